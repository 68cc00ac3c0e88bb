// router_logits_backward in one pass over the rows, for the MoE gate's shape (16-bit x, E <= 8,
// d a multiple of 8 up to 2048): dx += dl w and dw += dl^T x together. The general kernels of
// router_logits.cu make two passes (dx, then dw) with W in shared memory and a lane layout built
// for any E; at E = 8 they reached 35 % of the copy rate (70 us for moe-small's 96 MiB: read x,
// read and write dx), held back by the shared-memory reads of W and by one chunk of a row in
// flight per lane. Here:
// - A thread owns one 16-byte chunk of columns (8 values) of every row its row lane visits: it
//   keeps W's 8 x 8 values for those columns and its 8 x 8 dw sums in registers (no shared memory
//   in the loop), and runs each row's dx chunk (sum over e in order, added to dx, rounded once, as
//   router_logits.cu's dx) and its dw products (fma into the sums, rows in order).
// - A block of 256 threads is 256 / C row lanes of C = d / 8 (rounded up to a power of two from
//   a warp) threads; each row lane takes a contiguous share of the block's rows, kBatch rows at a
//   time. Each thread copies its own x and dx chunks of a batch (and a warp its batch's dl values,
//   one a lane: row u, expert e for lane 8 u + e) by cp.async into a shared-memory ring of
//   kStages batches, kStages - 1 batches ahead of its math: 16 bytes x 2 x kBatch x 3 a thread in
//   flight (a thread reads back only what it copied; the warp barrier covers dl).
// Measured on the H200 (docs/perf.md; bench row router_logits_bwd, moe-small): 70.1 us for the
// two passes; 56.7-59.2 us with one batch in registers (20th session: Nsight Compute put it at
// DRAM 29 %, SM 42 %, 8 warps an SM, latency bound; L2 prefetches gained ~4 %, not kept); 44.2 us
// with the 4-stage ring (21st session): 35 -> 42 -> 55 % of the copy rate. The ring is sm_80+
// (cp.async): 132 KiB with dx at 4 stages, 2 stages where a block gets 99 KiB (sm_86 / sm_89);
// sm_75 takes router_logits.cu's kernels.
// - dw: the row lanes' sums are added in row-lane order through shared memory and each block
//   writes its partial [E, d] to a device scratch; add_column_partials (column_partials.cuh) adds
//   the partials to dw in a fixed order. The blocks' row ranges depend on N, d and E alone, so dw
//   is bitwise the same on every run and device (no atomics).
// Where it does not apply (other dtypes or shapes, dx aliasing x) router_logits.cu's kernels run.
// The scratch is one per device, used in stream order: calls on two streams at once would race
// on it and are not supported (as router_logits.cu's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "cuda/column_partials.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/router_paths.hpp"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxExperts = 8;        // W's and dw's rows a thread holds (8 x 8 registers each)
constexpr int kChunk = 8;             // values of a 16-bit chunk
constexpr int kBatch = 4;             // rows a row lane loads at once (dl: one value a lane)
constexpr int kMaxChunks = kThreads;  // d / 8: one chunk a thread in a row lane of 256
constexpr int64_t kMaxBlocks = 132;   // partials: about one block per H200 SM
constexpr int64_t kMinRows = 64;      // rows a block takes at least
constexpr size_t kScratchBytes = size_t(4) << 20;
static_assert(kBatch * kMaxExperts == kWarpLanes, "a batch's dl values are one per lane");

__device__ float g_router_rows_partials[kScratchBytes / sizeof(float)];
struct RowsPartials {  // for add_column_partials
  template <class A>
  __device__ static const A* get() {
    return reinterpret_cast<const A*>(g_router_rows_partials);
  }
};

// The shared-memory ring: kStages stages of kBatch rows, each thread's x and dx chunks at
// [stage][row][thread] (a thread reads back only what it copied: no barrier), and each warp's dl
// values at [stage][warp][lane] (lane 8 u + e: row u, expert e; read by every lane of the warp).
template <bool kDx>
constexpr int kTensors = kDx ? 2 : 1;  // x, and dx when there is one
template <bool kDx>
constexpr size_t stage_chunk_bytes() {
  return size_t(kBatch) * kThreads * kTensors<kDx> * 16;
}
constexpr size_t kStageDlBytes = size_t(kThreads / kWarpLanes) * kWarpLanes * sizeof(float);
// Row lanes' dw sums, added through shared memory after the loop (aliasing the ring).
constexpr size_t kReduceBytes = size_t(kMaxExperts) * kChunk * (kThreads / 2) * sizeof(float);
template <bool kDx>
constexpr size_t ring_bytes(int stages) {
  const size_t ring = stages * (stage_chunk_bytes<kDx>() + kStageDlBytes);
  return ring > kReduceBytes ? ring : kReduceBytes;
}

// grid: the row blocks, kThreads threads: kThreads / lanes row lanes of `lanes` threads; dynamic
// shared memory ring_bytes<kDx>(kStages). `direct`: one block, whose sums go straight into dw.
template <class T, bool kDx, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    router_backward_rows_kernel(T* dx, float* __restrict__ dw, const float* __restrict__ dl,
                                const T* __restrict__ x, const float* __restrict__ w, int64_t n_tok,
                                int64_t d, int n_exp, int lanes, bool direct) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* chunks = reinterpret_cast<uint4*>(smem);  // [stage][row][tensor][thread]
    float* dls = reinterpret_cast<float*>(smem + kStages * stage_chunk_bytes<kDx>());
    const int row_lanes = kThreads / lanes;
    const int h = threadIdx.x / lanes, j = threadIdx.x % lanes;
    const int lane = threadIdx.x % kWarpLanes, warp = threadIdx.x / kWarpLanes;
    const int64_t col = int64_t(j) * kChunk;
    const bool active = col < d;
    const int64_t blocks = gridDim.x, b = blockIdx.x;
    const int64_t rb = n_tok * b / blocks, re = n_tok * (b + 1) / blocks;
    const int64_t r_begin = rb + (re - rb) * h / row_lanes;
    const int64_t r_end = rb + (re - rb) * (h + 1) / row_lanes;
    // W's columns of this thread (zeros past E); the dw sums.
    float wr[kMaxExperts][kChunk], acc[kMaxExperts][kChunk];
#pragma unroll
    for (int e = 0; e < kMaxExperts; ++e) {
      float4 lo = make_float4(0, 0, 0, 0), hi = lo;
      if (kDx && active && e < n_exp) {
        lo = __ldg(reinterpret_cast<const float4*>(w + e * d + col));
        hi = __ldg(reinterpret_cast<const float4*>(w + e * d + col + 4));
      }
      wr[e][0] = lo.x, wr[e][1] = lo.y, wr[e][2] = lo.z, wr[e][3] = lo.w;
      wr[e][4] = hi.x, wr[e][5] = hi.y, wr[e][6] = hi.z, wr[e][7] = hi.w;
#pragma unroll
      for (int v = 0; v < kChunk; ++v) acc[e][v] = 0.0f;
    }
    auto chunk = [&](int stage, int u, int tensor) -> uint4* {
      return chunks + ((stage * kBatch + u) * kTensors<kDx> + tensor) * kThreads + threadIdx.x;
    };
    // Batch q's copies into its stage (zeros past the row lane's rows), then one commit: every
    // thread commits once per batch, so the group counts agree across the loop.
    const int64_t batches = (r_end - r_begin + kBatch - 1) / kBatch;
    auto issue = [&](int64_t q) {
      if (q < batches) {
        const int stage = static_cast<int>(q % kStages);
        const int64_t r0 = r_begin + q * kBatch;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int64_t r = r0 + u;
          const bool ok = active && r < r_end;
          cp_async16(chunk(stage, u, 0), ok ? x + r * d + col : x, ok);
          if constexpr (kDx) cp_async16(chunk(stage, u, 1), ok ? dx + r * d + col : x, ok);
        }
        const int64_t r = r0 + lane / kMaxExperts;
        const int e = lane % kMaxExperts;
        const bool ok = r < r_end && e < n_exp;
        cp_async4(dls + (stage * (kThreads / kWarpLanes) + warp) * kWarpLanes + lane,
                  ok ? dl + r * n_exp + e : dl, ok);
      }
      cp_async_commit();
    };
#pragma unroll
    for (int q = 0; q < kStages - 1; ++q) issue(q);
    // Every lane of a warp is in one row lane (lanes is a multiple of 32): the loop, its breaks
    // and the warp barriers are uniform over the warp.
    for (int64_t q = 0; q < batches; ++q) {
      issue(q + kStages - 1);
      cp_async_wait<kStages - 1>();  // batch q's copies (this thread's) are in
      __syncwarp();                  // and the warp's dl values, copied by its other lanes
      const int stage = static_cast<int>(q % kStages);
      const float* g_stage = dls + (stage * (kThreads / kWarpLanes) + warp) * kWarpLanes;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t r = r_begin + q * kBatch + u;
        if (r >= r_end) break;
        float g[kMaxExperts];
#pragma unroll
        for (int e = 0; e < kMaxExperts; ++e) g[e] = g_stage[u * kMaxExperts + e];
        Vec16<T> xc;
        *reinterpret_cast<uint4*>(&xc) = *chunk(stage, u, 0);
        float xv[kChunk];
        widen_chunk(xc, xv);
#pragma unroll
        for (int e = 0; e < kMaxExperts; ++e)
          if (e < n_exp)
#pragma unroll
            for (int v = 0; v < kChunk; ++v) acc[e][v] = fmaf(g[e], xv[v], acc[e][v]);
        if constexpr (kDx) {
          if (active) {
            float s[kChunk], old[kChunk];
#pragma unroll
            for (int v = 0; v < kChunk; ++v) s[v] = 0.0f;
#pragma unroll
            for (int e = 0; e < kMaxExperts; ++e)
              if (e < n_exp)
#pragma unroll
                for (int v = 0; v < kChunk; ++v) s[v] = fmaf(g[e], wr[e][v], s[v]);
            Vec16<T> dc, out;
            *reinterpret_cast<uint4*>(&dc) = *chunk(stage, u, 1);
            widen_chunk(dc, old);
#pragma unroll
            for (int v = 0; v < kChunk; ++v) out.v[v] = store<T>(old[v] + s[v]);
            store16(dx + r * d + col, out);
          }
        }
      }
      __syncwarp();  // the warp's reads of this stage's dl are done before it is refilled
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: the row lanes' sums go through it
    // The row lanes' sums, added in row-lane order by row lane 0.
    float* red = reinterpret_cast<float*>(smem);  // [e * 8 + v][j]
    for (int hh = 1; hh < row_lanes; ++hh) {
      if (h == hh)
#pragma unroll
        for (int e = 0; e < kMaxExperts; ++e)
#pragma unroll
          for (int v = 0; v < kChunk; ++v) red[(e * kChunk + v) * (kThreads / 2) + j] = acc[e][v];
      __syncthreads();
      if (h == 0)
#pragma unroll
        for (int e = 0; e < kMaxExperts; ++e)
#pragma unroll
          for (int v = 0; v < kChunk; ++v) acc[e][v] += red[(e * kChunk + v) * (kThreads / 2) + j];
      __syncthreads();
    }
    if (h != 0 || !active) return;
    float* out = direct ? dw : g_router_rows_partials + b * n_exp * d;
#pragma unroll
    for (int e = 0; e < kMaxExperts; ++e) {
      if (e >= n_exp) break;
      float4* p = reinterpret_cast<float4*>(out + e * d + col);
      float4 lo = make_float4(acc[e][0], acc[e][1], acc[e][2], acc[e][3]);
      float4 hi = make_float4(acc[e][4], acc[e][5], acc[e][6], acc[e][7]);
      if (direct) {
        const float4 a = p[0], c = p[1];
        lo = make_float4(a.x + lo.x, a.y + lo.y, a.z + lo.z, a.w + lo.w);
        hi = make_float4(c.x + hi.x, c.y + hi.y, c.z + hi.z, c.w + hi.w);
      }
      p[0] = lo;
      p[1] = hi;
    }
  }
}

// The ring's depth on this device: 4 stages where a block may take their shared memory (sm_80,
// sm_90: 132 KiB with dx), else 2 (sm_86 / sm_89: 99 KiB), else 0 (the general kernels run).
template <bool kDx>
int ring_stages() {
  static const int stages = [] {
    int dev = 0, optin = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    for (int s : {4, 2})
      if (ring_bytes<kDx>(s) <= static_cast<size_t>(optin)) return s;
    return 0;
  }();
  return stages;
}

template <class T, bool kDx, int kStages>
void launch_rows(cudaStream_t stream, int64_t blocks, Tensor dx, Tensor dw, Tensor dlogits,
                 Tensor x, Tensor w, int lanes, bool direct) {
  auto kernel = router_backward_rows_kernel<T, kDx, kStages>;
  const size_t smem = ring_bytes<kDx>(kStages);
  static std::once_flag once;  // one per instantiation
  std::call_once(once, [&] { allow_dynamic_smem(kernel, smem); });
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      kDx ? data_of<T>(dx) : nullptr, data_of<float>(dw), data_of<const float>(dlogits),
      data_of<const T>(x), data_of<const float>(w), x.size(0), x.size(1),
      static_cast<int>(w.size(0)), lanes, direct);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T, bool kDx>
void launch_rows(cudaStream_t stream, int stages, int64_t blocks, Tensor dx, Tensor dw,
                 Tensor dlogits, Tensor x, Tensor w, int lanes, bool direct) {
  if (stages == 4)
    launch_rows<T, kDx, 4>(stream, blocks, dx, dw, dlogits, x, w, lanes, direct);
  else
    launch_rows<T, kDx, 2>(stream, blocks, dx, dw, dlogits, x, w, lanes, direct);
}

}  // namespace

bool router_logits_backward_rows(Ctx& ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x,
                                 Tensor w) {
  static const bool has_cp_async =
      compiled_arch(router_backward_rows_kernel<__nv_bfloat16, true, 4>) >= 80;
  const int64_t n = x.size(0), d = x.size(1), e = w.size(0);
  const bool wants_dx = !dx.empty();
  if (!has_cp_async || !(x.dtype == DType::bf16 || x.dtype == DType::f16) || e < 1 ||
      e > kMaxExperts || n < 1 || d < kChunk || d % kChunk != 0 || d / kChunk > kMaxChunks)
    return false;
  if (!aligned16({x.data, w.data, dw.data, dlogits.data}) || (wants_dx && !aligned16({dx.data})) ||
      memory_overlaps(dx, x))
    return false;
  const int stages = wants_dx ? ring_stages<true>() : ring_stages<false>();
  if (stages == 0) return false;
  // Row lanes of a power of two from 32 threads dividing 256: 32, 64, 128 or 256.
  int lanes = kWarpLanes;
  while (lanes < d / kChunk) lanes *= 2;
  // Row blocks from N, d and E alone (dw's summation order).
  int64_t blocks = std::min(kMaxBlocks, std::max<int64_t>(1, n / kMinRows));
  blocks = std::min<int64_t>(blocks, static_cast<int64_t>(kScratchBytes / sizeof(float)) / (e * d));
  if (blocks < 1) return false;
  const bool direct = blocks == 1;
  cudaStream_t stream = stream_of(ctx);
  auto launch = [&](auto zero) {
    using T = decltype(zero);
    if (wants_dx)
      launch_rows<T, true>(stream, stages, blocks, dx, dw, dlogits, x, w, lanes, direct);
    else
      launch_rows<T, false>(stream, stages, blocks, dx, dw, dlogits, x, w, lanes, direct);
  };
  if (x.dtype == DType::bf16)
    launch(__nv_bfloat16{});
  else
    launch(__half{});
  if (!direct) add_column_partials<float, RowsPartials>(stream, data_of<float>(dw), blocks, e * d);
  return true;
}

}  // namespace moe::cuda_detail
