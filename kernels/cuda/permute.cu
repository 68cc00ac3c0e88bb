// Token permutation for dropless MoE on CUDA: the plan (a stable counting sort of the N*K routed
// slots by expert, computed on the device with no host sync), the gather that builds the permuted
// activations and its backward, and the weighted combine and its backward. Semantics follow
// kernels/cpu/permute.cpp exactly; the plan equals the CPU plan bitwise.
//
// Plan, three launches on the op's stream (plus a memset), no scratch memory:
//   1. offsets[1..E] = per-expert histogram: each block counts its slots in a shared-memory
//      histogram and adds it to offsets[e+1] with integer atomics (exact in any order);
//   2. one thread turns offsets into the exclusive prefix sum (E is small);
//   3. one block per expert walks all slots in slot order, 512 at a time: a warp ballot marks the
//      slots of its expert, popcounts and a prefix over the block's warps give each such slot its
//      rank, so row = offsets[e] + rank is stable by slot index. A block stops once it has placed
//      all its slots. Work is O(E * N*K) reads of topk_idx in the worst case, which stays in L2;
//      correctness first (a per-tile counting sort would be O(N*K)).
// The row kernels use one block per output row and fp32 accumulation (double for f64); sums over
// k run in the fixed order k = 0..K-1 and are gathers (no atomics), so results are deterministic.
// The routing weights topk_w and their gradient dtopk_w are acc_t<T> (acc_dtype: the router's fp32
// weights with 16-bit activations), so a weight is never rounded to 16 bits.
// Indices cannot be validated on the device without a host read: a gather whose index is out of
// range writes NaN (loud, no out-of-bounds access); the plan ignores out-of-range experts.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/permute_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "moe/ops/permute.hpp"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kHistThreads = 256;
constexpr int kPlaceThreads = 512;
constexpr int kRowThreads = 256;

// ---- plan ---------------------------------------------------------------------------------------

__global__ void histogram_kernel(int32_t* __restrict__ offsets, const int32_t* __restrict__ expert,
                                 int64_t slots, int n_exp) {
  extern __shared__ int hist[];  // [E]
  for (int e = threadIdx.x; e < n_exp; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = expert[s];
    if (0 <= e && e < n_exp) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_exp; e += blockDim.x)
    if (hist[e]) atomicAdd(&offsets[e + 1], hist[e]);
}

__global__ void scan_kernel(int32_t* offsets, int n_exp) {
  if (threadIdx.x == 0 && blockIdx.x == 0)
    for (int e = 0; e < n_exp; ++e) offsets[e + 1] += offsets[e];
}

__global__ void __launch_bounds__(kPlaceThreads)
    place_kernel(int32_t* __restrict__ row_token, int32_t* __restrict__ slot_row,
                 const int32_t* __restrict__ offsets, const int32_t* __restrict__ expert,
                 int64_t slots, int k) {
  constexpr int kWarps = kPlaceThreads / kWarp;
  __shared__ int warp_count[kWarps];
  const int e = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int32_t base = offsets[e], count = offsets[e + 1] - base;
  int placed = 0;  // same in every thread
  for (int64_t c0 = 0; c0 < slots && placed < count; c0 += kPlaceThreads) {
    const int64_t s = c0 + threadIdx.x;
    const bool mine = s < slots && expert[s] == e;
    const unsigned ballot = __ballot_sync(kFullMask, mine);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int before = placed, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += warp_count[w];
      total += warp_count[w];
    }
    if (mine) {
      const int32_t r = base + before + __popc(ballot & ((1u << lane) - 1u));
      slot_row[s] = r;
      row_token[r] = static_cast<int32_t>(s / k);
    }
    placed += total;
    __syncthreads();  // warp_count is rewritten by the next chunk
  }
}

// ---- row kernels --------------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ T nan_of() {
  return store<T>(static_cast<acc_t<T>>(NAN));
}

// xp[r, :] = x[row_token[r], :]
template <class T>
__global__ void permute_forward_kernel(T* __restrict__ xp, const T* __restrict__ x,
                                       const int32_t* __restrict__ row_token, int64_t n_tok,
                                       int64_t d) {
  const int64_t r = blockIdx.x;
  const int32_t tok = row_token[r];
  const bool ok = 0 <= tok && tok < n_tok;
  T* dst = xp + r * d;
  const T* src = x + (ok ? tok : 0) * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dst[j] = ok ? src[j] : nan_of<T>();
}

// dx[n, :] = sum_k dxp[slot_row[n*K+k], :]
template <class T>
__global__ void permute_backward_kernel(T* __restrict__ dx, const T* __restrict__ dxp,
                                        const int32_t* __restrict__ slot_row, int k, int64_t d) {
  using A = acc_t<T>;
  const int64_t n = blockIdx.x, slots = static_cast<int64_t>(gridDim.x) * k;
  const int32_t* row = slot_row + n * k;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    A s = 0;
    for (int i = 0; i < k; ++i)
      s += (0 <= row[i] && row[i] < slots) ? load(dxp[row[i] * d + j]) : static_cast<A>(NAN);
    dx[n * d + j] = store<T>(s);
  }
}

// y[n, :] = sum_k w[n, k] * yp[slot_row[n*K+k], :]
template <class T>
__global__ void combine_forward_kernel(T* __restrict__ y, const T* __restrict__ yp,
                                       const acc_t<T>* __restrict__ w,
                                       const int32_t* __restrict__ slot_row, int k, int64_t d) {
  using A = acc_t<T>;
  const int64_t n = blockIdx.x, slots = static_cast<int64_t>(gridDim.x) * k;
  const int32_t* row = slot_row + n * k;
  const A* wn = w + n * k;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    A s = 0;
    for (int i = 0; i < k; ++i)
      s += (0 <= row[i] && row[i] < slots) ? wn[i] * load(yp[row[i] * d + j]) : static_cast<A>(NAN);
    y[n * d + j] = store<T>(s);
  }
}

// One block per slot s: dyp[slot_row[s], :] = w[s] dy[n, :], dtopk_w[s] = <dy[n, :], yp[row, :]>.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    combine_backward_kernel(T* __restrict__ dyp, acc_t<T>* __restrict__ dtopk_w,
                            const T* __restrict__ dy, const T* __restrict__ yp,
                            const acc_t<T>* __restrict__ w, const int32_t* __restrict__ slot_row,
                            int k, int64_t d) {
  using A = acc_t<T>;
  __shared__ A part[kRowThreads / kWarp];
  const int64_t s = blockIdx.x, slots = gridDim.x;
  const int32_t row = slot_row[s];
  const bool ok = 0 <= row && row < slots;
  const T* g = dy + (s / k) * d;
  const T* ys = yp + (ok ? row : 0) * d;
  T* dst = dyp + (ok ? row : 0) * d;
  const A ws = w[s];
  A dot = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const A gj = load(g[j]);
    dot += gj * load(ys[j]);
    if (ok) dst[j] = store<T>(ws * gj);
  }
  for (int o = kWarp / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(kFullMask, dot, o);
  if (threadIdx.x % kWarp == 0) part[threadIdx.x / kWarp] = dot;
  __syncthreads();
  if (threadIdx.x == 0) {
    A total = 0;
    for (int i = 0; i < kRowThreads / kWarp; ++i) total += part[i];
    dtopk_w[s] = ok ? total : static_cast<A>(NAN);
  }
}

// ---- host side ----------------------------------------------------------------------------------

void moe_permute_plan(Ctx& ctx, Tensor offsets, Tensor row_token, Tensor slot_row,
                      Tensor topk_idx) {
  check_moe_permute_plan_args(offsets, row_token, slot_row, topk_idx);
  const int64_t n_tok = topk_idx.size(0), k = topk_idx.size(1), slots = n_tok * k;
  const int64_t n_exp = offsets.size(0) - 1;
  MOE_CHECK(slots < (int64_t{1} << 31), "moe_permute_plan: N*K must fit in i32");
  cudaStream_t stream = stream_of(ctx);
  const int32_t* expert = static_cast<const int32_t*>(topk_idx.data);
  int32_t* off = static_cast<int32_t*>(offsets.data);
  MOE_CUDA_CHECK(cudaMemsetAsync(off, 0, offsets.nbytes(), stream));
  if (slots == 0) return;
  const unsigned hist_blocks = std::min<unsigned>(blocks_for(slots, kHistThreads), 1024u);
  histogram_kernel<<<hist_blocks, kHistThreads, n_exp * sizeof(int), stream>>>(
      off, expert, slots, static_cast<int>(n_exp));
  MOE_CUDA_LAUNCH_CHECK();
  scan_kernel<<<1, 1, 0, stream>>>(off, static_cast<int>(n_exp));
  MOE_CUDA_LAUNCH_CHECK();
  place_kernel<<<static_cast<unsigned>(n_exp), kPlaceThreads, 0, stream>>>(
      static_cast<int32_t*>(row_token.data), static_cast<int32_t*>(slot_row.data), off, expert,
      slots, static_cast<int>(k));
  MOE_CUDA_LAUNCH_CHECK();
}

void permute_forward(Ctx& ctx, Tensor xp, Tensor x, Tensor row_token) {
  check_permute_forward_args(xp, x, row_token);
  const int64_t rows = row_token.size(0), n_tok = x.size(0), d = x.size(1);
  if (rows == 0 || d == 0) return;
  dispatch_storage(x.dtype, "permute_forward", [&](auto zero) {
    using T = decltype(zero);
    permute_forward_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(xp.data), static_cast<const T*>(x.data),
        static_cast<const int32_t*>(row_token.data), n_tok, d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void permute_backward(Ctx& ctx, Tensor dx, Tensor dxp, Tensor slot_row) {
  const int64_t k = check_permute_backward_args(dx, dxp, slot_row);
  const int64_t n_tok = dx.size(0), d = dx.size(1), slots = slot_row.size(0);
  if (n_tok == 0 || d == 0) return;
  dispatch_storage(dx.dtype, "permute_backward", [&](auto zero) {
    using T = decltype(zero);
    permute_backward_kernel<T><<<static_cast<unsigned>(n_tok), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(dx.data), static_cast<const T*>(dxp.data),
        static_cast<const int32_t*>(slot_row.data), static_cast<int>(k), d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void combine_forward(Ctx& ctx, Tensor y, Tensor yp, Tensor topk_w, Tensor slot_row) {
  check_combine_forward_args(y, yp, topk_w, slot_row);
  const int64_t n_tok = y.size(0), d = y.size(1), k = topk_w.size(1);
  if (n_tok == 0 || d == 0) return;
  dispatch_storage(y.dtype, "combine_forward", [&](auto zero) {
    using T = decltype(zero);
    combine_forward_kernel<T><<<static_cast<unsigned>(n_tok), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(y.data), static_cast<const T*>(yp.data),
        static_cast<const acc_t<T>*>(topk_w.data), static_cast<const int32_t*>(slot_row.data),
        static_cast<int>(k), d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void combine_backward(Ctx& ctx, Tensor dyp, Tensor dtopk_w, Tensor dy, Tensor yp, Tensor topk_w,
                      Tensor slot_row) {
  check_combine_backward_args(dyp, dtopk_w, dy, yp, topk_w, slot_row);
  const int64_t n_tok = dy.size(0), d = dy.size(1), k = topk_w.size(1);
  if (n_tok == 0 || k == 0) return;
  dispatch_storage(dy.dtype, "combine_backward", [&](auto zero) {
    using T = decltype(zero);
    combine_backward_kernel<T>
        <<<static_cast<unsigned>(n_tok * k), kRowThreads, 0, stream_of(ctx)>>>(
            static_cast<T*>(dyp.data), static_cast<acc_t<T>*>(dtopk_w.data),
            static_cast<const T*>(dy.data), static_cast<const T*>(yp.data),
            static_cast<const acc_t<T>*>(topk_w.data), static_cast<const int32_t*>(slot_row.data),
            static_cast<int>(k), d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(moe_permute_plan, &::moe::cuda_detail::moe_permute_plan);
MOE_REGISTER_CUDA_OP(permute_forward, &::moe::cuda_detail::permute_forward);
MOE_REGISTER_CUDA_OP(permute_backward, &::moe::cuda_detail::permute_backward);
MOE_REGISTER_CUDA_OP(combine_forward, &::moe::cuda_detail::combine_forward);
MOE_REGISTER_CUDA_OP(combine_backward, &::moe::cuda_detail::combine_backward);
