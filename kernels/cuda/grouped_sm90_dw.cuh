// The sm_90a grouped GEMM's dw kernel (dw_e += dy_e^T x_e over units of expert, chunk and tile,
// deterministic chunk order), cooperative or ping-pong, and its gathering forms. Included by
// grouped_wgmma_sm90.cu alone.
#pragma once

#include <type_traits>

#include "cuda/grouped_sm90_parts.cuh"

namespace moe::cuda_detail::grouped_sm90 {

// dw kernel, persistent: dw[e] += dy_e^T x_e as work units of (expert e, chunk c of its rows,
// 128 x kBN tile of dw[e]). A(m = o, k = r) = dy[r, o] and B(k = r, n = i) = x[r, i] come through
// tensor maps over dy [rows, out] and x [rows, in] (boxes of 64 x 64, MN-major tiles). An expert's
// rows are cut into chunks of `chunk` rows (a multiple of kBK; the host makes it twice the mean
// rows per expert, so balanced routing keeps one chunk per expert and only a hot expert is split:
// at maxvio 7 one expert holds every row, and unsplit its 88 tiles left a third of the H200's 132
// SMs idle). Units run expert-major, then chunk, then tile; block b takes units b, b + grid, ...
// and its producer streams the next unit's slices during the current one's epilogue.
//
// Determinism: the chunks of one tile add to dw in chunk order. Chunk c waits until the tile's
// flag (dw_flags, one per (expert, tile), 0 between launches) reads c, adds, then publishes c + 1
// (the last chunk puts 0 back). Each element still gets one reduction per chunk from one thread,
// so the bits depend only on the offsets and the shapes. A bf16 dw (linear.hpp's bf16 gradient
// form) is loaded, added in fp32 and rounded by each chunk in turn: a split tile is rounded once
// per chunk, in the same fixed order. No deadlock: a unit only waits on a unit of lower index,
// and the lowest-index unfinished unit is always running once its block is on an SM (that block
// has finished every earlier unit of its own). Units are assigned to blocks
// statically, so a block kept off the SMs by another stream's kernels (NCCL's during an
// overlapped backward) delays the chunks that wait on its units until those kernels end; with SMs
// withheld for good (MPS limits) it would not end. Claiming units in index order by an atomic
// ticket would remove that dependence (next step). The flags assume one dw launch at a time per
// device (the trainer's one compute stream), as norm.cu's scratch does.
// A slice that runs past the chunk's last row holds the next rows: each math warpgroup zeroes those
// k-rows of its own 64-wide block of A before its wgmma, so they add nothing.
// The gathering dw kernel's copy of one operand's k-slice at k (rows k .. k + 63, those from k1
// on zeros): kBlocks blocks of [64 k-rows][64 columns from col0] of rows row_token[k-row] of
// src [tokens, width], in the layout their TMA loads would give. Thread p (0..127) holds k-row
// p % 64, and its warp copies its 32 k-rows of blocks p / 64, p / 64 + 2, ... (copy_warp_lines).
template <int kBlocks, class T>
__device__ __forceinline__ void gather_k_rows(uint32_t dst, int p, const T* src,
                                              const int32_t* row_token, int64_t tokens, int64_t k,
                                              int64_t k1, int64_t col0, int64_t width) {
  const int q = p % 64;
  const T* row = gathered_row(src, row_token, k + q, k + q < k1, tokens, width);
  for (int j = p / 64; j < kBlocks; j += 2)
    copy_warp_lines(dst + j * Sw128::kBlockBytes, q & ~31, row, src, col0 + 64 * j, width);
}

// The dw kernels' register split: the producer's TMA thread needs little. The gathering dw
// producer's 128 threads walk the units and copy x themselves: at 40, 56 and 72 registers they
// spilled (60, 12 and 4 bytes), at 88 not; 88 + 2 x 208 = 3 x 168, the block's registers, and
// the math code fits 208.
constexpr int kDwProducerRegs = 40, kDwMathRegs = 232;
constexpr int kGatherProducerRegs = 88, kGatherMathRegs = 208;
static_assert(setmaxnreg_fits(kDwProducerRegs, kDwMathRegs) &&
                  setmaxnreg_fits(kGatherProducerRegs, kGatherMathRegs),
              "setmaxnreg within the block");

constexpr int64_t kDwMaxFlags = int64_t(1) << 20;
__device__ int dw_flags[kDwMaxFlags];

// A work unit of the dw kernel: expert e, chunk c (of `chunks`) of its rows, [k0, k1), and tile
// `tile` of the expert's, at output row m0 and column n0 of dw[e] (second: a pair's dw2 tile).
struct DwUnit {
  int e, c, chunks;
  int64_t k0, k1, tile, m0, n0;
  bool second;
  __device__ __forceinline__ int slices() const {
    return static_cast<int>((k1 - k0 + kBK - 1) / kBK);
  }
  // k-rows of the last slice (0: a whole one)
  __device__ __forceinline__ int tail() const { return static_cast<int>((k1 - k0) % kBK); }
};

// The work units of the dw kernel, from the offsets (every thread of a block computes the same).
struct DwUnits {
  const int64_t* start;  // [E + 1], shared memory: first unit of expert e (empty experts: none)
  int experts;
  int64_t rows, chunk, tiles;  // tiles: per expert (out tiles x in tiles)
  int64_t half_tiles;          // a pair's tiles of dw, then as many of dw2 (else = tiles)
  int n_tiles;                 // column tiles of dw[e]
  __device__ __forceinline__ int64_t total() const { return start[experts]; }
  // Unit u (kBN: the tile's columns).
  template <int kBN>
  __device__ __forceinline__ DwUnit find(const int32_t* offsets, int64_t u) const {
    int lo = 0, hi = experts - 1;  // the last expert whose first unit is <= u
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= u)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int64_t r0 = clamp_offset(offsets[lo], rows), r1 = clamp_offset(offsets[lo + 1], rows);
    const int64_t local = u - start[lo];
    DwUnit w;
    w.e = lo;
    w.c = static_cast<int>(local / tiles);
    w.tile = local % tiles;
    w.chunks = static_cast<int>((r1 - r0 + chunk - 1) / chunk);
    w.k0 = r0 + int64_t(w.c) * chunk;
    w.k1 = std::min(r1, w.k0 + chunk);
    w.second = w.tile >= half_tiles;
    const int64_t own = w.second ? w.tile - half_tiles : w.tile;
    w.m0 = (own / n_tiles) * kBM;
    w.n0 = (own % n_tiles) * kBN;
    return w;
  }
};

// fp32 dw: one thread's pair of a tile's sums, dw elements p[0] and p[1], stored (the tile's
// first chunk under overwrite) or added by a reduction in L2 that does not wait for the load
// (subnormal f32 sums flush to zero).
__device__ __forceinline__ void dw_put_pair(float* p, float v0, float v1, bool store) {
  if (store)
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(v0), "f"(v1) : "memory");
  else
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(v0), "f"(v1) : "memory");
}

// bf16 dw (linear.hpp's bf16 gradient form): a pair is 4 bytes, rounded once to nearest even.
__device__ __forceinline__ void dw_store_bf16_pair(__nv_bfloat16* p, float v0, float v1) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(v0, v1);
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(*reinterpret_cast<const uint32_t*>(&r))
               : "memory");
}
// A bf16 tile's stores, whole 32-byte sectors: a thread's 4-byte pairs left 16 bytes of a row per
// warp instruction (half of each of 8 sectors, as the fp32 pairs' 8 bytes filled them), and were
// measured slower than the fp32 stores they replace (moe-fine's dw products +5%). Two lanes
// (t % 4 = 2q, 2q + 1) swap one pair: for column groups j and j + 1 (8 columns each) of a row,
// the even lane stores its group-j pair and its neighbour's (columns 8j + 4q .. + 3), the odd lane
// both group-(j + 1) pairs (8j + 8 + 4q ..): 8 bytes each, and the quad covers 16 columns. Relies
// on for_each_math_pair's order: pair k at column group k / 2, row + 8 (k % 2), per call.
template <class Pairs>
__device__ __forceinline__ void dw_store_bf16_pairs(__nv_bfloat16* dw_e, int64_t m0, int64_t n0,
                                                    int64_t out, int64_t in, Pairs&& pairs) {
  const bool odd_lane = (threadIdx.x & 1) != 0;  // t % 4 odd
  uint32_t held[2];                              // group j's pairs (rows row, row + 8)
  int k = 0;                                     // a constant at each call once unrolled
  pairs([&](int row, int col, float v0, float v1) {
    const int h = k & 1;
    const bool second = (k >> 1) & 1;  // group j + 1: col = 8 (j + 1) + 2 (t % 4)
    ++k;
    const __nv_bfloat162 r = __floats2bfloat162_rn(v0, v1);
    const uint32_t mine = *reinterpret_cast<const uint32_t*>(&r);
    if (!second) {
      held[h] = mine;
      return;
    }
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd_lane ? held[h] : mine, 1);
    const int64_t o = m0 + row, i = n0 + col - (odd_lane ? 2 : 8);
    // (in % 8 == 0: the four columns lie in the row or past it together)
    if (o < out && i < in)
      asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(dw_e + o * in + i),
                   "r"(odd_lane ? got : held[h]), "r"(odd_lane ? mine : got)
                   : "memory");
  });
}

// The pair a later chunk (or a launch without overwrite) adds to, from L2: ld.relaxed.gpu, since
// the tile's earlier chunk was written by another SM (ordered before this load by the flag's
// release / acquire and the barrier behind it).
__device__ __forceinline__ uint32_t dw_load_bf16_pair(const __nv_bfloat16* p) {
  uint32_t old;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(old) : "l"(p) : "memory");
  return old;
}

// A bf16 tile's additions: each pair loaded, added in fp32 and rounded (a split tile so rounds
// once per chunk, in chunk order). Batches of kPairBatch pairs are loaded before any of them is
// stored, so their L2 round trips overlap (one at a time, each store waits for its own load).
// pairs(f) hands the thread's pairs to f(row, col, v0, v1) in a fixed order, at most kMaxPairs
// of them, fully unrolled: the pair's index j is a constant there and old[] stays in registers.
constexpr int kPairBatch = 8;
template <int kMaxPairs, class Pairs>
__device__ __forceinline__ void dw_add_bf16_pairs(__nv_bfloat16* dw_e, int64_t m0, int64_t n0,
                                                  int64_t out, int64_t in, Pairs&& pairs) {
#pragma unroll
  for (int b = 0; b < (kMaxPairs + kPairBatch - 1) / kPairBatch; ++b) {
    uint32_t old[kPairBatch];
    int j = 0;
    pairs([&](int row, int col, float, float) {
      const int k = j++ - b * kPairBatch;
      const int64_t o = m0 + row, i = n0 + col;
      if (k >= 0 && k < kPairBatch && o < out && i < in)
        old[k] = dw_load_bf16_pair(dw_e + o * in + i);
    });
    j = 0;
    pairs([&](int row, int col, float v0, float v1) {
      const int k = j++ - b * kPairBatch;
      const int64_t o = m0 + row, i = n0 + col;
      if (k >= 0 && k < kPairBatch && o < out && i < in)
        dw_store_bf16_pair(dw_e + o * in + i, v0 + __uint_as_float(old[k] << 16),
                           v1 + __uint_as_float(old[k] & 0xffff0000u));  // (p[0]: the low half)
    });
  }
}

// Unit w's reductions into dw[w.e] ([out, in] each) at its tile, chunk w.c of w.chunks, by math
// warpgroup g: after the tile's earlier chunks (its flag, dw_flags[w.e * tiles + w.tile], reads
// w.c; formed only when the tile is split, where E x tiles fits the flags: launch_dw; the
// warpgroup's first thread polls it), then publishing w.c + 1 (the last chunk puts 0 back) once
// every thread that holds the tile has reduced: the warpgroup's (alone: the ping-pong kernel's
// tile is one warpgroup's) or both warpgroups' (barrier 3). pairs(add) hands this thread's
// accumulator pairs to add(row, col, v0, v1) (for_each_math_pair). overwrite: the tile's first
// chunk stores (dw is neither zeroed before nor read), the later ones add behind it in chunk
// order as always. O: dw's type, float or __nv_bfloat16 (dw_put_pair, dw_add_bf16_pairs).
template <class C, class O, class Pairs>
__device__ __forceinline__ void dw_tile_reduce(const DwUnit& w, int64_t tiles, int g, bool alone,
                                               O* dw, int64_t out, int64_t in, bool overwrite,
                                               Pairs&& pairs) {
  const int c = w.c, chunks = w.chunks;
  int* flag = chunks > 1 ? &dw_flags[int64_t(w.e) * tiles + w.tile] : nullptr;
  O* dw_e = dw + int64_t(w.e) * out * in;
  const int64_t m0 = w.m0, n0 = w.n0;
  const bool store = overwrite && c == 0;
  if (c > 0) {  // the tile's earlier chunks first
    if (threadIdx.x % 128 == 0) {
      int seen = -1;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
        if (seen == c) break;
        __nanosleep(100);
      }
    }
    named_barrier_sync(1 + g, 128);
  }
  // (one thread writes each pair per chunk; in % 8 == 0: a pair at col < in lies in the row)
  if constexpr (std::is_same_v<O, float>) {
    pairs([&](int row, int col, float v0, float v1) {
      const int64_t o = m0 + row, i = n0 + col;
      if (o < out && i < in) dw_put_pair(dw_e + o * in + i, v0, v1, store);
    });
  } else if (store) {
    dw_store_bf16_pairs(dw_e, m0, n0, out, in, pairs);
  } else {
    dw_add_bf16_pairs<C::kAcc>(dw_e, m0, n0, out, in, pairs);
  }
  if (chunks > 1) {  // publish: every thread's reductions, then the flag
    __threadfence();
    if (alone)
      named_barrier_sync(1 + g, 128);
    else
      named_barrier_sync(3, 256);
    if (threadIdx.x == (alone ? 128u * (1 + g) : 128u)) {  // the first thread of the tile's
      const int next = c + 1 == chunks ? 0 : c + 1;
      asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(next) : "memory");
    }
  }
}

// Zeroes k-rows tail..63 (tail > 0) of `blocks` 64-wide blocks of A from block `first` in a
// landed stage, so that a slice running past the chunk's last row adds nothing (the rows past it
// hold the next rows of B): 16-byte chunks, whole rows (the swizzle only permutes chunks within a
// row), by math warpgroup g's 128 threads, made visible to its wgmma (the async proxy).
__device__ __forceinline__ void zero_k_tail(uint32_t stage, int first, int blocks, int tail,
                                            int g) {
  for (int b = first; b < first + blocks; ++b) {
    const uint32_t block = stage + b * Sw128::kBlockBytes;
    for (int i = tail * 8 + static_cast<int>(threadIdx.x) % 128; i < 64 * 8; i += 128)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(block + 16 * i), "r"(0)
                   : "memory");
  }
  fence_proxy_async_smem();
  named_barrier_sync(1 + g, 128);
}

// kGatherDy / kGatherX: dy's / x's rows are gathered, k-row r being row row_token[r] of dy_src
// [tokens, out] / x_src [tokens, in] (the MoE layer's output gradient / input, no permuted copy;
// that operand's map unused): the producer warpgroup's 128 threads copy them by cp.async
// (gather_k_rows), the other operand still by TMA.
// kSched: pingpong (C = PingPong): a unit's 128 x kBN tile on one math warpgroup, its reductions
// under the other's main loop (pingpong_wait_turn); no multicast form. O: dw's type, float or
// (T = __nv_bfloat16) __nv_bfloat16 (dw_put_pair).
template <class C, class T, bool kGatherDy = false, bool kGatherX = false,
          Sched kSched = Sched::cooperative, class O = float>
__global__ void __launch_bounds__(kTmaThreads, 1)
    grouped_tma_dw_kernel(const __grid_constant__ CUtensorMap map_dy,
                          const __grid_constant__ CUtensorMap map_x,
                          const __grid_constant__ CUtensorMap map_dy2, O* dw, O* dw2,
                          const int32_t* offsets, int experts, int64_t rows, int64_t out,
                          int64_t in, int64_t chunk, bool overwrite, const T* dy_src,
                          const T* x_src, const int32_t* row_token, int64_t tokens) {
  constexpr bool kGather = kGatherDy || kGatherX;
  constexpr bool kPingPong = is_pingpong(kSched);
  static_assert(!is_multicast(kSched), "the dw kernel has no multicast form");
  if constexpr (kHasWgmma) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[C::kStages], empty[C::kStages];
    __shared__ int64_t unit_start[kSharedOffsets + 1];
    const int m_tiles = static_cast<int>((out + kBM - 1) / kBM);
    const int n_tiles = static_cast<int>((in + C::kBN - 1) / C::kBN);
    // A pair (dw2; dy not gathered): each expert's tiles of dw (dy's), then as many of dw2
    // (map_dy2's), over the same x.
    const int64_t half_tiles = int64_t(m_tiles) * n_tiles;
    const int64_t tiles = dw2 != nullptr ? 2 * half_tiles : half_tiles;
    if (threadIdx.x == 0) {  // experts <= kSharedOffsets (the host's condition)
      int64_t at = 0;
      for (int e = 0; e < experts; ++e) {
        unit_start[e] = at;
        const int64_t len = clamp_offset(offsets[e + 1], rows) - clamp_offset(offsets[e], rows);
        if (len > 0) at += (len + chunk - 1) / chunk * tiles;
      }
      unit_start[experts] = at;
    }
    __shared__ __align__(8) uint64_t turn[2];  // kPingPong
    // (its barrier publishes the table)
    const TmaRing<C> ring =
        make_ring<C, kSched>(smem, full, empty, kGather ? 1 + 128 : 1, kPingPong ? turn : nullptr);
    const DwUnits units{unit_start, experts, rows, chunk, tiles, half_tiles, n_tiles};
    const int wg = static_cast<int>(threadIdx.x) / 128;
    int64_t it = 0;
    if (wg == 0) {
      release_registers<kGather ? kGatherProducerRegs : kDwProducerRegs>();
      // Thread 0 loads by TMA; kGather: all 128 copy the gathered k-rows, thread p row p % 64.
      if (!kGather && threadIdx.x != 0) return;
      const int p = static_cast<int>(threadIdx.x);
      for (int64_t u = blockIdx.x; u < units.total(); u += gridDim.x) {
        const DwUnit w = units.find<C::kBN>(offsets, u);
        const int m0 = static_cast<int>(w.m0), n0 = static_cast<int>(w.n0), slices = w.slices();
        const bool second = w.second;
        const int64_t k1 = w.k1;
        for (int t = 0; t < slices; ++t, ++it) {
          ring.wait_free(it);
          const uint32_t stage = ring.stage(it), bar = ring.full(it);
          const int32_t k = static_cast<int32_t>(w.k0) + t * kBK;
          if (p == 0) {
            constexpr uint32_t kTmaBytes =
                (kGatherDy ? 0 : C::kABytes) + (kGatherX ? 0 : C::kBBytes);
            if constexpr (kTmaBytes > 0)
              mbar_arrive_expect_tx(bar, kTmaBytes);
            else
              mbar_arrive(bar);
            if constexpr (!kGatherDy) {
#pragma unroll
              for (int j = 0; j < kBM / 64; ++j)
                tma_load_2d(stage + j * Sw128::kBlockBytes, second ? &map_dy2 : &map_dy, bar,
                            m0 + 64 * j, k);
            }
            if constexpr (!kGatherX) {
#pragma unroll
              for (int j = 0; j < C::kBN / 64; ++j)
                tma_load_2d(stage + C::kABytes + j * Sw128::kBlockBytes, &map_x, bar, n0 + 64 * j,
                            k);
            }
          }
          if constexpr (kGatherDy)
            gather_k_rows<kBM / 64>(stage, p, dy_src, row_token, tokens, k, k1, m0, out);
          if constexpr (kGatherX)
            gather_k_rows<C::kBN / 64>(stage + C::kABytes, p, x_src, row_token, tokens, k, k1, n0,
                                       in);
          if constexpr (kGather) cp_async_mbar_arrive(bar);
        }
      }
    } else if constexpr (kPingPong) {
      claim_registers<kGather ? kGatherMathRegs : kDwMathRegs>();
      const int g = wg - 1;
      const uint32_t turns = shared_addr(turn);
      // The block's unit j is warpgroup j % 2's; units differ in k-slices, so each warpgroup
      // walks them all to count the ring's slices.
      int64_t j = 0;  // (this warpgroup's j / 2-th)
      for (int64_t u = blockIdx.x; u < units.total(); u += gridDim.x, ++j) {
        const DwUnit w = units.find<C::kBN>(offsets, u);
        const int slices = w.slices();
        if (j % 2 != g) {
          it += slices;
          continue;
        }
        const int tail = w.tail();
        const bool both = w.m0 + 64 < out;  // else dw's rows end in the tile's first half
        float acc[2][C::kAcc];
        // (kGather: the copies into the stage are the generic proxy's, the wgmma read it
        // through the async proxy)
        auto before = [&](int t, uint32_t stage) {
          if constexpr (kGather) fence_proxy_async_smem();
          if (t == slices - 1 && tail != 0) zero_k_tail(stage, 0, both ? 2 : 1, tail, g);
        };
        if (both)
          pingpong_math_loop<C, T, false, false, true>(acc, ring, it, slices, turns, g, j / 2,
                                                       before);
        else
          pingpong_math_loop<C, T, false, false, false>(acc, ring, it, slices, turns, g, j / 2,
                                                        before);
        it += slices;
        dw_tile_reduce<C>(w, tiles, g, true, w.second ? dw2 : dw, out, in, overwrite,
                          [&](auto&& add) {
                            for_each_math_pair<C>(acc[0], 0, add);
                            if (both) for_each_math_pair<C>(acc[1], 1, add);
                          });
      }
    } else {
      claim_registers<kGather ? kGatherMathRegs : kDwMathRegs>();
      const int g = wg - 1;
      for (int64_t u = blockIdx.x; u < units.total(); u += gridDim.x) {
        const DwUnit w = units.find<C::kBN>(offsets, u);
        const int slices = w.slices(), tail = w.tail();
        // A tile whose rows of this warpgroup's half lie past `out` (the last tile of an output
        // count of 1-64 past a multiple of 128, as moe-fine's 704) adds nothing: the other
        // warpgroup has the tensor cores to itself. The stages are still waited for and freed,
        // and a split tile's publish still counts this warpgroup (barrier 3).
        if (w.m0 + 64 * g >= out) {
          skip_slices(ring, it, slices);
          it += slices;
          if (w.chunks > 1) named_barrier_sync(3, 256);
          continue;
        }
        float acc[C::kAcc];
        tma_math_loop<C, T, false, false>(acc, ring, it, slices, g, [&](int t, uint32_t stage) {
          // kGather: the copies into the stage are the generic proxy's, the wgmma read it
          // through the async proxy
          if constexpr (kGather) fence_proxy_async_smem();
          if (t == slices - 1 && tail != 0) zero_k_tail(stage, g, 1, tail, g);  // its own block
        });
        it += slices;
        dw_tile_reduce<C>(w, tiles, g, false, w.second ? dw2 : dw, out, in, overwrite,
                          [&](auto&& add) { for_each_math_pair<C>(acc, g, add); });
      }
    }
  }
}

}  // namespace moe::cuda_detail::grouped_sm90
