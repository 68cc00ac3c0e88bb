// The router's gate matmul on CUDA: logits = x w^T and its backward (dx += dl w, dw += dl^T x),
// with x in its storage dtype (16-bit in mixed precision) and logits, w, dl, dw in acc_t (fp32, or
// double for f64). Semantics follow kernels/cpu/router_logits.cpp: x is widened exactly as it is
// read, all arithmetic is in acc_t, and dx is rounded once. Replaces a convert of x to fp32 plus
// cuBLAS fp32 GEMMs (and, in the backward, an fp32 dx temporary and a convert-add).
//
// Shapes are [N, d] x [E, d] with N large (16K tokens), d ~1K and E small (8) to moderate (64), so
// the forward and dx are long passes over [N, d] rows against a small W, and dw is a sum over N.
// Design:
// - Rows are read in 16-byte chunks (kVec<T> elements; element by element, zeros past d, when d
//   is not a multiple of kVec or a row is not 16-byte aligned: the chunking and every summation
//   order are the same on both paths, so alignment never changes a result). A warp's lanes are 8
//   column lanes x 4 row lanes: a warp access covers 4 rows x 128 contiguous bytes, and the 4 row
//   lanes that share a column read the same W values (a shared-memory broadcast).
// - Forward and dx keep a tile of W (experts x columns, fp32) in shared memory (up to 64 KiB),
//   staged once per block when it holds all of d (the block's first x loads are issued before it
//   is staged), and each lane reuses every W value it reads for kR rows. 16-bit chunks hold 8
//   columns (two float4 of W): the tile's columns are XOR-swizzled so that the column lanes' two
//   reads hit disjoint banks. Where the pass is memory bound a lane keeps two chunks in flight
//   (ChunkPipe): with every row of the batch resident at once, that is what fills the memory
//   pipeline.
// - Forward: each lane sums its columns (chunks c, c + 8, ... of the row, in order) for kR rows x
//   kTE experts in registers, then the 8 column lanes add up by xor butterfly (the same bits on
//   every lane). Blocks are persistent, one E tile each: E <= 8 in one tile (x read once), more in
//   tiles of 16 whose blocks for one row group run side by side, so x comes from DRAM once and
//   from L2 for the other tiles. Each logit is computed the same way whatever the grid, config or
//   alignment.
// - dx: per (row, chunk) the lane sums dl[n, e] w[e, chunk] over all e in order, adds the sum to
//   the widened dx chunk and rounds once. Work items are (column tile, row group), column-tile
//   major, so a block restages W only when its column tile changes. Past 64 KiB of W per 8 chunks
//   of columns (E > 256 for 16-bit x) the experts are staged in pieces, one chunk per lane.
// - dw: each lane owns one chunk of columns and kTE experts and sums dl[n, e] x[n, chunk] over a
//   fixed range of rows (its rows in order, then the 4 row lanes by butterfly); each block writes
//   one partial to a static device scratch and a second kernel adds the partials to dw in a fixed
//   order (strided subsets, then in order). The row ranges depend on N, d and E only, so dw is
//   bitwise the same on every run and device (no atomics).
// The dw scratch is one per device, used in stream order (as norm.cu's): backward calls on two
// streams of one device at once would race on it and are not supported.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/router_checks.hpp"
#include "cuda/column_partials.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/router_paths.hpp"
#include "cuda/vec16.cuh"
#include "moe/ops/router.hpp"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kColLanes = 8;  // lanes of a warp along a row (8 x 16 bytes)
constexpr int kRowLanes = 4;  // lanes of a warp across rows
// The forward and dx kernels' rows: an item's row group has kGroupRows<kR> rows, warp w takes
// kRowLanes * kR consecutive ones of them, and the lanes of row lane r4 = lane / kColLanes every
// kRowLanes-th of those from r4.
template <int kR>
constexpr int kGroupRows = (kWarps * kRowLanes) * kR;
// Blocks per SM the launch bounds keep registers for (128 a thread).
constexpr int kBlocksPerSm = 2;
// The W tile of the forward and dx kernels (its columns: a multiple of 8 chunks).
constexpr size_t kMaxTileBytes = 64 * 1024;
// dw: about two blocks per H200 SM, blocks of at least kDwMinRows rows, partials [blocks, E, d]
// within the scratch. Fixed numbers, not the device's: they set dw's summation order.
constexpr int64_t kDwTargetBlocks = 264;
constexpr int64_t kDwMinRows = 64;
// Rows a dw lane loads ahead: as many as fit beside its 64 accumulators in the 128 registers of
// two blocks per SM (f16's conversions need a few more registers than bf16's shifts).
template <class T>
constexpr int kDwRowsInFlight = std::is_same_v<T, __half> ? 3 : 4;
constexpr size_t kPartialBytes = size_t(8) << 20;

__device__ double g_router_dw_partials[kPartialBytes / sizeof(double)];
struct DwPartials {  // for add_column_partials (column_partials.cuh)
  template <class A>
  __device__ static const A* get() {
    return reinterpret_cast<const A*>(g_router_dw_partials);
  }
};

// ---- chunks of a row ----------------------------------------------------------------------------

// Chunk q of a row (elements q*V .. q*V + V-1), zeros past d; one 16-byte access when `vec`.
template <class T>
__device__ __forceinline__ Vec16<T> load_chunk(const T* row, int64_t q, int64_t d, bool vec) {
  constexpr int V = kVec<T>;
  if (vec) return load16(row + q * V);
  Vec16<T> c = zero_chunk<T>();
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (q * V + j < d) c.v[j] = row[q * V + j];
  return c;
}

template <class T>
__device__ __forceinline__ void store_chunk(T* row, int64_t q, int64_t d, bool vec,
                                            const Vec16<T>& c) {
  constexpr int V = kVec<T>;
  if (vec) return store16(row + q * V, c);
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (q * V + j < d) row[q * V + j] = c.v[j];
}

// kR rows' chunk q (zeros for a row past N: a null pointer).
template <class T, int kR>
__device__ __forceinline__ void load_rows(Vec16<T> (&c)[kR], const T* const (&rows)[kR], int64_t q,
                                          int64_t d, bool vec) {
#pragma unroll
  for (int i = 0; i < kR; ++i) c[i] = rows[i] ? load_chunk(rows[i], q, d, vec) : zero_chunk<T>();
}

// A lane's chunks q, q + 8, ... of kR rows, each loaded kAhead chunks before its use (0: when it
// is needed). A whole row holds only 8 lanes x 16 bytes per chunk, so with every row of a 16K-token
// batch resident at once one chunk ahead keeps ~16 KiB per SM in flight (about what an H200 SM
// needs to stream at full bandwidth); two ahead doubles that.
template <class T, int kR, int kAhead>
struct ChunkPipe {
  Vec16<T> cur[kR], nxt[kR], far[kR];  // nxt: kAhead 2 only; far: the one being loaded
  // Chunk q (and q + 8) before the first use.
  __device__ __forceinline__ void start(const T* const (&rows)[kR], int64_t q, int64_t q_end,
                                        int64_t d, bool vec) {
    if (q < q_end) load_rows(cur, rows, q, d, vec);
    if constexpr (kAhead > 1)
      if (q + kColLanes < q_end) load_rows(nxt, rows, q + kColLanes, d, vec);
  }
  // Before chunk q (in cur) is used: its successor kAhead chunks on starts loading.
  __device__ __forceinline__ void issue(const T* const (&rows)[kR], int64_t q, int64_t q_end,
                                        int64_t d, bool vec) {
    if constexpr (kAhead > 0) {
      const int64_t ahead = q + kAhead * kColLanes;
      if (ahead < q_end) {
        load_rows(far, rows, ahead, d, vec);
      } else {
#pragma unroll
        for (int i = 0; i < kR; ++i) far[i] = zero_chunk<T>();
      }
    }
  }
  // After chunk q is used: cur = chunk q + 8.
  __device__ __forceinline__ void advance(const T* const (&rows)[kR], int64_t q, int64_t q_end,
                                          int64_t d, bool vec) {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      if constexpr (kAhead == 1) {
        cur[i] = far[i];
      } else if constexpr (kAhead == 2) {
        cur[i] = nxt[i];
        nxt[i] = far[i];
      }
    }
    if constexpr (kAhead == 0)
      if (q + kColLanes < q_end) load_rows(cur, rows, q + kColLanes, d, vec);
  }
};

// ---- the W tile in shared memory ----------------------------------------------------------------

// Where tile column k lives. A 16-bit chunk spans 8 columns (32 bytes of fp32) and column lane c
// reads chunk c of every 8, so its two float4 reads would land lanes c and c + 4 on the same banks;
// swapping the halves of chunks 4-7 of every 8 (bit 2 of k when bit 5 is set) makes each read of
// the 8 lanes cover all 32 banks once. Wider elements need no swizzle (a chunk is one float4).
template <class T>
__device__ __forceinline__ int64_t tile_col(int64_t k) {
  if constexpr (kVec<T> == 8)
    return k ^ ((k >> 3) & 4);
  else
    return k;
}

// ws[r, :] = w[e0 + r, kc : kc + cols] for r < rows (zeros past E and past d). 16-byte groups
// of w, loaded whole when `w_vec` (d a multiple of the group, w aligned). cols: a multiple of 8
// chunks (so chunk c of every 8 is column lane c's, as tile_col assumes).
template <class T>
__device__ void stage_w(acc_t<T>* ws, const acc_t<T>* __restrict__ w, int rows, int e0, int n_exp,
                        int64_t d, int64_t kc, int cols, bool w_vec) {
  using A = acc_t<T>;
  constexpr int G = kVec<A>;
  const int groups = cols / G;
  for (int i = threadIdx.x; i < rows * groups; i += blockDim.x) {
    const int r = i / groups;
    const int64_t k = int64_t(i - r * groups) * G;
    const int e = e0 + r;
    const int64_t col = kc + k;
    Vec16<A> v = zero_chunk<A>();
    if (e < n_exp) {
      const A* src = w + int64_t(e) * d + col;
      if (w_vec && col < d) {
        v = load16(src);
      } else {
#pragma unroll
        for (int j = 0; j < G; ++j)
          if (col + j < d) v.v[j] = src[j];
      }
    }
    store16(ws + int64_t(r) * cols + tile_col<T>(k), v);
  }
}

// The V tile values of row `we` at columns k .. k + V-1 (k a multiple of V).
template <class T>
__device__ __forceinline__ void tile_values(acc_t<T> (&out)[kVec<T>], const acc_t<T>* we,
                                            int64_t k) {
  using A = acc_t<T>;
  constexpr int G = kVec<A>;
#pragma unroll
  for (int h = 0; h < kVec<T>; h += G) {
    const Vec16<A> v = load16(we + tile_col<T>(k + h));
#pragma unroll
    for (int j = 0; j < G; ++j) out[h + j] = v.v[j];
  }
}

// ---- forward ------------------------------------------------------------------------------------

// acc[i][e] += sum_v x[i][v] w[e0 + e][k + v] over one chunk (columns in order).
template <class T, int kTE, int kR>
__device__ __forceinline__ void forward_chunk(acc_t<T> (&acc)[kR][kTE], const Vec16<T> (&xc)[kR],
                                              const acc_t<T>* ws, int64_t k, int cols) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  A xv[kR][V];
#pragma unroll
  for (int i = 0; i < kR; ++i) widen_chunk(xc[i], xv[i]);
#pragma unroll
  for (int e = 0; e < kTE; ++e) {
    A wv[V];
    tile_values<T>(wv, ws + int64_t(e) * cols, k);
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int i = 0; i < kR; ++i) acc[i][e] = fma(xv[i][v], wv[v], acc[i][e]);
  }
}

// The first of this lane's kR rows (first_row + kRowLanes * i) in row group `group`.
template <int kR>
__device__ __forceinline__ int64_t lane_first_row(int64_t group, int r4) {
  return group * kGroupRows<kR> + (threadIdx.x / 32) * (kRowLanes * kR) + r4;
}

// logits[n, e0 + e] for the rows of the block's items. Items are (row group, E tile), tile
// fastest; gridDim.x is a multiple of `tiles`, so a block keeps one tile. cols: the W tile's
// columns (a multiple of 8 chunks); when it covers d the tile is staged once. kAhead: chunks of
// x in flight per lane (see ChunkPipe).
template <class T, int kTE, int kR, int kAhead>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    logits_forward_kernel(acc_t<T>* __restrict__ logits, const T* __restrict__ x,
                          const acc_t<T>* __restrict__ w, int64_t n_tok, int64_t d, int n_exp,
                          int tiles, int64_t items, int cols, bool x_vec, bool w_vec) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* ws = reinterpret_cast<A*>(smem);
  const int lane = threadIdx.x & 31, c8 = lane & (kColLanes - 1), r4 = lane / kColLanes;
  const int e0 = static_cast<int>(blockIdx.x % tiles) * kTE;
  const int64_t chunks = (d + V - 1) / V;
  const bool resident = cols >= d;
  bool staged = false;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    // x[rows[i], :]: this lane's rows (null past N)
    const int64_t first_row = lane_first_row<kR>(item / tiles, r4);
    const T* rows[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const int64_t n = first_row + kRowLanes * i;
      rows[i] = n < n_tok ? x + n * d : nullptr;
    }
    A acc[kR][kTE];
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int e = 0; e < kTE; ++e) acc[i][e] = 0;
    for (int64_t kc = 0; kc < d; kc += cols) {
      const int64_t q_end = std::min(chunks, (kc + cols) / V);
      int64_t q = kc / V + c8;
      ChunkPipe<T, kR, kAhead> pipe;
      pipe.start(rows, q, q_end, d, x_vec);  // in flight while W is staged
      if (!resident || !staged) {
        __syncthreads();  // the previous tile's readers are done
        stage_w<T>(ws, w, kTE, e0, n_exp, d, kc, cols, w_vec);
        __syncthreads();
        staged = true;
      }
      for (; q < q_end; q += kColLanes) {
        pipe.issue(rows, q, q_end, d, x_vec);
        forward_chunk<T, kTE, kR>(acc, pipe.cur, ws, q * V - kc, cols);
        pipe.advance(rows, q, q_end, d, x_vec);
      }
    }
    // Sum over the column lanes; lane c8 stores experts c8, c8 + 8, ...
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int e = 0; e < kTE; ++e)
#pragma unroll
        for (int o = 1; o < kColLanes; o <<= 1)
          acc[i][e] += __shfl_xor_sync(kFullMask, acc[i][e], o);
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      if (!rows[i]) continue;
      const int64_t n = first_row + kRowLanes * i;
#pragma unroll
      for (int e = 0; e < kTE; ++e)
        if (e % kColLanes == c8 && e0 + e < n_exp) logits[n * n_exp + e0 + e] = acc[i][e];
    }
  }
}

// ---- backward: dx -------------------------------------------------------------------------------

// s[i][v] += sum_e dl[n_i, e] w[e][k + v] for e in [e_begin, e_end), in order; the tile holds
// experts from e_tile (rows padded to a multiple of 4 with zeros, so groups of 4 need no guard
// there; dl past E reads as 0).
template <class T, int kR>
__device__ __forceinline__ void dx_sum(acc_t<T> (&s)[kR][kVec<T>], const int64_t (&n)[kR],
                                       const acc_t<T>* __restrict__ dl, int n_exp, bool dl_vec,
                                       const acc_t<T>* ws, int e_tile, int e_begin, int e_end,
                                       int64_t k, int cols) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  constexpr int G = kVec<A>;
  for (int e = e_begin; e < e_end; e += 4) {
    A g[kR][4];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
#pragma unroll
      for (int u = 0; u < 4; ++u) g[i][u] = 0;
      if (n[i] < 0) continue;
      const A* p = dl + n[i] * n_exp + e;
      if (dl_vec) {
#pragma unroll
        for (int h = 0; h < 4; h += G) {
          const Vec16<A> v = load16(p + h);
#pragma unroll
          for (int j = 0; j < G; ++j) g[i][h + j] = v.v[j];
        }
      } else {
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (e + u < n_exp) g[i][u] = p[u];
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      A wv[V];
      tile_values<T>(wv, ws + int64_t(e + u - e_tile) * cols, k);
#pragma unroll
      for (int i = 0; i < kR; ++i)
#pragma unroll
        for (int v = 0; v < V; ++v) s[i][v] = fma(g[i][u], wv[v], s[i][v]);
    }
  }
}

// dx chunk q of row i = round(dx + s), for the rows that exist.
template <class T, int kR>
__device__ __forceinline__ void dx_store(T* __restrict__ dx, const int64_t (&n)[kR],
                                         const Vec16<T> (&old)[kR],
                                         const acc_t<T> (&s)[kR][kVec<T>], int64_t q, int64_t d,
                                         bool vec) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    if (n[i] < 0) continue;
    A ov[V];
    widen_chunk(old[i], ov);
    Vec16<T> out;
#pragma unroll
    for (int v = 0; v < V; ++v) out.v[v] = store<T>(ov[v] + s[i][v]);
    store_chunk(dx + n[i] * d, q, d, vec, out);
  }
}

// dx[n, :] = round(dx[n, :] + dl[n, :] w). Items are (column tile, row group), tile major.
// kAhead: chunks of dx in flight per lane (see ChunkPipe): 2 for small E, where the pass is memory
// bound; 0 for large E, where the sums hide the latency and the registers go to more rows (kR).
// `tile_rows`: experts the tile holds; E rounded up to 4 when they all fit (then a block restages
// only when its column tile changes), else fewer, with cols = 8 chunks (one per lane) and the
// experts staged in pieces.
template <class T, int kR, int kAhead>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    logits_dx_kernel(T* __restrict__ dx, const acc_t<T>* __restrict__ dl,
                     const acc_t<T>* __restrict__ w, int64_t n_tok, int64_t d, int n_exp,
                     int64_t groups, int64_t items, int cols, int tile_rows, bool dx_vec,
                     bool w_vec, bool dl_vec) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* ws = reinterpret_cast<A*>(smem);
  const int lane = threadIdx.x & 31, c8 = lane & (kColLanes - 1), r4 = lane / kColLanes;
  const int64_t chunks = (d + V - 1) / V;
  const bool pieces = tile_rows < n_exp;
  int64_t staged_kc = -1;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t kc = (item / groups) * cols;
    const int64_t first_row = lane_first_row<kR>(item % groups, r4);
    int64_t n[kR];  // -1 past N
    const T* rows[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      n[i] = first_row + kRowLanes * i < n_tok ? first_row + kRowLanes * i : -1;
      rows[i] = n[i] >= 0 ? dx + n[i] * d : nullptr;
    }
    const int64_t q_end = std::min(chunks, (kc + cols) / V);
    int64_t q = kc / V + c8;
    ChunkPipe<T, kR, kAhead> pipe;
    pipe.start(rows, q, q_end, d, dx_vec);  // in flight while W is staged
    A s[kR][V];
    if (!pieces) {
      if (staged_kc != kc) {
        __syncthreads();
        stage_w<T>(ws, w, tile_rows, 0, n_exp, d, kc, cols, w_vec);
        __syncthreads();
        staged_kc = kc;
      }
      for (; q < q_end; q += kColLanes) {
        pipe.issue(rows, q, q_end, d, dx_vec);
#pragma unroll
        for (int i = 0; i < kR; ++i)
#pragma unroll
          for (int v = 0; v < V; ++v) s[i][v] = 0;
        dx_sum<T, kR>(s, n, dl, n_exp, dl_vec, ws, 0, 0, n_exp, q * V - kc, cols);
        dx_store<T, kR>(dx, n, pipe.cur, s, q, d, dx_vec);
        pipe.advance(rows, q, q_end, d, dx_vec);
      }
    } else {  // cols = 8 chunks: at most one per lane
#pragma unroll
      for (int i = 0; i < kR; ++i)
#pragma unroll
        for (int v = 0; v < V; ++v) s[i][v] = 0;
      for (int e0 = 0; e0 < n_exp; e0 += tile_rows) {
        __syncthreads();
        stage_w<T>(ws, w, tile_rows, e0, n_exp, d, kc, cols, w_vec);
        __syncthreads();
        if (q < q_end)
          dx_sum<T, kR>(s, n, dl, n_exp, dl_vec, ws, e0, e0, std::min(e0 + tile_rows, n_exp),
                        q * V - kc, cols);
      }
      if (q < q_end) dx_store<T, kR>(dx, n, pipe.cur, s, q, d, dx_vec);
      staged_kc = -1;
    }
  }
}

// ---- backward: dw -------------------------------------------------------------------------------

// Block (tile, column block, row block): lane (r4, c8) of warp w owns chunk q = (column block * 8
// + w) * 8 + c8 and experts e0 .. e0 + kTE-1, and sums rows r_begin + r4, + 4, ... in order. The
// 8 column lanes of a row need the same dl values: each loads every 8th of them (one coalesced
// load) and the others come by shuffle, so a lane holds one dl register per row in flight.
// With one row block the sums go straight into dw; otherwise into partial[row block].
template <class T, int kTE>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    logits_dw_kernel(acc_t<T>* __restrict__ dw, const T* __restrict__ x,
                     const acc_t<T>* __restrict__ dl, int64_t n_tok, int64_t d, int n_exp,
                     bool x_vec) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  constexpr int U = kDwRowsInFlight<T>;
  constexpr int kJ = kTE / kColLanes;  // dl values a lane loads per row
  static_assert(kTE % kColLanes == 0, "whole dl loads per row");
  const int lane = threadIdx.x & 31, c8 = lane & (kColLanes - 1), r4 = lane / kColLanes;
  const int row_lane0 = lane & ~(kColLanes - 1);
  const int e0 = static_cast<int>(blockIdx.x) * kTE;
  const int64_t q = (int64_t(blockIdx.y) * kWarps + threadIdx.x / 32) * kColLanes + c8;
  const bool active = q * V < d;
  const int64_t blocks = gridDim.z, rb = blockIdx.z;
  const int64_t r_begin = n_tok * rb / blocks, r_end = n_tok * (rb + 1) / blocks;
  A acc[kTE][V];
#pragma unroll
  for (int e = 0; e < kTE; ++e)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[e][v] = 0;
#pragma unroll 1
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowLanes * U) {  // all lanes (shuffles inside)
    Vec16<T> xc[U];
    A g[U][kJ];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t n = r0 + kRowLanes * u + r4;
      const bool ok = n < r_end;
      xc[u] = ok && active ? load_chunk(x + n * d, q, d, x_vec) : zero_chunk<T>();
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int e = e0 + c8 + kColLanes * j;
        g[u][j] = ok && e < n_exp ? dl[n * n_exp + e] : A(0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      A xv[V];
      widen_chunk(xc[u], xv);
#pragma unroll
      for (int e = 0; e < kTE; ++e) {
        const A ge = __shfl_sync(kFullMask, g[u][e / kColLanes], row_lane0 | (e % kColLanes));
#pragma unroll
        for (int v = 0; v < V; ++v) acc[e][v] = fma(ge, xv[v], acc[e][v]);
      }
    }
  }
  // Sum over the row lanes; row lane r4 writes experts r4, r4 + 4, ...
#pragma unroll
  for (int e = 0; e < kTE; ++e)
#pragma unroll
    for (int v = 0; v < V; ++v) {
      acc[e][v] += __shfl_xor_sync(kFullMask, acc[e][v], kColLanes);
      acc[e][v] += __shfl_xor_sync(kFullMask, acc[e][v], 2 * kColLanes);
    }
  if (!active) return;
  A* partial = reinterpret_cast<A*>(g_router_dw_partials) + rb * n_exp * d;
#pragma unroll
  for (int e = 0; e < kTE; ++e) {
    if (e % kRowLanes != r4 || e0 + e >= n_exp) continue;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int64_t at = int64_t(e0 + e) * d + q * V + v;
      if (q * V + v >= d) continue;
      if (blocks == 1)
        dw[at] += acc[e][v];
      else
        partial[at] = acc[e][v];
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------

int64_t round_up(int64_t v, int64_t m) {
  return (v + m - 1) / m * m;
}

// Lets `kernel` take the whole W tile (above the 48 KiB default); once per kernel and process.
template <class Kernel>
void allow_tile_smem(Kernel kernel, std::once_flag& once) {
  std::call_once(once, [&] {
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kMaxTileBytes)));
  });
}

// Blocks of a persistent grid over `items`: as many as the device holds at once (each item's
// result does not depend on which block computes it), a multiple of `multiple` (at least one).
template <class Kernel>
unsigned persistent_grid(Kernel kernel, size_t smem, int64_t items, int64_t multiple) {
  int per_sm = 0;
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int64_t cap = std::min<int64_t>(items, int64_t(std::max(per_sm, 1)) * device_sm_count());
  return static_cast<unsigned>(std::max<int64_t>(multiple, cap / multiple * multiple));
}

template <class T, int kTE, int kR, int kAhead>
void launch_forward(cudaStream_t stream, Tensor logits, Tensor x, Tensor w, int64_t n_tok,
                    int64_t d, int64_t n_exp) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  auto kernel = logits_forward_kernel<T, kTE, kR, kAhead>;
  static std::once_flag once;
  allow_tile_smem(kernel, once);
  const int64_t tiles = (n_exp + kTE - 1) / kTE;
  const int64_t group_rows = kGroupRows<kR>;
  const int64_t items = (n_tok + group_rows - 1) / group_rows * tiles;
  constexpr int64_t kLaneCols = kColLanes * V;  // the columns of one chunk per lane
  const int64_t max_cols =
      static_cast<int64_t>(kMaxTileBytes / (kTE * sizeof(A))) / kLaneCols * kLaneCols;
  const int cols = static_cast<int>(std::min(round_up(d, kLaneCols), max_cols));
  const size_t smem = size_t(kTE) * cols * sizeof(A);
  const bool x_vec = d % V == 0 && aligned16({x.data});
  const bool w_vec = d % kVec<A> == 0 && aligned16({w.data});
  kernel<<<persistent_grid(kernel, smem, items, tiles), kThreads, smem, stream>>>(
      data_of<A>(logits), data_of<T>(x), data_of<A>(w), n_tok, d, static_cast<int>(n_exp),
      static_cast<int>(tiles), items, cols, x_vec, w_vec);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T, int kR, int kAhead>
void launch_dx(cudaStream_t stream, Tensor dx, Tensor dlogits, Tensor w, int64_t n_tok, int64_t d,
               int64_t n_exp) {
  using A = acc_t<T>;
  constexpr int64_t kLaneCols = kColLanes * kVec<T>;  // the columns of one chunk per lane
  auto kernel = logits_dx_kernel<T, kR, kAhead>;
  static std::once_flag once;
  allow_tile_smem(kernel, once);
  const int64_t all_rows = round_up(n_exp, 4);
  int64_t cols, tile_rows;
  if (all_rows * kLaneCols * int64_t(sizeof(A)) <= int64_t(kMaxTileBytes)) {
    tile_rows = all_rows;
    const int64_t max_cols =
        static_cast<int64_t>(kMaxTileBytes / (all_rows * sizeof(A))) / kLaneCols * kLaneCols;
    cols = std::min(round_up(d, kLaneCols), max_cols);
  } else {
    cols = kLaneCols;
    tile_rows = static_cast<int64_t>(kMaxTileBytes / (kLaneCols * sizeof(A))) / 4 * 4;
  }
  const size_t smem = size_t(tile_rows) * cols * sizeof(A);
  const int64_t group_rows = kGroupRows<kR>;
  const int64_t groups = (n_tok + group_rows - 1) / group_rows;
  const int64_t items = (d + cols - 1) / cols * groups;
  const bool dx_vec = d % kVec<T> == 0 && aligned16({dx.data});
  const bool w_vec = d % kVec<A> == 0 && aligned16({w.data});
  const bool dl_vec = n_exp % 4 == 0 && aligned16({dlogits.data});
  kernel<<<persistent_grid(kernel, smem, items, 1), kThreads, smem, stream>>>(
      data_of<T>(dx), data_of<A>(dlogits), data_of<A>(w), n_tok, d, static_cast<int>(n_exp), groups,
      items, static_cast<int>(cols), static_cast<int>(tile_rows), dx_vec, w_vec, dl_vec);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T, int kTE>
void launch_dw(cudaStream_t stream, Tensor dw, Tensor x, Tensor dlogits, int64_t n_tok, int64_t d,
               int64_t n_exp) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  const int64_t tiles = (n_exp + kTE - 1) / kTE;
  const int64_t col_blocks = ((d + V - 1) / V + kWarps * kColLanes - 1) / (kWarps * kColLanes);
  // Row blocks from N, d and E alone (dw's summation order).
  int64_t blocks = (kDwTargetBlocks + tiles * col_blocks - 1) / (tiles * col_blocks);
  blocks = std::min(blocks, std::max<int64_t>(1, n_tok / kDwMinRows));
  blocks = std::min(
      blocks, std::max<int64_t>(1, static_cast<int64_t>(kPartialBytes / sizeof(A)) / (n_exp * d)));
  MOE_CHECK(col_blocks <= 65535,
            "router_logits_backward: d = " + std::to_string(d) + " is too large for the dw grid");
  const bool x_vec = d % V == 0 && aligned16({x.data});
  logits_dw_kernel<T, kTE><<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(col_blocks),
                                  static_cast<unsigned>(blocks)),
                             kThreads, 0, stream>>>(
      data_of<A>(dw), data_of<T>(x), data_of<A>(dlogits), n_tok, d, static_cast<int>(n_exp), x_vec);
  MOE_CUDA_LAUNCH_CHECK();
  if (blocks == 1) return;
  const int64_t cols = n_exp * d;
  add_column_partials<A, DwPartials>(stream, data_of<A>(dw), blocks, cols);
}

// Sizes the kernels index with int (E, columns of a tile); rows and offsets are int64.
void check_int_sizes(int64_t d, int64_t n_exp, const char* op) {
  MOE_CHECK(n_exp <= (int64_t(1) << 24) && d <= (int64_t(1) << 40),
            std::string(op) + ": E = " + std::to_string(n_exp) + ", d = " + std::to_string(d) +
                " out of the CUDA kernels' range");
}

void router_logits_forward(Ctx& ctx, Tensor logits, Tensor x, Tensor w) {
  const RouterLogitsDims s = check_router_logits_forward_args(logits, x, w, ctx.device);
  check_int_sizes(s.d, s.e, "router_logits_forward");
  cudaStream_t stream = stream_of(ctx);
  if (s.n == 0 || s.e == 0) return;
  if (s.d == 0) {  // empty sums: +0 (all-zero bits)
    MOE_CUDA_CHECK(cudaMemsetAsync(logits.data, 0, logits.nbytes(), stream));
    return;
  }
  if (router_logits_forward_mma(ctx, logits, x, w)) return;        // E <= 8 on tensor cores
  if (router_logits_forward_split_mma(ctx, logits, x, w)) return;  // wider bf16 gates
  dispatch_storage(x.dtype, "router_logits_forward", [&](auto zero) {
    using T = decltype(zero);
    // Experts per tile, rows per lane, chunks in flight: up to 8 experts the pass is memory
    // bound (two chunks ahead); past 8, tiles of 16 (x read from DRAM once, L2 for the others).
    if (s.e <= 4) {
      launch_forward<T, 4, 2, 2>(stream, logits, x, w, s.n, s.d, s.e);
    } else if constexpr (std::is_same_v<T, double>) {  // 16 double accumulators a tile is plenty
      launch_forward<T, 8, 2, 2>(stream, logits, x, w, s.n, s.d, s.e);
    } else {
      if (s.e <= 8)
        launch_forward<T, 8, 2, 2>(stream, logits, x, w, s.n, s.d, s.e);
      else
        launch_forward<T, 16, 2, 1>(stream, logits, x, w, s.n, s.d, s.e);
    }
  });
}

void router_logits_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x, Tensor w) {
  const RouterLogitsDims s = check_router_logits_backward_args(dx, dw, dlogits, x, w, ctx.device);
  check_int_sizes(s.d, s.e, "router_logits_backward");
  if (s.n == 0 || s.e == 0 || s.d == 0) return;  // dx += 0 and dw += 0 change no bits
  if (router_logits_backward_rows(ctx, dx, dw, dlogits, x, w)) return;       // the gate's shape
  if (router_logits_backward_split_mma(ctx, dx, dw, dlogits, x, w)) return;  // wider bf16 gates
  cudaStream_t stream = stream_of(ctx);
  dispatch_storage(x.dtype, "router_logits_backward", [&](auto zero) {
    using T = decltype(zero);
    // dx: small E is memory bound (two chunks in flight); large E compute bound (more rows per
    // lane, so each W and dl value read serves more FMAs).
    if (!dx.empty()) {  // (empty: no dx wanted)
      if constexpr (std::is_same_v<T, double>) {
        launch_dx<T, 2, 2>(stream, dx, dlogits, w, s.n, s.d, s.e);
      } else if (s.e <= 8) {
        launch_dx<T, 2, 2>(stream, dx, dlogits, w, s.n, s.d, s.e);
      } else {
        launch_dx<T, 4, 0>(stream, dx, dlogits, w, s.n, s.d, s.e);
      }
    }
    // dw: kTE x kVec accumulators a lane (64 values; 16 doubles).
    launch_dw<T, std::is_same_v<T, float> ? 16 : 8>(stream, dw, x, dlogits, s.n, s.d, s.e);
  });
}

}  // namespace
}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(router_logits_forward, &::moe::cuda_detail::router_logits_forward);
MOE_REGISTER_CUDA_OP(router_logits_backward, &::moe::cuda_detail::router_logits_backward);
