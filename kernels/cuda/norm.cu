// RMSNorm on the GPU: y = w * x * rstd, rstd = 1/sqrt(mean(x^2) + eps), saved per row for the
// backward. Statistics accumulate in fp32 (double for f64), and rstd and the gain gradient dw are
// kept in that type (acc_t<T>, acc_dtype(x) in the op's contract): a 16-bit rstd would put a 16-bit
// rounding into every dx, and a 16-bit dw would round each micro-batch's sum before adding it.
//
// Forward and the dx part of the backward run one block per row: the threads stride over the row,
// reduce in a fixed tree (warp shuffles, then one warp over the warp sums), and write the row.
// dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)) uses the saved rstd, as the CPU op does; dx may
// alias dy (the row's reduction finishes before any element is written, each by its reader).
// dw += sum_n dy * x * rstd sums over rows, so it is a separate kernel parallel over columns: a
// block owns 8 columns, its 64 thread rows take every 64th data row, and the 64 partials of a
// column are added in a fixed order. No atomics: bitwise the same on every run and device.
//
// The residual fusions are the same kernels with the add folded in (template flag kAdd), so they
// cost about what the plain norm costs and the add's own pass over [N, d] disappears:
// - add_rmsnorm_forward: each thread first stores h = x + r for its elements (rounded as the add op
//   rounds it) and squares the stored value; the second loop reads h back (its own writes). Same
//   threads, same elements, same tree as rmsnorm_forward on h: bitwise add + rmsnorm_forward.
// - rmsnorm_backward_add: the dx kernel adds residual[j] in acc_t before its one rounding; dx may
//   alias residual (read, then written, by the same thread). The dw kernel is unchanged.
#include <algorithm>
#include <string>

#include "common/norm_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "moe/ops/norm.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kMaxRowThreads = 256;  // threads of a per-row block
// dw: 8 columns per block (blockDim.x) and 64 row groups (blockDim.y), so d = 1024 gives 128
// blocks (32-column blocks left 100 of the H200's 132 SMs idle: ~250 us at 16k x 1024).
constexpr int kDwColumns = 8;
constexpr int kDwRowGroups = 64;

// ---- kernels ------------------------------------------------------------------------------------

__device__ __forceinline__ float inv_sqrt(float v) {
  return 1.0f / sqrtf(v);
}
__device__ __forceinline__ double inv_sqrt(double v) {
  return 1.0 / sqrt(v);
}

// Sum of v over the block in a fixed tree, returned to every thread. blockDim.x is a multiple
// of 32.
template <class A>
__device__ A block_sum(A v) {
  __shared__ A warp_sums[32];
  __shared__ A total;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : A(0);
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// grid N, one block per row. kAdd: h = x + res is stored first and normalised (x is the norm's
// input otherwise; h and res are unused).
template <class T, bool kAdd>
__global__ void rmsnorm_forward_kernel(T* y, acc_t<T>* rstd, T* h, const T* x, const T* res,
                                       const T* w, int64_t d, acc_t<T> eps) {
  using A = acc_t<T>;
  const int64_t off = blockIdx.x * d;
  // The norm's input: h when fused. Not __restrict__: h may alias x or res.
  const T* in = kAdd ? h + off : x + off;
  T* yr = y + off;
  A ss = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    T s;
    if constexpr (kAdd) {
      s = store<T>(load(x[off + j]) + load(res[off + j]));  // exactly add_kernel's rounding
      h[off + j] = s;
    } else {
      s = in[j];
    }
    const A v = load(s);
    ss += v * v;
  }
  ss = block_sum(ss);
  const A r = inv_sqrt(ss / static_cast<A>(d) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    yr[j] = store<T>(load(w[j]) * (load(in[j]) * r));
}

// grid N, one block per row: dx (overwritten), plus res when kAdd (summed in A, rounded once).
template <class T, bool kAdd>
__global__ void rmsnorm_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const acc_t<T>* rstd,
                                  const T* res, int64_t d) {
  using A = acc_t<T>;
  const int64_t off = blockIdx.x * d;
  A m = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    m += load(w[j]) * load(dy[off + j]) * load(x[off + j]);
  m = block_sum(m) / static_cast<A>(d);
  const A r = rstd[blockIdx.x];
  const A c = r * r * m;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const A g = r * (load(w[j]) * load(dy[off + j]) - load(x[off + j]) * c);
    if constexpr (kAdd)
      dx[off + j] = store<T>(load(res[off + j]) + g);
    else
      dx[off + j] = store<T>(g);
  }
}

// grid ceil(d / kDwColumns), block (kDwColumns, kDwRowGroups): dw += sum_n dy * x * rstd.
template <class T>
__global__ void rmsnorm_dw_kernel(acc_t<T>* dw, const T* dy, const T* x, const acc_t<T>* rstd,
                                  int64_t n, int64_t d) {
  using A = acc_t<T>;
  __shared__ A partial[kDwRowGroups][kDwColumns + 1];
  const int64_t col = blockIdx.x * int64_t(kDwColumns) + threadIdx.x;
  A acc = 0;
  if (col < d)
    for (int64_t i = threadIdx.y; i < n; i += kDwRowGroups)
      acc += load(dy[i * d + col]) * load(x[i * d + col]) * rstd[i];
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < d) {
    A s = 0;
    for (int g = 0; g < kDwRowGroups; ++g) s += partial[g][threadIdx.x];
    dw[col] += s;
  }
}

// ---- host side ----------------------------------------------------------------------------------

// Threads of a per-row block: a multiple of 32, no more than the row needs, at most 256.
int row_threads(int64_t d) {
  return static_cast<int>(
      std::min<int64_t>(kMaxRowThreads, std::max<int64_t>(32, (d + 31) / 32 * 32)));
}

void check_rows(int64_t n) {
  MOE_CHECK(n <= 0x7fffffff, "rmsnorm: too many rows (" + std::to_string(n) + ")");
}

template <bool kAdd>
void launch_forward(Ctx& ctx, Tensor h, Tensor y, Tensor rstd, Tensor x, Tensor r, Tensor w,
                    double eps, const char* op) {
  const int64_t n = x.size(0), d = x.size(1);
  check_rows(n);
  if (n == 0) return;
  dispatch_storage(x.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    rmsnorm_forward_kernel<T, kAdd>
        <<<static_cast<unsigned>(n), row_threads(d), 0, stream_of(ctx)>>>(
            data_of<T>(y), data_of<acc_t<T>>(rstd), data_of<T>(h), data_of<T>(x), data_of<T>(r),
            data_of<T>(w), d, static_cast<acc_t<T>>(eps));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

template <bool kAdd>
void launch_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                     Tensor residual, const char* op) {
  const int64_t n = x.size(0), d = x.size(1);
  check_rows(n);
  if (n == 0 || d == 0) return;
  dispatch_storage(x.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    // dw first: it reads dy, which dx may alias.
    const dim3 dw_block(kDwColumns, kDwRowGroups);
    rmsnorm_dw_kernel<T><<<blocks_for(d, kDwColumns), dw_block, 0, stream_of(ctx)>>>(
        data_of<acc_t<T>>(dw), data_of<T>(dy), data_of<T>(x), data_of<acc_t<T>>(rstd), n, d);
    MOE_CUDA_LAUNCH_CHECK();
    rmsnorm_dx_kernel<T, kAdd><<<static_cast<unsigned>(n), row_threads(d), 0, stream_of(ctx)>>>(
        data_of<T>(dx), data_of<T>(dy), data_of<T>(x), data_of<T>(w), data_of<acc_t<T>>(rstd),
        data_of<T>(residual), d);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// y: [N, d], rstd: [N], x: [N, d], w: [d]
void rmsnorm_forward_cuda(Ctx& ctx, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  check_rmsnorm_forward_args(y, rstd, x, w);
  launch_forward<false>(ctx, Tensor(), y, rstd, x, Tensor(), w, eps, "rmsnorm_forward");
}

// h = x + r; y, rstd = RMSNorm(h). h, y, x, r: [N, d], rstd: [N], w: [d]
void add_rmsnorm_forward_cuda(Ctx& ctx, Tensor h, Tensor y, Tensor rstd, Tensor x, Tensor r,
                              Tensor w, double eps) {
  check_add_rmsnorm_forward_args(h, y, rstd, x, r, w);
  launch_forward<true>(ctx, h, y, rstd, x, r, w, eps, "add_rmsnorm_forward");
}

// dx: [N, d] (overwritten), dw: [d] (+=), dy, x: [N, d], w: [d], rstd: [N]
void rmsnorm_backward_cuda(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                           Tensor rstd) {
  check_rmsnorm_backward_args(dx, dw, dy, x, w, rstd);
  launch_backward<false>(ctx, dx, dw, dy, x, w, rstd, Tensor(), "rmsnorm_backward");
}

// dx = residual + (rmsnorm_backward's dx); dx may alias residual or dy.
void rmsnorm_backward_add_cuda(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                               Tensor rstd, Tensor residual) {
  check_rmsnorm_backward_add_args(dx, dw, dy, x, w, rstd, residual);
  launch_backward<true>(ctx, dx, dw, dy, x, w, rstd, residual, "rmsnorm_backward_add");
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(rmsnorm_forward, &cuda_detail::rmsnorm_forward_cuda);
MOE_REGISTER_CUDA_OP(rmsnorm_backward, &cuda_detail::rmsnorm_backward_cuda);
MOE_REGISTER_CUDA_OP(add_rmsnorm_forward, &cuda_detail::add_rmsnorm_forward_cuda);
MOE_REGISTER_CUDA_OP(rmsnorm_backward_add, &cuda_detail::rmsnorm_backward_add_cuda);
}  // namespace moe
