// The per-token router code shared by router.cu's top-K kernels and router_fused.cu's fused
// router: a token's E values spread over a group of lanes (RowLayout, LaneSpan), group
// butterflies, the selection order (Cand, sort8, group_best), the per-block counts (finish_counts)
// and TokenRouter, one token's softmax, top-K, renormalisation and counts (the semantics of
// router_topk_forward, moe/ops/router.hpp; see router.cu's top comment for the design).
#pragma once
#include <cstdint>

#include "cuda/block_ticket.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kLaneValues = 8;    // row values a lane keeps in registers
constexpr int kMaxBlocks = 2048;  // grid cap of the per-token kernels (= aux-loss partials)

// ---- rows spread over a group of lanes ----------------------------------------------------------

// group: lanes per token; contiguous: lane g owns values [g*v, g*v + v), v = E / group (else
// g, g + group, ...); vec: contiguous and every row pointer 16-byte aligned.
struct RowLayout {
  int group, log2_group;
  bool contiguous;
  bool vec;
};

// The values a lane owns: experts first + i * step for i < count.
struct LaneSpan {
  int first, step, count;
  __device__ int expert(int i) const { return first + i * step; }
};

__device__ __forceinline__ LaneSpan lane_span(const RowLayout& lay, int n_exp, int lane_g) {
  if (lay.contiguous) {
    const int v = n_exp >> lay.log2_group;
    return {lane_g * v, 1, v};
  }
  return {lane_g, lay.group,
          lane_g < n_exp ? (n_exp - lane_g + lay.group - 1) >> lay.log2_group : 0};
}

// x[i] = row[expert(i)] for the lane's first kLaneValues values (0 past its count).
template <class T>
__device__ __forceinline__ void load_lane(acc_t<T> (&x)[kLaneValues], const T* row,
                                          const LaneSpan& s, bool vec) {
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) x[i] = 0;
  if (vec) {
#pragma unroll
    for (int c = 0; c < kLaneValues; c += kVec<T>)
      if (c < s.count) {
        const Vec16<T> v = load16(row + s.first + c);
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) x[c + j] = load(v.v[j]);
      }
  } else {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i)
      if (i < s.count) x[i] = load(row[s.expert(i)]);
  }
}

// fn(i, e, x, cached) for every value the lane owns: e its expert, x its value. The first
// kLaneValues come from the registers x (cached = true, i their slot); later ones are read from
// `row` again (cached = false). i is a compile-time slot either way, so the caller's own register
// arrays indexed by it stay in registers.
template <class T, class Fn>
__device__ __forceinline__ void for_lane(const acc_t<T> (&x)[kLaneValues], const T* row,
                                         const LaneSpan& s, Fn&& fn) {
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i)
    if (i < s.count) fn(i, s.expert(i), x[i], true);
  for (int j = kLaneValues; j < s.count; j += kLaneValues) {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i)
      if (j + i < s.count) {
        const int e = s.expert(j + i);
        fn(i, e, load(row[e]), false);
      }
  }
}

// row[expert(i)] = value(i, e, cached) for every value the lane owns (cached: slot i <
// kLaneValues).
template <class T, class Fn>
__device__ __forceinline__ void store_lane(T* row, const LaneSpan& s, bool vec, Fn&& value) {
  if (vec) {  // contiguous and at most kLaneValues values
#pragma unroll
    for (int c = 0; c < kLaneValues; c += kVec<T>)
      if (c < s.count) {
        Vec16<T> v;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) v.v[j] = store<T>(value(c + j, s.first + c + j, true));
        store16(row + s.first + c, v);
      }
    return;
  }
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i)
    if (i < s.count) row[s.expert(i)] = store<T>(value(i, s.expert(i), true));
  for (int j = kLaneValues; j < s.count; j += kLaneValues) {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i)
      if (j + i < s.count) {
        const int e = s.expert(j + i);
        row[e] = store<T>(value(i, e, false));
      }
  }
}

// Butterflies over the `group` lanes of a token (group: a power of 2 dividing 32; a token's lanes
// are consecutive and aligned): every lane ends with the same value. The offsets run group/2, ...,
// 1 (unrolled; the guard is the same for the whole warp).
template <class V>
__device__ __forceinline__ V group_sum(V v, int group) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1)
    if (o < group) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
template <class V>
__device__ __forceinline__ V group_max(V v, int group) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1)
    if (o < group) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ bool group_all(bool b, int group) {
  int v = b;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1)
    if (o < group) v &= __shfl_xor_sync(kFullMask, v, o);
  return v != 0;
}

// ---- selection order ----------------------------------------------------------------------------

// A candidate expert in the selection order: higher score first, then lower expert index. The
// default candidate ("none") ranks after every expert.
template <bool kPacked>
struct Cand;

// Float score (no bias, 16/32-bit logits): key = ordered float bits << 32 | ~index, so one unsigned
// compare ranks two candidates. -0 is keyed as +0 (equal scores, as in the double compare).
template <>
struct Cand<true> {
  uint64_t key = 0;  // every expert's key is above 0
  __device__ static Cand of(float score, int e) {
    const uint32_t u = __float_as_uint(score == 0.0f ? 0.0f : score);
    const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return {(static_cast<uint64_t>(ordered) << 32) | ~static_cast<uint32_t>(e)};
  }
  __device__ bool before(const Cand& o) const { return key > o.key; }
  __device__ bool same(const Cand& o) const { return key == o.key; }
  __device__ int expert() const { return key ? static_cast<int>(~static_cast<uint32_t>(key)) : -1; }
  __device__ float score() const {
    const uint32_t ordered = static_cast<uint32_t>(key >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
  }
  __device__ Cand shfl_xor(int o) const { return {__shfl_xor_sync(kFullMask, key, o)}; }
};

template <>
struct Cand<false> {
  double s = 0;
  int e = -1;
  __device__ static Cand of(double score, int e) { return {score, e}; }
  __device__ bool before(const Cand& o) const {
    return e >= 0 && (o.e < 0 || s > o.s || (s == o.s && e < o.e));
  }
  __device__ bool same(const Cand& o) const { return e == o.e; }
  __device__ int expert() const { return e; }
  __device__ Cand shfl_xor(int o) const {
    return {__shfl_xor_sync(kFullMask, s, o), __shfl_xor_sync(kFullMask, e, o)};
  }
};

template <class C>
__device__ __forceinline__ void order_pair(C (&a)[kLaneValues], int i, int j) {
  if (a[j].before(a[i])) {
    const C t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

// Sorts 8 candidates into selection order (the optimal 19-comparator network for 8 inputs).
template <class C>
__device__ __forceinline__ void sort8(C (&a)[kLaneValues]) {
  static_assert(kLaneValues == 8, "sort8 sorts 8 values");
  order_pair(a, 0, 2), order_pair(a, 1, 3), order_pair(a, 4, 6), order_pair(a, 5, 7);
  order_pair(a, 0, 4), order_pair(a, 1, 5), order_pair(a, 2, 6), order_pair(a, 3, 7);
  order_pair(a, 0, 1), order_pair(a, 2, 3), order_pair(a, 4, 5), order_pair(a, 6, 7);
  order_pair(a, 2, 4), order_pair(a, 3, 5);
  order_pair(a, 1, 4), order_pair(a, 3, 6);
  order_pair(a, 1, 2), order_pair(a, 3, 4), order_pair(a, 5, 6);
}

// The best candidate over the token's lanes (every lane gets it).
template <class C>
__device__ __forceinline__ C group_best(C c, int group) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1)
    if (o < group) {
      const C other = c.shfl_xor(o);
      if (other.before(c)) c = other;
    }
  return c;
}

// ---- counts -------------------------------------------------------------------------------------

// Per-device scratch of the router kernels: two tickets, the aux-loss partials and the top-K
// count accumulator (tickets and accumulator are left zero by the kernels that use them).
struct RouterScratch {
  int* tickets;        // [0]: top-K forward, [1]: aux-loss forward
  double* partials;    // [2 * kMaxBlocks]
  int32_t* count_acc;  // [E]
};

// After a block's picks are in hist (shared memory, or count_acc itself): the last block to finish
// writes counts = the sum over blocks and zeroes the accumulator and ticket for the next call.
__device__ inline void finish_counts(int32_t* counts, const int32_t* hist, bool hist_in_smem,
                                     const RouterScratch& scratch, int n_exp) {
  __shared__ bool last;
  __syncthreads();
  if (hist_in_smem)
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x)
      if (hist[e]) atomicAdd(&scratch.count_acc[e], hist[e]);
  __syncthreads();  // the block's adds happen before thread 0's release
  if (threadIdx.x == 0)
    last = block_ticket_add(&scratch.tickets[0], 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();  // (the last block: thread 0's acquire before everyone's reads)
  if (!last) return;
  for (int e = threadIdx.x; e < n_exp; e += blockDim.x)
    counts[e] = atomicExch(&scratch.count_acc[e], 0);
  if (threadIdx.x == 0) scratch.tickets[0] = 0;
}

// ---- one token's routing ------------------------------------------------------------------------

// Softmax, top-K, renormalisation and counts of one token per group of lanes (router_topk_forward).
// A lane calls route() with the values it owns already in x (load_lane) and the logits row `l`
// (read again for values past kLaneValues and for the weights when K > group: a lane that wrote
// the row itself, or a block behind a barrier, sees it). Every lane of a group calls route() for
// the same token; lanes past N pass valid = false and still join the butterflies.
template <class T, bool kPacked>
struct TokenRouter {
  using A = acc_t<T>;
  using C = Cand<kPacked>;
  T* probs;
  int32_t* idx;
  T* w;
  int32_t* hist;  // per-block counts (shared memory) or the scratch accumulator
  const T* bias;
  int n_exp, k;
  bool norm_topk_prob;
  RowLayout lay;
  int group, lane_g;
  LaneSpan span;
  bool in_regs;                   // every value of the token in the group's registers
  double lane_bias[kLaneValues];  // the lane's bias values (the same experts for every token)

  __device__ TokenRouter(T* probs_, int32_t* idx_, T* w_, int32_t* hist_, const T* bias_,
                         int n_exp_, int k_, bool norm, RowLayout lay_)
      : probs(probs_),
        idx(idx_),
        w(w_),
        hist(hist_),
        bias(bias_),
        n_exp(n_exp_),
        k(k_),
        norm_topk_prob(norm),
        lay(lay_),
        group(lay_.group),
        lane_g(static_cast<int>(threadIdx.x) & (lay_.group - 1)),
        span(lane_span(lay_, n_exp_, lane_g)),
        in_regs((n_exp_ + lay_.group - 1) / lay_.group <= kLaneValues) {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i)
      lane_bias[i] = bias && i < span.count ? static_cast<double>(load(bias[span.expert(i)])) : 0.0;
  }

  __device__ C cand(int i, int e, A x, bool cached) const {
    if constexpr (kPacked)
      return C::of(x, e);
    else
      return C::of(static_cast<double>(x) + (cached ? lane_bias[i]
                                             : bias ? static_cast<double>(load(bias[e]))
                                                    : 0.0),
                   e);
  }

  __device__ void route(const A (&x)[kLaneValues], const T* l, int64_t row_n, bool valid) const {
    // Softmax: p_e = exp(l_e - max) / sum.
    A mx = neg_inf<A>();
    bool finite = true;
    for_lane(x, l, span, [&](int i, int e, A v, bool cached) {
      mx = max(mx, v);
      if constexpr (kPacked)  // & rather than &&: no branch per value
        finite &= static_cast<bool>(isfinite(v));
      else
        finite &= static_cast<bool>(isfinite(cand(i, e, v, cached).s));
    });
    mx = group_max(mx, group);
    finite = group_all(finite, group);
    A ex[kLaneValues];
    A sum = 0;
    for_lane(x, l, span, [&](int i, int, A v, bool cached) {
      const A t = dev_exp(v - mx);
      if (cached) ex[i] = t;
      sum += t;
    });
    const A inv_sum = A(1) / group_sum(sum, group);
    if (valid)
      store_lane(probs + row_n * n_exp, span, lay.vec, [&](int i, int e, bool cached) {
        return (cached ? ex[i] : dev_exp(load(l[e]) - mx)) * inv_sum;
      });

    // Selection: K group argmaxes over the lanes' best remaining candidates.
    C sorted[kLaneValues];  // in_regs: the lane's candidates in selection order
    C head;                 // the lane's best candidate not yet picked
    if (finite && in_regs) {
#pragma unroll
      for (int i = 0; i < kLaneValues; ++i)
        sorted[i] = i < span.count ? cand(i, span.expert(i), x[i], true) : C{};
      sort8(sorted);
      head = sorted[0];
    }
    // Without registers for all values (E > 8 * 32): scan again for the best after `prev`.
    auto scan_after = [&](const C& prev, bool first) {
      C best;
      for_lane(x, l, span, [&](int i, int e, A v, bool cached) {
        const C c = cand(i, e, v, cached);
        if ((first || prev.before(c)) && c.before(best)) best = c;
      });
      return best;
    };
    if (finite && !in_regs) head = scan_after(C{}, true);

    // Picks are made `group` at a time; after each batch lane g holds pick j0 + g, so the stores,
    // counts and probabilities of a batch are one step of the group (not one per pick).
    int32_t* in = idx + row_n * k;
    T* wn = w + row_n * k;
    A sum_topk = 0;  // batch by batch in pick order (the CPU adds them one by one)
    A p_mine = 0;    // the probability of this lane's pick of the last batch
    for (int j0 = 0; j0 < k; j0 += group) {
      const int batch = min(group, k - j0);
      C mine;
      for (int jj = 0; jj < batch; ++jj) {
        const C pick = group_best(head, group);
        if (head.same(pick)) {  // this lane's head was picked: pop it
          if (in_regs) {
#pragma unroll
            for (int i = 0; i + 1 < kLaneValues; ++i) sorted[i] = sorted[i + 1];
            sorted[kLaneValues - 1] = C{};
            head = sorted[0];
          } else if (finite) {
            head = scan_after(pick, false);
          }
        }
        if (lane_g == jj) mine = pick;
      }
      const bool holds = lane_g < batch;
      const int e = mine.expert();
      p_mine = 0;
      if (holds && e >= 0) {
        A logit;
        if constexpr (kPacked)
          logit = mine.score();
        else
          logit = load(l[e]);
        p_mine = dev_exp(logit - mx) * inv_sum;
      }
      if (valid && holds) {
        in[j0 + lane_g] = e;
        if (e >= 0) atomicAdd(&hist[e], 1);
      }
      sum_topk += group_sum(p_mine, group);
    }
    auto weight = [&](A pj) {
      return store<T>(norm_topk_prob ? (sum_topk > A(0) ? pj / sum_topk : A(0)) : pj);
    };
    if (valid) {
      if (k <= group) {  // one batch: each lane still holds its pick's probability
        if (lane_g < k) wn[lane_g] = weight(p_mine);
      } else {
        for (int j = lane_g; j < k; j += group) {
          const int e = in[j];  // written by this lane above
          wn[j] = weight(e >= 0 ? dev_exp(load(l[e]) - mx) * inv_sum : A(0));
        }
      }
    }
  }
};

}  // namespace
}  // namespace moe::cuda_detail
