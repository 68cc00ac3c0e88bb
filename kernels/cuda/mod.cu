// Mixture-of-Depths on CUDA: per-sequence top-C selection, the gather of the selected rows (and its
// accumulating backward), and the gated scatter out_i = x_i + sigmoid(r_i) (ys_i - x_i) (and its
// backward into x, ys and the scores). Semantics follow kernels/cpu/mod.cpp exactly.
//
// Selection: one block per sequence, no host sync, O(T) work per digit. Each score becomes an
// unsigned key of its own width whose integer order is the float order (sign bit flipped for
// positives, all bits for negatives; -0 becomes +0 so that it ties with +0 as the CPU's == says).
// A radix select over 8-bit digits from the top finds the key K of the C-th largest score and
// how many positions with key K are kept (k): a shared-memory histogram of the candidates' next
// digit per pass (warp-aggregated integer atomics: counts, so order-free), then one warp walks the
// 256 bins from the top. It stops early once the candidates sharing the chosen prefix are exactly
// the ones still needed (random fp32 scores usually need 2-3 of the 4 passes). Position i is kept
// iff key_i > K, or key_i == K and fewer than k positions before i have key K: the CPU's set for
// the strict order (higher score first, then lower position). One block scan over contiguous
// position segments then gives every thread its tie rank and its output slot, so sel comes out
// ascending with no sort. (NaN scores get keys too, above +inf or below -inf by their sign bit,
// so exactly C positions are kept whatever the scores; the CPU's order is unspecified for NaN.)
// The previous kernel counted ranks pairwise, O(T^2): 67 us at 16 x 1024.
// Gather / scatter: a warp per selected row (8 rows per block), 16-byte vectors with kUnroll
// loads in flight per lane when every row is 16-byte aligned (d a multiple of 16 bytes' worth of
// elements, aligned bases), else one element per lane; fp32 math (double for f64). The scores
// and their gradient are acc_t<T> (acc_dtype(x): the router's fp32 scores with 16-bit
// activations). sel strictly ascending (as mod_select writes it) makes every written row owned by
// one selected slot: no atomics, no races; the dscores dot product is a fixed warp tree. sel cannot
// be validated on the device without a host read: an out-of-range entry makes the gather write NaN
// and the scatters skip that row (the CPU ops throw).
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/mod_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/mod.hpp"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kSelectThreads = 1024;
constexpr int kSelectWarps = kSelectThreads / kWarp;
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;
constexpr int kRowWarps = 8;  // selected rows per gather / scatter block
constexpr int kRowThreads = kRowWarps * kWarp;
constexpr int kUnroll = 4;  // 16-byte loads in flight per lane

template <class A>
__device__ __forceinline__ A sigmoid(A x) {
  return A(1) / (A(1) + dev_exp(-x));
}

// ---- selection ----------------------------------------------------------------------------------

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
// blockDim.x == kSelectThreads; every thread must call it.
__device__ __forceinline__ void block_exclusive_scan2(int& a, int& b) {
  __shared__ int sh_a[kSelectWarps], sh_b[kSelectWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int ia = a, ib = b;  // inclusive within the warp
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int ua = __shfl_up_sync(kFullMask, ia, o), ub = __shfl_up_sync(kFullMask, ib, o);
    if (lane >= o) ia += ua, ib += ub;
  }
  if (lane == kWarp - 1) sh_a[warp] = ia, sh_b[warp] = ib;
  __syncthreads();
  if (warp == 0) {
    int wa = sh_a[lane], wb = sh_b[lane];
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const int ua = __shfl_up_sync(kFullMask, wa, o), ub = __shfl_up_sync(kFullMask, wb, o);
      if (lane >= o) wa += ua, wb += ub;
    }
    sh_a[lane] = wa, sh_b[lane] = wb;  // inclusive over warps
  }
  __syncthreads();
  const int base_a = warp > 0 ? sh_a[warp - 1] : 0, base_b = warp > 0 ? sh_b[warp - 1] : 0;
  a = base_a + ia - a;
  b = base_b + ib - b;
}

// The digit search of one radix pass: warp 0 finds the bin (from the top) holding the k-th
// largest candidate. hist: kBins counts; writes the bin, k within the bin and the bin's count.
__device__ __forceinline__ void find_digit(const int* hist, int k, int* out) {
  constexpr int kPerLane = kBins / kWarp;
  const int lane = threadIdx.x % kWarp;
  int mine = 0;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) mine += hist[lane * kPerLane + q];
  int above = mine;  // after the scan: candidates in this lane's bins and every higher lane's
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int u = __shfl_down_sync(kFullMask, above, o);
    if (lane + o < kWarp) above += u;
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

// sel[b, :] = the C best positions of sequence b, ascending; mask[b, :] = 1 there, else 0.
template <class T>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(int32_t* __restrict__ sel, T* __restrict__ mask, const T* __restrict__ scores,
                  int t, int c) {
  using K = key_t<T>;
  using A = acc_t<T>;
  __shared__ int hist[2][kBins];
  __shared__ int found[3];  // digit, k within it, its count
  const int lane = threadIdx.x % kWarp;
  const T* r = scores + static_cast<int64_t>(blockIdx.x) * t;
  // Positions are kept when (key & pmask) > prefix, or == prefix among the first k such.
  // C == T keeps all (pmask 0: every key ties, k = T), C == 0 none (k = 0): no passes needed.
  K prefix = 0, pmask = 0;
  int k = c;
  if (0 < c && c < t) {
    if (threadIdx.x < kBins) hist[0][threadIdx.x] = 0;
    __syncthreads();
    for (int pass = 0; pass * kDigitBits < kKeyBits<T>; ++pass) {
      const int shift = kKeyBits<T> - (pass + 1) * kDigitBits;
      int* h = hist[pass & 1];
      // The other buffer was last read by the previous pass's find_digit, before its barrier.
      if (threadIdx.x < kBins) hist[(pass + 1) & 1][threadIdx.x] = 0;
      for (int i0 = 0; i0 < t; i0 += kSelectThreads) {  // uniform trip count: whole warps
        const int i = i0 + static_cast<int>(threadIdx.x);
        const K key = i < t ? score_key(r[i]) : K(0);
        const bool cand = i < t && (key & pmask) == prefix;
        const int digit = cand ? static_cast<int>((key >> shift) & K(kBins - 1)) : kBins;
        const unsigned peers = __match_any_sync(kFullMask, digit);
        if (cand && lane == __ffs(peers) - 1) atomicAdd(&h[digit], __popc(peers));
      }
      __syncthreads();
      if (threadIdx.x < kWarp) find_digit(h, k, found);
      __syncthreads();
      prefix |= static_cast<K>(found[0]) << shift;
      pmask |= static_cast<K>(kBins - 1) << shift;
      k = found[1];
      if (found[2] == k) break;  // every candidate with this prefix is kept: ties are settled
    }
  }
  // Contiguous position segments, so one scan orders both the ties and the output slots.
  const int per = (t + kSelectThreads - 1) / kSelectThreads;
  const int lo = min(t, static_cast<int>(threadIdx.x) * per), hi = min(t, lo + per);
  int n_gt = 0, n_eq = 0;
  for (int i = lo; i < hi; ++i) {
    const K key = score_key(r[i]) & pmask;
    n_gt += key > prefix;
    n_eq += key == prefix;
  }
  int gt_before = n_gt, eq_before = n_eq;
  block_exclusive_scan2(gt_before, eq_before);
  // Kept before this segment: every greater key and the first k ties.
  int out = gt_before + min(eq_before, k), tie = eq_before;
  T* m = mask + static_cast<int64_t>(blockIdx.x) * t;
  int32_t* s = sel + static_cast<int64_t>(blockIdx.x) * c;
  for (int i = lo; i < hi; ++i) {
    const K key = score_key(r[i]) & pmask;
    const bool eq = key == prefix;
    const bool kept = key > prefix || (eq && tie < k);
    tie += eq;
    m[i] = store<T>(kept ? A(1) : A(0));
    if (kept) s[out++] = i;
  }
}

// ---- gather / scatter rows ----------------------------------------------------------------------

// Row of x (in [B*T, d]) that selected slot i = b*C + c reads, or -1 when sel[i] is out of range.
__device__ __forceinline__ int64_t source_row(const int32_t* sel, int64_t i, int64_t c, int64_t t) {
  const int32_t p = sel[i];
  return (0 <= p && p < t) ? (i / c) * t + p : -1;
}

// The selected slot of this warp, or -1 past the last.
__device__ __forceinline__ int64_t warp_slot(int64_t rows) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  return i < rows ? i : -1;
}

// One warp over a row of nvec 16-byte vectors: load(v) for kUnroll vectors per lane first (loads
// in flight together), then use(v, loaded). Each vector is handled by one lane.
template <class Load, class Use>
__device__ __forceinline__ void warp_vectors(int64_t nvec, Load&& load, Use&& use) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t v0 = lane; v0 < nvec; v0 += kUnroll * kWarp) {
    decltype(load(v0)) buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * kWarp < nvec) buf[u] = load(v0 + u * kWarp);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * kWarp < nvec) use(v0 + u * kWarp, buf[u]);
  }
}

template <class T>
struct Vec2 {
  Vec16<T> a, b;
};
template <class T>
struct Vec3 {
  Vec16<T> a, b, c;
};

// xs[i, :] = x[source_row(i), :]
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    gather_forward_kernel(T* __restrict__ xs, const T* __restrict__ x,
                          const int32_t* __restrict__ sel, int64_t rows, int64_t t, int64_t c,
                          int64_t d, bool vec) {
  constexpr int kV = kVec<T>;
  const int64_t i = warp_slot(rows);
  if (i < 0) return;
  const int64_t row = source_row(sel, i, c, t);
  T* dst = xs + i * d;
  if (row < 0) {
    for (int64_t j = threadIdx.x % kWarp; j < d; j += kWarp)
      dst[j] = store<T>(static_cast<acc_t<T>>(NAN));
    return;
  }
  const T* src = x + row * d;
  if (vec) {
    warp_vectors(
        d / kV, [&](int64_t v) { return load16(src + v * kV); },
        [&](int64_t v, const Vec16<T>& a) { store16(dst + v * kV, a); });
  } else {
    for (int64_t j = threadIdx.x % kWarp; j < d; j += kWarp) dst[j] = src[j];
  }
}

// dx[source_row(i), :] += dxs[i, :]
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    gather_backward_kernel(T* __restrict__ dx, const T* __restrict__ dxs,
                           const int32_t* __restrict__ sel, int64_t rows, int64_t t, int64_t c,
                           int64_t d, bool vec) {
  constexpr int kV = kVec<T>;
  const int64_t i = warp_slot(rows);
  if (i < 0) return;
  const int64_t row = source_row(sel, i, c, t);
  if (row < 0) return;
  T* dst = dx + row * d;
  const T* src = dxs + i * d;
  if (vec) {
    warp_vectors(
        d / kV,
        [&](int64_t v) {
          return Vec2<T>{load16(dst + v * kV), load16(src + v * kV)};
        },
        [&](int64_t v, const Vec2<T>& in) {
          Vec16<T> o;
#pragma unroll
          for (int e = 0; e < kV; ++e) o.v[e] = store<T>(load(in.a.v[e]) + load(in.b.v[e]));
          store16(dst + v * kV, o);
        });
  } else {
    for (int64_t j = threadIdx.x % kWarp; j < d; j += kWarp)
      dst[j] = store<T>(load(dst[j]) + load(src[j]));
  }
}

// ---- gated scatter ------------------------------------------------------------------------------

// Selected rows: out[row, :] = x[row, :] + g (ys[i, :] - x[row, :]), g = sigmoid(scores[row]).
// out may alias x: each element is read and written by the same lane.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    scatter_forward_kernel(T* out, const T* x, const T* __restrict__ ys,
                           const acc_t<T>* __restrict__ scores, const int32_t* __restrict__ sel,
                           int64_t rows, int64_t t, int64_t c, int64_t d, bool vec) {
  using A = acc_t<T>;
  constexpr int kV = kVec<T>;
  const int64_t i = warp_slot(rows);
  if (i < 0) return;
  const int64_t row = source_row(sel, i, c, t);
  if (row < 0) return;
  const A g = sigmoid(scores[row]);  // scores: [B, T] has the flat index of the row of x
  const T* xr = x + row * d;
  const T* yr = ys + i * d;
  T* orow = out + row * d;
  if (vec) {
    warp_vectors(
        d / kV,
        [&](int64_t v) {
          return Vec2<T>{load16(xr + v * kV), load16(yr + v * kV)};
        },
        [&](int64_t v, const Vec2<T>& in) {
          Vec16<T> o;
#pragma unroll
          for (int e = 0; e < kV; ++e) {
            const A xv = load(in.a.v[e]);
            o.v[e] = store<T>(xv + g * (load(in.b.v[e]) - xv));
          }
          store16(orow + v * kV, o);
        });
  } else {
    for (int64_t j = threadIdx.x % kWarp; j < d; j += kWarp) {
      const A xv = load(xr[j]);
      orow[j] = store<T>(xv + g * (load(yr[j]) - xv));
    }
  }
}

// Selected rows: dys[i] = g dout[row], dx[row] = (1-g) dout[row], dscores[row] = g(1-g)<dout,
// ys-x>. dx may alias dout: each element of dout is read before the same lane overwrites it.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    scatter_backward_kernel(T* dx, T* __restrict__ dys, acc_t<T>* __restrict__ dscores,
                            const T* dout, const T* __restrict__ x, const T* __restrict__ ys,
                            const acc_t<T>* __restrict__ scores, const int32_t* __restrict__ sel,
                            int64_t rows, int64_t t, int64_t c, int64_t d, bool vec) {
  using A = acc_t<T>;
  constexpr int kV = kVec<T>;
  const int64_t i = warp_slot(rows);
  if (i < 0) return;
  const int64_t row = source_row(sel, i, c, t);
  if (row < 0) return;  // uniform over the warp
  const A g = sigmoid(scores[row]);
  const T* gr = dout + row * d;
  const T* xr = x + row * d;
  const T* yr = ys + i * d;
  T* dxr = dx + row * d;
  T* dyr = dys + i * d;
  A dot = 0;
  if (vec) {
    warp_vectors(
        d / kV,
        [&](int64_t v) {
          return Vec3<T>{load16(gr + v * kV), load16(xr + v * kV), load16(yr + v * kV)};
        },
        [&](int64_t v, const Vec3<T>& in) {
          Vec16<T> oy, ox;
#pragma unroll
          for (int e = 0; e < kV; ++e) {
            const A gj = load(in.a.v[e]);
            dot += gj * (load(in.c.v[e]) - load(in.b.v[e]));
            oy.v[e] = store<T>(g * gj);
            ox.v[e] = store<T>((A(1) - g) * gj);
          }
          store16(dyr + v * kV, oy);
          store16(dxr + v * kV, ox);
        });
  } else {
    for (int64_t j = threadIdx.x % kWarp; j < d; j += kWarp) {
      const A gj = load(gr[j]);
      dot += gj * (load(yr[j]) - load(xr[j]));
      dyr[j] = store<T>(g * gj);
      dxr[j] = store<T>((A(1) - g) * gj);
    }
  }
  dot = warp_sum(dot);  // fixed butterfly: every lane the same bits
  if (threadIdx.x % kWarp == 0) dscores[row] = g * (A(1) - g) * dot;
}

// ---- host side ----------------------------------------------------------------------------------

// Whether the row kernels may use 16-byte vectors: every row of every array starts 16-byte aligned.
template <class T>
bool rows_vectorisable(int64_t d, std::initializer_list<const void*> ptrs) {
  return d % kVec<T> == 0 && aligned16(ptrs);
}

unsigned row_blocks(int64_t rows) {
  return blocks_for(rows, kRowWarps);
}

void mod_select(Ctx& ctx, Tensor sel, Tensor mask, Tensor scores) {
  check_mod_select_args(sel, mask, scores);
  const int64_t b = scores.size(0), t = scores.size(1), c = sel.size(1);
  if (b == 0 || t == 0) return;
  MOE_CHECK(t <= INT32_MAX && b <= INT32_MAX, "mod_select: [B, T] too large");
  dispatch_storage(scores.dtype, "mod_select", [&](auto zero) {
    using T = decltype(zero);
    select_kernel<T><<<static_cast<unsigned>(b), kSelectThreads, 0, stream_of(ctx)>>>(
        static_cast<int32_t*>(sel.data), static_cast<T*>(mask.data),
        static_cast<const T*>(scores.data), static_cast<int>(t), static_cast<int>(c));
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
    gather_forward_kernel<T><<<row_blocks(rows), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(xs.data), static_cast<const T*>(x.data),
        static_cast<const int32_t*>(sel.data), rows, t, sel.size(1), d,
        rows_vectorisable<T>(d, {xs.data, x.data}));
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
    gather_backward_kernel<T><<<row_blocks(rows), kRowThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(dx.data), static_cast<const T*>(dxs.data),
        static_cast<const int32_t*>(sel.data), rows, t, sel.size(1), d,
        rows_vectorisable<T>(d, {dx.data, dxs.data}));
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
    scatter_forward_kernel<T><<<row_blocks(b * c), kRowThreads, 0, stream>>>(
        static_cast<T*>(out.data), static_cast<const T*>(x.data), static_cast<const T*>(ys.data),
        static_cast<const acc_t<T>*>(scores.data), static_cast<const int32_t*>(sel.data), b * c, t,
        c, d, rows_vectorisable<T>(d, {out.data, x.data, ys.data}));
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
    scatter_backward_kernel<T><<<row_blocks(b * c), kRowThreads, 0, stream>>>(
        static_cast<T*>(dx.data), static_cast<T*>(dys.data), static_cast<acc_t<T>*>(dscores.data),
        static_cast<const T*>(dout.data), static_cast<const T*>(x.data),
        static_cast<const T*>(ys.data), static_cast<const acc_t<T>*>(scores.data),
        static_cast<const int32_t*>(sel.data), b * c, t, c, d,
        rows_vectorisable<T>(d, {dx.data, dys.data, dout.data, x.data, ys.data}));
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
