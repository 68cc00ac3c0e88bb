// The three bf16 parts of an fp32 value, v = p[0] + p[1] + p[2] exactly where the exponents allow
// (moe/ops/bf16_split.hpp): each part the rounding of what the ones before leave. Shared by the
// split copies (bf16_split.cu) and the router kernels that split as they load
// (router_split_mma.cu), so both give the same parts bit for bit.
#pragma once
#include <cuda_bf16.h>

namespace moe::cuda_detail {

struct Bf16Parts {
  __nv_bfloat16 p[3];
};

__device__ __forceinline__ Bf16Parts split3(float v) {
  Bf16Parts r;
  r.p[0] = __float2bfloat16_rn(v);
  const float r1 = __fsub_rn(v, __bfloat162float(r.p[0]));
  r.p[1] = __float2bfloat16_rn(r1);
  r.p[2] = __float2bfloat16_rn(__fsub_rn(r1, __bfloat162float(r.p[1])));
  return r;
}

}  // namespace moe::cuda_detail
