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

}  // namespace moe
