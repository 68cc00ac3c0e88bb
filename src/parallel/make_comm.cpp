// make_comm: one rank -> SingleComm; several -> NcclComm for GPU tensors, MpiComm for CPU ones;
// a clear error when this build lacks the library a multi-rank launch needs.
#include <cmath>
#include <string>

#include "parallel/comm_impl.hpp"
#include "moe/error.hpp"

namespace moe {

namespace {

[[maybe_unused]] std::string launched_as(const RankInfo& info) {
  return "launched as rank " + std::to_string(info.rank) + " of " + std::to_string(info.world) +
         " (" + info.launcher + ")";
}

}  // namespace

std::unique_ptr<Comm> make_comm(const RankInfo& info, Device dev, double timeout_s) {
  if (!(timeout_s >= 0) || !std::isfinite(timeout_s))
    throw InputError("comm timeout must be a number of seconds >= 0 (0 = no timeout), got " +
                     std::to_string(timeout_s));
  if (info.world == 1) return dist::make_single_comm(info, dev, timeout_s);
  if (dev.type == DeviceType::cuda) {
#if defined(MOE_WITH_NCCL) && defined(MOE_WITH_MPI)
    return dist::make_nccl_comm(info, timeout_s);
#elif defined(MOE_WITH_NCCL)
    throw CommError(launched_as(info) +
                    ", but this build has no MPI to exchange the NCCL unique id: rebuild with "
                    "-DMOE_MPI=ON and an MPI library installed");
#else
    throw CommError(launched_as(info) +
                    ", but this build has no NCCL for multi-GPU training: rebuild with CUDA and "
                    "NCCL (nccl.h and libnccl found by CMake)");
#endif
  }
#ifdef MOE_WITH_MPI
  return dist::make_mpi_comm(info, timeout_s);
#else
  throw CommError(launched_as(info) +
                  ", but this build has no MPI: rebuild with -DMOE_MPI=ON and an MPI library "
                  "installed, or run a single process");
#endif
}

}  // namespace moe
