// Warp-level building blocks of the sm_80+ flash attention kernels (attention_sm80.cu forward,
// attention_sm80_backward.cu backward), head_dim 64, tiles of 64 rows staged in shared memory with
// a 72-element row stride (144 B: the 8 row addresses of one ldmatrix fall on 8 bank groups).
//
// Every product in attention is one of two shapes for a warp that owns 16 rows:
//   C (16 x 64) = A (16 x 64, fragments in registers) . B^T, B a staged [64][64] tile
//       (S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T: B is read k-contiguous)
//   acc (16 x 64) += C (16 x 64, an accumulator in registers) . B, B a staged [64][64] tile
//       (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q: B is read transposed)
// The second works because the m16n8 accumulator layout of two adjacent n8 fragments is the
// m16k16 A-fragment layout: C is rounded to 16 bits in place (pack2), as FlashAttention does.
#pragma once
#include "cuda/cuda_common.cuh"
#include "cuda/mma_sm80.cuh"

namespace moe::cuda_detail::flash {

constexpr int kD = 64;       // head_dim
constexpr int kLd = kD + 8;  // staged row stride (elements)
constexpr int kTile = 64;    // rows of a staged tile
constexpr int kTileElems = kTile * kLd;
constexpr int kSteps = kD / 16;  // k16 steps over head_dim (= over a tile's 64 rows)
constexpr int kFrags = 8;        // n8 fragments of a 16 x 64 accumulator

using Frags = uint32_t[kSteps][4];  // a warp's 16 x 64 A operand
using Accum = float[kFrags][4];     // a warp's 16 x 64 fp32 accumulator

// A fragments of rows [row0, row0 + 16) of a staged tile (all 64 columns).
template <class T>
__device__ __forceinline__ void load_a(Frags& a, const T* tile, int row0) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
    ldmatrix_x4<false>(a[s], tile + (row0 + (lane & 15)) * kLd + s * 16 + (lane >> 4) * 8);
}

__device__ __forceinline__ void zero(Accum& c) {
#pragma unroll
  for (int j = 0; j < kFrags; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[j][e] = 0.0f;
}

// c = A B^T: c(r, n) = sum_d A(r, d) tile[n][d].
template <class T>
__device__ __forceinline__ void abt(Accum& c, const Frags& a, const T* tile) {
  const int lane = static_cast<int>(threadIdx.x) & 31, q = lane >> 3, r = lane & 7;
  zero(c);
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int p = 0; p < kFrags / 2; ++p) {
      uint32_t b[4];
      ldmatrix_x4<false>(b, tile + (16 * p + r + (q >> 1) * 8) * kLd + s * 16 + (q & 1) * 8);
      mma_16816<T>(c[2 * p], a[s], b[0], b[1]);
      mma_16816<T>(c[2 * p + 1], a[s], b[2], b[3]);
    }
}

// acc += C B: acc(r, d) += sum_n C(r, n) tile[n][d], C rounded to T first.
template <class T>
__device__ __forceinline__ void cb(Accum& acc, const Accum& c, const T* tile) {
  const int lane = static_cast<int>(threadIdx.x) & 31, q = lane >> 3, r = lane & 7;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    // A registers: (row g, k 0-7), (g + 8, k 0-7), (g, k 8-15), (g + 8, k 8-15) of this k16 step
    const uint32_t a[4] = {pack2<T>(c[2 * s][0], c[2 * s][1]), pack2<T>(c[2 * s][2], c[2 * s][3]),
                           pack2<T>(c[2 * s + 1][0], c[2 * s + 1][1]),
                           pack2<T>(c[2 * s + 1][2], c[2 * s + 1][3])};
#pragma unroll
    for (int p = 0; p < kFrags / 2; ++p) {
      uint32_t b[4];
      ldmatrix_x4<true>(b, tile + (16 * s + r + (q & 1) * 8) * kLd + 16 * p + (q >> 1) * 8);
      mma_16816<T>(acc[2 * p], a, b[0], b[1]);
      mma_16816<T>(acc[2 * p + 1], a, b[2], b[3]);
    }
  }
}

// Hands every accumulator element to f(half, col, value&): the element of row lane/4 + 8 half and
// column col (in [0, 64)) of the warp's tile. half is a compile-time value after unrolling, so
// per-row state indexed by it stays in registers.
template <class F>
__device__ __forceinline__ void for_each(Accum& c, F&& f) {
  const int t4 = static_cast<int>(threadIdx.x) & 3;
#pragma unroll
  for (int j = 0; j < kFrags; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(e >> 1, 8 * j + 2 * t4 + (e & 1), c[j][e]);
}

// Stores row `row` (0..15 of the warp's tile: this lane holds row lane/4 and lane/4 + 8) of an
// accumulator times `scale` to dst[0..64).
template <class T>
__device__ __forceinline__ void store_row(T* dst, const Accum& c, int half, float scale) {
  const int t4 = static_cast<int>(threadIdx.x) & 3;
#pragma unroll
  for (int j = 0; j < kFrags; ++j)
    store_pair(dst + 8 * j + 2 * t4, c[j][2 * half] * scale, c[j][2 * half + 1] * scale);
}

}  // namespace moe::cuda_detail::flash
