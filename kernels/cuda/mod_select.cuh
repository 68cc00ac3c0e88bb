// Mixture-of-Depths top-C selection of one sequence by one block (a radix select over the scores'
// order-preserving keys; see mod.cu's top comment for the design): shared by mod.cu's select
// kernel (a block of 1024 threads per sequence) and router_fused.cu's mod_route (the block that
// finishes a sequence's scores selects it, from a copy in shared memory).
#pragma once
#include <cstdint>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kSelectFullMask = 0xffffffffu;
constexpr int kSelectWarpLanes = 32;
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;

// The order-preserving unsigned key of a score: same width as the storage type.
template <class T>
struct KeyOf;
template <>
struct KeyOf<float> {
  using type = uint32_t;
  static __device__ __forceinline__ type bits(float v) { return __float_as_uint(v); }
};
template <>
struct KeyOf<double> {
  using type = unsigned long long;
  static __device__ __forceinline__ type bits(double v) {
    return static_cast<type>(__double_as_longlong(v));
  }
};
template <>
struct KeyOf<__half> {
  using type = uint32_t;  // 16 significant bits, kept in 32 (no 16-bit shuffles needed)
  static __device__ __forceinline__ uint16_t bits(__half v) { return __half_as_ushort(v); }
};
template <>
struct KeyOf<__nv_bfloat16> {
  using type = uint32_t;
  static __device__ __forceinline__ uint16_t bits(__nv_bfloat16 v) {
    return __bfloat16_as_ushort(v);
  }
};
template <class T>
using key_t = typename KeyOf<T>::type;
template <class T>
constexpr int kKeyBits = 8 * static_cast<int>(sizeof(T));  // significant bits of key_t<T>

// Larger score <=> larger key; -0 and +0 give the same key (they tie on the CPU).
template <class T>
__device__ __forceinline__ key_t<T> score_key(T v) {
  using K = key_t<T>;
  constexpr K sign = K(1) << (kKeyBits<T> - 1);
  constexpr K all = sign | (sign - 1);
  K b = static_cast<K>(KeyOf<T>::bits(v));
  if ((b & ~sign) == 0) b = 0;  // +-0
  return (b & sign) ? (~b & all) : (b | sign);
}

// Exclusive block-wide prefix sums of (a, b) over thread order; also the totals.
// blockDim.x == kThreads; every thread must call it.
template <int kThreads>
__device__ __forceinline__ void block_exclusive_scan2(int& a, int& b) {
  constexpr int kWarps = kThreads / kSelectWarpLanes;
  __shared__ int sh_a[kWarps], sh_b[kWarps];
  const int lane = threadIdx.x % kSelectWarpLanes, warp = threadIdx.x / kSelectWarpLanes;
  int ia = a, ib = b;  // inclusive within the warp
#pragma unroll
  for (int o = 1; o < kSelectWarpLanes; o <<= 1) {
    const int ua = __shfl_up_sync(kSelectFullMask, ia, o),
              ub = __shfl_up_sync(kSelectFullMask, ib, o);
    if (lane >= o) ia += ua, ib += ub;
  }
  if (lane == kSelectWarpLanes - 1) sh_a[warp] = ia, sh_b[warp] = ib;
  __syncthreads();
  if (warp == 0) {
    int wa = lane < kWarps ? sh_a[lane] : 0, wb = lane < kWarps ? sh_b[lane] : 0;
#pragma unroll
    for (int o = 1; o < kSelectWarpLanes; o <<= 1) {
      const int ua = __shfl_up_sync(kSelectFullMask, wa, o),
                ub = __shfl_up_sync(kSelectFullMask, wb, o);
      if (lane >= o) wa += ua, wb += ub;
    }
    if (lane < kWarps) sh_a[lane] = wa, sh_b[lane] = wb;  // inclusive over warps
  }
  __syncthreads();
  const int base_a = warp > 0 ? sh_a[warp - 1] : 0, base_b = warp > 0 ? sh_b[warp - 1] : 0;
  a = base_a + ia - a;
  b = base_b + ib - b;
}

// The digit search of one radix pass: warp 0 finds the bin (from the top) holding the k-th
// largest candidate. hist: kBins counts; writes the bin, k within the bin and the bin's count.
__device__ __forceinline__ void find_digit(const int* hist, int k, int* out) {
  constexpr int kPerLane = kBins / kSelectWarpLanes;
  const int lane = threadIdx.x % kSelectWarpLanes;
  int mine = 0;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) mine += hist[lane * kPerLane + q];
  int above = mine;  // after the scan: candidates in this lane's bins and every higher lane's
#pragma unroll
  for (int o = 1; o < kSelectWarpLanes; o <<= 1) {
    const int u = __shfl_down_sync(kSelectFullMask, above, o);
    if (lane + o < kSelectWarpLanes) above += u;
  }
  above -= mine;                         // candidates in higher lanes' bins only
  if (above < k && k <= above + mine) {  // exactly one lane
    for (int q = kPerLane - 1; q >= 0; --q) {
      const int n = hist[lane * kPerLane + q];
      if (above + n >= k) {
        out[0] = lane * kPerLane + q;
        out[1] = k - above;
        out[2] = n;
        return;
      }
      above += n;
    }
  }
}

// The score i of r (global or shared memory); through L2 (ld.global.cg) when kL2: global
// scores that other blocks wrote in the same launch (behind a fence and a ticket).
template <bool kL2, class T>
__device__ __forceinline__ T score_at(const T* r, int i) {
  if constexpr (kL2)
    return __ldcg(r + i);
  else
    return r[i];
}

// select_sequence when every score has a thread of its own (t <= kThreads): the C-th largest key
// found bit by bit from the top, each bit by one block-wide count (__syncthreads_count: a single
// barrier that also adds), the keys in registers. The radix passes take two barriers, shared
// atomics and a warp's digit search for 8 bits, and read the scores again each pass; their ~6 us
// for moe-small's 16 sequences of 1,024 scores were most of the MoD select's bench row (docs/
// perf.md, 34th session). Stops as soon as exactly C keys reach the candidate (no ties to settle).
// The same result: the C best, ties to the lower positions (scripts/models/mod_select.py).
template <class T, int kThreads, bool kL2>
__device__ void select_one_per_thread(int32_t* __restrict__ s, T* __restrict__ m,
                                      const T* __restrict__ r, int t, int c) {
  using K = key_t<T>;
  using A = acc_t<T>;
  const int i = static_cast<int>(threadIdx.x);
  const bool live = i < t;
  const K key = live ? score_key(score_at<kL2>(r, i)) : K(0);
  // Kept: gt, or eq among the first k in position order.
  bool gt = false, eq = false;
  int k = 0;
  if (c >= t) {
    gt = live;
  } else if (c > 0) {
    // p: the largest value with at least C keys >= p (true of 0), so the C-th largest key.
    K p = 0;
    bool exact = false;
    for (int bit = kKeyBits<T> - 1; bit >= 0; --bit) {
      const K cand = p | (K(1) << bit);
      const int n = __syncthreads_count(live && key >= cand);  // the same n in every thread
      if (n >= c) {
        p = cand;
        if (n == c) {
          exact = true;
          break;
        }
      }
    }
    if (exact) {
      gt = live && key >= p;  // exactly C
    } else {
      gt = live && key > p;
      eq = live && key == p;
      k = c - __syncthreads_count(gt);
    }
  }
  int gt_before = gt, eq_before = eq;
  block_exclusive_scan2<kThreads>(gt_before, eq_before);
  const bool kept = gt || (eq && eq_before < k);
  if (live) m[i] = store<T>(kept ? A(1) : A(0));
  if (kept) s[gt_before + min(eq_before, k)] = i;
}

// The selection of one sequence by the whole block (blockDim.x == kThreads, every thread calls
// it): s[:] = the C best positions of scores r[0, t), ascending; m[:] = 1 there, else 0.
// t <= kThreads: select_one_per_thread; else radix passes over 8-bit digits of the keys.
template <class T, int kThreads, bool kL2>
__device__ void select_sequence(int32_t* __restrict__ s, T* __restrict__ m, const T* __restrict__ r,
                                int t, int c) {
  if (t <= kThreads) {  // the same in every thread
    select_one_per_thread<T, kThreads, kL2>(s, m, r, t, c);
    return;
  }
  using K = key_t<T>;
  using A = acc_t<T>;
  __shared__ int hist[2][kBins];
  __shared__ int found[3];  // digit, k within it, its count
  const int lane = threadIdx.x % kSelectWarpLanes;
  // Positions are kept when (key & pmask) > prefix, or == prefix among the first k such.
  // C == T keeps all (pmask 0: every key ties, k = T), C == 0 none (k = 0): no passes needed.
  K prefix = 0, pmask = 0;
  int k = c;
  if (0 < c && c < t) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[0][i] = 0;
    __syncthreads();
    for (int pass = 0; pass * kDigitBits < kKeyBits<T>; ++pass) {
      const int shift = kKeyBits<T> - (pass + 1) * kDigitBits;
      int* h = hist[pass & 1];
      // The other buffer was last read by the previous pass's find_digit, before its barrier.
      for (int i = threadIdx.x; i < kBins; i += kThreads) hist[(pass + 1) & 1][i] = 0;
      for (int i0 = 0; i0 < t; i0 += kThreads) {  // uniform trip count: whole warps
        const int i = i0 + static_cast<int>(threadIdx.x);
        const K key = i < t ? score_key(score_at<kL2>(r, i)) : K(0);
        const bool cand = i < t && (key & pmask) == prefix;
        const int digit = cand ? static_cast<int>((key >> shift) & K(kBins - 1)) : kBins;
        const unsigned peers = __match_any_sync(kSelectFullMask, digit);
        if (cand && lane == __ffs(peers) - 1) atomicAdd(&h[digit], __popc(peers));
      }
      __syncthreads();
      if (threadIdx.x < kSelectWarpLanes) find_digit(h, k, found);
      __syncthreads();
      prefix |= static_cast<K>(found[0]) << shift;
      pmask |= static_cast<K>(kBins - 1) << shift;
      k = found[1];
      if (found[2] == k) break;  // every candidate with this prefix is kept: ties are settled
    }
  }
  // Contiguous position segments, so one scan orders both the ties and the output slots.
  const int per = (t + kThreads - 1) / kThreads;
  const int lo = min(t, static_cast<int>(threadIdx.x) * per), hi = min(t, lo + per);
  int n_gt = 0, n_eq = 0;
  for (int i = lo; i < hi; ++i) {
    const K key = score_key(score_at<kL2>(r, i)) & pmask;
    n_gt += key > prefix;
    n_eq += key == prefix;
  }
  int gt_before = n_gt, eq_before = n_eq;
  block_exclusive_scan2<kThreads>(gt_before, eq_before);
  // Kept before this segment: every greater key and the first k ties.
  int out = gt_before + min(eq_before, k), tie = eq_before;
  for (int i = lo; i < hi; ++i) {
    const K key = score_key(score_at<kL2>(r, i)) & pmask;
    const bool eq = key == prefix;
    const bool kept = key > prefix || (eq && tie < k);
    tie += eq;
    m[i] = store<T>(kept ? A(1) : A(0));
    if (kept) s[out++] = i;
  }
}

}  // namespace
}  // namespace moe::cuda_detail
