// MoE router on CUDA: softmax over experts, top-K selection, renormalisation and per-expert counts
// in one launch; its backward; the auxiliary load-balance and z losses and their gradient; the
// aux-loss-free bias update. Semantics follow kernels/cpu/router.cpp exactly.
//
// Design:
// - One warp per token (8 tokens per 256-thread block). Lanes stride over the E experts; warp
//   reductions are xor butterflies, so every lane ends with the bitwise same value and the result
//   does not depend on timing.
// - Softmax and weights run in fp32 for f32/f16/bf16 storage (double for f64). The selection score
//   logits + bias is formed and compared in double, exactly as the CPU reference does, so the
//   selected experts (and the tie-break: higher score first, then lower expert index) agree
//   bitwise with the CPU on the same stored values. The K picks are K warp-wide argmax passes,
//   each taking "the best expert ranked after the previous pick" (the CPU's stateless scan), which
//   lists them in descending score order.
// - counts: a cudaMemsetAsync on the op's stream zeroes them, then lane 0 of each warp adds its
//   picks with integer atomics (exact, order-independent).
// - A row whose score is not finite cannot throw on the device without a host read: it gets
//   topk_idx = -1 and weight 0 and is left out of counts (the CPU op throws for such a row).
// - The aux-loss forward is one 1024-thread block: warp w handles rows w, w+32, ... in order and
//   accumulates them in double; the 32 warp partials are added in warp order. Deterministic.
// - The bias update is one block with a fixed-order tree sum of the loads in double.
// - add_counts (acc += counts, f32 / f64 acc) is one thread per expert: exact for integer loads
//   below 2^24 in f32, so the micro-batches' sum is the same in any order.
#include <cfloat>
#include <cstdint>
#include <string>

#include "common/router_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/router.hpp"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kTokensPerBlock = 8;  // warps per block of the per-token kernels
constexpr int kAuxThreads = 1024;   // the single block of the aux-loss forward

template <class A>
__device__ __forceinline__ A warp_max(A v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Selection order: a ranks before b when its score is higher, or equal with a lower index.
__device__ __forceinline__ bool ranks_before(double sa, int a, double sb, int b) {
  return sa > sb || (sa == sb && a < b);
}

// log(sum_e exp(l_e)) of one row, warp-wide (every lane gets it).  l: [E]
template <class T>
__device__ acc_t<T> warp_logsumexp(const T* l, int n_exp, int lane) {
  using A = acc_t<T>;
  A mx = -INFINITY;
  for (int e = lane; e < n_exp; e += kWarp) mx = max(mx, load(l[e]));
  mx = warp_max(mx);
  A s = 0;
  for (int e = lane; e < n_exp; e += kWarp) s += dev_exp(load(l[e]) - mx);
  return mx + dev_log(warp_sum(s));
}

// ---- top-K forward ------------------------------------------------------------------------------

template <class T>
__global__ void topk_forward_kernel(T* __restrict__ probs, int32_t* __restrict__ idx,
                                    T* __restrict__ w, int32_t* __restrict__ counts,
                                    const T* __restrict__ logits, const T* __restrict__ bias,
                                    int64_t n_tok, int n_exp, int k, bool norm_topk_prob) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + threadIdx.x / kWarp;
  if (n >= n_tok) return;  // the whole warp leaves together
  const T* l = logits + n * n_exp;
  auto score = [&](int e) {
    return static_cast<double>(load(l[e])) + (bias ? static_cast<double>(load(bias[e])) : 0.0);
  };

  // Softmax: p_e = exp(l_e - max) / sum.
  A mx = -INFINITY;
  bool finite = true;
  for (int e = lane; e < n_exp; e += kWarp) {
    mx = max(mx, load(l[e]));
    finite = finite && isfinite(score(e));
  }
  mx = warp_max(mx);
  finite = __all_sync(kFullMask, finite);
  A sum = 0;
  for (int e = lane; e < n_exp; e += kWarp) sum += dev_exp(load(l[e]) - mx);
  sum = warp_sum(sum);
  T* p = probs + n * n_exp;
  for (int e = lane; e < n_exp; e += kWarp) p[e] = store<T>(dev_exp(load(l[e]) - mx) / sum);

  // K argmax passes, each over the experts ranked after the previous pick.
  int32_t* in = idx + n * k;
  int prev = -1;
  double prev_score = 0;
  A sum_topk = 0;  // in pick order, like the CPU
  for (int j = 0; j < k; ++j) {
    int best = -1;
    double best_score = 0;
    if (finite) {
      for (int e = lane; e < n_exp; e += kWarp) {
        const double s = score(e);
        const bool after_prev = prev < 0 || ranks_before(prev_score, prev, s, e);
        if (after_prev && (best < 0 || ranks_before(s, e, best_score, best))) {
          best = e;
          best_score = s;
        }
      }
    }
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const int other = __shfl_xor_sync(kFullMask, best, o);
      const double other_score = __shfl_xor_sync(kFullMask, best_score, o);
      if (other >= 0 && (best < 0 || ranks_before(other_score, other, best_score, best))) {
        best = other;
        best_score = other_score;
      }
    }
    if (lane == 0) {
      in[j] = best;
      if (best >= 0) atomicAdd(&counts[best], 1);
    }
    if (best >= 0) sum_topk += dev_exp(load(l[best]) - mx) / sum;
    prev = best;
    prev_score = best_score;
  }
  __syncwarp();  // lane 0's writes of `in` are visible to the warp
  for (int j = lane; j < k; j += kWarp) {
    const int e = in[j];
    const A pj = e >= 0 ? dev_exp(load(l[e]) - mx) / sum : A(0);
    w[n * k + j] = store<T>(norm_topk_prob ? (sum_topk > A(0) ? pj / sum_topk : A(0)) : pj);
  }
}

// ---- top-K backward -----------------------------------------------------------------------------

template <class T>
__global__ void topk_backward_kernel(T* __restrict__ dlogits, const T* __restrict__ dtopk_w,
                                     const T* __restrict__ probs, const int32_t* __restrict__ idx,
                                     int64_t n_tok, int n_exp, int k, bool norm_topk_prob) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + threadIdx.x / kWarp;
  if (n >= n_tok) return;
  const T* p = probs + n * n_exp;
  const T* dw = dtopk_w + n * k;
  const int32_t* in = idx + n * k;
  auto valid = [&](int j) { return in[j] >= 0 && in[j] < n_exp; };  // invalid picks are skipped
  // Renormalisation w_j = p_j / S:  dp_j = (dw_j - sum_i dw_i w_i) / S on the top-K.
  A sum_topk = 0;
  for (int j = lane; j < k; j += kWarp) sum_topk += valid(j) ? load(p[in[j]]) : A(0);
  sum_topk = warp_sum(sum_topk);
  A dw_dot_w = 0;
  for (int j = lane; j < k; j += kWarp)
    dw_dot_w += valid(j) ? load(dw[j]) * load(p[in[j]]) / sum_topk : A(0);
  dw_dot_w = warp_sum(dw_dot_w);
  auto dp = [&](int j) {
    return norm_topk_prob ? (load(dw[j]) - dw_dot_w) / sum_topk : load(dw[j]);
  };
  // Softmax: dl_e = p_e * (dp_e - sum_j p_j dp_j).
  A p_dot_dp = 0;
  for (int j = lane; j < k; j += kWarp) p_dot_dp += valid(j) ? load(p[in[j]]) * dp(j) : A(0);
  p_dot_dp = warp_sum(p_dot_dp);
  T* dl = dlogits + n * n_exp;
  for (int e = lane; e < n_exp; e += kWarp) dl[e] = store<T>(-load(p[e]) * p_dot_dp);
  __syncwarp();  // the selected entries below overwrite the ones just written
  for (int j = lane; j < k; j += kWarp)
    if (valid(j)) dl[in[j]] = store<T>(load(p[in[j]]) * (dp(j) - p_dot_dp));
}

// ---- auxiliary losses ---------------------------------------------------------------------------

// d aux / d p_ne = aux_coef * E * f_e / N, f_e = count_e / (N*K); factors: [E] in shared memory.
template <class A>
__device__ void fill_aux_factors(A* factors, const int32_t* counts, int64_t n_tok, int n_exp, int k,
                                 double aux_coef) {
  for (int e = threadIdx.x; e < n_exp; e += blockDim.x)
    factors[e] = static_cast<A>(
        aux_coef * n_exp * (static_cast<double>(counts[e]) / (static_cast<double>(n_tok) * k)) /
        static_cast<double>(n_tok));
  __syncthreads();
}

template <class T>
__global__ void __launch_bounds__(kAuxThreads)
    aux_forward_kernel(T* __restrict__ losses, const T* __restrict__ logits,
                       const T* __restrict__ probs, const int32_t* __restrict__ counts,
                       int64_t n_tok, int n_exp, int k, double aux_coef, double z_coef) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* factors = reinterpret_cast<A*>(smem);
  __shared__ double part_aux[kAuxThreads / kWarp], part_z[kAuxThreads / kWarp];
  fill_aux_factors(factors, counts, n_tok, n_exp, k, aux_coef);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  // One token per thread (router rows are short: E values), so all 1024 threads stream the
  // [N, E] rows; a warp per token left most lanes idle on E = 8 and took ~0.5 ms at N = 16k.
  double aux = 0, z = 0;
  for (int64_t n = threadIdx.x; n < n_tok; n += blockDim.x) {
    const T* pn = probs + n * n_exp;
    const T* ln = logits + n * n_exp;
    A s = 0, mx = -INFINITY;
    for (int e = 0; e < n_exp; ++e) {
      s += factors[e] * load(pn[e]);
      mx = max(mx, load(ln[e]));
    }
    A sum = 0;
    for (int e = 0; e < n_exp; ++e) sum += dev_exp(load(ln[e]) - mx);
    const A lse = mx + dev_log(sum);
    aux += static_cast<double>(s);
    z += static_cast<double>(lse) * static_cast<double>(lse);
  }
  aux = warp_sum(aux);  // fixed butterfly order: deterministic
  z = warp_sum(z);
  if (lane == 0) {
    part_aux[warp] = aux;
    part_z[warp] = z;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double ta = 0, tz = 0;
    for (int i = 0; i < warps; ++i) {
      ta += part_aux[i];
      tz += part_z[i];
    }
    losses[0] = store<T>(static_cast<A>(n_tok > 0 ? ta : 0.0));
    losses[1] =
        store<T>(static_cast<A>(n_tok > 0 ? z_coef * tz / static_cast<double>(n_tok) : 0.0));
  }
}

template <class T>
__global__ void aux_backward_kernel(T* __restrict__ dlogits, const T* __restrict__ logits,
                                    const T* __restrict__ probs, const int32_t* __restrict__ counts,
                                    int64_t n_tok, int n_exp, int k, double aux_coef, double z_coef,
                                    double grad_scale) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* factors = reinterpret_cast<A*>(smem);
  fill_aux_factors(factors, counts, n_tok, n_exp, k, aux_coef);
  const int lane = threadIdx.x % kWarp;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + threadIdx.x / kWarp;
  if (n >= n_tok) return;  // after the block barrier in fill_aux_factors
  const T* pn = probs + n * n_exp;
  // aux through the softmax: p_e (g_e - sum_j p_j g_j); z: z_coef * 2 lse / N * p_e.
  A p_dot_g = 0;
  for (int e = lane; e < n_exp; e += kWarp) p_dot_g += load(pn[e]) * factors[e];
  p_dot_g = warp_sum(p_dot_g);
  const A lse = warp_logsumexp(logits + n * n_exp, n_exp, lane);
  const A dz_dlse = static_cast<A>(z_coef * 2.0 / static_cast<double>(n_tok)) * lse;
  const A scale = static_cast<A>(grad_scale);
  T* dl = dlogits + n * n_exp;
  for (int e = lane; e < n_exp; e += kWarp) {
    const A pe = load(pn[e]);
    dl[e] = store<T>(load(dl[e]) + scale * (pe * (factors[e] - p_dot_g) + dz_dlse * pe));
  }
}

// ---- bias update --------------------------------------------------------------------------------

constexpr int kBiasThreads = 256;

template <class T>
__global__ void __launch_bounds__(kBiasThreads)
    bias_update_kernel(T* __restrict__ bias, const T* __restrict__ load_e, int n_exp, double rate) {
  __shared__ double part[kBiasThreads];
  double s = 0;
  for (int e = threadIdx.x; e < n_exp; e += kBiasThreads) s += static_cast<double>(load(load_e[e]));
  part[threadIdx.x] = s;
  __syncthreads();
  for (int h = kBiasThreads / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  const double mean = part[0] / n_exp;
  for (int e = threadIdx.x; e < n_exp; e += kBiasThreads) {
    const double err = mean - static_cast<double>(load(load_e[e]));
    const double sign = err > 0 ? 1.0 : (err < 0 ? -1.0 : 0.0);
    bias[e] = store<T>(static_cast<acc_t<T>>(static_cast<double>(load(bias[e])) + rate * sign));
  }
}

// ---- add_counts ---------------------------------------------------------------------------------

constexpr int kCountThreads = 256;

template <class A>
__global__ void add_counts_kernel(A* __restrict__ acc, const int32_t* __restrict__ counts,
                                  int64_t n_exp) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n_exp) acc[e] += static_cast<A>(counts[e]);
}

// ---- host side ----------------------------------------------------------------------------------

unsigned token_blocks(int64_t n_tok) {
  return blocks_for(n_tok, kTokensPerBlock);
}

void router_topk_forward(Ctx& ctx, Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor counts,
                         Tensor logits, Tensor bias, bool norm_topk_prob) {
  check_router_topk_forward_args(probs, topk_idx, topk_w, counts, logits, bias);
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1), k = topk_idx.size(1);
  cudaStream_t stream = stream_of(ctx);
  MOE_CUDA_CHECK(cudaMemsetAsync(counts.data, 0, counts.nbytes(), stream));
  if (n_tok == 0) return;
  dispatch_storage(logits.dtype, "router_topk_forward", [&](auto zero) {
    using T = decltype(zero);
    topk_forward_kernel<T><<<token_blocks(n_tok), kTokensPerBlock * kWarp, 0, stream>>>(
        static_cast<T*>(probs.data), static_cast<int32_t*>(topk_idx.data),
        static_cast<T*>(topk_w.data), static_cast<int32_t*>(counts.data),
        static_cast<const T*>(logits.data), static_cast<const T*>(bias.data), n_tok,
        static_cast<int>(n_exp), static_cast<int>(k), norm_topk_prob);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void router_topk_backward(Ctx& ctx, Tensor dlogits, Tensor dtopk_w, Tensor probs, Tensor topk_idx,
                          bool norm_topk_prob) {
  check_router_topk_backward_args(dlogits, dtopk_w, probs, topk_idx);
  const int64_t n_tok = probs.size(0), n_exp = probs.size(1), k = topk_idx.size(1);
  if (n_tok == 0) return;
  dispatch_storage(probs.dtype, "router_topk_backward", [&](auto zero) {
    using T = decltype(zero);
    topk_backward_kernel<T><<<token_blocks(n_tok), kTokensPerBlock * kWarp, 0, stream_of(ctx)>>>(
        static_cast<T*>(dlogits.data), static_cast<const T*>(dtopk_w.data),
        static_cast<const T*>(probs.data), static_cast<const int32_t*>(topk_idx.data), n_tok,
        static_cast<int>(n_exp), static_cast<int>(k), norm_topk_prob);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void router_aux_loss_forward(Ctx& ctx, Tensor losses, Tensor logits, Tensor probs, Tensor counts,
                             int k, double aux_coef, double z_coef) {
  check_router_aux_loss_forward_args(losses, logits, probs, counts, k);
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  dispatch_storage(logits.dtype, "router_aux_loss_forward", [&](auto zero) {
    using T = decltype(zero);
    const size_t smem = static_cast<size_t>(n_exp) * sizeof(acc_t<T>);
    aux_forward_kernel<T><<<1, kAuxThreads, smem, stream_of(ctx)>>>(
        static_cast<T*>(losses.data), static_cast<const T*>(logits.data),
        static_cast<const T*>(probs.data), static_cast<const int32_t*>(counts.data), n_tok,
        static_cast<int>(n_exp), k, aux_coef, z_coef);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void router_aux_loss_backward(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor probs, Tensor counts,
                              int k, double aux_coef, double z_coef, double grad_scale) {
  check_router_aux_loss_backward_args(dlogits, logits, probs, counts, k);
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  if (n_tok == 0) return;
  dispatch_storage(logits.dtype, "router_aux_loss_backward", [&](auto zero) {
    using T = decltype(zero);
    const size_t smem = static_cast<size_t>(n_exp) * sizeof(acc_t<T>);
    aux_backward_kernel<T><<<token_blocks(n_tok), kTokensPerBlock * kWarp, smem, stream_of(ctx)>>>(
        static_cast<T*>(dlogits.data), static_cast<const T*>(logits.data),
        static_cast<const T*>(probs.data), static_cast<const int32_t*>(counts.data), n_tok,
        static_cast<int>(n_exp), k, aux_coef, z_coef, grad_scale);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void router_bias_update(Ctx& ctx, Tensor bias, Tensor load, double rate) {
  check_router_bias_update_args(bias, load);
  const int64_t n_exp = bias.size(0);
  if (n_exp == 0) return;
  dispatch_storage(bias.dtype, "router_bias_update", [&](auto zero) {
    using T = decltype(zero);
    bias_update_kernel<T><<<1, kBiasThreads, 0, stream_of(ctx)>>>(static_cast<T*>(bias.data),
                                                                  static_cast<const T*>(load.data),
                                                                  static_cast<int>(n_exp), rate);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void add_counts(Ctx& ctx, Tensor acc, Tensor counts) {
  check_add_counts_args(acc, counts);
  check_on_gpu({&acc, &counts}, "add_counts");
  const int64_t n_exp = acc.size(0);
  if (n_exp == 0) return;
  dispatch_acc(acc.dtype, "add_counts", [&](auto zero) {
    using A = decltype(zero);
    add_counts_kernel<A><<<blocks_for(n_exp, kCountThreads), kCountThreads, 0, stream_of(ctx)>>>(
        static_cast<A*>(acc.data), static_cast<const int32_t*>(counts.data), n_exp);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(router_topk_forward, &::moe::cuda_detail::router_topk_forward);
MOE_REGISTER_CUDA_OP(router_topk_backward, &::moe::cuda_detail::router_topk_backward);
MOE_REGISTER_CUDA_OP(router_aux_loss_forward, &::moe::cuda_detail::router_aux_loss_forward);
MOE_REGISTER_CUDA_OP(router_aux_loss_backward, &::moe::cuda_detail::router_aux_loss_backward);
MOE_REGISTER_CUDA_OP(router_bias_update, &::moe::cuda_detail::router_bias_update);
MOE_REGISTER_CUDA_OP(add_counts, &::moe::cuda_detail::add_counts);
