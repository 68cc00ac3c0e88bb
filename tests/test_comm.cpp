// The communication layer in one process: rank discovery from fake launcher environments (Open
// MPI, PMI, srun, none, broken ones), the GPU a local rank picks, SingleComm's semantics and
// contract checks, and the watchdog (in a forked child, since firing ends the process).
// The multi-rank collectives are tested under mpirun by tests/mpi/.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "parallel/queued_deadlines.hpp"
#include "parallel/watchdog.hpp"
#include "moe/comm.hpp"
#include "moe/error.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

using FakeEnv = std::map<std::string, std::string>;

RankInfo detect(const FakeEnv& env) {
  return detect_ranks([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return "";
}

const FakeEnv kOmpi = {{"OMPI_COMM_WORLD_RANK", "5"},
                       {"OMPI_COMM_WORLD_SIZE", "8"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};

}  // namespace

TEST_CASE("detect_ranks: no launcher is a single process") {
  RankInfo r = detect({{"HOME", "/root"}, {"SLURM_PROCID", "3"}});  // SLURM_NTASKS unset
  CHECK(r.rank == 0);
  CHECK(r.world == 1);
  CHECK(r.local_rank == 0);
  CHECK(r.local_world == 1);
  CHECK(r.launcher == "single");
}

TEST_CASE("detect_ranks: Open MPI's mpirun") {
  RankInfo r = detect(kOmpi);
  CHECK(r.rank == 5);
  CHECK(r.world == 8);
  CHECK(r.local_rank == 1);
  CHECK(r.local_world == 4);
  CHECK(r.launcher == "mpirun (Open MPI)");

  // mpirun inside a SLURM allocation: mpirun's variables win over the allocation's
  FakeEnv both = kOmpi;
  both.insert({{"SLURM_NTASKS", "16"}, {"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
  CHECK(detect(both).world == 8);
}

TEST_CASE("detect_ranks: PMI launchers") {
  RankInfo r = detect(
      {{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  CHECK(r.rank == 3);
  CHECK(r.world == 4);
  CHECK(r.local_rank == 1);
  CHECK(r.local_world == 2);
  CHECK(r.launcher == "PMI");

  // srun --mpi=pmi2: the local layout comes from SLURM
  r = detect({{"PMI_RANK", "6"},
              {"PMI_SIZE", "8"},
              {"SLURM_NTASKS", "8"},
              {"SLURM_PROCID", "6"},
              {"SLURM_LOCALID", "2"},
              {"SLURM_NODEID", "1"},
              {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}});
  CHECK(r.rank == 6);
  CHECK(r.local_rank == 2);
  CHECK(r.local_world == 4);

  // no local layout at all: one node
  r = detect({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}});
  CHECK(r.local_rank == 2);
  CHECK(r.local_world == 3);
}

TEST_CASE("detect_ranks: srun") {
  FakeEnv env = {{"SLURM_NTASKS", "7"},
                 {"SLURM_PROCID", "6"},
                 {"SLURM_LOCALID", "0"},
                 {"SLURM_NODEID", "3"},
                 {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}};
  RankInfo r = detect(env);
  CHECK(r.rank == 6);
  CHECK(r.world == 7);
  CHECK(r.local_rank == 0);
  CHECK(r.local_world == 1);
  CHECK(r.launcher == "srun");

  env["SLURM_NODEID"] = "1";
  env["SLURM_PROCID"] = "3";
  env["SLURM_LOCALID"] = "1";
  CHECK(detect(env).local_world == 2);

  // the allocation's list when the step's is missing; no list: at least local rank + 1
  env.erase("SLURM_STEP_TASKS_PER_NODE");
  env["SLURM_TASKS_PER_NODE"] = "3,2,2";
  CHECK(detect(env).local_world == 2);
  env.erase("SLURM_TASKS_PER_NODE");
  CHECK(detect(env).local_world == 2);
}

TEST_CASE("detect_ranks: broken environments are clear errors") {
  FakeEnv env = kOmpi;
  env.erase("OMPI_COMM_WORLD_LOCAL_RANK");
  CHECK_THAT(error_of<InputError>([&] { detect(env); }),
             Catch::Contains("OMPI_COMM_WORLD_LOCAL_RANK is not set"));

  env = kOmpi;
  env["OMPI_COMM_WORLD_RANK"] = "8";
  std::string msg = error_of<InputError>([&] { detect(env); });
  CHECK_THAT(msg, Catch::Contains("inconsistent"));
  CHECK_THAT(msg, Catch::Contains("rank 8 is not below the world size 8"));

  env = kOmpi;
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "9";
  CHECK_THAT(error_of<InputError>([&] { detect(env); }),
             Catch::Contains("local size 9 exceeds the world size 8"));

  env = kOmpi;
  env["OMPI_COMM_WORLD_SIZE"] = "eight";
  CHECK_THAT(error_of<InputError>([&] { detect(env); }),
             Catch::Contains("OMPI_COMM_WORLD_SIZE='eight' is not a non-negative integer"));
  env["OMPI_COMM_WORLD_SIZE"] = "-1";
  CHECK_THROWS_AS(detect(env), InputError);
  env["OMPI_COMM_WORLD_SIZE"] = "";
  CHECK_THROWS_AS(detect(env), InputError);

  CHECK_THAT(error_of<InputError>([&] {
               detect({{"SLURM_NTASKS", "4"}});
             }),
             Catch::Contains("SLURM_PROCID is not set"));
  CHECK_THAT(error_of<InputError>([&] {
               detect({{"SLURM_NTASKS", "4"}, {"SLURM_PROCID", "1"}});
             }),
             Catch::Contains("SLURM_LOCALID is not set"));
  CHECK_THAT(error_of<InputError>([&] {
               detect({{"SLURM_NTASKS", "4"},
                       {"SLURM_PROCID", "1"},
                       {"SLURM_LOCALID", "1"},
                       {"SLURM_TASKS_PER_NODE", "2(y2)"}});
             }),
             Catch::Contains("cannot read SLURM_TASKS_PER_NODE='2(y2)'"));
  CHECK_THAT(error_of<InputError>([&] {
               detect({{"SLURM_NTASKS", "4"},
                       {"SLURM_PROCID", "1"},
                       {"SLURM_LOCALID", "3"},
                       {"SLURM_TASKS_PER_NODE", "2(x2)"}});
             }),
             Catch::Contains("local rank 3 is not below the local size 2"));
  CHECK_THAT(error_of<InputError>([&] {
               detect({{"PMI_SIZE", "0"}, {"PMI_RANK", "0"}});
             }),
             Catch::Contains("the world size is 0"));
  CHECK_THAT(error_of<InputError>([&] {
               detect({{"PMI_SIZE", "2"}, {"PMI_RANK", "0"}, {"MPI_LOCALRANKID", "0"}});
             }),
             Catch::Contains("MPI_LOCALNRANKS is not set"));
}

TEST_CASE("pick_local_gpu: local rank, or the one GPU the launcher bound") {
  RankInfo r = detect(kOmpi);  // local rank 1 of 4
  CHECK(pick_local_gpu(r, 4) == 1);
  CHECK(pick_local_gpu(r, 8) == 1);
  CHECK(pick_local_gpu(r, 1) == 0);
  r.local_rank = 3;
  CHECK_THAT(error_of<InputError>([&] { pick_local_gpu(r, 2); }),
             Catch::Contains("only 2 GPUs are visible"));
  CHECK_THROWS_AS(pick_local_gpu(r, 0), InputError);
}

TEST_CASE("make_comm: one rank is SingleComm; bad timeouts are input errors") {
  std::unique_ptr<Comm> comm = make_comm(RankInfo{}, Device{}, 5.0);
  CHECK(std::string(comm->backend()) == "single");
  CHECK(comm->rank() == 0);
  CHECK(comm->world() == 1);
  CHECK(comm->local_rank() == 0);
  CHECK(comm->device() == Device{});
  CHECK(comm->timeout_s() == 5.0);
  CHECK_THROWS_AS(make_comm(RankInfo{}, Device{}, -1.0), InputError);
  CHECK_THROWS_AS(make_comm(RankInfo{}, Device{}, std::nan("")), InputError);
#ifndef MOE_WITH_MPI
  RankInfo two;
  two.world = 2;
  two.local_world = 2;
  CHECK_THAT(error_of<CommError>([&] { make_comm(two, Device{}, 5.0); }),
             Catch::Contains("this build has no MPI"));
#endif
}

TEST_CASE("SingleComm: collectives over one rank") {
  std::unique_ptr<Comm> comm = make_comm(RankInfo{}, Device{}, 0.0);
  Buf<float> a({2, 3});
  fill_uniform(a, 1, 0.5, 1.5);
  const std::vector<float> before = a.v;

  comm->all_reduce_sum(a);
  CHECK(a.v == before);
  comm->reduce_sum(a, 0);
  CHECK(a.v == before);
  comm->broadcast(a, 0);
  CHECK(a.v == before);
  comm->barrier();
  comm->set_stream(nullptr);

  Buf<float> out({6});
  comm->reduce_scatter_sum(out, a);
  CHECK(out.v == before);
  comm->reduce_scatter_sum(a, a);  // in place
  CHECK(a.v == before);

  Buf<float> gathered({2, 3});
  comm->all_gather(gathered, a);
  CHECK(gathered.v == before);

  Buf<int32_t> rows({3, 2}), got({3, 2});
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(7 * i + 1);
  comm->all_to_all_v(got, {3}, rows, {3});
  CHECK(got.v == rows.v);
  Buf<int32_t> none({0, 2}), none_out({0, 2});
  comm->all_to_all_v(none_out, {0}, none, {0});
}

TEST_CASE("SingleComm: contract violations are InternalErrors, not hangs") {
  std::unique_ptr<Comm> comm = make_comm(RankInfo{}, Device{}, 0.0);
  Buf<float> a({4}), b({3});
  Buf<double> d({4});
  CHECK_THROWS_AS(comm->reduce_scatter_sum(b, a), InternalError);
  CHECK_THROWS_AS(comm->all_gather(b, a), InternalError);
  CHECK_THROWS_AS(comm->all_gather(d, a), InternalError);  // dtype
  CHECK_THROWS_AS(comm->broadcast(a, 1), InternalError);
  CHECK_THROWS_AS(comm->broadcast(a, -1), InternalError);
  CHECK_THROWS_AS(comm->reduce_sum(a, 1), InternalError);  // root outside the world

  Buf<float> rows({4, 2}), out({4, 2}), wide({4, 3});
  CHECK_THROWS_AS(comm->all_to_all_v(out, {3}, rows, {4}), InternalError);     // out rows
  CHECK_THROWS_AS(comm->all_to_all_v(out, {4, 0}, rows, {4}), InternalError);  // world 1
  CHECK_THROWS_AS(comm->all_to_all_v(out, {-4}, rows, {-4}), InternalError);
  CHECK_THROWS_AS(comm->all_to_all_v(wide, {4}, rows, {4}), InternalError);  // row size
  CHECK_THROWS_AS(comm->all_to_all_v(rows, {4}, rows, {4}), InternalError);  // overlap

  Tensor on_gpu = a;
  on_gpu.device = Device{DeviceType::cuda, 0};
  CHECK_THAT(error_of<InternalError>([&] { comm->all_reduce_sum(on_gpu); }),
             Catch::Contains("is on cuda:0"));
  Tensor null_data(nullptr, DType::f32, Device{}, {4});
  CHECK_THROWS_AS(comm->all_reduce_sum(null_data), InternalError);
}

TEST_CASE("Watchdog: the timeout line") {
  CHECK(dist::timeout_line(3, "all_reduce_sum", 600) ==
        "moe-train: rank 3: all_reduce_sum did not complete within 600 s (a peer rank died or "
        "hangs); aborting");
  CHECK_THAT(dist::timeout_line(0, "barrier", 0.5), Catch::Contains("within 0.5 s"));
}

namespace {

struct ChildResult {
  int exit_code = -1;
  std::string stderr_text;
  double seconds = 0;
};

// Runs `body` in a forked child with stderr captured; the child ends with _exit(0) if body returns.
template <class F>
ChildResult run_child(F&& body) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDERR_FILENO);
    body();
    _exit(0);
  }
  close(fds[1]);
  ChildResult r;
  char buf[512];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) r.stderr_text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace

TEST_CASE("Watchdog: a call past its deadline prints one line and aborts") {
  ChildResult r = run_child([] {
    dist::Watchdog dog(2, 0.3, [] { _exit(7); });
    auto guard = dog.watch("all_to_all_v");
    std::this_thread::sleep_for(std::chrono::seconds(20));  // the "hung" collective
  });
  CHECK(r.exit_code == 7);
  CHECK(r.stderr_text ==
        "moe-train: rank 2: all_to_all_v did not complete within 0.3 s (a peer rank died or "
        "hangs); aborting\n");
  CHECK(r.seconds < 5);
}

TEST_CASE("Watchdog: calls that finish in time, and disarmed waits, never fire") {
  ChildResult r = run_child([] {
    dist::Watchdog dog(0, 0.3, [] { _exit(7); });
    for (int i = 0; i < 5; ++i) {
      auto guard = dog.watch("barrier");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(800));  // disarmed: no deadline
    dist::Watchdog off(0, 0.0, [] { _exit(8); });                 // timeout 0: off
    auto guard = off.watch("barrier");
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  });
  CHECK(r.exit_code == 0);
  CHECK(r.stderr_text.empty());
}

TEST_CASE("Watchdog: the poll hook reports asynchronous failures") {
  ChildResult r = run_child([] {
    int polls = 0;
    dist::Watchdog dog(
        1, 0.0, [] { _exit(9); },
        [&polls]() -> std::string {
          return ++polls < 3 ? ""
                             : "moe-train: rank 1: NCCL error: remote process exited; aborting";
        });
    std::this_thread::sleep_for(std::chrono::seconds(20));
  });
  CHECK(r.exit_code == 9);
  CHECK(r.stderr_text == "moe-train: rank 1: NCCL error: remote process exited; aborting\n");
  CHECK(r.seconds < 5);
}

namespace {

// Fake events for QueuedDeadlines: a handle is an index into `state`.
struct FakeEvents {
  std::vector<dist::QueuedDeadlines::EventState> state;
  void* make() {
    state.push_back(dist::QueuedDeadlines::EventState::pending);
    return reinterpret_cast<void*>(state.size());  // 1-based: never nullptr
  }
  dist::QueuedDeadlines::EventState& at(void* e) {
    return state.at(reinterpret_cast<size_t>(e) - 1);
  }
  dist::QueuedDeadlines::Query query() {
    return [this](void* e, std::string* error) {
      if (at(e) == dist::QueuedDeadlines::EventState::failed) *error = "an illegal memory access";
      return at(e);
    };
  }
};

}  // namespace

TEST_CASE("QueuedDeadlines: the clock starts when the stream reaches the collective") {
  using QD = dist::QueuedDeadlines;
  using std::chrono::seconds;
  FakeEvents ev;
  QD q(10.0);
  void* s1 = ev.make();
  void* e1 = ev.make();
  void* s2 = ev.make();
  void* e2 = ev.make();
  q.push("all_reduce_sum", s1, e1);
  q.push("all_gather", s2, e2);
  std::vector<void*> released;
  const QD::Clock::time_point t0{};
  // Queued behind a minute of compute: the start event is pending, so no deadline runs.
  CHECK(q.check(t0 + seconds(60), ev.query(), 3, &released).empty());
  ev.at(s1) = QD::EventState::done;  // the stream reaches the all-reduce
  CHECK(q.check(t0 + seconds(61), ev.query(), 3, &released).empty());  // clock starts here
  CHECK(q.check(t0 + seconds(70), ev.query(), 3, &released).empty());  // 9 s in
  // It finishes; the all-gather behind it has not started (its start event is pending), so the
  // time already spent queued does not count against it either.
  ev.at(e1) = QD::EventState::done;
  CHECK(q.check(t0 + seconds(200), ev.query(), 3, &released).empty());
  CHECK(released == std::vector<void*>{s1, e1});
  CHECK(q.size() == 1);
  ev.at(s2) = QD::EventState::done;
  CHECK(q.check(t0 + seconds(201), ev.query(), 3, &released).empty());
  CHECK(q.check(t0 + seconds(210), ev.query(), 3, &released).empty());
  // 10 s after the stream reached it, it has not completed: a peer holds it up.
  CHECK(q.check(t0 + seconds(211), ev.query(), 3, &released) ==
        dist::timeout_line(3, "all_gather", 10.0));
  CHECK(q.events() == std::vector<void*>{s2, e2});
}

TEST_CASE("QueuedDeadlines: finished collectives are dropped, failures reported") {
  using QD = dist::QueuedDeadlines;
  FakeEvents ev;
  QD q(5.0);
  std::vector<void*> released;
  for (int i = 0; i < 3; ++i) {
    void* s = ev.make();
    void* e = ev.make();
    q.push("broadcast", s, e);
    ev.at(s) = ev.at(e) = QD::EventState::done;
  }
  CHECK(q.check(QD::Clock::time_point{}, ev.query(), 0, &released).empty());
  CHECK(q.empty());
  CHECK(released.size() == 6);
  void* s = ev.make();
  void* e = ev.make();
  q.push("reduce_scatter_sum", s, e);
  ev.at(s) = QD::EventState::failed;
  CHECK(q.check(QD::Clock::time_point{}, ev.query(), 1, &released) ==
        "moe-train: rank 1: reduce_scatter_sum failed on the GPU: an illegal memory access; "
        "aborting");
}
