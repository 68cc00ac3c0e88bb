// The routers in one launch each: router_forward (the MoE gate's logits, softmax, top-K,
// renormalisation and counts) and mod_route (the MoD router's scores and the per-sequence top-C
// selection). Each reads the 16-bit residual stream x once, so it is bound by that read (32 MiB
// for a 16K-token micro-batch at d = 1024), where the two-op paths read x in one launch and then
// the logits or scores again in a second, latency-bound one (a few microseconds of a pass over
// [N, 8] values, ~5 % of the copy rate).
//
// The gate product on tensor cores. An FMA loop over x's rows (router_logits.cu) has to read every
// W value it multiplies from shared memory: at E = 8 those reads, not DRAM, bound it (41 % of the
// copy rate). Here mma.sync m16n8k8 in tf32 takes 16 rows x 8 experts per instruction, W stays in
// registers and L1, and the product is exact where it matters: 16-bit x values are exact in tf32
// (bf16: 8 significant bits, f16: 11), and w = hi + mid + lo splits each fp32 weight exactly into
// three tf32 parts (the top 11 significant bits by truncation, the next 11 of the remainder, and
// the at most 2 left), so every product of the three mma per k-step is exact in fp32 and only the
// order of the fp32 sums differs from router_logits_forward's.
// - A block of 4 warps takes 32 rows (two m16 tiles); warp w takes the k-blocks of 32 columns w,
//   w + 4, ...; each lane reads one 16-byte chunk (8 columns) of each of its 4 rows per k-block,
//   kBatch k-blocks at a time (8 loads a lane), the next batch's loads issued before this one's
//   products (so DRAM stays busy through the math), whose 8 values feed four mma k-steps:
//   a thread's A-fragment columns t and t + 4 of step s are its chunk's values 2s and 2s + 1, and
//   its B fragment (expert g, the same k rows) is w[g] at the same 8 columns, so any permutation
//   of k within a k-block pairs A and B alike. Rows of a multiple of 8 elements, 16-byte aligned.
// - The hi part and the two small parts sum into accumulators of their own (shorter chains of
//   dependent mma), added at the end; the four warps' partial sums go through shared memory and are
//   added in warp order: every logit's summation order depends on d alone, not on the grid or the
//   device.
// - router_forward: lane r of warp 0 then holds row r's E <= 8 logits, writes them and routes the
//   token itself (TokenRouter of router_rows.cuh with one lane per token: the code and layout of
//   router_topk_forward for E <= 8, so the routing is bitwise that op's on these logits); the
//   counts go through a per-block histogram and the last block's ticket (finish_counts).
// - mod_route: lane r writes row r's score; a per-sequence ticket counts the rows written, and the
//   block that writes a sequence's last rows selects it (select_sequence of mod_select.cuh, the
//   code of mod_select), from a copy of the scores staged in shared memory through L2 behind a
//   fence (up to T = 4096; read through L2 beyond). The selections of the sequences finished
//   last are the kernel's tail.
// - router_logits_forward at the same shape (E <= 8, through router_paths.hpp): the product alone,
//   lane r of warp 0 writing row r's logits (gate_logits_kernel): router_forward's logits bitwise.
// Measured on the H200 (docs/perf.md, 19th and 20th sessions; bench rows router, mod_select and
// router_logits, moe-small): router_forward 14.2 us against 21.6 + 6.7 for the two ops, mod_route
// 17.7 us, router_logits_forward 9.9-10.0 us against 21.9 for router_logits.cu's FMA kernel.
// Asking L2 for a block's whole rows first (prefetch.global.L2) made them slower (16.4 / 12.2 us).
// The tickets and the count accumulator are device globals, zero between launches (the last user
// resets them): calls on two streams of one device at once are not supported (as router.cu's
// scratch). Elsewhere (no sm_80 code, other dtypes or shapes) each op runs its two ops in turn.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "common/mod_checks.hpp"
#include "common/router_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/mod_select.cuh"
#include "cuda/router_paths.hpp"
#include "cuda/router_rows.cuh"
#include "moe/env_switch.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/router.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kGateWarps = 4;  // warps of a block: each sums a quarter of the k-blocks
constexpr int kGateThreads = kGateWarps * kWarp;
constexpr int kTiles = 2;                   // m16 row tiles of a block
constexpr int kBlockRows = 16 * kTiles;     // rows of a block: one per lane of warp 0
[[maybe_unused]] constexpr int kBatch = 2;  // k-blocks of 32 columns a lane loads at once
constexpr int kMaxExperts = 8;              // one n8 tile
constexpr int kMaxSequences = 8192;         // mod_route's per-sequence tickets
constexpr int kBlocksPerSm = 4;             // the launch bounds' occupancy (128 registers)
constexpr int kMaxStagedScores = 4096;      // mod_route: a sequence's scores in shared memory
static_assert(kBlockRows <= kWarp, "a block's rows are routed by the lanes of warp 0");
static_assert(kMaxExperts == kLaneValues,
              "a routing lane holds its token's logits as TokenRouter's values");

__device__ int g_router_ticket;
__device__ int32_t g_router_counts[kMaxExperts];
__device__ int g_mod_tickets[kMaxSequences];

// ---- the gate product ---------------------------------------------------------------------------

// The tf32 bit pattern of v's leading 11 significant bits (truncated: exact in tf32).
__device__ __forceinline__ uint32_t tf32_top(float v) {
  return __float_as_uint(v) & 0xffffe000u;
}

// w = hi + mid + lo exactly, each part exact in tf32 (see the top comment).
[[maybe_unused]] __device__ __forceinline__ void split_tf32(float w, uint32_t& hi, uint32_t& mid,
                                                            uint32_t& lo) {
  hi = tf32_top(w);
  const float r = w - __uint_as_float(hi);  // the low 13 bits of w's significand: exact
  mid = tf32_top(r);
  lo = __float_as_uint(r - __uint_as_float(mid));  // at most 2 significant bits: exact
}

// The logits x[row0 + r, :] w^T of the block's rows: lane r of warp 0 gets row r's (experts past
// n_exp: 0). Every thread of the block calls it (it ends with a barrier).
template <class T>
__device__ void gate_rows(float (&logit)[kMaxExperts], const T* __restrict__ x,
                          const float* __restrict__ w, int64_t row0, int64_t n_tok, int64_t d,
                          int n_exp) {
  __shared__ float part[kGateWarps][kBlockRows][kMaxExperts + 1];  // +1: no bank conflicts
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, t4 = lane % 4;  // the mma fragments' group and thread in group
  const int64_t chunks = d / 8, kblocks = (chunks + 3) / 4;
  // Rows 16 i + 8 h + g of the block (null past N) and expert g's weights (null past E).
  const T* rows[kTiles][2];
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = row0 + 16 * i + 8 * h + g;
      rows[i][h] = n < n_tok ? x + n * d : nullptr;
    }
  const float* wg = g < n_exp ? w + int64_t(g) * d : nullptr;
  // Two accumulators a tile (the hi part's, the mid and lo parts'): shorter chains of dependent
  // mma than one (a third accumulator spills at the 128 registers of 4 blocks an SM).
  float c[2][kTiles][4];
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) c[p][i][j] = 0.0f;
  // The batch of k-blocks from kb0 on (zeros past d and past N).
  auto load_batch = [&](Vec16<T>(&xc)[kBatch][kTiles][2], int64_t kb0) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t q = (kb0 + b * kGateWarps) * 4 + t4;
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          xc[b][i][h] = zero_chunk<T>();
          if (rows[i][h] && q < chunks)  // read-only path (ld.global.nc)
            *reinterpret_cast<uint4*>(&xc[b][i][h]) =
                __ldg(reinterpret_cast<const uint4*>(rows[i][h] + q * 8));
        }
    }
  };
  // Software pipeline: the next batch's loads are issued before this one's products, so the
  // block keeps DRAM busy through its math (with one batch at a time, the blocks of a wave loaded
  // and computed in lockstep and DRAM idled through every compute phase).
  constexpr int64_t kStep = int64_t(kGateWarps) * kBatch;
  Vec16<T> cur[kBatch][kTiles][2], nxt[kBatch][kTiles][2];
  if (warp < kblocks) load_batch(cur, warp);
  for (int64_t kb0 = warp; kb0 < kblocks; kb0 += kStep) {
    if (kb0 + kStep < kblocks) load_batch(nxt, kb0 + kStep);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t q = (kb0 + b * kGateWarps) * 4 + t4;
      if (kb0 + b * kGateWarps >= kblocks) break;  // the same for the whole warp
      float wv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (wg && q < chunks) {
        const float4 lo4 = __ldg(reinterpret_cast<const float4*>(wg + q * 8));
        const float4 hi4 = __ldg(reinterpret_cast<const float4*>(wg + q * 8 + 4));
        wv[0] = lo4.x, wv[1] = lo4.y, wv[2] = lo4.z, wv[3] = lo4.w;
        wv[4] = hi4.x, wv[5] = hi4.y, wv[6] = hi4.z, wv[7] = hi4.w;
      }
      uint32_t wp[3][8];
#pragma unroll
      for (int j = 0; j < 8; ++j) split_tf32(wv[j], wp[0][j], wp[1][j], wp[2][j]);
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        float top[8], bottom[8];  // rows g and g + 8 of the tile, exact in tf32
        widen_chunk(cur[b][i][0], top);
        widen_chunk(cur[b][i][1], bottom);
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int p = 0; p < 3; ++p)
            mma_tf32(c[p == 0 ? 0 : 1][i], __float_as_uint(top[2 * s]),
                     __float_as_uint(bottom[2 * s]), __float_as_uint(top[2 * s + 1]),
                     __float_as_uint(bottom[2 * s + 1]), wp[p][2 * s], wp[p][2 * s + 1]);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) cur[b][i][h] = nxt[b][i][h];
  }
  // c[p][i]: rows 16 i + g (0, 1) and 16 i + g + 8 (2, 3), experts 2 t4 and 2 t4 + 1; the small
  // parts' sum added to the hi part's.
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    float s[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = c[1][i][j] + c[0][i][j];
    part[warp][16 * i + g][2 * t4] = s[0];
    part[warp][16 * i + g][2 * t4 + 1] = s[1];
    part[warp][16 * i + g + 8][2 * t4] = s[2];
    part[warp][16 * i + g + 8][2 * t4 + 1] = s[3];
  }
  __syncthreads();
  if (warp == 0 && lane < kBlockRows)
#pragma unroll
    for (int e = 0; e < kMaxExperts; ++e) {
      float s = part[0][lane][e];
#pragma unroll
      for (int v = 1; v < kGateWarps; ++v) s += part[v][lane][e];
      logit[e] = s;
    }
}

// A token's E <= 8 logits into its row l; vec: E = 4 or 8 and the row 16-byte aligned.
__device__ __forceinline__ void store_logits(float* l, const float (&lg)[kMaxExperts], int n_exp,
                                             bool vec) {
  if (vec) {
#pragma unroll
    for (int e = 0; e < kMaxExperts; e += 4)
      if (e < n_exp)
        *reinterpret_cast<float4*>(l + e) = make_float4(lg[e], lg[e + 1], lg[e + 2], lg[e + 3]);
  } else {
#pragma unroll
    for (int e = 0; e < kMaxExperts; ++e)
      if (e < n_exp) l[e] = lg[e];
  }
}

// ---- router_forward -----------------------------------------------------------------------------

template <class T, bool kPacked>
__global__ void __launch_bounds__(kGateThreads, kBlocksPerSm)
    router_forward_kernel(float* __restrict__ logits, float* __restrict__ probs,
                          int32_t* __restrict__ idx, float* __restrict__ topk_w,
                          int32_t* __restrict__ counts, const T* __restrict__ x,
                          const float* __restrict__ w, const float* __restrict__ bias,
                          int64_t n_tok, int64_t d, int n_exp, int k, bool norm_topk_prob,
                          RowLayout lay) {
  if constexpr (kHasSm80) {
    __shared__ int32_t hist[kMaxExperts];
    if (threadIdx.x < kMaxExperts) hist[threadIdx.x] = 0;  // read after gate_rows' barrier
    const int64_t row0 = int64_t(blockIdx.x) * kBlockRows;
    float lg[kMaxExperts];
    gate_rows<T>(lg, x, w, row0, n_tok, d, n_exp);
    if (threadIdx.x < kBlockRows) {
      const int64_t n = row0 + threadIdx.x;
      const bool valid = n < n_tok;
      const int64_t row_n = valid ? n : 0;
      float* l = logits + row_n * n_exp;
      if (valid) store_logits(l, lg, n_exp, lay.vec);
      // One lane per token (E <= 8): the group butterflies are empty, so lanes route on their own.
      const TokenRouter<float, kPacked> router(probs, idx, topk_w, hist, bias, n_exp, k,
                                               norm_topk_prob, lay);
      router.route(lg, l, row_n, valid);
    }
    const RouterScratch scratch{&g_router_ticket, nullptr, g_router_counts};
    finish_counts(counts, hist, true, scratch, n_exp);
  }
}

// ---- router_logits_forward (E <= 8) -------------------------------------------------------------

// The product alone (router_logits_forward's path for the gate's shape): the logits router_forward
// writes, bitwise. kLetDependent: its blocks let a programmatic dependent launch at once
// (mod_route's PDL path: the selection's blocks wait resident for this grid's end).
template <class T, bool kLetDependent = false>
__global__ void __launch_bounds__(kGateThreads, kBlocksPerSm)
    gate_logits_kernel(float* __restrict__ logits, const T* __restrict__ x,
                       const float* __restrict__ w, int64_t n_tok, int64_t d, int n_exp, bool vec) {
  if constexpr (kLetDependent) allow_dependent_launch();
  if constexpr (kHasSm80) {
    const int64_t row0 = int64_t(blockIdx.x) * kBlockRows;
    float lg[kMaxExperts];
    gate_rows<T>(lg, x, w, row0, n_tok, d, n_exp);
    const int64_t n = row0 + threadIdx.x;
    if (threadIdx.x < kBlockRows && n < n_tok) store_logits(logits + n * n_exp, lg, n_exp, vec);
  }
}

// ---- mod_route ----------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kGateThreads, kBlocksPerSm)
    mod_route_kernel(float* __restrict__ scores, int32_t* __restrict__ sel,
                     float* __restrict__ mask, const T* __restrict__ x, const float* __restrict__ w,
                     int64_t n_tok, int64_t d, int t, int c) {
  if constexpr (kHasSm80) {
    __shared__ int done[kBlockRows];  // sequences whose last rows this block wrote
    __shared__ int n_done;
    const int64_t row0 = int64_t(blockIdx.x) * kBlockRows;
    float lg[kMaxExperts];
    gate_rows<T>(lg, x, w, row0, n_tok, d, 1);
    if (threadIdx.x < kBlockRows && row0 + threadIdx.x < n_tok) scores[row0 + threadIdx.x] = lg[0];
    __syncthreads();  // the scores happen before thread 0's release (block_ticket_add)
    if (threadIdx.x == 0) {
      int m = 0;
      const int64_t end = min(row0 + kBlockRows, n_tok);
      for (int64_t r = row0; r < end;) {
        const int64_t b = r / t, seq_end = min((b + 1) * t, end);
        const int rows = static_cast<int>(seq_end - r);
        if (block_ticket_add(&g_mod_tickets[b], rows) + rows == t) done[m++] = static_cast<int>(b);
        r = seq_end;
      }
      n_done = m;
    }
    __syncthreads();
    __shared__ float staged[kMaxStagedScores];
    // (the other blocks' scores: acquired by thread 0's tickets, ordered by the barrier above)
    for (int i = 0; i < n_done; ++i) {
      const int64_t b = done[i];
      const float* r = scores + b * t;
      if (t <= kMaxStagedScores) {
        // The selection reads every score 2-4 times: stage them, with kStageLoads loads in
        // flight a thread (one after another, each would wait on L2 in turn).
        constexpr int kStageLoads = 8;
        for (int i0 = threadIdx.x; i0 < t; i0 += kStageLoads * kGateThreads) {
          float v[kStageLoads];
#pragma unroll
          for (int u = 0; u < kStageLoads; ++u)
            if (i0 + u * kGateThreads < t) v[u] = __ldcg(r + i0 + u * kGateThreads);
#pragma unroll
          for (int u = 0; u < kStageLoads; ++u)
            if (i0 + u * kGateThreads < t) staged[i0 + u * kGateThreads] = v[u];
        }
        __syncthreads();
        select_sequence<float, kGateThreads, false>(sel + b * c, mask + b * t, staged, t, c);
      } else {
        select_sequence<float, kGateThreads, true>(sel + b * c, mask + b * t, r, t, c);
      }
      __syncthreads();  // the selection's shared memory is free for the next sequence
      if (threadIdx.x == 0) g_mod_tickets[b] = 0;
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------

// Whether the one-launch path takes x [N, d] against n_exp gate rows w: device code for sm_80+,
// 16-bit x, whole 16-byte chunks per row and aligned rows.
template <class Kernel>
bool fused_path(Kernel kernel, const Tensor& x, const Tensor& w, int64_t n_exp) {
  static std::once_flag once;
  static bool has_mma = false;
  std::call_once(once, [&] { has_mma = compiled_arch(kernel) >= 80; });
  const int64_t d = x.size(1);
  return has_mma && (x.dtype == DType::bf16 || x.dtype == DType::f16) && n_exp >= 1 &&
         n_exp <= kMaxExperts && d > 0 && d % 8 == 0 && aligned16({x.data, w.data});
}

// On an sm_90 device: mod_route as the product and a selection kernel launched as its
// programmatic dependent (mod_select_after_scores): 1,024 threads a sequence once the product's
// grid is done instead of the 128-thread block that wrote a sequence's last score selecting it
// alone (17.3 against 17.8 us at moe-small's shape on an H100: docs/perf.md, 34th session).
// MOE_MOD_ROUTE_PDL=0 (read at every call) keeps the one launch, for comparison.
bool route_by_dependent_launch() {
  if (!env_switch("MOE_MOD_ROUTE_PDL", true)) return false;
  static const bool sm90 = [] {
    int dev = 0, major = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major >= 9;
  }();
  return sm90;
}

unsigned gate_grid(int64_t n_tok) {
  return static_cast<unsigned>((n_tok + kBlockRows - 1) / kBlockRows);
}

void router_forward(Ctx& ctx, Tensor logits, Tensor probs, Tensor topk_idx, Tensor topk_w,
                    Tensor counts, Tensor x, Tensor w, Tensor bias, bool norm_topk_prob) {
  const RouterLogitsDims s = check_router_logits_forward_args(logits, x, w, ctx.device);
  check_router_topk_forward_args(probs, topk_idx, topk_w, counts, logits, bias);
  const bool fused = fused_path(router_forward_kernel<__nv_bfloat16, true>, x, w, s.e) && s.n > 0 &&
                     s.n <= (int64_t(1) << 40);
  if (!fused) {
    ::moe::cuda::router_logits_forward(ctx, logits, x, w);
    ::moe::cuda::router_topk_forward(ctx, probs, topk_idx, topk_w, counts, logits, bias,
                                     norm_topk_prob);
    return;
  }
  // router_topk_forward's layout for E <= 8: one lane per token (see row_layout, router.cu).
  const bool contiguous = s.e % kVec<float> == 0;
  const RowLayout lay{1, 0, contiguous, contiguous && aligned16({logits.data, probs.data})};
  const int k = static_cast<int>(topk_idx.size(1));
  auto launch = [&](auto kernel, auto zero) {
    using T = decltype(zero);
    kernel<<<gate_grid(s.n), kGateThreads, 0, stream_of(ctx)>>>(
        data_of<float>(logits), data_of<float>(probs), data_of<int32_t>(topk_idx),
        data_of<float>(topk_w), data_of<int32_t>(counts), data_of<const T>(x),
        data_of<const float>(w), bias.empty() ? nullptr : data_of<const float>(bias), s.n, s.d,
        static_cast<int>(s.e), k, norm_topk_prob, lay);
    MOE_CUDA_LAUNCH_CHECK();
  };
  const bool packed = bias.empty();
  if (x.dtype == DType::bf16) {
    if (packed)
      launch(router_forward_kernel<__nv_bfloat16, true>, __nv_bfloat16{});
    else
      launch(router_forward_kernel<__nv_bfloat16, false>, __nv_bfloat16{});
  } else {
    if (packed)
      launch(router_forward_kernel<__half, true>, __half{});
    else
      launch(router_forward_kernel<__half, false>, __half{});
  }
}

void mod_route(Ctx& ctx, Tensor scores, Tensor sel, Tensor mask, Tensor x, Tensor w) {
  MOE_CHECK(scores.ndim == 2, "mod_route: scores must be [B, T], got " + scores.shape_str());
  const Tensor flat = scores.view({scores.numel(), 1});
  const RouterLogitsDims s = check_router_logits_forward_args(flat, x, w, ctx.device);
  check_mod_select_args(sel, mask, scores);
  const int64_t b = scores.size(0), t = scores.size(1), c = sel.size(1);
  const bool fused = fused_path(mod_route_kernel<__nv_bfloat16>, x, w, s.e) && s.e == 1 && b > 0 &&
                     t > 0 && b <= kMaxSequences && t <= INT32_MAX;
  if (!fused) {
    ::moe::cuda::router_logits_forward(ctx, flat, x, w);
    ::moe::cuda::mod_select(ctx, sel, mask, scores);
    return;
  }
  if (route_by_dependent_launch()) {
    // The product, then the selection with a 1,024-thread block per sequence launched as its
    // programmatic dependent: the same scores and selection bits as the one-launch kernel.
    auto product = [&](auto kernel, auto zero) {
      using T = decltype(zero);
      kernel<<<gate_grid(s.n), kGateThreads, 0, stream_of(ctx)>>>(
          data_of<float>(scores), data_of<const T>(x), data_of<const float>(w), s.n, s.d, 1, false);
      MOE_CUDA_LAUNCH_CHECK();
    };
    if (x.dtype == DType::bf16)
      product(gate_logits_kernel<__nv_bfloat16, true>, __nv_bfloat16{});
    else
      product(gate_logits_kernel<__half, true>, __half{});
    mod_select_after_scores(ctx, sel, mask, scores);
    return;
  }
  auto launch = [&](auto kernel, auto zero) {
    using T = decltype(zero);
    kernel<<<gate_grid(s.n), kGateThreads, 0, stream_of(ctx)>>>(
        data_of<float>(scores), data_of<int32_t>(sel), data_of<float>(mask), data_of<const T>(x),
        data_of<const float>(w), s.n, s.d, static_cast<int>(t), static_cast<int>(c));
    MOE_CUDA_LAUNCH_CHECK();
  };
  if (x.dtype == DType::bf16)
    launch(mod_route_kernel<__nv_bfloat16>, __nv_bfloat16{});
  else
    launch(mod_route_kernel<__half>, __half{});
}

}  // namespace

bool router_logits_forward_mma(Ctx& ctx, Tensor logits, Tensor x, Tensor w) {
  const int64_t n = x.size(0), e = w.size(0);
  if (!fused_path(gate_logits_kernel<__nv_bfloat16>, x, w, e) || n < 1 || n > (int64_t(1) << 40))
    return false;
  auto launch = [&](auto kernel, auto zero) {
    using T = decltype(zero);
    kernel<<<gate_grid(n), kGateThreads, 0, stream_of(ctx)>>>(
        data_of<float>(logits), data_of<const T>(x), data_of<const float>(w), n, x.size(1),
        static_cast<int>(e), e % kVec<float> == 0 && aligned16({logits.data}));
    MOE_CUDA_LAUNCH_CHECK();
  };
  if (x.dtype == DType::bf16)
    launch(gate_logits_kernel<__nv_bfloat16>, __nv_bfloat16{});
  else
    launch(gate_logits_kernel<__half>, __half{});
  return true;
}

}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(router_forward, &::moe::cuda_detail::router_forward);
MOE_REGISTER_CUDA_OP(mod_route, &::moe::cuda_detail::mod_route);
