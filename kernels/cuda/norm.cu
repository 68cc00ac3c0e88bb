// RMSNorm on the GPU: y = w * x * rstd, rstd = 1/sqrt(mean(x^2) + eps), saved per row for the
// backward. Statistics accumulate in fp32 (double for f64), and rstd and the gain gradient dw are
// kept in that type (acc_t<T>, acc_dtype(x) in the op's contract): a 16-bit rstd would put a 16-bit
// rounding into every dx, and a 16-bit dw would round each micro-batch's sum before adding it.
//
// The kernels are memory bound, so each is built to touch every byte once, 16 bytes at a time:
// - A row is cut into 16-byte chunks (kVec<T> elements) and belongs to 1-16 warps (the fewest that
//   hold it with kRowChunks chunks a thread): thread t takes chunks t, t + threads, ... and keeps
//   them in registers, so the reduction (warp butterfly, then the row's warp sums in order) needs
//   no second read of the row. Each row group steps through several rows and loads the next one
//   while it works on the current one (loads in flight through the reduction and the stores).
//   Chunks are loaded with one 16-byte access when d is a multiple of kVec and every pointer is
//   16-byte aligned, element by element otherwise; the chunk layout and every summation order are
//   the same on both paths, so the path never changes a result (only d does: it sets the warps).
// - Forward: as many blocks as the device holds at once, each row computed the same way anywhere.
// - Backward: dx and dw in one pass, so dy and x are read once, not once for each. dx = rstd *
//   (w*dy - x * rstd^2 * mean(w*dy*x)) uses the saved rstd, as the CPU op does. dw += sum_n dy * x
//   * rstd: a block takes a fixed range of rows (its row groups every rows-th one), each thread
//   sums its columns over its rows in registers, the block adds its row groups in order in shared
//   memory and writes one partial per column to a static device scratch; a second small kernel
//   adds the partials in block order into dw. The grid depends on N and d only, so dw is bitwise
//   the same on every run and device (no atomics). dx may alias dy: a thread reads its elements of
//   a row before it writes them, and dw is summed from the same registers.
// - Rows longer than 16 warps hold (d > 8192 for 16-bit, 4096 f32, 2048 f64) take the wide
//   kernels: one block per row reading it twice, and a separate dw kernel over column strips.
//
// The residual fusions are the same kernels with the add folded in (template flag kAdd), so they
// cost about what the plain norm costs and the add's own pass over [N, d] disappears:
// - add_rmsnorm_forward: h = x + r is rounded as the add op rounds it, stored, and the rounded
//   values are normalised from the registers. Same threads, same elements, same order as
//   rmsnorm_forward on h: bitwise add + rmsnorm_forward.
// - rmsnorm_backward_add: dx adds residual[j] in acc_t before its one rounding; dx may alias
//   residual (read, then written, by the same thread). dw is unchanged.
//
// The dw scratch (kDwScratchBytes) is one per device, used in stream order: ops of one device share
// one stream (moe::gpu::default_stream); backward calls on two streams of one device at once would
// race on it and are not supported (as for sum_squares in elementwise.cu).
#include <algorithm>
#include <string>
#include <type_traits>

#include "common/norm_checks.hpp"
#include "cuda/column_partials.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/norm.hpp"

namespace moe::cuda_detail {
namespace {

// Row kernels: each thread holds kRowChunks 16-byte chunks of a row (16 elements of a 16-bit row,
// so d = 1024 takes 2 warps), twice over (the next row loads while the current one is worked on).
// Blocks of 256 threads (8-1 rows of 1-8 warps) or 512 (one row of 16 warps: d <= 8192 for
// 16-bit, 4096 f32, 2048 f64; longer rows take the wide kernels).
constexpr int kRowChunks = 2;
constexpr int kMaxRowWarps = 16;
// Warps per SM the row kernels' registers must allow (__launch_bounds__): the plain forward's
// ~64 registers leave room for 32; the fused forward and the backward would spill below 128.
template <bool kAdd>
constexpr int kForwardWarpsPerSm = kAdd ? 16 : 32;
constexpr int kBackwardWarpsPerSm = 16;
// Backward grid: at most 264 blocks of 256 threads (two per H200 SM, one wave; half that for
// 512), from N and d alone: dw's summation order must not depend on the device. A block takes at
// least kMinBackwardRows rows, so its partial (d floats) stays small beside its rows.
constexpr int kMaxBackwardBlocks = 264;
constexpr int kMinBackwardRows = 8;
constexpr size_t kDwScratchBytes = size_t(8) << 20;  // partials: [blocks, d] in acc_t
// Wide rows: one block per row, and dw blocks of 8 columns x 64 row groups.
constexpr int kWideThreads = 256;
constexpr int kDwColumns = 8;
constexpr int kDwRowGroups = 64;

// The backward's dw partials (one per device: module globals are per device). Static, so a step
// allocates nothing and can be captured in a CUDA graph.
__device__ double g_dw_partials[kDwScratchBytes / sizeof(double)];
struct DwPartials {  // for add_column_partials (column_partials.cuh)
  template <class A>
  __device__ static const A* get() {
    return reinterpret_cast<const A*>(g_dw_partials);
  }
};

// ---- kernels ------------------------------------------------------------------------------------

__device__ __forceinline__ float inv_sqrt(float v) {
  return 1.0f / sqrtf(v);
}
__device__ __forceinline__ double inv_sqrt(double v) {
  return 1.0 / sqrt(v);
}

// The chunk of a row at column col: one 16-byte load on the vector path, else element by element
// with zeros past d (they add nothing to the sums below and are never stored).
template <bool kVecIO, class T>
__device__ __forceinline__ Vec16<T> load_chunk(const T* row, int64_t col, int64_t d) {
  if constexpr (kVecIO) {
    return load16(row + col);
  } else {
    Vec16<T> r;
#pragma unroll
    for (int e = 0; e < kVec<T>; ++e) r.v[e] = col + e < d ? row[col + e] : store<T>(acc_t<T>(0));
    return r;
  }
}

template <bool kVecIO, class T>
__device__ __forceinline__ void store_chunk(T* row, int64_t col, int64_t d, const Vec16<T>& c) {
  if constexpr (kVecIO) {
    store16(row + col, c);
  } else {
#pragma unroll
    for (int e = 0; e < kVec<T>; ++e)
      if (col + e < d) row[col + e] = c.v[e];
  }
}

// Sum of v over the threads of this thread's row (threadIdx.x; threadIdx.y is the row), returned
// to each of them: the warp butterfly, then the row's warp sums in order. Every thread of the
// block must call it: with several warps per row it synchronises the block.
template <class A>
__device__ A row_sum(A v) {
  __shared__ A warp_sums[kMaxRowWarps];
  v = warp_sum(v);
  const int warps = blockDim.x / kWarpLanes;
  if (warps == 1) return v;
  const int first = threadIdx.y * warps;
  __syncthreads();  // the previous call's readers are done
  if ((threadIdx.x & (kWarpLanes - 1)) == 0) warp_sums[first + threadIdx.x / kWarpLanes] = v;
  __syncthreads();
  A s = warp_sums[first];
  for (int k = 1; k < warps; ++k) s += warp_sums[first + k];
  return s;
}

// The chunks of one row that this thread holds (live: the row exists; chunks past d are skipped).
template <bool kVecIO, int K, class T>
__device__ __forceinline__ void load_row(Vec16<T> (&c)[K], const T* row, int64_t first,
                                         int64_t step, int64_t d, bool live) {
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (live && first + k * step < d) c[k] = load_chunk<kVecIO>(row, first + k * step, d);
}

template <int K, class T>
__device__ __forceinline__ void copy_row(Vec16<T> (&to)[K], const Vec16<T> (&from)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) to[k] = from[k];
}

// grid <= ceil(N / rows), block (32 * warps, rows): row groups (blockIdx.x * rows + threadIdx.y)
// step through the rows by gridDim.x * rows, each loading its next row before it works on the
// current one, so a row's loads overlap the previous row's reduction and stores (rows are
// disjoint, so that is safe whatever aliases). kAdd: h = x + res is stored and normalised (h and
// res are unused otherwise); h may alias x or res (each element is read before it is written, by
// its writer). The grid never changes a result: each row is computed the same way anywhere.
template <class T, bool kAdd, bool kVecIO, int kThreads>
__global__ void __launch_bounds__(kThreads, kForwardWarpsPerSm<kAdd> / (kThreads / kWarpLanes))
    rmsnorm_forward_kernel(T* y, acc_t<T>* rstd, T* h, const T* x, const T* res, const T* w, int n,
                           int64_t d, acc_t<T> eps) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  const int64_t first = int64_t(threadIdx.x) * V, step = int64_t(blockDim.x) * V;
  const int64_t stride = int64_t(gridDim.x) * blockDim.y, base = int64_t(blockIdx.x) * blockDim.y;
  // The same trip count for every thread of the block (row_sum may synchronise it).
  const int64_t iters = base < n ? (n - base + stride - 1) / stride : 0;
  constexpr int K = kRowChunks;
  Vec16<T> wv[K], xc[K], rc[K], xn[K], rn[K];
  load_row<kVecIO>(wv, w, first, step, d, true);
  auto load_rows = [&](Vec16<T>(&xr)[K], Vec16<T>(&rr)[K], int64_t i, bool ok) {
    load_row<kVecIO>(xr, x + i * d, first, step, d, ok);
    if constexpr (kAdd) load_row<kVecIO>(rr, res + i * d, first, step, d, ok);
  };
  int64_t row = base + threadIdx.y;
  load_rows(xc, rc, row, row < n);
  for (int64_t it = 0; it < iters; ++it, row += stride) {
    const bool live = row < n;
    load_rows(xn, rn, row + stride, it + 1 < iters && row + stride < n);
    const int64_t off = row * d;
    A ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t col = first + k * step;
      if (!live || col >= d) continue;
      if constexpr (kAdd) {
#pragma unroll
        for (int e = 0; e < V; ++e)
          xc[k].v[e] = store<T>(load(xc[k].v[e]) + load(rc[k].v[e]));  // exactly add's rounding
        store_chunk<kVecIO>(h + off, col, d, xc[k]);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A s = load(xc[k].v[e]);
        ss += s * s;
      }
    }
    ss = row_sum(ss);
    const A rs = inv_sqrt(ss / static_cast<A>(d) + eps);
    if (live) {
      if (threadIdx.x == 0) rstd[row] = rs;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t col = first + k * step;
        if (col >= d) continue;
        Vec16<T> o;
#pragma unroll
        for (int e = 0; e < V; ++e) o.v[e] = store<T>(load(wv[k].v[e]) * (load(xc[k].v[e]) * rs));
        store_chunk<kVecIO>(y + off, col, d, o);
      }
    }
    copy_row(xc, xn);
    if constexpr (kAdd) copy_row(rc, rn);
  }
}

// grid G, block (32 * warps, rows), dynamic shared memory (rows - 1) * d acc_t: block b takes rows
// [b * rows_per_block, (b + 1) * rows_per_block) and its row group threadIdx.y every rows-th of
// them, loading the next before working on the current one (as the forward). dx (overwritten;
// plus res when kAdd, summed in A and rounded once), and the block's dw sum into
// g_dw_partials[b] (G > 1) or straight into dw (G == 1).
template <class T, bool kAdd, bool kVecIO, int kThreads>
__global__ void __launch_bounds__(kThreads, kBackwardWarpsPerSm / (kThreads / kWarpLanes))
    rmsnorm_backward_kernel(T* dx, acc_t<T>* dw, const T* dy, const T* x, const T* w,
                            const acc_t<T>* rstd, const T* res, int n, int64_t d,
                            int rows_per_block) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  const int64_t first = int64_t(threadIdx.x) * V, step = int64_t(blockDim.x) * V;
  const int64_t begin = int64_t(blockIdx.x) * rows_per_block;
  const int64_t end = min(int64_t(n), begin + rows_per_block);
  // The same trip count for every thread of the block (row_sum may synchronise it).
  const int64_t iters = (end - begin + blockDim.y - 1) / blockDim.y;
  constexpr int K = kRowChunks;
  Vec16<T> wv[K], gc[K], xc[K], rc[K], gn[K], xn[K], rn[K];
  A acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = 0;
  load_row<kVecIO>(wv, w, first, step, d, true);
  // The current rows are in (gc, xc, rc, r), the next ones load into (gn, xn, rn, r_next).
  auto load_rows = [&](Vec16<T>(&g)[K], Vec16<T>(&xr)[K], Vec16<T>(&rr)[K], int64_t i, bool ok) {
    load_row<kVecIO>(g, dy + i * d, first, step, d, ok);
    load_row<kVecIO>(xr, x + i * d, first, step, d, ok);
    if constexpr (kAdd) load_row<kVecIO>(rr, res + i * d, first, step, d, ok);
    return ok ? rstd[i] : A(0);
  };
  int64_t row = begin + threadIdx.y;
  A r = load_rows(gc, xc, rc, row, row < end);
  for (int64_t it = 0; it < iters; ++it, row += blockDim.y) {
    const bool live = row < end;
    const A r_next = load_rows(gn, xn, rn, row + blockDim.y, row + blockDim.y < end);
    A m = 0;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (live && first + k * step < d)
#pragma unroll
        for (int e = 0; e < V; ++e) m += load(wv[k].v[e]) * load(gc[k].v[e]) * load(xc[k].v[e]);
    m = row_sum(m) / static_cast<A>(d);
    if (live) {
      const A c = r * r * m;
      const int64_t off = row * d;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t col = first + k * step;
        if (col >= d) continue;
        Vec16<T> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const A gy = load(gc[k].v[e]), xe = load(xc[k].v[e]);
          acc[k][e] += gy * xe * r;
          const A gx = r * (load(wv[k].v[e]) * gy - xe * c);
          if constexpr (kAdd)
            o.v[e] = store<T>(load(rc[k].v[e]) + gx);
          else
            o.v[e] = store<T>(gx);
        }
        store_chunk<kVecIO>(dx + off, col, d, o);
      }
    }
    r = r_next;
    copy_row(gc, gn);
    copy_row(xc, xn);
    if constexpr (kAdd) copy_row(rc, rn);
  }

  // dw: the row groups' sums added in order of threadIdx.y.
  extern __shared__ __align__(16) unsigned char dw_shared[];
  A* sums = reinterpret_cast<A*>(dw_shared);  // [rows - 1, d]
  if (threadIdx.y > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (first + k * step + e < d)
          sums[(threadIdx.y - 1) * d + first + k * step + e] = acc[k][e];
  }
  __syncthreads();
  if (threadIdx.y > 0) return;
  A* partial = reinterpret_cast<A*>(g_dw_partials) + int64_t(blockIdx.x) * d;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t col = first + k * step + e;
      if (col >= d) continue;
      A s = acc[k][e];
      for (int y = 1; y < static_cast<int>(blockDim.y); ++y) s += sums[(y - 1) * d + col];
      if (gridDim.x == 1)
        dw[col] += s;
      else
        partial[col] = s;
    }
}

// ---- wide rows (d past what kMaxRowWarps warps hold) --------------------------------------------

// Sum of v over the block in a fixed tree, returned to every thread. blockDim.x is a multiple
// of 32.
template <class A>
__device__ A block_sum(A v) {
  __shared__ A warp_sums[32];
  __shared__ A total;
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : A(0);
    v = warp_sum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// grid N, one block per row; the second loop reads h (or x) again. kAdd as above: each thread
// stores h and squares the stored value, then reads back its own writes.
template <class T, bool kAdd>
__global__ void rmsnorm_forward_wide_kernel(T* y, acc_t<T>* rstd, T* h, const T* x, const T* res,
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
      s = store<T>(load(x[off + j]) + load(res[off + j]));  // exactly add's rounding
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
__global__ void rmsnorm_dx_wide_kernel(T* dx, const T* dy, const T* x, const T* w,
                                       const acc_t<T>* rstd, const T* res, int64_t d) {
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

// grid ceil(d / kDwColumns), block (kDwColumns, kDwRowGroups): dw += sum_n dy * x * rstd, the
// 64 row groups' sums of a column added in order.
template <class T>
__global__ void rmsnorm_dw_wide_kernel(acc_t<T>* dw, const T* dy, const T* x, const acc_t<T>* rstd,
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

// The row kernels' shape for rows of d elements of T, from d alone (it sets the summation order):
// warps per row (the fewest that hold the row), rows and threads per block (256, or 512 for rows
// of 16 warps). warps == 0: longer rows, for the wide kernels.
struct RowPlan {
  int warps, rows, threads;
};

template <class T>
RowPlan row_plan(int64_t d) {
  const int64_t chunks = (d + kVec<T> - 1) / kVec<T>;
  int warps = 1;
  while (warps < kMaxRowWarps && int64_t(warps) * kWarpLanes * kRowChunks < chunks) warps *= 2;
  if (chunks > int64_t(warps) * kWarpLanes * kRowChunks) return {0, 0, 0};
  const int threads = std::max(256, warps * kWarpLanes);
  return {warps, threads / (warps * kWarpLanes), threads};
}

// fn(std::integral_constant<int, threads>{}, std::bool_constant<vec>{}): the kernel instance.
template <class Fn>
void dispatch_row_kernel(int threads, bool vec, Fn&& fn) {
  auto with_vec = [&](auto t) {
    if (vec)
      fn(t, std::true_type{});
    else
      fn(t, std::false_type{});
  };
  if (threads == 256)
    with_vec(std::integral_constant<int, 256>{});
  else
    with_vec(std::integral_constant<int, 512>{});
}

// Threads of a wide-row block: a multiple of 32, no more than the row needs, at most 256.
int wide_threads(int64_t d) {
  return static_cast<int>(
      std::min<int64_t>(kWideThreads, std::max<int64_t>(32, (d + 31) / 32 * 32)));
}

// How many blocks of kKernel (kThreads threads, no dynamic shared memory) the current device runs
// at once. Kept per kernel after the first call (one GPU model per process).
template <auto kKernel, int kThreads>
unsigned resident_blocks() {
  static const unsigned blocks = [] {
    int per_sm = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0));
    return static_cast<unsigned>(std::max(1, device_sm_count() * per_sm));
  }();
  return blocks;
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
    const RowPlan p = row_plan<T>(d);
    if (p.warps > 0) {
      const bool vec = d % kVec<T> == 0 && aligned16({y.data, h.data, x.data, r.data, w.data});
      dispatch_row_kernel(p.threads, vec, [&](auto t, auto v) {
        constexpr int kThreads = decltype(t)::value;
        constexpr auto kernel = rmsnorm_forward_kernel<T, kAdd, decltype(v)::value, kThreads>;
        // As many blocks as the device runs at once (each loops over rows): more would queue
        // behind them and finish a whole row loop late.
        const unsigned blocks =
            std::min(blocks_for(n, p.rows), resident_blocks<kernel, kThreads>());
        kernel<<<blocks, dim3(p.warps * kWarpLanes, p.rows), 0, stream_of(ctx)>>>(
            data_of<T>(y), data_of<acc_t<T>>(rstd), data_of<T>(h), data_of<T>(x), data_of<T>(r),
            data_of<T>(w), static_cast<int>(n), d, static_cast<acc_t<T>>(eps));
      });
    } else {
      rmsnorm_forward_wide_kernel<T, kAdd>
          <<<static_cast<unsigned>(n), wide_threads(d), 0, stream_of(ctx)>>>(
              data_of<T>(y), data_of<acc_t<T>>(rstd), data_of<T>(h), data_of<T>(x), data_of<T>(r),
              data_of<T>(w), d, static_cast<acc_t<T>>(eps));
    }
    MOE_CUDA_LAUNCH_CHECK();
  });
}

template <class T>
void launch_backward_wide(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                          Tensor rstd, Tensor residual, bool add) {
  const int64_t n = x.size(0), d = x.size(1);
  // dw first: it reads dy, which dx may alias.
  rmsnorm_dw_wide_kernel<T>
      <<<blocks_for(d, kDwColumns), dim3(kDwColumns, kDwRowGroups), 0, stream_of(ctx)>>>(
          data_of<acc_t<T>>(dw), data_of<T>(dy), data_of<T>(x), data_of<acc_t<T>>(rstd), n, d);
  MOE_CUDA_LAUNCH_CHECK();
  auto* kernel = add ? rmsnorm_dx_wide_kernel<T, true> : rmsnorm_dx_wide_kernel<T, false>;
  kernel<<<static_cast<unsigned>(n), wide_threads(d), 0, stream_of(ctx)>>>(
      data_of<T>(dx), data_of<T>(dy), data_of<T>(x), data_of<T>(w), data_of<acc_t<T>>(rstd),
      data_of<T>(residual), d);
  MOE_CUDA_LAUNCH_CHECK();
}

template <bool kAdd>
void launch_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                     Tensor residual, const char* op) {
  const int64_t n = x.size(0), d = x.size(1);
  check_rows(n);
  if (n == 0 || d == 0) return;
  dispatch_storage(x.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const RowPlan p = row_plan<T>(d);
    if (p.warps == 0) return launch_backward_wide<T>(ctx, dx, dw, dy, x, w, rstd, residual, kAdd);
    // Blocks and rows per block from N and d alone (dw's summation order), rows per block a
    // multiple of the block's rows (every row group the same trip count), partials within the
    // scratch (room for 256 blocks at d = 8192).
    const int64_t max_blocks = std::max<int64_t>(
        1, std::min<int64_t>({kMaxBackwardBlocks * 256 / p.threads,
                              (n + kMinBackwardRows - 1) / kMinBackwardRows,
                              static_cast<int64_t>(kDwScratchBytes / (d * sizeof(A)))}));
    const int64_t per_block = ((n + max_blocks - 1) / max_blocks + p.rows - 1) / p.rows * p.rows;
    const int blocks = static_cast<int>((n + per_block - 1) / per_block);
    const bool vec =
        d % kVec<T> == 0 && aligned16({dx.data, dy.data, x.data, w.data, residual.data});
    const size_t shared = static_cast<size_t>(p.rows - 1) * d * sizeof(A);
    dispatch_row_kernel(p.threads, vec, [&](auto t, auto v) {
      rmsnorm_backward_kernel<T, kAdd, decltype(v)::value, decltype(t)::value>
          <<<blocks, dim3(p.warps * kWarpLanes, p.rows), shared, stream_of(ctx)>>>(
              data_of<T>(dx), data_of<A>(dw), data_of<T>(dy), data_of<T>(x), data_of<T>(w),
              data_of<A>(rstd), data_of<T>(residual), static_cast<int>(n), d,
              static_cast<int>(per_block));
    });
    MOE_CUDA_LAUNCH_CHECK();
    if (blocks == 1) return;
    add_column_partials<A, DwPartials>(stream_of(ctx), data_of<A>(dw), blocks, d);
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
