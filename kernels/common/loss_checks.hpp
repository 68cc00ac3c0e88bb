// Argument checks of the loss ops, shared by the CPU (kernels/cpu/loss.cpp) and CUDA
// (kernels/cuda/loss.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device (the CPU op also checks the targets' values).
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// targets: [N] i32 (the shape and dtype; not the values).
inline void check_loss_targets_args(const Tensor& targets, int64_t n, const char* op) {
  check_shape(targets, {n}, (std::string(op) + ": targets").c_str());
  MOE_CHECK(targets.dtype == DType::i32, std::string(op) + ": targets must be i32");
}

// losses, lse: [N] in acc_dtype(logits), logits: [N, V]; the targets are checked apart.
inline void check_cross_entropy_forward_args(const Tensor& losses, const Tensor& lse,
                                             const Tensor& logits) {
  MOE_CHECK(logits.ndim == 2,
            "cross_entropy_forward: logits must be [N, V], got " + logits.shape_str());
  const int64_t n = logits.size(0);
  check_shape(losses, {n}, "cross_entropy_forward: losses");
  check_shape(lse, {n}, "cross_entropy_forward: lse");
  check_acc_dtype(losses, logits, "cross_entropy_forward: losses");
  check_acc_dtype(lse, logits, "cross_entropy_forward: lse");
}

// dlogits, logits: [N, V] of one dtype, lse: [N] in acc_dtype(logits); targets checked apart.
inline void check_cross_entropy_backward_args(const Tensor& dlogits, const Tensor& logits,
                                              const Tensor& lse) {
  MOE_CHECK(logits.ndim == 2,
            "cross_entropy_backward: logits must be [N, V], got " + logits.shape_str());
  const int64_t n = logits.size(0), v = logits.size(1);
  check_shape(dlogits, {n, v}, "cross_entropy_backward: dlogits");
  check_shape(lse, {n}, "cross_entropy_backward: lse");
  check_same_dtype(dlogits, logits, "cross_entropy_backward: dlogits, logits");
  check_acc_dtype(lse, logits, "cross_entropy_backward: lse");
}

// Both of the above (cross_entropy_forward_backward).
inline void check_cross_entropy_forward_backward_args(const Tensor& losses, const Tensor& lse,
                                                      const Tensor& dlogits, const Tensor& logits) {
  check_cross_entropy_forward_args(losses, lse, logits);
  check_cross_entropy_backward_args(dlogits, logits, lse);
}

// loss: [1], logits, targets: [N], one dtype.
inline void check_bce_with_logits_forward_args(const Tensor& loss, const Tensor& logits,
                                               const Tensor& targets) {
  MOE_CHECK(logits.ndim == 1,
            "bce_with_logits_forward: logits must be [N], got " + logits.shape_str());
  check_shape(loss, {1}, "bce_with_logits_forward: loss");
  check_shape(targets, {logits.size(0)}, "bce_with_logits_forward: targets");
  check_same_dtype(loss, logits, "bce_with_logits_forward: loss, logits");
  check_same_dtype(targets, logits, "bce_with_logits_forward: targets, logits");
}

// dlogits, logits, targets: [N], one dtype.
inline void check_bce_with_logits_backward_args(const Tensor& dlogits, const Tensor& logits,
                                                const Tensor& targets) {
  MOE_CHECK(logits.ndim == 1,
            "bce_with_logits_backward: logits must be [N], got " + logits.shape_str());
  check_shape(dlogits, {logits.size(0)}, "bce_with_logits_backward: dlogits");
  check_shape(targets, {logits.size(0)}, "bce_with_logits_backward: targets");
  check_same_dtype(dlogits, logits, "bce_with_logits_backward: dlogits, logits");
  check_same_dtype(targets, logits, "bce_with_logits_backward: targets, logits");
}

}  // namespace moe
