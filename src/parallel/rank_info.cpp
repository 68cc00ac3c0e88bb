// Rank discovery: the launcher (mpirun, a PMI launcher, srun, or none) leaves the rank layout in
// environment variables before MPI is initialised; reading them first lets the trainer pick its
// GPU and its backend before any communication exists.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "moe/comm.hpp"
#include "moe/error.hpp"

namespace moe {

namespace {

class Env {
 public:
  explicit Env(const EnvLookup& lookup) : lookup_(lookup) {}

  bool has(const char* name) const { return raw(name) != nullptr; }

  std::optional<int> get_int(const char* name) const {
    const char* s = raw(name);
    if (!s) return std::nullopt;
    errno = 0;
    char* end = nullptr;
    long v = std::strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || errno != 0 || v < 0 || v > 1 << 30)
      throw InputError(std::string("launcher environment: ") + name + "='" + s +
                       "' is not a non-negative integer");
    return static_cast<int>(v);
  }

  int require_int(const char* name, const char* because) const {
    std::optional<int> v = get_int(name);
    if (!v)
      throw InputError(std::string("launcher environment: ") + because + " but " + name +
                       " is not set");
    return *v;
  }

  const char* raw(const char* name) const {
    const char* s = lookup_(name);
    return s;
  }

 private:
  const EnvLookup& lookup_;
};

// SLURM's compressed tasks-per-node list, e.g. "2(x3),1" = nodes with 2, 2, 2, 1 tasks.
std::optional<int> tasks_on_node(const std::string& list, int node) {
  int index = 0;
  size_t pos = 0;
  while (pos < list.size()) {
    size_t comma = list.find(',', pos);
    std::string item =
        list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? list.size() : comma + 1;
    char* end = nullptr;
    long tasks = std::strtol(item.c_str(), &end, 10);
    long repeat = 1;
    if (end == item.c_str() || tasks < 0) return std::nullopt;
    if (*end == '(') {
      const char* rep = end + 1;
      if (*rep != 'x') return std::nullopt;
      repeat = std::strtol(rep + 1, &end, 10);
      if (end == rep + 1 || *end != ')' || repeat < 1) return std::nullopt;
      ++end;
    }
    if (*end != '\0') return std::nullopt;
    if (node < index + repeat) return static_cast<int>(tasks);
    index += static_cast<int>(repeat);
  }
  return std::nullopt;
}

void check_consistent(const RankInfo& r, const std::string& vars) {
  std::string bad;
  if (r.world < 1)
    bad = "the world size is 0";
  else if (r.rank >= r.world)
    bad = "rank " + std::to_string(r.rank) + " is not below the world size " +
          std::to_string(r.world);
  else if (r.local_world < 1 || r.local_rank >= r.local_world)
    bad = "local rank " + std::to_string(r.local_rank) + " is not below the local size " +
          std::to_string(r.local_world);
  else if (r.local_world > r.world)
    bad = "local size " + std::to_string(r.local_world) + " exceeds the world size " +
          std::to_string(r.world);
  if (!bad.empty())
    throw InputError("launcher environment (" + r.launcher + ": " + vars +
                     ") is inconsistent: " + bad);
}

// srun's local layout, when the SLURM variables are there.
bool slurm_local(const Env& env, RankInfo& r) {
  std::optional<int> local = env.get_int("SLURM_LOCALID");
  if (!local) return false;
  r.local_rank = *local;
  int node = env.get_int("SLURM_NODEID").value_or(0);
  std::optional<int> tasks;
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    if (const char* list = env.raw(name)) {
      tasks = tasks_on_node(list, node);
      if (!tasks)
        throw InputError(std::string("launcher environment: cannot read ") + name + "='" + list +
                         "' for node " + std::to_string(node));
      break;
    }
  }
  // Without a tasks-per-node list the local size is unknown: at least local rank + 1.
  r.local_world = tasks ? *tasks : *local + 1;
  return true;
}

}  // namespace

RankInfo detect_ranks(const EnvLookup& getenv) {
  Env env(getenv);
  RankInfo r;
  if (env.has("OMPI_COMM_WORLD_SIZE") || env.has("OMPI_COMM_WORLD_RANK")) {
    const char* why = "OMPI_COMM_WORLD_* is set (Open MPI's mpirun)";
    r.launcher = "mpirun (Open MPI)";
    r.world = env.require_int("OMPI_COMM_WORLD_SIZE", why);
    r.rank = env.require_int("OMPI_COMM_WORLD_RANK", why);
    r.local_world = env.require_int("OMPI_COMM_WORLD_LOCAL_SIZE", why);
    r.local_rank = env.require_int("OMPI_COMM_WORLD_LOCAL_RANK", why);
    check_consistent(r, "OMPI_COMM_WORLD_*");
  } else if (env.has("PMI_SIZE") || env.has("PMI_RANK")) {
    const char* why = "PMI_* is set (a PMI launcher: MPICH / Intel MPI mpiexec, srun --mpi=pmi2)";
    r.launcher = "PMI";
    r.world = env.require_int("PMI_SIZE", why);
    r.rank = env.require_int("PMI_RANK", why);
    if (env.has("MPI_LOCALRANKID")) {
      r.local_rank = env.require_int("MPI_LOCALRANKID", why);
      r.local_world = env.require_int("MPI_LOCALNRANKS", "MPI_LOCALRANKID is set");
    } else if (!slurm_local(env, r)) {
      r.local_rank = r.rank;  // no local layout given: one node
      r.local_world = r.world;
    }
    check_consistent(r, "PMI_*");
  } else if (env.has("SLURM_NTASKS")) {
    const char* why = "SLURM_NTASKS is set (srun)";
    r.launcher = "srun";
    r.world = env.require_int("SLURM_NTASKS", why);
    r.rank = env.require_int("SLURM_PROCID", why);
    if (!slurm_local(env, r)) env.require_int("SLURM_LOCALID", why);  // throws: not set
    check_consistent(r, "SLURM_*");
  }
  return r;
}

RankInfo detect_ranks() {
  return detect_ranks([](const char* name) -> const char* { return std::getenv(name); });
}

int pick_local_gpu(const RankInfo& info, int visible_gpus) {
  if (visible_gpus < 1)
    throw InputError("rank " + std::to_string(info.rank) + " sees no GPU (CUDA_VISIBLE_DEVICES='" +
                     std::string(std::getenv("CUDA_VISIBLE_DEVICES")
                                     ? std::getenv("CUDA_VISIBLE_DEVICES")
                                     : "<unset>") +
                     "')");
  if (visible_gpus == 1) return 0;  // the launcher bound one GPU to this rank
  if (info.local_rank < visible_gpus) return info.local_rank;
  throw InputError("rank " + std::to_string(info.rank) + " is local rank " +
                   std::to_string(info.local_rank) + " of " + std::to_string(info.local_world) +
                   " on its node, but only " + std::to_string(visible_gpus) +
                   " GPUs are visible: start at most " + std::to_string(visible_gpus) +
                   " ranks per node (one per GPU)");
}

}  // namespace moe
