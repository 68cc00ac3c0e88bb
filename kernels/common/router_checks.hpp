// Argument checks of the router ops, shared by the CPU (kernels/cpu/router.cpp) and CUDA
// (kernels/cuda/router.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// probs: [N, E], topk_idx / topk_w: [N, K], counts: [E] i32, logits: [N, E], bias: [E] or empty.
inline void check_router_topk_forward_args(const Tensor& probs, const Tensor& topk_idx,
                                           const Tensor& topk_w, const Tensor& counts,
                                           const Tensor& logits, const Tensor& bias) {
  MOE_CHECK(logits.ndim == 2,
            "router_topk_forward: logits must be [N, E], got " + logits.shape_str());
  MOE_CHECK(topk_idx.ndim == 2,
            "router_topk_forward: topk_idx must be [N, K], got " + topk_idx.shape_str());
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1), k = topk_idx.size(1);
  MOE_CHECK(k >= 1 && k <= n_exp, "router_topk_forward: K = " + std::to_string(k) +
                                      " outside [1, E = " + std::to_string(n_exp) + "]");
  check_shape(probs, {n_tok, n_exp}, "router_topk_forward: probs");
  check_shape(topk_idx, {n_tok, k}, "router_topk_forward: topk_idx");
  check_shape(topk_w, {n_tok, k}, "router_topk_forward: topk_w");
  check_shape(counts, {n_exp}, "router_topk_forward: counts");
  check_same_dtype(probs, logits, "router_topk_forward: probs, logits");
  check_same_dtype(topk_w, logits, "router_topk_forward: topk_w, logits");
  MOE_CHECK(topk_idx.dtype == DType::i32 && counts.dtype == DType::i32,
            "router_topk_forward: topk_idx and counts must be i32");
  if (!bias.empty()) {
    check_shape(bias, {n_exp}, "router_topk_forward: bias");
    check_same_dtype(bias, logits, "router_topk_forward: bias, logits");
  }
}

inline void check_router_topk_backward_args(const Tensor& dlogits, const Tensor& dtopk_w,
                                            const Tensor& probs, const Tensor& topk_idx) {
  MOE_CHECK(probs.ndim == 2 && topk_idx.ndim == 2,
            "router_topk_backward: probs must be [N, E] and topk_idx [N, K], got " +
                probs.shape_str() + " and " + topk_idx.shape_str());
  const int64_t n_tok = probs.size(0), n_exp = probs.size(1), k = topk_idx.size(1);
  check_shape(dlogits, {n_tok, n_exp}, "router_topk_backward: dlogits");
  check_shape(dtopk_w, {n_tok, k}, "router_topk_backward: dtopk_w");
  check_shape(topk_idx, {n_tok, k}, "router_topk_backward: topk_idx");
  check_same_dtype(dlogits, probs, "router_topk_backward: dlogits, probs");
  check_same_dtype(dtopk_w, probs, "router_topk_backward: dtopk_w, probs");
  MOE_CHECK(topk_idx.dtype == DType::i32, "router_topk_backward: topk_idx must be i32");
}

// Shared shape checks of the aux-loss pair.  logits, probs: [N, E], counts: [E] i32
inline void check_router_aux_args(const Tensor& logits, const Tensor& probs, const Tensor& counts,
                                  int k, const char* op) {
  MOE_CHECK(logits.ndim == 2,
            std::string(op) + ": logits must be [N, E], got " + logits.shape_str());
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  check_shape(probs, {n_tok, n_exp}, (std::string(op) + ": probs").c_str());
  check_shape(counts, {n_exp}, (std::string(op) + ": counts").c_str());
  check_same_dtype(probs, logits, (std::string(op) + ": probs, logits").c_str());
  MOE_CHECK(counts.dtype == DType::i32, std::string(op) + ": counts must be i32");
  MOE_CHECK(k >= 1 && k <= n_exp, std::string(op) + ": k = " + std::to_string(k) +
                                      " outside [1, E = " + std::to_string(n_exp) + "]");
}

// losses: [2]
inline void check_router_aux_loss_forward_args(const Tensor& losses, const Tensor& logits,
                                               const Tensor& probs, const Tensor& counts, int k) {
  check_router_aux_args(logits, probs, counts, k, "router_aux_loss_forward");
  check_shape(losses, {2}, "router_aux_loss_forward: losses");
  check_same_dtype(losses, logits, "router_aux_loss_forward: losses, logits");
}

inline void check_router_aux_loss_backward_args(const Tensor& dlogits, const Tensor& logits,
                                                const Tensor& probs, const Tensor& counts, int k) {
  check_router_aux_args(logits, probs, counts, k, "router_aux_loss_backward");
  check_shape(dlogits, {logits.size(0), logits.size(1)}, "router_aux_loss_backward: dlogits");
  check_same_dtype(dlogits, logits, "router_aux_loss_backward: dlogits, logits");
}

// bias, load: [E]
inline void check_router_bias_update_args(const Tensor& bias, const Tensor& load) {
  MOE_CHECK(bias.ndim == 1, "router_bias_update: bias must be [E], got " + bias.shape_str());
  check_shape(load, {bias.size(0)}, "router_bias_update: load");
  check_same_dtype(load, bias, "router_bias_update: load, bias");
}

// acc: [E] f32 or f64, counts: [E] i32
inline void check_add_counts_args(const Tensor& acc, const Tensor& counts) {
  MOE_CHECK(acc.ndim == 1, "add_counts: acc must be [E], got " + acc.shape_str());
  check_shape(counts, {acc.size(0)}, "add_counts: counts");
  MOE_CHECK(acc.dtype == DType::f32 || acc.dtype == DType::f64,
            std::string("add_counts: acc must be f32 or f64, got ") + dtype_name(acc.dtype));
  MOE_CHECK(counts.dtype == DType::i32,
            std::string("add_counts: counts must be i32, got ") + dtype_name(counts.dtype));
}

// ---- router_logits ------------------------------------------------------------------------------

// Every tensor of a router_logits call on the op's device (`op_device`: ctx.device), so a host
// tensor handed to the CUDA op (or the reverse) fails here with its name, not inside a kernel.
inline void check_router_logits_device(const Tensor& t, const Device& op_device, const char* op,
                                       const char* name) {
  MOE_CHECK(t.device == op_device, std::string(op) + ": " + name + " is on " + t.device.str() +
                                       ", the op runs on " + op_device.str());
}

// x: [N, d] f32 / f64 / f16 / bf16, w: [E, d] in acc_dtype(x). Returns {N, d, E}.
struct RouterLogitsDims {
  int64_t n, d, e;
};
inline RouterLogitsDims router_logits_dims(const Tensor& x, const Tensor& w, const char* op) {
  MOE_CHECK(x.ndim == 2, std::string(op) + ": x must be [N, d], got " + x.shape_str());
  MOE_CHECK(w.ndim == 2, std::string(op) + ": w must be [E, d], got " + w.shape_str());
  MOE_CHECK(x.dtype != DType::i32,
            std::string(op) + ": x must be f32, f64, f16 or bf16, got " + dtype_name(x.dtype));
  MOE_CHECK(w.size(1) == x.size(1), std::string(op) + ": x " + x.shape_str() + " and w " +
                                        w.shape_str() + " disagree on d");
  check_acc_dtype(w, x, (std::string(op) + ": w").c_str());
  return {x.size(0), x.size(1), w.size(0)};
}

// logits: [N, E] in acc_dtype(x), x: [N, d], w: [E, d] in acc_dtype(x), all on `op_device`.
inline RouterLogitsDims check_router_logits_forward_args(const Tensor& logits, const Tensor& x,
                                                         const Tensor& w, const Device& op_device) {
  constexpr const char* op = "router_logits_forward";
  const RouterLogitsDims s = router_logits_dims(x, w, op);
  check_shape(logits, {s.n, s.e}, "router_logits_forward: logits");
  check_acc_dtype(logits, x, "router_logits_forward: logits");
  check_router_logits_device(logits, op_device, op, "logits");
  check_router_logits_device(x, op_device, op, "x");
  check_router_logits_device(w, op_device, op, "w");
  return s;
}

// dx: [N, d] of x's dtype, dw: [E, d] and dlogits: [N, E] in acc_dtype(x), x: [N, d],
// w: [E, d] in acc_dtype(x), all on `op_device`.
inline RouterLogitsDims check_router_logits_backward_args(const Tensor& dx, const Tensor& dw,
                                                          const Tensor& dlogits, const Tensor& x,
                                                          const Tensor& w,
                                                          const Device& op_device) {
  constexpr const char* op = "router_logits_backward";
  const RouterLogitsDims s = router_logits_dims(x, w, op);
  if (!dx.empty()) {  // empty: no dx wanted
    check_shape(dx, {s.n, s.d}, "router_logits_backward: dx");
    check_same_dtype(dx, x, "router_logits_backward: dx, x");
    check_router_logits_device(dx, op_device, op, "dx");
  }
  check_shape(dw, {s.e, s.d}, "router_logits_backward: dw");
  check_shape(dlogits, {s.n, s.e}, "router_logits_backward: dlogits");
  check_acc_dtype(dw, x, "router_logits_backward: dw");
  check_acc_dtype(dlogits, x, "router_logits_backward: dlogits");
  check_router_logits_device(dw, op_device, op, "dw");
  check_router_logits_device(dlogits, op_device, op, "dlogits");
  check_router_logits_device(x, op_device, op, "x");
  check_router_logits_device(w, op_device, op, "w");
  return s;
}

}  // namespace moe
