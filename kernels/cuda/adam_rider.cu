// The host side of the AdamW riders (adam_rider.cuh): the rider of a split AdamW step and the
// kernel that finishes what its host kernel's spare warps left.
#include <algorithm>
#include <cstdint>

#include "cuda/adam_rider.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"

namespace moe::cuda_detail {
namespace {

__device__ unsigned long long rider_ticket;

constexpr int kFinishThreads = 256;

// Every warp takes tickets until none is left; one wave of blocks.
__global__ void __launch_bounds__(kFinishThreads) finish_adam_rider_kernel(AdamRider r) {
  ride_adam(r);
}

}  // namespace

bool adam_rider_fits(const Tensor& hi, const Tensor& lo, const Tensor& g, const Tensor& m,
                     const Tensor& v, const AdamWArgs& a) {
  auto aligned8 = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data) % 8 == 0; };
  // (the riders read an f32 g: a bf16 one, train.bf16_expert_grads, takes the separate update)
  return g.dtype == DType::f32 && hi.numel() % 4 == 0 && a.grad_sq_out.empty() && aligned8(hi) &&
         aligned8(lo) && aligned16({g.data, m.data, v.data});
}

AdamRider make_adam_rider(Ctx& ctx, Tensor hi, Tensor lo, Tensor g, Tensor m, Tensor v,
                          const AdamWArgs& a) {
  AdamRider r;
  r.hi = static_cast<ushort4*>(hi.data);
  r.lo = static_cast<ushort4*>(lo.data);
  r.g = static_cast<const float4*>(g.data);
  r.m = static_cast<float4*>(m.data);
  r.v = static_cast<float4*>(v.data);
  r.quads = hi.numel() / 4;
  r.c = adam_consts<float>(a);
  static unsigned long long* ticket = [] {
    void* p = nullptr;
    MOE_CUDA_CHECK(cudaGetSymbolAddress(&p, rider_ticket));
    return static_cast<unsigned long long*>(p);
  }();
  r.ticket = ticket;
  MOE_CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof(*ticket), stream_of(ctx)));
  return r;
}

void finish_adam_rider(Ctx& ctx, const AdamRider& r) {
  if (r.quads == 0) return;
  static const int per_sm = [] {
    int n = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, finish_adam_rider_kernel,
                                                                 kFinishThreads, 0));
    return std::max(n, 1);
  }();
  const int64_t warps_needed = r.tickets();
  const int64_t blocks =
      std::min<int64_t>(int64_t(per_sm) * device_sm_count(),
                        (warps_needed + kFinishThreads / 32 - 1) / (kFinishThreads / 32));
  finish_adam_rider_kernel<<<static_cast<unsigned>(blocks), kFinishThreads, 0, stream_of(ctx)>>>(r);
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace moe::cuda_detail
