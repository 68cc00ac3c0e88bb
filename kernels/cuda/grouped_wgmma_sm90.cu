// Hopper (sm_90a) grouped GEMMs with wgmma and TMA: the first path of grouped_mma_rows /
// grouped_mma_dw (grouped_mma.cuh) on an sm_90 device, ahead of the mma.sync kernels of
// grouped_mma_sm80.cu, which stay for sm_80 / sm_89 and for every case this file declines.
//
// Why it is fast: a warpgroup (4 warps) issues one asynchronous m64nNk16 MMA that reads both
// operands straight from shared memory, and the operands get there by TMA (the tensor memory
// accelerator copies a whole box per instruction, zero-fills what lies outside the tensor and
// writes the 128-byte swizzle the MMA reads), so the math warps issue almost nothing else.
//
// A block: 3 warpgroups (384 threads). Warpgroup 0 produces: one thread issues the TMA loads of
// each 64-wide k-slice into a kStages-deep ring of shared-memory stages, each guarded by a "full"
// and an "empty" barrier (tma_sm90.cuh). Warpgroups 1 and 2 compute a 128 x kBN output tile
// (warpgroup g owns rows 64g..64g+63, all kBN columns: m64nkBNk16): wait for a stage to be full,
// issue its four wgmma, and free the stage before once its wgmma have retired (one group in
// flight). Operand tiles keep the operand's global major-ness, read through wgmma's transpose
// bits, so the three products share one loop:
//   y  = x w_e^T        A = x [R, in] K-major      B(k, n) = w_e[n, k] K-major    rows kernel
//   dx = dy w_e         A = dy [R, out] K-major    B(k, n) = w_e[k, n] N-major    rows kernel
//   dw_e += dy_e^T x_e  A(m, k) = dy[k, m] M-major B(k, n) = x[k, n] N-major      dw kernel
// A K-major tile is kMN rows of 64 k (128 bytes); an MN-major tile is kMN / 64 blocks of 64 k-rows
// of 64 m/n-elements, 8 KiB apart. TMA needs 16-byte aligned bases and leading dimensions that
// are multiples of 8 elements (the sm_80 kernels' requirements too).
//
// Rows kernel: persistent, one block per SM walking (row tile, column tile) pairs, columns
// fastest (blocks resident together share their A row tiles and the expert's weights in L2);
// row tiles are cut per expert on the device (grouped_tiles.cuh). dw kernel: persistent too, over
// (expert, chunk of its rows, tile) units; a hot expert's rows are split into chunks that add in
// a fixed order (flags), so every output element gets its reductions from one thread per chunk,
// in chunk order: deterministic.
//
// Which code runs: the kernels' bodies exist only in sm_90a code (kHasWgmma). The top
// CMakeLists.txt builds MOE_CUDA_ARCHS entry 90 as sm_90a machine code (no compute_90 PTX) and
// then defines MOE_WITH_SM90A; with it, a kernel whose code for this device is version 9.0 on an
// sm_90 device is the sm_90a code, and the host launches these kernels. Otherwise they decline.
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/grouped_mma.cuh"
#include "cuda/grouped_tiles.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/silu.cuh"
#include "cuda/tma_sm90.cuh"
#include "cuda/adam_rider.cuh"
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

using Wide = Sm90Cfg<256, 4>;    // 192 KiB: one block per SM
using Narrow = Sm90Cfg<128, 4>;  // 128 KiB: one block per SM, half the accumulators
// The ping-pong kernels' ring (MOE_GROUPED_SM90=pingpong): each math warpgroup computes a whole
// 128 x 128 tile, the two taking turns, so a stage holds one warpgroup's slice; 6 of them keep
// the same 192 KiB in flight as Wide's 4.
using PingPong = Sm90Cfg<128, 6>;

// How a kernel's two math warpgroups share the work (MOE_GROUPED_SM90): cooperative (both on
// one 128-row tile, 64 rows each), pingpong (alternate whole tiles, pingpong_wait_turn) or
// multicast (cooperative, the blocks in clusters of two on adjacent row tiles of one expert, each
// loading half of the B tile they share by TMA multicast: block_row_tile; rows kernels only).
enum class Sched { cooperative, pingpong, multicast };
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
// (pingpong), or the 8 of both blocks of the cluster pair (multicast: the peer's TMA writes
// into this block's stage too). turns (pingpong): the two turn barriers, one arrival each.
template <class C, Sched kSched = Sched::cooperative>
__device__ __forceinline__ TmaRing<C> make_ring(unsigned char* smem, uint64_t* full,
                                                uint64_t* empty, int full_arrivals = 1,
                                                uint64_t* turns = nullptr) {
  constexpr int kMathWarps = kTmaThreads / 32 - 4;
  constexpr int kEmptyArrivals = kSched == Sched::pingpong    ? kMathWarps / 2
                                 : kSched == Sched::multicast ? 2 * kMathWarps
                                                              : kMathWarps;
  TmaRing<C> r{ring_base(smem), shared_addr(full), shared_addr(empty)};
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(r.full0 + 8 * s, full_arrivals);
      mbar_init(r.empty0 + 8 * s, kEmptyArrivals);
    }
    if constexpr (kSched == Sched::pingpong) {
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
[[maybe_unused]] __device__ __forceinline__ void pingpong_wait_turn(uint32_t turn0, int g,
                                                                    int64_t k) {
  if (g == 0 && k == 0) return;
  mbar_wait(turn0 + 8 * g, static_cast<uint32_t>((g == 0 ? k - 1 : k) & 1));
}
// One thread of warpgroup g, after its last wait on a stage of the tile.
[[maybe_unused]] __device__ __forceinline__ void pingpong_pass_turn(uint32_t turn0, int g) {
  mbar_arrive(turn0 + 8 * (1 - g));
}

// Math warpgroup `g` (0 or 1: rows 64g..64g+63 of the tile): acc = the sum over `slices`
// k-slices of ring slices it0, it0 + 1, ... . `before(t, stage)` runs after slice t has landed
// and before its wgmma (the dw kernel masks the rows past the expert there).
// kPeer (multicast): each stage freed is also freed in the cluster peer's ring (peer_empty0: the
// peer's empty[0], cluster_peer_address), whose TMA wrote half of it.
template <class C, class T, bool kAKFast, bool kBKFast, bool kPeer = false, class Before>
__device__ __forceinline__ void tma_math_loop(float (&acc)[C::kAcc], const TmaRing<C>& ring,
                                              int64_t it0, int slices, int g, Before&& before,
                                              uint32_t peer_empty0 = 0) {
  auto free_stage = [&](int64_t it) {
    mbar_arrive(ring.empty(it));
    if constexpr (kPeer)
      mbar_arrive_remote(peer_empty0 + 8 * static_cast<uint32_t>(it % C::kStages));
  };
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
    wgmma_wait<1>();  // slice t - 1's wgmma have retired: its stage is free
    fence_accumulators(acc);
    if (t > 0 && signals) free_stage(it - 1);
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
  if (slices > 0 && signals) free_stage(it0 + slices - 1);
}

// The ping-pong main loop of math warpgroup g's k-th tile: acc[h] = rows 64h..64h+63 of the
// block tile over ring slices it0 .. it0 + slices - 1 (kBoth: rows 64-127 too; else the tile's
// real rows end before them and only acc[0] is computed), between the turns (pingpong_wait_turn;
// turns: the shared address of turn[0]). before(t, stage) as in tma_math_loop. kBoth is a
// template argument, the caller branching once per tile: a test of a runtime flag between the
// wgmma made ptxas serialize every wgmma of the kernel (C7520, "WG.AR in divergent path").
template <class C, class T, bool kAKFast, bool kBKFast, bool kBoth, class Before>
__device__ __forceinline__ void pingpong_math_loop(float (&acc)[2][C::kAcc], const TmaRing<C>& ring,
                                                   int64_t it0, int slices, uint32_t turns, int g,
                                                   int64_t k, Before&& before) {
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
    if (t > 0 && signals) mbar_arrive(ring.empty(it - 1));
  }
  // This warpgroup waits on no more stages of the tile: the other one's main loop may start, its
  // first wgmma queued behind this one's last.
  if (threadIdx.x % 128 == 0) pingpong_pass_turn(turns, g);
  wgmma_wait<0>();
  fence_accumulators(acc[0]);
  fence_accumulators(acc[1]);
  if (slices > 0 && signals) mbar_arrive(ring.empty(it0 + slices - 1));
}

// A math warpgroup with nothing to compute in slices it0 .. it0 + slices - 1: it waits for each
// to land and frees it, as tma_math_loop does, so the ring's barriers see every math warp's
// arrival in every phase (an arrival before its stage is full could count toward the phase
// before).
// kPeer, peer_empty0: as tma_math_loop's.
template <class C, bool kPeer = false>
__device__ __forceinline__ void skip_slices(const TmaRing<C>& ring, int64_t it0, int slices,
                                            uint32_t peer_empty0 = 0) {
  const bool signals = (threadIdx.x % 32) == 0;
  for (int t = 0; t < slices; ++t) {
    const int64_t it = it0 + t;
    mbar_wait(ring.full(it), TmaRing<C>::parity(it));
    if (signals) {
      mbar_arrive(ring.empty(it));
      if constexpr (kPeer)
        mbar_arrive_remote(peer_empty0 + 8 * static_cast<uint32_t>(it % C::kStages));
    }
  }
}

// The multicast schedule's tiles (kMulticast): the cluster pair's tile `tile` is a 256-row tile
// of one expert (find_row_tile<256>), the block of rank r taking its rows 128 r .. 128 r + 127;
// where the expert ends first, [r0, r1) is empty, and the block still loads its half of each B
// slice and frees its stages. Otherwise find_row_tile's 128-row tile.
template <bool kMulticast>
__device__ __forceinline__ bool block_row_tile(const int32_t* offsets, int experts, int64_t rows,
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
template <class T, bool kScaled = false, class Pair>
__device__ __forceinline__ void store_piece(int g, uint32_t staging, T* dst, const CUtensorMap* map,
                                            int64_t r0, int64_t r1, int64_t n0, int64_t n_total,
                                            Pair&& pair, uint32_t scale = 0) {
  const int t = static_cast<int>(threadIdx.x) % 128;
  const int row0 = (t / 32) * 16 + (t % 32) / 4, col = 4 * (t % 4);
  // Chunk c (0..15, 8 columns each) of row r: box c / 8, line r, 16-byte slot (c % 8) ^ (r % 8).
  auto slot = [&](int r, int c) {
    return staging + (c / 8) * kStagingBoxBytes + r * 128 + (((c % 8) ^ (r & 7)) << 4);
  };
  if (t == 0) tma_store_wait_read();           // the previous piece's stores read the staging
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
  for (int jj = 0; jj < 16; ++jj) {
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
      if (n0 + 64 < n_total)
        tma_store_2d(map, staging + kStagingBoxBytes, static_cast<int32_t>(n0 + 64),
                     static_cast<int32_t>(r0));
      tma_store_commit();
    }
    return;
  }
  named_barrier_sync(1 + g, 128);
#pragma unroll
  for (int i = 0; i < 64 * 16 / 128; ++i) {
    const int idx = i * 128 + t, row = idx / 16, chunk = idx % 16;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(slot(row, chunk))
                 : "memory");
    const int64_t r = r0 + row, n = n0 + chunk * 8;
    // n_total % 8 == 0: a chunk is wholly inside or outside; 16-byte aligned
    if (r >= r1 || n >= n_total) continue;
    *reinterpret_cast<uint4*>(dst + r * n_total + n) = v;
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

// The epilogue of a rows tile (rows [r0, r1) of warpgroup g's 64 are real). Plain: the kBN
// columns go to c at n0, 128 at a time. kSwiglu: columns 0-127 of the tile are gate (x w1^T) and
// 128-255 up (x w3^T) for the same 128 features at n0; gate, up and h = row_w * silu(gate) * up
// go to c, c_up and c_h. map_c, map_up, map_h: tensor maps over c, c_up and c_h for store_piece's
// TMA stores.
// row_scales: the shared address of the warpgroup's 64 floats for row_w.
template <class C, class T, bool kSwiglu>
__device__ __forceinline__ void store_tile(const float (&acc)[C::kAcc], int g, uint32_t staging,
                                           T* c, T* c_up, T* c_h, const CUtensorMap* map_c,
                                           const CUtensorMap* map_up, const CUtensorMap* map_h,
                                           const float* row_w, uint32_t row_scales, int64_t r0,
                                           int64_t r1, int64_t n0, int64_t n_total) {
  auto columns = [&](int j0) {  // pairs of the 128 tile columns from 8 j0
    return [&, j0](int jj, int hr) {
      const int j = j0 + jj;
      return pack2<T>(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
    };
  };
  if constexpr (kSwiglu) {
    // Fetch the tile's weights while gate and up are stored, once every thread of the
    // warpgroup is done reading the previous tile's (the barrier), by cp.async, one per thread
    // of the warpgroup's first 64: no register waits for them. (Read in the rows pass, a global
    // load per chunk waited behind the chunk's shared-memory load, the asm volatile ordering
    // memory accesses: 8 load latencies in a row per piece, 0.71 ms of a moe-small step,
    // measured. Fetched after the gate piece, with no barrier of its own, the bf16 kernel
    // spilled 8 bytes.)
    named_barrier_sync(1 + g, 128);
    const int t = static_cast<int>(threadIdx.x) % 128;
    const bool real = r0 + t < r1;
    if (t < 64) cp_async_shared<4>(row_scales + 4 * t, real ? row_w + r0 + t : row_w, real);
    store_piece(g, staging, c, map_c, r0, r1, n0, n_total, columns(0));
    store_piece(g, staging, c_up, map_up, r0, r1, n0, n_total, columns(16));
    // The routing weights come from shared memory just before h's pairs pass: loaded from
    // global memory and held through the gate and up pieces, they spilled (bf16: 132 bytes).
    store_piece<T, true>(
        g, staging, c_h, map_h, r0, r1, n0, n_total,
        [&](int jj, int hr) {
          const int jg = jj, ju = 16 + jj;
          return swiglu_pair<T>(acc[4 * jg + 2 * hr], acc[4 * jg + 2 * hr + 1],
                                acc[4 * ju + 2 * hr], acc[4 * ju + 2 * hr + 1]);
        },
        row_scales);
  } else {
#pragma unroll
    for (int h = 0; h < C::kBN / 128; ++h)
      store_piece(g, staging, c, map_c, r0, r1, n0 + 128 * h, n_total, columns(16 * h));
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

// The rows kernel's registers per thread: the producer warpgroup's (its warps 1-3 carry an AdamW
// rider: at 40 they spilled 72 bytes) and the math warpgroups' (at most 3 x 168 together, the
// block's: setmaxnreg.inc only takes what a .dec gave back). The SwiGLU kernel carries no rider
// (its epilogue spilled 64 bytes at 216) and keeps 40 + 2 x 232. kMulticast: the dx-form
// producer's multicast loads and rider spilled 8 bytes at 64; 72 + 2 x 216 is the whole block.
template <bool kSwiglu, bool kMulticast = false>
constexpr int kRowsProducerRegs = kSwiglu      ? 40
                                  : kMulticast ? 72
                                               : 64;
template <bool kSwiglu>
constexpr int kRowsMathRegs = kSwiglu ? 232 : 216;
static_assert(kRowsProducerRegs<false, true> + 2 * kRowsMathRegs<false> <= 3 * 168 &&
                  kRowsProducerRegs<true> + 2 * kRowsMathRegs<true> <= 3 * 168,
              "setmaxnreg within the block");

// Rows kernel, persistent: block b runs tiles b, b + gridDim.x, ... of (row tile, column tile),
// columns fastest. While the math warps store one tile, the producer already streams the next
// tile's slices. A: a tensor map over a [rows, k_total] (box 64 k x 128 rows; the rows past the
// expert belong to the next one and only feed output rows that are not stored). B: over w as
// [E, n_total, k_total] (kBKFast, box 64 x kBN x 1) or [E, k_total, n_total] (box 64 x 64 x 1,
// kBN / 64 of them per slice), so each expert's bounds zero-fill on their own.
// kSwiglu (forward, kBN = 256): a tile is 128 features, w1's rows (map_b, box 64 x 128 x 1) in
// the B tile's first 128 rows and w3's (map_b2) in the next 128; the epilogue stores gate, up
// and h = row_w * silu(gate) * up (store_tile).
// kGather: A's rows are gathered, row r being row row_token[r] of a_src [a_tokens, k_total] (the
// MoE permute fused into the loads; map_a unused): the producer warpgroup's 128 threads copy
// them by cp.async (gathered_row, copy_warp_lines).
// kSched: pingpong (C = PingPong, not with kSwiglu): the tile's 128 rows on one math warpgroup,
// the warpgroups alternating (pingpong_wait_turn); multicast: launched in clusters of two
// blocks, which share each B slice (block_row_tile, load_b).
template <class C, class T, bool kBKFast, bool kSwiglu, bool kGather = false,
          Sched kSched = Sched::cooperative>
__global__ void __launch_bounds__(kTmaThreads, 1) grouped_tma_rows_kernel(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    const __grid_constant__ CUtensorMap map_b2, const __grid_constant__ CUtensorMap map_a2,
    const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_up,
    const __grid_constant__ CUtensorMap map_h, T* c, T* c_up, T* c_h, const float* row_w,
    const int32_t* offsets, int experts, int64_t rows, int64_t n_total, int64_t k_total,
    int n_tiles, int64_t tiles, const T* a_src, const int32_t* row_token, int64_t a_tokens,
    const AdamRider rider, bool pair) {
  constexpr bool kPingPong = kSched == Sched::pingpong, kMulticast = kSched == Sched::multicast;
  static_assert(!kSwiglu || (kBKFast && C::kBN == 256 && !kPingPong),
                "SwiGLU follows the forward product, gate and up 128 columns each");
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
    // other's ring; the pair walks tiles first, first + step, ... (its blocks the same ones).
    if constexpr (kMulticast) cluster_sync();
    const uint32_t rank = kMulticast ? cluster_rank() : 0;
    const unsigned first = kMulticast ? blockIdx.x / 2 : blockIdx.x;
    const unsigned step = kMulticast ? gridDim.x / 2 : gridDim.x;
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
      for (int64_t tile = first; loads && tile < tiles; tile += step) {
        int e = 0;
        int64_t r0 = 0, r1 = 0;
        if (!block_row_tile<kMulticast>(offsets, experts, rows, tile / n_tiles, rank, &e, &r0, &r1))
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
      claim_registers<kRowsMathRegs<kSwiglu>>();
      const int g = wg - 1;
      const uint32_t staging = ring.base + C::kStages * C::kStageBytes + g * kStagingBytes / 2;
      const uint32_t turns = shared_addr(turn);
      // The block's tile j = g, g + 2, ... (this warpgroup's tile j / 2): every tile has
      // `slices` k-slices, so tile j's are ring slices j * slices on.
      for (int64_t tile = blockIdx.x + g * int64_t(gridDim.x); tile < tiles;
           tile += 2 * int64_t(gridDim.x)) {
        // (from the tile: a second loop counter spilled 4 bytes)
        const int64_t j = (tile - blockIdx.x) / gridDim.x;
        int e = 0;
        int64_t r0 = 0, r1 = 0;
        if (!find_row_tile<kBM>(offsets, experts, rows, tile / n_tiles, &e, &r0, &r1)) break;
        const int64_t n0 = (tile % n_tiles) * kTileN;
        const bool both = r0 + 64 < r1;  // else the tile's real rows end in its first half
        float acc[2][C::kAcc];
        // kGather: the copies into the stage are the generic proxy's, the wgmma read it through
        // the async proxy
        auto before = [](int, uint32_t) {
          if constexpr (kGather) fence_proxy_async_smem();
        };
        if (both)
          pingpong_math_loop<C, T, true, kBKFast, true>(acc, ring, j * slices, slices, turns, g,
                                                        j / 2, before);
        else
          pingpong_math_loop<C, T, true, kBKFast, false>(acc, ring, j * slices, slices, turns, g,
                                                         j / 2, before);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 1 && !both) break;
          store_piece<T>(g, staging, c, &map_c, r0 + 64 * h, r1, n0, n_total, [&](int jj, int hr) {
            return pack2<T>(acc[h][4 * jj + 2 * hr], acc[h][4 * jj + 2 * hr + 1]);
          });
        }
      }
      if (threadIdx.x % 128 == 0) {
        tma_store_wait_all();  // its TMA stores have landed
        atomicAdd(&math_done, 1);
      }
    } else {
      claim_registers<kRowsMathRegs<kSwiglu>>();
      const int g = wg - 1;
      const uint32_t staging = ring.base + C::kStages * C::kStageBytes + g * kStagingBytes / 2;
      // kSwiglu: each math warpgroup's 64 routing weights, after the staging, in the 1 KiB kept
      // for aligning the ring (unused: the dynamic shared memory starts 1024-aligned, as its
      // declaration asks; the block is at the 227 KiB limit, and static shared memory for them
      // would round the static part up by another KiB).
      const uint32_t row_scales = ring.base + C::kStages * C::kStageBytes + kStagingBytes;
      if (kSwiglu && ring.base - shared_addr(smem) > 1024 - 2 * 64 * 4) __trap();  // never
      // (kMulticast: the peer's empty[0], on which this block's math warps free stages too)
      const uint32_t peer_empty0 = kMulticast ? cluster_peer_address(ring.empty0, rank ^ 1u) : 0;
      for (int64_t tile = first; tile < tiles; tile += step, it += slices) {
        int e = 0;
        int64_t r0 = 0, r1 = 0;
        if (!block_row_tile<kMulticast>(offsets, experts, rows, tile / n_tiles, rank, &e, &r0, &r1))
          break;
        const int64_t n0 = (tile % n_tiles) * kTileN;
        // A tile cut at its expert's end with no real rows in this warpgroup's half (an expert's
        // last 1-64 rows, or a cold expert's few) leaves its wgmma to the other warpgroup, which
        // then has the SM's tensor cores to itself: the stages are still waited for and freed.
        const bool real = r0 + 64 * g < r1;
        if (!real) {
          skip_slices<C, kMulticast>(ring, it, slices, peer_empty0);
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
            peer_empty0);
        store_tile<C, T, kSwiglu>(acc, g, staging, c, c_up, c_h, &map_c, &map_up, &map_h, row_w,
                                  row_scales + 256 * g, r0 + 64 * g, r1, n0, n_total);
      }
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
// so the bits depend only on the offsets and the shapes. No deadlock: a unit only waits on a unit
// of lower index, and the lowest-index unfinished unit is always running once its block is on an
// SM (that block has finished every earlier unit of its own). Units are assigned to blocks
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

// The gathering dw producer's 128 threads walk the units and copy x themselves: at 40, 56 and 72
// registers they spilled (60, 12 and 4 bytes), at 88 not. 88 + 2 x 208 = 3 x 168, the block's
// registers (setmaxnreg.inc only takes what a .dec gave back), and the math code fits 208.
constexpr int kGatherProducerRegs = 88, kGatherMathRegs = 208;
static_assert(kGatherProducerRegs + 2 * kGatherMathRegs <= 3 * 168, "setmaxnreg within the block");

constexpr int64_t kDwMaxFlags = int64_t(1) << 20;
__device__ int dw_flags[kDwMaxFlags];

// The work units of the dw kernel, from the offsets (every thread of a block computes the same).
struct DwUnits {
  const int64_t* start;  // [E + 1], shared memory: first unit of expert e (empty experts: none)
  int experts;
  int64_t rows, chunk, tiles;  // tiles: per expert (out tiles x in tiles)
  __device__ __forceinline__ int64_t total() const { return start[experts]; }
  // The unit's expert, chunk rows [k0, k1), chunk index, number of chunks and tile.
  __device__ __forceinline__ void find(const int32_t* offsets, int64_t u, int* e, int64_t* k0,
                                       int64_t* k1, int* c, int* chunks, int64_t* tile) const {
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
    *e = lo;
    *c = static_cast<int>(local / tiles);
    *tile = local % tiles;
    *chunks = static_cast<int>((r1 - r0 + chunk - 1) / chunk);
    *k0 = r0 + int64_t(*c) * chunk;
    *k1 = std::min(r1, *k0 + chunk);
  }
};

// Who waits and publishes around a dw tile's reductions: the named barrier the tile's
// warpgroup syncs on after its leader saw the earlier chunks' flag, the barrier (and its thread
// count) that gathers every thread's reductions before the publish, and the publishing thread.
struct DwTileSync {
  int wait_bar, publish_bar, publish_threads;
  unsigned publisher;
};

// A dw unit's reductions into dw_e [out, in] at tile (m0, n0), chunk c of `chunks` of the tile
// (flag: dw_flags' entry of the tile, when chunks > 1): after the tile's earlier chunks (the flag
// reads c), then publishing c + 1 (the last chunk puts 0 back). pairs(add) hands this thread's
// accumulator pairs to add(row, col, v0, v1) (for_each_math_pair). store: st instead of red
// (the overwrite's first chunk).
template <class C, class Pairs>
__device__ __forceinline__ void dw_tile_reduce(int* flag, int c, int chunks, bool leader,
                                               DwTileSync sync, float* dw_e, int64_t out,
                                               int64_t in, int64_t m0, int64_t n0, bool store,
                                               Pairs&& pairs) {
  if (c > 0) {  // the tile's earlier chunks first
    if (leader) {
      int seen = -1;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
        if (seen == c) break;
        __nanosleep(100);
      }
    }
    named_barrier_sync(sync.wait_bar, 128);
  }
  pairs([&](int row, int col, float v0, float v1) {
    const int64_t o = m0 + row, i = n0 + col;
    // in % 8 == 0: i + 1 < in too; 8-byte aligned. One thread adds to each element per
    // chunk: a load, add and store in L2 without waiting for the load (subnormal f32 sums
    // flush to zero).
    if (o >= out || i >= in) return;
    if (store)
      asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(dw_e + o * in + i), "f"(v0), "f"(v1)
                   : "memory");
    else
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dw_e + o * in + i), "f"(v0),
                   "f"(v1)
                   : "memory");
  });
  if (chunks > 1) {  // publish: every thread's reductions, then the flag
    __threadfence();
    named_barrier_sync(sync.publish_bar, sync.publish_threads);
    if (threadIdx.x == sync.publisher) {
      const int next = c + 1 == chunks ? 0 : c + 1;
      asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(next) : "memory");
    }
  }
}

// kGatherDy / kGatherX: dy's / x's rows are gathered, k-row r being row row_token[r] of dy_src
// [tokens, out] / x_src [tokens, in] (the MoE layer's output gradient / input, no permuted copy;
// that operand's map unused): the producer warpgroup's 128 threads copy them by cp.async
// (gather_k_rows), the other operand still by TMA.
// kSched: pingpong (C = PingPong): a unit's 128 x kBN tile on one math warpgroup, its reductions
// under the other's main loop (pingpong_wait_turn); no multicast form.
template <class C, class T, bool kGatherDy = false, bool kGatherX = false,
          Sched kSched = Sched::cooperative>
__global__ void __launch_bounds__(kTmaThreads, 1)
    grouped_tma_dw_kernel(const __grid_constant__ CUtensorMap map_dy,
                          const __grid_constant__ CUtensorMap map_x,
                          const __grid_constant__ CUtensorMap map_dy2, float* dw, float* dw2,
                          const int32_t* offsets, int experts, int64_t rows, int64_t out,
                          int64_t in, int64_t chunk, bool overwrite, const T* dy_src,
                          const T* x_src, const int32_t* row_token, int64_t tokens) {
  constexpr bool kGather = kGatherDy || kGatherX;
  constexpr bool kPingPong = kSched == Sched::pingpong;
  static_assert(kSched != Sched::multicast, "the dw kernel has no multicast form");
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
    const DwUnits units{unit_start, experts, rows, chunk, tiles};
    const int wg = static_cast<int>(threadIdx.x) / 128;
    int64_t it = 0;
    if (wg == 0) {
      release_registers<kGather ? kGatherProducerRegs : 40>();
      // Thread 0 loads by TMA; kGather: all 128 copy the gathered k-rows, thread p row p % 64.
      if (!kGather && threadIdx.x != 0) return;
      const int p = static_cast<int>(threadIdx.x);
      for (int64_t u = blockIdx.x; u < units.total(); u += gridDim.x) {
        int e = 0, c = 0, chunks = 0;
        int64_t k0 = 0, k1 = 0, tile = 0;
        units.find(offsets, u, &e, &k0, &k1, &c, &chunks, &tile);
        const bool second = tile >= half_tiles;
        const int64_t own = second ? tile - half_tiles : tile;
        const int m0 = static_cast<int>(own / n_tiles) * kBM;
        const int n0 = static_cast<int>(own % n_tiles) * C::kBN;
        const int slices = static_cast<int>((k1 - k0 + kBK - 1) / kBK);
        for (int t = 0; t < slices; ++t, ++it) {
          ring.wait_free(it);
          const uint32_t stage = ring.stage(it), bar = ring.full(it);
          const int32_t k = static_cast<int32_t>(k0) + t * kBK;
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
      claim_registers<kGather ? kGatherMathRegs : 232>();
      const int g = wg - 1;
      const uint32_t turns = shared_addr(turn);
      // The block's unit j is warpgroup j % 2's; units differ in k-slices, so each warpgroup
      // walks them all to count the ring's slices.
      int64_t j = 0, k = 0;
      for (int64_t u = blockIdx.x; u < units.total(); u += gridDim.x, ++j) {
        int e = 0, c = 0, chunks = 0;
        int64_t k0 = 0, k1 = 0, tile = 0;
        units.find(offsets, u, &e, &k0, &k1, &c, &chunks, &tile);
        const int slices = static_cast<int>((k1 - k0 + kBK - 1) / kBK);
        if (j % 2 != g) {
          it += slices;
          continue;
        }
        const bool second = tile >= half_tiles;
        const int64_t own = second ? tile - half_tiles : tile;
        const int64_t m0 = (own / n_tiles) * kBM, n0 = (own % n_tiles) * C::kBN;
        const int tail = static_cast<int>((k1 - k0) % kBK);  // as in the cooperative branch
        const bool both = m0 + 64 < out;  // else dw's rows end in the tile's first half
        float acc[2][C::kAcc];
        auto before = [&](int t, uint32_t stage) {
          if constexpr (kGather) fence_proxy_async_smem();
          if (t != slices - 1 || tail == 0) return;
          // k-rows tail..63 of each computed 64-wide block of A (the cooperative hook's
          // rows, in both blocks)
          const int per_block = (64 - tail) * 8;  // 16-byte chunks
          for (int i = static_cast<int>(threadIdx.x) % 128; i < (both ? 2 : 1) * per_block;
               i += 128) {
            const uint32_t at =
                stage + (i / per_block) * Sw128::kBlockBytes + 16 * (tail * 8 + i % per_block);
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(0) : "memory");
          }
          fence_proxy_async_smem();
          named_barrier_sync(1 + g, 128);
        };
        if (both)
          pingpong_math_loop<C, T, false, false, true>(acc, ring, it, slices, turns, g, k, before);
        else
          pingpong_math_loop<C, T, false, false, false>(acc, ring, it, slices, turns, g, k, before);
        it += slices;
        ++k;
        int* flag = chunks > 1 ? &dw_flags[int64_t(e) * tiles + tile] : nullptr;
        // (the tile is this warpgroup's alone: it publishes on its own barrier)
        dw_tile_reduce<C>(flag, c, chunks, threadIdx.x % 128 == 0,
                          {1 + g, 1 + g, 128, 128u * (1 + g)},
                          (second ? dw2 : dw) + int64_t(e) * out * in, out, in, m0, n0,
                          overwrite && c == 0, [&](auto&& add) {
                            for_each_math_pair<C>(acc[0], 0, add);
                            if (both) for_each_math_pair<C>(acc[1], 1, add);
                          });
      }
    } else {
      claim_registers<kGather ? kGatherMathRegs : 232>();
      const int g = wg - 1;
      const bool leader = threadIdx.x % 128 == 0;
      for (int64_t u = blockIdx.x; u < units.total(); u += gridDim.x) {
        int e = 0, c = 0, chunks = 0;
        int64_t k0 = 0, k1 = 0, tile = 0;
        units.find(offsets, u, &e, &k0, &k1, &c, &chunks, &tile);
        const bool second = tile >= half_tiles;
        const int64_t own = second ? tile - half_tiles : tile;
        const int64_t m0 = (own / n_tiles) * kBM, n0 = (own % n_tiles) * C::kBN;
        const int slices = static_cast<int>((k1 - k0 + kBK - 1) / kBK);
        const int tail = static_cast<int>((k1 - k0) % kBK);  // k-rows of the last slice, 0: whole
        // A tile whose rows of this warpgroup's half lie past `out` (the last tile of an output
        // count of 1-64 past a multiple of 128, as moe-fine's 704) adds nothing: the other
        // warpgroup has the tensor cores to itself. The stages are still waited for and freed,
        // and a split tile's publish still counts this warpgroup (barrier 3).
        if (m0 + 64 * g >= out) {
          skip_slices(ring, it, slices);
          it += slices;
          if (chunks > 1) named_barrier_sync(3, 256);
          continue;
        }
        float acc[C::kAcc];
        tma_math_loop<C, T, false, false>(acc, ring, it, slices, g, [&](int t, uint32_t stage) {
          // kGather: the copies into the stage are the generic proxy's, the wgmma read it
          // through the async proxy
          if constexpr (kGather) fence_proxy_async_smem();
          if (t != slices - 1 || tail == 0) return;
          // Rows tail..63 of this warpgroup's A block: 16-byte chunks, whole rows (the swizzle
          // only permutes chunks within a row).
          const uint32_t block = stage + g * Sw128::kBlockBytes;
          for (int i = tail * 8 + static_cast<int>(threadIdx.x) % 128; i < 64 * 8; i += 128)
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(block + 16 * i), "r"(0)
                         : "memory");
          fence_proxy_async_smem();
          named_barrier_sync(1 + g, 128);
        });
        it += slices;
        // (only formed when the tile is split: then E x tiles fits the flags, launch_dw)
        int* flag = chunks > 1 ? &dw_flags[int64_t(e) * tiles + tile] : nullptr;
        // overwrite: the tile's first chunk stores (dw is neither zeroed before nor read), the
        // later ones add behind it in chunk order as always. The publish counts both
        // warpgroups (barrier 3), thread 128 stores the flag.
        dw_tile_reduce<C>(flag, c, chunks, leader, {1 + g, 3, 256, 128},
                          (second ? dw2 : dw) + int64_t(e) * out * in, out, in, m0, n0,
                          overwrite && c == 0,
                          [&](auto&& add) { for_each_math_pair<C>(acc, g, add); });
      }
    }
  }
}

// A tensor map over a row-major 16-bit tensor of `rank` (2 or 3) dimensions, innermost first:
// dims[i] elements, strides[i] elements between steps of dimension i + 1, boxes of box[i]
// elements, stored in shared memory in the 128-byte swizzle (box[0] must be 64 elements).
CUtensorMap tile_map(DType t, const void* base, int rank, const uint64_t* dims,
                     const uint64_t* strides, const uint32_t* box) {
  CUtensorMap map{};
  uint64_t stride_bytes[2] = {0, 0};
  for (int i = 0; i + 1 < rank; ++i) stride_bytes[i] = strides[i] * 2;
  const uint32_t ones[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, t == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, stride_bytes, box, ones,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw InternalError("cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) +
                        ") for a grouped GEMM operand");
  return map;
}

// The outputs of a rows launch: c, and with SwiGLU also up and h, all [rows, n_total], and the
// rows' routing weights that h is scaled by.
struct RowsOut {
  void* c;
  void* up = nullptr;
  void* h = nullptr;
  const float* row_w = nullptr;
};

// The A operand of a rows launch: `a` itself, [rows, k_total], or with row_token (kGather) its
// rows row_token[r] of a [tokens, k_total].
struct RowsIn {
  const void* a;
  const int32_t* row_token = nullptr;
  int64_t tokens = 0;
  // A pair (grouped_sm90_rows_pair): c = a B(w) + a2 B(w2), a2 shaped as a, w2 as w, one
  // accumulation over both k ranges.
  const void* a2 = nullptr;
};

// w2: w3 for SwiGLU (kSwiglu), unused otherwise. kSched: the kernel's schedule (pingpong: C =
// PingPong).
template <class C, class T, bool kBKFast, bool kSwiglu = false, bool kGather = false,
          Sched kSched = Sched::cooperative>
void launch_rows(Ctx& ctx, DType t, RowsOut out, RowsIn in, const void* w, const void* w2,
                 const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                 int64_t k_total, int64_t expert_stride, const AdamRider& rider = {}) {
  auto kernel = grouped_tma_rows_kernel<C, T, kBKFast, kSwiglu, kGather, kSched>;
  constexpr bool kMulticast = kSched == Sched::multicast;
  // kMulticast: the launch in clusters of two blocks, as many pairs as the device holds at once
  // (one block an SM; a GPC's odd SM holds none).
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kTmaThreads);
  config.dynamicSmemBytes = kRowsSmemBytes<C>;
  config.stream = stream_of(ctx);
  config.attrs = &cluster;
  config.numAttrs = 1;
  static int max_pairs = 0;
  static std::once_flag once;
  std::call_once(once, [&] {
    allow_dynamic_smem(kernel, kRowsSmemBytes<C>);
    if constexpr (kMulticast) {
      config.gridDim = dim3(2);
      MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&max_pairs, kernel, &config));
    }
  });
  if constexpr (kMulticast) {
    if (max_pairs < 1) {  // no pair fits: the cooperative kernel
      launch_rows<C, T, kBKFast, kSwiglu, kGather>(ctx, t, out, in, w, w2, offsets, experts, rows,
                                                   n_total, k_total, expert_stride, rider);
      return;
    }
  }
  constexpr int kTileN = kSwiglu ? C::kBN / 2 : C::kBN;
  const void* a = in.a;
  // (gathering: a map over the token rows that the kernel does not use)
  const uint64_t a_dims[2] = {uint64_t(k_total), uint64_t(kGather ? in.tokens : rows)};
  const uint64_t a_strides[1] = {uint64_t(k_total)};
  const uint32_t a_box[2] = {kBK, kBM};
  const CUtensorMap map_a = tile_map(t, a, 2, a_dims, a_strides, a_box);
  // w_e as [n_total, k_total] (y = x w_e^T) or [k_total, n_total] (dx = dy w_e), E of them.
  const uint64_t b_dims[3] = {uint64_t(kBKFast ? k_total : n_total),
                              uint64_t(kBKFast ? n_total : k_total), uint64_t(experts)};
  const uint64_t b_strides[2] = {b_dims[0], uint64_t(expert_stride)};
  // (kMulticast: a block loads half of each B slice, load_b; a SwiGLU half is w1's or w3's box)
  const uint32_t b_box[3] = {
      kBK, kBKFast ? uint32_t(kMulticast && !kSwiglu ? kTileN / 2 : kTileN) : 64u, 1};
  const CUtensorMap map_b = tile_map(t, w, 3, b_dims, b_strides, b_box);
  const bool pair = in.a2 != nullptr;
  const CUtensorMap map_b2 = kSwiglu || pair ? tile_map(t, w2, 3, b_dims, b_strides, b_box) : map_b;
  const CUtensorMap map_a2 = pair ? tile_map(t, in.a2, 2, a_dims, a_strides, a_box) : map_a;
  // The outputs [rows, n_total] for the epilogue's TMA stores, boxes of 64 x 64 (store_piece).
  const uint64_t c_dims[2] = {uint64_t(n_total), uint64_t(rows)};
  const uint64_t c_strides[1] = {uint64_t(n_total)};
  const uint32_t c_box[2] = {64, 64};
  const CUtensorMap map_c = tile_map(t, out.c, 2, c_dims, c_strides, c_box);
  const CUtensorMap map_up = kSwiglu ? tile_map(t, out.up, 2, c_dims, c_strides, c_box) : map_c;
  const CUtensorMap map_h = kSwiglu ? tile_map(t, out.h, 2, c_dims, c_strides, c_box) : map_c;
  const int n_tiles = static_cast<int>(blocks_for(n_total, kTileN));
  // (kMulticast: tiles of a pair, 256 rows each)
  const int64_t tiles = int64_t(n_tiles) * (blocks_for(rows, kMulticast ? 2 * kBM : kBM) + experts);
  if constexpr (kMulticast) {
    config.gridDim = dim3(2 * static_cast<unsigned>(std::min<int64_t>(tiles, max_pairs)));
    MOE_CUDA_CHECK(cudaLaunchKernelEx(
        &config, kernel, map_a, map_b, map_b2, map_a2, map_c, map_up, map_h, static_cast<T*>(out.c),
        static_cast<T*>(out.up), static_cast<T*>(out.h), out.row_w, offsets, experts, rows, n_total,
        k_total, n_tiles, tiles, static_cast<const T*>(a), in.row_token, in.tokens, rider, pair));
  } else {
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, device_sm_count()));
    kernel<<<grid, kTmaThreads, kRowsSmemBytes<C>, stream_of(ctx)>>>(
        map_a, map_b, map_b2, map_a2, map_c, map_up, map_h, static_cast<T*>(out.c),
        static_cast<T*>(out.up), static_cast<T*>(out.h), out.row_w, offsets, experts, rows, n_total,
        k_total, n_tiles, tiles, static_cast<const T*>(a), in.row_token, in.tokens, rider, pair);
  }
  MOE_CUDA_LAUNCH_CHECK();
}

// overwrite: the experts without rows get zeros here (the dw kernel has no units for them).
// Grid row e checks expert e's count; an empty expert's blocks clear dw[e] (a grid-stride loop;
// few experts are empty, and the others' blocks return at once).
__global__ void zero_empty_experts_kernel(float* dw, const int32_t* offsets, int64_t rows,
                                          int64_t per_expert) {
  const int e = static_cast<int>(blockIdx.y);
  if (clamp_offset(offsets[e + 1], rows) > clamp_offset(offsets[e], rows)) return;
  float* d = dw + int64_t(e) * per_expert;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_expert; i += stride)
    d[i] = 0.0f;
}

// kGatherDy / kGatherX: dy / x is [g.tokens, out / in] and k-row r of the product reads its row
// g.row_token[r]. A pair (dw2 and dy2; dy not gathered): dw2[e] (+)= dy2_e^T x_e in the same
// launch.
template <class C, class T, bool kGatherDy = false, bool kGatherX = false,
          Sched kSched = Sched::cooperative>
void launch_dw(Ctx& ctx, DType t, float* dw, const void* dy, const void* x, const int32_t* offsets,
               int experts, int64_t rows, int64_t out, int64_t in, bool overwrite, DwGather g = {},
               float* dw2 = nullptr, const void* dy2 = nullptr) {
  auto kernel = grouped_tma_dw_kernel<C, T, kGatherDy, kGatherX, kSched>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, C::kSmemBytes); });
  const uint32_t box[2] = {64, kBK};
  // (a gathered operand: a map over its token rows that the kernel does not use)
  const uint64_t dy_dims[2] = {uint64_t(out), uint64_t(kGatherDy ? g.tokens : rows)},
                 dy_strides[1] = {uint64_t(out)};
  const uint64_t x_dims[2] = {uint64_t(in), uint64_t(kGatherX ? g.tokens : rows)},
                 x_strides[1] = {uint64_t(in)};
  const CUtensorMap map_dy = tile_map(t, dy, 2, dy_dims, dy_strides, box);
  const CUtensorMap map_x = tile_map(t, x, 2, x_dims, x_strides, box);
  const CUtensorMap map_dy2 =
      dw2 != nullptr ? tile_map(t, dy2, 2, dy_dims, dy_strides, box) : map_dy;
  const int64_t tiles = blocks_for(out, kBM) * blocks_for(in, C::kBN) * (dw2 != nullptr ? 2 : 1);
  // Chunks of twice the mean rows per expert (whole k-slices); no split when the flags run out.
  const int64_t mean = (rows + experts - 1) / experts;
  const int64_t chunk = int64_t(experts) * tiles <= kDwMaxFlags
                            ? std::max<int64_t>(kBK, (2 * mean + kBK - 1) / kBK * kBK)
                            : rows;
  const int64_t most_units = tiles * ((rows + chunk - 1) / chunk + experts);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(most_units, device_sm_count()));
  if (overwrite) {
    const dim3 zgrid(static_cast<unsigned>(std::min<int64_t>(blocks_for(out * in, 256), 64)),
                     static_cast<unsigned>(experts));
    zero_empty_experts_kernel<<<zgrid, 256, 0, stream_of(ctx)>>>(dw, offsets, rows, out * in);
    MOE_CUDA_LAUNCH_CHECK();
    if (dw2 != nullptr) {
      zero_empty_experts_kernel<<<zgrid, 256, 0, stream_of(ctx)>>>(dw2, offsets, rows, out * in);
      MOE_CUDA_LAUNCH_CHECK();
    }
  }
  kernel<<<grid, kTmaThreads, C::kSmemBytes, stream_of(ctx)>>>(
      map_dy, map_x, map_dy2, dw, dw2, offsets, experts, rows, out, in, chunk, overwrite,
      static_cast<const T*>(dy), static_cast<const T*>(x), g.row_token, g.tokens);
  MOE_CUDA_LAUNCH_CHECK();
}

// Whether the code the device runs for C's kernels is the sm_90a code (see the top comment).
// kS: the kernels of that schedule (pingpong: no SwiGLU kernel; multicast: rows kernels only).
template <class C, class T, Sched kS = Sched::cooperative>
bool compiled_for_sm90a() {
#ifdef MOE_WITH_SM90A
  auto is90 = [](int v) { return v >= 90 && v < 100; };
  if constexpr (kS != Sched::pingpong) {
    if (!is90(compiled_arch(grouped_tma_rows_kernel<Wide, T, true, true, false, kS>)) ||
        !is90(compiled_arch(grouped_tma_rows_kernel<Wide, T, true, true, true, kS>)))
      return false;
  }
  if constexpr (kS != Sched::multicast) {
    if (!is90(compiled_arch(grouped_tma_dw_kernel<C, T, false, false, kS>)) ||
        !is90(compiled_arch(grouped_tma_dw_kernel<C, T, true, false, kS>)) ||
        !is90(compiled_arch(grouped_tma_dw_kernel<C, T, false, true, kS>)))
      return false;
  }
  return is90(compiled_arch(grouped_tma_rows_kernel<C, T, true, false, false, kS>)) &&
         is90(compiled_arch(grouped_tma_rows_kernel<C, T, false, false, false, kS>)) &&
         is90(compiled_arch(grouped_tma_rows_kernel<C, T, false, false, true, kS>));
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
// "0" declines (the sm_80 kernels run), "128" takes 128-column block tiles, "pingpong" the
// ping-pong kernels (pingpong_wait_turn) for the rows and dw products, "pingpong-rows" for the
// rows products only, "multicast" the cluster-pair rows kernels (block_row_tile; dw as by
// default), anything else (or unset) 256-column cooperative tiles. The fused SwiGLU forward has
// no ping-pong form: it runs the 256-column cooperative kernel under both ping-pong settings.
enum class Mode { off, narrow, wide, pingpong, pingpong_rows, multicast };
Mode mode() {
  const char* v = std::getenv("MOE_GROUPED_SM90");
  if (v == nullptr) return Mode::wide;
  const std::string s(v);
  return s == "0"               ? Mode::off
         : s == "128"           ? Mode::narrow
         : s == "pingpong"      ? Mode::pingpong
         : s == "pingpong-rows" ? Mode::pingpong_rows
         : s == "multicast"     ? Mode::multicast
                                : Mode::wide;
}

bool sm90_available(DType t) {
  // Decided once per process for the current device (the trainer uses one device per process).
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    if (!device_is_sm90()) return;
    auto all = [](auto zero) {
      using T = decltype(zero);
      return compiled_for_sm90a<Wide, T>() && compiled_for_sm90a<Narrow, T>() &&
             compiled_for_sm90a<PingPong, T, Sched::pingpong>() &&
             compiled_for_sm90a<Wide, T, Sched::multicast>();
    };
    half_ok = all(__half{});
    bf16_ok = all(__nv_bfloat16{});
  });
  return t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
}

template <Sched kS>
using SchedTag = std::integral_constant<Sched, kS>;

// Calls fn(C{}, T{}, sched) with the configuration, storage type and schedule (a SchedTag) of
// this launch; kDw: a dw product's (no multicast form).
template <bool kDw, class Fn>
void with_config(DType t, Mode m, Fn&& fn) {
  const bool pingpong = m == Mode::pingpong || (m == Mode::pingpong_rows && !kDw);
  auto typed = [&](auto zero) {
    if (pingpong) {
      fn(PingPong{}, zero, SchedTag<Sched::pingpong>{});
    } else if (m == Mode::multicast && !kDw) {
      if constexpr (!kDw) fn(Wide{}, zero, SchedTag<Sched::multicast>{});
    } else if (m == Mode::narrow)
      fn(Narrow{}, zero, SchedTag<Sched::cooperative>{});
    else
      fn(Wide{}, zero, SchedTag<Sched::cooperative>{});
  };
  if (t == DType::f16)
    typed(__half{});
  else
    typed(__nv_bfloat16{});
}

}  // namespace

bool grouped_sm90_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                       const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                       int64_t k_total, int64_t expert_stride, bool b_k_fast,
                       const int32_t* row_token, int64_t tokens, const AdamRider* rider) {
  const Mode m = mode();
  // (gathering: the dx = dy w[e] form only, the one the trainer gathers; a rider: not with it,
  // the producer warpgroup's threads all copy there)
  if (m == Mode::off || !sm90_available(t) || (row_token != nullptr && b_k_fast) ||
      (rider != nullptr && row_token != nullptr) ||
      !rows_operands_fit(c, a, w, n_total, k_total, expert_stride, b_k_fast, rows, experts, kBM))
    return false;
  if (rows == 0) return true;  // nothing to write (and a tensor map needs a row)
  const RowsIn in{a, row_token, tokens};
  with_config<false>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    const AdamRider r = rider ? *rider : AdamRider{};
    if (row_token != nullptr)
      launch_rows<C, T, false, false, true, kS>(ctx, t, {c}, in, w, nullptr, offsets, experts, rows,
                                                n_total, k_total, expert_stride);
    else if (b_k_fast)
      launch_rows<C, T, true, false, false, kS>(ctx, t, {c}, in, w, nullptr, offsets, experts, rows,
                                                n_total, k_total, expert_stride, r);
    else
      launch_rows<C, T, false, false, false, kS>(ctx, t, {c}, in, w, nullptr, offsets, experts,
                                                 rows, n_total, k_total, expert_stride, r);
  });
  return true;
}

// The dw kernel's operand conditions: dy's and x's rows 16-byte aligned, out and in multiples of
// 8, dw 8-byte aligned (float2 adds), the experts' unit table in shared memory.
static bool dw_operands_fit(const float* dw, const void* dy, const void* x, int64_t out, int64_t in,
                            int experts) {
  return aligned16_rows(dy, out) && aligned16_rows(x, in) && out % 8 == 0 && in % 8 == 0 &&
         reinterpret_cast<uintptr_t>(dw) % 8 == 0 && experts <= kSharedOffsets;
}

bool grouped_sm90_dw_pair(Ctx& ctx, DType t, float* dw, float* dw2, const void* dy, const void* dy2,
                          const void* x, const int32_t* offsets, int experts, int64_t rows,
                          int64_t out, int64_t in, bool overwrite, DwGather g) {
  const Mode m = mode();
  // grouped_sm90_dw's operand conditions for each gradient; dy not gathered (the pair switches
  // its tensor map); no rows or experts: the caller's two calls
  if (m == Mode::off || !sm90_available(t) || g.dy ||
      !dw_operands_fit(dw, dy, x, out, in, experts) ||
      !dw_operands_fit(dw2, dy2, x, out, in, experts) || rows == 0 || experts == 0)
    return false;
  with_config<true>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    if (g.x)
      launch_dw<C, T, false, true, kS>(ctx, t, dw, dy, x, offsets, experts, rows, out, in,
                                       overwrite, g, dw2, dy2);
    else
      launch_dw<C, T, false, false, kS>(ctx, t, dw, dy, x, offsets, experts, rows, out, in,
                                        overwrite, {}, dw2, dy2);
  });
  return true;
}

bool grouped_sm90_rows_pair_runs(DType t, int64_t rows, int experts, int64_t n_total,
                                 int64_t k_total) {
  return mode() != Mode::off && sm90_available(t) &&
         rows_sizes_fit(n_total, k_total, rows, experts, kBM);
}

bool grouped_sm90_rows_pair(Ctx& ctx, DType t, void* c, const void* a, const void* a2,
                            const void* w, const void* w2, const int32_t* offsets, int experts,
                            int64_t rows, int64_t n_total, int64_t k_total, int64_t expert_stride) {
  const Mode m = mode();
  if (m == Mode::off || !sm90_available(t) ||
      !rows_operands_fit(c, a, w, n_total, k_total, expert_stride, false, rows, experts, kBM) ||
      !rows_operands_fit(c, a2, w2, n_total, k_total, expert_stride, false, rows, experts, kBM))
    return false;
  if (rows == 0) return true;  // nothing to write
  RowsIn in{a};
  in.a2 = a2;
  with_config<false>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    launch_rows<C, T, false, false, false, decltype(sched)::value>(
        ctx, t, {c}, in, w, w2, offsets, experts, rows, n_total, k_total, expert_stride);
  });
  return true;
}

bool grouped_sm90_swiglu(Ctx& ctx, DType t, void* gate, void* up, void* h, const void* x,
                         const void* w1, const void* w3, const float* row_w, const int32_t* offsets,
                         int experts, int64_t rows, int64_t features, int64_t in,
                         const int32_t* row_token, int64_t tokens) {
  const Mode m = mode();
  const int64_t stride = features * in;
  // MOE_SWIGLU_FUSED=0 (read at every call) declines: the bench and tests compare both paths.
  const char* fused = std::getenv("MOE_SWIGLU_FUSED");
  // (the ping-pong settings run the cooperative 256-column kernel: it has no ping-pong form)
  if ((fused != nullptr && std::string(fused) == "0") || row_w == nullptr || m == Mode::off ||
      m == Mode::narrow || !sm90_available(t) ||
      !rows_operands_fit(gate, x, w1, features, in, stride, true, rows, experts, kBM) ||
      !rows_operands_fit(up, x, w3, features, in, stride, true, rows, experts, kBM) ||
      !aligned16_rows(h, features))
    return false;
  if (rows == 0) return true;  // nothing to write
  const RowsOut out{gate, up, h, row_w};
  const RowsIn a{x, row_token, tokens};
  auto launch = [&](auto zero, auto sched) {
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    if (row_token != nullptr)
      launch_rows<Wide, T, true, true, true, kS>(ctx, t, out, a, w1, w3, offsets, experts, rows,
                                                 features, in, stride);
    else
      launch_rows<Wide, T, true, true, false, kS>(ctx, t, out, a, w1, w3, offsets, experts, rows,
                                                  features, in, stride);
  };
  auto typed = [&](auto zero) {
    if (m == Mode::multicast)
      launch(zero, SchedTag<Sched::multicast>{});
    else
      launch(zero, SchedTag<Sched::cooperative>{});
  };
  if (t == DType::f16)
    typed(__half{});
  else
    typed(__nv_bfloat16{});
  return true;
}

bool grouped_sm90_dw(Ctx& ctx, DType t, float* dw, const void* dy, const void* x,
                     const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in,
                     bool overwrite, DwGather g) {
  const Mode m = mode();
  // More experts than the unit table holds (kSharedOffsets): the sm_80 kernels. Both operands
  // gathered (no caller: the producer threads spilled there) declines too.
  if (m == Mode::off || !sm90_available(t) || (g.dy && g.x) ||
      !dw_operands_fit(dw, dy, x, out, in, experts))
    return false;
  if (rows == 0 || experts == 0) {  // every dw[e] += 0 (or = 0)
    if (overwrite)
      MOE_CUDA_CHECK(
          cudaMemsetAsync(dw, 0, size_t(experts) * out * in * sizeof(float), stream_of(ctx)));
    return true;
  }
  with_config<true>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    if (g.dy)
      launch_dw<C, T, true, false, kS>(ctx, t, dw, dy, x, offsets, experts, rows, out, in,
                                       overwrite, g);
    else if (g.x)
      launch_dw<C, T, false, true, kS>(ctx, t, dw, dy, x, offsets, experts, rows, out, in,
                                       overwrite, g);
    else
      launch_dw<C, T, false, false, kS>(ctx, t, dw, dy, x, offsets, experts, rows, out, in,
                                        overwrite);
  });
  return true;
}

}  // namespace moe::cuda_detail
