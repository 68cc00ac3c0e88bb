// The sm_90a grouped GEMM kernels' shared parts (grouped_wgmma_sm90.cu's design comment says how
// they fit): tile and ring configurations, the TMA ring and its barriers, the math warpgroups'
// main loops (cooperative and ping-pong), the multicast pair's row tiles, the epilogue's staged
// stores and the gathering copies. Included by grouped_wgmma_sm90.cu alone (with
// grouped_sm90_rows.cuh and grouped_sm90_dw.cuh, the kernels).
#pragma once

#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/grouped_tiles.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/silu.cuh"
#include "cuda/tma_sm90.cuh"
#include "cuda/wgmma_sm90.cuh"

namespace moe::cuda_detail::grouped_sm90 {

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

constexpr int kBM = 128;  // rows of the block tile: two warpgroups of 64
constexpr int kBK = 64;   // k per slice: one 128-byte swizzle row of 16-bit elements

using Wide = Sm90Cfg<256, 4>;    // 192 KiB: one block per SM
using Narrow = Sm90Cfg<128, 4>;  // 128 KiB: one block per SM, half the accumulators
// The ping-pong kernels' ring (MOE_GROUPED_SM90=pingpong): each math warpgroup computes a whole
// 128 x 128 tile, the two taking turns, so a stage holds one warpgroup's slice; 6 of them keep
// the same 192 KiB in flight as Wide's 4.
using PingPong = Sm90Cfg<128, 6>;

// How a kernel's two math warpgroups share the work (MOE_GROUPED_SM90): cooperative (both on
// one 128-row tile, 64 rows each), pingpong (alternate whole tiles, pingpong_wait_turn) or
// multicast (cooperative, the blocks in clusters of two on adjacent row tiles of one expert, each
// loading half of the B tile they share by TMA multicast: sched_row_tile; rows kernels only), or
// both (pingpong_multicast: ping-pong blocks in such pairs; rows kernels only).
enum class Sched { cooperative, pingpong, multicast, pingpong_multicast };
constexpr bool is_pingpong(Sched s) {
  return s == Sched::pingpong || s == Sched::pingpong_multicast;
}
constexpr bool is_multicast(Sched s) {
  return s == Sched::multicast || s == Sched::pingpong_multicast;
}
static_assert(Wide::kABytes == kBM * kBK * 2 && Sw128::kBlockBytes == kBK * Sw128::kRowBytes,
              "tiles of 128 rows and 64-wide k-slices of 16-bit elements");

template <class T, int kN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_step(float (&d)[kN / 2], uint64_t da, uint64_t db) {
  if constexpr (kN == 256)
    wgmma_m64n256<T, kTransA, kTransB>(d, da, db);
  else
    wgmma_m64n128<T, kTransA, kTransB>(d, da, db);
}

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

template <int kAlign = 1024>
__device__ __forceinline__ uint32_t ring_base(unsigned char* smem) {
  return (shared_addr(smem) + (kAlign - 1)) & ~uint32_t(kAlign - 1);
}

constexpr int kTmaThreads = 384;  // a producer warpgroup and two math warpgroups
// Experts whose offsets the rows kernel keeps in shared memory (more: it reads them from global).
constexpr int kSharedOffsets = 256;
// The rows kernel's output staging, after its ring: a 64 x 128 piece of the tile per math
// warpgroup, as two 64 x 64 boxes of 128-byte lines with their 16-byte chunks swizzled
// (chunk ^ line % 8: TMA's 128-byte swizzle; 1024-aligned, as that needs).
constexpr int kStagingBoxBytes = 64 * 128;
constexpr int kStagingBytes = 2 * 2 * kStagingBoxBytes;
template <class C>
constexpr size_t kRowsSmemBytes = C::kSmemBytes + kStagingBytes;
// Shared memory per block on sm_90: 227 KiB, static and dynamic together.
static_assert(kRowsSmemBytes<Sm90Cfg<256, 4>> + 4 * (kSharedOffsets + 1) + 16 * 4 <= 232448,
              "the rows kernel's ring, staging, offsets and barriers fit in 227 KiB");
static_assert(kRowsSmemBytes<PingPong> + 4 * (kSharedOffsets + 1) + 16 * 7 <= 232448,
              "the ping-pong rows kernel's ring, staging, offsets, barriers and turns fit");

// Ring bookkeeping shared by the producer and the math warps: slice number `it` (counted over
// every tile the block runs) uses stage it % kStages in round it / kStages.
template <class C>
struct TmaRing {
  uint32_t base;   // shared address of stage 0 (1024-byte aligned)
  uint32_t full0;  // shared address of full[0]; full[s] = full0 + 8 s
  uint32_t empty0;
  __device__ __forceinline__ uint32_t stage(int64_t it) const {
    return base + static_cast<uint32_t>(it % C::kStages) * C::kStageBytes;
  }
  __device__ __forceinline__ uint32_t full(int64_t it) const {
    return full0 + 8 * static_cast<uint32_t>(it % C::kStages);
  }
  __device__ __forceinline__ uint32_t empty(int64_t it) const {
    return empty0 + 8 * static_cast<uint32_t>(it % C::kStages);
  }
  __device__ __forceinline__ static uint32_t parity(int64_t it) {
    return static_cast<uint32_t>((it / C::kStages) & 1);
  }
  // Producer side: waits until slice it's stage is free (the math of slice it - kStages retired).
  // Every producer thread that writes the stage waits; one then arms its full barrier.
  __device__ __forceinline__ void wait_free(int64_t it) const {
    if (it >= C::kStages) mbar_wait(empty(it), parity(it) ^ 1u);
  }
};

// Sets up the ring in the dynamic shared memory and the barriers: all threads call it.
// full_arrivals: the arrivals that fill a stage besides its bytes (the producer's expect_tx; the
// gathering rows kernel's cp.async copies too). A stage is freed by one arrival per math warp
// that read it (kSched): all 8 (cooperative), the 4 of the one warpgroup that computes its slice
// (pingpong), those of both blocks of the cluster pair (multicast: the peer's TMA writes into
// this block's stage too). turns (pingpong): the two turn barriers, one arrival each.
template <class C, Sched kSched = Sched::cooperative>
__device__ __forceinline__ TmaRing<C> make_ring(unsigned char* smem, uint64_t* full,
                                                uint64_t* empty, int full_arrivals = 1,
                                                uint64_t* turns = nullptr) {
  constexpr int kMathWarps = kTmaThreads / 32 - 4;
  constexpr int kEmptyArrivals =
      (is_pingpong(kSched) ? kMathWarps / 2 : kMathWarps) * (is_multicast(kSched) ? 2 : 1);
  TmaRing<C> r{ring_base(smem), shared_addr(full), shared_addr(empty)};
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(r.full0 + 8 * s, full_arrivals);
      mbar_init(r.empty0 + 8 * s, kEmptyArrivals);
    }
    if constexpr (is_pingpong(kSched)) {
      mbar_init(shared_addr(turns), 1);
      mbar_init(shared_addr(turns) + 8, 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
  return r;
}

// The ping-pong kernels' order: the block's tiles (units, for dw) alternate between the math
// warpgroups, tile j on warpgroup j % 2, which computes all 128 of its rows (two m64 wgmma per
// k16 step) and stores them while the other warpgroup's main loop runs: the tensor cores have
// work during every epilogue, which the cooperative kernels (both warpgroups on one tile, then
// both storing) leave idle. The main loops take turns: warpgroup g waits on turn[g] before its
// first slice and, once it waits on no more stages of the tile, arrives on turn[1 - g]. Besides
// the alternation, the turns are what keep the ring's parity waits sound: without them,
// warpgroup 1 could wait on a stage's full barrier for its slice while that barrier's phase is
// still two rounds behind (warpgroup 0 not yet through its own slices), and a parity wait
// cannot tell phase p from p - 2 (scripts/models/pingpong_barriers.py models the protocol).
// turn0: the shared address of turn[0] (turn[1] = turn0 + 8). Before warpgroup g's k-th main
// loop (k = 0, 1, ...): warpgroup 0's first goes at once; its k-th waits for warpgroup 1's
// (k-1)-th to pass the turn, and warpgroup 1's k-th for warpgroup 0's k-th.
__device__ __forceinline__ void pingpong_wait_turn(uint32_t turn0, int g, int64_t k) {
  if (g == 0 && k == 0) return;
  mbar_wait(turn0 + 8 * g, static_cast<uint32_t>((g == 0 ? k - 1 : k) & 1));
}
// One thread of warpgroup g, after its last wait on a stage of the tile.
__device__ __forceinline__ void pingpong_pass_turn(uint32_t turn0, int g) {
  mbar_arrive(turn0 + 8 * (1 - g));
}

// A math warp's arrival freeing slice it's stage; kPeer (multicast): in the cluster peer's ring
// too (peer_empty0: the peer's empty[0], cluster_peer_address), whose TMA wrote half of it.
template <bool kPeer, class C>
__device__ __forceinline__ void free_stage(const TmaRing<C>& ring, int64_t it,
                                           uint32_t peer_empty0) {
  mbar_arrive(ring.empty(it));
  if constexpr (kPeer) mbar_arrive_remote(peer_empty0 + 8 * static_cast<uint32_t>(it % C::kStages));
}

// The deferred epilogue's held stage (ring slice it; none if it < 0): the warpgroup's thread 0,
// which issued the TMA stores that read it, waits until they have and frees it (its warp's
// arrival, the one the math loop held back).
template <class C>
__device__ __forceinline__ void release_held(const TmaRing<C>& ring, int64_t it) {
  if (it >= 0 && threadIdx.x % 128 == 0) {
    tma_store_wait_read();
    mbar_arrive(ring.empty(it));
  }
}

// Math warpgroup `g` (0 or 1: rows 64g..64g+63 of the tile): acc = the sum over `slices`
// k-slices of ring slices it0, it0 + 1, ... . `before(t, stage)` runs after slice t has landed
// and before its wgmma (the dw kernel masks the rows past the expert there).
// kPeer, peer_empty0: as free_stage's.
// Deferred epilogues (deferred_staging): with hold_last, the warpgroup's thread 0 does not
// free the last slice's stage (the epilogue stages the tile there); release_it >= 0: the stage
// of ring slice release_it, held by the previous tile's epilogue, which thread 0 frees once its
// TMA stores have read it (release_held), right after this tile's slice release_at is issued
// (or after the loop, for a tile of fewer slices): later gives the stores longer to read it
// before thread 0 waits for them, and the producer less time to refill it.
template <class C, class T, bool kAKFast, bool kBKFast, bool kPeer = false, class Before>
__device__ __forceinline__ void tma_math_loop(float (&acc)[C::kAcc], const TmaRing<C>& ring,
                                              int64_t it0, int slices, int g, Before&& before,
                                              uint32_t peer_empty0 = 0, bool hold_last = false,
                                              int64_t release_it = -1, int release_at = 0) {
#pragma unroll
  for (int i = 0; i < C::kAcc; ++i) acc[i] = 0.0f;
  const bool signals = (threadIdx.x % 32) == 0;
  for (int t = 0; t < slices; ++t) {
    const int64_t it = it0 + t;
    mbar_wait(ring.full(it), TmaRing<C>::parity(it));
    const uint32_t stage = ring.stage(it);
    before(t, stage);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s)
      wgmma_step<T, C::kBN, kAKFast ? 0 : 1, kBKFast ? 0 : 1>(
          acc, step_desc<kAKFast>(stage, g * 64, s), step_desc<kBKFast>(stage + C::kABytes, 0, s));
    wgmma_commit();
    if (t == release_at) release_held(ring, release_it);
    wgmma_wait<1>();  // slice t - 1's wgmma have retired: its stage is free
    fence_accumulators(acc);
    if (t > 0 && signals) free_stage<kPeer>(ring, it - 1, peer_empty0);
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
  if (slices <= release_at) release_held(ring, release_it);
  const bool holds = hold_last && threadIdx.x % 128 == 0;
  if (slices > 0 && signals && !holds) free_stage<kPeer>(ring, it0 + slices - 1, peer_empty0);
}

// The ping-pong main loop of math warpgroup g's k-th tile: acc[h] = rows 64h..64h+63 of the
// block tile over ring slices it0 .. it0 + slices - 1 (kBoth: rows 64-127 too; else the tile's
// real rows end before them and only acc[0] is computed), between the turns (pingpong_wait_turn;
// turns: the shared address of turn[0]). before(t, stage) as in tma_math_loop. kBoth is a
// template argument, the caller branching once per tile: a test of a runtime flag between the
// wgmma made ptxas serialize every wgmma of the kernel (C7520, "WG.AR in divergent path").
// kPeer (pingpong_multicast): as free_stage's, the peer's empty[0] found at each arrival (held
// in a register through the loop, it and the rank spilled).
template <class C, class T, bool kAKFast, bool kBKFast, bool kBoth, bool kPeer = false,
          class Before>
__device__ __forceinline__ void pingpong_math_loop(float (&acc)[2][C::kAcc], const TmaRing<C>& ring,
                                                   int64_t it0, int slices, uint32_t turns, int g,
                                                   int64_t k, Before&& before) {
  auto peer_empty0 = [&] {
    return kPeer ? cluster_peer_address(ring.empty0, cluster_rank() ^ 1u) : 0u;
  };
#pragma unroll
  for (int i = 0; i < C::kAcc; ++i) acc[0][i] = acc[1][i] = 0.0f;
  pingpong_wait_turn(turns, g, k);
  const bool signals = (threadIdx.x % 32) == 0;
  for (int t = 0; t < slices; ++t) {
    const int64_t it = it0 + t;
    mbar_wait(ring.full(it), TmaRing<C>::parity(it));
    const uint32_t stage = ring.stage(it), b = stage + C::kABytes;
    before(t, stage);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s) {
      const uint64_t db = step_desc<kBKFast>(b, 0, s);
      wgmma_step<T, C::kBN, kAKFast ? 0 : 1, kBKFast ? 0 : 1>(acc[0],
                                                              step_desc<kAKFast>(stage, 0, s), db);
      if constexpr (kBoth)
        wgmma_step<T, C::kBN, kAKFast ? 0 : 1, kBKFast ? 0 : 1>(
            acc[1], step_desc<kAKFast>(stage, 64, s), db);
    }
    wgmma_commit();
    wgmma_wait<1>();  // slice t - 1's wgmma have retired: its stage is free
    fence_accumulators(acc[0]);
    fence_accumulators(acc[1]);
    if (t > 0 && signals) free_stage<kPeer>(ring, it - 1, peer_empty0());
  }
  // This warpgroup waits on no more stages of the tile: the other one's main loop may start, its
  // first wgmma queued behind this one's last.
  if (threadIdx.x % 128 == 0) pingpong_pass_turn(turns, g);
  wgmma_wait<0>();
  fence_accumulators(acc[0]);
  fence_accumulators(acc[1]);
  if (slices > 0 && signals) free_stage<kPeer>(ring, it0 + slices - 1, peer_empty0());
}

// A math warpgroup with nothing to compute in slices it0 .. it0 + slices - 1: it waits for each
// to land and frees it, as tma_math_loop does, so the ring's barriers see every math warp's
// arrival in every phase (an arrival before its stage is full could count toward the phase
// before).
// kPeer, peer_empty0: as free_stage's.
template <class C, bool kPeer = false>
__device__ __forceinline__ void skip_slices(const TmaRing<C>& ring, int64_t it0, int slices,
                                            uint32_t peer_empty0 = 0) {
  const bool signals = (threadIdx.x % 32) == 0;
  for (int t = 0; t < slices; ++t) {
    const int64_t it = it0 + t;
    mbar_wait(ring.full(it), TmaRing<C>::parity(it));
    if (signals) free_stage<kPeer>(ring, it, peer_empty0);
  }
}

// The multicast schedule's tiles (kMulticast): the cluster pair's tile `tile` is a 256-row tile
// of one expert (find_row_tile<256>), the block of rank r taking its rows 128 r .. 128 r + 127;
// where the expert ends first, [r0, r1) is empty, and the block still loads its half of each B
// slice and frees its stages. Otherwise find_row_tile's 128-row tile. (Not grouped_tiles.cuh's
// block_row_tile, which syncs the whole block: in a warp-specialised kernel it would hang.)
template <bool kMulticast>
__device__ __forceinline__ bool sched_row_tile(const int32_t* offsets, int experts, int64_t rows,
                                               int64_t tile, uint32_t rank, int* e, int64_t* r0,
                                               int64_t* r1) {
  if constexpr (kMulticast) {
    int64_t s0 = 0, s1 = 0;
    if (!find_row_tile<2 * kBM>(offsets, experts, rows, tile, e, &s0, &s1)) return false;
    *r0 = s0 + kBM * int64_t(rank);
    *r1 = s1 < *r0 + kBM ? s1 : *r0 + kBM;  // (below r0: no rows)
    return true;
  } else {
    return find_row_tile<kBM>(offsets, experts, rows, tile, e, r0, r1);
  }
}

// Hands math warpgroup g's accumulator pairs to out(row, col, v0, v1) (col even), row and col
// relative to the block tile (the wgmma accumulator layout of wgmma_sm90.cuh).
template <class C, class Out>
__device__ __forceinline__ void for_each_math_pair(const float (&acc)[C::kAcc], int g, Out&& out) {
  const int t = static_cast<int>(threadIdx.x) % 128;
  const int row = g * 64 + (t / 32) * 16 + (t % 32) / 4;
  const int col = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < C::kBN / 8; ++j) {
    out(row, 8 * j + col, acc[4 * j], acc[4 * j + 1]);
    out(row + 8, 8 * j + col, acc[4 * j + 2], acc[4 * j + 3]);
  }
}

// Stores a 64 x 128 piece of math warpgroup g's output (rows [r0, r1) of it are real) into dst
// [*, n_total] at column n0 through the warpgroup's staging buffer: pair(jj, hr) gives the
// thread's packed pair of columns 8 jj + 2 (t % 4) (+1) of the piece at its row + 8 hr (the
// wgmma accumulator layout). The pairs (4 bytes per thread, 8 rows per warp instruction) go to
// shared memory as two 64 x 64 boxes in TMA's 128-byte swizzle; then, when all 64 rows are real
// and `map` (a tensor map over dst, boxes of 64 x 64) is given, one thread hands both boxes to
// TMA stores and the warpgroup goes on (the next piece first waits until they have read the
// staging); otherwise each warp stores 16-byte chunks of whole rows itself (the rows pass: a
// tile cut at its expert's end must not write the next expert's rows). Storing the pairs
// straight to global memory touched 8 lines per warp instruction and took ~2 us of every ~11 us
// tile at K = 1024. kScaled: each value v of the piece's row i becomes round(v * scale[i]) on its
// way into the staging, scale being the piece's 64 floats in shared memory at `scale`; the
// caller's cp.async brings them (store_tile), the piece waits for them, and each thread reads the
// two it needs (its rows row0 and row0 + 8).
// kBoxes = 1: a 64 x 64 piece, box 0 alone (pair's jj < 8). box1: where the second box goes
// when it is not beside the first (the ping-pong SwiGLU tile's up columns, to c_up at the gate's
// column); by default dst at column n0 + 64.
template <class T>
struct SecondBox {
  T* dst = nullptr;  // null: beside the first box
  const CUtensorMap* map = nullptr;
  int64_t n0 = 0;
};

// wait (the deferred epilogue): the thread's TMA store groups that may still be reading, at
// most, before the piece is written (-1: none waited for; the staging is known free).
template <class T, bool kScaled = false, int kBoxes = 2, class Pair>
__device__ __forceinline__ void store_piece(int g, uint32_t staging, T* dst, const CUtensorMap* map,
                                            int64_t r0, int64_t r1, int64_t n0, int64_t n_total,
                                            Pair&& pair, uint32_t scale = 0, SecondBox<T> box1 = {},
                                            int wait = 0) {
  static_assert(kBoxes == 1 || kBoxes == 2, "a piece is one or two 64-column boxes");
  constexpr int kChunks = 8 * kBoxes;  // 8-column chunks of a row
  const bool apart = box1.dst != nullptr;
  const CUtensorMap* map1 = apart ? box1.map : map;
  const int64_t n1 = apart ? box1.n0 : n0 + 64;  // the second box's first column
  T* dst1 = apart ? box1.dst : dst;
  const int t = static_cast<int>(threadIdx.x) % 128;
  const int row0 = (t / 32) * 16 + (t % 32) / 4, col = 4 * (t % 4);
  // Chunk c (0..15, 8 columns each) of row r: box c / 8, line r, 16-byte slot (c % 8) ^ (r % 8).
  auto slot = [&](int r, int c) {
    return staging + (c / 8) * kStagingBoxBytes + r * 128 + (((c % 8) ^ (r & 7)) << 4);
  };
  if (t == 0 && wait == 0) tma_store_wait_read();  // the previous piece's stores read the staging
  if (t == 0 && wait == 1) tma_store_wait_read<1>();
  if constexpr (kScaled) cp_async_wait_all();  // this thread's scales; the barrier: everyone's
  named_barrier_sync(1 + g, 128);              // every thread is done reading the previous piece
  float w[2] = {1.0f, 1.0f};                   // the scales of the thread's two rows
  if constexpr (kScaled) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      asm volatile("ld.shared.f32 %0, [%1];\n"
                   : "=f"(w[hr])
                   : "r"(scale + 4 * (row0 + 8 * hr))
                   : "memory");
  }
#pragma unroll
  for (int jj = 0; jj < kChunks; ++jj) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + 8 * hr;
      uint32_t v = pair(jj, hr);
      if constexpr (kScaled) {
        const T* e = reinterpret_cast<const T*>(&v);
        v = pack2<T>(load(e[0]) * w[hr], load(e[1]) * w[hr]);
      }
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot(row, jj) + col), "r"(v) : "memory");
    }
  }
  if (map != nullptr && r0 + 64 <= r1) {
    fence_proxy_async_smem();  // this thread's pairs, visible to the TMA unit
    named_barrier_sync(1 + g, 128);
    if (t == 0) {
      tma_store_2d(map, staging, static_cast<int32_t>(n0), static_cast<int32_t>(r0));
      if (kBoxes == 2 && n1 < n_total)
        tma_store_2d(map1, staging + kStagingBoxBytes, static_cast<int32_t>(n1),
                     static_cast<int32_t>(r0));
      tma_store_commit();
    }
    return;
  }
  named_barrier_sync(1 + g, 128);
#pragma unroll
  for (int i = 0; i < 64 * kChunks / 128; ++i) {
    const int idx = i * 128 + t, row = idx / kChunks, chunk = idx % kChunks;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(slot(row, chunk))
                 : "memory");
    const bool second = chunk >= 8;
    const int64_t r = r0 + row, n = (second ? n1 - 64 : n0) + chunk * 8;
    // n_total % 8 == 0: a chunk is wholly inside or outside; 16-byte aligned
    if (r >= r1 || n >= n_total) continue;
    *reinterpret_cast<uint4*>((second ? dst1 : dst) + r * n_total + n) = v;
  }
}

// silu(gate) * up for a pair, from gate and up rounded to T first, rounded to T: with the row's
// routing weight applied by store_piece (round(w * that)), the arithmetic of
// swiglu_weighted_forward on the stored gate and up (silu.cuh), so the fused epilogue gives its
// bits.
template <class T>
__device__ __forceinline__ uint32_t swiglu_pair(float g0, float g1, float u0, float u1) {
  const uint32_t gp = pack2<T>(g0, g1), up = pack2<T>(u0, u1);
  const T* gv = reinterpret_cast<const T*>(&gp);
  const T* uv = reinterpret_cast<const T*>(&up);
  return pack2<T>(silu(load(gv[0])) * load(uv[0]), silu(load(gv[1])) * load(uv[1]));
}

// store_piece's pairs of the accumulator columns 8 j0 + (0 .. 127): a plain output.
template <class T, int kN>
__device__ __forceinline__ auto acc_pairs(const float (&acc)[kN], int j0) {
  return [&acc, j0](int jj, int hr) {
    const int j = j0 + jj;
    return pack2<T>(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
  };
}

// store_piece's pairs of h = silu(gate) * up (swiglu_pair), gate at accumulator columns 8 jj and
// up at 8 (up0 + jj).
template <class T, int kN>
__device__ __forceinline__ auto swiglu_pairs(const float (&acc)[kN], int up0) {
  return [&acc, up0](int jj, int hr) {
    const int ju = up0 + jj;
    return swiglu_pair<T>(acc[4 * jj + 2 * hr], acc[4 * jj + 2 * hr + 1], acc[4 * ju + 2 * hr],
                          acc[4 * ju + 2 * hr + 1]);
  };
}

// The SwiGLU epilogue's routing weights: n (64 or 128) of rows r0 .. (zeros past r1) into the
// warpgroup's shared scales at row_scales, once every thread of it is done reading the previous
// tile's (the barrier), by cp.async, one a thread: no register waits for them, the scaled piece
// does (store_piece). (Read in the rows pass, a global load per chunk waited behind the chunk's
// shared-memory load, the asm volatile ordering memory accesses: 8 load latencies in a row per
// piece, 0.71 ms of a moe-small step, measured. Fetched after the gate piece, with no barrier of
// its own, the bf16 kernel spilled 8 bytes.)
__device__ __forceinline__ void fetch_row_scales(int g, uint32_t row_scales, const float* row_w,
                                                 int64_t r0, int64_t r1, int n) {
  named_barrier_sync(1 + g, 128);
  const int t = static_cast<int>(threadIdx.x) % 128;
  const bool real = r0 + t < r1;
  if (t < n) cp_async_shared<4>(row_scales + 4 * t, real ? row_w + r0 + t : row_w, real);
}

// Where a rows tile's epilogue stages piece p (p = 0, 1: the first and second 128 columns, or
// SwiGLU's gate and up; p = 2: h) and the store groups of the thread that may still be reading
// there before it is written (store_piece's `wait`; -1: none).
struct Staging {
  uint32_t part[3];
  int wait[3];
};
// store_tile's default: every piece through the warpgroup's one 16 KiB staging, each behind the
// reads of the piece before.
__device__ __forceinline__ Staging one_staging(uint32_t staging) {
  return {{staging, staging, staging}, {0, 0, 0}};
}
// The deferred epilogue's (the rows kernel's kDefer): each piece in a 16 KiB part of its own, so
// the math warpgroup goes on to its next tile as soon as it has written them and handed them to
// TMA stores, which read them while the next tile's main loop runs. Warpgroup 0 stages the tile
// in the stage of its last slice (`at`, 48 KiB: room for the SwiGLU tile's three pieces; the
// math loop held it, hold_last, and the next tile's main loop frees it, release_held) and waits
// for nothing; warpgroup 1 in the kernel's 32 KiB staging (`at`, both warpgroups' halves under
// one_staging), waiting for its previous tile's stores before the first piece and, for the
// SwiGLU tile's h (into the first part again), for the first piece's.
__device__ __forceinline__ Staging deferred_staging(int g, uint32_t at) {
  constexpr uint32_t kPart = 2 * kStagingBoxBytes;
  if (g == 0) return {{at, at + kPart, at + 2 * kPart}, {-1, -1, -1}};
  return {{at, at + kPart, at}, {0, -1, 1}};
}

// The epilogue of a rows tile (rows [r0, r1) of warpgroup g's 64 are real), its pieces staged
// as `st` says. Plain: the kBN columns go to c at n0, 128 at a time. kSwiglu: columns 0-127 of
// the tile are gate (x w1^T) and 128-255 up (x w3^T) for the same 128 features at n0; gate, up
// and h = row_w * silu(gate) * up go to c, c_up and c_h. map_c, map_up, map_h: tensor maps over
// c, c_up and c_h for store_piece's TMA stores.
// row_scales: the shared address of the warpgroup's 64 floats for row_w.
template <class C, class T, bool kSwiglu>
__device__ __forceinline__ void store_tile(const float (&acc)[C::kAcc], int g, const Staging& st,
                                           T* c, T* c_up, T* c_h, const CUtensorMap* map_c,
                                           const CUtensorMap* map_up, const CUtensorMap* map_h,
                                           const float* row_w, uint32_t row_scales, int64_t r0,
                                           int64_t r1, int64_t n0, int64_t n_total) {
  if constexpr (kSwiglu) {
    // (the weights fetched while gate and up are stored)
    fetch_row_scales(g, row_scales, row_w, r0, r1, 64);
    store_piece(g, st.part[0], c, map_c, r0, r1, n0, n_total, acc_pairs<T>(acc, 0), 0, {},
                st.wait[0]);
    store_piece(g, st.part[1], c_up, map_up, r0, r1, n0, n_total, acc_pairs<T>(acc, 16), 0, {},
                st.wait[1]);
    // The routing weights come from shared memory just before h's pairs pass: loaded from
    // global memory and held through the gate and up pieces, they spilled (bf16: 132 bytes).
    store_piece<T, true>(g, st.part[2], c_h, map_h, r0, r1, n0, n_total, swiglu_pairs<T>(acc, 16),
                         row_scales, {}, st.wait[2]);
  } else {
#pragma unroll
    for (int h = 0; h < C::kBN / 128; ++h)
      store_piece(g, st.part[h], c, map_c, r0, r1, n0 + 128 * h, n_total, acc_pairs<T>(acc, 16 * h),
                  0, {}, st.wait[h]);
  }
}

// The gathering kernels' copies (the MoE permute fused into a product's loads). gathered_row:
// row i of the gathered operand, src's row row_token[i] of `width` elements, or null where i is
// not wanted (past the expert's rows) or its token lies outside [0, tokens) (a caller bug: it
// reads nothing).
template <class T>
__device__ __forceinline__ const T* gathered_row(const T* src, const int32_t* row_token, int64_t i,
                                                 bool wanted, int64_t tokens, int64_t width) {
  const int32_t token = wanted ? row_token[i] : -1;
  return 0 <= token && token < tokens ? src + int64_t(token) * width : nullptr;
}

// A warp's cp.async copy of lines line0 .. line0 + 31 (line0 a multiple of 32) of a block in the
// 128-byte swizzle TMA gives (16-byte chunk c of line q at slot c ^ (q % 8)): 64 elements from
// column col0 of the row lane l holds (`row`, for line line0 + l; null: zeros), zeros past
// `width` (a multiple of 8). Each step copies four whole lines, eight lanes per row, so every
// instruction reads full 128-byte lines: a lane per line read 16 bytes of 32 lines at a time,
// half of each 32-byte sector, and the gathering kernels ran at 0.65x the TMA ones. base: any
// valid address, for the copies that read nothing. All 32 lanes call it together.
template <class T>
__device__ __forceinline__ void copy_warp_lines(uint32_t block, int line0, const T* row,
                                                const T* base, int64_t col0, int64_t width) {
  const int lane = static_cast<int>(threadIdx.x % 32), c = lane % 8;
  const int64_t col = col0 + 8 * c;
  const auto own = reinterpret_cast<unsigned long long>(row);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int l = 4 * i + lane / 8;
    const T* src = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, own, l));
    const int q = line0 + l;
    const bool valid = src != nullptr && col < width;
    cp_async_shared<16>(block + q * Sw128::kRowBytes + ((c ^ (q & 7)) << 4),
                        valid ? src + col : base, valid);
  }
}

}  // namespace moe::cuda_detail::grouped_sm90
