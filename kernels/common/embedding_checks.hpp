// Argument checks of the embedding ops, shared by the CPU (kernels/cpu/embedding.cpp) and CUDA
// (kernels/cuda/embedding.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device (the CPU op also checks the ids' values).
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// ids: [N] i32 (the shape and dtype; not the values).
inline void check_embedding_ids_args(const Tensor& ids, int64_t n, const char* op) {
  MOE_CHECK(ids.dtype == DType::i32,
            std::string(op) + ": ids must be i32, got " + dtype_name(ids.dtype));
  check_shape(ids, {n}, (std::string(op) + ": ids").c_str());
}

// out: [N, d], ids: [N], table: [V, d]; the ids themselves are checked apart.
inline void check_embedding_forward_args(const Tensor& out, const Tensor& ids,
                                         const Tensor& table) {
  MOE_CHECK(table.ndim == 2, "embedding_forward: table must be [V, d], got " + table.shape_str());
  const int64_t d = table.size(1), n = ids.numel();
  check_shape(out, {n, d}, "embedding_forward: out");
  check_same_dtype(out, table, "embedding_forward: out, table");
}

// dtable: [V, d] in acc_dtype(dout), dout: [N, d], ids: [N]; the ids themselves are checked apart.
inline void check_embedding_backward_args(const Tensor& dtable, const Tensor& dout,
                                          const Tensor& ids) {
  MOE_CHECK(dtable.ndim == 2,
            "embedding_backward: dtable must be [V, d], got " + dtable.shape_str());
  const int64_t d = dtable.size(1), n = ids.numel();
  check_shape(dout, {n, d}, "embedding_backward: dout");
  check_acc_dtype(dtable, dout, "embedding_backward: dtable");
}

}  // namespace moe
