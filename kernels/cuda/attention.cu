// Causal grouped-query attention on CUDA (training forward/backward) and single-query decode
// attention over a key/value cache. Same math as kernels/cpu/attention.cpp and decode.cpp.
// f16 / bf16 with head_dim 64 run the flash-style tensor-core kernels of attention_mma.cu; the
// SIMT kernels here cover everything else: correct, deterministic, O(T^2 hd) work, no T x T
// matrix anywhere.
//
// Layout of the work: one warp owns one row (a query row, or in the dk/dv kernel a key row). A
// row of hd <= 256 elements is spread over the warp's 32 lanes, lane l holding elements
// c = l + 32 r (r < NPER = ceil(hd / 32), a template parameter so the row lives in registers), so
// every load of a k/v/q row is coalesced. A dot product is a per-lane partial followed by an xor
// butterfly over the warp: every lane ends with the same, bitwise identical sum, and the summation
// order is fixed, so results do not depend on scheduling. Arithmetic is fp32 for f32/f16/bf16
// storage (double for f64), stored once, rounded, at the end.
//
// - attention_forward: warp per (b, h, i), an online softmax over keys j <= i (running max m,
//   running sum l, output accumulator rescaled by exp(m_old - m_new)); writes o_i = acc / l and
//   lse_i = m + log l, kept in the arithmetic type (acc_t<T>: acc_dtype(q), fp32 for 16-bit q, so
//   the backward recomputes probabilities from an unrounded lse). Rows are issued longest first (i
//   descending within a head) so the causal imbalance does not leave a long tail.
// - attention_backward, kernel 1 (dq): warp per (b, h, i): D_i = <dO_i, O_i>, then for j <= i
//   p_ij = exp(s_ij - lse_i), dS_ij = p_ij (dO_i . v_j - D_i), dq_i = scale sum_j dS_ij k_j.
// - attention_backward, kernel 2 (dk, dv): warp per (b, kv head g, key j), looping over the query
//   heads of g's group and queries i >= j, recomputing s_ij, p_ij, dP_ij and D_i from q, k, v, dO,
//   O and lse: dk_j = scale sum dS_ij q_i, dv_j = sum p_ij dO_i. Every dk/dv row has exactly one
//   writer, so there are no atomics and the result is deterministic. (D_i is recomputed per pair
//   because ops may not allocate scratch; it costs one more dot product per pair.)
// - attention_decode_forward: block of 4 warps per (b, h); warp w takes keys j = w, w + 4, ... <
//   lengths[b] with its own online softmax, then the four partial states are merged in shared
//   memory in a fixed order. lengths live on the device and are never read by the host: a length
//   outside [1, S_max] (a caller bug, which the CPU op reports) writes NaN to that row instead.
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "common/attention_checks.hpp"
#include "common/decode_checks.hpp"
#include "cuda/attention_mma.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/attention.hpp"
#include "moe/ops/decode.hpp"

namespace moe::cuda_detail::attention_impl {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;  // warps (rows) per block in the training kernels
constexpr int kDecodeWarps = 4;   // warps per (b, h) in decode
constexpr int kMaxHeadDim = 256;

template <class A>
__device__ __forceinline__ void warp_sum2(A& a, A& b) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
}
template <class A>
__device__ __forceinline__ void warp_sum3(A& a, A& b, A& c) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
}

// Loads a row's lane-owned elements (0 past hd).
template <int NPER, class T>
__device__ __forceinline__ void load_row(acc_t<T> (&dst)[NPER], const T* row, int hd, int lane) {
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    dst[r] = c < hd ? load(row[c]) : acc_t<T>(0);
  }
}

struct Dims {
  int64_t batch, seq;
  int heads, kv_heads, hd;
  __host__ __device__ int group() const { return heads / kv_heads; }
};

// The CPU op's checks (kernels/common/attention_checks.hpp), plus the kernels' head_dim limit.
Dims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  const std::string name(op);
  check_attention_qkv_shapes(q, k, v, op);
  const Dims s{q.size(0), q.size(1), static_cast<int>(q.size(2)), static_cast<int>(k.size(2)),
               static_cast<int>(q.size(3))};
  MOE_CHECK(s.hd >= 1 && s.hd <= kMaxHeadDim, name + ": head_dim " + std::to_string(s.hd) +
                                                  " is outside the CUDA kernels' [1, " +
                                                  std::to_string(kMaxHeadDim) + "]");
  check_attention_qkv_dtypes(q, k, v, op);
  return s;
}

// Calls fn(std::integral_constant<int, NPER>) with NPER = lanes' share of a row of hd elements.
template <class Fn>
void dispatch_nper(int hd, Fn&& fn) {
  if (hd <= 32) return fn(std::integral_constant<int, 1>{});
  if (hd <= 64) return fn(std::integral_constant<int, 2>{});
  if (hd <= 128) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

// One key of an online softmax over a warp-held query row: folds the score scale * <q, k_j> and
// the value row v_j into the running max m, normaliser l and accumulator acc (each lane keeps its
// NPER columns). Shared by the training forward and the decode kernel.
template <class T, class A, int NPER>
__device__ __forceinline__ void online_softmax_key(const A (&qr)[NPER], const T* kj, const T* vj,
                                                   int hd, int lane, A scale, A& m, A& l,
                                                   A (&acc)[NPER]) {
  A part = 0;
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c < hd) part += qr[r] * load(kj[c]);
  }
  const A sc = scale * warp_sum(part);
  const A m_new = sc > m ? sc : m;
  const A corr = dev_exp(m - m_new);  // 0 on the first key (m = -inf)
  const A p = dev_exp(sc - m_new);
  l = l * corr + p;
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c < hd) acc[r] = acc[r] * corr + p * load(vj[c]);
  }
  m = m_new;
}

// The query row of warp `row` (< batch * heads * seq) in the forward and dq kernels, and where
// its data lives: position i of head h in sequence b, rows issued longest first (i descending
// within a head) so the causal imbalance does not leave a long tail.
template <class T>
struct QueryRow {
  int64_t i, bh;      // position; b * heads + h (lse's row)
  int64_t q_off;      // (b, i, h, 0) in q, out, dout, dq
  int64_t kv_stride;  // between positions of k and v
  const T* kb;        // (b, 0, g, 0) in k: g the kv head of h
  const T* vb;        // the same in v
};
template <class T>
__device__ __forceinline__ QueryRow<T> query_row(int64_t row, const Dims& s, const T* k,
                                                 const T* v) {
  const int64_t i = s.seq - 1 - row % s.seq;
  const int64_t bh = row / s.seq;
  const int h = static_cast<int>(bh % s.heads);
  const int64_t b = bh / s.heads;
  const int g = h / s.group();
  const int64_t kv_stride = static_cast<int64_t>(s.kv_heads) * s.hd;
  const int64_t q_off = ((b * s.seq + i) * s.heads + h) * s.hd;
  const T* kb = k + (b * s.seq * s.kv_heads + g) * s.hd;
  const T* vb = v + (b * s.seq * s.kv_heads + g) * s.hd;
  return {i, bh, q_off, kv_stride, kb, vb};
}

// ---- forward ------------------------------------------------------------------------------------

template <class T, int NPER>
__global__ void __launch_bounds__(kRowsPerBlock* kWarp)
    attention_forward_kernel(T* __restrict__ out, acc_t<T>* __restrict__ lse,
                             const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, Dims s, acc_t<T> scale) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= s.batch * s.heads * s.seq) return;
  const auto [i, bh, q_off, kv_stride, kb, vb] = query_row(row, s, k, v);

  A qr[NPER], acc[NPER];
  load_row<NPER>(qr, q + q_off, s.hd, lane);
#pragma unroll
  for (int r = 0; r < NPER; ++r) acc[r] = 0;
  A m = neg_inf<A>(), l = 0;
  for (int64_t j = 0; j <= i; ++j) {
    online_softmax_key<T, A, NPER>(qr, kb + j * kv_stride, vb + j * kv_stride, s.hd, lane, scale, m,
                                   l, acc);
  }
  const A inv_l = A(1) / l;
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c < s.hd) out[q_off + c] = store<T>(acc[r] * inv_l);
  }
  if (lane == 0) lse[bh * s.seq + i] = m + dev_log(l);
}

// ---- backward: dq -------------------------------------------------------------------------------

template <class T, int NPER>
__global__ void __launch_bounds__(kRowsPerBlock* kWarp)
    attention_backward_dq_kernel(T* __restrict__ dq, const T* __restrict__ dout,
                                 const T* __restrict__ q, const T* __restrict__ k,
                                 const T* __restrict__ v, const T* __restrict__ out,
                                 const acc_t<T>* __restrict__ lse, Dims s, acc_t<T> scale) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= s.batch * s.heads * s.seq) return;
  const auto [i, bh, q_off, kv_stride, kb, vb] = query_row(row, s, k, v);

  A qr[NPER], dor[NPER], dqr[NPER];
  load_row<NPER>(qr, q + q_off, s.hd, lane);
  load_row<NPER>(dor, dout + q_off, s.hd, lane);
  A d_part = 0;
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c < s.hd) d_part += dor[r] * load(out[q_off + c]);
    dqr[r] = 0;
  }
  const A d_i = warp_sum(d_part);  // D_i = <dO_i, O_i>
  const A lse_i = lse[bh * s.seq + i];
  for (int64_t j = 0; j <= i; ++j) {
    const T* kj = kb + j * kv_stride;
    const T* vj = vb + j * kv_stride;
    A kjr[NPER], vjr[NPER];
    load_row<NPER>(kjr, kj, s.hd, lane);
    load_row<NPER>(vjr, vj, s.hd, lane);
    A s_part = 0, dp_part = 0;
#pragma unroll
    for (int r = 0; r < NPER; ++r) {
      s_part += qr[r] * kjr[r];
      dp_part += dor[r] * vjr[r];
    }
    warp_sum2(s_part, dp_part);
    const A p = dev_exp(scale * s_part - lse_i);
    const A ds = p * (dp_part - d_i);
#pragma unroll
    for (int r = 0; r < NPER; ++r) dqr[r] += ds * kjr[r];
  }
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c < s.hd) dq[q_off + c] = store<T>(scale * dqr[r]);
  }
}

// ---- backward: dk, dv ---------------------------------------------------------------------------

template <class T, int NPER>
__global__ void __launch_bounds__(kRowsPerBlock* kWarp)
    attention_backward_dkdv_kernel(T* __restrict__ dk, T* __restrict__ dv,
                                   const T* __restrict__ dout, const T* __restrict__ q,
                                   const T* __restrict__ k, const T* __restrict__ v,
                                   const T* __restrict__ out, const acc_t<T>* __restrict__ lse,
                                   Dims s, acc_t<T> scale) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= s.batch * s.kv_heads * s.seq) return;
  const int64_t j = row % s.seq;  // small j (the longest rows) first
  const int64_t bg = row / s.seq;
  const int g = static_cast<int>(bg % s.kv_heads);
  const int64_t b = bg / s.kv_heads;
  const int64_t kv_off = ((b * s.seq + j) * s.kv_heads + g) * s.hd;
  const int64_t q_stride = static_cast<int64_t>(s.heads) * s.hd;  // between positions

  A kr[NPER], vr[NPER], dkr[NPER], dvr[NPER];
  load_row<NPER>(kr, k + kv_off, s.hd, lane);
  load_row<NPER>(vr, v + kv_off, s.hd, lane);
#pragma unroll
  for (int r = 0; r < NPER; ++r) dkr[r] = dvr[r] = 0;
  const int group = s.group();
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const int64_t head_off = (b * s.seq * s.heads + h) * s.hd;  // (b, t = 0, h)
    const A* lse_h = lse + (b * s.heads + h) * s.seq;
    for (int64_t i = j; i < s.seq; ++i) {
      const int64_t off = head_off + i * q_stride;
      A qi[NPER], doi[NPER];
      A s_part = 0, dp_part = 0, d_part = 0;
#pragma unroll
      for (int r = 0; r < NPER; ++r) {
        const int c = lane + kWarp * r;
        if (c < s.hd) {
          qi[r] = load(q[off + c]);
          doi[r] = load(dout[off + c]);
          s_part += qi[r] * kr[r];
          dp_part += doi[r] * vr[r];
          d_part += doi[r] * load(out[off + c]);
        } else {
          qi[r] = doi[r] = 0;
        }
      }
      warp_sum3(s_part, dp_part, d_part);
      const A p = dev_exp(scale * s_part - lse_h[i]);
      const A ds = p * (dp_part - d_part);
#pragma unroll
      for (int r = 0; r < NPER; ++r) {
        dkr[r] += ds * qi[r];
        dvr[r] += p * doi[r];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c < s.hd) {
      dk[kv_off + c] = store<T>(scale * dkr[r]);
      dv[kv_off + c] = store<T>(dvr[r]);
    }
  }
}

// ---- decode -------------------------------------------------------------------------------------

struct DecodeDims {
  int64_t batch, max_len;
  int heads, kv_heads, hd;
};

template <class T, int NPER>
__global__ void __launch_bounds__(kDecodeWarps* kWarp)
    attention_decode_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc,
                            const T* __restrict__ vc, const int32_t* __restrict__ lengths,
                            DecodeDims s, acc_t<T> scale) {
  using A = acc_t<T>;
  __shared__ A sh_m[kDecodeWarps], sh_l[kDecodeWarps];
  __shared__ A sh_acc[kDecodeWarps][NPER * kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t bh = blockIdx.x;  // (b, h)
  const int h = static_cast<int>(bh % s.heads);
  const int64_t b = bh / s.heads;
  const int g = h / (s.heads / s.kv_heads);
  const int64_t q_off = bh * s.hd;
  const int64_t len = lengths[b];
  if (len < 1 || len > s.max_len) {  // caller bug: make it visible, read nothing out of range
    for (int c = threadIdx.x; c < s.hd; c += blockDim.x)
      out[q_off + c] = store<T>(std::numeric_limits<A>::quiet_NaN());
    return;
  }
  const int64_t kv_stride = static_cast<int64_t>(s.kv_heads) * s.hd;
  const T* kb = kc + (b * s.max_len * s.kv_heads + g) * s.hd;
  const T* vb = vc + (b * s.max_len * s.kv_heads + g) * s.hd;

  A qr[NPER], acc[NPER];
  load_row<NPER>(qr, q + q_off, s.hd, lane);
#pragma unroll
  for (int r = 0; r < NPER; ++r) acc[r] = 0;
  A m = neg_inf<A>(), l = 0;
  for (int64_t j = warp; j < len; j += kDecodeWarps) {
    online_softmax_key<T, A, NPER>(qr, kb + j * kv_stride, vb + j * kv_stride, s.hd, lane, scale, m,
                                   l, acc);
  }
  if (lane == 0) {
    sh_m[warp] = m;
    sh_l[warp] = l;
  }
#pragma unroll
  for (int r = 0; r < NPER; ++r) sh_acc[warp][lane + kWarp * r] = acc[r];
  __syncthreads();
  if (warp != 0) return;
  // Merge the warps' states in warp order; a warp that saw no key (m = -inf) weighs 0. Warp 0
  // always saw key 0, so the merged max is finite.
  A mx = sh_m[0];
  for (int w = 1; w < kDecodeWarps; ++w) mx = sh_m[w] > mx ? sh_m[w] : mx;
  A wgt[kDecodeWarps], total = 0;
  for (int w = 0; w < kDecodeWarps; ++w) {
    wgt[w] = sh_m[w] == neg_inf<A>() ? A(0) : dev_exp(sh_m[w] - mx);
    total += sh_l[w] * wgt[w];
  }
  const A inv_total = A(1) / total;
#pragma unroll
  for (int r = 0; r < NPER; ++r) {
    const int c = lane + kWarp * r;
    if (c >= s.hd) continue;
    A o = 0;
    for (int w = 0; w < kDecodeWarps; ++w) o += sh_acc[w][c] * wgt[w];
    out[q_off + c] = store<T>(o * inv_total);
  }
}

// ---- host side ----------------------------------------------------------------------------------

void attention_forward_cuda(Ctx& ctx, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) {
  const Dims s = attention_dims(q, k, v, "attention_forward");
  check_attention_forward_outputs(out, lse, q);
  check_on_gpu({&out, &lse, &q, &k, &v}, "attention_forward");
  const int64_t rows = s.batch * s.heads * s.seq;
  if (rows == 0) return;
  if (attention_mma_available(q.dtype, s.hd)) {  // tensor cores: f16 / bf16, head_dim 64
    attention_mma_forward(ctx, q.dtype, out.data, data_of<float>(lse), q.data, k.data, v.data,
                          {s.batch, s.seq, s.heads, s.kv_heads});
    return;
  }
  dispatch_storage(q.dtype, "attention_forward", [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(s.hd)));
    dispatch_nper(s.hd, [&](auto nper) {
      attention_forward_kernel<T, decltype(nper)::value>
          <<<blocks_for(rows, kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream_of(ctx)>>>(
              data_of<T>(out), data_of<A>(lse), data_of<T>(q), data_of<T>(k), data_of<T>(v), s,
              scale);
      MOE_CUDA_LAUNCH_CHECK();
    });
  });
}

void attention_backward_cuda(Ctx& ctx, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                             Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dq_acc) {
  const Dims s = attention_dims(q, k, v, "attention_backward");
  check_attention_backward_args(dq, dk, dv, dout, q, k, out, lse, dq_acc);
  check_on_gpu({&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse}, "attention_backward");
  const int64_t q_rows = s.batch * s.heads * s.seq, kv_rows = s.batch * s.kv_heads * s.seq;
  if (q_rows == 0) return;
  if (attention_mma_available(q.dtype, s.hd)) {  // tensor cores: f16 / bf16, head_dim 64
    attention_mma_backward(ctx, q.dtype, dq.data, dk.data, dv.data, dout.data, q.data, k.data,
                           v.data, out.data, data_of<float>(lse),
                           dq_acc.empty() ? nullptr : data_of<float>(dq_acc),
                           {s.batch, s.seq, s.heads, s.kv_heads});
    return;
  }
  dispatch_storage(q.dtype, "attention_backward", [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(s.hd)));
    dispatch_nper(s.hd, [&](auto nper) {
      constexpr int N = decltype(nper)::value;
      attention_backward_dq_kernel<T, N>
          <<<blocks_for(q_rows, kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream_of(ctx)>>>(
              data_of<T>(dq), data_of<T>(dout), data_of<T>(q), data_of<T>(k), data_of<T>(v),
              data_of<T>(out), data_of<A>(lse), s, scale);
      MOE_CUDA_LAUNCH_CHECK();
      attention_backward_dkdv_kernel<T, N>
          <<<blocks_for(kv_rows, kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream_of(ctx)>>>(
              data_of<T>(dk), data_of<T>(dv), data_of<T>(dout), data_of<T>(q), data_of<T>(k),
              data_of<T>(v), data_of<T>(out), data_of<A>(lse), s, scale);
      MOE_CUDA_LAUNCH_CHECK();
    });
  });
}

void attention_decode_forward_cuda(Ctx& ctx, Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                                   Tensor lengths) {
  const std::string op = "attention_decode_forward";
  check_decode_shapes(out, q, k_cache, v_cache);
  const DecodeDims s{q.size(0), k_cache.size(1), static_cast<int>(q.size(1)),
                     static_cast<int>(k_cache.size(2)), static_cast<int>(q.size(2))};
  MOE_CHECK(s.hd >= 1 && s.hd <= kMaxHeadDim, op + ": head_dim " + std::to_string(s.hd) +
                                                  " is outside the CUDA kernel's [1, " +
                                                  std::to_string(kMaxHeadDim) + "]");
  check_decode_dtypes(out, q, k_cache, v_cache, lengths);
  check_on_gpu({&out, &q, &k_cache, &v_cache, &lengths}, op.c_str());
  const int64_t rows = s.batch * s.heads;
  if (rows == 0) return;
  dispatch_storage(q.dtype, op.c_str(), [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(s.hd)));
    dispatch_nper(s.hd, [&](auto nper) {
      attention_decode_kernel<T, decltype(nper)::value>
          <<<static_cast<unsigned>(rows), kDecodeWarps * kWarp, 0, stream_of(ctx)>>>(
              data_of<T>(out), data_of<T>(q), data_of<T>(k_cache), data_of<T>(v_cache),
              static_cast<const int32_t*>(lengths.data), s, scale);
      MOE_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace
}  // namespace moe::cuda_detail::attention_impl

MOE_REGISTER_CUDA_OP(attention_forward,
                     &::moe::cuda_detail::attention_impl::attention_forward_cuda);
MOE_REGISTER_CUDA_OP(attention_backward,
                     &::moe::cuda_detail::attention_impl::attention_backward_cuda);
// attention_backward_wants_dq_acc (ops/attention.hpp): the tensor-core path, on sm_90 as one kernel
static const bool moe_cuda_registered_attention_sums_dq = (
    ::moe::cuda::attention_backward_sums_dq =
        [](::moe::DType dt, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
           int64_t hd) {
          return ::moe::cuda_detail::attention_mma_available(dt, hd) &&
                 ::moe::cuda_detail::attention_sm90_backward_sums_dq(dt,
                                                                     {batch, seq, heads, kv_heads});
        },
    true);
MOE_REGISTER_CUDA_OP(attention_decode_forward,
                     &::moe::cuda_detail::attention_impl::attention_decode_forward_cuda);
