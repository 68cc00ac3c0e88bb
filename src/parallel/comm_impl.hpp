// Shared by the Comm implementations in src/parallel/: argument checks (every backend enforces the
// same contract, see include/moe/comm.hpp), the device-aware byte copy, and the factories that
// make_comm() chooses between.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe/comm.hpp"

namespace moe::dist {

// Which dtypes a backend accepts for an operation.
enum class DTypeUse { reduce, move };

// Every tensor of a call: on comm.device(), of a dtype `accepts` allows, non-null unless empty.
void check_tensor(const Comm& comm, const Tensor& t, const char* op, const char* arg,
                  bool (*accepts)(DType, DTypeUse), DTypeUse use);

// in = [world * n], out = [n], same dtype. Returns whether out is chunk `rank` of in (in place);
// any other overlap throws.
bool check_reduce_scatter(const Comm& comm, const Tensor& out, const Tensor& in, const char* op);
// out = [world * n], in = [n], same dtype. Returns whether in is chunk `rank` of out (in place).
bool check_all_gather(const Comm& comm, const Tensor& out, const Tensor& in, const char* op);

// The row layout of one all_to_all_v call, in rows of dim 0 (offsets are prefix sums).
struct AllToAllPlan {
  int64_t row_elems = 1;  // elements in one row (dims 1..)
  std::vector<int64_t> send_offsets, recv_offsets;
};
AllToAllPlan check_all_to_all_v(const Comm& comm, const Tensor& out,
                                const std::vector<int64_t>& out_counts, const Tensor& in,
                                const std::vector<int64_t>& in_counts, const char* op);

void check_root(const Comm& comm, int root, const char* op);

// memmove on the CPU; on a GPU an asynchronous device-to-device copy on `stream`.
void copy_bytes(Device dev, void* dst, const void* src, size_t bytes, void* stream);

// Factories behind make_comm().
std::unique_ptr<Comm> make_single_comm(const RankInfo& info, Device dev, double timeout_s);
#ifdef MOE_WITH_MPI
std::unique_ptr<Comm> make_mpi_comm(const RankInfo& info, double timeout_s);
#endif
#if defined(MOE_WITH_NCCL) && defined(MOE_WITH_MPI)
std::unique_ptr<Comm> make_nccl_comm(const RankInfo& info, double timeout_s);
#endif

}  // namespace moe::dist
