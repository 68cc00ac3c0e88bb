// The MoD causal predictor's head on CUDA, with the math of kernels/cpu/mod_predictor.cpp, on
// tensors of an accumulation dtype (f32 in the model; f64 for the gradient checks):
// - forward: a warp per row (kRowsInFlight rows a warp at once, their loads issued together),
//   each lane a strided share of its P columns (coalesced), silu(h) w2 summed by the warp's
//   fixed tree; w2 staged in shared memory once per block.
// - backward: blocks of kRowsPerBlock rows (more when the partials would not fit the scratch),
//   numbers fixed by N and P alone so dw2's summation order is the same on every device and run.
//   The block first turns its rows' logits into dl (bce_with_logits_backward's arithmetic), then
//   per 32-column slice each warp walks a strided subset of the rows (kRowsInFlight at once),
//   writing dh and summing dl silu(h) for its column; the warps' sums are added in warp order
//   into the block's partial row, and add_column_partials (column_partials.cuh) adds the
//   partials into dw2 in block order.
// In the model (moe-small, 16K tokens, P = 64) the forward's one launch replaces silu_forward and
// a cuBLAS fp32 product with one output (an [N, P] activation written and read back); the
// backward's two replace bce_with_logits_backward, linear_backward's two products and
// silu_backward (an [N, P] gradient written and read back). h is read once a direction.
#include <cstdint>
#include <string>

#include "common/mod_checks.hpp"
#include "cuda/column_partials.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/silu.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/mod.hpp"

namespace moe::cuda_detail::mod_predictor_impl {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kRowsInFlight = 4;       // rows a warp loads before using any
constexpr int64_t kRowsPerBlock = 64;  // backward: at least; doubles until the partials fit
// the block's dl staged in shared memory (acc_t); the dw2 partials (mod.hpp: the config's limits)
constexpr int64_t kMaxRowsPerBlock = kModHeadMaxBlockRows;
constexpr size_t kPartialBytes = size_t(kModHeadPartials) * sizeof(float);

__device__ double g_head_dw_partials[kPartialBytes / sizeof(double)];
struct HeadPartials {  // for add_column_partials
  template <class A>
  __device__ static A* get() {
    return reinterpret_cast<A*>(g_head_dw_partials);
  }
};

// Column j of rows i0, i0 + stride, ... (kRowsInFlight of them, 0 from row `end` on) of h [*, p],
// their loads issued together before any is used.
template <class A, class T>
__device__ __forceinline__ void load_rows(A (&a)[kRowsInFlight], const T* __restrict__ h,
                                          int64_t i0, int64_t stride, int64_t end, int64_t p,
                                          int64_t j) {
#pragma unroll
  for (int u = 0; u < kRowsInFlight; ++u) {
    const int64_t i = i0 + u * stride;
    a[u] = i < end ? A(load(h[i * p + j])) : A(0);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    head_forward_kernel(T* __restrict__ logit, const T* __restrict__ h, const T* __restrict__ w2,
                        int64_t n, int64_t p) {
  using A = acc_t<T>;
  extern __shared__ unsigned char smem_raw[];
  A* w = reinterpret_cast<A*>(smem_raw);
  for (int64_t j = threadIdx.x; j < p; j += kThreads) w[j] = load(w2[j]);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  // kRowsInFlight rows a warp at once, their loads issued together (one row at a time, each
  // waited on its own load); each row's sum in the same order as alone.
  for (int64_t i0 = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; i0 < n;
       i0 += kRowsInFlight * warps) {
    A s[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) s[u] = 0;
    for (int64_t j = lane; j < p; j += 32) {
      A a[kRowsInFlight];
      load_rows(a, h, i0, warps, n, p, j);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) s[u] += silu(a[u]) * w[j];
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const A t = warp_sum(s[u]);
      const int64_t i = i0 + u * warps;
      if (lane == 0 && i < n) logit[i] = store<T>(t);
    }
  }
}

// grid: ceil(n / rows) blocks of `rows` rows each.
template <class T>
__global__ void __launch_bounds__(kThreads)
    head_backward_kernel(T* __restrict__ dh, acc_t<T>* __restrict__ dw2, const T* __restrict__ h,
                         const T* __restrict__ w2, const T* __restrict__ logit,
                         const T* __restrict__ targets, int64_t n, int64_t p, int64_t rows,
                         acc_t<T> scale) {
  using A = acc_t<T>;
  extern __shared__ unsigned char smem_raw[];
  A* dl = reinterpret_cast<A*>(smem_raw);  // [rows]
  __shared__ A warp_part[kWarpsPerBlock][32];
  const int64_t r0 = blockIdx.x * rows;
  const int64_t r1 = r0 + rows < n ? r0 + rows : n;
  for (int64_t r = r0 + threadIdx.x; r < r1; r += kThreads) {
    const A x = load(logit[r]), t = load(targets[r]);
    dl[r - r0] = scale * (sigmoid(x) - t);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t j0 = 0; j0 < p; j0 += 32) {
    const int64_t j = j0 + lane;
    A s = 0;
    if (j < p) {
      const A wj = load(w2[j]);
      // kRowsInFlight of the warp's rows at once (loads first), summed in the same row order
      for (int64_t r0w = r0 + warp; r0w < r1; r0w += kRowsInFlight * kWarpsPerBlock) {
        A a[kRowsInFlight];
        load_rows(a, h, r0w, kWarpsPerBlock, r1, p, j);
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const int64_t r = r0w + u * kWarpsPerBlock;
          if (r >= r1) break;
          const A g = dl[r - r0];
          dh[r * p + j] = store<T>(g * wj * silu_grad(a[u]));
          s += g * silu(a[u]);
        }
      }
    }
    warp_part[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && j < p) {
      A t = warp_part[0][lane];
      for (int w = 1; w < kWarpsPerBlock; ++w) t += warp_part[w][lane];
      if (gridDim.x == 1)
        dw2[j] += t;
      else
        HeadPartials::get<A>()[blockIdx.x * p + j] = t;
    }
    __syncthreads();  // warp_part is rewritten by the next slice
  }
}

void head_forward_cuda(Ctx& ctx, Tensor logit, Tensor h, Tensor w2) {
  check_mod_predictor_head_args(h, w2, logit, nullptr, nullptr, nullptr,
                                "mod_predictor_head_forward");
  check_on_gpu({&logit, &h, &w2}, "mod_predictor_head_forward");
  const int64_t n = h.size(0), p = h.size(1);
  if (n == 0) return;
  dispatch_acc(h.dtype, "mod_predictor_head_forward", [&](auto zero) {
    using T = decltype(zero);
    const size_t smem = static_cast<size_t>(p) * sizeof(acc_t<T>);
    MOE_CHECK(smem <= 48 * 1024, "mod_predictor_head_forward: P = " + std::to_string(p) +
                                     " exceeds the kernel's shared-memory w2");
    const int64_t rows_per_block = int64_t(kWarpsPerBlock) * kRowsInFlight;
    const int64_t blocks = std::min<int64_t>((n + rows_per_block - 1) / rows_per_block,
                                             int64_t(device_sm_count()) * 8);
    head_forward_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream_of(ctx)>>>(
        data_of<T>(logit), data_of<T>(h), data_of<T>(w2), n, p);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void head_backward_cuda(Ctx& ctx, Tensor dh, Tensor dw2, Tensor h, Tensor w2, Tensor logit,
                        Tensor targets, double grad_scale) {
  check_mod_predictor_head_args(h, w2, logit, &dh, &dw2, &targets, "mod_predictor_head_backward");
  check_on_gpu({&dh, &dw2, &h, &w2, &logit, &targets}, "mod_predictor_head_backward");
  const int64_t n = h.size(0), p = h.size(1);
  if (n == 0) return;
  dispatch_acc(h.dtype, "mod_predictor_head_backward", [&](auto zero) {
    using T = decltype(zero);
    using A = T;
    // Rows per block from N and P alone (dw2's summation order), doubled until the partials fit.
    int64_t rows = kRowsPerBlock;
    while ((n + rows - 1) / rows * p > static_cast<int64_t>(kPartialBytes / sizeof(A)) &&
           rows < kMaxRowsPerBlock)
      rows *= 2;
    const int64_t blocks = (n + rows - 1) / rows;
    MOE_CHECK(blocks * p <= static_cast<int64_t>(kPartialBytes / sizeof(A)),
              "mod_predictor_head_backward: N = " + std::to_string(n) +
                  ", P = " + std::to_string(p) + " exceed the kernel's dw2 partials");
    const size_t smem = static_cast<size_t>(rows) * sizeof(A);
    cudaStream_t stream = stream_of(ctx);
    head_backward_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
        data_of<T>(dh), data_of<A>(dw2), data_of<T>(h), data_of<T>(w2), data_of<T>(logit),
        data_of<T>(targets), n, p, rows, static_cast<A>(grad_scale / static_cast<double>(n)));
    MOE_CUDA_LAUNCH_CHECK();
    if (blocks > 1) add_column_partials<A, HeadPartials>(stream, data_of<A>(dw2), blocks, p);
  });
}

}  // namespace
}  // namespace moe::cuda_detail::mod_predictor_impl

MOE_REGISTER_CUDA_OP(mod_predictor_head_forward,
                     &::moe::cuda_detail::mod_predictor_impl::head_forward_cuda);
MOE_REGISTER_CUDA_OP(mod_predictor_head_backward,
                     &::moe::cuda_detail::mod_predictor_impl::head_backward_cuda);
