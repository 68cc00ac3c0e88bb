// Losses on CUDA: softmax cross-entropy for the LM head and binary cross-entropy with logits for
// the MoD predictor, forward and backward, with the math of kernels/cpu/loss.cpp. Arithmetic is
// fp32 for f32/f16/bf16 storage (double for f64); results are rounded once into the storage dtype.
// The cross-entropy's losses and lse are kept in that arithmetic type (acc_t<T>, acc_dtype(logits)
// in the op's contract): a 16-bit lse would shift every probability of the backward by up to half
// a 16-bit ulp of lse, and 16-bit per-token losses would be summed already rounded.
//
// The cross-entropy kernels stream the [N, V] logits (1 GB at 16k tokens x 32k vocab): both are
// bandwidth-bound, so each thread reads whole 16-byte vectors, kUnroll of them issued before any is
// used (scalar 2-byte loads, one at a time, reached ~30% of the copy bandwidth). A row is split
// into a scalar head up to its first 16-byte boundary, the aligned vectors, and a scalar tail, so
// any V (and rows at any offset) take the vector path for all but < 2 * 16 bytes of each row.
// fp32 exponentials are one multiply by log2(e) and one ex2.approx (max relative error ~2^-22,
// far below the fp32 tolerance of the sum): the accurate expf adds ~8 instructions per element,
// which would bring the forward's ALU time close to its memory time. f64 (the gradient-check path)
// keeps exp.
//
// - cross_entropy_forward: one block per row. Each thread runs an online log-sum-exp over its
//   share of the row, 16 bytes at a time: the running max m and the sum s of exp(x - m), s
//   rescaled once per vector when the vector's max exceeds m. The per-thread (m, s) pairs are
//   merged in a fixed tree (warp shuffles, then the warps in index order): lse = m + log s,
//   loss = lse - x[target] (0 when the target is < 0; the thread that reads x[target] keeps it,
//   so there is no dependent load at the end). One read of the logits; the order of every sum
//   depends only on V and the row's offset within 16 bytes, so a given buffer gives the same bits
//   on every run.
// - cross_entropy_backward: one block per row; each thread reads a vector of logits, then writes
//   grad_scale * (exp(x - lse) - [j == target]) to the same 16 bytes, so dlogits may alias logits
//   (every element has one reader, which is its writer). Ignored rows (target < 0) are written as
//   zeros (selected per element, so the row's loads never wait for the target). A dlogits whose
//   rows sit at another offset within 16 bytes than the logits' rows takes the scalar path (the
//   same per-element arithmetic).
// - cross_entropy_forward_backward: one block per row, one read of it for both: each thread holds
//   its share of the row in registers (kVecs 16-byte vectors, loaded before any is used) from the
//   forward's online log-sum-exp until the backward's values are written over the same 16 bytes.
//   Each thread adds its values in the forward's order and the tree is the forward's, so lse and
//   loss are its bits, and each gradient element is the backward's arithmetic on that lse: the
//   same bits as the two kernels, from two thirds of their traffic (moe-small: 2 GB of logits
//   moved per step instead of 3). Rows longer than the registers hold (16-bit V > 32768) or a
//   dlogits at another 16-byte phase than the logits take the two kernels.
// - bce_with_logits_forward: kBceBlocks blocks (fixed) sum max(x, 0) - x t + log1p(exp(-|x|))
//   over their shares of N in double, the last to finish adds the partials in block order: the
//   mean is bitwise the same on every run.
// - bce_with_logits_backward: elementwise, grad_scale / N * (sigmoid(x) - t).
// Target indices live on the device and are never read by the host: a target >= V (a caller bug,
// which the CPU op reports) gives NaN for that row's loss and gradient instead of an out-of-range
// read.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/loss_checks.hpp"
#include "cuda/block_ticket.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/loss.hpp"

namespace moe::cuda_detail::loss_impl {
namespace {

constexpr int kWarp = 32;
constexpr int kRowThreads = 256;  // threads per cross-entropy row
constexpr int kUnroll = 4;        // 16-byte loads in flight per thread
constexpr int kBceBlocks = 32;    // bce_with_logits_forward: fixed (the sum's order)
constexpr int kBceThreads = 256;
constexpr int kElementwiseThreads = 256;
__device__ double g_bce_partials[kBceBlocks];  // bce_forward_kernel's per-block sums
__device__ int g_bce_ticket;

// e^d for the cross-entropy, d = x - (row max or lse) <= 0 in the common case. fp32: one multiply
// and one ex2.approx; -inf gives 0, NaN gives NaN, results below 2^-126 flush to 0 (a sum term
// that small is nothing next to the row's largest, 1; a probability that small a zero gradient).
__device__ __forceinline__ float ce_exp(float d) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * 1.4426950408889634f));  // log2(e)
  return r;
}
__device__ __forceinline__ double ce_exp(double d) {
  return exp(d);
}

// A 16-byte vector to / from its values in A. bf16 widens by a shift (exact, as
// __bfloat162float) and narrows two at a time (one cvt on sm_80+): the per-element intrinsics
// cost ~50% more registers here, which limits the blocks per SM.
template <class T>
__device__ __forceinline__ void unpack(const Vec16<T>& in, acc_t<T> (&x)[kVec<T>]) {
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) x[k] = load(in.v[k]);
}
template <>
__device__ __forceinline__ void unpack(const Vec16<__nv_bfloat16>& in, float (&x)[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(&in);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    x[2 * q] = __uint_as_float(words[q] << 16);
    x[2 * q + 1] = __uint_as_float(words[q] & 0xffff0000u);
  }
}
template <class T>
__device__ __forceinline__ Vec16<T> pack(const acc_t<T> (&x)[kVec<T>]) {
  Vec16<T> out;
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) out.v[k] = store<T>(x[k]);
  return out;
}
template <>
__device__ __forceinline__ Vec16<__nv_bfloat16> pack(const float (&x)[8]) {
  Vec16<__nv_bfloat16> out;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int q = 0; q < 4; ++q) pairs[q] = __floats2bfloat162_rn(x[2 * q], x[2 * q + 1]);
  return out;
}

// Elements of a row before its first 16-byte boundary: the scalar head. The whole row (v) when
// the vector path must not be used (`vec` false, or a pointer not even aligned to its element).
template <class T>
__device__ __forceinline__ int vector_head(const T* row, int v, bool vec) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(row);
  if (!vec || a % sizeof(T) != 0) return v;
  const int head = static_cast<int>(((16 - a % 16) % 16) / sizeof(T));
  return head < v ? head : v;
}

// Running log-sum-exp of one thread: m = the largest x seen (-inf while none is finite), s = sum
// of exp(x - m). x - m is exact near the max (the terms that matter), and the max's own term is
// exactly 1, so a one-element row gives lse = x, loss 0, bit for bit like the CPU.
template <class A>
struct OnlineLse {
  A m = neg_inf<A>(), s = A(0);

  // Adds the k values x[0..k): one rescale per call, then one exp per value.
  template <int K>
  __device__ __forceinline__ void add(const A (&x)[K]) {
    A top = x[0];
#pragma unroll
    for (int i = 1; i < K; ++i) top = fmax(top, x[i]);  // (drops NaN; the sum below keeps it)
    if (top > m) {
      s *= ce_exp(m - top);  // exp(-inf) = 0 on the first finite value
      m = top;
    }
    // Until a finite value is seen, -inf values add exp(-inf) = 0 (not exp(-inf - -inf) = NaN);
    // NaN values add NaN wherever they are.
    const A off = m == neg_inf<A>() ? A(0) : m;
#pragma unroll
    for (int i = 0; i < K; ++i) s += ce_exp(x[i] - off);
  }

  __device__ __forceinline__ void add1(A x) {
    const A one[1] = {x};
    add(one);
  }

  // Merges another state in: the smaller maximum's sum is rescaled to the larger one. A state
  // with m = -inf contributes s2 * 0 (0, or NaN when it saw a NaN).
  __device__ __forceinline__ void merge(A m2, A s2) {
    if (m2 > m) {
      const A tm = m, ts = s;
      m = m2, s = s2, m2 = tm, s2 = ts;
    }
    s += m2 == neg_inf<A>() ? s2 * A(0) : s2 * ce_exp(m2 - m);
  }

  __device__ __forceinline__ A lse() const {
    return m + dev_log(s);
  }
};

// Block-wide merge of every thread's state in a fixed tree; the result is returned to thread 0.
// blockDim.x == kRowThreads.
template <class A>
__device__ void block_lse(OnlineLse<A>& st) {
  __shared__ A sh_m[kRowThreads / kWarp], sh_s[kRowThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const A m2 = __shfl_down_sync(0xffffffffu, st.m, o);
    const A s2 = __shfl_down_sync(0xffffffffu, st.s, o);
    st.merge(m2, s2);
  }
  if (lane == 0) {
    sh_m[warp] = st.m;
    sh_s[warp] = st.s;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kRowThreads / kWarp; ++w) st.merge(sh_m[w], sh_s[w]);
}

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    ce_forward_kernel(acc_t<T>* __restrict__ losses, acc_t<T>* __restrict__ lse,
                      const T* __restrict__ logits, const int32_t* __restrict__ targets, int v) {
  using A = acc_t<T>;
  constexpr int kV = kVec<T>;
  __shared__ A target_logit;  // written by the thread that reads it, read by thread 0
  const int64_t n = blockIdx.x;
  const T* row = logits + n * v;
  const int t = targets[n];  // every thread: issued with the first row loads, no dependent load
  OnlineLse<A> st;
  const int head = vector_head(row, v, true);
  const int nvec = (v - head) / kV;
  const int tail = head + nvec * kV;
  // The scalar head and tail (fewer than kV elements each unless the row has no vector part).
  auto scalar = [&](int j) {
    const A x = load(row[j]);
    if (j == t) target_logit = x;
    st.add1(x);
  };
  for (int j = threadIdx.x; j < head; j += kRowThreads) scalar(j);
  for (int j = tail + threadIdx.x; j < v; j += kRowThreads) scalar(j);
  const T* vrow = row + head;
  for (int c0 = threadIdx.x; c0 < nvec; c0 += kUnroll * kRowThreads) {
    Vec16<T> buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * kRowThreads;
      if (c < nvec) buf[u] = load16(vrow + static_cast<int64_t>(c) * kV);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * kRowThreads;
      if (c >= nvec) break;
      A x[kV];
      unpack(buf[u], x);
      const int j0 = head + c * kV;
      if (static_cast<unsigned>(t - j0) < static_cast<unsigned>(kV)) {  // (rare: one thread)
#pragma unroll
        for (int k = 0; k < kV; ++k)
          if (j0 + k == t) target_logit = x[k];
      }
      st.add(x);
    }
  }
  block_lse(st);  // (its barrier also orders the target_logit write before the read below)
  if (threadIdx.x != 0) return;
  const A row_lse = st.lse();
  lse[n] = row_lse;
  if (t < 0)
    losses[n] = A(0);
  else if (t >= v)
    losses[n] = std::numeric_limits<A>::quiet_NaN();
  else
    losses[n] = row_lse - target_logit;
}

// The backward's value of element j of a row (ce_backward_kernel, ce_fused_kernel).
template <class A>
__device__ __forceinline__ A ce_gradient(int j, A x, int t, int v, A row_lse, A grad_scale) {
  const A p = ce_exp(x - row_lse);
  const A g = grad_scale * (j == t ? p - A(1) : p);
  return t < 0 ? A(0) : t >= v ? std::numeric_limits<A>::quiet_NaN() : g;
}

// drow[j0 .. j0 + kVec) = f(j, x) over a vector `in` loaded from the row at j0, stored whole.
template <class T, class F>
__device__ __forceinline__ void map_vector(T* drow, int j0, const Vec16<T>& in, F&& f) {
  acc_t<T> x[kVec<T>];
  unpack(in, x);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) x[k] = f(j0 + k, x[k]);
  store16(drow + j0, pack<T>(x));
}

// drow[j] = f(j, logit j) for every j of a row: scalar head and tail, then 16-byte vectors with
// kUnroll loads in flight. Each element is read, then written, by one thread (so drow may be row).
// drow and row must sit at the same offset within 16 bytes unless head == v.
template <class T, class F>
__device__ __forceinline__ void map_row(T* drow, const T* row, int v, int head, F&& f) {
  using A = acc_t<T>;
  constexpr int kV = kVec<T>;
  const int nvec = (v - head) / kV;
  const int tail = head + nvec * kV;
  for (int j = threadIdx.x; j < head; j += kRowThreads) drow[j] = store<T>(f(j, load(row[j])));
  for (int j = tail + threadIdx.x; j < v; j += kRowThreads) drow[j] = store<T>(f(j, load(row[j])));
  for (int c0 = threadIdx.x; c0 < nvec; c0 += kUnroll * kRowThreads) {
    Vec16<T> buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * kRowThreads;
      if (c < nvec) buf[u] = load16(row + head + static_cast<int64_t>(c) * kV);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * kRowThreads;
      if (c >= nvec) break;
      map_vector(drow, head + c * kV, buf[u], f);
    }
  }
}

// dlogits and logits may be the same memory: deliberately not __restrict__.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    ce_backward_kernel(T* dlogits, const T* logits, const acc_t<T>* __restrict__ lse,
                       const int32_t* __restrict__ targets, int v, acc_t<T> grad_scale, bool vec) {
  using A = acc_t<T>;
  const int64_t n = blockIdx.x;
  // Loaded with the row (the row's loads do not wait for them): ignored and out-of-range rows
  // are selected per element rather than branched on first.
  const int t = targets[n];
  const A row_lse = lse[n];
  const T* row = logits + n * v;
  T* drow = dlogits + n * v;
  map_row(drow, row, v, vector_head(row, v, vec),
          [&](int j, A x) { return ce_gradient(j, x, t, v, row_lse, grad_scale); });
}

// Vectors a thread of the fused kernel holds at most; 16 x 16 bytes in 64 registers, two blocks
// per SM within the launch bounds' 128.
constexpr int kFusedMaxVecs = 16;

// dlogits and logits may be the same memory (each element is read, then written, by one thread):
// deliberately not __restrict__. Rows with no more than kVecs * kRowThreads vectors.
template <class T, int kVecs>
__global__ void __launch_bounds__(kRowThreads, 2)
    ce_fused_kernel(acc_t<T>* __restrict__ losses, acc_t<T>* __restrict__ lse, T* dlogits,
                    const T* logits, const int32_t* __restrict__ targets, int v,
                    acc_t<T> grad_scale) {
  using A = acc_t<T>;
  constexpr int kV = kVec<T>;
  __shared__ A target_logit, row_lse_shared;
  const int64_t n = blockIdx.x;
  const T* row = logits + n * v;
  T* drow = dlogits + n * v;
  const int t = targets[n];
  const int head = vector_head(row, v, true);
  const int nvec = (v - head) / kV;
  const int tail = head + nvec * kV;
  const int tid = static_cast<int>(threadIdx.x);
  // The forward's order: the scalar head, the scalar tail, then the thread's vectors
  // tid, tid + kRowThreads, ... (ce_forward_kernel's unrolled rounds visit them so).
  Vec16<T> buf[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int c = tid + i * kRowThreads;
    if (c < nvec) buf[i] = load16(row + head + static_cast<int64_t>(c) * kV);
  }
  const bool has_head = tid < head, has_tail = tail + tid < v;  // (head, v - tail < kV)
  const A head_x = has_head ? load(row[tid]) : A(0);
  const A tail_x = has_tail ? load(row[tail + tid]) : A(0);
  OnlineLse<A> st;
  if (has_head) {
    if (tid == t) target_logit = head_x;
    st.add1(head_x);
  }
  if (has_tail) {
    if (tail + tid == t) target_logit = tail_x;
    st.add1(tail_x);
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int c = tid + i * kRowThreads;
    if (c >= nvec) break;
    A x[kV];
    unpack(buf[i], x);
    const int j0 = head + c * kV;
    if (static_cast<unsigned>(t - j0) < static_cast<unsigned>(kV)) {
#pragma unroll
      for (int k = 0; k < kV; ++k)
        if (j0 + k == t) target_logit = x[k];
    }
    st.add(x);
  }
  block_lse(st);  // (its barrier orders the target_logit write before thread 0's read)
  if (tid == 0) {
    const A row_lse = st.lse();
    lse[n] = row_lse;
    losses[n] = t < 0    ? A(0)
                : t >= v ? std::numeric_limits<A>::quiet_NaN()
                         : row_lse - target_logit;
    row_lse_shared = row_lse;
  }
  __syncthreads();
  // The lse as the backward kernel reads it back (lse is stored in A: no rounding in between).
  const A row_lse = row_lse_shared;
  if (has_head) drow[tid] = store<T>(ce_gradient(tid, head_x, t, v, row_lse, grad_scale));
  if (has_tail)
    drow[tail + tid] = store<T>(ce_gradient(tail + tid, tail_x, t, v, row_lse, grad_scale));
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int c = tid + i * kRowThreads;
    if (c >= nvec) break;
    map_vector(drow, head + c * kV, buf[i],
               [&](int j, A x) { return ce_gradient(j, x, t, v, row_lse, grad_scale); });
  }
}

// grid kBceBlocks, block kBceThreads: block b sums its contiguous share of the N terms (each
// thread a strided subset in index order, in double, then a fixed tree), publishes the partial
// and takes a ticket; the last block adds the partials in block order. The order depends on N
// alone: the mean is bitwise the same on every run. (One block, as before, spent ~10 us of
// serial load latency on moe-small's 16K logits; the partials and the ticket are per device, so
// two of these must not run at once on different streams: the model issues them on one.)
template <class T>
__global__ void __launch_bounds__(kBceThreads)
    bce_forward_kernel(T* __restrict__ loss, const T* __restrict__ logits,
                       const T* __restrict__ targets, int64_t n) {
  using A = acc_t<T>;
  __shared__ double sh[kBceThreads / kWarp];
  const int64_t begin = n * blockIdx.x / kBceBlocks, end = n * (blockIdx.x + 1) / kBceBlocks;
  double sum = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kBceThreads) {
    const A x = load(logits[i]), t = load(targets[i]);
    sum += static_cast<double>((x > A(0) ? x : A(0)) - x * t + dev_log1p(dev_exp(-dev_abs(x))));
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
  if (lane == 0) sh[warp] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  double total = 0;
  for (int w = 0; w < kBceThreads / kWarp; ++w) total += sh[w];
  g_bce_partials[blockIdx.x] = total;
  // thread 0 alone: its partial's store is ordered before its own release
  if (block_ticket_add(&g_bce_ticket, 1) != kBceBlocks - 1) return;
  double all = 0;
  for (int b = 0; b < kBceBlocks; ++b) all += g_bce_partials[b];
  g_bce_ticket = 0;  // for the next launch (stream-ordered after this one)
  loss[0] = store<T>(static_cast<A>(n > 0 ? all / static_cast<double>(n) : 0.0));
}

// dlogits may alias logits: element i is read, then written, by one thread.
template <class T>
__global__ void bce_backward_kernel(T* dlogits, const T* logits, const T* __restrict__ targets,
                                    int64_t n, acc_t<T> scale) {
  using A = acc_t<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const A x = load(logits[i]), t = load(targets[i]);
    const A sig = A(1) / (A(1) + dev_exp(-x));  // 0 or 1 (never NaN) for large |x|
    dlogits[i] = store<T>(scale * (sig - t));
  }
}

// Host-side part of the CPU op's target check: shape and dtype (values are on the device).
unsigned elementwise_blocks(int64_t n) {
  const int64_t cap = int64_t{1} << 16;  // grid-stride beyond this
  const int64_t b = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > cap ? cap : b));
}

// ---- host side ----------------------------------------------------------------------------------

void cross_entropy_forward_cuda(Ctx& ctx, Tensor losses, Tensor lse, Tensor logits,
                                Tensor targets) {
  check_cross_entropy_forward_args(losses, lse, logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_loss_targets_args(targets, n, "cross_entropy_forward");
  check_on_gpu({&losses, &lse, &logits, &targets}, "cross_entropy_forward");
  if (n == 0) return;
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(), "cross_entropy_forward: too many rows");
  MOE_CHECK(v <= std::numeric_limits<int32_t>::max(), "cross_entropy_forward: V too large");
  dispatch_storage(logits.dtype, "cross_entropy_forward", [&](auto zero) {
    using T = decltype(zero);
    ce_forward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream_of(ctx)>>>(
        data_of<acc_t<T>>(losses), data_of<acc_t<T>>(lse), data_of<T>(logits),
        static_cast<const int32_t*>(targets.data), static_cast<int>(v));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void cross_entropy_backward_cuda(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor lse,
                                 Tensor targets, double grad_scale) {
  check_cross_entropy_backward_args(dlogits, logits, lse);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_loss_targets_args(targets, n, "cross_entropy_backward");
  check_on_gpu({&dlogits, &logits, &lse, &targets}, "cross_entropy_backward");
  if (n == 0) return;
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(), "cross_entropy_backward: too many rows");
  MOE_CHECK(v <= std::numeric_limits<int32_t>::max(), "cross_entropy_backward: V too large");
  // Vectors need dlogits' rows at the logits' offset within 16 bytes (always so in place).
  const uintptr_t gap =
      reinterpret_cast<uintptr_t>(dlogits.data) - reinterpret_cast<uintptr_t>(logits.data);
  const bool vec = gap % 16 == 0;
  dispatch_storage(logits.dtype, "cross_entropy_backward", [&](auto zero) {
    using T = decltype(zero);
    ce_backward_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dlogits), data_of<T>(logits), data_of<acc_t<T>>(lse),
        static_cast<const int32_t*>(targets.data), static_cast<int>(v),
        static_cast<acc_t<T>>(grad_scale), vec);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void cross_entropy_forward_backward_cuda(Ctx& ctx, Tensor losses, Tensor lse, Tensor dlogits,
                                         Tensor logits, Tensor targets, double grad_scale) {
  check_cross_entropy_forward_backward_args(losses, lse, dlogits, logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_loss_targets_args(targets, n, "cross_entropy_forward_backward");
  check_on_gpu({&losses, &lse, &dlogits, &logits, &targets}, "cross_entropy_forward_backward");
  if (n == 0) return;
  MOE_CHECK(n <= std::numeric_limits<int32_t>::max(),
            "cross_entropy_forward_backward: too many rows");
  MOE_CHECK(v <= std::numeric_limits<int32_t>::max(),
            "cross_entropy_forward_backward: V too large");
  const uintptr_t gap =
      reinterpret_cast<uintptr_t>(dlogits.data) - reinterpret_cast<uintptr_t>(logits.data);
  bool fused = false;
  dispatch_storage(logits.dtype, "cross_entropy_forward_backward", [&](auto zero) {
    using T = decltype(zero);
    // Vectors per thread: the row's (at most; its head shortens it) over the block's threads.
    const int64_t per_thread = (v / kVec<T> + kRowThreads - 1) / kRowThreads;
    // (A row pointer off its element alignment would make the whole row the scalar head.)
    if (gap % 16 != 0 || per_thread > kFusedMaxVecs ||
        reinterpret_cast<uintptr_t>(logits.data) % sizeof(T) != 0)
      return;
    fused = true;
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream_of(ctx)>>>(
          data_of<acc_t<T>>(losses), data_of<acc_t<T>>(lse), data_of<T>(dlogits),
          data_of<T>(logits), static_cast<const int32_t*>(targets.data), static_cast<int>(v),
          static_cast<acc_t<T>>(grad_scale));
      MOE_CUDA_LAUNCH_CHECK();
    };
    // Fewer registers for short rows (more blocks per SM).
    if (per_thread <= 4)
      launch(ce_fused_kernel<T, 4>);
    else if (per_thread <= 8)
      launch(ce_fused_kernel<T, 8>);
    else
      launch(ce_fused_kernel<T, kFusedMaxVecs>);
  });
  if (fused) return;
  cross_entropy_forward_cuda(ctx, losses, lse, logits, targets);
  cross_entropy_backward_cuda(ctx, dlogits, logits, lse, targets, grad_scale);
}

void bce_with_logits_forward_cuda(Ctx& ctx, Tensor loss, Tensor logits, Tensor targets) {
  check_bce_with_logits_forward_args(loss, logits, targets);
  check_on_gpu({&loss, &logits, &targets}, "bce_with_logits_forward");
  dispatch_storage(logits.dtype, "bce_with_logits_forward", [&](auto zero) {
    using T = decltype(zero);
    bce_forward_kernel<T><<<kBceBlocks, kBceThreads, 0, stream_of(ctx)>>>(
        data_of<T>(loss), data_of<T>(logits), data_of<T>(targets), logits.size(0));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void bce_with_logits_backward_cuda(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor targets,
                                   double grad_scale) {
  check_bce_with_logits_backward_args(dlogits, logits, targets);
  check_on_gpu({&dlogits, &logits, &targets}, "bce_with_logits_backward");
  const int64_t n = logits.size(0);
  if (n == 0) return;
  const double scale = grad_scale / static_cast<double>(n);
  dispatch_storage(logits.dtype, "bce_with_logits_backward", [&](auto zero) {
    using T = decltype(zero);
    bce_backward_kernel<T><<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dlogits), data_of<T>(logits), data_of<T>(targets), n,
        static_cast<acc_t<T>>(scale));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail::loss_impl

MOE_REGISTER_CUDA_OP(cross_entropy_forward,
                     &::moe::cuda_detail::loss_impl::cross_entropy_forward_cuda);
MOE_REGISTER_CUDA_OP(cross_entropy_backward,
                     &::moe::cuda_detail::loss_impl::cross_entropy_backward_cuda);
MOE_REGISTER_CUDA_OP(cross_entropy_forward_backward,
                     &::moe::cuda_detail::loss_impl::cross_entropy_forward_backward_cuda);
MOE_REGISTER_CUDA_OP(bce_with_logits_forward,
                     &::moe::cuda_detail::loss_impl::bce_with_logits_forward_cuda);
MOE_REGISTER_CUDA_OP(bce_with_logits_backward,
                     &::moe::cuda_detail::loss_impl::bce_with_logits_backward_cuda);
