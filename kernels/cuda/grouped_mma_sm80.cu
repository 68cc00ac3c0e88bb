// Pipelined tensor-core grouped GEMMs for sm_80+ (f16 / bf16 in, fp32 accumulate): the fast path
// of grouped_mma_rows / grouped_mma_dw (grouped_mma.cuh). The WMMA kernels of grouped_mma.cu stay
// for sm_70-sm_75 builds and for operands that are not 16-byte aligned.
//
// Why it is faster than the WMMA version: operand tiles stream into shared memory with cp.async
// in a kStages-deep ring, so the loads of k-slices t+1..t+3 are in flight while the tensor cores
// work on slice t (the WMMA kernel loads, waits, then computes); fragments come from shared memory
// with ldmatrix (.trans where the operand is not k-contiguous) into mma.sync m16n8k16, and each
// warp owns a 64 x 64 output tile (twice the WMMA kernel's), which halves shared-memory reads per
// flop.
//
// A block: 2 x 2 warps, 128 x 128 outputs, k-slices of 32 in 4 stages (64 in 3 with
// MOE_GROUPED_TILE_K=64). Shared tiles keep the operand's global layout, padded by 8 elements per
// row so the 8 row addresses of one ldmatrix hit 8 different 16-byte bank groups (80, 144 or 272 B
// row strides). The operands:
//   y  = x w_e^T        A = x [R, in] (k fast)         B(k, n) = w_e[n, k] (k fast)   rows kernel
//   dx = dy w_e         A = dy [R, out] (k fast)       B(k, n) = w_e[k, n] (n fast)   rows kernel
//   dw_e += dy_e^T x_e  A(m, k) = dy[k, m] (m fast)    B(k, n) = x[k, n] (n fast)     dw kernel
// Rows kernel: blockIdx.x walks the output columns fastest, so the blocks resident at one time
// share their A row tiles (and the expert's weights) in L2; blockIdx.y is the row tile, cut per
// expert on the device (grouped_tiles.cuh). dw kernel: grid (in tiles, out tiles, E), a block loops
// over its expert's rows; an expert without rows returns before touching dw[e] (no atomics:
// deterministic). Requirements (checked by the host, else the WMMA kernels run): 16-byte aligned
// bases and every leading dimension and inner extent a multiple of 8 elements, so each 16-byte
// chunk is wholly in or out of bounds and is copied or zero-filled whole.
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/grouped_mma.cuh"
#include "cuda/grouped_tiles.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"

namespace moe::cuda_detail {
namespace {

// Block shape: 2 x 2 warps of 64 x 64 outputs each (a 128 x 128 block tile), k-slices of kBK in a
// kStages-deep ring. Two configurations: 32-wide slices in 4 stages (the default) and 64-wide in 3
// (MOE_GROUPED_TILE_K=64: half the barriers per flop, 110 KiB of shared memory, two blocks per
// SM). A 256 x 128 block tile (4 x 2 warps) was measured slower on the H200 at moe-small's shapes
// (222 against 288 TFLOP/s: one block per SM by registers and shared memory) and was dropped.
constexpr int kBN = 128;
constexpr int kWarpsN = 2;
constexpr int kWarpM = 64, kWarpN = 64;
constexpr int kFragsM = kWarpM / 16;  // m16 fragments per warp
constexpr int kFragsN = kWarpN / 8;   // n8 fragments per warp
constexpr int kPad = 8;
template <int kWarpsM_, int kBK_, int kStages_>
struct Cfg {
  static constexpr int kWarpsM = kWarpsM_, kBK = kBK_, kStages = kStages_;
  static constexpr int kBM = kWarpM * kWarpsM;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kKFastLd = kBK + kPad;  // staged row stride of a k-contiguous tile
  // A staged tile of `mn` rows or columns: mn x (kBK + pad) when k is the contiguous dimension,
  // else kBK x (mn + pad).
  __host__ __device__ static constexpr int tile_elems(bool k_fast, int mn) {
    return k_fast ? mn * kKFastLd : kBK * (mn + kPad);
  }
};
using Slices32 = Cfg<2, 32, 4>;
using Slices64 = Cfg<2, 64, 3>;

using Acc = float[kFragsM][kFragsN][4];

// Starts the copy of one operand's k-slice [kb, kb + kBK) x [mn_begin, mn_begin + kMN) into `dst`.
// The operand's element (mn, k) is src[mn * ld + k] (kKFast) or src[k * ld + mn]; elements at
// mn >= mn_end or k >= k_end read as zero. The block's C::kThreads threads share the copy.
template <class C, class T, bool kKFast, int kMN>
__device__ __forceinline__ void load_slice(T* dst, const T* src, int64_t ld, int64_t mn_begin,
                                           int64_t mn_end, int64_t kb, int64_t k_end) {
  constexpr int kInner = kKFast ? C::kBK : kMN;  // contiguous elements per staged row
  constexpr int kChunks = kInner / 8;            // 16-byte chunks per staged row
  constexpr int kPerThread = kMN * C::kBK / 8 / C::kThreads;
  static_assert(kPerThread * C::kThreads * 8 == kMN * C::kBK, "the slice must split evenly");
  constexpr int kLd = kKFast ? C::kKFastLd : kMN + kPad;
#pragma unroll
  for (int it = 0; it < kPerThread; ++it) {
    const int c = static_cast<int>(threadIdx.x) + it * C::kThreads;
    const int o = c / kChunks, i = (c % kChunks) * 8;
    const int64_t g_outer = (kKFast ? mn_begin : kb) + o;
    const int64_t g_inner = (kKFast ? kb : mn_begin) + i;
    const bool valid =
        kKFast ? (g_outer < mn_end && g_inner < k_end) : (g_outer < k_end && g_inner < mn_end);
    cp_async16(dst + o * kLd + i, valid ? src + g_outer * ld + g_inner : src, valid);
  }
}

// acc += A B over one staged k-slice. Fragment addresses follow the mma.sync m16n8k16 layouts:
// A (16 x 16, row major) is four 8x8 matrices (rows 0-7 / 8-15) x (k 0-7 / 8-15) in the order
// (0,0), (8,0), (0,8), (8,8); B (16 x 8 per n8 fragment) is two, k 0-7 and k 8-15, and one
// ldmatrix.x4 fetches two n8 fragments. Stored k-fast tiles are read as is, the others transposed.
template <class C, class T, bool kAKFast, bool kBKFast>
__device__ __forceinline__ void mma_slice(Acc& acc, const T* as, const T* bs, int wm, int wn) {
  constexpr int kALd = C::kBM + kPad, kBLd = kBN + kPad;  // strides of the mn-contiguous tiles
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int q = lane >> 3, r = lane & 7;  // which 8x8 matrix this lane addresses, and its row
#pragma unroll
  for (int kk = 0; kk < C::kBK; kk += 16) {
    uint32_t af[kFragsM][4];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
      const int m = wm + 16 * i;
      if constexpr (kAKFast)  // rows m + lane%16, k + 8 * (lane/16)
        ldmatrix_x4<false>(af[i], as + (m + (lane & 15)) * C::kKFastLd + kk + (lane >> 4) * 8);
      else  // stored [k][m]: rows k + r + 8 * (q/2), columns m + 8 * (q%2)
        ldmatrix_x4<true>(af[i], as + (kk + r + (q >> 1) * 8) * kALd + m + (q & 1) * 8);
    }
    uint32_t bf[kFragsN][2];
#pragma unroll
    for (int p = 0; p < kFragsN / 2; ++p) {
      const int n = wn + 16 * p;
      uint32_t t[4];
      if constexpr (kBKFast)  // stored [n][k]: rows n + r + 8 * (q/2), k + 8 * (q%2)
        ldmatrix_x4<false>(t, bs + (n + r + (q >> 1) * 8) * C::kKFastLd + kk + (q & 1) * 8);
      else  // stored [k][n]: rows k + r + 8 * (q%2), columns n + 8 * (q/2)
        ldmatrix_x4<true>(t, bs + (kk + r + (q & 1) * 8) * kBLd + n + (q >> 1) * 8);
      bf[2 * p][0] = t[0];
      bf[2 * p][1] = t[1];
      bf[2 * p + 1][0] = t[2];
      bf[2 * p + 1][1] = t[3];
    }
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) mma_16816<T>(acc[i][j], af[i], bf[j][0], bf[j][1]);
  }
}

// acc = sum over k in [k_begin, k_end) of A(m, k) B(k, n) for the block's kBM x 128 tile, with
// the k-slices streamed through a kStages-deep cp.async ring in `smem`. All threads call it.
template <class C, class T, bool kAKFast, bool kBKFast>
__device__ __forceinline__ void pipelined_mma(Acc& acc, unsigned char* smem, const T* a,
                                              int64_t lda, int64_t m_begin, int64_t m_end,
                                              const T* b, int64_t ldb, int64_t n_begin,
                                              int64_t n_end, int64_t k_begin, int64_t k_end) {
  constexpr int kBK = C::kBK, kStages = C::kStages;
  constexpr int kA = C::tile_elems(kAKFast, C::kBM), kStage = kA + C::tile_elems(kBKFast, kBN);
  T* ring = reinterpret_cast<T*>(smem);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int wm = (warp / kWarpsN) * kWarpM, wn = (warp % kWarpsN) * kWarpN;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;
  const int slices = static_cast<int>((k_end - k_begin + kBK - 1) / kBK);
  auto load = [&](int t) {
    T* stage = ring + (t % kStages) * kStage;
    const int64_t kb = k_begin + int64_t(t) * kBK;
    load_slice<C, T, kAKFast, C::kBM>(stage, a, lda, m_begin, m_end, kb, k_end);
    load_slice<C, T, kBKFast, kBN>(stage + kA, b, ldb, n_begin, n_end, kb, k_end);
  };
  // One commit per slice (empty past the end), so "slice t has landed" is always "at most
  // kStages - 2 younger groups pending".
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < slices) load(t);
    cp_async_commit();
  }
  for (int t = 0; t < slices; ++t) {
    cp_async_wait<kStages - 2>();
    // Slice t is visible to every thread, and every warp is done with slice t - 1, whose stage
    // the load below overwrites.
    __syncthreads();
    if (t + kStages - 1 < slices) load(t + kStages - 1);
    cp_async_commit();
    const T* stage = ring + (t % kStages) * kStage;
    mma_slice<C, T, kAKFast, kBKFast>(acc, stage, stage + kA, wm, wn);
  }
  cp_async_wait<0>();
}

// Hands every accumulator pair to out(row, col, v0, v1) (col even; v1 belongs to col + 1), with
// row and col relative to the block tile.
template <class Out>
__device__ __forceinline__ void for_each_pair(const Acc& acc, Out&& out) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int wm = (warp / kWarpsN) * kWarpM, wn = (warp % kWarpsN) * kWarpN;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      const int row = wm + 16 * i + (lane >> 2), col = wn + 8 * j + 2 * (lane & 3);
      out(row, col, acc[i][j][0], acc[i][j][1]);
      out(row + 8, col, acc[i][j][2], acc[i][j][3]);
    }
}

template <class C, class T, bool kBKFast>
__global__ void __launch_bounds__(C::kThreads)
    grouped_sm80_rows_kernel(T* c, const T* a, const T* w, const int32_t* offsets, int experts,
                             int64_t rows, int64_t n_total, int64_t k_total,
                             int64_t expert_stride) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem[];
    int64_t r0 = 0, r1 = 0;
    const int expert = block_row_tile<C::kBM>(offsets, experts, rows, blockIdx.y, &r0, &r1);
    if (expert < 0) return;  // uniform over the block
    const int64_t n0 = int64_t(blockIdx.x) * kBN;
    Acc acc;
    // B(k, n) = w_e[n * k_total + k] (forward) or w_e[k * n_total + n] (dx)
    pipelined_mma<C, T, true, kBKFast>(acc, smem, a, k_total, r0, r1, w + expert * expert_stride,
                                       kBKFast ? k_total : n_total, n0, n_total, 0, k_total);
    for_each_pair(acc, [&](int row, int col, float v0, float v1) {
      const int64_t r = r0 + row, n = n0 + col;
      if (r < r1 && n < n_total) store_pair(c + r * n_total + n, v0, v1);
    });
  }
}

template <class C, class T>
__global__ void __launch_bounds__(C::kThreads)
    grouped_sm80_dw_kernel(float* dw, const T* dy, const T* x, const int32_t* offsets, int64_t rows,
                           int64_t out, int64_t in) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int e = blockIdx.z;
    const int64_t r0 = clamp_offset(offsets[e], rows), r1 = clamp_offset(offsets[e + 1], rows);
    if (r1 <= r0) return;  // no rows: dw[e] += 0, left untouched (uniform over the block)
    const int64_t m0 = int64_t(blockIdx.y) * C::kBM, n0 = int64_t(blockIdx.x) * kBN;
    Acc acc;
    // A(m = o, k = r) = dy[r * out + o]; B(k = r, n = i) = x[r * in + i]
    pipelined_mma<C, T, false, false>(acc, smem, dy, out, m0, out, x, in, n0, in, r0, r1);
    float* dw_e = dw + int64_t(e) * out * in;
    for_each_pair(acc, [&](int row, int col, float v0, float v1) {
      const int64_t o = m0 + row, i = n0 + col;
      if (o < out && i < in) {  // in % 8 == 0: i + 1 < in too
        float* p = dw_e + o * in + i;
        p[0] += v0;
        p[1] += v1;
      }
    });
  }
}

template <class C>
constexpr size_t smem_bytes(bool a_k_fast, bool b_k_fast, size_t elem) {
  return C::kStages * (C::tile_elems(a_k_fast, C::kBM) + C::tile_elems(b_k_fast, kBN)) * elem;
}

// 64-wide k-slices with MOE_GROUPED_TILE_K=64 (a tuning knob for `moe-train bench`; read at every
// launch so the tests cover both configurations in one process), else 32-wide.
bool deep_slices() {
  const char* v = std::getenv("MOE_GROUPED_TILE_K");
  return v != nullptr && std::string(v) == "64";
}

template <class C, class T, bool kBKFast>
void launch_rows(Ctx& ctx, void* c, const void* a, const void* w, const int32_t* offsets,
                 int experts, int64_t rows, int64_t n_total, int64_t k_total,
                 int64_t expert_stride) {
  auto kernel = grouped_sm80_rows_kernel<C, T, kBKFast>;
  constexpr size_t bytes = smem_bytes<C>(true, kBKFast, sizeof(T));
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, bytes); });
  const dim3 grid(blocks_for(n_total, kBN),
                  static_cast<unsigned>(blocks_for(rows, C::kBM) + experts));
  kernel<<<grid, C::kThreads, bytes, stream_of(ctx)>>>(static_cast<T*>(c), static_cast<const T*>(a),
                                                       static_cast<const T*>(w), offsets, experts,
                                                       rows, n_total, k_total, expert_stride);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class C, class T>
void launch_dw(Ctx& ctx, float* dw, const void* dy, const void* x, const int32_t* offsets,
               int experts, int64_t rows, int64_t out, int64_t in) {
  auto kernel = grouped_sm80_dw_kernel<C, T>;
  constexpr size_t bytes = smem_bytes<C>(false, false, sizeof(T));
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, bytes); });
  const dim3 grid(blocks_for(in, kBN), blocks_for(out, C::kBM), static_cast<unsigned>(experts));
  kernel<<<grid, C::kThreads, bytes, stream_of(ctx)>>>(
      dw, static_cast<const T*>(dy), static_cast<const T*>(x), offsets, rows, out, in);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class C, class T>
bool compiled_for_sm80() {
  return compiled_arch(grouped_sm80_rows_kernel<C, T, true>) >= 80 &&
         compiled_arch(grouped_sm80_rows_kernel<C, T, false>) >= 80 &&
         compiled_arch(grouped_sm80_dw_kernel<C, T>) >= 80;
}

template <class T>
bool compiled_for_sm80() {
  return compiled_for_sm80<Slices32, T>() && compiled_for_sm80<Slices64, T>();
}

// Calls fn(C{}, T{}) with the configuration and storage type of this launch.
template <class Fn>
void with_config(DType t, Fn&& fn) {
  const bool deep = deep_slices();
  if (t == DType::f16)
    deep ? fn(Slices64{}, __half{}) : fn(Slices32{}, __half{});
  else
    deep ? fn(Slices64{}, __nv_bfloat16{}) : fn(Slices32{}, __nv_bfloat16{});
}

}  // namespace

bool grouped_sm80_available(DType t) {
  // Decided once per process for the current device (the trainer uses one device per process).
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    half_ok = compiled_for_sm80<__half>();
    bf16_ok = compiled_for_sm80<__nv_bfloat16>();
  });
  return t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
}

bool grouped_sm80_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                       const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                       int64_t k_total, int64_t expert_stride, bool b_k_fast) {
  if (!grouped_sm80_available(t) ||
      !rows_operands_fit(c, a, w, n_total, k_total, expert_stride, b_k_fast, rows, experts, 128))
    return false;
  with_config(t, [&](auto cfg, auto zero) {
    using C = decltype(cfg);
    using T = decltype(zero);
    if (b_k_fast)
      launch_rows<C, T, true>(ctx, c, a, w, offsets, experts, rows, n_total, k_total,
                              expert_stride);
    else
      launch_rows<C, T, false>(ctx, c, a, w, offsets, experts, rows, n_total, k_total,
                               expert_stride);
  });
  return true;
}

bool grouped_sm80_dw(Ctx& ctx, DType t, float* dw, const void* dy, const void* x,
                     const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in) {
  if (!grouped_sm80_available(t) || !aligned16_rows(dy, out) || !aligned16_rows(x, in))
    return false;
  with_config(t, [&](auto cfg, auto zero) {
    launch_dw<decltype(cfg), decltype(zero)>(ctx, dw, dy, x, offsets, experts, rows, out, in);
  });
  return true;
}

}  // namespace moe::cuda_detail
