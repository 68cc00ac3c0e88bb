// How long the grouped GEMM epilogue's TMA stores take to read their shared-memory staging (and
// to complete) when every SM stores at once, as the persistent rows kernels' blocks do at the end
// of each tile round: the question behind the deferred epilogue's release point (docs/perf.md,
// 31st session; MOE_GROUPED_DEFER=1 frees the held stage right after the next tile's first
// slice, =3 two slices later). If the reads take a few hundred cycles, the held stage is back in
// the ring at once; if they drain at the SMs' share of the write rate (~2 us for 48 KiB an SM),
// warpgroup 0 would wait at the release.
// Each block (one an SM, or one in all) fills `bytes` of shared memory, hands them to one bulk
// store (cp.async.bulk, shared -> global) into its next slot of a 1 GiB ring (far past L2, as the
// kernels' outputs are), and times with clock64 until `cp.async.bulk.wait_group.read 0` returns
// and until `wait_group 0` does; then it spins `gap` cycles (the next tile's main loop) and
// repeats. Printed: the mean cycles and microseconds of both waits per round.
// Not part of the build; on an sm_90 machine:
//   nvcc -std=c++17 -O3 -arch=sm_90a scripts/microbench/tma_store_drain.cu -o /tmp/tma_store_drain
//   /tmp/tma_store_drain [rounds = 200]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "check.cuh"

constexpr size_t kRingBytes = size_t(1) << 30;

__global__ void __launch_bounds__(128, 1) drain_kernel(unsigned char* ring, int bytes, int rounds,
                                                       long long gap, unsigned long long* cycles) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  unsigned long long read_sum = 0, done_sum = 0;
  const size_t slots = kRingBytes / size_t(bytes);
  for (int r = 0; r < rounds; ++r) {
    for (int i = threadIdx.x * 4; i < bytes; i += blockDim.x * 4)
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + i), "r"(i ^ r) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      const size_t slot = (size_t(r) * gridDim.x + blockIdx.x) % slots;
      unsigned char* dst = ring + slot * size_t(bytes);
      const long long t0 = clock64();
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                   "r"(base), "r"(bytes)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      const long long t1 = clock64();
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      const long long t2 = clock64();
      read_sum += t1 - t0;
      done_sum += t2 - t0;
      const long long until = t2 + gap;
      while (clock64() < until) {
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    cycles[2 * blockIdx.x] = read_sum;
    cycles[2 * blockIdx.x + 1] = done_sum;
  }
}

void run(unsigned char* ring, unsigned long long* cycles, int blocks, int bytes, int rounds,
         long long gap, double clock_ghz) {
  CK(cudaFuncSetAttribute(drain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  drain_kernel<<<blocks, 128, bytes>>>(ring, bytes, rounds, gap, cycles);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long* h = static_cast<unsigned long long*>(malloc(2 * blocks * sizeof(*h)));
  CK(cudaMemcpy(h, cycles, 2 * blocks * sizeof(*h), cudaMemcpyDeviceToHost));
  double read = 0, done = 0;
  for (int b = 0; b < blocks; ++b) read += double(h[2 * b]), done += double(h[2 * b + 1]);
  read /= double(blocks) * rounds;
  done /= double(blocks) * rounds;
  printf(
      "%3d block(s)  %3d KiB  gap %6lld cycles:  read %7.0f cycles (%5.2f us)  "
      "complete %7.0f cycles (%5.2f us)\n",
      blocks, bytes / 1024, gap, read, read / (clock_ghz * 1e3), done, done / (clock_ghz * 1e3));
  free(h);
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 200;
  int sms = 0, khz = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const double ghz = khz / 1e6;
  unsigned char* ring = nullptr;
  unsigned long long* cycles = nullptr;
  CK(cudaMalloc(&ring, kRingBytes));
  CK(cudaMalloc(&cycles, 2 * sms * sizeof(unsigned long long)));
  printf("%d SMs, clock %.2f GHz (the attribute; under load it may run lower)\n", sms, ghz);
  run(ring, cycles, sms, 32 * 1024, rounds / 10 + 1, 16000, ghz);  // warm-up
  // A rows tile at K = 1024 is ~16,000 tensor cycles; its epilogue stores 64 KiB (plain) or
  // 96 KiB (SwiGLU) a block: 32 / 48 KiB a warpgroup.
  for (int bytes : {16 * 1024, 32 * 1024, 48 * 1024, 96 * 1024}) {
    run(ring, cycles, sms, bytes, rounds, 16000, ghz);
    run(ring, cycles, 1, bytes, rounds, 16000, ghz);
  }
  run(ring, cycles, sms, 48 * 1024, rounds, 4000, ghz);  // stores back to back
  return 0;
}
