// Where the MoD select's time goes after the product (docs/perf.md, 44th session): moe-small's
// shape (16 sequences of 1,024 tokens, d = 1,024 bf16, keep 128) with a stand-in for the router's
// product (a bandwidth-bound dot product of every row with w, 128-thread blocks of 32 rows at four
// a multiprocessor, as gate_logits_kernel) and the trainer's selection (select_sequence of
// kernels/cuda/mod_select.cuh, 1,024 threads a sequence). Rows, each the mean of many
// back-to-back iterations:
//   product            the product alone
//   select             the selection alone (an ordinary launch)
//   pdl                the product, then the selection as its programmatic dependent (the trainer)
//   pdl_empty          ... a dependent that only waits for the product: the dependent launch's cost
//   pdl_io             ... a dependent that loads the scores, scans and stores (no search)
//   serial             the product, then the selection as an ordinary launch
//   one_launch         the product's block that finishes a sequence selects it (a ticket), by the
//                      bit search with 8 keys a thread and a warp-sum a bit (one barrier a bit)
//   pdl_nibble         pdl with the search taking 4 bits a round (ballots, two barriers a round)
//   pdl_multi256/128   pdl with one_launch's search in a dependent of 256 / 128 threads a sequence
// GB/s: the bar row's bytes (x, w, the scores and the mask written, sel) over each row's time, as
// `moe-train bench`'s mod_select row counts them. The alternative selections are checked against
// select_sequence's output (sel and mask bits) first; the exit status is 1 if any differs.
// Not part of the build; on a GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90 -Iinclude -Ikernels -Isrc \
//     scripts/microbench/mod_select_parts.cu -o /tmp/mod_select_parts && /tmp/mod_select_parts
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "check.cuh"
#include "cuda/block_ticket.cuh"
#include "cuda/mod_select.cuh"

namespace msp {
using namespace moe::cuda_detail;

constexpr int kB = 16, kT = 1024, kC = 128, kD = 1024;
constexpr int kN = kB * kT;
constexpr int kProdThreads = 128, kProdRows = 32;
constexpr int kSelThreads = 1024;

__device__ int g_tickets[kB];

// score[r] = <x[r, :], w> for the block's 32 rows: warp q takes rows q*8 .. q*8+7, two at a time,
// each lane 4 16-byte chunks of a row (8 loads in flight).
__device__ __forceinline__ void product_rows(float* scores, const __nv_bfloat16* x,
                                             const float* w) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row0 = blockIdx.x * kProdRows + warp * 8;
  for (int r = 0; r < 8; r += 2) {
    uint4 v[2][4];
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int u = 0; u < 4; ++u)
        v[q][u] =
            __ldcs(reinterpret_cast<const uint4*>(x + int64_t(row0 + r + q) * kD) + lane + 32 * u);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      float acc = 0.f;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[q][u]);
        const float4* wp = reinterpret_cast<const float4*>(w + (lane + 32 * u) * 8);
        const float4 w0 = __ldg(wp), w1 = __ldg(wp + 1);
        acc += __bfloat162float(h[0]) * w0.x + __bfloat162float(h[1]) * w0.y +
               __bfloat162float(h[2]) * w0.z + __bfloat162float(h[3]) * w0.w +
               __bfloat162float(h[4]) * w1.x + __bfloat162float(h[5]) * w1.y +
               __bfloat162float(h[6]) * w1.z + __bfloat162float(h[7]) * w1.w;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) scores[row0 + r + q] = acc;
    }
  }
}

template <bool kLet>
__global__ void __launch_bounds__(kProdThreads, 4)
    product_kernel(float* scores, const __nv_bfloat16* x, const float* w) {
  if constexpr (kLet) allow_dependent_launch();
  product_rows(scores, x, w);
}

template <bool kPdl>
__global__ void __launch_bounds__(kSelThreads)
    select_kernel(int32_t* sel, float* mask, const float* scores) {
  if constexpr (kPdl) wait_primary_grid();
  const int b = blockIdx.x;
  select_sequence<float, kSelThreads, false>(sel + b * kC, mask + b * kT, scores + b * kT, kT, kC);
}

__global__ void __launch_bounds__(kSelThreads) empty_kernel() {
  wait_primary_grid();
}

// The selection's loads, scan and stores with a made-up rule (the first C positions): no search.
__global__ void __launch_bounds__(kSelThreads)
    io_kernel(int32_t* sel, float* mask, const float* scores) {
  wait_primary_grid();
  const int b = blockIdx.x, i = threadIdx.x;
  const float s = scores[b * kT + i];
  const bool kept = i < kC;
  int gt = kept, eq = 0;
  block_exclusive_scan2<kSelThreads>(gt, eq);
  mask[b * kT + i] = kept ? 1.f : 0.f * s;  // (the score's load kept)
  if (kept) sel[b * kC + gt] = i;
}

// ---- the bit search with several keys a thread (one barrier a bit) ----

// Selection of one sequence by a block of kThreads threads, kPer contiguous keys a thread.
template <int kThreads, int kPer>
__device__ void select_multi(int32_t* s, float* m, const float* r) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int counts[2][kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int i0 = threadIdx.x * kPer;
  uint32_t key[kPer];
#pragma unroll
  for (int j = 0; j < kPer; j += 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(r + i0 + j));
    key[j] = score_key(v.x), key[j + 1] = score_key(v.y), key[j + 2] = score_key(v.z),
    key[j + 3] = score_key(v.w);
  }
  uint32_t p = 0;
  bool exact = false;
  int round = 0;
  for (int bit = 31; bit >= 0; --bit, ++round) {
    const uint32_t cand = p | (1u << bit);
    int n = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) n += key[j] >= cand;
    n = __reduce_add_sync(0xffffffffu, n);
    if (lane == 0) counts[round & 1][warp] = n;
    __syncthreads();
    n = 0;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) n += counts[round & 1][q];
    if (n >= kC) {
      p = cand;
      if (n == kC) {
        exact = true;
        break;
      }
    }
  }
  int n_gt = 0, n_eq = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    n_gt += exact ? key[j] >= p : key[j] > p;
    n_eq += !exact && key[j] == p;
  }
  int gt_before = n_gt, eq_before = n_eq;
  block_exclusive_scan2<kThreads>(gt_before, eq_before);
  // The ties' total: the last thread's exclusive sum plus its own count, via the scan's shared.
  int k = kC;
  if (!exact) {
    __shared__ int total_gt;
    if (threadIdx.x == kThreads - 1) total_gt = gt_before + n_gt;
    __syncthreads();
    k = kC - total_gt;
  }
  int out = gt_before + min(eq_before, k), tie = eq_before;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const bool eq = !exact && key[j] == p;
    const bool kept = (exact ? key[j] >= p : key[j] > p) || (eq && tie < k);
    tie += eq;
    m[i0 + j] = kept ? 1.f : 0.f;
    if (kept) s[out++] = i0 + j;
  }
}

__global__ void __launch_bounds__(kProdThreads, 4)
    one_launch_kernel(float* scores, int32_t* sel, float* mask, const __nv_bfloat16* x,
                      const float* w) {
  product_rows(scores, x, w);
  __shared__ int last;
  __syncthreads();
  const int b = blockIdx.x * kProdRows / kT;
  // mod_route_kernel's ticket: one acq_rel atom after the barrier, no fences.
  if (threadIdx.x == 0) last = block_ticket_add(&g_tickets[b], kProdRows) + kProdRows == kT;
  __syncthreads();
  if (!last) return;
  select_multi<kProdThreads, kT / kProdThreads>(sel + b * kC, mask + b * kT, scores + b * kT);
  if (threadIdx.x == 0) g_tickets[b] = 0;
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    multi_kernel(int32_t* sel, float* mask, const float* scores) {
  wait_primary_grid();
  const int b = blockIdx.x;
  select_multi<kThreads, kT / kThreads>(sel + b * kC, mask + b * kT, scores + b * kT);
}

// ---- the bit search four bits a round (ballots) ----

__global__ void __launch_bounds__(kSelThreads)
    nibble_kernel(int32_t* sel, float* mask, const float* scores) {
  wait_primary_grid();
  constexpr int kWarps = kSelThreads / 32;
  __shared__ int wc[kWarps][16];  // per warp: candidates with digit >= j
  __shared__ int pick[3];         // digit, keys above the new prefix, exact
  const int b = blockIdx.x, i = threadIdx.x, lane = i % 32, warp = i / 32;
  const uint32_t key = score_key(scores[b * kT + i]);
  // Invariant: p holds the bits above shift + 4 of the C-th largest key; above counts the keys
  // whose bits there exceed p's.
  uint32_t p = 0, hi_mask = 0;
  int above = 0;
  bool exact = false;
  for (int shift = 28; shift >= 0; shift -= 4) {
    const bool cand = (key & hi_mask) == p;
    const int digit = cand ? int((key >> shift) & 15u) : -1;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const unsigned bal = __ballot_sync(0xffffffffu, digit >= j);
      if (lane == j) wc[warp][j] = __popc(bal);
    }
    __syncthreads();
    if (warp == 0) {
      int n = 0;  // lane j < 16: candidates with digit >= j over the block
      if (lane < 16)
#pragma unroll 8
        for (int q = 0; q < kWarps; ++q) n += wc[q][lane];
      const unsigned ok = __ballot_sync(0xffffffffu, lane < 16 && above + n >= kC);
      const int j = 31 - __clz(ok);  // lane 0 always qualifies (the invariant)
      const int nj = __shfl_sync(0xffffffffu, n, j);
      const int nj1 = __shfl_sync(0xffffffffu, n, (j + 1) & 31);
      if (lane == 0) {
        pick[0] = j;
        pick[1] = above + (j < 15 ? nj1 : 0);
        pick[2] = above + nj == kC;
      }
    }
    __syncthreads();
    p |= uint32_t(pick[0]) << shift;
    hi_mask |= 15u << shift;
    above = pick[1];
    if (pick[2]) {
      exact = true;
      break;
    }
  }
  // Kept: key >= p when exactly C reach it, else key > p or key == p among the first k.
  const bool gt = exact ? key >= p : key > p, eq = !exact && key == p;
  const int k = exact ? 0 : kC - above;
  int gt_before = gt, eq_before = eq;
  block_exclusive_scan2<kSelThreads>(gt_before, eq_before);
  const bool kept = gt || (eq && eq_before < k);
  mask[b * kT + i] = kept ? 1.f : 0.f;
  if (kept) sel[b * kC + gt_before + min(eq_before, k)] = i;
}

// ---- host ----

template <class Launch>
float time_us(Launch&& launch, int iters = 400) {
  for (int i = 0; i < 20; ++i) launch();
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return 1000.f * ms / iters;
}

// A sequence a block, as the product's programmatic dependent.
template <int kThreads = kSelThreads, class K, class... Args>
void launch_pdl(K kernel, Args... args) {
  CK(launch_dependent(kernel, dim3(kB), dim3(kThreads), nullptr, args...));
}

}  // namespace msp

int main() {
  using namespace msp;
  std::vector<__nv_bfloat16> hx(size_t(kN) * kD);
  std::vector<float> hw(kD);
  uint64_t st = 0x9e3779b97f4a7c15ull;
  auto rnd = [&] {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    return float((st >> 40) & 0xffffff) / float(1 << 24) - 0.5f;
  };
  for (auto& v : hx) v = __float2bfloat16(rnd());
  for (auto& v : hw) v = rnd() * 0.06f;
  __nv_bfloat16* x;
  float *w, *scores, *mask, *mask2;
  int32_t *sel, *sel2;
  CK(cudaMalloc(&x, hx.size() * 2));
  CK(cudaMalloc(&w, kD * 4));
  CK(cudaMalloc(&scores, kN * 4));
  CK(cudaMalloc(&mask, kN * 4));
  CK(cudaMalloc(&mask2, kN * 4));
  CK(cudaMalloc(&sel, kB * kC * 4));
  CK(cudaMalloc(&sel2, kB * kC * 4));
  CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, hw.data(), kD * 4, cudaMemcpyHostToDevice));
  const dim3 pgrid(kN / kProdRows);

  auto product = [&] { product_kernel<false><<<pgrid, kProdThreads>>>(scores, x, w); };
  auto product_let = [&] { product_kernel<true><<<pgrid, kProdThreads>>>(scores, x, w); };
  auto select = [&] { select_kernel<false><<<kB, kSelThreads>>>(sel, mask, scores); };
  auto pdl = [&] {
    product_let();
    launch_pdl(select_kernel<true>, sel, mask, (const float*)scores);
  };
  auto pdl_empty = [&] {
    product_let();
    launch_pdl(empty_kernel);
  };
  auto pdl_io = [&] {
    product_let();
    launch_pdl(io_kernel, sel2, mask2, (const float*)scores);
  };
  auto serial = [&] {
    product();
    select();
  };
  auto one_launch = [&] { one_launch_kernel<<<pgrid, kProdThreads>>>(scores, sel2, mask2, x, w); };
  auto pdl_multi256 = [&] {
    product_let();
    launch_pdl<256>(multi_kernel<256>, sel2, mask2, (const float*)scores);
  };
  auto pdl_multi128 = [&] {
    product_let();
    launch_pdl<128>(multi_kernel<128>, sel2, mask2, (const float*)scores);
  };
  auto pdl_nibble = [&] {
    product_let();
    launch_pdl(nibble_kernel, sel2, mask2, (const float*)scores);
  };

  // Correctness of the alternatives against select_sequence.
  std::vector<int32_t> s_ref(kB * kC), s_alt(kB * kC);
  std::vector<float> m_ref(kN), m_alt(kN);
  pdl();
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(s_ref.data(), sel, s_ref.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(m_ref.data(), mask, m_ref.size() * 4, cudaMemcpyDeviceToHost));
  bool all_ok = true;
  auto check = [&](const char* name, auto&& run) {
    CK(cudaMemset(sel2, 0xff, kB * kC * 4));
    CK(cudaMemset(mask2, 0xff, kN * 4));
    run();
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(s_alt.data(), sel2, s_alt.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(m_alt.data(), mask2, m_alt.size() * 4, cudaMemcpyDeviceToHost));
    const bool ok = s_alt == s_ref && std::memcmp(m_alt.data(), m_ref.data(), kN * 4) == 0;
    all_ok = all_ok && ok;
    std::printf("check %-12s %s\n", name, ok ? "same sel and mask" : "DIFFERENT");
  };
  check("one_launch", one_launch);
  check("pdl_nibble", pdl_nibble);
  check("pdl_multi256", pdl_multi256);
  check("pdl_multi128", pdl_multi128);

  const double bytes = double(kN) * kD * 2 + kD * 4 + kN * 4 * 2 + kB * kC * 4;
  std::printf("%-12s %9s %9s\n", "row", "us", "GB/s");
  for (int round = 0; round < 2; ++round) {
    struct Row {
      const char* name;
      float us;
    };
    std::vector<Row> rows = {
        {"product", time_us(product)},
        {"select", time_us(select)},
        {"pdl", time_us(pdl)},
        {"pdl_empty", time_us(pdl_empty)},
        {"pdl_io", time_us(pdl_io)},
        {"serial", time_us(serial)},
        {"one_launch", time_us(one_launch)},
        {"pdl_nibble", time_us(pdl_nibble)},
        {"pdl_multi256", time_us(pdl_multi256)},
        {"pdl_multi128", time_us(pdl_multi128)},
    };
    for (const Row& r : rows) std::printf("%-12s %9.2f %9.0f\n", r.name, r.us, bytes / r.us / 1e3);
  }
  return all_ok ? 0 : 1;
}
