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
// dq: [B, T, nh, hd], dk, dv: [B, T, nkv, hd] (overwritten); lse: the forward's, acc_dtype(q)
MOE_OP(attention_backward,
       (Ctx & ctx, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
        Tensor out, Tensor lse),
       (ctx, dq, dk, dv, dout, q, k, v, out, lse))

}  // namespace moe
