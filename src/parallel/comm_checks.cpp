// The Comm contract, checked the same way by every backend before it moves a byte: a size or
// device mismatch is a bug in the caller (InternalError), never a hang or a silent truncation.
#include <string>

#include "parallel/comm_impl.hpp"
#include "moe/error.hpp"

namespace moe::dist {

namespace {

std::string where(const char* op, const char* arg) {
  return std::string(op) + ": " + arg;
}

const char* byte_begin(const Tensor& t) {
  return static_cast<const char*>(t.data);
}
const char* byte_end(const Tensor& t) {
  return byte_begin(t) + t.nbytes();
}

bool overlap(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  return byte_begin(a) < byte_end(b) && byte_begin(b) < byte_end(a);
}

// Whether `part` is exactly chunk `index` (of part's size) of `whole`.
bool is_chunk(const Tensor& part, const Tensor& whole, int index) {
  return byte_begin(part) == byte_begin(whole) + static_cast<size_t>(index) * part.nbytes();
}

}  // namespace

void check_tensor(const Comm& comm, const Tensor& t, const char* op, const char* arg,
                  bool (*accepts)(DType, DTypeUse), DTypeUse use) {
  if (t.device != comm.device())
    throw InternalError(where(op, arg) + " is on " + t.device.str() + ", but this " +
                        comm.backend() + " comm works on " + comm.device().str() + " tensors");
  if (!accepts(t.dtype, use))
    throw InternalError(where(op, arg) + ": dtype " + dtype_name(t.dtype) +
                        " is not supported by " + comm.backend() + " comm for " +
                        (use == DTypeUse::reduce ? "reductions" : "data movement"));
  if (t.data == nullptr && t.numel() != 0)
    throw InternalError(where(op, arg) + ": null data for " + t.shape_str() + " tensor");
}

bool check_reduce_scatter(const Comm& comm, const Tensor& out, const Tensor& in, const char* op) {
  check_same_dtype(out, in, op);
  if (in.numel() != out.numel() * comm.world())
    throw InternalError(std::string(op) + ": in has " + std::to_string(in.numel()) +
                        " elements, expected world (" + std::to_string(comm.world()) + ") x out (" +
                        std::to_string(out.numel()) + ")");
  if (!overlap(out, in)) return false;
  if (is_chunk(out, in, comm.rank())) return true;
  throw InternalError(std::string(op) + ": out overlaps in but is not chunk " +
                      std::to_string(comm.rank()) + " of it");
}

bool check_all_gather(const Comm& comm, const Tensor& out, const Tensor& in, const char* op) {
  check_same_dtype(out, in, op);
  if (out.numel() != in.numel() * comm.world())
    throw InternalError(std::string(op) + ": out has " + std::to_string(out.numel()) +
                        " elements, expected world (" + std::to_string(comm.world()) + ") x in (" +
                        std::to_string(in.numel()) + ")");
  if (!overlap(out, in)) return false;
  if (is_chunk(in, out, comm.rank())) return true;
  throw InternalError(std::string(op) + ": in overlaps out but is not chunk " +
                      std::to_string(comm.rank()) + " of it");
}

AllToAllPlan check_all_to_all_v(const Comm& comm, const Tensor& out,
                                const std::vector<int64_t>& out_counts, const Tensor& in,
                                const std::vector<int64_t>& in_counts, const char* op) {
  check_same_dtype(out, in, op);
  if (out.ndim < 1 || in.ndim < 1)
    throw InternalError(std::string(op) + ": out and in need a row dimension (dim 0)");
  const auto world = static_cast<size_t>(comm.world());
  if (out_counts.size() != world || in_counts.size() != world)
    throw InternalError(std::string(op) + ": " + std::to_string(out_counts.size()) + " out and " +
                        std::to_string(in_counts.size()) + " in counts for world " +
                        std::to_string(world));
  AllToAllPlan plan;
  for (int i = 1; i < in.ndim; ++i) plan.row_elems *= in.shape[i];
  int64_t out_row = 1;
  for (int i = 1; i < out.ndim; ++i) out_row *= out.shape[i];
  if (out_row != plan.row_elems)
    throw InternalError(std::string(op) + ": rows of out " + out.shape_str() + " and in " +
                        in.shape_str() + " differ in size");
  plan.send_offsets.resize(world);
  plan.recv_offsets.resize(world);
  int64_t sent = 0, received = 0;
  for (size_t p = 0; p < world; ++p) {
    if (in_counts[p] < 0 || out_counts[p] < 0)
      throw InternalError(std::string(op) + ": negative count for peer " + std::to_string(p));
    plan.send_offsets[p] = sent;
    plan.recv_offsets[p] = received;
    sent += in_counts[p];
    received += out_counts[p];
  }
  if (sent != in.shape[0] || received != out.shape[0])
    throw InternalError(std::string(op) + ": counts sum to " + std::to_string(sent) +
                        " rows in / " + std::to_string(received) + " rows out, tensors have " +
                        std::to_string(in.shape[0]) + " / " + std::to_string(out.shape[0]));
  if (overlap(out, in)) throw InternalError(std::string(op) + ": out and in overlap");
  return plan;
}

void check_root(const Comm& comm, int root, const char* op) {
  if (root < 0 || root >= comm.world())
    throw InternalError(std::string(op) + ": root " + std::to_string(root) + " outside world " +
                        std::to_string(comm.world()));
}

}  // namespace moe::dist
