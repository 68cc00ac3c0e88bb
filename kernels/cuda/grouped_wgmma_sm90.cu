// Hopper (sm_90a) grouped GEMMs with wgmma: the first path of grouped_mma_rows / grouped_mma_dw
// (grouped_mma.cuh) on an sm_90 device, ahead of the mma.sync kernels of grouped_mma_sm80.cu,
// which stay for sm_80 / sm_89 and for every case this file declines.
//
// Why it is faster than mma.sync: a warpgroup (4 warps) issues one asynchronous m64nNk16 MMA that
// reads both operands straight from shared memory (no ldmatrix, no fragment registers), so the
// tensor cores run back to back while the same threads stream the next k-slices in with cp.async.
//
// A block: 2 warpgroups (256 threads), a 128 x kBN output tile (warpgroup g owns rows 64g..64g+63,
// all kBN columns: m64nkBNk16), k-slices of 64 in a kStages-deep ring. Operand tiles are stored in
// the 128-byte swizzle that the wgmma descriptors read (wgmma_sm90.cuh), in the operand's global
// major-ness, so the three products share one loop:
//   y  = x w_e^T        A = x [R, in] K-major      B(k, n) = w_e[n, k] K-major    rows kernel
//   dx = dy w_e         A = dy [R, out] K-major    B(k, n) = w_e[k, n] N-major    rows kernel
//   dw_e += dy_e^T x_e  A(m, k) = dy[k, m] M-major B(k, n) = x[k, n] N-major      dw kernel
// A K-major tile is kMN rows of 64 k (128 bytes); an MN-major tile is kMN / 64 blocks of 64 k-rows
// of 64 m/n-elements, 8 KiB apart. Copies are cp.async of 16-byte chunks, zero-filled past the
// bounds (the same requirements as the sm_80 kernels: 16-byte aligned bases, leading dimensions
// and inner extents multiples of 8 elements).
//
// The loop (each thread): wait for its own copies of slice t, fence them to the async proxy,
// barrier (slice t visible to both warpgroups; both are done with slice t - 2), issue slice t's
// four wgmma, start the copies of slice t + kStages - 2 into the stage slice t - 2 used, and wait
// for slice t - 1's wgmma: one wgmma group in flight under the copies.
//
// Rows kernel: blockIdx.x walks the output columns fastest (blocks resident together share their A
// row tiles and the expert's weights in L2); blockIdx.y is the 128-row tile, cut per expert on the
// device (grouped_tiles.cuh). dw kernel: grid (in tiles, out tiles, E), a block loops over its
// expert's rows as the k dimension; an expert without rows returns before touching dw[e]. No
// atomics: deterministic.
//
// Which code runs: the kernels' bodies exist only in sm_90a code (kHasWgmma). The top
// CMakeLists.txt builds MOE_CUDA_ARCHS entry 90 as sm_90a machine code (no compute_90 PTX) and
// then defines MOE_WITH_SM90A; with it, a kernel whose code for this device is version 9.0 on an
// sm_90 device is the sm_90a code, and the host launches these kernels. Otherwise they decline.
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/grouped_mma.cuh"
#include "cuda/grouped_tiles.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/wgmma_sm90.cuh"

namespace moe::cuda_detail {

// The swizzled tiles: 128-byte rows (64 k- or m/n-elements); an MN-major tile's 64-wide m/n blocks
// are 64 k-rows, 8 KiB apart.
struct Sw128 {
  static constexpr int kRowBytes = 128, kBlockBytes = 64 * kRowBytes;
};

// kBN: output columns per block (128 or 256); kStages: ring depth (>= 3); block tiles of 128 rows
// and 64-wide k-slices.
template <int kBN_, int kStages_>
struct Sm90Cfg {
  static constexpr int kBN = kBN_, kStages = kStages_;
  static constexpr int kABytes = 128 * 64 * 2, kBBytes = kBN * 64 * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kAcc = kBN / 2;  // fp32 accumulators per thread
  // +1024: the ring starts at the first 1024-byte boundary of the dynamic shared memory.
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 1024;
};

namespace {

constexpr int kBM = 128;  // rows of the block tile: two warpgroups of 64
constexpr int kBK = 64;   // k per slice: one 128-byte swizzle row of 16-bit elements
constexpr int kThreads = 256;

using Wide = Sm90Cfg<256, 4>;    // 192 KiB: one block per SM
using Narrow = Sm90Cfg<128, 4>;  // 128 KiB: one block per SM, half the accumulators
static_assert(Wide::kABytes == kBM * kBK * 2 && Sw128::kBlockBytes == kBK * Sw128::kRowBytes,
              "tiles of 128 rows and 64-wide k-slices of 16-bit elements");

template <class T, int kN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_step(float (&d)[kN / 2], uint64_t da, uint64_t db) {
  if constexpr (kN == 256)
    wgmma_m64n256<T, kTransA, kTransB>(d, da, db);
  else
    wgmma_m64n128<T, kTransA, kTransB>(d, da, db);
}

// Copies one operand's k-slices [kb, kb + kBK) x [mn_begin, mn_begin + kMN) into swizzled tiles.
// The operand's element (mn, k) is src[mn * ld + k] (kKFast) or src[k * ld + mn]; elements at
// mn >= mn_end or k >= k_end read as zero. Each thread's chunks sit a fixed stride apart in global
// and shared memory and keep their swizzle phase from slice to slice, so the addresses and the m/n
// bounds are worked out once per tile and a slice costs a pointer step and a k compare per chunk
// (computing them afresh took ~250 of the loop's ~360 instructions per slice).
template <class T, bool kKFast, int kMN>
struct SliceLoader {
  // A thread's chunks: global rows (mn when kKFast, else k) row + it * kRowsPerIt, one chunk each.
  static constexpr int kPerRow = kKFast ? 8 : kMN / 8;  // 16-byte chunks per global row
  static constexpr int kRowsPerIt = kThreads / kPerRow;
  static constexpr int kIters = kMN * kBK / 8 / kThreads;
  static_assert(kIters * kThreads * 8 == kMN * kBK && kRowsPerIt % 8 == 0,
                "whole rows per step, the swizzle phase (row % 8) kept");
  const T* src;     // the tensor's base: the address of zero-filled chunks
  const T* first;   // this thread's first chunk of slice 0
  int64_t it_step;  // elements between this thread's successive chunks of one slice
  int64_t slice_step;
  uint32_t smem0;  // byte offset of the first chunk in a stage's tile
  uint32_t mn_ok;  // bit it: chunk it lies inside the m/n bounds
  int64_t k_left;  // chunk it of slice t is inside the k bounds iff t * kBK (+ it * kRowsPerIt) <
                   // k_left

  __device__ __forceinline__ SliceLoader(const T* src_, int64_t ld, int64_t mn_begin,
                                         int64_t mn_end, int64_t k_begin, int64_t k_end) {
    const int tid = static_cast<int>(threadIdx.x);
    const int row = tid / kPerRow, chunk = tid % kPerRow;
    src = src_;
    mn_ok = 0;
    if constexpr (kKFast) {  // rows = mn: row + it * kRowsPerIt, 8 k-chunks per row
      first = src_ + (mn_begin + row) * ld + k_begin + chunk * 8;
      it_step = kRowsPerIt * ld;
      slice_step = kBK;
      smem0 = row * Sw128::kRowBytes + ((chunk ^ (row & 7)) << 4);
#pragma unroll
      for (int it = 0; it < kIters; ++it)
        if (mn_begin + row + it * kRowsPerIt < mn_end) mn_ok |= 1u << it;
      k_left = k_end - (k_begin + chunk * 8);
    } else {  // rows = k: row + it * kRowsPerIt, kMN / 8 m/n-chunks per row in 64-wide blocks
      first = src_ + (k_begin + row) * ld + mn_begin + chunk * 8;
      it_step = kRowsPerIt * ld;
      slice_step = kBK * ld;
      smem0 = (chunk >> 3) * Sw128::kBlockBytes + row * Sw128::kRowBytes +
              (((chunk & 7) ^ (row & 7)) << 4);
      if (mn_begin + chunk * 8 < mn_end) mn_ok = ~0u;
      k_left = k_end - (k_begin + row);
    }
  }

  // Starts the copies of slice t into the tile at shared address `dst`.
  __device__ __forceinline__ void load(uint32_t dst, int t) const {
    const T* p = first + t * slice_step;
    const int64_t k0 = int64_t(t) * kBK;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool valid =
          ((mn_ok >> it) & 1u) && (kKFast ? k0 < k_left : k0 + it * kRowsPerIt < k_left);
      const uint32_t off = smem0 + it * kRowsPerIt * Sw128::kRowBytes;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + off),
                   "l"(valid ? p + it * it_step : src), "r"(valid ? 16 : 0));
    }
  }
};

// Descriptor of the k16 step `s` (0..3) of a staged slice for a 64-row (A) or kN-column (B) piece
// starting at m/n-block offset `mn0` (a multiple of 64) of the tile at `base`.
template <bool kKFast>
__device__ __forceinline__ uint64_t step_desc(uint32_t base, int mn0, int s) {
  if constexpr (kKFast)  // rows of 128 bytes: mn0 rows down, 16 k-elements = 32 bytes right
    return smem_desc_sw128(base + mn0 * Sw128::kRowBytes + s * 32, 16, 1024);
  else  // 64-wide blocks 8 KiB apart: block mn0 / 64, 16 k-rows = two 1024-byte k groups down
    return smem_desc_sw128(base + (mn0 / 64) * Sw128::kBlockBytes + s * 2048, Sw128::kBlockBytes,
                           1024);
}

// acc = sum over k in [k_begin, k_end) of A(m, k) B(k, n) for the block's 128 x kBN tile, the
// k-slices streamed through the ring at `ring` (shared address, 1024-byte aligned). A(m, k) =
// a[m * lda + k] (kAKFast) or a[k * lda + m], m in [m_begin, m_end); B(k, n) = b[n * ldb + k]
// (kBKFast) or b[k * ldb + n], n in [n_begin, n_end). All threads call it.
template <class C, class T, bool kAKFast, bool kBKFast>
__device__ __forceinline__ void wgmma_mainloop(float (&acc)[C::kAcc], uint32_t ring, const T* a,
                                               int64_t lda, int64_t m_begin, int64_t m_end,
                                               const T* b, int64_t ldb, int64_t n_begin,
                                               int64_t n_end, int64_t k_begin, int64_t k_end) {
  constexpr int kStages = C::kStages, kAhead = kStages - 2;  // slices in flight ahead of the math
  const int wg = static_cast<int>(threadIdx.x) / 128;
#pragma unroll
  for (int i = 0; i < C::kAcc; ++i) acc[i] = 0.0f;
  const int slices = static_cast<int>((k_end - k_begin + kBK - 1) / kBK);
  const SliceLoader<T, kAKFast, kBM> load_a(a, lda, m_begin, m_end, k_begin, k_end);
  const SliceLoader<T, kBKFast, C::kBN> load_b(b, ldb, n_begin, n_end, k_begin, k_end);
  auto load = [&](int t) {
    const uint32_t stage = ring + (t % kStages) * C::kStageBytes;
    load_a.load(stage, t);
    load_b.load(stage + C::kABytes, t);
  };
  // One cp.async commit per slice (empty past the end): "slice t has landed" is always "at most
  // kAhead - 1 younger groups pending".
#pragma unroll
  for (int t = 0; t < kAhead; ++t) {
    if (t < slices) load(t);
    cp_async_commit();
  }
  fence_accumulators(acc);
  for (int t = 0; t < slices; ++t) {
    cp_async_wait<kAhead - 1>();
    fence_proxy_async_smem();
    // Slice t is visible to both warpgroups, and both have retired slice t - 2's wgmma (each
    // waited for it at the end of iteration t - 1), whose stage the copies below overwrite.
    __syncthreads();
    const uint32_t stage = ring + (t % kStages) * C::kStageBytes;
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s)
      wgmma_step<T, C::kBN, kAKFast ? 0 : 1, kBKFast ? 0 : 1>(
          acc, step_desc<kAKFast>(stage, wg * 64, s), step_desc<kBKFast>(stage + C::kABytes, 0, s));
    wgmma_commit();
    if (t + kAhead < slices) load(t + kAhead);
    cp_async_commit();
    wgmma_wait<1>();
    fence_accumulators(acc);
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
  cp_async_wait<0>();
}

// Hands every accumulator pair to out(row, col, v0, v1) (col even; v1 belongs to col + 1), with
// row and col relative to the block tile.
template <class C, class Out>
__device__ __forceinline__ void for_each_pair(const float (&acc)[C::kAcc], Out&& out) {
  const int t = static_cast<int>(threadIdx.x);
  const int row = (t / 128) * 64 + ((t % 128) / 32) * 16 + (t % 32) / 4;
  const int col = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < C::kBN / 8; ++j) {
    out(row, 8 * j + col, acc[4 * j], acc[4 * j + 1]);
    out(row + 8, 8 * j + col, acc[4 * j + 2], acc[4 * j + 3]);
  }
}

template <int kAlign = 1024>
__device__ __forceinline__ uint32_t ring_base(unsigned char* smem) {
  return (shared_addr(smem) + (kAlign - 1)) & ~uint32_t(kAlign - 1);
}

template <class C, class T, bool kBKFast>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_sm90_rows_kernel(T* c, const T* a, const T* w, const int32_t* offsets, int experts,
                             int64_t rows, int64_t n_total, int64_t k_total,
                             int64_t expert_stride) {
  if constexpr (kHasWgmma) {
    extern __shared__ __align__(1024) unsigned char smem[];
    int64_t r0 = 0, r1 = 0;
    const int expert = block_row_tile<kBM>(offsets, experts, rows, blockIdx.y, &r0, &r1);
    if (expert < 0) return;  // uniform over the block
    const int64_t n0 = int64_t(blockIdx.x) * C::kBN;
    float acc[C::kAcc];
    // B(k, n) = w_e[n * k_total + k] (forward) or w_e[k * n_total + n] (dx)
    wgmma_mainloop<C, T, true, kBKFast>(acc, ring_base(smem), a, k_total, r0, r1,
                                        w + expert * expert_stride, kBKFast ? k_total : n_total, n0,
                                        n_total, 0, k_total);
    for_each_pair<C>(acc, [&](int row, int col, float v0, float v1) {
      const int64_t r = r0 + row, n = n0 + col;
      if (r < r1 && n < n_total) store_pair(c + r * n_total + n, v0, v1);
    });
  }
}

template <class C, class T>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_sm90_dw_kernel(float* dw, const T* dy, const T* x, const int32_t* offsets, int64_t rows,
                           int64_t out, int64_t in) {
  if constexpr (kHasWgmma) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int e = blockIdx.z;
    const int64_t r0 = clamp_offset(offsets[e], rows), r1 = clamp_offset(offsets[e + 1], rows);
    if (r1 <= r0) return;  // no rows: dw[e] += 0, left untouched (uniform over the block)
    const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * C::kBN;
    float acc[C::kAcc];
    // A(m = o, k = r) = dy[r * out + o]; B(k = r, n = i) = x[r * in + i]
    wgmma_mainloop<C, T, false, false>(acc, ring_base(smem), dy, out, m0, out, x, in, n0, in, r0,
                                       r1);
    float* dw_e = dw + int64_t(e) * out * in;
    for_each_pair<C>(acc, [&](int row, int col, float v0, float v1) {
      const int64_t o = m0 + row, i = n0 + col;
      if (o < out && i < in) {  // in % 8 == 0: i + 1 < in too; 8-byte aligned
        float2* p = reinterpret_cast<float2*>(dw_e + o * in + i);
        float2 v = *p;
        v.x += v0;
        v.y += v1;
        *p = v;
      }
    });
  }
}

template <class C, class T, bool kBKFast>
void launch_rows(Ctx& ctx, void* c, const void* a, const void* w, const int32_t* offsets,
                 int experts, int64_t rows, int64_t n_total, int64_t k_total,
                 int64_t expert_stride) {
  auto kernel = grouped_sm90_rows_kernel<C, T, kBKFast>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, C::kSmemBytes); });
  const dim3 grid(blocks_for(n_total, C::kBN),
                  static_cast<unsigned>(blocks_for(rows, kBM) + experts));
  kernel<<<grid, kThreads, C::kSmemBytes, stream_of(ctx)>>>(
      static_cast<T*>(c), static_cast<const T*>(a), static_cast<const T*>(w), offsets, experts,
      rows, n_total, k_total, expert_stride);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class C, class T>
void launch_dw(Ctx& ctx, float* dw, const void* dy, const void* x, const int32_t* offsets,
               int experts, int64_t rows, int64_t out, int64_t in) {
  auto kernel = grouped_sm90_dw_kernel<C, T>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, C::kSmemBytes); });
  const dim3 grid(blocks_for(in, C::kBN), blocks_for(out, kBM), static_cast<unsigned>(experts));
  kernel<<<grid, kThreads, C::kSmemBytes, stream_of(ctx)>>>(
      dw, static_cast<const T*>(dy), static_cast<const T*>(x), offsets, rows, out, in);
  MOE_CUDA_LAUNCH_CHECK();
}

// Whether the code the device runs for C's kernels is the sm_90a code (see the top comment).
template <class C, class T>
bool compiled_for_sm90a() {
#ifdef MOE_WITH_SM90A
  auto is90 = [](int v) { return v >= 90 && v < 100; };
  return is90(compiled_arch(grouped_sm90_rows_kernel<C, T, true>)) &&
         is90(compiled_arch(grouped_sm90_rows_kernel<C, T, false>)) &&
         is90(compiled_arch(grouped_sm90_dw_kernel<C, T>));
#else
  return false;
#endif
}

bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major == 9 && minor == 0;
}

// MOE_GROUPED_SM90 (read at every launch, so the tests cover every setting in one process):
// "0" declines (the sm_80 kernels run), "128" takes 128-column block tiles, anything else (or
// unset) 256-column ones.
enum class Mode { off, narrow, wide };
Mode mode() {
  const char* v = std::getenv("MOE_GROUPED_SM90");
  if (v == nullptr) return Mode::wide;
  const std::string s(v);
  return s == "0" ? Mode::off : s == "128" ? Mode::narrow : Mode::wide;
}

bool sm90_available(DType t) {
  // Decided once per process for the current device (the trainer uses one device per process).
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    if (!device_is_sm90()) return;
    half_ok = compiled_for_sm90a<Wide, __half>() && compiled_for_sm90a<Narrow, __half>();
    bf16_ok =
        compiled_for_sm90a<Wide, __nv_bfloat16>() && compiled_for_sm90a<Narrow, __nv_bfloat16>();
  });
  return t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
}

// Calls fn(C{}, T{}) with the configuration and storage type of this launch.
template <class Fn>
void with_config(DType t, Mode m, Fn&& fn) {
  const bool wide = m == Mode::wide;
  if (t == DType::f16)
    wide ? fn(Wide{}, __half{}) : fn(Narrow{}, __half{});
  else
    wide ? fn(Wide{}, __nv_bfloat16{}) : fn(Narrow{}, __nv_bfloat16{});
}

}  // namespace

bool grouped_sm90_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                       const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                       int64_t k_total, int64_t expert_stride, bool b_k_fast) {
  const Mode m = mode();
  if (m == Mode::off || !sm90_available(t) ||
      !rows_operands_fit(c, a, w, n_total, k_total, expert_stride, b_k_fast, rows, experts, kBM))
    return false;
  with_config(t, m, [&](auto cfg, auto zero) {
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

bool grouped_sm90_dw(Ctx& ctx, DType t, float* dw, const void* dy, const void* x,
                     const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in) {
  const Mode m = mode();
  if (m == Mode::off || !sm90_available(t) || !aligned16_rows(dy, out) || !aligned16_rows(x, in) ||
      out % 8 != 0 || in % 8 != 0 || reinterpret_cast<uintptr_t>(dw) % 8 != 0)
    return false;
  with_config(t, m, [&](auto cfg, auto zero) {
    launch_dw<decltype(cfg), decltype(zero)>(ctx, dw, dy, x, offsets, experts, rows, out, in);
  });
  return true;
}

}  // namespace moe::cuda_detail
