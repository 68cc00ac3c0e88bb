// PTX wrappers for Hopper's tensor memory accelerator (TMA) and the shared-memory barriers that
// track it (sm_90a, like wgmma_sm90.cuh: the bodies exist only where MOE_HAS_WGMMA is 1), plus
// the warp-specialisation primitives the TMA kernels use (setmaxnreg, named barriers).
//
// A TMA load copies a box of a tensor described by a CUtensorMap (built on the host) into shared
// memory, zero-filling the parts of the box outside the tensor, and counts its bytes against an
// mbarrier ("complete_tx"). A consumer waits on the barrier's phase parity: the k-th completion
// of a barrier flips its phase, so the consumer of round r waits for parity r % 2.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/wgmma_sm90.cuh"

namespace moe::cuda_detail {

// cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda); host
// code of the TMA kernels' launchers (one lookup per process).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                    cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      throw InternalError("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12+)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// Initialises the barrier at shared address `bar` to expect `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if MOE_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes barrier initialisation visible to the async proxy (the TMA unit) before its first use;
// a block barrier after it publishes it to the other threads.
__device__ __forceinline__ void mbar_init_fence() {
#if MOE_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival that also tells the barrier to wait for `bytes` more bytes of TMA traffic.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if MOE_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if MOE_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// Spins until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if MOE_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// Loads the box at coordinates (c0, c1[, c2]) (innermost first, in elements) of `map` into shared
// memory at `dst`, completing `bytes` of transaction on the barrier `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int32_t c0, int32_t c1) {
#if MOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
#endif
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int32_t c0, int32_t c1, int32_t c2) {
#if MOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#endif
}

// Thread-block clusters (the multicast grouped GEMM): tma_load_3d as tma_load_3d_multicast, the
// box written into the same shared-memory offset `dst` of every block of the cluster in
// `cta_mask` (bit r: the block of rank r), its bytes completed on the barrier at offset `bar` of
// each.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int32_t c0, int32_t c1,
                                                      int32_t c2, uint16_t cta_mask) {
#if MOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
#endif
}

// This block's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if MOE_HAS_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}

// The shared::cluster address of the barrier at this block's shared address `bar` in the block of
// rank `cta` (mapa), for mbar_arrive_remote.
__device__ __forceinline__ uint32_t cluster_peer_address(uint32_t bar, uint32_t cta) {
  uint32_t remote = 0;
#if MOE_HAS_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
#endif
  return remote;
}

// One arrival on another block's barrier (remote: from cluster_peer_address). The reads it
// answers for (the wgmma that read a stage the peer's TMA multicast filled) retired at the
// caller's wgmma wait, so the default semantics (release at CTA scope) suffice: a release at
// cluster scope made every arrival a cluster-wide fence, in each math warp once a slice.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote) {
#if MOE_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
#endif
}

// Every thread of every block of the cluster arrives, then waits for all: after the barriers'
// initialisation (no block multicasts into a peer's ring before the peer set it up) and at the
// end (no block exits while a peer may still write into its shared memory or arrive on it).
// Every non-exited thread of the cluster must call it.
__device__ __forceinline__ void cluster_sync() {
#if MOE_HAS_WGMMA
  asm volatile(
      "barrier.cluster.arrive.release;\n"
      "barrier.cluster.wait.acquire;\n" ::
          : "memory");
#endif
}

// Warp specialisation: the producer warpgroup gives registers back (kRegs per thread) so the
// math warpgroups can take more; every warp of a warpgroup must execute the same call.
// setmaxnreg.inc only takes what a .dec gave back within the block, whose registers are fixed at
// launch: 168 a thread for 384 threads (65,536 / 384 in units of 8). A claim beyond it waits for
// ever (the 42nd session's 32 + 2 x 240 hung), so every kernel asserts this for its pair.
constexpr bool setmaxnreg_fits(int producer_regs, int math_regs) {
  return producer_regs + 2 * math_regs <= 3 * 168;
}
template <int kRegs>
__device__ __forceinline__ void release_registers() {
#if MOE_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void claim_registers() {
#if MOE_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Stores the box at shared address `src` to coordinates (c0, c1) (innermost first) of `map`,
// leaving out the parts outside the tensor; asynchronous, in this thread's bulk group. The
// threads that wrote `src` must fence_proxy_async_smem() first (and a barrier must follow).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int32_t c0,
                                             int32_t c1) {
#if MOE_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
#endif
}
// Closes this thread's bulk group of TMA stores.
__device__ __forceinline__ void tma_store_commit() {
#if MOE_HAS_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's committed TMA stores have read their shared memory (it may be
// written again) / have written global memory.
// kPending: all but this thread's kPending most recent groups.
template <int kPending = 0>
__device__ __forceinline__ void tma_store_wait_read() {
#if MOE_HAS_WGMMA
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}
__device__ __forceinline__ void tma_store_wait_all() {
#if MOE_HAS_WGMMA
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Copies kBytes (4 or 16) at global `src` to shared address `dst` asynchronously (cp.async,
// sm_80+; 16-byte copies bypass L1); with !valid it writes zeros and reads nothing.
// cp_async_wait_all: this thread's copies have landed (a barrier after it publishes them).
template <int kBytes>
__device__ __forceinline__ void cp_async_shared(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 16, "cp.async copies 4 (.ca) or 16 (.cg) bytes here");
#if MOE_HAS_WGMMA
  if constexpr (kBytes == 4)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
#endif
}
// An arrival on the barrier at `bar` once this thread's cp.async so far have landed, counted as
// one of the arrivals the barrier expects (.noinc: its init count includes these).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
#if MOE_HAS_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if MOE_HAS_WGMMA
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads of the block.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace moe::cuda_detail
