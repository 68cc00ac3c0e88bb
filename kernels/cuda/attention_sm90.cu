// Hopper (sm_90a) flash attention with wgmma and TMA, head_dim 64, f16 / bf16: the first path of
// attention_mma_forward / attention_mma_backward (attention_mma.cuh) on an sm_90 device, ahead of
// the mma.sync kernels of attention_sm80.cu / attention_sm80_backward.cu, which stay for sm_80 /
// sm_89 and for every case this file declines. Same op contract and rounding points as those:
// q, out, dout, dq [B, T, H, 64], k, v, dk, dv [B, T, KVH, 64] (GQA: kv head = h / (H / KVH)),
// lse [B, H, T] fp32 in natural-log units, causal; P and dS are rounded to 16 bits before their
// products, as FlashAttention does.
//
// Why it is fast (FlashAttention-3 style, simplified): a warpgroup issues asynchronous m64nNk16
// MMAs that read Q / K / V tiles straight from shared memory, the tiles get there by TMA (whole
// boxes per instruction, zero-filled past T, written in the 128-byte swizzle wgmma reads), and
// the second product of each step (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q) takes its A
// operand from the registers that hold the first product's accumulator, rounded in place.
//
// A block: 3 warpgroups (384 threads). Warpgroup 0 produces (one thread issues the TMA loads into
// mbarrier full / empty rings, tma_sm90.cuh; the dk/dv kernel's warps 2-3 also compute lse and D
// per query). Warpgroups 1 and 2 compute, 64 rows each (m64 wgmma), and only wait and issue.
// Every kernel pipelines the same way: step j's first products are issued, then step j - 1's
// second products right behind them, so the tensor cores run those while the elementwise part
// of step j does; a stage is freed once its second products have retired.
// - forward: 128 query rows of one (b, h), key tiles of 128 (K and V rings of their own, so
//   S = Q K^T of a tile starts before its V lands), up to the block's last row (causal), longest
//   query tiles first over the whole grid. Online softmax in registers on the raw scores, P =
//   2^(S scale log2e - m scale log2e) in one FFMA and one ex2.approx.ftz (exp2_ftz) per element;
//   O += P V of tile j - 1 runs under tile j's softmax. lse = (m scale log2e + log2 l) ln 2.
// - dq kernel: 128 query rows of one (b, h), Q and dO loaded once; key tiles of 64 (K and V in one
//   stage): S = Q K^T, dP = dO V^T, P = exp2(S scale log2e - lse log2e), dS = P (dP - D) with
//   D_i = <dO_i, O_i>, dQ += dS K; dQ = scale dQ.
// - dk/dv kernel: 128 keys of one (b, kv head), K and V loaded once; for each query head of the
//   group and each query tile of 64 that sees the keys: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T as
//   above, dV += P^T dO, dK += dS^T Q; dK = scale dK. The TMA brings Q, dO and O per step, and
//   the helper warps read D off the landed dO and O tiles.
// The elementwise parts are the kernels' bottleneck (ncu: issue-bound on dependent ALU work with
// 8 math warps per SM), so only tiles that reach the causal diagonal or T evaluate a mask, in
// 32-bit offsets; a tile no row of a warpgroup sees is computed like any other (it adds zeros),
// so the loop bodies have no branch around a wgmma.
// Every output element is written by one thread of one block: deterministic, no atomics.
// attention_sm90_fused_backward.cu runs the backward as one kernel where use_fused() says so. Rows
// past T are zero-filled on load, computed and not stored; keys past T and causal-future keys are
// masked (-inf before the softmax, P = 0 in the backward).
//
// The accumulator -> A-fragment mapping (PTX ISA, "Register fragments" of wgmma .m64nNk16): thread
// t of a warpgroup holds accumulator elements d[4j + e] at row 16 (t / 32) + (t % 32) / 4 + 8 (e /
// 2) and column 8 j + 2 (t % 4) + e % 2 (j = 0 .. N/8 - 1), and the A fragment of k16 step s is 4
// registers of 16-bit pairs: (row r, k 2c..2c+1), (r + 8, 2c..), (r, 2c + 8..), (r + 8, 2c + 8..)
// with r = 16 (t / 32) + (t % 32) / 4 and c = t % 4. Columns 16 s .. 16 s + 15 of the accumulator
// are its n8 blocks 2s and 2s + 1, so a[s] = {pack(d[8s], d[8s+1]), pack(d[8s+2], d[8s+3]),
// pack(d[8s+4], d[8s+5]), pack(d[8s+6], d[8s+7])} (pack_a): the same trick as the mma.sync
// kernels' cb() in attention_sm80.cuh.
//
// Operand tiles: every tile is [rows][64] 16-bit elements, 128-byte rows in the swizzle, as TMA
// writes it from [B, T, heads * 64] with a box of 64 x rows x 1. A tile is K-major when its rows
// are the M or N index and head_dim is k (Q, K, V, dO in S = Q K^T, dP = dO V^T, S^T = K Q^T,
// dP^T = V dO^T: k16 step s is 32 bytes to the right), MN-major when its rows are k (V in P V, K
// in dS K, dO in P^T dO, Q in dS^T Q: transpose bit set, N = 64 = one 128-byte row, k16 step s is
// 16 rows = 2048 bytes down); wgmma_sm90.cuh's descriptors, as in grouped_wgmma_sm90.cu.
//
// Which code runs: as grouped_wgmma_sm90.cu (the bodies exist only in sm_90a code, kHasWgmma; the
// host launches them only on an sm_90 device whose code for these kernels is version 9.0 under
// MOE_WITH_SM90A). MOE_ATTENTION_SM90=0 declines both directions (enabled() below), so the tests
// compare both paths in one process.
#include <cmath>
#include <mutex>
#include <string>

#include "cuda/attention_sm90.cuh"
#include "moe/env_switch.hpp"

namespace moe::cuda_detail {
namespace {
using namespace flash90;

// The query tile of this block in the forward and dq kernels (C: Fwd or Dq). Longest first over
// the whole grid: the query tile is the slowest index of blockIdx.x, largest first.
struct QueryTile {
  int b, h, kvh;  // sequence, query head, its kv head
  int64_t q0;     // the tile's first query row
  int n_tiles;    // key tiles of C::kBN up to its last row (causal) or T
};
template <class C>
__device__ __forceinline__ QueryTile query_tile(int64_t seq, int batch, int heads, int kv_heads,
                                                int q_tiles) {
  const int bh_count = batch * heads;
  const int tile_rank = static_cast<int>(blockIdx.x / bh_count);
  const int bh = static_cast<int>(blockIdx.x % bh_count);
  const int b = bh / heads, h = bh % heads, kvh = h / (heads / kv_heads);
  const int64_t q0 = int64_t(q_tiles - 1 - tile_rank) * C::kBM;
  const int64_t kv_end = seq < q0 + C::kBM ? seq : q0 + C::kBM;
  const int n_tiles = static_cast<int>((kv_end + C::kBN - 1) / C::kBN);
  return {b, h, kvh, q0, n_tiles};
}

// ---- forward -----------------------------------------------------------------------------------

struct Fwd {
  static constexpr int kBM = 128;  // query rows per block
  static constexpr int kBN = 128;  // keys per tile
  static constexpr int kStages = 2;
  static constexpr int kQBytes = kBM * kRowBytes;
  static constexpr int kTileBytes = kBN * kRowBytes;  // a K or V tile
  static constexpr int kK0 = kQBytes;                 // the K ring, then the V ring
  static constexpr int kV0 = kK0 + kStages * kTileBytes;
  // +1024: the tiles start at the first 1024-byte boundary of the dynamic shared memory.
  static constexpr size_t kSmem = 1024 + kV0 + kStages * kTileBytes;
  // setmaxnreg: the producer warpgroup's registers go to the two math warpgroups.
  static constexpr int kProducerRegs = 40, kMathRegs = 232;
};
static_assert(setmaxnreg_fits(Fwd::kProducerRegs, Fwd::kMathRegs), "setmaxnreg within the block");

template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    flash_forward_sm90_kernel(const __grid_constant__ CUtensorMap map_q,
                              const __grid_constant__ CUtensorMap map_k,
                              const __grid_constant__ CUtensorMap map_v, T* out, float* lse,
                              int64_t seq, int batch, int heads, int kv_heads, int q_tiles,
                              float scale_log2) {
  if constexpr (kHasWgmma) {
    using C = Fwd;
    constexpr int kS = C::kStages;
    extern __shared__ __align__(1024) unsigned char smem[];
    // q_full, then per stage k_full, k_empty, v_full, v_empty
    __shared__ __align__(8) uint64_t bars[1 + 4 * kS];
    const uint32_t base = align1024(shared_addr(smem));
    const uint32_t q_full = shared_addr(bars), k_full = q_full + 8, k_empty = k_full + 8 * kS,
                   v_full = k_empty + 8 * kS, v_empty = v_full + 8 * kS;
    if (threadIdx.x == 0) {
      mbar_init(q_full, 1);
      for (int s = 0; s < kS; ++s) {
        mbar_init(k_full + 8 * s, 1);
        mbar_init(v_full + 8 * s, 1);
        mbar_init(k_empty + 8 * s, kMathWarps);
        mbar_init(v_empty + 8 * s, kMathWarps);
      }
      mbar_init_fence();
    }
    __syncthreads();
    const auto [b, h, kvh, q0, n_tiles] = query_tile<C>(seq, batch, heads, kv_heads, q_tiles);
    const int wg = static_cast<int>(threadIdx.x) / 128;
    if (wg == 0) {
      release_registers<C::kProducerRegs>();
      if (threadIdx.x != 0) return;
      mbar_arrive_expect_tx(q_full, C::kQBytes);
      tma_load_3d(base, &map_q, q_full, h * kD, static_cast<int32_t>(q0), b);
      for (int j = 0; j < n_tiles; ++j) {
        const int s = j % kS;
        const uint32_t free_parity = ((j / kS) & 1) ^ 1u;
        if (j >= kS) mbar_wait(k_empty + 8 * s, free_parity);
        mbar_arrive_expect_tx(k_full + 8 * s, C::kTileBytes);
        tma_load_3d(base + C::kK0 + s * C::kTileBytes, &map_k, k_full + 8 * s, kvh * kD, j * C::kBN,
                    b);
        if (j >= kS) mbar_wait(v_empty + 8 * s, free_parity);
        mbar_arrive_expect_tx(v_full + 8 * s, C::kTileBytes);
        tma_load_3d(base + C::kV0 + s * C::kTileBytes, &map_v, v_full + 8 * s, kvh * kD, j * C::kBN,
                    b);
      }
      return;
    }
    claim_registers<C::kMathRegs>();
    const int g = wg - 1, lane = static_cast<int>(threadIdx.x) % 32;
    const int warp = (static_cast<int>(threadIdx.x) % 128) / 32;
    const int64_t warp_first = q0 + g * kWgRows + warp * 16;  // rows row and row + 8: this thread's
    const int64_t row = warp_first + lane / 4;
    const bool signals = lane == 0;
    const uint32_t q_tile = base + g * kWgBytes;
    const uint64_t q_desc = kmajor_desc(q_tile);

    float o[32];
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // m: raw scores
    float s[C::kBN / 2];
    uint32_t p[C::kBN / 16][4];  // P of the previous tile, rounded: O += P V's A operand

    // Tile j's S (landed in s): mask, the running row maxima (of the raw scores), then
    // P = 2^(S scale log2e - m scale log2e) in place, one FFMA and one MUFU per element; alpha =
    // how much the old O and l shrink. Only tiles that reach the causal diagonal or T mask.
    auto softmax = [&](int j, float(&alpha)[2]) {
      const int64_t j0 = int64_t(j) * C::kBN;
      float mx[2] = {m[0], m[1]};
      if (j0 + C::kBN - 1 > warp_first || j0 + C::kBN > seq) {
        // d = key - row of element (jj, e) is rel + 8 jj + (e & 1) (for row + 8: minus 8), in
        // 32 bits (shape_fits: T < 2^31); keys from T on have d >= lim
        const int rel = static_cast<int>(j0 - row) + 2 * (lane & 3);
        const int lim = static_cast<int>(seq - row);
#pragma unroll
        for (int jj = 0; jj < C::kBN / 8; ++jj)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hr = e >> 1, d = rel + 8 * jj + (e & 1);  // key - row
            float& x = s[4 * jj + e];
            if (d > 8 * hr || d >= lim) x = -INFINITY;
            mx[hr] = fmaxf(mx[hr], x);
          }
      } else {
#pragma unroll
        for (int i = 0; i < C::kBN / 2; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
      }
      float base_m[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
        // A row with no visible key yet keeps m = -inf: subtract 0 so nothing becomes NaN.
        base_m[hr] = mx[hr] == -INFINITY ? 0.0f : mx[hr] * scale_log2;
        alpha[hr] = exp2_ftz(m[hr] * scale_log2 - base_m[hr]);
        m[hr] = mx[hr];
        l[hr] *= alpha[hr];
      }
      // l sums P in fp32 before pack_a rounds it to T, as FlashAttention does
#pragma unroll
      for (int i = 0; i < C::kBN / 2; ++i) {
        const int hr = (i >> 1) & 1;
        s[i] = exp2_ftz(fmaf(s[i], scale_log2, -base_m[hr]));
        l[hr] += s[i];
      }
    };

    mbar_wait(q_full, 0);
    {  // tile 0: S, softmax (o is still 0: nothing to rescale)
      mbar_wait(k_full, 0);
      wgmma_fence();
      product_abt<T, C::kBN>(s, q_desc, kmajor_desc(base + C::kK0));
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(s);
      if (signals) mbar_arrive(k_empty);
      float alpha[2];
      softmax(0, alpha);
      pack_a<T, C::kBN>(p, s);
    }
    // Tile j: S_j = Q K_j^T, then O += P_{j-1} V_{j-1} right behind it, which runs while the
    // softmax of S_j does. One shape of loop body, no branch on j: with one, ptxas could not
    // tell that S has retired at wait<1> and serialised the wgmma (C7514).
    for (int j = 1; j < n_tiles; ++j) {
      const int st = j % kS, prev = (j - 1) % kS;
      mbar_wait(k_full + 8 * st, (j / kS) & 1);
      mbar_wait(v_full + 8 * prev, ((j - 1) / kS) & 1);
      wgmma_fence();  // o, p were written by ordinary instructions since the last wgmma
      product_abt<T, C::kBN>(s, q_desc, kmajor_desc(base + C::kK0 + st * C::kTileBytes));
      wgmma_commit();
      product_cb<T, C::kBN>(o, p, mnmajor_desc(base + C::kV0 + prev * C::kTileBytes));
      wgmma_commit();
      wgmma_wait<1>();  // S has retired (groups retire in order), P V may still run
      fence_accumulators(s);
      if (signals) mbar_arrive(k_empty + 8 * st);
      float alpha[2];
      softmax(j, alpha);
      wgmma_wait<0>();  // the previous tile's P V has retired: o is final, p and V free
      fence_accumulators(o);
      fence_fragments(p);
      if (signals) mbar_arrive(v_empty + 8 * prev);
#pragma unroll
      for (int i = 0; i < 32; ++i) o[i] *= alpha[(i >> 1) & 1];
      pack_a<T, C::kBN>(p, s);
    }
    {  // the last tile's O += P V
      const int last = (n_tiles - 1) % kS;
      mbar_wait(v_full + 8 * last, ((n_tiles - 1) / kS) & 1);
      wgmma_fence();
      product_cb<T, C::kBN>(o, p, mnmajor_desc(base + C::kV0 + last * C::kTileBytes));
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(o);
      fence_fragments(p);
      if (signals) mbar_arrive(v_empty + 8 * last);
    }
    // finish: l over the quad, O / l, lse = (m + log2 l) ln 2
    float inv[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
      l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
      inv[hr] = 1.0f / l[hr];
      const int64_t r = row + 8 * hr;
      if ((lane & 3) == 0 && r < seq)
        lse[(int64_t(b) * heads + h) * seq + r] = (m[hr] * scale_log2 + log2f(l[hr])) * kLn2;
    }
    const int64_t first = q0 + g * kWgRows;
    store_tile<T>(o, inv, q_tile, out + ((int64_t(b) * seq + first) * heads + h) * kD,
                  int64_t(heads) * kD, seq - first, g);
  }
}

// ---- backward: dq ------------------------------------------------------------------------------

struct Dq {
  static constexpr int kBM = 128;  // query rows per block
  static constexpr int kBN = 64;   // keys per tile
  // A stage is freed a tile late (its K is the next tile's dQ operand).
  static constexpr int kStages = 4;
  static constexpr int kQBytes = kBM * kRowBytes;     // Q, then dO
  static constexpr int kTileBytes = kBN * kRowBytes;  // a K or V tile; a stage holds K then V
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kRing0 = 2 * kQBytes;
  static constexpr size_t kSmem = 1024 + kRing0 + kStages * kStageBytes;
  static constexpr int kProducerRegs = 40, kMathRegs = 232;  // as Fwd's
};
static_assert(setmaxnreg_fits(Dq::kProducerRegs, Dq::kMathRegs), "setmaxnreg within the block");

template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    flash_dq_sm90_kernel(const __grid_constant__ CUtensorMap map_q,
                         const __grid_constant__ CUtensorMap map_do,
                         const __grid_constant__ CUtensorMap map_k,
                         const __grid_constant__ CUtensorMap map_v, T* dq, const T* dout,
                         const T* out, const float* lse, int64_t seq, int batch, int heads,
                         int kv_heads, int q_tiles, float scale, float scale_log2) {
  if constexpr (kHasWgmma) {
    using C = Dq;
    constexpr int kS = C::kStages;
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[1 + 2 * kS];  // qd_full, then full[], empty[]
    const uint32_t base = align1024(shared_addr(smem));
    const uint32_t qd_full = shared_addr(bars), full = qd_full + 8, empty = full + 8 * kS;
    if (threadIdx.x == 0) {
      mbar_init(qd_full, 1);
      for (int s = 0; s < kS; ++s) {
        mbar_init(full + 8 * s, 1);
        mbar_init(empty + 8 * s, kMathWarps);
      }
      mbar_init_fence();
    }
    __syncthreads();
    const auto [b, h, kvh, q0, n_tiles] = query_tile<C>(seq, batch, heads, kv_heads, q_tiles);
    const int wg = static_cast<int>(threadIdx.x) / 128;
    if (wg == 0) {
      release_registers<C::kProducerRegs>();
      if (threadIdx.x != 0) return;
      mbar_arrive_expect_tx(qd_full, 2 * C::kQBytes);
      tma_load_3d(base, &map_q, qd_full, h * kD, static_cast<int32_t>(q0), b);
      tma_load_3d(base + C::kQBytes, &map_do, qd_full, h * kD, static_cast<int32_t>(q0), b);
      for (int j = 0; j < n_tiles; ++j) {
        const int s = j % kS;
        if (j >= kS) mbar_wait(empty + 8 * s, ((j / kS) & 1) ^ 1u);
        mbar_arrive_expect_tx(full + 8 * s, C::kStageBytes);
        const uint32_t stage = base + C::kRing0 + s * C::kStageBytes;
        tma_load_3d(stage, &map_k, full + 8 * s, kvh * kD, j * C::kBN, b);
        tma_load_3d(stage + C::kTileBytes, &map_v, full + 8 * s, kvh * kD, j * C::kBN, b);
      }
      return;
    }
    claim_registers<C::kMathRegs>();
    const int g = wg - 1, lane = static_cast<int>(threadIdx.x) % 32, t4 = lane & 3;
    const int warp = (static_cast<int>(threadIdx.x) % 128) / 32;
    const int64_t wg_first = q0 + g * kWgRows;
    const int64_t warp_first = wg_first + warp * 16, row = warp_first + lane / 4;
    const bool signals = lane == 0;
    const int64_t q_stride = int64_t(heads) * kD;
    const int64_t q_off = (int64_t(b) * seq * heads + h) * kD;

    // D and lse (log2 domain) of rows `row` and row + 8, while the tiles land: the quad's 4 lanes
    // take 16 columns each. Rows past T get lse = +inf, so their P is 0.
    float d_row[2], lse2[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t r = row + 8 * hr;
      const bool in = r < seq;
      float part = 0.0f;
      if (in) {
        const uint4* a = reinterpret_cast<const uint4*>(dout + q_off + r * q_stride + 16 * t4);
        const uint4* c = reinterpret_cast<const uint4*>(out + q_off + r * q_stride + 16 * t4);
        part = dot8<T>(a[0], c[0]) + dot8<T>(a[1], c[1]);
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      d_row[hr] = part;
      lse2[hr] = in ? lse[(int64_t(b) * heads + h) * seq + r] * kLog2e : INFINITY;
    }

    const uint32_t q_tile = base + g * kWgBytes;
    const uint64_t q_desc = kmajor_desc(q_tile), do_desc = kmajor_desc(q_tile + C::kQBytes);
    float dqa[32], s[32], dp[32];
    zero(dqa);
    uint32_t ds[C::kBN / 16][4];  // dS of the previous tile, rounded: dQ += dS K's A operand
    auto k_tile = [&](int st) { return base + C::kRing0 + st * C::kStageBytes; };
    // S = Q K^T and dP = dO V^T of the tile in stage st (issued, not committed).
    auto scores = [&](int st) {
      product_abt<T, C::kBN>(s, q_desc, kmajor_desc(k_tile(st)));
      product_abt<T, C::kBN>(dp, do_desc, kmajor_desc(k_tile(st) + C::kTileBytes));
    };
    // Tile j's S and dP (landed) -> dS = P (dP - D) in s. Keys no row of the warpgroup sees
    // (the causal future, past T) and rows past T (lse = +inf) give P = 0: such a tile is
    // computed like any other and adds zeros, so the loop body has no branch.
    auto grads = [&](int j) {
      const int64_t j0 = int64_t(j) * C::kBN;
      float nl[2];  // -lse in the log2 domain: P = 2^(S scale log2e - lse log2e), one FFMA
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) nl[hr] = -lse2[hr];
      if (j0 + C::kBN - 1 > warp_first || j0 + C::kBN > seq) {
        // d = key - row of element (jj, e) is rel + 8 jj + (e & 1) (for row + 8: minus 8);
        // keys from T on have d >= lim
        const int rel = static_cast<int>(j0 - row) + 2 * t4;
        const int lim = static_cast<int>(seq - row);
#pragma unroll
        for (int jj = 0; jj < C::kBN / 8; ++jj)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hr = e >> 1, i = 4 * jj + e, d = rel + 8 * jj + (e & 1);
            const float pr =
                d > 8 * hr || d >= lim ? 0.0f : exp2_ftz(fmaf(s[i], scale_log2, nl[hr]));
            s[i] = pr * (dp[i] - d_row[hr]);
          }
      } else {
#pragma unroll
        for (int i = 0; i < C::kBN / 2; ++i) {
          const int hr = (i >> 1) & 1;
          s[i] = exp2_ftz(fmaf(s[i], scale_log2, nl[hr])) * (dp[i] - d_row[hr]);
        }
      }
    };
    mbar_wait(qd_full, 0);
    {  // tile 0
      mbar_wait(full, 0);
      wgmma_fence();
      scores(0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(s);
      fence_accumulators(dp);
      grads(0);
      pack_a<T, C::kBN>(ds, s);
    }
    // Tile j: S_j and dP_j, then dQ += dS_{j-1} K_{j-1} right behind them, which runs while the
    // elementwise part of tile j does (as the forward's P V); stage j - 1 is freed after it.
    for (int j = 1; j < n_tiles; ++j) {
      const int st = j % kS, prev = (j - 1) % kS;
      mbar_wait(full + 8 * st, (j / kS) & 1);
      wgmma_fence();
      scores(st);
      wgmma_commit();
      product_cb<T, C::kBN>(dqa, ds, mnmajor_desc(k_tile(prev)));
      wgmma_commit();
      wgmma_wait<1>();  // S and dP have retired
      fence_accumulators(s);
      fence_accumulators(dp);
      grads(j);
      wgmma_wait<0>();
      fence_accumulators(dqa);
      fence_fragments(ds);
      if (signals) mbar_arrive(empty + 8 * prev);
      pack_a<T, C::kBN>(ds, s);
    }
    {  // the last tile's dQ += dS K
      const int last = (n_tiles - 1) % kS;
      wgmma_fence();
      product_cb<T, C::kBN>(dqa, ds, mnmajor_desc(k_tile(last)));
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(dqa);
      fence_fragments(ds);
      if (signals) mbar_arrive(empty + 8 * last);
    }
    const float sc[2] = {scale, scale};
    store_tile<T>(dqa, sc, q_tile, dq + q_off + wg_first * q_stride, q_stride, seq - wg_first, g);
  }
}

// ---- backward: dk, dv --------------------------------------------------------------------------

// The key-tile-major dk/dv kernel: one block per (key tile, batch, kv head), its K and V loaded
// once; the layout is DkdvGeometry's (attention_sm90.cuh).
struct Dkdv : DkdvGeometry {
  static constexpr int kRing0 = 2 * kKVBytes;
  static constexpr size_t kSmem = 1024 + kRing0 + kStages * kStageBytes;
};
// Shared memory per block on sm_90: 227 KiB, static and dynamic together (the static barriers
// take 1024 bytes: the dynamic memory starts 1024-byte aligned). Every tile the 128-byte swizzle
// reads starts on a 1024-byte boundary.
constexpr size_t kStaticSmem = 1024, kSmemLimit = 232448;
static_assert(Fwd::kSmem + kStaticSmem <= kSmemLimit && Dq::kSmem + kStaticSmem <= kSmemLimit &&
                  Dkdv::kSmem + kStaticSmem <= kSmemLimit,
              "shared memory");
static_assert(Fwd::kQBytes % 1024 == 0 && Fwd::kTileBytes % 1024 == 0 && Dq::kQBytes % 1024 == 0 &&
                  Dq::kTileBytes % 1024 == 0 && kWgBytes % 1024 == 0,
              "1024-byte aligned tiles");

template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    flash_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap map_q,
                           const __grid_constant__ CUtensorMap map_do,
                           const __grid_constant__ CUtensorMap map_k,
                           const __grid_constant__ CUtensorMap map_v,
                           const __grid_constant__ CUtensorMap map_o, T* dk, T* dv,
                           const float* lse, int64_t seq, int batch, int heads, int kv_heads,
                           float scale, float scale_log2) {
  if constexpr (kHasWgmma) {
    using C = Dkdv;
    constexpr int kS = C::kStages;
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[1 + 3 * kS];  // kv_full, then landed[], full[], empty[]
    const uint32_t base = align1024(shared_addr(smem));
    unsigned char* base_ptr = smem + (base - shared_addr(smem));
    const uint32_t kv_full = shared_addr(bars), landed = kv_full + 8, full = landed + 8 * kS,
                   empty = full + 8 * kS;
    if (threadIdx.x == 0) {
      mbar_init(kv_full, 1);
      init_step_ring<C>(landed, full, empty);
      mbar_init_fence();
    }
    __syncthreads();
    // The first key tiles see the most queries: the key tile is the slowest index, first first.
    const int bkv_count = batch * kv_heads;
    const int k_tile = static_cast<int>(blockIdx.x / bkv_count);
    const int bkv = static_cast<int>(blockIdx.x % bkv_count);
    const int b = bkv / kv_heads, kvh = bkv % kv_heads, group = heads / kv_heads;
    const int64_t k0 = int64_t(k_tile) * C::kBN;
    const int64_t q_tiles = (seq + C::kBM - 1) / C::kBM, first_tile = k0 / C::kBM;
    const int per_head = static_cast<int>(q_tiles - first_tile);
    const int steps = group * per_head;  // (query head, query tile) pairs, head-major
    // step it's first query (of its head)
    auto query0 = [&](int it) { return (first_tile + it % per_head) * C::kBM; };
    const int wg = static_cast<int>(threadIdx.x) / 128;
    if (wg == 0) {
      release_registers<C::kProducerRegs>();
      if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(kv_full, 2 * C::kKVBytes);
        tma_load_3d(base, &map_k, kv_full, kvh * kD, static_cast<int32_t>(k0), b);
        tma_load_3d(base + C::kKVBytes, &map_v, kv_full, kvh * kD, static_cast<int32_t>(k0), b);
        for (int it = 0; it < steps; ++it) {
          const int s = it % kS;
          if (it >= kS) mbar_wait(empty + 8 * s, ((it / kS) & 1) ^ 1u);
          load_step_tiles<C>(base + C::kRing0 + s * C::kStageBytes, landed + 8 * s, &map_q, &map_do,
                             &map_o, kvh * group + it / per_head, static_cast<int32_t>(query0(it)),
                             b);
        }
      } else if (threadIdx.x >= 64) {
        // lse and D = <dO_i, O_i> of each step's 64 queries, one row per thread (helper_step).
        const int r = static_cast<int>(threadIdx.x) - 64;
        for (int it = 0; it < steps; ++it) {
          const int s = it % kS;
          const int h = kvh * group + it / per_head;
          helper_step<C, T>(base_ptr + C::kRing0 + s * C::kStageBytes, landed + 8 * s, full + 8 * s,
                            (it / kS) & 1, r, lse + (int64_t(b) * heads + h) * seq, query0(it),
                            seq);
        }
      }
      return;
    }
    claim_registers<C::kMathRegs>();
    const int g = wg - 1, lane = static_cast<int>(threadIdx.x) % 32, t4 = lane & 3;
    const int warp = (static_cast<int>(threadIdx.x) % 128) / 32;
    const int64_t wg_key = k0 + g * kWgRows;            // the warpgroup's first key
    const int64_t key = wg_key + warp * 16 + lane / 4;  // this thread's keys: key and key + 8
    const bool signals = lane == 0;
    const uint32_t k_rows = base + g * kWgBytes, v_rows = base + C::kKVBytes + g * kWgBytes;
    const uint64_t k_desc = kmajor_desc(k_rows), v_desc = kmajor_desc(v_rows);
    float dka[32], dva[32], s[32], dp[32];
    zero(dka);
    zero(dva);
    // P^T and dS^T of the previous step, rounded: the A operands of dV += P^T dO, dK += dS^T Q
    uint32_t pa[C::kBM / 16][4], dsa[C::kBM / 16][4];
    auto q_tile = [&](int st) { return base + C::kRing0 + st * C::kStageBytes; };
    // The step in stage st: its products (dkdv_scores, dkdv_accumulate) and elementwise part.
    auto scores = [&](int st) { dkdv_scores<T, C>(s, dp, k_desc, v_desc, q_tile(st)); };
    auto grads = [&](int it, int st) {
      dkdv_grads<C>(s, dp, base_ptr + C::kRing0 + st * C::kStageBytes, query0(it), wg_key, key, seq,
                    t4, scale_log2);
    };
    auto accumulate = [&](int st) { dkdv_accumulate<T, C>(dva, dka, pa, dsa, q_tile(st)); };
    mbar_wait(kv_full, 0);
    {                        // step 0
      mbar_wait(landed, 0);  // the helpers' arrivals follow the TMA's; this keeps it explicit
      mbar_wait(full, 0);
      wgmma_fence();
      scores(0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(s);
      fence_accumulators(dp);
      grads(0, 0);
      pack_a<T, C::kBM>(pa, s);
      pack_a<T, C::kBM>(dsa, dp);
    }
    // Step it: S^T and dP^T, then the previous step's dV and dK products right behind them,
    // which run while the elementwise part of step it does (as the forward's P V); the previous
    // step's stage is freed after them.
    for (int it = 1; it < steps; ++it) {
      const int st = it % kS, prev = (it - 1) % kS;
      mbar_wait(landed + 8 * st, (it / kS) & 1);
      mbar_wait(full + 8 * st, (it / kS) & 1);
      wgmma_fence();
      scores(st);
      wgmma_commit();
      accumulate(prev);
      wgmma_commit();
      wgmma_wait<1>();  // S^T and dP^T have retired
      fence_accumulators(s);
      fence_accumulators(dp);
      grads(it, st);
      wgmma_wait<0>();
      fence_accumulators(dka);
      fence_accumulators(dva);
      fence_fragments(pa);
      fence_fragments(dsa);
      if (signals) mbar_arrive(empty + 8 * prev);
      pack_a<T, C::kBM>(pa, s);
      pack_a<T, C::kBM>(dsa, dp);
    }
    {  // the last step's dV and dK products
      const int last = (steps - 1) % kS;
      wgmma_fence();
      accumulate(last);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(dka);
      fence_accumulators(dva);
      fence_fragments(pa);
      fence_fragments(dsa);
      if (signals) mbar_arrive(empty + 8 * last);
    }
    store_dk_dv<T>(dka, dva, k_rows, v_rows, dk, dv, b, seq, wg_key, kv_heads, kvh, scale, g);
  }
}

// ---- host side ---------------------------------------------------------------------------------

template <class T>
void launch_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                    const void* v, const AttentionShape& s) {
  using C = Fwd;
  auto kernel = flash_forward_sm90_kernel<T>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, C::kSmem); });
  const CUtensorMap mq = head_rows_map(t, q, s, s.heads, C::kBM);
  const CUtensorMap mk = head_rows_map(t, k, s, s.kv_heads, C::kBN);
  const CUtensorMap mv = head_rows_map(t, v, s, s.kv_heads, C::kBN);
  const int q_tiles = static_cast<int>(blocks_for(s.seq, C::kBM));
  const unsigned grid = static_cast<unsigned>(int64_t(q_tiles) * s.batch * s.heads);
  kernel<<<grid, kThreads, C::kSmem, stream_of(ctx)>>>(
      mq, mk, mv, static_cast<T*>(out), lse, s.seq, static_cast<int>(s.batch),
      static_cast<int>(s.heads), static_cast<int>(s.kv_heads), q_tiles,
      static_cast<float>(kScale * 1.4426950408889634));
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T>
void launch_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                     const void* q, const void* k, const void* v, const void* out, const float* lse,
                     const AttentionShape& s) {
  static std::once_flag once;
  std::call_once(once, [] {
    allow_dynamic_smem(flash_dq_sm90_kernel<T>, Dq::kSmem);
    allow_dynamic_smem(flash_dkdv_sm90_kernel<T>, Dkdv::kSmem);
  });
  const auto scale = static_cast<float>(kScale);
  const auto scale_log2 = static_cast<float>(kScale * 1.4426950408889634);
  {
    const CUtensorMap mq = head_rows_map(t, q, s, s.heads, Dq::kBM);
    const CUtensorMap mdo = head_rows_map(t, dout, s, s.heads, Dq::kBM);
    const CUtensorMap mk = head_rows_map(t, k, s, s.kv_heads, Dq::kBN);
    const CUtensorMap mv = head_rows_map(t, v, s, s.kv_heads, Dq::kBN);
    const int q_tiles = static_cast<int>(blocks_for(s.seq, Dq::kBM));
    const unsigned grid = static_cast<unsigned>(int64_t(q_tiles) * s.batch * s.heads);
    flash_dq_sm90_kernel<T><<<grid, kThreads, Dq::kSmem, stream_of(ctx)>>>(
        mq, mdo, mk, mv, static_cast<T*>(dq), static_cast<const T*>(dout),
        static_cast<const T*>(out), lse, s.seq, static_cast<int>(s.batch),
        static_cast<int>(s.heads), static_cast<int>(s.kv_heads), q_tiles, scale, scale_log2);
    MOE_CUDA_LAUNCH_CHECK();
  }
  {
    const DkdvMaps m = dkdv_maps(t, q, dout, k, v, out, s);
    const int64_t k_tiles = blocks_for(s.seq, Dkdv::kBN);
    const unsigned grid = static_cast<unsigned>(k_tiles * s.batch * s.kv_heads);
    flash_dkdv_sm90_kernel<T><<<grid, kThreads, Dkdv::kSmem, stream_of(ctx)>>>(
        m.q, m.dout, m.k, m.v, m.out, static_cast<T*>(dk), static_cast<T*>(dv), lse, s.seq,
        static_cast<int>(s.batch), static_cast<int>(s.heads), static_cast<int>(s.kv_heads), scale,
        scale_log2);
    MOE_CUDA_LAUNCH_CHECK();
  }
}

// Whether the code the device runs for T's kernels is the sm_90a code (see the top comment).
template <class T>
bool compiled_for_sm90a() {
#ifdef MOE_WITH_SM90A
  auto is90 = [](int v) { return v >= 90 && v < 100; };
  return is90(compiled_arch(flash_forward_sm90_kernel<T>)) &&
         is90(compiled_arch(flash_dq_sm90_kernel<T>)) &&
         is90(compiled_arch(flash_dkdv_sm90_kernel<T>));
#else
  return false;
#endif
}

bool sm90_available(DType t) {
  // Decided once per process for the current device (the trainer uses one device per process).
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    int dev = 0, major = 0, minor = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0) return;
    half_ok = compiled_for_sm90a<__half>();
    bf16_ok = compiled_for_sm90a<__nv_bfloat16>();
  });
  return t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
}

// MOE_ATTENTION_SM90 (read at every call): "0" declines both directions (the sm_80 kernels
// run); unset or anything else takes both. On the H200 these are the faster kernels in both
// directions (B x T x H x hd = 16 x 1024 x 16 x 64: forward 136 against 245 us, backward 475
// against 684; 4 x 4096 x 16 x 64: 347 against 879 and 1241 against 2318; docs/perf.md).
bool enabled() {
  return env_switch("MOE_ATTENTION_SM90", true);
}

// Whether the backward runs as one kernel (attention_sm90_fused_backward.cu) where the caller
// gives the dq scratch. MOE_ATTENTION_FUSED_BWD (read at every call): "0" never, "1" always;
// unset or anything else: where its grid, one block per (batch, kv head) chain, fills the SMs'
// waves to at least 3/4 (a chain runs ~1.15x the dk/dv kernel's share of the work and saves the
// dq kernel's ~0.66x: below that fill the two kernels, whose many short blocks balance, win).
bool use_fused(const AttentionShape& s) {
  static std::once_flag once;
  static bool compiled = false;
  std::call_once(once, [] { compiled = fused_backward_compiled_for_sm90a(); });
  if (!compiled) return false;
  if (!env_switch("MOE_ATTENTION_FUSED_BWD", true)) return false;
  if (env_switch("MOE_ATTENTION_FUSED_BWD", false)) return true;
  const int64_t chains = s.batch * s.kv_heads, sms = device_sm_count();
  const int64_t waves = (chains + sms - 1) / sms;
  return 4 * chains >= 3 * waves * sms;
}

// The shapes the kernels index with 32-bit block and TMA coordinates.
bool shape_fits(const AttentionShape& s) {
  const int64_t limit = int64_t(1) << 31;
  return s.seq < limit && s.batch * s.heads < limit &&
         (s.seq + 63) / 64 * s.batch * s.heads < limit && s.heads % s.kv_heads == 0;
}

// Whether the sm_90 kernels take dtype t and shape s here (alignment aside).
bool runs_here(DType t, const AttentionShape& s) {
  return enabled() && sm90_available(t) && shape_fits(s);
}

}  // namespace

bool attention_sm90_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                            const void* v, const AttentionShape& s) {
  if (!runs_here(t, s) || !aligned16({out, q, k, v})) return false;
  if (t == DType::f16)
    launch_forward<__half>(ctx, t, out, lse, q, k, v, s);
  else
    launch_forward<__nv_bfloat16>(ctx, t, out, lse, q, k, v, s);
  return true;
}

bool attention_sm90_backward_sums_dq(DType t, const AttentionShape& s) {
  return runs_here(t, s) && use_fused(s);
}

bool attention_sm90_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                             const void* q, const void* k, const void* v, const void* out,
                             const float* lse, float* dq_acc, const AttentionShape& s) {
  if (!runs_here(t, s) || !aligned16({dq, dk, dv, dout, q, k, v, out})) return false;
  if (dq_acc != nullptr && aligned16({dq_acc}) && use_fused(s)) {
    launch_fused_backward(ctx, t, dq, dk, dv, dq_acc, dout, q, k, v, out, lse, s);
    return true;
  }
  if (t == DType::f16)
    launch_backward<__half>(ctx, t, dq, dk, dv, dout, q, k, v, out, lse, s);
  else
    launch_backward<__nv_bfloat16>(ctx, t, dq, dk, dv, dout, q, k, v, out, lse, s);
  return true;
}

namespace flash90 {

// A tensor map over a [B, T, n_heads, 64] 16-bit tensor seen as [B][T][n_heads * 64] (innermost
// first: n_heads * 64, T, B): boxes of one head's 64 elements x `rows` positions x 1 sequence,
// stored in the 128-byte swizzle; positions past T are zero-filled, never the next sequence's.
CUtensorMap head_rows_map(DType t, const void* p, const AttentionShape& s, int64_t n_heads,
                          uint32_t rows) {
  CUtensorMap map{};
  const uint64_t dims[3] = {uint64_t(n_heads * kD), uint64_t(s.seq), uint64_t(s.batch)};
  const uint64_t strides[2] = {uint64_t(n_heads * kD * 2), uint64_t(s.seq * n_heads * kD * 2)};
  const uint32_t box[3] = {uint32_t(kD), rows, 1};
  const uint32_t ones[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, t == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      3, const_cast<void*>(p), dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw InternalError("cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) +
                        ") for an attention operand");
  return map;
}

DkdvMaps dkdv_maps(DType t, const void* q, const void* dout, const void* k, const void* v,
                   const void* out, const AttentionShape& s) {
  using C = DkdvGeometry;
  return {head_rows_map(t, q, s, s.heads, C::kBM), head_rows_map(t, dout, s, s.heads, C::kBM),
          head_rows_map(t, k, s, s.kv_heads, C::kBN), head_rows_map(t, v, s, s.kv_heads, C::kBN),
          head_rows_map(t, out, s, s.heads, C::kBM)};
}

}  // namespace flash90
}  // namespace moe::cuda_detail
