// Losses on CUDA: softmax cross-entropy for the LM head and binary cross-entropy with logits for
// the MoD predictor, forward and backward, with the math of kernels/cpu/loss.cpp. Arithmetic is
// fp32 for f32/f16/bf16 storage (double for f64); results are rounded once into the storage dtype.
// The cross-entropy's losses and lse are kept in that arithmetic type (acc_t<T>, acc_dtype(logits)
// in the op's contract): a 16-bit lse would shift every probability of the backward by up to half
// a 16-bit ulp of lse, and 16-bit per-token losses would be summed already rounded.
//
// - cross_entropy_forward: one block per row. Each thread runs an online log-sum-exp over its
//   strided share of the row (running max m, running sum s of exp(x - m), rescaled when the max
//   grows), then the per-thread (m, s) pairs are merged in a fixed tree (warp shuffles, then the
//   warps' results in shared memory): lse = m + log s, loss = lse - x[target] (0 when the target is
//   < 0). One read of the logits, deterministic.
// - cross_entropy_backward: one block per row; each thread reads logit j, then writes
//   grad_scale * (exp(x_j - lse) - [j == target]) to the same index j, so dlogits may alias logits
//   (no element is read after any thread has written it: every element has one reader, which is its
//   writer). Ignored rows (target < 0) are written as zeros.
// - bce_with_logits_forward: one block (fixed size) sums max(x, 0) - x t + log1p(exp(-|x|)) over
//   all N, each thread in index order in double, then a fixed tree: the mean is bitwise the same
//   on every run.
// - bce_with_logits_backward: elementwise, grad_scale / N * (sigmoid(x) - t).
// Target indices live on the device and are never read by the host: a target >= V (a caller bug,
// which the CPU op reports) gives NaN for that row's loss and gradient instead of an out-of-range
// read.
#include <cmath>
#include <limits>
#include <string>

#include "common/loss_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/loss.hpp"

namespace moe::cuda_detail::loss_impl {
namespace {

constexpr int kWarp = 32;
constexpr int kRowThreads = 256;  // threads per cross-entropy row
constexpr int kBceSumThreads = 1024;
constexpr int kElementwiseThreads = 256;

// Merges the log-sum-exp state (m2, s2) into (m, s): sum exp(x - m) over both sets. A state that
// holds no elements (m = -inf, s = 0) is neutral.
template <class A>
__device__ __forceinline__ void lse_merge(A& m, A& s, A m2, A s2) {
  if (m2 == neg_inf<A>()) return;
  if (m == neg_inf<A>()) {
    m = m2;
    s = s2;
    return;
  }
  if (m2 > m) {
    s = s * dev_exp(m - m2) + s2;
    m = m2;
  } else {
    s = s + s2 * dev_exp(m2 - m);
  }
}

// Block-wide merge of every thread's (m, s); the result is returned to every thread.
// blockDim.x == kRowThreads.
template <class A>
__device__ void block_lse(A& m, A& s) {
  __shared__ A sh_m[kRowThreads / kWarp], sh_s[kRowThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const A m2 = __shfl_down_sync(0xffffffffu, m, o);
    const A s2 = __shfl_down_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kRowThreads / kWarp; ++w) lse_merge(m, s, sh_m[w], sh_s[w]);
    sh_m[0] = m;
    sh_s[0] = s;
  }
  __syncthreads();
  m = sh_m[0];
  s = sh_s[0];
}

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    ce_forward_kernel(acc_t<T>* __restrict__ losses, acc_t<T>* __restrict__ lse,
                      const T* __restrict__ logits, const int32_t* __restrict__ targets,
                      int64_t v) {
  using A = acc_t<T>;
  const int64_t n = blockIdx.x;
  const T* row = logits + n * v;
  A m = neg_inf<A>(), s = 0;
  for (int64_t j = threadIdx.x; j < v; j += kRowThreads) {
    const A x = load(row[j]);
    if (x > m) {
      s = s * dev_exp(m - x) + A(1);  // exp(-inf) = 0 on the first element
      m = x;
    } else if (x != neg_inf<A>()) {  // (-inf adds 0; skipping it avoids -inf - -inf)
      s += dev_exp(x - m);           // NaN logits propagate through here
    }
  }
  block_lse(m, s);
  if (threadIdx.x != 0) return;
  const A row_lse = m + dev_log(s);
  lse[n] = row_lse;
  const int64_t t = targets[n];
  if (t < 0)
    losses[n] = A(0);
  else if (t >= v)
    losses[n] = std::numeric_limits<A>::quiet_NaN();
  else
    losses[n] = row_lse - load(row[t]);
}

// dlogits and logits may be the same memory: deliberately not __restrict__.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    ce_backward_kernel(T* dlogits, const T* logits, const acc_t<T>* __restrict__ lse,
                       const int32_t* __restrict__ targets, int64_t v, acc_t<T> grad_scale) {
  using A = acc_t<T>;
  const int64_t n = blockIdx.x;
  const int64_t t = targets[n];
  const T* row = logits + n * v;
  T* drow = dlogits + n * v;
  if (t < 0) {
    for (int64_t j = threadIdx.x; j < v; j += kRowThreads) drow[j] = store<T>(A(0));
    return;
  }
  if (t >= v) {
    for (int64_t j = threadIdx.x; j < v; j += kRowThreads)
      drow[j] = store<T>(std::numeric_limits<A>::quiet_NaN());
    return;
  }
  const A row_lse = lse[n];
  for (int64_t j = threadIdx.x; j < v; j += kRowThreads) {
    const A p = dev_exp(load(row[j]) - row_lse);               // read element j ...
    drow[j] = store<T>(grad_scale * (j == t ? p - A(1) : p));  // ... then write it
  }
}

template <class T>
__global__ void __launch_bounds__(kBceSumThreads)
    bce_forward_kernel(T* __restrict__ loss, const T* __restrict__ logits,
                       const T* __restrict__ targets, int64_t n) {
  using A = acc_t<T>;
  __shared__ double sh[kBceSumThreads / kWarp];
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += kBceSumThreads) {
    const A x = load(logits[i]), t = load(targets[i]);
    sum += static_cast<double>((x > A(0) ? x : A(0)) - x * t + dev_log1p(dev_exp(-dev_abs(x))));
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
  if (lane == 0) sh[warp] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  double total = 0;
  for (int w = 0; w < kBceSumThreads / kWarp; ++w) total += sh[w];
  loss[0] = store<T>(static_cast<A>(n > 0 ? total / static_cast<double>(n) : 0.0));
}

// dlogits may alias logits: element i is read, then written, by one thread.
template <class T>
__global__ void bce_backward_kernel(T* dlogits, const T* logits, const T* __restrict__ targets,
                                    int64_t n, acc_t<T> scale) {
  using A = acc_t<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const A x = load(logits[i]), t = load(targets[i]);
    const A sig = A(1) / (A(1) + dev_exp(-x));  // 0 or 1 (never NaN) for large |x|
    dlogits[i] = store<T>(scale * (sig - t));
  }
}

// Host-side part of the CPU op's target check: shape and dtype (values are on the device).
unsigned elementwise_blocks(int64_t n) {
  const int64_t cap = int64_t{1} << 16;  // grid-stride beyond this
  const int64_t b = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > cap ? cap : b));
}

// ---- host side ----------------------------------------------------------------------------------

void cross_entropy_forward_cuda(Ctx& ctx, Tensor losses, Tensor lse, Tensor logits,
                                Tensor targets) {
  check_cross_entropy_forward_args(losses, lse, logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_loss_targets_args(targets, n, "cross_entropy_forward");
  check_on_gpu({&losses, &lse, &logits, &targets}, "cross_entropy_forward");
  if (n == 0) return;
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(), "cross_entropy_forward: too many rows");
  dispatch_storage(logits.dtype, "cross_entropy_forward", [&](auto zero) {
    using T = decltype(zero);
    ce_forward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream_of(ctx)>>>(
        data_of<acc_t<T>>(losses), data_of<acc_t<T>>(lse), data_of<T>(logits),
        static_cast<const int32_t*>(targets.data), v);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void cross_entropy_backward_cuda(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor lse,
                                 Tensor targets, double grad_scale) {
  check_cross_entropy_backward_args(dlogits, logits, lse);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_loss_targets_args(targets, n, "cross_entropy_backward");
  check_on_gpu({&dlogits, &logits, &lse, &targets}, "cross_entropy_backward");
  if (n == 0) return;
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(), "cross_entropy_backward: too many rows");
  dispatch_storage(logits.dtype, "cross_entropy_backward", [&](auto zero) {
    using T = decltype(zero);
    ce_backward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dlogits), data_of<T>(logits), data_of<acc_t<T>>(lse),
        static_cast<const int32_t*>(targets.data), v, static_cast<acc_t<T>>(grad_scale));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void bce_with_logits_forward_cuda(Ctx& ctx, Tensor loss, Tensor logits, Tensor targets) {
  check_bce_with_logits_forward_args(loss, logits, targets);
  check_on_gpu({&loss, &logits, &targets}, "bce_with_logits_forward");
  dispatch_storage(logits.dtype, "bce_with_logits_forward", [&](auto zero) {
    using T = decltype(zero);
    bce_forward_kernel<T><<<1, kBceSumThreads, 0, stream_of(ctx)>>>(
        data_of<T>(loss), data_of<T>(logits), data_of<T>(targets), logits.size(0));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void bce_with_logits_backward_cuda(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor targets,
                                   double grad_scale) {
  check_bce_with_logits_backward_args(dlogits, logits, targets);
  check_on_gpu({&dlogits, &logits, &targets}, "bce_with_logits_backward");
  const int64_t n = logits.size(0);
  if (n == 0) return;
  const double scale = grad_scale / static_cast<double>(n);
  dispatch_storage(logits.dtype, "bce_with_logits_backward", [&](auto zero) {
    using T = decltype(zero);
    bce_backward_kernel<T><<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dlogits), data_of<T>(logits), data_of<T>(targets), n,
        static_cast<acc_t<T>>(scale));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail::loss_impl

MOE_REGISTER_CUDA_OP(cross_entropy_forward,
                     &::moe::cuda_detail::loss_impl::cross_entropy_forward_cuda);
MOE_REGISTER_CUDA_OP(cross_entropy_backward,
                     &::moe::cuda_detail::loss_impl::cross_entropy_backward_cuda);
MOE_REGISTER_CUDA_OP(bce_with_logits_forward,
                     &::moe::cuda_detail::loss_impl::bce_with_logits_forward_cuda);
MOE_REGISTER_CUDA_OP(bce_with_logits_backward,
                     &::moe::cuda_detail::loss_impl::bce_with_logits_backward_cuda);
