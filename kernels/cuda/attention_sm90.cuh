// The pieces the Hopper flash attention kernels share (attention_sm90.cu: the forward and the
// two-kernel backward; attention_sm90_fused_backward.cu: the one-kernel backward): the tile
// geometry, wgmma descriptors and products over swizzled [rows][64] head tiles, the accumulator ->
// A-fragment packing, the staged tile store and the host's tensor maps. attention_sm90.cu's top
// comment explains the layouts and the pipeline.
#pragma once
#include <cudaTypedefs.h>

#include <cstdint>
#include <type_traits>

#include "cuda/attention_mma.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/tma_sm90.cuh"
#include "cuda/vec16.cuh"
#include "cuda/wgmma_sm90.cuh"

namespace moe::cuda_detail::flash90 {

constexpr int kD = 64;          // head_dim
constexpr int kRowBytes = 128;  // a row of 64 16-bit elements: one 128-byte swizzle row
constexpr int kThreads = 384;   // a producer warpgroup and two math warpgroups
constexpr int kWgRows = 64;     // rows of a math warpgroup's m64 tile
constexpr int kWgBytes = kWgRows * kRowBytes;  // 8 KiB: a math warpgroup's rows of a tile
constexpr int kMathWarps = 8;                  // arrivals on an empty barrier: one per math warp
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// ---- device helpers ----------------------------------------------------------------------------

[[maybe_unused]] __device__ __forceinline__ uint32_t align1024(uint32_t addr) {
  return (addr + 1023u) & ~1023u;
}

// Descriptors of a swizzled [rows][64] tile at shared address `tile` (1024-byte aligned) used
// K-major (rows are M / N; 8-row groups 1024 bytes apart) or MN-major (rows are k; one 64-wide
// m/n block, so the block stride is never used).
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile) {
  return smem_desc_sw128(tile, 16, 1024);
}
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile) {
  return smem_desc_sw128(tile, kWgBytes, 1024);
}
// The descriptor `bytes` further on: the start address is bits 0-13 in 16-byte units, and shared
// addresses stay below 256 KiB, so the add never carries out of the field.
[[maybe_unused]] __device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// c (64 x kN) = A B^T over head_dim: A the K-major tile of desc_a (64 rows), B the K-major tile
// of desc_b (kN rows). Issued, not waited for.
template <class T, int kN>
__device__ __forceinline__ void product_abt(float (&c)[kN / 2], uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int s = 0; s < kD / 16; ++s) {
    if constexpr (kN == 128)
      wgmma_m64n128<T, 0, 0>(c, desc_at(desc_a, 32 * s), desc_at(desc_b, 32 * s), s > 0);
    else
      wgmma_m64n64<T, 0, 0>(c, desc_at(desc_a, 32 * s), desc_at(desc_b, 32 * s), s > 0);
  }
}

// acc (64 x 64) += C B: C (64 x kK) in A fragments (pack_a), B the MN-major tile of desc_b (kK
// rows of 64). Issued, not waited for.
template <class T, int kK>
__device__ __forceinline__ void product_cb(float (&acc)[32], const uint32_t (&c)[kK / 16][4],
                                           uint64_t desc_b) {
#pragma unroll
  for (int s = 0; s < kK / 16; ++s) wgmma_m64n64_rs<T, 1>(acc, c[s], desc_at(desc_b, 2048 * s), 1);
}

// An accumulator of kN columns rounded to T as the A fragments of kN / 16 k16 steps (the mapping
// in the top comment).
template <class T, int kN>
__device__ __forceinline__ void pack_a(uint32_t (&a)[kN / 16][4], const float (&c)[kN / 2]) {
#pragma unroll
  for (int s = 0; s < kN / 16; ++s) {
    a[s][0] = pack2<T>(c[8 * s], c[8 * s + 1]);
    a[s][1] = pack2<T>(c[8 * s + 2], c[8 * s + 3]);
    a[s][2] = pack2<T>(c[8 * s + 4], c[8 * s + 5]);
    a[s][3] = pack2<T>(c[8 * s + 6], c[8 * s + 7]);
  }
}

template <int kN>
__device__ __forceinline__ void zero(float (&c)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) c[i] = 0.0f;
}

// <a, b> over the 8 16-bit elements of two 16-byte chunks, in fp32.
template <class T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const T* ea = reinterpret_cast<const T*>(&a);
  const T* eb = reinterpret_cast<const T*>(&b);
  float s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += load(ea[j]) * load(eb[j]);
  return s;
}

// Stores a math warpgroup's 64 x 64 accumulator, row half hr (rows r and r + 8 of each thread)
// times scale[hr], to dst rows 0 .. rows_left - 1 (row i at dst + i * stride): the accumulator
// pairs go to `staging` (the warpgroup's 8 KiB of a tile no wgmma reads any more) with their
// 16-byte chunks swizzled (chunk ^ row % 8: the 8 rows of a warp store hit 32 banks), then each
// row leaves as 8 16-byte stores, 8 threads per 128-byte row.
template <class T>
__device__ __forceinline__ void store_tile(const float (&c)[32], const float (&scale)[2],
                                           uint32_t staging, T* dst, int64_t stride,
                                           int64_t rows_left, int g) {
  const int t = static_cast<int>(threadIdx.x) % 128;
  const int row0 = (t / 32) * 16 + (t % 32) / 4, pair = t % 4;
  named_barrier_sync(1 + g, 128);  // every wgmma of the warpgroup has retired
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + 8 * hr;
      const uint32_t at = staging + row * kRowBytes + ((j ^ (row & 7)) << 4) + 4 * pair;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at),
                   "r"(pack2<T>(c[4 * j + 2 * hr] * scale[hr], c[4 * j + 2 * hr + 1] * scale[hr]))
                   : "memory");
    }
  named_barrier_sync(1 + g, 128);
#pragma unroll
  for (int i = 0; i < kWgRows * 8 / 128; ++i) {
    const int idx = i * 128 + t, row = idx / 8, chunk = idx % 8;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(staging + row * kRowBytes + ((chunk ^ (row & 7)) << 4))
                 : "memory");
    if (row < rows_left) *reinterpret_cast<uint4*>(dst + row * stride + chunk * 8) = v;
  }
}

// The geometry both dk/dv kernels share (attention_sm90.cu's two-kernel backward and
// attention_sm90_fused_backward.cu): a block's 128 keys (K then V), 64-query steps in a 4-stage
// ring freed a step late (a stage's Q and dO are the next step's dK, dV operands); a stage holds
// Q, dO, O (TMA), then lse (log2 domain) and D of its 64 queries, 1024-byte aligned. The helpers
// (warps 2-3, one query row each) write lse and D once the stage's tiles have landed and are the
// full barrier's arrivals. lse and D are stored thread-major (sum_slot): the 16 queries a math
// thread reads are 16 consecutive floats, four 16-byte loads each instead of 16 scalar ones. The
// register split (2 x 128 x math + 128 x producer <= 64 Ki): the math keeps dK, dV, S^T, dP^T and
// the previous step's P^T, dS^T fragments.
struct DkdvGeometry {
  static constexpr int kBN = 128;  // keys per block (a key tile)
  static constexpr int kBM = 64;   // queries per step
  static constexpr int kStages = 4;
  static constexpr int kKVBytes = kBN * kRowBytes;    // K or V of the key tile
  static constexpr int kTileBytes = kBM * kRowBytes;  // a Q, dO or O tile
  static constexpr int kDo = kTileBytes, kO = 2 * kTileBytes;
  static constexpr int kSumSlots = kBM + 4;  // sum_slot's range (64 queries and a gap)
  static constexpr int kLse = 3 * kTileBytes, kDsum = kLse + kSumSlots * 4;
  static constexpr int kStageBytes = 3 * kTileBytes + 1024;
  static constexpr int kHelpers = 64;
  static constexpr int kProducerRegs = 40, kMathRegs = 232;
};
static_assert(setmaxnreg_fits(DkdvGeometry::kProducerRegs, DkdvGeometry::kMathRegs),
              "setmaxnreg within the block");
static_assert(DkdvGeometry::kKVBytes % 1024 == 0 && DkdvGeometry::kTileBytes % 1024 == 0 &&
                  DkdvGeometry::kStageBytes % 1024 == 0 &&
                  DkdvGeometry::kDsum + DkdvGeometry::kSumSlots * 4 <= DkdvGeometry::kStageBytes &&
                  DkdvGeometry::kLse % 16 == 0 && DkdvGeometry::kDsum % 16 == 0,
              "1024-byte aligned tiles; lse and D inside the stage, 16-byte aligned");

// Where query row r (0..63) of a step keeps its lse and D: math thread t4 (lane % 4) of the
// S^T / dP^T accumulator layout reads the rows 8 jj + 2 t4 + b (jj = 0..7, b = 0, 1), so row r
// goes to 16 t4 + 2 jj + b, shifted by 4 floats for t4 >= 2 so that the four 16-byte loads of a
// quarter-warp (t4 = 0..3) fall on distinct banks.
__device__ __forceinline__ int sum_slot(int r) {
  const int t4 = (r >> 1) & 3;
  return 16 * t4 + 4 * (t4 >> 1) + 2 * (r >> 3) + (r & 1);
}

// The dk/dv kernels' step, for a math warpgroup's 64 keys (its K and V rows: k_desc, v_desc)
// against the kBM queries whose tiles are at shared address `stage` (layout C): the first
// products S^T = K Q^T and dP^T = V dO^T, and the second dV += P^T dO, dK += dS^T Q with P^T and
// dS^T in A fragments (issued, not committed).
template <class T, class C>
__device__ __forceinline__ void dkdv_scores(float (&s)[C::kBM / 2], float (&dp)[C::kBM / 2],
                                            uint64_t k_desc, uint64_t v_desc, uint32_t stage) {
  product_abt<T, C::kBM>(s, k_desc, kmajor_desc(stage));
  product_abt<T, C::kBM>(dp, v_desc, kmajor_desc(stage + C::kDo));
}
template <class T, class C>
__device__ __forceinline__ void dkdv_accumulate(float (&dva)[32], float (&dka)[32],
                                                const uint32_t (&pa)[C::kBM / 16][4],
                                                const uint32_t (&dsa)[C::kBM / 16][4],
                                                uint32_t stage) {
  product_cb<T, C::kBM>(dva, pa, mnmajor_desc(stage + C::kDo));
  product_cb<T, C::kBM>(dka, dsa, mnmajor_desc(stage));
}

// The dk/dv kernels' elementwise step: S^T and dP^T (s, dp) of a math warpgroup's 64 keys (this
// thread's: key and key + 8) against the kBM queries from i0 -> P^T in s, dS^T = P^T (dP^T - D)
// in dp, with the queries' lse (log2 domain) and D from the landed stage (layout C). Queries
// that see no key of the warpgroup (the causal past of its keys, past T) give P = 0, and keys
// past T are never stored: such a step is computed like any other and adds zeros, so the loop
// body has no branch; only steps that reach the diagonal or T evaluate a mask.
template <class C>
__device__ __forceinline__ void dkdv_grads(float (&s)[C::kBM / 2], float (&dp)[C::kBM / 2],
                                           const unsigned char* stage, int64_t i0, int64_t wg_key,
                                           int64_t key, int64_t seq, int t4, float scale_log2) {
  constexpr int kBM = C::kBM;
  static_assert(kBM == 64, "sum_slot's layout: 64 queries a step");
  // This thread's 16 queries 8 jj + 2 t4 + b keep lse and D at base + 2 jj + b: a 16-byte load of
  // each per pair of jj, loaded where used (all 32 up front spilled in the one-kernel backward).
  const float4* lse4 = reinterpret_cast<const float4*>(stage + C::kLse + 4 * sum_slot(2 * t4));
  const float4* dsum4 = reinterpret_cast<const float4*>(stage + C::kDsum + 4 * sum_slot(2 * t4));
  // d = query - key of element (jj, e) is rel + 8 jj + (e & 1) (for key + 8: minus 8); queries
  // from T on have d >= lim
  const int rel = static_cast<int>(i0 - key) + 2 * t4;
  const int lim = static_cast<int>(seq - key);
  auto pass = [&](auto masked) {
#pragma unroll
    for (int q = 0; q < kBM / 16; ++q) {
      const float4 l4 = lse4[q], d4 = dsum4[q];
      const float lse2[4] = {l4.x, l4.y, l4.z, l4.w}, dsum[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int jj = 2 * q + h;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * jj + e, c = 2 * h + (e & 1);
          const int d = rel + 8 * jj + (e & 1);
          const float pr = decltype(masked)::value && (d < 8 * (e >> 1) || d >= lim)
                               ? 0.0f
                               : exp2_ftz(fmaf(s[i], scale_log2, -lse2[c]));
          s[i] = pr;
          dp[i] = pr * (dp[i] - dsum[c]);
        }
      }
    }
  };
  if (i0 < wg_key + kWgRows || i0 + kBM > seq)
    pass(std::true_type{});
  else
    pass(std::false_type{});
}

// The dk/dv kernels' step ring (by thread 0, before the block's barrier): per stage, `landed`
// completed by the TMA, `full` by the helpers' lse and D, `empty` by the math warps.
template <class C>
__device__ __forceinline__ void init_step_ring(uint32_t landed, uint32_t full, uint32_t empty) {
  for (int s = 0; s < C::kStages; ++s) {
    mbar_init(landed + 8 * s, 1);
    mbar_init(full + 8 * s, C::kHelpers);
    mbar_init(empty + 8 * s, kMathWarps);
  }
}

// The dk/dv kernels' producer: a step's Q, dO and O tiles (64 query rows from i0 of query head h,
// sequence b) into `stage` (layout C: C::kDo, kO), completing the stage's `landed` barrier.
template <class C>
__device__ __forceinline__ void load_step_tiles(uint32_t stage, uint32_t landed,
                                                const CUtensorMap* map_q, const CUtensorMap* map_do,
                                                const CUtensorMap* map_o, int h, int32_t i0,
                                                int b) {
  mbar_arrive_expect_tx(landed, 3 * C::kTileBytes);
  tma_load_3d(stage, map_q, landed, h * kD, i0, b);
  tma_load_3d(stage + C::kDo, map_do, landed, h * kD, i0, b);
  tma_load_3d(stage + C::kO, map_o, landed, h * kD, i0, b);
}

// The dk/dv kernels' helper thread for query row r of a step in `stage` (layout C: C::kDo, kO,
// kLse, kDsum), the step's queries starting at query0 of the head whose lse row is lse_row: the
// row's lse (log2 domain, +inf past T so P = 0) is loaded before the stage's tiles land (its
// latency hides behind the TMA's), then D = <dO_r, O_r> is read off the swizzled dO and O tiles
// (zero past T; chunk c of row r at r * 128 + (c ^ r % 8) * 16) and written beside the lse, and
// the thread's arrival on `full` releases them.
template <class C, class T>
__device__ __forceinline__ void helper_step(unsigned char* stage, uint32_t landed, uint32_t full,
                                            uint32_t parity, int r, const float* lse_row,
                                            int64_t query0, int64_t seq) {
  const int64_t q = query0 + r;
  const float row_lse = q < seq ? lse_row[q] * kLog2e : INFINITY;
  mbar_wait(landed, parity);
  float part = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int at = r * kRowBytes + ((c ^ (r & 7)) << 4);
    part += dot8<T>(*reinterpret_cast<const uint4*>(stage + C::kDo + at),
                    *reinterpret_cast<const uint4*>(stage + C::kO + at));
  }
  reinterpret_cast<float*>(stage + C::kDsum)[sum_slot(r)] = part;
  reinterpret_cast<float*>(stage + C::kLse)[sum_slot(r)] = row_lse;
  mbar_arrive(full);
}

// The dk/dv kernels' last act: a math warpgroup's 64 rows of dK (scaled) and dV, from wg_key of
// kv head kvh in sequence b, through its K and V rows of shared memory as staging (store_tile).
template <class T>
__device__ __forceinline__ void store_dk_dv(const float (&dka)[32], const float (&dva)[32],
                                            uint32_t k_rows, uint32_t v_rows, T* dk, T* dv, int b,
                                            int64_t seq, int64_t wg_key, int kv_heads, int kvh,
                                            float scale, int g) {
  const int64_t kv_stride = int64_t(kv_heads) * kD;
  const int64_t kv_off = ((int64_t(b) * seq + wg_key) * kv_heads + kvh) * kD;
  const float sk[2] = {scale, scale}, sv[2] = {1.0f, 1.0f};
  store_tile<T>(dka, sk, k_rows, dk + kv_off, kv_stride, seq - wg_key, g);
  store_tile<T>(dva, sv, v_rows, dv + kv_off, kv_stride, seq - wg_key, g);
}

constexpr double kScale = 0.125;  // 1 / sqrt(head_dim)

// A tensor map over a [B, T, n_heads, 64] 16-bit tensor seen as [B][T][n_heads * 64] (innermost
// first: n_heads * 64, T, B): boxes of one head's 64 elements x `rows` positions x 1 sequence,
// stored in the 128-byte swizzle; positions past T are zero-filled, never the next sequence's.
CUtensorMap head_rows_map(DType t, const void* p, const AttentionShape& s, int64_t n_heads,
                          uint32_t rows);

// The dk/dv kernels' operands (DkdvGeometry's boxes): the steps' Q, dO and O tiles, the key
// tile's K and V.
struct DkdvMaps {
  CUtensorMap q, dout, k, v, out;
};
DkdvMaps dkdv_maps(DType t, const void* q, const void* dout, const void* k, const void* v,
                   const void* out, const AttentionShape& s);

// The one-kernel backward (attention_sm90_fused_backward.cu): whether this binary's code for it
// is sm_90a code, and its launch (the caller checks the device, the alignment and the shape as
// for the two-kernel backward). dq_acc: fp32 [B, nh, T, 64] scratch, overwritten.
bool fused_backward_compiled_for_sm90a();
void launch_fused_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, float* dq_acc,
                           const void* dout, const void* q, const void* k, const void* v,
                           const void* out, const float* lse, const AttentionShape& s);

}  // namespace moe::cuda_detail::flash90
