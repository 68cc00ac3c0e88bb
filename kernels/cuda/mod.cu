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
// The scatter forward into a separate out of up to 16 MiB is one launch over every row
// (scatter_all_forward_kernel: skipped rows copied, selected ones updated), where it was a copy of
// x and then the selected rows' kernel: at moe-t4's 8192 x 512 the two took 9.9 us, 6.6 in one.
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "common/mod_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/mod_select.cuh"
#include "cuda/router_paths.hpp"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/mod.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kWarp = 32;
constexpr int kSelectThreads = 1024;
constexpr int kRowWarps = 8;  // selected rows per gather / scatter block
constexpr int kRowThreads = kRowWarps * kWarp;
constexpr int kUnroll = 4;  // 16-byte loads in flight per lane

template <class A>
__device__ __forceinline__ A sigmoid(A x) {
  return A(1) / (A(1) + dev_exp(-x));
}

// ---- selection ----------------------------------------------------------------------------------

// sel[b, :] = the C best positions of sequence b, ascending; mask[b, :] = 1 there, else 0.
// kAfterPrimary: launched as the programmatic dependent of the kernel that writes the scores
// (mod_select_after_scores), it waits for that grid here.
template <class T, bool kAfterPrimary = false>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(int32_t* __restrict__ sel, T* __restrict__ mask, const T* __restrict__ scores,
                  int t, int c) {
  if constexpr (kAfterPrimary) wait_primary_grid();
  const int64_t b = blockIdx.x;
  select_sequence<T, kSelectThreads, false>(sel + b * c, mask + b * t, scores + b * t, t, c);
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

// The same for every row of out when out is not x, in one launch: out[row] = x[row] on skipped
// rows (the copy the selected-rows kernel needs before it), the gated update on selected ones. A
// block takes kSpanRows consecutive positions of one sequence (blockIdx.y) and first marks which of
// them are selected, and by which slot, from one pass over sel[b, :] (C entries, read once per
// block rather than searched per row); then its threads walk (row, 16-byte chunk) items with
// kUnroll loads in flight, so the rows' reads overlap across the whole block.
constexpr int kSpanRows = 32;

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    scatter_all_forward_kernel(T* __restrict__ out, const T* __restrict__ x,
                               const T* __restrict__ ys, const acc_t<T>* __restrict__ scores,
                               const int32_t* __restrict__ sel, int64_t t, int64_t c, int64_t d,
                               bool vec) {
  using A = acc_t<T>;
  constexpr int kV = kVec<T>;
  __shared__ int64_t slot_of[kSpanRows];  // the row's slot b*C + j in ys, or -1 (skipped)
  __shared__ A gate_of[kSpanRows];
  const int64_t b = blockIdx.y, p0 = int64_t(blockIdx.x) * kSpanRows;
  const int span = static_cast<int>(t - p0 < kSpanRows ? t - p0 : kSpanRows);
  if (threadIdx.x < kSpanRows) slot_of[threadIdx.x] = -1;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const int64_t p = sel[b * c + j];
    if (p0 <= p && p < p0 + span) slot_of[p - p0] = b * c + j;  // sel ascending: one writer
  }
  __syncthreads();
  if (threadIdx.x < span) {
    const int64_t row = b * t + p0 + threadIdx.x;
    gate_of[threadIdx.x] = slot_of[threadIdx.x] >= 0 ? sigmoid(scores[row]) : A(0);
  }
  __syncthreads();
  // 32-bit item arithmetic (the launcher checks that a block's items fit): a 64-bit division
  // per item cost more than the copy.
  const int per_row = static_cast<int>(vec ? d / kV : d), items = span * per_row;
  const int64_t base = (b * t + p0) * d;  // the block's first element of x and out
  // Item i: the block's row r and its first column (a chunk's when vec, else an element's).
  auto item = [&](int i) {
    const int r = i / per_row;
    return std::pair<int, int64_t>(r, int64_t(i - r * per_row) * (vec ? kV : 1));
  };
  for (int i0 = threadIdx.x; i0 < items; i0 += kUnroll * kRowThreads) {
    if (vec) {
      Vec16<T> xv[kUnroll], yv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kRowThreads;
        if (i >= items) break;
        const auto [r, col] = item(i);
        xv[u] = load16(x + base + r * d + col);
        if (slot_of[r] >= 0) yv[u] = load16(ys + slot_of[r] * d + col);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kRowThreads;
        if (i >= items) break;
        const auto [r, col] = item(i);
        Vec16<T> o = xv[u];
        if (slot_of[r] >= 0) {
          const A g = gate_of[r];
#pragma unroll
          for (int e = 0; e < kV; ++e) {
            const A a = load(xv[u].v[e]);
            o.v[e] = store<T>(a + g * (load(yv[u].v[e]) - a));
          }
        }
        store16(out + base + r * d + col, o);
      }
    } else {
      for (int i = i0; i < items && i < i0 + kUnroll * kRowThreads; i += kRowThreads) {
        const auto [r, col] = item(i);
        const T xe = x[base + r * d + col];
        if (slot_of[r] < 0) {
          out[base + r * d + col] = xe;
        } else {
          const A a = load(xe);
          out[base + r * d + col] = store<T>(a + gate_of[r] * (load(ys[slot_of[r] * d + col]) - a));
        }
      }
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
  if (b * t == 0 || d == 0) return;
  // One launch where x is small enough for the two launches' fixed costs to dominate (measured on
  // the H200, 19th session: 6.6 against 9.9 us at 8 MiB of f16 x; 37.6 against 24.6 us at 32 MiB
  // of bf16, where the copy engine's copy plus the selected rows is faster); gridDim.y's limit; a
  // block's items within int.
  if (out.data != x.data && x.nbytes() <= (size_t(16) << 20) && b <= 65535 &&
      d <= INT32_MAX / kSpanRows) {
    dispatch_storage(x.dtype, "mod_scatter_forward", [&](auto zero) {
      using T = decltype(zero);
      const dim3 grid(static_cast<unsigned>((t + kSpanRows - 1) / kSpanRows),
                      static_cast<unsigned>(b));
      scatter_all_forward_kernel<T><<<grid, kRowThreads, 0, stream>>>(
          static_cast<T*>(out.data), static_cast<const T*>(x.data), static_cast<const T*>(ys.data),
          static_cast<const acc_t<T>*>(scores.data), static_cast<const int32_t*>(sel.data), t, c, d,
          rows_vectorisable<T>(d, {out.data, x.data, ys.data}));
      MOE_CUDA_LAUNCH_CHECK();
    });
    return;
  }
  if (out.data != x.data)  // skipped rows: out = x
    MOE_CUDA_CHECK(cudaMemcpyAsync(out.data, x.data, x.nbytes(), cudaMemcpyDeviceToDevice, stream));
  if (b * c == 0) return;
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

// (the arguments checked by mod_route, its caller: router_paths.hpp)
void mod_select_after_scores(Ctx& ctx, Tensor sel, Tensor mask, Tensor scores) {
  const int64_t b = scores.size(0), t = scores.size(1), c = sel.size(1);
  MOE_CHECK(scores.dtype == DType::f32 && b > 0 && t > 0 && t <= INT32_MAX && b <= INT32_MAX,
            "mod_select_after_scores: f32 scores of a non-empty [B, T] expected");
  MOE_CUDA_CHECK(launch_dependent(
      select_kernel<float, true>, dim3(static_cast<unsigned>(b)), dim3(kSelectThreads),
      stream_of(ctx), static_cast<int32_t*>(sel.data), static_cast<float*>(mask.data),
      static_cast<const float*>(scores.data), static_cast<int>(t), static_cast<int>(c)));
}

}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(mod_select, &::moe::cuda_detail::mod_select);
MOE_REGISTER_CUDA_OP(mod_gather_forward, &::moe::cuda_detail::mod_gather_forward);
MOE_REGISTER_CUDA_OP(mod_gather_backward, &::moe::cuda_detail::mod_gather_backward);
MOE_REGISTER_CUDA_OP(mod_scatter_forward, &::moe::cuda_detail::mod_scatter_forward);
MOE_REGISTER_CUDA_OP(mod_scatter_backward, &::moe::cuda_detail::mod_scatter_backward);
