// Single-query attention for autoregressive decoding over a key/value cache. Each batch row holds
// one new query that attends to the first lengths[b] cached entries (the new token's own k/v
// already appended), with the same math as one row of attention_forward: query head h reads kv
// head h / (nh / nkv), scale 1/sqrt(hd), softmax accumulated in double. The cache is allocated
// once at S_max entries per row, so growing a sequence moves no memory.
//
// Forward only: sampling never differentiates, so there is no backward to declare.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// out: [B, nh, hd], q: [B, nh, hd], k_cache, v_cache: [B, S_max, nkv, hd],
// lengths: [B] i32 in [1, S_max] (a length outside that range is a caller bug: InternalError).
MOE_OP(attention_decode_forward,
       (Ctx & ctx, Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths),
       (ctx, out, q, k_cache, v_cache, lengths))

}  // namespace moe
