// Flash-style causal GQA attention with WMMA (16x16x16, f16 / bf16 in, fp32 accumulate), head_dim
// 64: the sm_70 / sm_75 path (the T4) and the fallback for unaligned tensors; on sm_80+ the
// mma.sync kernels of attention_sm80.cu / attention_sm80_backward.cu run first, and on sm_90 the
// wgmma kernels of attention_sm90.cu before those. No T x T matrix
// exists anywhere: scores live one 16 x 32 tile per warp in shared memory.
//
// Forward: a block (4 warps) owns 64 query rows of one (b, h), 16 per warp, its Q rows held as
// fragments. It walks the key tiles of 32 up to its last row (causal): K and V tiles staged in
// shared memory, S = Q K^T per warp, an online softmax per row in fp32 (two lanes per row), P
// rounded to the storage type, O = alpha O + P V with O kept in fp32 in shared memory (the
// rescale needs per-row access that WMMA fragments do not give). Writes O / l and lse = m + log l.
// Query tiles are issued longest first.
// Backward (FlashAttention-2 split, deterministic: every output has exactly one writer):
// - dq kernel, per 64 query rows: D_i = <dO_i, O_i>, then for each key tile S = Q K^T,
//   dP = dO V^T, P = exp(scale S - lse), dS = P (dP - D) (rounded to the storage type),
//   dq += dS K; dq = scale * dq.
// - dk/dv kernel, per 64 key rows of one kv head: for each query head of its group and each query
//   tile of 32 that can see the keys, S^T = K Q^T, dP^T = V dO^T, P^T, dS^T as above,
//   dv += P^T dO, dk += dS^T Q; dk = scale * dk.
// P and dS are rounded to 16 bits before their products, as FlashAttention does; the tests' 16-bit
// bounds cover it. Rows past T are zero-filled on load, masked, and never stored.
#include <mma.h>

#include <cmath>
#include <mutex>
#include <string>

#include "cuda/attention_mma.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/vec16.cuh"

namespace moe::cuda_detail {
namespace {

using namespace nvcuda;

constexpr int kD = 64;            // head_dim
constexpr int kLd = kD + 8;       // staged row stride (elements): 16-byte rows, spread banks
constexpr int kBM = 64;           // query (forward, dq) or key (dk/dv) rows per block
constexpr int kBN = 32;           // key (forward, dq) or query (dk/dv) rows per inner tile
constexpr int kWarps = kBM / 16;  // 4 warps, 16 rows each
constexpr int kThreads = kWarps * 32;
constexpr int kSld = kBN + 4;      // fp32 score tile stride
constexpr int kPld = kBN + 8;      // 16-bit probability tile stride
constexpr int kOld = kD + 4;       // fp32 output accumulator stride
constexpr int kDFrags = kD / 16;   // fragments along head_dim
constexpr int kNFrags = kBN / 16;  // fragments along the inner tile

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <class T>
using FragARow = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// Copies rows [row0, row0 + kRows) of a [T, *, 64] tensor (row i at src + i * stride) into
// dst[r * kLd + d], zeros for rows >= seq. `vec`: src and stride allow 16-byte loads.
template <class T, int kRows>
__device__ __forceinline__ void stage_rows(T* dst, const T* src, int64_t stride, int64_t row0,
                                           int64_t seq, bool vec) {
  constexpr int kChunks = kRows * (kD / 8);
  for (int c = threadIdx.x; c < kChunks; c += kThreads) {
    const int r = c / (kD / 8), d = (c % (kD / 8)) * 8;
    const int64_t i = row0 + r;
    T* out = dst + r * kLd + d;
    if (i < seq && vec) {
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(src + i * stride + d);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = i < seq ? src[i * stride + d + j] : store<T>(0.0f);
    }
  }
}

// <a_i, b_i> over head_dim for row i, split over the two lanes of a pair (lane ^ 1).
template <class T>
__device__ __forceinline__ float pair_dot(const T* a, const T* b, int half) {
  float s = 0;
  for (int c = half * (kD / 2); c < (half + 1) * (kD / 2); ++c) s += load(a[c]) * load(b[c]);
  return s + __shfl_xor_sync(0xffffffffu, s, 1);
}

// Stages the block's kBM rows of a [T, *, 64] tensor and loads this warp's 16 of them as A
// fragments: the operand a block keeps for its whole walk (Q and dO rows, or K and V rows). `buf`
// is free again on return.
template <class T>
__device__ __forceinline__ void load_block_rows(FragARow<T> (&frags)[kDFrags], T* buf, const T* src,
                                                int64_t stride, int64_t row0, int64_t seq,
                                                bool vec) {
  const int warp = threadIdx.x / 32;
  stage_rows<T, kBM>(buf, src, stride, row0, seq, vec);
  __syncthreads();
#pragma unroll
  for (int d = 0; d < kDFrags; ++d)
    wmma::load_matrix_sync(frags[d], buf + warp * 16 * kLd + d * 16, kLd);
  __syncthreads();
}

// Stores a warp's 16 x 64 accumulator (kDFrags fragments) through a 16 x 16 fp32 staging tile:
// out(row, col, value) for row < 16, col < 64.
template <class Out>
__device__ __forceinline__ void store_rows(Acc (&acc)[kDFrags], float* staging, Out&& out) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kDFrags; ++n) {
    wmma::store_matrix_sync(staging, acc[n], kSld, wmma::mem_row_major);
    __syncwarp();
    for (int idx = lane; idx < 256; idx += 32)
      out(idx / 16, n * 16 + idx % 16, staging[(idx / 16) * kSld + idx % 16]);
    __syncwarp();
  }
}

// ---- forward ------------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, int64_t seq,
                         int heads, int kv_heads, float scale, bool vec) {
  if constexpr (HasMma<T>::value) {
    __shared__ alignas(128) T kv[2 * kBN * kLd];  // K, V tiles (first: the block's Q rows)
    __shared__ alignas(128) float s_buf[kWarps][16 * kSld];
    __shared__ alignas(128) T p_buf[kWarps][16 * kPld];
    __shared__ alignas(128) float o_buf[kWarps][16 * kOld];
    static_assert(2 * kBN == kBM, "the K/V buffer stages the Q rows first");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t tiles = (seq + kBM - 1) / kBM;
    const int64_t q0 = (tiles - 1 - blockIdx.x) * kBM;  // longest first
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
    const int64_t q_stride = int64_t(heads) * kD, kv_stride = int64_t(kv_heads) * kD;
    const T* qb = q + (int64_t(b) * seq * heads + h) * kD;
    const T* kb = k + (int64_t(b) * seq * kv_heads + g) * kD;
    const T* vb = v + (int64_t(b) * seq * kv_heads + g) * kD;

    FragARow<T> qf[kDFrags];
    load_block_rows(qf, kv, qb, q_stride, q0, seq, vec);

    float* S = s_buf[warp];
    T* P = p_buf[warp];
    float* O = o_buf[warp];
    for (int idx = lane; idx < 16 * kOld; idx += 32) O[idx] = 0;
    const int r = lane >> 1, half = lane & 1;  // two lanes per row
    const int64_t i = q0 + warp * 16 + r;
    const int64_t warp_last = q0 + warp * 16 + 15;
    float m = -INFINITY, l = 0;
    const int64_t kv_end = seq < q0 + kBM ? seq : q0 + kBM;
    for (int64_t j0 = 0; j0 < kv_end; j0 += kBN) {
      stage_rows<T, kBN>(kv, kb, kv_stride, j0, seq, vec);
      stage_rows<T, kBN>(kv + kBN * kLd, vb, kv_stride, j0, seq, vec);
      __syncthreads();
      if (j0 <= warp_last) {  // uniform over the warp: some key of the tile is visible
#pragma unroll
        for (int n = 0; n < kNFrags; ++n) {
          Acc s;
          wmma::fill_fragment(s, 0.0f);
#pragma unroll
          for (int d = 0; d < kDFrags; ++d) {
            FragBCol<T> kf;  // B(k = d, n = key) = K[key][d]
            wmma::load_matrix_sync(kf, kv + n * 16 * kLd + d * 16, kLd);
            wmma::mma_sync(s, qf[d], kf, s);
          }
          wmma::store_matrix_sync(S + n * 16, s, kSld, wmma::mem_row_major);
        }
        __syncwarp();
        // online softmax over this row's 16 columns of the tile (the pair covers 32)
        float x[kBN / 2];
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < kBN / 2; ++c) {
          const int64_t j = j0 + half * (kBN / 2) + c;
          x[c] = (j <= i && j < seq) ? S[r * kSld + half * (kBN / 2) + c] * scale : -INFINITY;
          mx = fmaxf(mx, x[c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
        float sum = 0;
#pragma unroll
        for (int c = 0; c < kBN / 2; ++c) {
          const float p = x[c] == -INFINITY ? 0.0f : expf(x[c] - m_new);
          sum += p;
          P[r * kPld + half * (kBN / 2) + c] = store<T>(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        for (int c = half * (kD / 2); c < (half + 1) * (kD / 2); ++c) O[r * kOld + c] *= alpha;
        __syncwarp();
        // O += P V
#pragma unroll
        for (int n = 0; n < kDFrags; ++n) {
          Acc o;
          wmma::load_matrix_sync(o, O + n * 16, kOld, wmma::mem_row_major);
#pragma unroll
          for (int kk = 0; kk < kNFrags; ++kk) {
            FragARow<T> pf;
            wmma::load_matrix_sync(pf, P + kk * 16, kPld);
            FragBRow<T> vf;  // B(k = key, n = d) = V[key][d]
            wmma::load_matrix_sync(vf, kv + kBN * kLd + kk * 16 * kLd + n * 16, kLd);
            wmma::mma_sync(o, pf, vf, o);
          }
          wmma::store_matrix_sync(O + n * 16, o, kOld, wmma::mem_row_major);
        }
        __syncwarp();
      }
      __syncthreads();
    }
    if (i < seq) {
      const float inv = 1.0f / l;
      T* orow = out + ((int64_t(b) * seq + i) * heads + h) * kD;
      for (int c = half * (kD / 2); c < (half + 1) * (kD / 2); ++c)
        orow[c] = store<T>(O[r * kOld + c] * inv);
      if (half == 0) lse[(int64_t(b) * heads + h) * seq + i] = m + logf(l);
    }
  }
}

// ---- backward: dq -------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
    flash_dq_kernel(T* dq, const T* dout, const T* q, const T* k, const T* v, const T* out,
                    const float* lse, int64_t seq, int heads, int kv_heads, float scale, bool vec) {
  if constexpr (HasMma<T>::value) {
    __shared__ alignas(128) T kv[2 * kBN * kLd];  // K, V tiles (first: Q, then dO rows)
    __shared__ alignas(128) float s_buf[kWarps][16 * kSld];
    __shared__ alignas(128) float dp_buf[kWarps][16 * kSld];
    __shared__ alignas(128) T ds_buf[kWarps][16 * kPld];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t tiles = (seq + kBM - 1) / kBM;
    const int64_t q0 = (tiles - 1 - blockIdx.x) * kBM;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
    const int64_t q_stride = int64_t(heads) * kD, kv_stride = int64_t(kv_heads) * kD;
    const int64_t q_off = (int64_t(b) * seq * heads + h) * kD;
    const T* kb = k + (int64_t(b) * seq * kv_heads + g) * kD;
    const T* vb = v + (int64_t(b) * seq * kv_heads + g) * kD;

    FragARow<T> qf[kDFrags], dof[kDFrags];
    load_block_rows(qf, kv, q + q_off, q_stride, q0, seq, vec);
    load_block_rows(dof, kv, dout + q_off, q_stride, q0, seq, vec);

    const int r = lane >> 1, half = lane & 1;
    const int64_t i = q0 + warp * 16 + r;
    const int64_t warp_last = q0 + warp * 16 + 15;
    // Rows past seq read the last row (every lane must reach the shuffle); they are masked below.
    const int64_t ic = i < seq ? i : seq - 1;
    const float row_lse = lse[(int64_t(b) * heads + h) * seq + ic];
    const float row_d = pair_dot(dout + q_off + ic * q_stride, out + q_off + ic * q_stride, half);
    float* S = s_buf[warp];
    float* DP = dp_buf[warp];
    T* DS = ds_buf[warp];
    Acc acc[kDFrags];
#pragma unroll
    for (int n = 0; n < kDFrags; ++n) wmma::fill_fragment(acc[n], 0.0f);
    const int64_t kv_end = seq < q0 + kBM ? seq : q0 + kBM;
    for (int64_t j0 = 0; j0 < kv_end; j0 += kBN) {
      stage_rows<T, kBN>(kv, kb, kv_stride, j0, seq, vec);
      stage_rows<T, kBN>(kv + kBN * kLd, vb, kv_stride, j0, seq, vec);
      __syncthreads();
      if (j0 <= warp_last) {
#pragma unroll
        for (int n = 0; n < kNFrags; ++n) {
          Acc s, dp;
          wmma::fill_fragment(s, 0.0f);
          wmma::fill_fragment(dp, 0.0f);
#pragma unroll
          for (int d = 0; d < kDFrags; ++d) {
            FragBCol<T> kf, vf;  // B(k = d, n = key) = K[key][d], V[key][d]
            wmma::load_matrix_sync(kf, kv + n * 16 * kLd + d * 16, kLd);
            wmma::mma_sync(s, qf[d], kf, s);
            wmma::load_matrix_sync(vf, kv + kBN * kLd + n * 16 * kLd + d * 16, kLd);
            wmma::mma_sync(dp, dof[d], vf, dp);
          }
          wmma::store_matrix_sync(S + n * 16, s, kSld, wmma::mem_row_major);
          wmma::store_matrix_sync(DP + n * 16, dp, kSld, wmma::mem_row_major);
        }
        __syncwarp();
#pragma unroll
        for (int c = 0; c < kBN / 2; ++c) {
          const int col = half * (kBN / 2) + c;
          const int64_t j = j0 + col;
          const float p =
              (j <= i && j < seq && i < seq) ? expf(S[r * kSld + col] * scale - row_lse) : 0.0f;
          DS[r * kPld + col] = store<T>(p * (DP[r * kSld + col] - row_d));
        }
        __syncwarp();
        // dq += dS K
#pragma unroll
        for (int n = 0; n < kDFrags; ++n)
#pragma unroll
          for (int kk = 0; kk < kNFrags; ++kk) {
            FragARow<T> a;
            wmma::load_matrix_sync(a, DS + kk * 16, kPld);
            FragBRow<T> kf;  // B(k = key, n = d) = K[key][d]
            wmma::load_matrix_sync(kf, kv + kk * 16 * kLd + n * 16, kLd);
            wmma::mma_sync(acc[n], a, kf, acc[n]);
          }
      }
      __syncthreads();
    }
    store_rows(acc, S, [&](int row, int col, float val) {
      const int64_t qi = q0 + warp * 16 + row;
      if (qi < seq) dq[q_off + qi * q_stride + col] = store<T>(val * scale);
    });
  }
}

// ---- backward: dk, dv ---------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_kernel(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                      const float* lse, int64_t seq, int heads, int kv_heads, float scale,
                      bool vec) {
  if constexpr (HasMma<T>::value) {
    __shared__ alignas(128) T qd[2 * kBN * kLd];  // Q, dO tiles (first: K, then V rows)
    __shared__ alignas(128) float s_buf[kWarps][16 * kSld];
    __shared__ alignas(128) float dp_buf[kWarps][16 * kSld];
    __shared__ alignas(128) T pt_buf[kWarps][16 * kPld];
    __shared__ alignas(128) T dst_buf[kWarps][16 * kPld];
    __shared__ float tile_lse[kBN], tile_d[kBN];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t k0 = int64_t(blockIdx.x) * kBM;  // most work first: key tile 0 sees every query
    const int g = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
    const int64_t q_stride = int64_t(heads) * kD, kv_stride = int64_t(kv_heads) * kD;
    const int64_t kv_off = (int64_t(b) * seq * kv_heads + g) * kD;

    FragARow<T> kf[kDFrags], vf[kDFrags];
    load_block_rows(kf, qd, k + kv_off, kv_stride, k0, seq, vec);
    load_block_rows(vf, qd, v + kv_off, kv_stride, k0, seq, vec);

    const int r = lane >> 1, half = lane & 1;
    const int64_t w0 = k0 + warp * 16;  // the warp's first key
    const int64_t j = w0 + r;
    float* S = s_buf[warp];
    float* DP = dp_buf[warp];
    T* PT = pt_buf[warp];
    T* DST = dst_buf[warp];
    Acc dk_acc[kDFrags], dv_acc[kDFrags];
#pragma unroll
    for (int n = 0; n < kDFrags; ++n) {
      wmma::fill_fragment(dk_acc[n], 0.0f);
      wmma::fill_fragment(dv_acc[n], 0.0f);
    }
    for (int hh = 0; hh < group; ++hh) {
      const int h = g * group + hh;
      const int64_t q_off = (int64_t(b) * seq * heads + h) * kD;
      for (int64_t i0 = k0 / kBN * kBN; i0 < seq; i0 += kBN) {
        stage_rows<T, kBN>(qd, q + q_off, q_stride, i0, seq, vec);
        stage_rows<T, kBN>(qd + kBN * kLd, dout + q_off, q_stride, i0, seq, vec);
        {  // lse and D = <dO_i, O_i> of the tile's queries: 4 threads per query
          const int qq = threadIdx.x / 4, part = threadIdx.x % 4;
          const int64_t i = i0 + qq;
          float dsum = 0;
          if (i < seq) {
            const T* a = dout + q_off + i * q_stride + part * (kD / 4);
            const T* o = out + q_off + i * q_stride + part * (kD / 4);
            for (int c = 0; c < kD / 4; ++c) dsum += load(a[c]) * load(o[c]);
          }
          dsum += __shfl_xor_sync(0xffffffffu, dsum, 1);
          dsum += __shfl_xor_sync(0xffffffffu, dsum, 2);
          if (part == 0) {
            tile_d[qq] = dsum;
            tile_lse[qq] = i < seq ? lse[(int64_t(b) * heads + h) * seq + i] : 0.0f;
          }
        }
        __syncthreads();
        if (i0 + kBN - 1 >= w0 && w0 < seq) {  // some query of the tile sees some key of the warp
#pragma unroll
          for (int n = 0; n < kNFrags; ++n) {
            Acc s, dp;
            wmma::fill_fragment(s, 0.0f);
            wmma::fill_fragment(dp, 0.0f);
#pragma unroll
            for (int d = 0; d < kDFrags; ++d) {
              FragBCol<T> qf, df;  // B(k = d, n = query) = Q[query][d], dO[query][d]
              wmma::load_matrix_sync(qf, qd + n * 16 * kLd + d * 16, kLd);
              wmma::mma_sync(s, kf[d], qf, s);
              wmma::load_matrix_sync(df, qd + kBN * kLd + n * 16 * kLd + d * 16, kLd);
              wmma::mma_sync(dp, vf[d], df, dp);
            }
            wmma::store_matrix_sync(S + n * 16, s, kSld, wmma::mem_row_major);
            wmma::store_matrix_sync(DP + n * 16, dp, kSld, wmma::mem_row_major);
          }
          __syncwarp();
#pragma unroll
          for (int c = 0; c < kBN / 2; ++c) {
            const int col = half * (kBN / 2) + c;
            const int64_t i = i0 + col;
            const float p = (j <= i && i < seq && j < seq)
                                ? expf(S[r * kSld + col] * scale - tile_lse[col])
                                : 0.0f;
            PT[r * kPld + col] = store<T>(p);
            DST[r * kPld + col] = store<T>(p * (DP[r * kSld + col] - tile_d[col]));
          }
          __syncwarp();
          // dv += P^T dO, dk += dS^T Q
#pragma unroll
          for (int n = 0; n < kDFrags; ++n)
#pragma unroll
            for (int kk = 0; kk < kNFrags; ++kk) {
              FragARow<T> a;
              FragBRow<T> bf;  // B(k = query, n = d)
              wmma::load_matrix_sync(a, PT + kk * 16, kPld);
              wmma::load_matrix_sync(bf, qd + kBN * kLd + kk * 16 * kLd + n * 16, kLd);
              wmma::mma_sync(dv_acc[n], a, bf, dv_acc[n]);
              wmma::load_matrix_sync(a, DST + kk * 16, kPld);
              wmma::load_matrix_sync(bf, qd + kk * 16 * kLd + n * 16, kLd);
              wmma::mma_sync(dk_acc[n], a, bf, dk_acc[n]);
            }
        }
        __syncthreads();
      }
    }
    store_rows(dk_acc, S, [&](int row, int col, float val) {
      const int64_t kj = w0 + row;
      if (kj < seq) dk[kv_off + kj * kv_stride + col] = store<T>(val * scale);
    });
    store_rows(dv_acc, S, [&](int row, int col, float val) {
      const int64_t kj = w0 + row;
      if (kj < seq) dv[kv_off + kj * kv_stride + col] = store<T>(val);
    });
  }
}

template <class T>
bool compiled_for() {
  return compiled_arch(flash_forward_kernel<T>) >= kMmaArch<T> &&
         compiled_arch(flash_dq_kernel<T>) >= kMmaArch<T> &&
         compiled_arch(flash_dkdv_kernel<T>) >= kMmaArch<T>;
}

template <class T>
void forward(Ctx& ctx, void* out, float* lse, const void* q, const void* k, const void* v,
             const AttentionShape& s) {
  const dim3 grid(blocks_for(s.seq, kBM), static_cast<unsigned>(s.heads),
                  static_cast<unsigned>(s.batch));
  const bool vec = aligned16({q, k, v});
  flash_forward_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(
      static_cast<T*>(out), lse, static_cast<const T*>(q), static_cast<const T*>(k),
      static_cast<const T*>(v), s.seq, static_cast<int>(s.heads), static_cast<int>(s.kv_heads),
      static_cast<float>(1.0 / std::sqrt(double(kD))), vec);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T>
void backward(Ctx& ctx, void* dq, void* dk, void* dv, const void* dout, const void* q,
              const void* k, const void* v, const void* out, const float* lse,
              const AttentionShape& s) {
  const float scale = static_cast<float>(1.0 / std::sqrt(double(kD)));
  const bool vec = aligned16({dout, q, k, v});
  const dim3 dq_grid(blocks_for(s.seq, kBM), static_cast<unsigned>(s.heads),
                     static_cast<unsigned>(s.batch));
  flash_dq_kernel<T><<<dq_grid, kThreads, 0, stream_of(ctx)>>>(
      static_cast<T*>(dq), static_cast<const T*>(dout), static_cast<const T*>(q),
      static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out), lse, s.seq,
      static_cast<int>(s.heads), static_cast<int>(s.kv_heads), scale, vec);
  MOE_CUDA_LAUNCH_CHECK();
  const dim3 kv_grid(blocks_for(s.seq, kBM), static_cast<unsigned>(s.kv_heads),
                     static_cast<unsigned>(s.batch));
  flash_dkdv_kernel<T><<<kv_grid, kThreads, 0, stream_of(ctx)>>>(
      static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout),
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
      static_cast<const T*>(out), lse, s.seq, static_cast<int>(s.heads),
      static_cast<int>(s.kv_heads), scale, vec);
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool attention_mma_available(DType t, int64_t hd) {
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    half_ok = compiled_for<__half>();
    bf16_ok = compiled_for<__nv_bfloat16>();
  });
  if (hd != kD) return false;
  return t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
}

void attention_mma_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                           const void* v, const AttentionShape& s) {
  if (attention_sm90_forward(ctx, t, out, lse, q, k, v, s) ||
      attention_sm80_forward(ctx, t, out, lse, q, k, v, s))
    return;
  if (t == DType::f16)
    forward<__half>(ctx, out, lse, q, k, v, s);
  else if (t == DType::bf16)
    forward<__nv_bfloat16>(ctx, out, lse, q, k, v, s);
  else
    throw InternalError(std::string("attention_mma_forward: unsupported dtype ") + dtype_name(t));
}

void attention_mma_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                            const void* q, const void* k, const void* v, const void* out,
                            const float* lse, float* dq_acc, const AttentionShape& s) {
  if (attention_sm90_backward(ctx, t, dq, dk, dv, dout, q, k, v, out, lse, dq_acc, s) ||
      attention_sm80_backward(ctx, t, dq, dk, dv, dout, q, k, v, out, lse, s))
    return;
  if (t == DType::f16)
    backward<__half>(ctx, dq, dk, dv, dout, q, k, v, out, lse, s);
  else if (t == DType::bf16)
    backward<__nv_bfloat16>(ctx, dq, dk, dv, dout, q, k, v, out, lse, s);
  else
    throw InternalError(std::string("attention_mma_backward: unsupported dtype ") + dtype_name(t));
}

}  // namespace moe::cuda_detail
