// The sm_90a grouped GEMM's rows kernel (y = x w_e^T, dx = dy w_e, the pair's one product, the
// fused SwiGLU forward, the gathering forms), in each schedule (Sched). Included by
// grouped_wgmma_sm90.cu alone.
#pragma once

#include <type_traits>

#include "cuda/adam_rider.cuh"
#include "cuda/grouped_sm90_parts.cuh"

namespace moe::cuda_detail::grouped_sm90 {

// The rows kernel's registers per thread: the producer warpgroup's (its warps 1-3 carry an AdamW
// rider: at 40 they spilled 72 bytes) and the math warpgroups' (at most 3 x 168 together, the
// block's: setmaxnreg.inc only takes what a .dec gave back). The SwiGLU kernel carries no rider
// (its epilogue spilled 64 bytes at 216) and keeps 40 + 2 x 232. kMulticast: the producer's
// multicast loads spilled at 64 (with the rider: 8 bytes) and at 40 (SwiGLU: 4), so 72 + 2 x 216
// and 56 + 2 x 224, each the block's whole file.
template <bool kSwiglu, bool kMulticast = false>
constexpr int kRowsProducerRegs = kSwiglu      ? (kMulticast ? 56 : 40)
                                  : kMulticast ? 72
                                               : 64;
template <bool kSwiglu, bool kMulticast = false>
constexpr int kRowsMathRegs = kSwiglu ? (kMulticast ? 224 : 232) : 216;
// The deferred epilogue's meeting of the two math warpgroups after each tile's main loop (ids 1
// and 2: each warpgroup's own).
constexpr int kDeferBarrier = 3;

template <bool kSwiglu, bool kMulticast>
constexpr bool kRowsRegsFit = setmaxnreg_fits(kRowsProducerRegs<kSwiglu, kMulticast>,
                                              kRowsMathRegs<kSwiglu, kMulticast>);
static_assert(kRowsRegsFit<false, false> && kRowsRegsFit<false, true> &&
                  kRowsRegsFit<true, false> && kRowsRegsFit<true, true>,
              "setmaxnreg within the block");

// Rows kernel, persistent: block b runs tiles b, b + gridDim.x, ... of (row tile, column tile),
// columns fastest. While the math warps store one tile, the producer already streams the next
// tile's slices. A: a tensor map over a [rows, k_total] (box 64 k x 128 rows; the rows past the
// expert belong to the next one and only feed output rows that are not stored). B: over w as
// [E, n_total, k_total] (kBKFast, box 64 x kBN x 1) or [E, k_total, n_total] (box 64 x 64 x 1,
// kBN / 64 of them per slice), so each expert's bounds zero-fill on their own.
// kSwiglu (forward, kBN = 256): a tile is 128 features, w1's rows (map_b, box 64 x 128 x 1) in
// the B tile's first 128 rows and w3's (map_b2) in the next 128; the epilogue stores gate, up
// and h = row_w * silu(gate) * up (store_tile). Ping-pong (kBN = 128): 64 features, 64 rows each.
// kGather: A's rows are gathered, row r being row row_token[r] of a_src [a_tokens, k_total] (the
// MoE permute fused into the loads; map_a unused): the producer warpgroup's 128 threads copy
// them by cp.async (gathered_row, copy_warp_lines).
// kSched: pingpong (C = PingPong): the tile's 128 rows on one math warpgroup, the warpgroups
// alternating (pingpong_wait_turn); multicast: launched in clusters of two
// blocks, which share each B slice (sched_row_tile, load_b). kDefer (cooperative only): the
// deferred epilogue (deferred_staging; MOE_GROUPED_DEFER), warpgroup 0's held stage freed
// after the next tile's slice release_at is issued (tma_math_loop; unused without kDefer).
template <class C, class T, bool kBKFast, bool kSwiglu, bool kGather = false,
          Sched kSched = Sched::cooperative, bool kDefer = false>
__global__ void __launch_bounds__(kTmaThreads, 1) grouped_tma_rows_kernel(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    const __grid_constant__ CUtensorMap map_b2, const __grid_constant__ CUtensorMap map_a2,
    const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_up,
    const __grid_constant__ CUtensorMap map_h, T* c, T* c_up, T* c_h, const float* row_w,
    const int32_t* offsets, int experts, int64_t rows, int64_t n_total, int64_t k_total,
    int n_tiles, int64_t tiles, const T* a_src, const int32_t* row_token, int64_t a_tokens,
    const AdamRider rider, bool pair, int release_at) {
  constexpr bool kPingPong = is_pingpong(kSched), kMulticast = is_multicast(kSched);
  static_assert(!kSwiglu || (kBKFast && C::kBN == (kPingPong ? 128 : 256)),
                "SwiGLU follows the forward product, gate and up 128 columns each (ping-pong: 64)");
  constexpr int kTileN = kSwiglu ? C::kBN / 2 : C::kBN;  // output columns per tile
  if constexpr (kHasWgmma) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[C::kStages], empty[C::kStages];
    // Every tile starts with a scan of the offsets: from shared memory it costs a few hundred
    // cycles, from global memory a chain of dependent loads.
    __shared__ int32_t shared_offsets[kSharedOffsets + 1];
    if (experts <= kSharedOffsets) {
      for (int i = static_cast<int>(threadIdx.x); i <= experts; i += kTmaThreads)
        shared_offsets[i] = offsets[i];
      offsets = shared_offsets;
    }
    // The math warpgroups done with their tiles (the riders stop at 2).
    __shared__ int math_done;
    if (threadIdx.x == 0) math_done = 0;
    __shared__ __align__(8) uint64_t turn[2];  // kPingPong
    // (its barrier publishes the offsets' copy and math_done)
    const TmaRing<C> ring =
        make_ring<C, kSched>(smem, full, empty, kGather ? 1 + 128 : 1, kPingPong ? turn : nullptr);
    // kMulticast: the pair's barriers are set up before either block's TMA writes into the
    // other's ring; the pair walks tiles first(), first() + step(), ... (its blocks the same
    // ones). (first and step are read where used: the ping-pong warpgroups spilled them.)
    if constexpr (kMulticast) cluster_sync();
    const uint32_t rank = kMulticast ? cluster_rank() : 0;
    auto first = [] { return kMulticast ? blockIdx.x / 2 : blockIdx.x; };
    auto step = [] { return kMulticast ? gridDim.x / 2 : gridDim.x; };
    const int wg = static_cast<int>(threadIdx.x) / 128;
    // pair (!kSwiglu, !kGather): the k-slices of (map_a, map_b), then as many of (map_a2, map_b2)
    const int half_slices = static_cast<int>((k_total + kBK - 1) / kBK);
    const int slices = pair ? 2 * half_slices : half_slices;
    int64_t it = 0;
    // Slice t of B for tile column n0 of expert e into `stage`, counted on `bar`.
    // (second: the pair's second B, map_b2, at its own slice t). kMulticast: this block loads
    // its half (rank 0 the first, w1's for SwiGLU) into both blocks' stages, the peer the other.
    auto load_b = [&](uint32_t stage, uint32_t bar, int t, int n0, int e, bool second) {
      if constexpr (kMulticast) {
        const CUtensorMap* map =
            kSwiglu ? (rank == 0 ? &map_b : &map_b2) : (second ? &map_b2 : &map_b);
        constexpr uint16_t kBoth = 0x3;
        if constexpr (kBKFast) {  // SwiGLU: w1's or w3's 128 rows; else half of kBN (host's box)
          const int half = kSwiglu ? 0 : C::kBN / 2 * static_cast<int>(rank);
          tma_load_3d_multicast(stage + C::kABytes + (C::kBN / 2) * Sw128::kRowBytes * rank, map,
                                bar, t * kBK, n0 + half, e, kBoth);
        } else {
#pragma unroll
          for (int i = 0; i < C::kBN / 128; ++i) {
            const int j = C::kBN / 128 * static_cast<int>(rank) + i;
            tma_load_3d_multicast(stage + C::kABytes + j * Sw128::kBlockBytes, map, bar,
                                  n0 + 64 * j, t * kBK, e, kBoth);
          }
        }
      } else if constexpr (kSwiglu) {
        tma_load_3d(stage + C::kABytes, &map_b, bar, t * kBK, n0, e);
        tma_load_3d(stage + C::kABytes + kTileN * Sw128::kRowBytes, &map_b2, bar, t * kBK, n0, e);
      } else if constexpr (kBKFast) {
        tma_load_3d(stage + C::kABytes, second ? &map_b2 : &map_b, bar, t * kBK, n0, e);
      } else {
#pragma unroll
        for (int j = 0; j < C::kBN / 64; ++j)
          tma_load_3d(stage + C::kABytes + j * Sw128::kBlockBytes, second ? &map_b2 : &map_b, bar,
                      n0 + 64 * j, t * kBK, e);
      }
    };
    if (wg == 0) {
      release_registers<kRowsProducerRegs<kSwiglu, kMulticast>>();
      // Thread 0 loads by TMA (warp 0 scans the offsets); kGather: all 128 threads copy A's rows,
      // thread p row p. Otherwise warps 1-3 carry the rider's AdamW (if any) until the math
      // warpgroups are done.
      // (kMulticast: no thread exits before the cluster's last barrier, below)
      const bool loads = kGather || threadIdx.x < 32;
      if (!loads) {
        if constexpr (!kSwiglu) {
          if (rider.quads > 0) ride_adam(rider, &math_done, 2);
        }
        if constexpr (!kMulticast) return;
      }
      const int p = static_cast<int>(threadIdx.x);
      for (int64_t tile = first(); loads && tile < tiles; tile += step()) {
        int e = 0;
        int64_t r0 = 0, r1 = 0;
        if (!sched_row_tile<kMulticast>(offsets, experts, rows, tile / n_tiles, rank, &e, &r0, &r1))
          break;
        const int n0 = static_cast<int>(tile % n_tiles) * kTileN;
        // kGather: the A row thread p copies (null past the expert's end: zeros, which feed
        // output rows that are not stored)
        const T* src = kGather
                           ? gathered_row(a_src, row_token, r0 + p, r0 + p < r1, a_tokens, k_total)
                           : nullptr;
        if (kGather || p == 0) {
          for (int t = 0; t < slices; ++t, ++it) {
            ring.wait_free(it);
            const uint32_t stage = ring.stage(it), bar = ring.full(it);
            if (p == 0) {
              mbar_arrive_expect_tx(bar, kGather ? C::kBBytes : C::kStageBytes);
              const bool second = pair && t >= half_slices;
              const int tk = second ? t - half_slices : t;
              if constexpr (!kGather)
                tma_load_2d(stage, second ? &map_a2 : &map_a, bar, tk * kBK,
                            static_cast<int32_t>(r0));
              load_b(stage, bar, tk, n0, e, second);
            }
            if constexpr (kGather) {
              copy_warp_lines(stage, p & ~31, src, a_src, t * kBK, k_total);
              cp_async_mbar_arrive(bar);
            }
          }
        }
        __syncwarp();
      }
    } else if constexpr (kPingPong) {
      claim_registers<kRowsMathRegs<kSwiglu, kMulticast>>();
      const int g = wg - 1;
      const uint32_t staging = ring.base + C::kStages * C::kStageBytes + g * kStagingBytes / 2;
      const uint32_t turns = shared_addr(turn);
      // kSwiglu: each math warpgroup's 128 routing weights, after the staging, in the 1 KiB kept
      // for aligning the ring (as the cooperative branch's 64; all of it here).
      const uint32_t row_scales =
          ring.base + C::kStages * C::kStageBytes + kStagingBytes + g * kBM * 4;
      if (kSwiglu && ring.base != shared_addr(smem)) __trap();  // never
      // The block's tile j = g, g + 2, ... (this warpgroup's tile j / 2): every tile has
      // `slices` k-slices, so tile j's are ring slices j * slices on. (kMulticast's rank is read
      // again where used: held through the loop, it spilled.)
      // (kMulticast: 32-bit tile indices, a launch's tiles being far fewer than 2^31; 64-bit ones
      // spilled there, and 32-bit ones in the plain ping-pong kernel: register allocation)
      using Index = std::conditional_t<kMulticast, uint32_t, int64_t>;
      for (Index tile = first() + g * Index(step()); tile < tiles; tile += 2 * Index(step())) {
        // (from the tile: a second loop counter spilled 4 bytes)
        const Index j = (tile - first()) / step();
        int e = 0;
        int64_t r0 = 0, r1 = 0;
        if (!sched_row_tile<kMulticast>(offsets, experts, rows, tile / n_tiles,
                                        kMulticast ? cluster_rank() : 0, &e, &r0, &r1))
          break;
        const int64_t n0 = (tile % n_tiles) * kTileN;
        const bool both = r0 + 64 < r1;  // else the tile's real rows end in its first half
        float acc[2][C::kAcc];
        // kGather: the copies into the stage are the generic proxy's, the wgmma read it through
        // the async proxy
        auto before = [](int, uint32_t) {
          if constexpr (kGather) fence_proxy_async_smem();
        };
        // (kMulticast: a block with none of the pair tile's rows, its expert ended, still computes
        // a first half that is not stored: it takes its turn and frees its stages)
        if (both)
          pingpong_math_loop<C, T, true, kBKFast, true, kMulticast>(acc, ring, j * slices, slices,
                                                                    turns, g, j / 2, before);
        else
          pingpong_math_loop<C, T, true, kBKFast, false, kMulticast>(acc, ring, j * slices, slices,
                                                                     turns, g, j / 2, before);
        if constexpr (kSwiglu) fetch_row_scales(g, row_scales, row_w, r0, r1, 128);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 1 && !both) break;
          if constexpr (kSwiglu) {
            // The tile's 64 features: gate (columns 0-63) to c and up (64-127) to c_up at n0 in
            // one piece, then h = row_w * silu(gate) * up to c_h.
            store_piece<T>(g, staging, c, &map_c, r0 + 64 * h, r1, n0, n_total,
                           acc_pairs<T>(acc[h], 0), 0, SecondBox<T>{c_up, &map_up, n0});
            store_piece<T, true, 1>(g, staging, c_h, &map_h, r0 + 64 * h, r1, n0, n_total,
                                    swiglu_pairs<T>(acc[h], 8), row_scales + 64 * 4 * h);
          } else {
            store_piece<T>(g, staging, c, &map_c, r0 + 64 * h, r1, n0, n_total,
                           acc_pairs<T>(acc[h], 0));
          }
        }
      }
      if (threadIdx.x % 128 == 0) {
        tma_store_wait_all();  // its TMA stores have landed
        atomicAdd(&math_done, 1);
      }
    } else {
      claim_registers<kRowsMathRegs<kSwiglu, kMulticast>>();
      const int g = wg - 1;
      const uint32_t staging_all = ring.base + C::kStages * C::kStageBytes;
      const uint32_t staging = staging_all + g * kStagingBytes / 2;
      // kSwiglu: each math warpgroup's 64 routing weights, after the staging, in the 1 KiB kept
      // for aligning the ring (unused: the dynamic shared memory starts 1024-aligned, as its
      // declaration asks; the block is at the 227 KiB limit, and static shared memory for them
      // would round the static part up by another KiB).
      const uint32_t row_scales = ring.base + C::kStages * C::kStageBytes + kStagingBytes;
      if (kSwiglu && ring.base - shared_addr(smem) > 1024 - 2 * 64 * 4) __trap();  // never
      // (kMulticast: the peer's empty[0], on which this block's math warps free stages too)
      const uint32_t peer_empty0 = kMulticast ? cluster_peer_address(ring.empty0, rank ^ 1u) : 0;
      // kDefer: deferred_staging (cooperative kernels only: a multicast stage is the peer's
      // too; launched with k_total > 0, so a tile has a last slice whose stage warpgroup 0
      // holds); warpgroup 0's held stage, if any (held: its ring slice).
      static_assert(!kDefer || kSched == Sched::cooperative, "the deferred epilogue's schedule");
      // (release_at <= 2, the host's: the next tile's slices up to release_at must not need the
      // held stage, whose slice + kStages comes after them)
      static_assert(!kDefer || C::kStages >= 4, "the held stage's release");
      const bool hold = kDefer && g == 0;
      int64_t held = -1;
      for (int64_t tile = first(); tile < tiles; tile += step(), it += slices) {
        int e = 0;
        int64_t r0 = 0, r1 = 0;
        if (!sched_row_tile<kMulticast>(offsets, experts, rows, tile / n_tiles, rank, &e, &r0, &r1))
          break;
        const int64_t n0 = (tile % n_tiles) * kTileN;
        // A tile cut at its expert's end with no real rows in this warpgroup's half (an expert's
        // last 1-64 rows, or a cold expert's few) leaves its wgmma to the other warpgroup, which
        // then has the SM's tensor cores to itself: the stages are still waited for and freed.
        const bool real = r0 + 64 * g < r1;
        if (!real) {
          release_held(ring, held);
          held = -1;
          skip_slices<C, kMulticast>(ring, it, slices, peer_empty0);
          if constexpr (kDefer) named_barrier_sync(kDeferBarrier, 256);
          continue;
        }
        float acc[C::kAcc];
        // kGather: the copies into the stage are the generic proxy's, the wgmma read it through
        // the async proxy
        tma_math_loop<C, T, true, kBKFast, kMulticast>(
            acc, ring, it, slices, g,
            [](int, uint32_t) {
              if constexpr (kGather) fence_proxy_async_smem();
            },
            peer_empty0, hold, held, release_at);
        if constexpr (kDefer) {
          // Warpgroup 1's wgmma may still read the last stage, where warpgroup 0 stages: both
          // meet first (every tile: warpgroup 1 skips none of them without meeting).
          named_barrier_sync(kDeferBarrier, 256);
          const int64_t last = it + slices - 1;
          store_tile<C, T, kSwiglu>(
              acc, g, deferred_staging(g, hold ? ring.stage(last) : staging_all), c, c_up, c_h,
              &map_c, &map_up, &map_h, row_w, row_scales + 256 * g, r0 + 64 * g, r1, n0, n_total);
          held = hold ? last : -1;
          // A tile cut at its expert's end in this half was stored from the staging by the
          // warps themselves (store_piece): the stage is free once all of them have read it.
          if (hold && r0 + 64 * g + 64 > r1) {
            fence_proxy_async_smem();  // (the reads before the TMA loads that refill it)
            named_barrier_sync(1 + g, 128);
            release_held(ring, held);
            held = -1;
          }
        } else {
          store_tile<C, T, kSwiglu>(acc, g, one_staging(staging), c, c_up, c_h, &map_c, &map_up,
                                    &map_h, row_w, row_scales + 256 * g, r0 + 64 * g, r1, n0,
                                    n_total);
        }
      }
      release_held(ring, held);
      if (threadIdx.x % 128 == 0) {
        tma_store_wait_all();  // its TMA stores have landed
        atomicAdd(&math_done, 1);
      }
    }
    // kMulticast: neither block exits while the other may still write into its ring or arrive on
    // its barriers.
    if constexpr (kMulticast) cluster_sync();
  }
}

}  // namespace moe::cuda_detail::grouped_sm90
