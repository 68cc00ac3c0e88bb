// Token permutation for dropless MoE on CUDA: the plan (a stable counting sort of the N*K routed
// slots by expert, computed on the device with no host sync), the gather that builds the permuted
// activations and its backward (also the MoE combine: the routing weights are applied in the
// experts' SwiGLU), and the routing weights put into row order. Semantics follow
// kernels/cpu/permute.cpp exactly; the plan equals the CPU plan bitwise.
//
// Plan: four launches on the op's stream, O(N*K) work spread over the grid, no atomics and no
// scratch. The slots are cut into T contiguous tiles, one warp each (T <= N*K / E, so the [T, E]
// table of per-tile counts fits in row_token, which is written last).
//   1. count: each warp counts its tile's slots per expert (__match_any_sync groups the lanes of
//      one expert; the group's first lane adds the group's size to a shared-memory counter);
//   2. scan: one warp per expert turns its column of the table into the exclusive prefix over
//      tiles and writes the expert's total to offsets[e+1];
//   3. place: each warp starts expert e's cursor at (rows of experts < e) + (rows of e in earlier
//      tiles) and walks its tile 32 slots at a time: a slot's row is the cursor plus its rank
//      among the same-expert lanes before it. Tiles in slot order, lanes in slot order: stable;
//   4. finish: row_token[slot_row[s]] = s / K, and offsets becomes the inclusive prefix.
// Row kernels: a group of kGroup = 8 lanes owns one output row (four rows per warp) and moves it
// in 16-byte accesses (8 x 16-bit) when d allows and every pointer is 16-byte aligned, element by
// element otherwise; each lane keeps kUnroll accesses per source row in flight. Sums accumulate in
// fp32 registers (double for f64) over k = 0..K-1 in that order and are gathers (no atomics), so
// every result is the same on every run.
// Measured on an H200 (bf16, 16384 tokens, d = 1024, E = 64, K = 8; copy 4.05 TB/s): plan 26 us,
// permute forward 107-114 us (x stays mostly in L2), permute backward 82 us: about 90% of copy
// bandwidth over the bytes that must move.
// The routing weights (topk_w, row_w) and their gradients are f32 / f64 (acc_dtype: the router's
// fp32 weights with 16-bit activations), so a weight is never rounded to 16 bits.
// Indices cannot be validated on the device without a host read: a gather whose index is out of
// range writes NaN (loud, no out-of-bounds access); the plan gives slots of out-of-range experts
// slot_row = -1 and no row.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/permute_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "moe/ops/permute.hpp"

namespace moe::cuda_detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;

// ---- plan ---------------------------------------------------------------------------------------

constexpr int kPlanWarps = 4;        // tiles per block of the count and place kernels
constexpr int64_t kTileSlots = 256;  // slots per tile when the table allows: T ~ N*K / 256 warps
constexpr int kScanWarps = 8;        // experts per block of the tile scan
constexpr int kFinishThreads = 256;
constexpr int64_t kSmemBytes = 48 * 1024;  // default dynamic shared memory limit
// One warp's counters (E ints) must fit in shared memory.
constexpr int64_t kMaxPlanExperts = kSmemBytes / sizeof(int);

// Exclusive prefix over the warp's lanes of v (lane order); *total gets the sum of all lanes.
__device__ __forceinline__ int warp_exclusive_scan(int v, int lane, int* total) {
  int incl = v;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int up = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += up;
  }
  *total = __shfl_sync(kFullMask, incl, kWarp - 1);
  return incl - v;
}

// Lane `lane`'s contiguous run [e0, e1) of the n_exp experts (lane order is expert order), and
// `run`: the sum of totals over the experts before e0, i.e. the warp's exclusive prefix of totals
// at e0. The place and finish kernels both turn the per-expert totals into first rows this way.
struct ExpertRun {
  int e0, e1, run;
};
__device__ __forceinline__ ExpertRun lane_expert_run(const int32_t* totals, int n_exp, int lane) {
  const int per = (n_exp + kWarp - 1) / kWarp, e0 = lane * per;
  const int e1 = e0 + per < n_exp ? e0 + per : n_exp;
  int sum = 0;
  for (int e = e0; e < e1; ++e) sum += totals[e];
  int total;
  const int run = warp_exclusive_scan(sum, lane, &total);
  return {e0, e1, run};
}

// Slots [begin, end) of warp `tile`.
struct TileRange {
  int64_t begin, end;
};
__device__ __forceinline__ TileRange tile_range(int64_t tile, int64_t tile_slots, int64_t slots) {
  const int64_t begin = tile * tile_slots;
  return {begin, begin + tile_slots < slots ? begin + tile_slots : slots};
}

// A lane's expert ids of kChunkBatch chunks of 32 slots from b0 (-1 past end), loaded before any
// is used so that the loads overlap.
constexpr int kChunkBatch = 8;
__device__ __forceinline__ void load_chunk_batch(int (&ex)[kChunkBatch],
                                                 const int32_t* __restrict__ expert, int64_t b0,
                                                 int64_t end, int lane) {
#pragma unroll
  for (int c = 0; c < kChunkBatch; ++c) {
    const int64_t s = b0 + c * kWarp + lane;
    ex[c] = s < end ? expert[s] : -1;
  }
}

// The count and place kernels' walk over the slots of range t, in chunks of 32 with kChunkBatch
// chunks' expert ids loaded at a time: every lane calls fn(s, e, valid, same) for its slot s of
// every chunk (so fn may __syncwarp), with e = expert[s] (-1 past t.end), valid = e in [0, n_exp),
// and `same` the chunk's lanes with the same e (all invalid lanes match each other).
template <class Fn>
__device__ __forceinline__ void for_each_slot(const TileRange& t,
                                              const int32_t* __restrict__ expert, int n_exp,
                                              int lane, Fn&& fn) {
  for (int64_t b0 = t.begin; b0 < t.end; b0 += kWarp * kChunkBatch) {
    int ex[kChunkBatch];
    load_chunk_batch(ex, expert, b0, t.end, lane);
#pragma unroll
    for (int c = 0; c < kChunkBatch; ++c) {
      const int64_t s = b0 + c * kWarp + lane;
      const int e = ex[c];
      const bool valid = 0 <= e && e < n_exp;
      const unsigned same = __match_any_sync(kFullMask, valid ? e : -1);
      fn(s, e, valid, same);
    }
  }
}

// counts[tile * E + e] = slots of expert e in the tile (with one tile: counts = offsets + 1).
__global__ void plan_count_kernel(int32_t* __restrict__ counts, const int32_t* __restrict__ expert,
                                  int64_t slots, int64_t tile_slots, int64_t tiles, int n_exp) {
  extern __shared__ int smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (tile >= tiles) return;  // whole warps leave
  int* count = smem + warp * n_exp;
  for (int e = lane; e < n_exp; e += kWarp) count[e] = 0;
  __syncwarp();
  for_each_slot(tile_range(tile, tile_slots, slots), expert, n_exp, lane,
                [&](int64_t, int e, bool valid, unsigned same) {
                  // One writer per expert and chunk; the next chunk's may be another lane, hence
                  // the sync.
                  if (valid && lane == __ffs(same) - 1) count[e] += __popc(same);
                  __syncwarp();
                });
  for (int e = lane; e < n_exp; e += kWarp) counts[tile * n_exp + e] = count[e];
}

// Warp e: table[:, e] becomes its exclusive prefix over tiles; totals[e] = its sum. Lane l owns
// a contiguous run of at most kMaxTilesPerLane tiles (lane order is tile order), held in registers.
constexpr int kMaxTilesPerLane = 32;
constexpr int64_t kMaxTiles = kWarp * kMaxTilesPerLane;
__global__ void plan_scan_kernel(int32_t* __restrict__ table, int32_t* __restrict__ totals,
                                 int64_t tiles, int n_exp) {
  const int lane = threadIdx.x % kWarp;
  const int e = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (e >= n_exp) return;
  const int per = static_cast<int>((tiles + kWarp - 1) / kWarp);
  const int64_t t0 = static_cast<int64_t>(lane) * per;
  int c[kMaxTilesPerLane], sum = 0;
#pragma unroll
  for (int i = 0; i < kMaxTilesPerLane; ++i) {
    c[i] = i < per && t0 + i < tiles ? table[(t0 + i) * n_exp + e] : 0;
    sum += c[i];
  }
  int total;
  int run = warp_exclusive_scan(sum, lane, &total);
#pragma unroll
  for (int i = 0; i < kMaxTilesPerLane; ++i)
    if (i < per && t0 + i < tiles) {
      table[(t0 + i) * n_exp + e] = run;
      run += c[i];
    }
  if (lane == 0) totals[e] = total;
}

// Warp `tile` places its slots: slot_row[s] = cursor[e] + rank of s among its chunk's lanes of e.
// table: [tiles, E] rows of e in earlier tiles (null with one tile); totals: [E] rows per expert.
__global__ void plan_place_kernel(int32_t* __restrict__ slot_row, const int32_t* __restrict__ table,
                                  const int32_t* __restrict__ totals,
                                  const int32_t* __restrict__ expert, int64_t slots,
                                  int64_t tile_slots, int64_t tiles, int n_exp) {
  extern __shared__ int smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (tile >= tiles) return;
  int* cursor = smem + warp * n_exp;
  // First row of each expert: exclusive prefix of the totals.
  auto [e0, e1, run] = lane_expert_run(totals, n_exp, lane);
  for (int e = e0; e < e1; ++e) {
    cursor[e] = run + (table ? table[tile * n_exp + e] : 0);
    run += totals[e];
  }
  __syncwarp();
  const TileRange t = tile_range(tile, tile_slots, slots);
  for_each_slot(t, expert, n_exp, lane, [&](int64_t s, int e, bool valid, unsigned same) {
    if (s < t.end) slot_row[s] = valid ? cursor[e] + __popc(same & ((1u << lane) - 1u)) : -1;
    __syncwarp();  // every lane has read its cursor before the group's first lane advances it
    if (valid && lane == __ffs(same) - 1) cursor[e] += __popc(same);
    __syncwarp();
  });
}

// row_token[slot_row[s]] = s / K; block 0's first warp turns offsets[1..E] (the totals) into the
// inclusive prefix, offsets[0] = 0. Runs after place, the last reader of the totals and the table.
__global__ void plan_finish_kernel(int32_t* __restrict__ row_token, int32_t* __restrict__ offsets,
                                   const int32_t* __restrict__ slot_row, int64_t slots, int k,
                                   int n_exp) {
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t r = slot_row[s];
    if (0 <= r && r < slots) row_token[r] = static_cast<int32_t>(s) / k;
  }
  if (blockIdx.x != 0 || threadIdx.x >= kWarp) return;
  const int lane = threadIdx.x;
  int32_t* totals = offsets + 1;
  auto [e0, e1, run] = lane_expert_run(totals, n_exp, lane);
  for (int e = e0; e < e1; ++e) {
    run += totals[e];
    totals[e] = run;
  }
  if (lane == 0) offsets[0] = 0;
}

// ---- row kernels --------------------------------------------------------------------------------

constexpr int kRowThreads = 256;
// Lanes per row: 8 x 16 B is one 128-byte line per access, and a warp has four rows in flight.
constexpr int kGroup = 8;
// Accesses in flight per lane and source row: 2 measured best on the H200 (4 and 8 cost registers
// and occupancy); evict-first stores and L2 evict-last hints on the gathered rows measured no gain.
constexpr int kUnroll = 2;

// W consecutive elements moved as one access: 16 bytes (W = kVec<T>) or one element (W = 1).
template <class T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

template <class T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
  Pack<T, W> r;
  if constexpr (W == 1) {
    r.v[0] = *p;
  } else {
    static_assert(sizeof(Pack<T, W>) == 16, "a vector access is 16 bytes");
    *reinterpret_cast<uint4*>(r.v) = *reinterpret_cast<const uint4*>(p);
  }
  return r;
}

template <class T, int W>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& r) {
  if constexpr (W == 1)
    *p = r.v[0];
  else
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(r.v);
}

template <class T>
__device__ __forceinline__ T nan_of() {
  return store<T>(static_cast<acc_t<T>>(NAN));
}

// The row a lane's group owns, and the lane's index within the group.
__device__ __forceinline__ int64_t group_row() {
  return (static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x) / kGroup;
}
__device__ __forceinline__ int group_lane() {
  return threadIdx.x % kGroup;
}

// xp[r, :] = x[row_token[r], :]
template <class T, int W>
__global__ void __launch_bounds__(kRowThreads)
    permute_forward_kernel(T* __restrict__ xp, const T* __restrict__ x,
                           const int32_t* __restrict__ row_token, int64_t rows, int64_t n_tok,
                           int64_t d) {
  const int64_t r = group_row();
  if (r >= rows) return;
  const int32_t tok = row_token[r];
  const bool ok = 0 <= tok && tok < n_tok;
  const T* src = x + (ok ? tok : 0) * d;
  T* dst = xp + r * d;
  Pack<T, W> nan;
#pragma unroll
  for (int j = 0; j < W; ++j) nan.v[j] = nan_of<T>();
  const int64_t units = d / W;
  for (int64_t c0 = group_lane(); c0 < units; c0 += kGroup * kUnroll) {
    Pack<T, W> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kGroup;
      if (c < units) v[u] = ok ? load_pack<T, W>(src + c * W) : nan;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kGroup;
      if (c < units) store_pack<T, W>(dst + c * W, v[u]);
    }
  }
}

// out[n, :] = sum_k in[slot_row[n*K+k], :]: permute backward and the MoE combine. kSecond
// (permute backward's dxp2): in2's row is added after in's, in the same fp32 sum (one rounding of
// the token's 2K rows). base (permute_backward_add; null: none, not out's memory): the sum starts
// from its row.
template <class T, int W, bool kSecond>
__global__ void __launch_bounds__(kRowThreads)
    gather_sum_kernel(T* __restrict__ out, const T* __restrict__ in, const T* __restrict__ in2,
                      const int32_t* __restrict__ slot_row, int64_t n_tok, int k, int64_t d,
                      const T* __restrict__ base) {
  using A = acc_t<T>;
  const int64_t n = group_row();
  if (n >= n_tok) return;
  const int64_t slots = n_tok * k, units = d / W;
  const int32_t* rows = slot_row + n * k;
  T* dst = out + n * d;
  for (int64_t c0 = group_lane(); c0 < units; c0 += kGroup * kUnroll) {
    A acc[kUnroll][W] = {};
    if (base != nullptr) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + u * kGroup < units) {
          const Pack<T, W> b = load_pack<T, W>(base + n * d + (c0 + u * kGroup) * W);
#pragma unroll
          for (int j = 0; j < W; ++j) acc[u][j] = load(b.v[j]);
        }
    }
    for (int i = 0; i < k; ++i) {
      const int32_t r = rows[i];
      const bool ok = 0 <= r && r < slots;
      const A poison = ok ? A(1) : static_cast<A>(NAN);  // a slot with no row sums to NaN
      const T* src = in + (ok ? r : 0) * d;
      const T* src2 = kSecond ? in2 + (ok ? r : 0) * d : nullptr;
      Pack<T, W> v[kUnroll], v2[kSecond ? kUnroll : 1];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + u * kGroup < units) {
          v[u] = load_pack<T, W>(src + (c0 + u * kGroup) * W);
          if constexpr (kSecond) v2[u] = load_pack<T, W>(src2 + (c0 + u * kGroup) * W);
        }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + u * kGroup < units) {
#pragma unroll
          for (int j = 0; j < W; ++j) {
            acc[u][j] += poison * load(v[u].v[j]);
            if constexpr (kSecond) acc[u][j] += poison * load(v2[u].v[j]);
          }
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kGroup;
      if (c >= units) continue;
      Pack<T, W> o;
#pragma unroll
      for (int j = 0; j < W; ++j) o.v[j] = store<T>(acc[u][j]);
      store_pack<T, W>(dst + c * W, o);
    }
  }
}

// row_w[slot_row[s]] = topk_w[s] (a permutation: each row written once; a slot with no row,
// slot_row = -1, writes nothing).
template <class A>
__global__ void permute_weights_forward_kernel(A* __restrict__ row_w, const A* __restrict__ topk_w,
                                               const int32_t* __restrict__ slot_row,
                                               int64_t slots) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < slots;
       s += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = slot_row[s];
    if (0 <= r && r < slots) row_w[r] = topk_w[s];
  }
}

// dtopk_w[s] = drow_w[slot_row[s]] (NaN for a slot with no row).
template <class A>
__global__ void permute_weights_backward_kernel(A* __restrict__ dtopk_w,
                                                const A* __restrict__ drow_w,
                                                const int32_t* __restrict__ slot_row,
                                                int64_t slots) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < slots;
       s += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = slot_row[s];
    dtopk_w[s] = 0 <= r && r < slots ? drow_w[r] : static_cast<A>(NAN);
  }
}

// ---- host side ----------------------------------------------------------------------------------

// Blocks for one kGroup-lane group per row.
unsigned row_blocks(int64_t rows) {
  return blocks_for(rows * kGroup, kRowThreads);
}

// Calls fn(std::integral_constant<int, W>{}): W = kVec<T> (16-byte accesses) when every row
// starts 16-byte aligned (d a multiple of kVec<T>, every base pointer aligned), W = 1 otherwise.
template <class T, class Fn>
void with_access_width(int64_t d, std::initializer_list<const void*> ptrs, Fn&& fn) {
  if (d % kVec<T> == 0 && aligned16(ptrs))
    fn(std::integral_constant<int, kVec<T>>{});
  else
    fn(std::integral_constant<int, 1>{});
}

void moe_permute_plan(Ctx& ctx, Tensor offsets, Tensor row_token, Tensor slot_row,
                      Tensor topk_idx) {
  check_moe_permute_plan_args(offsets, row_token, slot_row, topk_idx);
  const int64_t n_tok = topk_idx.size(0), k = topk_idx.size(1), slots = n_tok * k;
  const int64_t n_exp = offsets.size(0) - 1;
  MOE_CHECK(slots < (int64_t{1} << 31), "moe_permute_plan: N*K must fit in i32");
  MOE_CHECK(n_exp <= kMaxPlanExperts, "moe_permute_plan: " + std::to_string(n_exp) +
                                          " experts, the CUDA plan supports at most " +
                                          std::to_string(kMaxPlanExperts));
  cudaStream_t stream = stream_of(ctx);
  const int32_t* expert = static_cast<const int32_t*>(topk_idx.data);
  int32_t* off = static_cast<int32_t*>(offsets.data);
  int32_t* tok = static_cast<int32_t*>(row_token.data);
  int32_t* row = static_cast<int32_t*>(slot_row.data);
  if (slots == 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(off, 0, offsets.nbytes(), stream));
    return;
  }
  // T tiles of about kTileSlots slots, T * E <= N*K so that the [T, E] table fits in row_token.
  // With one tile there is no table: its counts are the totals (offsets + 1).
  const int64_t tiles = std::max<int64_t>(
      1, std::min({(slots + kTileSlots - 1) / kTileSlots, slots / n_exp, kMaxTiles}));
  const int64_t tile_slots = (slots + tiles - 1) / tiles;
  const int e = static_cast<int>(n_exp);
  const int warps = static_cast<int>(
      std::clamp<int64_t>(kSmemBytes / (n_exp * int64_t(sizeof(int))), 1, kPlanWarps));
  const unsigned tile_blocks = static_cast<unsigned>((tiles + warps - 1) / warps);
  const size_t smem = static_cast<size_t>(warps) * n_exp * sizeof(int);
  int32_t* table = tiles > 1 ? tok : nullptr;
  plan_count_kernel<<<tile_blocks, warps * kWarp, smem, stream>>>(table ? table : off + 1, expert,
                                                                  slots, tile_slots, tiles, e);
  MOE_CUDA_LAUNCH_CHECK();
  if (table) {
    plan_scan_kernel<<<blocks_for(n_exp, kScanWarps), kScanWarps * kWarp, 0, stream>>>(
        table, off + 1, tiles, e);
    MOE_CUDA_LAUNCH_CHECK();
  }
  plan_place_kernel<<<tile_blocks, warps * kWarp, smem, stream>>>(row, table, off + 1, expert,
                                                                  slots, tile_slots, tiles, e);
  MOE_CUDA_LAUNCH_CHECK();
  const unsigned finish_blocks = std::min<unsigned>(blocks_for(slots, kFinishThreads), 1024u);
  plan_finish_kernel<<<finish_blocks, kFinishThreads, 0, stream>>>(tok, off, row, slots,
                                                                   static_cast<int>(k), e);
  MOE_CUDA_LAUNCH_CHECK();
}

void permute_forward(Ctx& ctx, Tensor xp, Tensor x, Tensor row_token) {
  check_permute_forward_args(xp, x, row_token);
  const int64_t rows = row_token.size(0), n_tok = x.size(0), d = x.size(1);
  if (rows == 0 || d == 0) return;
  dispatch_storage(x.dtype, "permute_forward", [&](auto zero) {
    using T = decltype(zero);
    with_access_width<T>(d, {xp.data, x.data}, [&](auto width) {
      permute_forward_kernel<T, decltype(width)::value>
          <<<row_blocks(rows), kRowThreads, 0, stream_of(ctx)>>>(
              data_of<T>(xp), data_of<T>(x), data_of<int32_t>(row_token), rows, n_tok, d);
      MOE_CUDA_LAUNCH_CHECK();
    });
  });
}

// The gather-sum launch of permute_backward and permute_backward_add (dxp2, base: empty or not).
void launch_gather_sum(Ctx& ctx, Tensor dx, Tensor dxp, Tensor dxp2, Tensor base, Tensor slot_row,
                       int64_t k, const char* op) {
  const int64_t n_tok = dx.size(0), d = dx.size(1);
  if (n_tok == 0 || d == 0) return;
  const bool second = !dxp2.empty();
  dispatch_storage(dx.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    with_access_width<T>(
        d, {dx.data, dxp.data, second ? dxp2.data : dxp.data, base.empty() ? dx.data : base.data},
        [&](auto width) {
          constexpr int kW = decltype(width)::value;
          auto kernel = second ? gather_sum_kernel<T, kW, true> : gather_sum_kernel<T, kW, false>;
          kernel<<<row_blocks(n_tok), kRowThreads, 0, stream_of(ctx)>>>(
              data_of<T>(dx), data_of<T>(dxp), second ? data_of<T>(dxp2) : nullptr,
              data_of<int32_t>(slot_row), n_tok, static_cast<int>(k), d,
              base.empty() ? nullptr : data_of<T>(base));
          MOE_CUDA_LAUNCH_CHECK();
        });
  });
}

void permute_backward(Ctx& ctx, Tensor dx, Tensor dxp, Tensor dxp2, Tensor slot_row) {
  const int64_t k = check_permute_backward_args(dx, dxp, dxp2, slot_row);
  launch_gather_sum(ctx, dx, dxp, dxp2, Tensor(), slot_row, k, "permute_backward");
}

void permute_backward_add(Ctx& ctx, Tensor y, Tensor base, Tensor yp, Tensor slot_row) {
  const int64_t k = check_permute_backward_add_args(y, base, yp, slot_row);
  launch_gather_sum(ctx, y, yp, Tensor(), base, slot_row, k, "permute_backward_add");
}

constexpr int kWeightThreads = 256;

// Launches kernel(out, in, slot_row, slots) over the slots, instantiated for the weights' dtype
// (f32 or f64; the checks have ruled out the rest).
template <class Kernel32, class Kernel64>
void launch_weights(Ctx& ctx, DType t, Kernel32 k32, Kernel64 k64, Tensor out, Tensor in,
                    Tensor slot_row) {
  const int64_t slots = slot_row.size(0);
  if (slots == 0) return;
  const unsigned grid = std::min<unsigned>(blocks_for(slots, kWeightThreads), 1024u);
  const int32_t* rows = data_of<int32_t>(slot_row);
  if (t == DType::f32)
    k32<<<grid, kWeightThreads, 0, stream_of(ctx)>>>(data_of<float>(out), data_of<float>(in), rows,
                                                     slots);
  else
    k64<<<grid, kWeightThreads, 0, stream_of(ctx)>>>(data_of<double>(out), data_of<double>(in),
                                                     rows, slots);
  MOE_CUDA_LAUNCH_CHECK();
}

void permute_weights_forward(Ctx& ctx, Tensor row_w, Tensor topk_w, Tensor slot_row) {
  check_permute_weights_args(row_w, topk_w, slot_row, "permute_weights_forward", "row_w", "topk_w");
  launch_weights(ctx, topk_w.dtype, permute_weights_forward_kernel<float>,
                 permute_weights_forward_kernel<double>, row_w, topk_w, slot_row);
}

void permute_weights_backward(Ctx& ctx, Tensor dtopk_w, Tensor drow_w, Tensor slot_row) {
  check_permute_weights_args(drow_w, dtopk_w, slot_row, "permute_weights_backward", "drow_w",
                             "dtopk_w");
  launch_weights(ctx, dtopk_w.dtype, permute_weights_backward_kernel<float>,
                 permute_weights_backward_kernel<double>, dtopk_w, drow_w, slot_row);
}

}  // namespace
}  // namespace moe::cuda_detail

MOE_REGISTER_CUDA_OP(moe_permute_plan, &::moe::cuda_detail::moe_permute_plan);
MOE_REGISTER_CUDA_OP(permute_forward, &::moe::cuda_detail::permute_forward);
MOE_REGISTER_CUDA_OP(permute_backward, &::moe::cuda_detail::permute_backward);
MOE_REGISTER_CUDA_OP(permute_backward_add, &::moe::cuda_detail::permute_backward_add);
MOE_REGISTER_CUDA_OP(permute_weights_forward, &::moe::cuda_detail::permute_weights_forward);
MOE_REGISTER_CUDA_OP(permute_weights_backward, &::moe::cuda_detail::permute_weights_backward);
