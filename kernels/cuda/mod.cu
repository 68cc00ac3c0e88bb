// Mixture-of-Depths on CUDA: per-sequence top-C selection, the gather of the selected rows (and its
// accumulating backward), and the gated scatter out_i = x_i + sigmoid(r_i) (ys_i - x_i) (and its
// backward into x, ys and the scores). Semantics follow kernels/cpu/mod.cpp exactly.
//
// Selection: one block per sequence. Each position's rank under the strict total order (higher
// score first, then lower position) is counted against every other position, the scores streamed
// through shared memory a tile at a time: rank_i = #{j : s_j > s_i or (s_j == s_i and j < i)}.
// Position i is kept iff rank_i < C, which is the CPU's set exactly (the order is total, so the
// ranks are a permutation of 0..T-1). The kept positions are then compacted in position order with
// a warp-ballot prefix sum over the block, so sel comes out ascending with no sort. O(T^2) compares
// per sequence (fine for T of a few thousand; a radix select would be the next step).
// Gather / scatter: one block per selected row, fp32 math (double for f64); the scores and their
// gradient are acc_t<T> (acc_dtype(x): the router's fp32 scores with 16-bit activations). sel
// strictly ascending (as mod_select writes it) makes every written row owned by one selected slot:
// no atomics, no races. sel cannot be validated on the device without a host read: an out-of-range
// entry makes the gather write NaN and the scatters skip that row (the CPU ops throw).
#include <cstdint>
#include <string>

#include "common/mod_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/mod.hpp"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kSelectThreads = 512;
constexpr int kRowThreads = 256;

template <class A>
__device__ __forceinline__ A sigmoid(A x) {
  return A(1) / (A(1) + dev_exp(-x));
}

// ---- selection ----------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(int32_t* __restrict__ sel, T* __restrict__ mask, const T* __restrict__ scores,
                  int64_t t, int64_t c) {
  using A = acc_t<T>;
  constexpr int kWarps = kSelectThreads / kWarp;
  __shared__ A tile[kSelectThreads];
  __shared__ int warp_count[kWarps];
  const int64_t b = blockIdx.x;
  const T* r = scores + b * t;
  T* m = mask + b * t;
  int32_t* out = sel + b * c;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int64_t placed = 0;  // same in every thread
  for (int64_t i0 = 0; i0 < t; i0 += kSelectThreads) {
    const int64_t i = i0 + threadIdx.x;
    const bool active = i < t;
    const A si = active ? load(r[i]) : A(0);
    int64_t rank = 0;
    for (int64_t j0 = 0; j0 < t; j0 += kSelectThreads) {
      __syncthreads();  // the previous tile has been read
      if (j0 + threadIdx.x < t) tile[threadIdx.x] = load(r[j0 + threadIdx.x]);
      __syncthreads();
      const int jn = static_cast<int>(min(static_cast<int64_t>(kSelectThreads), t - j0));
      if (active) {
        for (int jj = 0; jj < jn; ++jj) {
          const A sj = tile[jj];
          rank += (sj > si) || (sj == si && j0 + jj < i);
        }
      }
    }
    const bool kept = active && rank < c;
    if (active) m[i] = store<T>(kept ? A(1) : A(0));
    // Ordered compaction of the kept positions of this group.
    const unsigned ballot = __ballot_sync(kFullMask, kept);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int64_t before = placed, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += warp_count[w];
      total += warp_count[w];
    }
    if (kept) {
      const int64_t pos = before + __popc(ballot & ((1u << lane) - 1u));
      if (pos < c) out[pos] = static_cast<int32_t>(i);  // always true unless scores hold NaN
    }
    placed += total;
    // warp_count is next written after the tile loop's barriers.
  }
}

// ---- gather -------------------------------------------------------------------------------------

// Row of x (in [B*T, d]) that selected slot i = b*C + c reads, or -1 when sel[i] is out of range.
__device__ __forceinline__ int64_t source_row(const int32_t* sel, int64_t i, int64_t c, int64_t t) {
  const int32_t p = sel[i];
  return (0 <= p && p < t) ? (i / c) * t + p : -1;
}

// xs[i, :] = x[source_row(i), :]
template <class T>
__global__ void gather_forward_kernel(T* __restrict__ xs, const T* __restrict__ x,
                                      const int32_t* __restrict__ sel, int64_t t, int64_t c,
                                      int64_t d) {
  const int64_t i = blockIdx.x;
  const int64_t row = source_row(sel, i, c, t);
  T* dst = xs + i * d;
  const T* src = x + (row >= 0 ? row : 0) * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    dst[j] = row >= 0 ? src[j] : store<T>(static_cast<acc_t<T>>(NAN));
}

// dx[source_row(i), :] += dxs[i, :]
template <class T>
__global__ void gather_backward_kernel(T* __restrict__ dx, const T* __restrict__ dxs,
                                       const int32_t* __restrict__ sel, int64_t t, int64_t c,
                                       int64_t d) {
  const int64_t i = blockIdx.x;
  const int64_t row = source_row(sel, i, c, t);
  if (row < 0) return;
  T* dst = dx + row * d;
  const T* src = dxs + i * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    dst[j] = store<T>(load(dst[j]) + load(src[j]));
}

// ---- gated scatter ------------------------------------------------------------------------------

// Selected rows: out[row, :] = x[row, :] + g (ys[i, :] - x[row, :]), g = sigmoid(scores[row]).
// out may alias x: each element is read and written by the same thread.
template <class T>
__global__ void scatter_forward_kernel(T* out, const T* x, const T* __restrict__ ys,
                                       const acc_t<T>* __restrict__ scores,
                                       const int32_t* __restrict__ sel, int64_t t, int64_t c,
                                       int64_t d) {
  using A = acc_t<T>;
  const int64_t i = blockIdx.x;
  const int64_t row = source_row(sel, i, c, t);
  if (row < 0) return;
  const A g = sigmoid(scores[row]);  // scores: [B, T] has the flat index of the row of x
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const A xv = load(x[row * d + j]);
    out[row * d + j] = store<T>(xv + g * (load(ys[i * d + j]) - xv));
  }
}

// Selected rows: dys[i] = g dout[row], dx[row] = (1-g) dout[row], dscores[row] = g(1-g)<dout,
// ys-x>. dx may alias dout: each element of dout is read before the same thread overwrites it.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    scatter_backward_kernel(T* dx, T* __restrict__ dys, acc_t<T>* __restrict__ dscores,
                            const T* dout, const T* __restrict__ x, const T* __restrict__ ys,
                            const acc_t<T>* __restrict__ scores, const int32_t* __restrict__ sel,
                            int64_t t, int64_t c, int64_t d) {
  using A = acc_t<T>;
  __shared__ A part[kRowThreads / kWarp];
  const int64_t i = blockIdx.x;
  const int64_t row = source_row(sel, i, c, t);
  if (row < 0) return;  // uniform over the block
  const A g = sigmoid(scores[row]);
  A dot = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const A gj = load(dout[row * d + j]);
    dot += gj * (load(ys[i * d + j]) - load(x[row * d + j]));
    dys[i * d + j] = store<T>(g * gj);
    dx[row * d + j] = store<T>((A(1) - g) * gj);
  }
  for (int o = kWarp / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(kFullMask, dot, o);
  if (threadIdx.x % kWarp == 0) part[threadIdx.x / kWarp] = dot;
  __syncthreads();
  if (threadIdx.x == 0) {
    A total = 0;
    for (int w = 0; w < kRowThreads / kWarp; ++w) total += part[w];
    dscores[row] = g * (A(1) - g) * total;
  }
}

// ---- host side ----------------------------------------------------------------------------------

// The sequence length T of x: [B*T, d] for sel: [B, C], checked.
// Host-side part of the CPU's sel check (the values live on the device).
void mod_select(Ctx& ctx, Tensor sel, Tensor mask, Tensor scores) {
  check_mod_select_args(sel, mask, scores);
  const int64_t b = scores.size(0), t = scores.size(1), c = sel.size(1);
  if (b == 0 || t == 0) return;
  dispatch_storage(scores.dtype, "mod_select", [&](auto zero) {
    using T = decltype(zero);
    select_kernel<T><<<static_cast<unsigned>(b), kSelectThreads, 0, stream_of(ctx)>>>(
        static_cast<int32_t*>(sel.data), static_cast<T*>(mask.data),
        static_cast<const T*>(scores.data), t, c);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void mod_gather_forward(Ctx& ctx, Tensor xs, Tensor x, Tensor sel) {
  const int64_t t = mod_seq_len(x, sel, "mod_gather_forward");
  check_mod_sel_args(sel, t, "mod_gather_forward");
  const int64_t rows = sel.size(0) * sel.size(1), d = x.size(1);
  check_shape(xs, {rows, d}, "mod_gather_forward: xs");
  check_same_dtype(xs, x, "mod_gather_forward: xs, x");
  if (rows == 0 || d == 0) return;
  dispatch_storage(x.dtype, "mod_gather_forward", [&](auto zero) {
    using T = decltype(zero);
    gather_forward_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(xs.data), static_cast<const T*>(x.data),
        static_cast<const int32_t*>(sel.data), t, sel.size(1), d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void mod_gather_backward(Ctx& ctx, Tensor dx, Tensor dxs, Tensor sel) {
  const int64_t t = mod_seq_len(dx, sel, "mod_gather_backward");
  check_mod_sel_args(sel, t, "mod_gather_backward");
  const int64_t rows = sel.size(0) * sel.size(1), d = dx.size(1);
  check_shape(dxs, {rows, d}, "mod_gather_backward: dxs");
  check_same_dtype(dxs, dx, "mod_gather_backward: dxs, dx");
  if (rows == 0 || d == 0) return;
  dispatch_storage(dx.dtype, "mod_gather_backward", [&](auto zero) {
    using T = decltype(zero);
    gather_backward_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(dx.data), static_cast<const T*>(dxs.data),
        static_cast<const int32_t*>(sel.data), t, sel.size(1), d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void mod_scatter_forward(Ctx& ctx, Tensor out, Tensor x, Tensor ys, Tensor scores, Tensor sel) {
  const int64_t t = mod_seq_len(x, sel, "mod_scatter_forward");
  check_mod_sel_args(sel, t, "mod_scatter_forward");
  check_mod_scatter_forward_args(out, x, ys, scores, sel, t);
  const int64_t b = sel.size(0), c = sel.size(1), d = x.size(1);
  cudaStream_t stream = stream_of(ctx);
  if (out.data != x.data && x.nbytes() > 0)  // skipped rows: out = x
    MOE_CUDA_CHECK(cudaMemcpyAsync(out.data, x.data, x.nbytes(), cudaMemcpyDeviceToDevice, stream));
  if (b * c == 0 || d == 0) return;
  dispatch_storage(x.dtype, "mod_scatter_forward", [&](auto zero) {
    using T = decltype(zero);
    scatter_forward_kernel<T><<<static_cast<unsigned>(b * c), kRowThreads, 0, stream>>>(
        static_cast<T*>(out.data), static_cast<const T*>(x.data), static_cast<const T*>(ys.data),
        static_cast<const acc_t<T>*>(scores.data), static_cast<const int32_t*>(sel.data), t, c, d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void mod_scatter_backward(Ctx& ctx, Tensor dx, Tensor dys, Tensor dscores, Tensor dout, Tensor x,
                          Tensor ys, Tensor scores, Tensor sel) {
  const int64_t t = mod_seq_len(x, sel, "mod_scatter_backward");
  check_mod_sel_args(sel, t, "mod_scatter_backward");
  check_mod_scatter_backward_args(dx, dys, dscores, dout, x, ys, scores, sel, t);
  const int64_t b = sel.size(0), c = sel.size(1), d = x.size(1);
  cudaStream_t stream = stream_of(ctx);
  if (dx.data != dout.data && dout.nbytes() > 0)  // skipped rows: dx = dout
    MOE_CUDA_CHECK(
        cudaMemcpyAsync(dx.data, dout.data, dout.nbytes(), cudaMemcpyDeviceToDevice, stream));
  // Skipped positions get dscores = 0 (all-zero bits are 0 in every float dtype).
  if (dscores.nbytes() > 0)
    MOE_CUDA_CHECK(cudaMemsetAsync(dscores.data, 0, dscores.nbytes(), stream));
  if (b * c == 0) return;
  dispatch_storage(x.dtype, "mod_scatter_backward", [&](auto zero) {
    using T = decltype(zero);
    scatter_backward_kernel<T><<<static_cast<unsigned>(b * c), kRowThreads, 0, stream>>>(
        static_cast<T*>(dx.data), static_cast<T*>(dys.data), static_cast<acc_t<T>*>(dscores.data),
        static_cast<const T*>(dout.data), static_cast<const T*>(x.data),
        static_cast<const T*>(ys.data), static_cast<const acc_t<T>*>(scores.data),
        static_cast<const int32_t*>(sel.data), t, c, d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(mod_select, &::moe::cuda_detail::mod_select);
MOE_REGISTER_CUDA_OP(mod_gather_forward, &::moe::cuda_detail::mod_gather_forward);
MOE_REGISTER_CUDA_OP(mod_gather_backward, &::moe::cuda_detail::mod_gather_backward);
MOE_REGISTER_CUDA_OP(mod_scatter_forward, &::moe::cuda_detail::mod_scatter_forward);
MOE_REGISTER_CUDA_OP(mod_scatter_backward, &::moe::cuda_detail::mod_scatter_backward);
