// A block's ticket on a device counter, for kernels whose last block to finish does a final step
// over what every block published (the routers' counts, mod_route's sequences, the BCE's sum).
#pragma once
#include <cuda_runtime.h>

namespace moe::cuda_detail {

// A block's ticket: thread 0 adds `v` to *ticket with release and acquire semantics at GPU scope
// and returns the old value. Called after a block barrier, the release orders every access of
// the block's threads before it (the barrier makes them happen before thread 0's atom; release is
// cumulative), so one fence-free atom replaces a __threadfence in every thread (each of which
// waited for that thread's own stores, the token outputs included, which no other block reads);
// a block that reads what the others published acquires through the same atom, then its barrier.
__device__ __forceinline__ int block_ticket_add(int* ticket, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(ticket), "r"(v)
               : "memory");
  return old;
}

}  // namespace moe::cuda_detail
