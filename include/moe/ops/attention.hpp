// Causal multi-head attention with grouped-query heads: query head h reads kv head h / (nh / nkv).
// Causality is by index within the sequence (MoD passes its selected tokens in position order, so
// index order is position order). Scale 1/sqrt(hd). No T x T matrix is kept between forward and
// backward: the backward recomputes probabilities from the saved log-sum-exp.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// out: [B, T, nh, hd], lse: [B, nh, T] (log-sum-exp of each scaled score row, in acc_dtype(q)),
// q: [B, T, nh, hd], k, v: [B, T, nkv, hd]
MOE_OP(attention_forward, (Ctx & ctx, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v),
       (ctx, out, lse, q, k, v))
// dq: [B, T, nh, hd], dk, dv: [B, T, nkv, hd] (overwritten); lse: the forward's, acc_dtype(q).
// dq_acc: empty, or f32 [B, nh, T, hd] scratch on q's device (contents ignored, overwritten) in
// which a GPU backward may sum dq over key tiles in the same pass as dk and dv (the sm_90
// kernels); the other backends leave it alone. The gradients do not depend on whether it is given
// beyond rounding.
MOE_OP(attention_backward,
       (Ctx & ctx, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
        Tensor out, Tensor lse, Tensor dq_acc),
       (ctx, dq, dk, dv, dout, q, k, v, out, lse, dq_acc))
// Whether attention_backward over q [batch, seq, heads, hd], k [batch, seq, kv_heads, hd] in dtype
// dt on ctx's device sums dq in a given dq_acc (the CUDA backend's one-kernel sm_90 backward), so
// callers allocate the scratch only where it is used. Decided from the shapes and the device alone
// (the planning dry run asks too), assuming 16-byte aligned tensors (arena allocations are).
#ifdef MOE_WITH_CUDA
namespace cuda {
inline bool (*attention_backward_sums_dq)(DType dt, int64_t batch, int64_t seq, int64_t heads,
                                          int64_t kv_heads, int64_t hd) = nullptr;
}
#endif
inline bool attention_backward_wants_dq_acc(const Ctx& ctx, DType dt, int64_t batch, int64_t seq,
                                            int64_t heads, int64_t kv_heads, int64_t hd) {
#ifdef MOE_WITH_CUDA
  if (ctx.device.type == DeviceType::cuda && cuda::attention_backward_sums_dq != nullptr)
    return cuda::attention_backward_sums_dq(dt, batch, seq, heads, kv_heads, hd);
#endif
  (void)ctx, (void)dt, (void)batch, (void)seq, (void)heads, (void)kv_heads, (void)hd;
  return false;
}

}  // namespace moe
