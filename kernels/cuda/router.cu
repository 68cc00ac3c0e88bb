// MoE router on CUDA: softmax over experts, top-K selection, renormalisation and per-expert counts
// in one launch; its backward; the auxiliary load-balance and z losses and their gradient; the
// aux-loss-free bias update. Semantics follow kernels/cpu/router.cpp exactly. The per-token code
// of the top-K forward (layouts, butterflies, selection order, TokenRouter, finish_counts) lives in
// router_rows.cuh, shared with router_fused.cu's one-launch router_forward.
//
// Design (router rows are short, E values, and the ops are bandwidth-bound passes over [N, E]):
// - A group of G lanes per token, G the smallest power of 2 (<= 32) with 8 * G >= E, so each lane
//   owns at most 8 of the row's values (all of them in registers up to E = 256; beyond that the
//   ninth and later are read again for each pass). When E / G is a whole number of 16-byte vectors
//   a lane owns a contiguous run and loads it with 16-byte accesses; otherwise lanes own every G-th
//   value, so each warp access still covers whole sectors. Which layout is used depends on the
//   shape only, so the bits of every result do too. A block walks tokens grid-stride; the grid
//   depends only on N and E.
// - Group reductions are xor butterflies: every lane of the group ends with the bitwise same
//   value, independent of timing.
// - Softmax and weights run in fp32 for f32/f16/bf16 storage (double for f64). The selection score
//   logits + bias is formed and compared in double, exactly as the CPU reference does, so the
//   selected experts (and the tie-break: higher score first, then lower expert index) agree
//   bitwise with the CPU. Without bias and with 16/32-bit logits the score is the float logit, and
//   (score, index) packs into one 64-bit integer key. Each lane sorts its own candidates once (a
//   19-comparator network); then each of the K picks is one group argmax of the lanes' heads and
//   the winning lane pops its head. Picks come out in descending score order, G at a time: lane g
//   ends a batch holding its pick g, so indices, counts and the renormalisation sum cost one
//   group step per batch, not per pick (the sum is added per batch, a rounding away from the CPU's
//   one-by-one order).
// - counts: each block counts its picks in shared memory (integer atomics: exact); blocks add
//   those into an accumulator in a per-device scratch, and the last block to finish (a ticket)
//   moves the totals to `counts` and zeroes the accumulator. One launch, no memset per call.
// - A row whose score is not finite cannot throw on the device without a host read: it gets
//   topk_idx = -1 and weight 0 and is left out of counts (the CPU op throws for such a row).
// - The aux-loss forward sums each block's tokens (in a fixed order) into a double partial; the
//   last block adds the partials in block order. Deterministic for a given shape.
// - The bias update is one block with a fixed-order tree sum of the loads in double.
// - add_counts (acc += counts, f32 / f64 acc) is one thread per expert: exact for integer loads
//   below 2^24 in f32, so the micro-batches' sum is the same in any order.
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "common/router_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/router_rows.cuh"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/router.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 128;  // threads per block of the per-token kernels

// ---- top-K forward ------------------------------------------------------------------------------

template <class T, bool kPacked>
__global__ void __launch_bounds__(kThreads)
    topk_forward_kernel(T* __restrict__ probs, int32_t* __restrict__ idx, T* __restrict__ w,
                        int32_t* __restrict__ counts, const T* __restrict__ logits,
                        const T* __restrict__ bias, int64_t n_tok, int n_exp, int k,
                        bool norm_topk_prob, RowLayout lay, RouterScratch scratch,
                        bool hist_in_smem) {
  using A = acc_t<T>;
  extern __shared__ int32_t smem_hist[];
  int32_t* hist = hist_in_smem ? smem_hist : scratch.count_acc;
  if (hist_in_smem) {
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x) hist[e] = 0;
    __syncthreads();
  }
  const TokenRouter<T, kPacked> router(probs, idx, w, hist, bias, n_exp, k, norm_topk_prob, lay);
  const int tokens = kThreads >> lay.log2_group;
  for (int64_t base = int64_t(blockIdx.x) * tokens; base < n_tok;
       base += int64_t(gridDim.x) * tokens) {
    const int64_t n = base + (threadIdx.x >> lay.log2_group);
    const bool valid = n < n_tok;  // lanes past the end still join the butterflies
    const int64_t row_n = valid ? n : 0;
    const T* l = logits + row_n * n_exp;
    A x[kLaneValues];
    load_lane(x, l, router.span, lay.vec);
    router.route(x, l, row_n, valid);
  }
  finish_counts(counts, hist, hist_in_smem, scratch, n_exp);
}

// ---- top-K backward -----------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
    topk_backward_kernel(T* __restrict__ dlogits, const T* __restrict__ dtopk_w,
                         const T* __restrict__ probs, const int32_t* __restrict__ idx,
                         int64_t n_tok, int n_exp, int k, bool norm_topk_prob, RowLayout lay) {
  using A = acc_t<T>;
  const int group = lay.group, lane_g = threadIdx.x & (group - 1);
  const LaneSpan span = lane_span(lay, n_exp, lane_g);
  const int tokens = kThreads >> lay.log2_group;
  for (int64_t base = int64_t(blockIdx.x) * tokens; base < n_tok;
       base += int64_t(gridDim.x) * tokens) {
    const int64_t n = base + (threadIdx.x >> lay.log2_group);
    const bool valid = n < n_tok;
    const int64_t row_n = valid ? n : 0;
    const T* p = probs + row_n * n_exp;
    const T* dw = dtopk_w + row_n * k;
    const int32_t* in = idx + row_n * k;
    auto pick = [&](int j) {  // invalid picks are skipped
      const int e = in[j];
      return e >= 0 && e < n_exp ? e : -1;
    };
    // Renormalisation w_j = p_j / S:  dp_j = (dw_j - sum_i dw_i w_i) / S on the top-K.
    A sum_topk = 0;
    for (int j = lane_g; j < k; j += group) {
      const int e = pick(j);
      if (e >= 0) sum_topk += load(p[e]);
    }
    sum_topk = group_sum(sum_topk, group);
    A dw_dot_w = 0;
    for (int j = lane_g; j < k; j += group) {
      const int e = pick(j);
      if (e >= 0) dw_dot_w += load(dw[j]) * (load(p[e]) / sum_topk);  // w_j as the forward
    }
    dw_dot_w = group_sum(dw_dot_w, group);
    auto dp = [&](int j) {
      return norm_topk_prob ? (load(dw[j]) - dw_dot_w) / sum_topk : load(dw[j]);
    };
    // Softmax: dl_e = p_e * (dp_e - sum_j p_j dp_j).
    A p_dot_dp = 0;
    for (int j = lane_g; j < k; j += group) {
      const int e = pick(j);
      if (e >= 0) p_dot_dp += load(p[e]) * dp(j);
    }
    p_dot_dp = group_sum(p_dot_dp, group);
    A x[kLaneValues];
    load_lane(x, p, span, lay.vec);
    T* dl = dlogits + row_n * n_exp;
    if (valid)
      store_lane(dl, span, lay.vec, [&](int i, int e, bool cached) {
        return -(cached ? x[i] : load(p[e])) * p_dot_dp;
      });
    __syncwarp();  // the selected entries below overwrite ones just written by other lanes
    if (valid)
      for (int j = lane_g; j < k; j += group) {
        const int e = pick(j);
        if (e >= 0) dl[e] = store<T>(load(p[e]) * (dp(j) - p_dot_dp));
      }
  }
}

// ---- auxiliary losses ---------------------------------------------------------------------------

// d aux / d p_ne = aux_coef * E * f_e / N = factor_scale * count_e, f_e = count_e / (N*K): the
// lane's experts are the same for every token, so their factors are computed once.
template <class A>
__device__ __forceinline__ void lane_factors(A (&g)[kLaneValues], const int32_t* counts,
                                             const LaneSpan& s, A factor_scale) {
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i)
    g[i] = i < s.count ? factor_scale * static_cast<A>(counts[s.expert(i)]) : A(0);
}

// log(sum_e exp(l_e)) of one row over the token's lanes (every lane gets it).
template <class T>
__device__ __forceinline__ acc_t<T> group_logsumexp(const acc_t<T> (&x)[kLaneValues], const T* l,
                                                    const LaneSpan& s, int group) {
  using A = acc_t<T>;
  A mx = neg_inf<A>();
  for_lane(x, l, s, [&](int, int, A v, bool) { mx = max(mx, v); });
  mx = group_max(mx, group);
  A sum = 0;
  for_lane(x, l, s, [&](int, int, A v, bool) { sum += dev_exp(v - mx); });
  return mx + dev_log(group_sum(sum, group));
}

// Sum of a and b over the block in a fixed order, valid in thread 0.
__device__ void block_sum2(double& a, double& b) {
  __shared__ double part[2][kThreads / kWarp];
  a = warp_sum(a);
  b = warp_sum(b);
  if (threadIdx.x % kWarp == 0) {
    part[0][threadIdx.x / kWarp] = a;
    part[1][threadIdx.x / kWarp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = b = 0;
    for (int i = 0; i < kThreads / kWarp; ++i) {
      a += part[0][i];
      b += part[1][i];
    }
  }
  __syncthreads();
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    aux_forward_kernel(T* __restrict__ losses, const T* __restrict__ logits,
                       const T* __restrict__ probs, const int32_t* __restrict__ counts,
                       int64_t n_tok, int n_exp, acc_t<T> factor_scale, double z_coef,
                       RowLayout lay, RouterScratch scratch) {
  using A = acc_t<T>;
  const int group = lay.group, lane_g = threadIdx.x & (group - 1);
  const LaneSpan span = lane_span(lay, n_exp, lane_g);
  const int tokens = kThreads >> lay.log2_group;
  A g[kLaneValues];
  lane_factors(g, counts, span, factor_scale);
  // aux = sum_n sum_e g_e p_ne (aux is linear in p with f held constant); z = mean_n lse_n^2.
  double aux = 0, z = 0;  // this lane's tokens, in token order (group leaders only)
  for (int64_t base = int64_t(blockIdx.x) * tokens; base < n_tok;
       base += int64_t(gridDim.x) * tokens) {
    const int64_t n = base + (threadIdx.x >> lay.log2_group);
    const bool valid = n < n_tok;
    const int64_t row_n = valid ? n : 0;
    const T* p = probs + row_n * n_exp;
    const T* l = logits + row_n * n_exp;
    A xp[kLaneValues], xl[kLaneValues];
    load_lane(xp, p, span, lay.vec);
    load_lane(xl, l, span, lay.vec);
    A s = 0;
    for_lane(xp, p, span, [&](int i, int e, A v, bool cached) {
      s += (cached ? g[i] : factor_scale * static_cast<A>(counts[e])) * v;
    });
    s = group_sum(s, group);
    const A lse = group_logsumexp(xl, l, span, group);
    if (valid && lane_g == 0) {
      aux += static_cast<double>(s);
      z += static_cast<double>(lse) * static_cast<double>(lse);
    }
  }
  // Block partial, then the last block adds the partials in block order.
  block_sum2(aux, z);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    scratch.partials[2 * blockIdx.x] = aux;
    scratch.partials[2 * blockIdx.x + 1] = z;
    __threadfence();
    last = atomicAdd(&scratch.tickets[1], 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  aux = z = 0;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += kThreads) {
    aux += __ldcg(&scratch.partials[2 * b]);
    z += __ldcg(&scratch.partials[2 * b + 1]);
  }
  block_sum2(aux, z);
  if (threadIdx.x == 0) {
    losses[0] = store<T>(static_cast<A>(aux));
    losses[1] = store<T>(static_cast<A>(z_coef * z / static_cast<double>(n_tok)));
    scratch.tickets[1] = 0;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    aux_backward_kernel(T* __restrict__ dlogits, const T* __restrict__ logits,
                        const T* __restrict__ probs, const int32_t* __restrict__ counts,
                        int64_t n_tok, int n_exp, acc_t<T> factor_scale, acc_t<T> dz_scale,
                        acc_t<T> grad_scale, RowLayout lay) {
  using A = acc_t<T>;
  const int group = lay.group, lane_g = threadIdx.x & (group - 1);
  const LaneSpan span = lane_span(lay, n_exp, lane_g);
  const int tokens = kThreads >> lay.log2_group;
  A g[kLaneValues];
  lane_factors(g, counts, span, factor_scale);
  auto factor = [&](int i, int e, bool cached) {
    return cached ? g[i] : factor_scale * static_cast<A>(counts[e]);
  };
  for (int64_t base = int64_t(blockIdx.x) * tokens; base < n_tok;
       base += int64_t(gridDim.x) * tokens) {
    const int64_t n = base + (threadIdx.x >> lay.log2_group);
    const bool valid = n < n_tok;
    const int64_t row_n = valid ? n : 0;
    const T* p = probs + row_n * n_exp;
    const T* l = logits + row_n * n_exp;
    T* dl = dlogits + row_n * n_exp;
    A xp[kLaneValues], xl[kLaneValues], xd[kLaneValues];
    load_lane(xp, p, span, lay.vec);
    load_lane(xl, l, span, lay.vec);
    load_lane(xd, dl, span, lay.vec);
    // aux through the softmax: p_e (g_e - sum_j p_j g_j); z: z_coef * 2 lse / N * p_e.
    A p_dot_g = 0;
    for_lane(xp, p, span,
             [&](int i, int e, A v, bool cached) { p_dot_g += v * factor(i, e, cached); });
    p_dot_g = group_sum(p_dot_g, group);
    const A dz_dlse = dz_scale * group_logsumexp(xl, l, span, group);
    if (valid)
      store_lane(dl, span, lay.vec, [&](int i, int e, bool cached) {
        const A pe = cached ? xp[i] : load(p[e]);
        const A d0 = cached ? xd[i] : load(dl[e]);
        return d0 + grad_scale * (pe * (factor(i, e, cached) - p_dot_g) + dz_dlse * pe);
      });
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

// The scratch of the current device, allocated (zeroed, on `stream`) on first use and again only
// when a larger E arrives; kept for the life of the process, so steady-state calls allocate
// nothing. Like sum_squares_scratch (elementwise.cu) its use is ordered by the op's stream: ops of
// one device share one stream, and calls on different streams of one device are not supported.
RouterScratch router_scratch(int64_t n_exp, cudaStream_t stream) {
  static std::mutex mutex;
  struct Slot {
    char* base = nullptr;
    int64_t n_exp = 0;
  };
  static std::vector<Slot> per_device;
  constexpr size_t kHead = 16 + 2 * kMaxBlocks * sizeof(double);  // tickets, partials
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mutex);
  if (per_device.size() <= static_cast<size_t>(dev)) per_device.resize(dev + 1);
  Slot& s = per_device[dev];
  if (s.n_exp < n_exp) {
    // cudaMalloc / cudaDeviceSynchronize are illegal while `stream` is captured (global mode), and
    // in relaxed mode the zeroing memset would only be recorded into the graph, leaving eager
    // calls before its first replay with garbage tickets: allocate outside a capture only.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    MOE_CHECK(
        capture == cudaStreamCaptureStatusNone,
        "router: the per-device scratch for E = " + std::to_string(n_exp) +
            " must first be allocated outside a CUDA graph capture (run the op eagerly once)");
    const int64_t cap = std::max<int64_t>(n_exp, 256);
    const size_t bytes = kHead + static_cast<size_t>(cap) * sizeof(int32_t);
    if (s.base) {  // kernels queued earlier may still use the old one
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      MOE_CUDA_CHECK(cudaFree(s.base));
      s = Slot{};
    }
    MOE_CUDA_CHECK(cudaMalloc(&s.base, bytes));
    MOE_CUDA_CHECK(cudaMemsetAsync(s.base, 0, bytes, stream));
    s.n_exp = cap;
  }
  return {reinterpret_cast<int*>(s.base), reinterpret_cast<double*>(s.base + 16),
          reinterpret_cast<int32_t*>(s.base + kHead)};
}

// The group and value layout of [N, E] rows of T (see RowLayout); `rows`: the row tensors'
// pointers, which must all be 16-byte aligned for vector access.
template <class T>
RowLayout row_layout(int64_t n_exp, std::initializer_list<const void*> rows) {
  int log2_group = 0;
  while (log2_group < 5 && (kLaneValues << log2_group) < n_exp) ++log2_group;
  const int group = 1 << log2_group;
  const int64_t v = n_exp / group;
  const bool contiguous = n_exp % group == 0 && v <= kLaneValues && v % kVec<T> == 0;
  return {group, log2_group, contiguous, contiguous && aligned16(rows)};
}

// The grid depends only on N and E (through the group size): reductions are fixed per shape.
unsigned row_grid(int64_t n_tok, const RowLayout& lay) {
  return static_cast<unsigned>(
      std::min<int64_t>(blocks_for(n_tok, kThreads >> lay.log2_group), kMaxBlocks));
}

// aux_coef * E / (N * K * N): d aux / d p_ne = this * count_e.
double aux_factor_scale(double aux_coef, int64_t n_exp, int64_t n_tok, int k) {
  return aux_coef * static_cast<double>(n_exp) /
         (static_cast<double>(n_tok) * k * static_cast<double>(n_tok));
}

// Per-block counts live in shared memory up to this (E <= 8192), within the 48 KiB a launch may
// take without opting in; larger E count straight into the scratch accumulator.
constexpr size_t kMaxHistBytes = 32 * 1024;

void router_topk_forward(Ctx& ctx, Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor counts,
                         Tensor logits, Tensor bias, bool norm_topk_prob) {
  check_router_topk_forward_args(probs, topk_idx, topk_w, counts, logits, bias);
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1), k = topk_idx.size(1);
  cudaStream_t stream = stream_of(ctx);
  if (n_tok == 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(counts.data, 0, counts.nbytes(), stream));
    return;
  }
  const RouterScratch scratch = router_scratch(n_exp, stream);
  const size_t hist_bytes = static_cast<size_t>(n_exp) * sizeof(int32_t);
  const bool hist_in_smem = hist_bytes <= kMaxHistBytes;
  dispatch_storage(logits.dtype, "router_topk_forward", [&](auto zero) {
    using T = decltype(zero);
    const RowLayout lay = row_layout<T>(n_exp, {logits.data, probs.data});
    auto launch = [&](auto kernel) {
      kernel<<<row_grid(n_tok, lay), kThreads, hist_in_smem ? hist_bytes : 0, stream>>>(
          static_cast<T*>(probs.data), static_cast<int32_t*>(topk_idx.data),
          static_cast<T*>(topk_w.data), static_cast<int32_t*>(counts.data),
          static_cast<const T*>(logits.data), static_cast<const T*>(bias.data), n_tok,
          static_cast<int>(n_exp), static_cast<int>(k), norm_topk_prob, lay, scratch, hist_in_smem);
      MOE_CUDA_LAUNCH_CHECK();
    };
    if constexpr (std::is_same_v<T, double>) {
      launch(topk_forward_kernel<T, false>);
    } else {
      if (bias.empty())
        launch(topk_forward_kernel<T, true>);
      else
        launch(topk_forward_kernel<T, false>);
    }
  });
}

void router_topk_backward(Ctx& ctx, Tensor dlogits, Tensor dtopk_w, Tensor probs, Tensor topk_idx,
                          bool norm_topk_prob) {
  check_router_topk_backward_args(dlogits, dtopk_w, probs, topk_idx);
  const int64_t n_tok = probs.size(0), n_exp = probs.size(1), k = topk_idx.size(1);
  if (n_tok == 0) return;
  dispatch_storage(probs.dtype, "router_topk_backward", [&](auto zero) {
    using T = decltype(zero);
    const RowLayout lay = row_layout<T>(n_exp, {dlogits.data, probs.data});
    topk_backward_kernel<T><<<row_grid(n_tok, lay), kThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(dlogits.data), static_cast<const T*>(dtopk_w.data),
        static_cast<const T*>(probs.data), static_cast<const int32_t*>(topk_idx.data), n_tok,
        static_cast<int>(n_exp), static_cast<int>(k), norm_topk_prob, lay);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void router_aux_loss_forward(Ctx& ctx, Tensor losses, Tensor logits, Tensor probs, Tensor counts,
                             int k, double aux_coef, double z_coef) {
  check_router_aux_loss_forward_args(losses, logits, probs, counts, k);
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  cudaStream_t stream = stream_of(ctx);
  if (n_tok == 0) {  // both losses 0 (all-zero bits in every float dtype)
    MOE_CUDA_CHECK(cudaMemsetAsync(losses.data, 0, losses.nbytes(), stream));
    return;
  }
  const RouterScratch scratch = router_scratch(n_exp, stream);
  dispatch_storage(logits.dtype, "router_aux_loss_forward", [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const RowLayout lay = row_layout<T>(n_exp, {logits.data, probs.data});
    aux_forward_kernel<T><<<row_grid(n_tok, lay), kThreads, 0, stream>>>(
        static_cast<T*>(losses.data), static_cast<const T*>(logits.data),
        static_cast<const T*>(probs.data), static_cast<const int32_t*>(counts.data), n_tok,
        static_cast<int>(n_exp), static_cast<A>(aux_factor_scale(aux_coef, n_exp, n_tok, k)),
        z_coef, lay, scratch);
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
    using A = acc_t<T>;
    const RowLayout lay = row_layout<T>(n_exp, {dlogits.data, logits.data, probs.data});
    aux_backward_kernel<T><<<row_grid(n_tok, lay), kThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(dlogits.data), static_cast<const T*>(logits.data),
        static_cast<const T*>(probs.data), static_cast<const int32_t*>(counts.data), n_tok,
        static_cast<int>(n_exp), static_cast<A>(aux_factor_scale(aux_coef, n_exp, n_tok, k)),
        static_cast<A>(z_coef * 2.0 / static_cast<double>(n_tok)), static_cast<A>(grad_scale), lay);
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
