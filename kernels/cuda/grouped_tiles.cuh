// Row tiles over expert segments, shared by the grouped (per-expert) GEMM kernels: expert e's
// rows [offsets[e], offsets[e+1]) are cut into ceil(count_e / kRowTile) tiles, experts in order,
// so a tile never mixes experts. The offsets live on the device; every block finds its own tile
// with one warp-wide scan (no host-side schedule, no synchronisation).
#pragma once
#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"

namespace moe::cuda_detail {

// Whether a 16-bit matrix at p with leading dimension ld_elems (and experts stride_elems apart)
// can be read in whole 16-byte chunks: an aligned base and both strides multiples of 8 elements.
inline bool aligned16_rows(const void* p, int64_t ld_elems, int64_t stride_elems = 0) {
  return aligned16({p}) && ld_elems % 8 == 0 && stride_elems % 8 == 0;
}

// The rows kernels' size requirements: rows of whole 16-byte chunks (n_total and k_total
// multiples of 8 elements), and the row tiles of `rows` rows (kBM per tile, plus one cut per
// expert) within grid.y's 65535. (With 16-byte aligned pointers, as the arena's are: the
// decision of rows_operands_fit before any tensor exists.)
inline bool rows_sizes_fit(int64_t n_total, int64_t k_total, int64_t rows, int experts,
                           int64_t kBM) {
  return k_total % 8 == 0 && n_total % 8 == 0 && (rows + kBM - 1) / kBM + experts <= 65535;
}

// The pipelined rows kernels' requirements (grouped_mma_sm80.cu, grouped_wgmma_sm90.cu): every
// operand readable in whole 16-byte chunks (so each chunk is wholly in or out of bounds), and
// rows_sizes_fit.
inline bool rows_operands_fit(const void* c, const void* a, const void* w, int64_t n_total,
                              int64_t k_total, int64_t expert_stride, bool b_k_fast, int64_t rows,
                              int experts, int64_t kBM) {
  return aligned16_rows(a, k_total) && aligned16_rows(c, n_total) &&
         aligned16_rows(w, b_k_fast ? k_total : n_total, expert_stride) &&
         rows_sizes_fit(n_total, k_total, rows, experts, kBM);
}

// Offsets are clamped to [0, rows]: malformed offsets (a caller bug; the CPU op checks them) can
// leave rows unwritten but never read or write out of bounds.
__device__ __forceinline__ int64_t clamp_offset(int32_t v, int64_t rows) {
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// The expert and row range [r0, r1) of row tile `tile`. Run by one full warp (32 experts per
// step with a warp prefix sum); returns false past the last tile.
template <int kRowTile>
__device__ bool find_row_tile(const int32_t* offsets, int experts, int64_t rows, int64_t tile,
                              int* expert, int64_t* r0, int64_t* r1) {
  const int lane = threadIdx.x & 31;
  int64_t before = 0;  // tiles of the experts scanned so far
  for (int e0 = 0; e0 < experts; e0 += 32) {
    const int e = e0 + lane;
    int64_t start = 0, count = 0;
    if (e < experts) {
      start = clamp_offset(offsets[e], rows);
      count = clamp_offset(offsets[e + 1], rows) - start;
      if (count < 0) count = 0;
    }
    const int64_t tiles = (count + kRowTile - 1) / kRowTile;
    int64_t incl = tiles;  // inclusive prefix sum over the lanes
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const int64_t first = before + incl - tiles;
    const bool mine = tiles > 0 && tile >= first && tile < before + incl;
    const unsigned owner = __ballot_sync(0xffffffffu, mine);
    if (owner) {  // the same for every lane
      const int src = __ffs(owner) - 1;
      const int64_t begin = start + (tile - first) * kRowTile;
      const int64_t end = start + count;
      *expert = __shfl_sync(0xffffffffu, e, src);
      *r0 = __shfl_sync(0xffffffffu, begin, src);
      *r1 = __shfl_sync(0xffffffffu, begin + kRowTile < end ? begin + kRowTile : end, src);
      return true;
    }
    before += __shfl_sync(0xffffffffu, incl, 31);
  }
  return false;
}

// The calling block's row tile (row tile `tile`, the same for every thread), found by its first
// warp and shared with every thread: returns the expert (-1 past the last tile: the whole block
// should exit) and sets [r0, r1). All threads of the block must call it (it synchronises the
// block).
template <int kRowTile>
__device__ __forceinline__ int block_row_tile(const int32_t* offsets, int experts, int64_t rows,
                                              int64_t tile, int64_t* r0, int64_t* r1) {
  __shared__ int s_expert;
  __shared__ int64_t s_r0, s_r1;
  if (threadIdx.x < 32) {
    int e = -1;
    int64_t b = 0, end = 0;
    const bool found = find_row_tile<kRowTile>(offsets, experts, rows, tile, &e, &b, &end);
    if (threadIdx.x == 0) {
      s_expert = found ? e : -1;
      s_r0 = b;
      s_r1 = end;
    }
  }
  __syncthreads();
  *r0 = s_r0;
  *r1 = s_r1;
  return s_expert;
}

}  // namespace moe::cuda_detail
