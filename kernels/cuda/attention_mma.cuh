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

// The wgmma / TMA forward for sm_90 (attention_sm90.cu), ahead of the sm_80 one: false, launching
// nothing, when the device is not sm_90, the binary has no sm_90a code for t, a tensor is not
// 16-byte aligned, or MOE_ATTENTION_SM90=0.
bool attention_sm90_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                            const void* v, const AttentionShape& s);

// The wgmma / TMA backward for sm_90 (attention_sm90.cu), under the same conditions. With
// dq_acc (fp32 [B, nh, T, 64] scratch, or null) it may run as one kernel that sums dq there
// (attention_sm90_fused_backward.cu).
bool attention_sm90_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                             const void* q, const void* k, const void* v, const void* out,
                             const float* lse, float* dq_acc, const AttentionShape& s);
// Whether attention_sm90_backward over 16-byte aligned tensors of shape s with a dq_acc runs as
// the one kernel (and so uses dq_acc).
bool attention_sm90_backward_sums_dq(DType t, const AttentionShape& s);

// The mma.sync forward for sm_80+ (attention_sm80.cu) behind attention_mma_forward: false,
// launching nothing, when the binary has no sm_80 code for t on this device or a tensor is not
// 16-byte aligned.
bool attention_sm80_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                            const void* v, const AttentionShape& s);

// The mma.sync backward for sm_80+ (attention_sm80_backward.cu) behind attention_mma_backward,
// under the same conditions.
bool attention_sm80_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                             const void* q, const void* k, const void* v, const void* out,
                             const float* lse, const AttentionShape& s);

void attention_mma_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                            const void* q, const void* k, const void* v, const void* out,
                            const float* lse, float* dq_acc, const AttentionShape& s);

}  // namespace moe::cuda_detail
