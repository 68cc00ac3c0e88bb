// Tensor-core grouped GEMMs (WMMA 16x16x16, f16 / bf16 in, fp32 accumulate) over expert segments
// whose offsets live on the device.
//
// One block computes a 128 x 128 output tile with 8 warps (2 along M x 4 along N, 64 x 32 each:
// 4 x 2 fragments). K advances 32 at a time: both operand tiles are staged in shared memory in
// their global layout (16-byte loads when aligned, zero-filled past the bounds), and the fragment
// layout (row / col major) is chosen to match, so the three products of the MoE layer share one
// loop:
//   y  = x w_e^T      A = x [R, in] (k fast), B(k, n) = w_e[n, k] (k fast)       rows kernel
//   dx = dy w_e       A = dy [R, out] (k fast), B(k, n) = w_e[k, n] (n fast)     rows kernel
//   dw_e += dy_e^T x_e  A(m, k) = dy[k, m] (m fast), B(k, n) = x[k, n] (n fast)  dw kernel
// Rows kernel: the row tiles are cut per expert (grouped_tiles.cuh), so a tile never mixes
// experts; grid ceil(R/128) + E row tiles (each expert wastes at most one partial tile) x
// ceil(n/128), blocks past the last tile exit at once. dw kernel: grid (in tiles, out tiles, E);
// a block loops over its expert's rows; an expert without rows returns before touching dw[e].
// Results are stored through a per-warp 16 x 16 fp32 staging tile: one rounding to the output
// dtype, or an fp32 += for dw.
// These kernels are single-buffered (no cp.async): the sm_70/sm_75 path and the fallback for
// unaligned operands. On sm_80+ the pipelined kernels of grouped_mma_sm80.cu run first, and on
// sm_90 the wgmma kernels of grouped_wgmma_sm90.cu before those.
#include <mma.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/grouped_mma.cuh"
#include "cuda/grouped_tiles.cuh"
#include "cuda/mma_common.cuh"
#include "moe/memory.hpp"

namespace moe::cuda_detail {
namespace {

using namespace nvcuda;

constexpr int kBM = 128, kBN = 128, kBK = 32;
constexpr int kThreads = 256;          // 8 warps
constexpr int kWarpsN = 4;             // warps along N; 2 along M
constexpr int kFragM = 4, kFragN = 2;  // 16 x 16 fragments per warp: 64 x 32 outputs
constexpr int kPad = 8;  // elements of padding per staged row: spreads banks, keeps 16 B
// A staged tile is kBM x kBK or kBK x kBM (+ padding on the fast dimension), B likewise.
constexpr int kStageElems = kBM * (kBK + kPad) > kBK*(kBM + kPad) ? kBM*(kBK + kPad)
                                                                  : kBK*(kBM + kPad);
static_assert(kBM == kBN, "A and B stages share one size");

// Stages a kOuter x kInner tile (kOuter * kInner = 4096) of a matrix whose element (o, i) is
// src[o * ld + i], for o in [o_begin, o_begin + kOuter), i in [i_begin, i_begin + kInner), into
// dst[o * (kInner + kPad) + i]; zeros outside [.., o_end) x [.., i_end). `vec`: ld and src are
// 16-byte aligned, so whole in-bounds 8-element chunks move as one 16-byte load.
template <class T, int kOuter, int kInner>
__device__ __forceinline__ void stage(T* dst, const T* src, int64_t ld, int64_t o_begin,
                                      int64_t o_end, int64_t i_begin, int64_t i_end, bool vec) {
  constexpr int kChunks = kInner / 8;
  constexpr int kPerThread = kOuter * kChunks / kThreads;
  static_assert(kPerThread * kThreads == kOuter * kChunks, "tile must split evenly");
#pragma unroll
  for (int it = 0; it < kPerThread; ++it) {
    const int c = static_cast<int>(threadIdx.x) + it * kThreads;
    const int o = c / kChunks, i = (c % kChunks) * 8;
    const int64_t go = o_begin + o, gi = i_begin + i;
    T* d = dst + o * (kInner + kPad) + i;
    if (go < o_end && vec && gi + 8 <= i_end) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(src + go * ld + gi);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        d[j] = (go < o_end && gi + j < i_end) ? src[go * ld + gi + j] : store<T>(0.0f);
    }
  }
}

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// acc += A B over k in [k_begin, k_end) for the block's tile: A(m, k) = a[m * lda + k] (kAKFast)
// or a[k * lda + m], m in [m_begin, m_end); B(k, n) = b[n * ldb + k] (kBKFast) or b[k * ldb + n],
// n in [n_begin, n_end). All threads of the block call it.
template <class T, bool kAKFast, bool kBKFast>
__device__ __forceinline__ void mma_tile(Acc (&acc)[kFragM][kFragN], T* as, T* bs, const T* a,
                                         int64_t lda, int64_t m_begin, int64_t m_end, bool vec_a,
                                         const T* b, int64_t ldb, int64_t n_begin, int64_t n_end,
                                         bool vec_b, int64_t k_begin, int64_t k_end) {
  using LayoutA = std::conditional_t<kAKFast, wmma::row_major, wmma::col_major>;
  using LayoutB = std::conditional_t<kBKFast, wmma::col_major, wmma::row_major>;
  constexpr int lda_s = kAKFast ? kBK + kPad : kBM + kPad;
  constexpr int ldb_s = kBKFast ? kBK + kPad : kBN + kPad;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int wm = (warp / kWarpsN) * kFragM * 16, wn = (warp % kWarpsN) * kFragN * 16;
  for (int64_t kb = k_begin; kb < k_end; kb += kBK) {
    if (kAKFast)
      stage<T, kBM, kBK>(as, a, lda, m_begin, m_end, kb, k_end, vec_a);
    else
      stage<T, kBK, kBM>(as, a, lda, kb, k_end, m_begin, m_end, vec_a);
    if (kBKFast)
      stage<T, kBN, kBK>(bs, b, ldb, n_begin, n_end, kb, k_end, vec_b);
    else
      stage<T, kBK, kBN>(bs, b, ldb, kb, k_end, n_begin, n_end, vec_b);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb[kFragN];
#pragma unroll
      for (int j = 0; j < kFragN; ++j) {
        const int n = wn + 16 * j;
        wmma::load_matrix_sync(fb[j], bs + (kBKFast ? n * ldb_s + kk : kk * ldb_s + n), ldb_s);
      }
#pragma unroll
      for (int i = 0; i < kFragM; ++i) {
        const int m = wm + 16 * i;
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa;
        wmma::load_matrix_sync(fa, as + (kAKFast ? m * lda_s + kk : kk * lda_s + m), lda_s);
#pragma unroll
        for (int j = 0; j < kFragN; ++j) wmma::mma_sync(acc[i][j], fa, fb[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
}

// Hands each fragment of the warp, as a 16 x 16 fp32 tile in `staging`, to out(row, col, value)
// with row, col relative to the block tile's origin.
template <class Out>
__device__ __forceinline__ void store_fragments(Acc (&acc)[kFragM][kFragN], float* staging,
                                                Out&& out) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wm = (warp / kWarpsN) * kFragM * 16, wn = (warp % kWarpsN) * kFragN * 16;
#pragma unroll
  for (int i = 0; i < kFragM; ++i)
#pragma unroll
    for (int j = 0; j < kFragN; ++j) {
      wmma::store_matrix_sync(staging, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int idx = lane; idx < 256; idx += 32)
        out(wm + 16 * i + idx / 16, wn + 16 * j + idx % 16, staging[idx]);
      __syncwarp();
    }
}

template <class T, bool kBKFast>
__global__ void __launch_bounds__(kThreads)
    grouped_mma_rows_kernel(T* c, const T* a, const T* w, const int32_t* offsets, int experts,
                            int64_t rows, int64_t n_total, int64_t k_total, int64_t expert_stride,
                            bool vec_a, bool vec_b) {
  if constexpr (HasMma<T>::value) {
    __shared__ alignas(128) T as[kStageElems];
    __shared__ alignas(128) T bs[kStageElems];
    __shared__ alignas(128) float staging[kThreads / 32][256];
    int64_t r0 = 0, r1 = 0;
    const int expert = block_row_tile<kBM>(offsets, experts, rows, blockIdx.x, &r0, &r1);
    if (expert < 0) return;  // uniform over the block
    const int64_t n0 = int64_t(blockIdx.y) * kBN;
    const T* b = w + expert * expert_stride;
    Acc acc[kFragM][kFragN];
#pragma unroll
    for (int i = 0; i < kFragM; ++i)
#pragma unroll
      for (int j = 0; j < kFragN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    // B(k, n) = b[n * k_total + k] (forward) or b[k * n_total + n] (dx)
    mma_tile<T, true, kBKFast>(acc, as, bs, a, k_total, r0, r1, vec_a, b,
                               kBKFast ? k_total : n_total, n0, n_total, vec_b, 0, k_total);
    store_fragments(acc, staging[threadIdx.x / 32], [&](int row, int col, float v) {
      const int64_t r = r0 + row, n = n0 + col;
      if (r < r1 && n < n_total) c[r * n_total + n] = store<T>(v);
    });
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    grouped_mma_dw_kernel(float* dw, const T* dy, const T* x, const int32_t* offsets, int64_t rows,
                          int64_t out, int64_t in, bool vec_a, bool vec_b) {
  if constexpr (HasMma<T>::value) {
    __shared__ alignas(128) T as[kStageElems];
    __shared__ alignas(128) T bs[kStageElems];
    __shared__ alignas(128) float staging[kThreads / 32][256];
    const int e = blockIdx.z;
    const int64_t r0 = clamp_offset(offsets[e], rows), r1 = clamp_offset(offsets[e + 1], rows);
    if (r1 <= r0) return;  // no rows: dw[e] += 0, left untouched (uniform over the block)
    const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * kBN;
    Acc acc[kFragM][kFragN];
#pragma unroll
    for (int i = 0; i < kFragM; ++i)
#pragma unroll
      for (int j = 0; j < kFragN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    // A(m = o, k = r) = dy[r * out + o]; B(k = r, n = i) = x[r * in + i]
    mma_tile<T, false, false>(acc, as, bs, dy, out, m0, out, vec_a, x, in, n0, in, vec_b, r0, r1);
    float* dw_e = dw + int64_t(e) * out * in;
    store_fragments(acc, staging[threadIdx.x / 32], [&](int row, int col, float v) {
      const int64_t o = m0 + row, i = n0 + col;
      if (o < out && i < in) dw_e[o * in + i] += v;
    });
  }
}

// round_grouped_dw_bf16: grid row e is expert e (a grid-stride loop over its elements).
__global__ void round_dw_bf16_kernel(__nv_bfloat16* dw, const float* sums, const int32_t* offsets,
                                     int64_t rows, int64_t per_expert, bool overwrite) {
  const int e = static_cast<int>(blockIdx.y);
  if (!overwrite && clamp_offset(offsets[e + 1], rows) <= clamp_offset(offsets[e], rows)) return;
  __nv_bfloat16* d = dw + int64_t(e) * per_expert;
  const float* s = sums + int64_t(e) * per_expert;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_expert; i += stride)
    d[i] = __float2bfloat16_rn(overwrite ? s[i] : __bfloat162float(d[i]) + s[i]);
}

template <class T>
void launch_rows(Ctx& ctx, void* c, const void* a, const void* w, const int32_t* offsets,
                 int experts, int64_t rows, int64_t n_total, int64_t k_total, int64_t expert_stride,
                 bool b_k_fast) {
  const dim3 grid(static_cast<unsigned>(blocks_for(rows, kBM) + experts), blocks_for(n_total, kBN));
  const bool vec_a = aligned16_rows(a, k_total);
  const bool vec_b = aligned16_rows(w, b_k_fast ? k_total : n_total, expert_stride);
  if (b_k_fast)
    grouped_mma_rows_kernel<T, true><<<grid, kThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(c), static_cast<const T*>(a), static_cast<const T*>(w), offsets, experts,
        rows, n_total, k_total, expert_stride, vec_a, vec_b);
  else
    grouped_mma_rows_kernel<T, false><<<grid, kThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(c), static_cast<const T*>(a), static_cast<const T*>(w), offsets, experts,
        rows, n_total, k_total, expert_stride, vec_a, vec_b);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T>
void launch_dw(Ctx& ctx, float* dw, const void* dy, const void* x, const int32_t* offsets,
               int experts, int64_t rows, int64_t out, int64_t in) {
  const dim3 grid(blocks_for(in, kBN), blocks_for(out, kBM), static_cast<unsigned>(experts));
  grouped_mma_dw_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(
      dw, static_cast<const T*>(dy), static_cast<const T*>(x), offsets, rows, out, in,
      aligned16_rows(dy, out), aligned16_rows(x, in));
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool grouped_mma_available(DType t) {
  // Decided once per process for the current device (the trainer uses one device per process).
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    half_ok = compiled_arch(grouped_mma_rows_kernel<__half, true>) >= 70 &&
              compiled_arch(grouped_mma_dw_kernel<__half>) >= 70;
    bf16_ok = compiled_arch(grouped_mma_rows_kernel<__nv_bfloat16, true>) >= 80 &&
              compiled_arch(grouped_mma_dw_kernel<__nv_bfloat16>) >= 80;
  });
  return t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
}

void grouped_mma_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                      const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                      int64_t k_total, int64_t expert_stride, bool b_k_fast) {
  if (grouped_sm90_rows(ctx, t, c, a, w, offsets, experts, rows, n_total, k_total, expert_stride,
                        b_k_fast) ||
      grouped_sm80_rows(ctx, t, c, a, w, offsets, experts, rows, n_total, k_total, expert_stride,
                        b_k_fast))
    return;
  if (t == DType::f16)
    launch_rows<__half>(ctx, c, a, w, offsets, experts, rows, n_total, k_total, expert_stride,
                        b_k_fast);
  else if (t == DType::bf16)
    launch_rows<__nv_bfloat16>(ctx, c, a, w, offsets, experts, rows, n_total, k_total,
                               expert_stride, b_k_fast);
  else
    throw InternalError(std::string("grouped_mma_rows: unsupported dtype ") + dtype_name(t));
}

void round_grouped_dw_bf16(Ctx& ctx, void* dw, const float* sums, const int32_t* offsets,
                           int experts, int64_t rows, int64_t per_expert, bool overwrite) {
  if (experts == 0 || per_expert == 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_for(per_expert, 256), 64)),
                  static_cast<unsigned>(experts));
  round_dw_bf16_kernel<<<grid, 256, 0, stream_of(ctx)>>>(static_cast<__nv_bfloat16*>(dw), sums,
                                                         offsets, rows, per_expert, overwrite);
  MOE_CUDA_LAUNCH_CHECK();
}

float* bf16_dw_sums(Ctx& ctx, size_t floats) {
  static std::mutex mutex;
  // by device index; never destroyed (a cudaFree after the runtime's own teardown at exit)
  static auto* buffers = new std::map<int, Buffer>();
  const std::lock_guard<std::mutex> lock(mutex);
  Buffer& b = (*buffers)[ctx.device.index];
  const size_t bytes = std::max<size_t>(16, floats * sizeof(float));
  if (b.bytes() < bytes) {
    b = Buffer();  // (freed first: the old and new sums need not fit at once)
    b = Buffer(ctx.device, bytes);
  }
  return static_cast<float*>(b.data());
}

void grouped_mma_dw(Ctx& ctx, DType t, void* dw_out, DType dw_t, const void* dy, const void* x,
                    const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in,
                    bool overwrite) {
  if (grouped_sm90_dw(ctx, t, dw_out, dw_t, dy, x, offsets, experts, rows, out, in, overwrite))
    return;
  if (dw_t == DType::bf16) {  // the fp32 sums apart, then rounded (the fast path is sm_90's)
    float* s = bf16_dw_sums(ctx, size_t(experts) * out * in);
    grouped_mma_dw(ctx, t, s, DType::f32, dy, x, offsets, experts, rows, out, in, true);
    round_grouped_dw_bf16(ctx, dw_out, s, offsets, experts, rows, out * in, overwrite);
    return;
  }
  float* dw = static_cast<float*>(dw_out);
  if (overwrite)  // the other kernels add: onto zeros
    MOE_CUDA_CHECK(
        cudaMemsetAsync(dw, 0, size_t(experts) * out * in * sizeof(float), stream_of(ctx)));
  if (grouped_sm80_dw(ctx, t, dw, dy, x, offsets, experts, rows, out, in)) return;
  if (t == DType::f16)
    launch_dw<__half>(ctx, dw, dy, x, offsets, experts, rows, out, in);
  else if (t == DType::bf16)
    launch_dw<__nv_bfloat16>(ctx, dw, dy, x, offsets, experts, rows, out, in);
  else
    throw InternalError(std::string("grouped_mma_dw: unsupported dtype ") + dtype_name(t));
}

}  // namespace moe::cuda_detail
