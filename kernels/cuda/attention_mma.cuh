// Flash-style causal GQA attention on tensor cores (kernels/cuda/attention_mma.cu) for f16 / bf16
// with head_dim 64; attention.cu's SIMT kernels cover every other case. Same math and layouts as
// the attention ops (include/moe/ops/attention.hpp): q, out [B, T, nh, 64], k, v [B, T, nkv, 64],
// lse [B, nh, T] in fp32.
#pragma once
#include <cstdint>

#include "moe/ops/common.hpp"

namespace moe::cuda_detail {

// Whether the tensor-core kernels exist in this binary for dtype t and head_dim hd on the device.
bool attention_mma_available(DType t, int64_t hd);

struct AttentionShape {
  int64_t batch, seq, heads, kv_heads;
};

void attention_mma_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                           const void* v, const AttentionShape& s);

void attention_mma_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                            const void* q, const void* k, const void* v, const void* out,
                            const float* lse, const AttentionShape& s);

}  // namespace moe::cuda_detail
