// A split AdamW step (adamw_step_split's update, adam_element.cuh) that another kernel's spare
// warps carry while that kernel's own work runs: the slab is cut into tickets of kRiderQuads
// quads, each warp of a rider takes the next ticket by an atomic counter and updates it, and a
// finishing kernel (finish_adam_rider, adam_rider.cu) takes what is left once the host kernel
// ends. Each quad goes through adam_split_quad once, whoever takes it, so the bits are those of
// adamw_step_split for any split of the work.
//
// Why: AdamW is memory-bound (28 bytes per parameter) and the expert GEMMs are tensor-core bound
// with whole SMs held by one block each, so a side stream's AdamW only fills their gaps (13th
// session). The producer warpgroup of the sm_90 GEMMs has three warps with nothing to do: there
// the update shares each SM with the tensor cores.
#pragma once
#include <cstdint>

#include "cuda/adam_element.cuh"

namespace moe::cuda_detail {

// 256 quads: 1,024 parameters, 28 KiB of traffic per ticket, a few microseconds for a warp, so
// a rider stops soon after its host kernel's work ends.
constexpr int64_t kRiderQuads = 256;

struct AdamRider {
  ushort4* hi = nullptr;  // the split master (hi, lo), gradient and moments, in quads
  ushort4* lo = nullptr;
  const float4* g = nullptr;
  float4* m = nullptr;
  float4* v = nullptr;
  int64_t quads = 0;                     // 0: nothing to carry
  unsigned long long* ticket = nullptr;  // tickets taken so far (0 before the host kernel)
  AdamConsts<float> c{};
  __host__ __device__ int64_t tickets() const { return (quads + kRiderQuads - 1) / kRiderQuads; }
};

// One warp (all 32 lanes together) updates tickets until none is left or, with `stop`, until
// *stop reaches stop_at (the host kernel's own work is done; checked before each ticket).
__device__ __forceinline__ void ride_adam(const AdamRider& r, const volatile int* stop = nullptr,
                                          int stop_at = 0) {
  float grad_scale;
  if (!step_scale(r.c, &grad_scale)) return;  // a skipped step: nothing to update
  const int lane = static_cast<int>(threadIdx.x % 32);
  const unsigned long long tickets = static_cast<unsigned long long>(r.tickets());
  for (;;) {
    if (stop != nullptr && *stop >= stop_at) return;
    unsigned long long t = 0;
    if (lane == 0) t = atomicAdd(r.ticket, 1ull);
    t = __shfl_sync(0xffffffffu, t, 0);
    if (t >= tickets) return;
    const int64_t q0 = static_cast<int64_t>(t) * kRiderQuads;
    const int64_t q1 = q0 + kRiderQuads < r.quads ? q0 + kRiderQuads : r.quads;
    // Two quads per lane in flight (both loaded before either is updated): the riders are few
    // warps, so their bandwidth is the bytes each keeps in flight.
    int64_t q = q0 + lane;
    for (; q + 32 < q1; q += 64) {
      const int64_t j = q + 32;
      ushort4 h0 = r.hi[q], l0 = r.lo[q], h1 = r.hi[j], l1 = r.lo[j];
      float4 m0 = r.m[q], v0 = r.v[q], m1 = r.m[j], v1 = r.v[j];
      const float4 g0 = r.g[q], g1 = r.g[j];
      adam_split_quad(h0, l0, g0, m0, v0, grad_scale, r.c);
      adam_split_quad(h1, l1, g1, m1, v1, grad_scale, r.c);
      r.hi[q] = h0, r.lo[q] = l0, r.m[q] = m0, r.v[q] = v0;
      r.hi[j] = h1, r.lo[j] = l1, r.m[j] = m1, r.v[j] = v1;
    }
    if (q < q1) {
      ushort4 h = r.hi[q], l = r.lo[q];
      float4 mq = r.m[q], vq = r.v[q];
      const float4 gq = r.g[q];
      adam_split_quad(h, l, gq, mq, vq, grad_scale, r.c);
      r.hi[q] = h, r.lo[q] = l, r.m[q] = mq, r.v[q] = vq;
    }
  }
}

// The host side (adam_rider.cu).
// Whether adamw_step_split(hi, lo, g, m, v, a) can be carried by a rider: whole 16-byte-aligned
// quads (8-byte for hi and lo) and no gradient-norm output (the riders keep no partials). The
// arguments are checked by the caller (check_adamw_step_split_args).
bool adam_rider_fits(const Tensor& hi, const Tensor& lo, const Tensor& g, const Tensor& m,
                     const Tensor& v, const AdamWArgs& a);
// The rider for that step, its ticket counter reset on ctx's stream (one rider in flight per
// device at a time: the counter is one per process, as the dw kernel's flags are).
AdamRider make_adam_rider(Ctx& ctx, Tensor hi, Tensor lo, Tensor g, Tensor m, Tensor v,
                          const AdamWArgs& a);
// Queues the kernel that updates the tickets no rider took (after the host kernel, same stream).
void finish_adam_rider(Ctx& ctx, const AdamRider& r);

}  // namespace moe::cuda_detail
