// The router gate's matmul for the wider bf16 gates (bf16 x, 16 < E <= 64: moe-fine's 64 experts)
// on bf16 tensor cores: router_logits_forward and _backward, where the tf32 product and the
// one-pass backward of router_fused.cu / router_backward_rows.cu (E <= 8) do not reach and
// router_logits.cu's FMA kernels are bound by their N d E FMAs. Until now the trainer ran those
// gates as the bf16 split products of router_matmul.cpp (cuBLAS over [N, 3E] and [N, 6E] split
// copies, a zeroing pass and summing passes: ~140 us a moe-fine layer on an H100). Here the same
// parts:
// - fp32 values as three bf16 parts, v = p1 + p2 + p3 exactly (moe/ops/bf16_split.hpp): a product
//   of a bf16 part and a bf16 value (x, or another part) is exact in fp32, so the mma sums are the
//   fp32 product up to the order of the fp32 additions, as on the split path.
// - forward: logits = x (w1 + w2 + w3)^T (below, at the forward kernel).
// - dx += dy w: the three largest cross terms p_dy q_w with p + q <= 3 (1-based: dy1 w1, dy1 w2,
//   dy2 w1), over k = E each, into one fp32 accumulator per element, added to the dx value read
//   and rounded once to bf16. The terms left out are below 2^-16 of the largest (the split path's
//   six terms reach 2^-24): 2^-7 of dx's own bf16 rounding step, so dx rounds as from the fp32
//   product but in a fraction of a percent of elements, where it is one bf16 step off. mma.sync
//   throughput bounds these products: measured (H100, moe-fine's 16,384 x 1,024 x 64; docs/perf.md,
//   39th and 40th sessions) the backward 82 us with three terms, 89 with six, the forward 26,
//   against ~140 us a layer for the split path's cuBLAS products and passes.
// - dw += dy^T x = (dy1 + dy2 + dy3)^T x, x exact in bf16: three products over the rows, the fp32
//   product up to the order of its sums (dw is a master gradient: no term left out).
// The backward is two kernels over the same work items: a block owns 128 columns of d and a fixed
// group of 64-row tiles, and per tile splits the tile's dy rows into shared memory
// ([part][row][expert]); 8 warps (2 x 4) each take 32 rows (dx) or 32 experts (dw) x 32 columns.
// The dx kernel splits its W slice once ([part][col][expert]) and per k-step loads the dy parts'
// fragments once for all the terms, with the tile's old dx values loaded before its products. The
// dw kernel copies the x tiles by cp.async a tile ahead and keeps its sums in registers over the
// group. (One kernel doing both, first written, ran at 99 us a moe-fine layer: with both
// accumulator sets live it had no registers left to hoist fragments or prefetch dx.) Shared tiles
// are XOR-swizzled in 16-byte chunks (row r's chunk c at c ^ (r % 8)) so ldmatrix's eight row
// addresses hit eight different banks. Experts past E and rows past N are zeros in shared memory
// (dx rows past N are neither read nor written).
// - dw's row groups depend on the shape alone (N, and E and d through the partials' cap:
//   row_groups): each dw block writes its partial [E, 128 columns] to a
//   device scratch and add_column_partials (column_partials.cuh) adds the groups' partials to dw
//   in a fixed order, so dw is bitwise the same on every run and device (no atomics); every other
//   sum is per element in a fixed order.
// sm_80+ (cp.async, ldmatrix, bf16 mma); the kernels take 56-80 KiB of shared memory a block. The
// scratches are one per device, used in stream order (as router_logits.cu's).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "cuda/bf16_parts.cuh"
#include "cuda/column_partials.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/router_paths.hpp"
#include "cuda/vec16.cuh"
#include "moe/ops/router.hpp"

namespace moe::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;  // 8 warps
constexpr int kE = 64;         // experts, zero-padded
constexpr int kRows = 64;      // rows of a backward tile
constexpr int kCols = 128;     // columns of d a backward block owns
constexpr int kParts = 3;
constexpr int64_t kTilesPerGroup = 8;  // row tiles a backward block walks (at most, unless
                                       // the partials' cap binds: row_groups)
// dx's cross terms: the parts p of dy and q of w with p + q < kDxParts (0-based; see the top
// comment).
constexpr int kDxParts = 2;
constexpr size_t kScratchBytes = size_t(8) << 20;

constexpr int kExpertRowBytes = kE * 2;                // a [.][kE] bf16 row: 128 bytes
constexpr int kColRowBytes = kCols * 2;                // a [.][kCols] bf16 row: 256 bytes
constexpr int kWPartBytes = kCols * kExpertRowBytes;   // W's part: [kCols][kE]
constexpr int kDyPartBytes = kRows * kExpertRowBytes;  // a dy tile's part: [kRows][kE]
constexpr int kXTileBytes = kRows * kColRowBytes;      // an x tile: [kRows][kCols]
constexpr size_t kDxSmemBytes = size_t(kParts) * (kWPartBytes + kDyPartBytes);    // 72 KiB
constexpr size_t kDwSmemBytes = size_t(kParts) * kDyPartBytes + 2 * kXTileBytes;  // 56 KiB

// (16-byte aligned: float2 stores; the other global takes 16-byte cp.async reads)
__device__ __align__(16) float g_router_split_partials[kScratchBytes / sizeof(float)];
struct SplitPartials {  // for add_column_partials
  template <class A>
  __device__ static const A* get() {
    return reinterpret_cast<const A*>(g_router_split_partials);
  }
};

// Byte offset of 16-bit element (row, col) in a tile of `row_bytes` rows (a multiple of 128),
// its 16-byte chunks XOR-swizzled by row (see the top comment).
__device__ __forceinline__ uint32_t swz(int row, int col, int row_bytes) {
  return row * row_bytes + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 16 + (col & 7) * 2;
}

// ldmatrix_x4's lane addresses in a swizzled [row][expert] tile of kExpertRowBytes rows, k-step
// k16: the A fragment of rows r0 .. r0 + 15 (four 8 x 8 matrices: rows +0 / +8, experts +0 / +8)
// and the B fragments of rows r0 .. r0 + 15 taken as two n8 halves (rows +0 / +8 outermost).
__device__ __forceinline__ uint32_t a_fragment_at(int r0, int k16, int lane) {
  return swz(r0 + (lane & 7) + 8 * ((lane >> 3) & 1), 16 * k16 + 8 * (lane >> 4), kExpertRowBytes);
}
__device__ __forceinline__ uint32_t b_fragment_at(int r0, int k16, int lane) {
  return swz(r0 + (lane & 7) + 8 * (lane >> 4), 16 * k16 + 8 * ((lane >> 3) & 1), kExpertRowBytes);
}

__device__ __forceinline__ uint32_t bits2(bf16 lo, bf16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}

// A 4-byte global load issued where it stands: volatile asm keeps its place among the mma
// (volatile asm too), where the compiler would sink a plain load to its use after them.
__device__ __forceinline__ uint32_t load_early(const bf16* p) {
  uint32_t v;
  asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// The backward blocks' work: 128 columns from c0 and row tiles [begin, end) (grid (d / kCols,
// row groups)); per tile, thread (row tid / 4, experts 16 (tid % 4) ..) carries 16 dy values
// from global memory (a tile ahead) into the tile's three parts in shared memory.
struct BackwardItems {
  int64_t c0, begin, end;
  __device__ BackwardItems(int64_t n_tok) {
    const int64_t tiles = (n_tok + kRows - 1) / kRows, groups = gridDim.y;
    c0 = int64_t(blockIdx.x) * kCols;
    begin = tiles * blockIdx.y / groups;
    end = tiles * (blockIdx.y + 1) / groups;
  }
};

struct DyRows {
  float v[16];
  __device__ void load(const float* __restrict__ dl, int64_t tile, int64_t n_tok, int n_exp) {
    const int64_t row = tile * kRows + (threadIdx.x >> 2);
    const int e0 = (threadIdx.x & 3) * 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + 4 * j;
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (row < n_tok && e < n_exp)
        f = __ldg(reinterpret_cast<const float4*>(dl + row * n_exp + e));
      v[4 * j] = f.x, v[4 * j + 1] = f.y, v[4 * j + 2] = f.z, v[4 * j + 3] = f.w;
    }
  }
  // Into ap [part][row][expert] (16-byte stores: a quarter warp's 8 hit 8 bank groups).
  __device__ void store_parts(unsigned char* ap) const {
    const int row = threadIdx.x >> 2, e0 = (threadIdx.x & 3) * 16;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t words[kParts][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const Bf16Parts lo = split3(v[8 * half + 2 * j]), hi = split3(v[8 * half + 2 * j + 1]);
#pragma unroll
        for (int k = 0; k < kParts; ++k) words[k][j] = bits2(lo.p[k], hi.p[k]);
      }
#pragma unroll
      for (int k = 0; k < kParts; ++k)
        *reinterpret_cast<uint4*>(ap + k * kDyPartBytes +
                                  swz(row, e0 + 8 * half, kExpertRowBytes)) =
            make_uint4(words[k][0], words[k][1], words[k][2], words[k][3]);
    }
  }
};

// dx += dy w for the block's columns (grid (d / kCols, row groups), kThreads threads,
// kDxSmemBytes of dynamic shared memory); warp (wm, wn) takes rows 32 wm .. and columns 32 wn ..
// of each tile.
__global__ void __launch_bounds__(kThreads, 2)
    router_split_dx_kernel(bf16* dx, const float* __restrict__ dl, const float* __restrict__ w,
                           int64_t n_tok, int64_t d, int n_exp) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ws = smem;                       // [part][col][expert]
    unsigned char* ap = ws + kParts * kWPartBytes;  // [part][row][expert]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3, wm = warp >> 2, wn = warp & 3;
    const BackwardItems items(n_tok);
    // W's slice split once: thread (expert tid % 64, column quad) stores its 4 columns' parts
    // transposed; a warp's stores of one column are 32 consecutive experts.
    {
      const int e = tid % kE;
#pragma unroll 2
      for (int q = tid / kE; q < kCols / 4; q += kThreads / kE) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (e < n_exp) v = __ldg(reinterpret_cast<const float4*>(w + e * d + items.c0 + 4 * q));
        const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const Bf16Parts p = split3(vals[j]);
#pragma unroll
          for (int k = 0; k < kParts; ++k)
            *reinterpret_cast<bf16*>(ws + k * kWPartBytes + swz(4 * q + j, e, kExpertRowBytes)) =
                p.p[k];
        }
      }
    }
    bf16* out = dx + items.c0 + 32 * wn + 2 * t4;  // + row d + 8 ni: this thread's pairs
    DyRows dy;
    if (items.begin < items.end) dy.load(dl, items.begin, n_tok, n_exp);
    for (int64_t tile = items.begin; tile < items.end; ++tile) {
      __syncthreads();  // every warp is done with the previous tile's parts (and W's are in)
      dy.store_parts(ap);
      if (tile + 1 < items.end) dy.load(dl, tile + 1, n_tok, n_exp);
      // The tile's old dx pairs, in flight through the products: rows 32 wm + 16 mi + 8 h + g.
      uint32_t old[2][2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = tile * kRows + 32 * wm + 16 * mi + 8 * h + g;
#pragma unroll
          for (int ni = 0; ni < 4; ++ni)
            old[mi][h][ni] = row < n_tok ? load_early(out + row * d + 8 * ni) : 0u;
        }
      __syncthreads();  // the tile's dy parts are in shared memory
      float acc[2][4][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.0f;
#pragma unroll
      for (int k16 = 0; k16 < kE / 16; ++k16) {
        uint32_t a[kDxParts][2][4];  // the dy parts' fragments, for all the terms
#pragma unroll
        for (int p = 0; p < kDxParts; ++p)
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
            ldmatrix_x4<false>(a[p][mi],
                               ap + p * kDyPartBytes + a_fragment_at(32 * wm + 16 * mi, k16, lane));
            // W's parts q from the smallest, each against the dy parts p with p + q < kDxParts
            // (0-based), the smaller terms first.
#pragma unroll
        for (int q = kDxParts - 1; q >= 0; --q) {
          uint32_t b[2][4];
#pragma unroll
          for (int np = 0; np < 2; ++np)
            ldmatrix_x4<false>(b[np],
                               ws + q * kWPartBytes + b_fragment_at(32 * wn + 16 * np, k16, lane));
#pragma unroll
          for (int p = kDxParts - 1 - q; p >= 0; --p)
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
              for (int ni = 0; ni < 4; ++ni)
                mma_16816<bf16>(acc[mi][ni], a[p][mi], b[ni >> 1][2 * (ni & 1)],
                                b[ni >> 1][2 * (ni & 1) + 1]);
        }
      }
      // dx += the sums, rounded once.
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = tile * kRows + 32 * wm + 16 * mi + 8 * h + g;
          if (row >= n_tok) continue;
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) {
            const __nv_bfloat162 o = *reinterpret_cast<const __nv_bfloat162*>(&old[mi][h][ni]);
            *reinterpret_cast<uint32_t*>(out + row * d + 8 * ni) = pack2<bf16>(
                __low2float(o) + acc[mi][ni][2 * h], __high2float(o) + acc[mi][ni][2 * h + 1]);
          }
        }
    }
  }
}

// The row groups' dw sums for the block's columns (grid (d / kCols, row groups), kThreads
// threads, kDwSmemBytes of dynamic shared memory): warp (wm, wn) takes experts 32 wm .. and
// columns 32 wn ..; k = the tile's rows, A a dy part transposed ([row][expert] stored), B the x
// tile ([row][col] stored). `direct`: one row group, whose sums go straight into dw.
__global__ void __launch_bounds__(kThreads, 2)
    router_split_dw_kernel(float* __restrict__ dw, const float* __restrict__ dl,
                           const bf16* __restrict__ x, int64_t n_tok, int64_t d, int n_exp,
                           bool direct) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ap = smem;                        // [part][row][expert]
    unsigned char* xs = ap + kParts * kDyPartBytes;  // [stage][row][col]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3, wm = warp >> 2, wn = warp & 3;
    const BackwardItems items(n_tok);
    // A tile's x rows by cp.async into stage st (zeros past N): 4 chunks a thread.
    auto copy_x = [&](int64_t tile, int st) {
#pragma unroll
      for (int i = 0; i < kRows * kCols / 8 / kThreads; ++i) {
        const int c = tid + i * kThreads, r = c / (kCols / 8), col = (c % (kCols / 8)) * 8;
        const int64_t row = tile * kRows + r;
        const bool valid = row < n_tok;
        cp_async16(xs + st * kXTileBytes + swz(r, col, kColRowBytes),
                   valid ? x + row * d + items.c0 + col : x, valid);
      }
      cp_async_commit();
    };
    float dwa[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) dwa[i][j][k] = 0.0f;
    DyRows dy;
    if (items.begin < items.end) {
      copy_x(items.begin, 0);
      dy.load(dl, items.begin, n_tok, n_exp);
    }
    for (int64_t tile = items.begin; tile < items.end; ++tile) {
      const int st = int((tile - items.begin) & 1);
      __syncthreads();  // every warp is done with the previous tile's parts and x stage
      dy.store_parts(ap);
      if (tile + 1 < items.end) {
        copy_x(tile + 1, st ^ 1);
        dy.load(dl, tile + 1, n_tok, n_exp);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // this tile's dy parts and x rows are in shared memory
      const unsigned char* xt = xs + st * kXTileBytes;
#pragma unroll
      for (int k16 = 0; k16 < kRows / 16; ++k16) {
        uint32_t b[2][4];
#pragma unroll
        for (int np = 0; np < 2; ++np)
          ldmatrix_x4<true>(b[np], xt + swz(16 * k16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                            32 * wn + 16 * np + 8 * (lane >> 4), kColRowBytes));
#pragma unroll
        for (int p = kParts - 1; p >= 0; --p) {
          uint32_t a[2][4];
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
            ldmatrix_x4<true>(a[mi],
                              ap + p * kDyPartBytes +
                                  swz(16 * k16 + (lane & 7) + 8 * (lane >> 4),
                                      32 * wm + 16 * mi + 8 * ((lane >> 3) & 1), kExpertRowBytes));
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
              mma_16816<bf16>(dwa[mi][ni], a[mi], b[ni >> 1][2 * (ni & 1)],
                              b[ni >> 1][2 * (ni & 1) + 1]);
        }
      }
    }
    // The group's sums: experts past E are not written.
    float* out = direct ? dw : g_router_split_partials + int64_t(blockIdx.y) * n_exp * d;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 32 * wm + 16 * mi + g + 8 * h;
        if (e >= n_exp) continue;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          float2* q = reinterpret_cast<float2*>(out + e * d + items.c0 + 32 * wn + 8 * ni + 2 * t4);
          float2 v = make_float2(dwa[mi][ni][2 * h], dwa[mi][ni][2 * h + 1]);
          if (direct) {
            const float2 o = *q;
            v = make_float2(o.x + v.x, o.y + v.y);
          }
          *q = v;
        }
      }
  }
}

// ---- the forward: logits = x w^T ------------------------------------------------------------
// W's three parts are split once a call into a device buffer ([part][expert][d], experts past E
// zeros); a block takes 128 rows and walks d in slices of 64 columns, each slice's x rows and W
// parts copied by cp.async a slice ahead (two stages of 40 KiB); its 8 warps (4 x 2) each sum 32
// rows x 32 experts, the top part's products and the two small parts' in accumulators of their
// own (shorter chains of dependent mma), added at the end (small parts first, as router_fused.cu).
// Each logit's summation order depends on d alone.

constexpr int kFwdRows = 128;
constexpr int kFwdK = 64;                               // columns of d a stage holds
constexpr int64_t kMaxSplitD = 8192;                    // W's parts buffer: [kParts][kE][d]
constexpr int kFwdXBytes = kFwdRows * kExpertRowBytes;  // [row][k] (128-byte rows): 16 KiB
constexpr int kFwdWPartBytes = kE * kExpertRowBytes;    // [expert][k]: 8 KiB
constexpr int kFwdStageBytes = kFwdXBytes + kParts * kFwdWPartBytes;
constexpr size_t kFwdSmemBytes = size_t(2) * kFwdStageBytes;
static_assert(kFwdK * 2 == kExpertRowBytes, "a stage's rows are 128 bytes, as the expert rows");

__device__ __align__(16) uint16_t g_router_w_parts[size_t(kParts) * kE * kMaxSplitD];

// W's parts into g_router_w_parts (a grid-stride loop over [kE, d]).
__global__ void split_w_kernel(const float* __restrict__ w, int64_t d, int n_exp) {
  const int64_t n = int64_t(kE) * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Bf16Parts p = split3(i / d < n_exp ? w[i] : 0.0f);  // i = e d + k: w's own index, e < E
#pragma unroll
    for (int k = 0; k < kParts; ++k) g_router_w_parts[k * n + i] = __bfloat16_as_ushort(p.p[k]);
  }
}

// grid ceil(N / kFwdRows), kThreads threads, kFwdSmemBytes of dynamic shared memory. One block an
// SM for the registers (two accumulator sets spill at 128): moe-fine's 16K rows are 128 blocks.
__global__ void __launch_bounds__(kThreads, 1)
    router_split_forward_kernel(float* __restrict__ logits, const bf16* __restrict__ x,
                                int64_t n_tok, int64_t d, int n_exp) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;  // 32-row quarter, 32-expert half
    const int64_t row0 = int64_t(blockIdx.x) * kFwdRows, slices = d / kFwdK;
    const int64_t part_elems = int64_t(kE) * d;
    const bf16* parts = reinterpret_cast<const bf16*>(g_router_w_parts);
    // Slice kc's x rows (zeros past N: 4 chunks a thread) and W parts (6) into stage st.
    auto copy_slice = [&](int64_t kc, int st) {
      unsigned char* base = smem + st * kFwdStageBytes;
#pragma unroll
      for (int i = 0; i < kFwdRows * kFwdK / 8 / kThreads; ++i) {
        const int c = tid + i * kThreads, r = c / (kFwdK / 8), col = (c % (kFwdK / 8)) * 8;
        const int64_t row = row0 + r;
        const bool valid = row < n_tok;
        cp_async16(base + swz(r, col, kExpertRowBytes), valid ? x + row * d + kc * kFwdK + col : x,
                   valid);
      }
#pragma unroll
      for (int i = 0; i < kParts * kE * kFwdK / 8 / kThreads; ++i) {
        const int c = tid + i * kThreads, p = c / (kE * kFwdK / 8), rem = c % (kE * kFwdK / 8);
        const int e = rem / (kFwdK / 8), col = (rem % (kFwdK / 8)) * 8;
        cp_async16(base + kFwdXBytes + p * kFwdWPartBytes + swz(e, col, kExpertRowBytes),
                   parts + p * part_elems + e * d + kc * kFwdK + col, true);
      }
      cp_async_commit();
    };
    float top[2][4][4], small[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) top[i][j][k] = small[i][j][k] = 0.0f;
    copy_slice(0, 0);
    for (int64_t kc = 0; kc < slices; ++kc) {
      const int st = int(kc & 1);
      if (kc + 1 < slices) {
        copy_slice(kc + 1, st ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // slice kc is in stage st
      const unsigned char* xt = smem + st * kFwdStageBytes;
      const unsigned char* wt = xt + kFwdXBytes;
#pragma unroll
      for (int k16 = 0; k16 < kFwdK / 16; ++k16) {
        uint32_t a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          ldmatrix_x4<false>(a[mi], xt + a_fragment_at(32 * wm + 16 * mi, k16, lane));
#pragma unroll
        for (int p = kParts - 1; p >= 0; --p) {
          uint32_t b[2][4];
#pragma unroll
          for (int np = 0; np < 2; ++np)
            ldmatrix_x4<false>(
                b[np], wt + p * kFwdWPartBytes + b_fragment_at(32 * wn + 16 * np, k16, lane));
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
              mma_16816<bf16>(p == 0 ? top[mi][ni] : small[mi][ni], a[mi], b[ni >> 1][2 * (ni & 1)],
                              b[ni >> 1][2 * (ni & 1) + 1]);
        }
      }
      __syncthreads();  // every warp is done with stage st: slice kc + 2 may land there
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + 32 * wm + 16 * mi + g + 8 * h;
        if (row >= n_tok) continue;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int e = 32 * wn + 8 * ni + 2 * t4;
          if (e < n_exp)  // E is a multiple of 4: a pair is inside or past it
            *reinterpret_cast<float2*>(logits + row * n_exp + e) =
                make_float2(small[mi][ni][2 * h] + top[mi][ni][2 * h],
                            small[mi][ni][2 * h + 1] + top[mi][ni][2 * h + 1]);
        }
      }
  }
}

// Whether this binary's kernels run on the current device with their shared memory.
bool kernels_available() {
  static const bool ok = [] {
    if (compiled_arch(router_split_dx_kernel) < 80) return false;
    int dev = 0, optin = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return std::max({kDxSmemBytes, kDwSmemBytes, kFwdSmemBytes}) <= static_cast<size_t>(optin);
  }();
  return ok;
}

// Row groups from N, E and d alone (dw's summation order): kTilesPerGroup tiles each, as many
// as the partials' scratch holds.
int64_t row_groups(int64_t n, int64_t e, int64_t d) {
  const int64_t tiles = (n + kRows - 1) / kRows;
  const int64_t cap = std::max<int64_t>(1, int64_t(kScratchBytes / sizeof(float)) / (e * d));
  return std::clamp<int64_t>((tiles + kTilesPerGroup - 1) / kTilesPerGroup, 1, cap);
}

bool shape_applies(DType dt, int64_t n, int64_t e, int64_t d) {
  // Past the 16 outputs of the routers' own paths (router_matmul.cpp's kFusedRouterOutputs),
  // whose measured kernels stay theirs.
  return dt == DType::bf16 && n >= 1 && e > 16 && e <= kE && e % 4 == 0 && d >= kCols &&
         d % kCols == 0 && d <= kMaxSplitD;
}

bool on_tensor_cores(DType dt, int64_t n, int64_t e, int64_t d) {
  return shape_applies(dt, n, e, d) && kernels_available();
}

}  // namespace

bool router_logits_forward_split_mma(Ctx& ctx, Tensor logits, Tensor x, Tensor w) {
  const int64_t n = x.size(0), d = x.size(1), e = w.size(0);
  if (!shape_applies(x.dtype, n, e, d) || logits.dtype != DType::f32 || w.dtype != DType::f32 ||
      !aligned16({x.data, w.data, logits.data}) || !kernels_available())
    return false;
  cudaStream_t stream = stream_of(ctx);
  split_w_kernel<<<grid_stride_blocks(kE * d, kThreads), kThreads, 0, stream>>>(
      data_of<const float>(w), d, static_cast<int>(e));
  MOE_CUDA_LAUNCH_CHECK();
  static std::once_flag once;
  std::call_once(once, [] { allow_dynamic_smem(router_split_forward_kernel, kFwdSmemBytes); });
  router_split_forward_kernel<<<static_cast<unsigned>((n + kFwdRows - 1) / kFwdRows), kThreads,
                                kFwdSmemBytes, stream>>>(
      data_of<float>(logits), data_of<const bf16>(x), n, d, static_cast<int>(e));
  MOE_CUDA_LAUNCH_CHECK();
  return true;
}

bool router_logits_backward_split_mma(Ctx& ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x,
                                      Tensor w) {
  const int64_t n = x.size(0), d = x.size(1), e = w.size(0);
  const bool wants_dx = !dx.empty();
  if (!shape_applies(x.dtype, n, e, d) || dlogits.dtype != DType::f32 || w.dtype != DType::f32 ||
      dw.dtype != DType::f32)
    return false;
  if (!aligned16({x.data, w.data, dw.data, dlogits.data}) || (wants_dx && !aligned16({dx.data})) ||
      memory_overlaps(dx, x) || !kernels_available())
    return false;
  const int64_t groups = row_groups(n, e, d);
  const bool direct = groups == 1;
  const dim3 grid(static_cast<unsigned>(d / kCols), static_cast<unsigned>(groups));
  cudaStream_t stream = stream_of(ctx);
  static std::once_flag once;
  std::call_once(once, [] {
    allow_dynamic_smem(router_split_dx_kernel, kDxSmemBytes);
    allow_dynamic_smem(router_split_dw_kernel, kDwSmemBytes);
  });
  if (wants_dx) {
    router_split_dx_kernel<<<grid, kThreads, kDxSmemBytes, stream>>>(
        data_of<bf16>(dx), data_of<const float>(dlogits), data_of<const float>(w), n, d,
        static_cast<int>(e));
    MOE_CUDA_LAUNCH_CHECK();
  }
  router_split_dw_kernel<<<grid, kThreads, kDwSmemBytes, stream>>>(
      data_of<float>(dw), data_of<const float>(dlogits), data_of<const bf16>(x), n, d,
      static_cast<int>(e), direct);
  MOE_CUDA_LAUNCH_CHECK();
  if (!direct) add_column_partials<float, SplitPartials>(stream, data_of<float>(dw), groups, e * d);
  return true;
}

}  // namespace moe::cuda_detail

// The model's query (moe/ops/router.hpp): whether router_logits_forward and _backward run these
// kernels for these sizes on the current device (16-byte aligned tensors assumed, as arena
// allocations are).
static const bool kRegistered =
    (::moe::cuda::router_logits_on_tensor_cores = &::moe::cuda_detail::on_tensor_cores, true);
