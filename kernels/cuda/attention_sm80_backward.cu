// FlashAttention-2 style causal GQA attention backward for sm_80+ (f16 / bf16, head_dim 64) with
// mma.sync: the fast path of attention_mma_backward (attention_mma.cuh). Same split as the WMMA
// kernels of attention_mma.cu (which stay for sm_70-sm_75 builds and unaligned tensors), every
// output has exactly one writer (no atomics, deterministic):
// - dq kernel, 64 query rows of one (b, h) per block (4 warps x 16 rows), Q and dO fragments held
//   in registers: for each key tile of 64 up to the block's last row, S = Q K^T, dP = dO V^T,
//   P = exp(scale S - lse), dS = P (dP - D) with D_i = <dO_i, O_i>, dQ += dS K; dQ = scale dQ.
// - dk/dv kernel, 64 keys of one (b, kv head) per block, K and V fragments held in registers: for
//   each query head of the group and each query tile of 64 that sees the keys, S^T = K Q^T,
//   dP^T = V dO^T, P^T and dS^T as above, dV += P^T dO, dK += dS^T Q; dK = scale dK.
// Scores, P and dS stay in registers (attention_sm80.cuh); the staged tiles stream through
// two-stage cp.async rings. D is computed where it is needed from dO and O rows (the ops have no
// scratch memory to keep it in), lse is used in the log2 domain (exp2_ftz).
#include <cmath>
#include <mutex>

#include "cuda/attention_mma.cuh"
#include "cuda/attention_sm80.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/vec16.cuh"

namespace moe::cuda_detail {
namespace {

using namespace flash;

constexpr int kWarps = kTile / 16;  // 16 rows per warp
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

template <class T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int64_t stride, int64_t row0,
                                          int64_t seq) {
  cp_async_rows<T, kTile, kD, kLd, kThreads>(dst, src, stride, row0, seq);
}

// <a, b> over n elements (n % 8 == 0, 16-byte aligned), in fp32.
template <class T>
__device__ __forceinline__ float dot(const T* a, const T* b, int n) {
  float s = 0;
  for (int c = 0; c < n; c += 8) {
    const uint4 va = *reinterpret_cast<const uint4*>(a + c);
    const uint4 vb = *reinterpret_cast<const uint4*>(b + c);
    const T* ea = reinterpret_cast<const T*>(&va);
    const T* eb = reinterpret_cast<const T*>(&vb);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += load(ea[j]) * load(eb[j]);
  }
  return s;
}

// ---- dq -----------------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
    flash_dq_sm80_kernel(T* dq, const T* dout, const T* q, const T* k, const T* v, const T* out,
                         const float* lse, int64_t seq, int heads, int kv_heads, float scale,
                         float scale_log2) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* qs = reinterpret_cast<T*>(smem_raw);
    T* dos = qs + kTileElems;
    T* ring = dos + kTileElems;  // stage s: K at ring + 2 s tile, V right after
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int64_t tiles = (seq + kTile - 1) / kTile;
    const int64_t q0 = (tiles - 1 - blockIdx.x) * kTile;  // longest first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (heads / kv_heads);
    const int64_t q_stride = int64_t(heads) * kD, kv_stride = int64_t(kv_heads) * kD;
    const int64_t q_off = (int64_t(b) * seq * heads + h) * kD;
    const T* kb = k + (int64_t(b) * seq * kv_heads + kvh) * kD;
    const T* vb = v + (int64_t(b) * seq * kv_heads + kvh) * kD;
    const int64_t kv_end = seq < q0 + kTile ? seq : q0 + kTile;
    const int n_tiles = static_cast<int>((kv_end + kTile - 1) / kTile);

    load_rows(qs, q + q_off, q_stride, q0, seq);
    load_rows(dos, dout + q_off, q_stride, q0, seq);
    load_rows(ring, kb, kv_stride, 0, seq);
    load_rows(ring + kTileElems, vb, kv_stride, 0, seq);
    cp_async_commit();

    // D and lse (log2 domain) of rows g and g + 8: the quad's 4 lanes take 16 columns each. Rows
    // past T get lse = +inf, so their P is 0.
    const int64_t warp_first = q0 + warp * 16, warp_last = warp_first + 15;
    float d_row[2], lse2[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t row = warp_first + g + 8 * hr;
      const bool in = row < seq;
      float part = in ? dot(dout + q_off + row * q_stride + 16 * t4,
                            out + q_off + row * q_stride + 16 * t4, 16)
                      : 0.0f;
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      d_row[hr] = part;
      lse2[hr] = in ? lse[(int64_t(b) * heads + h) * seq + row] * kLog2e : INFINITY;
    }

    Frags qf, dof;
    Accum dqa;
    zero(dqa);
    for (int tile = 0; tile < n_tiles; ++tile) {
      cp_async_wait<0>();
      __syncthreads();  // tile landed for all; every warp is done with tile - 1
      if (tile == 0) {
        load_a(qf, qs, warp * 16);
        load_a(dof, dos, warp * 16);
      }
      if (tile + 1 < n_tiles) {
        T* next = ring + ((tile + 1) & 1) * 2 * kTileElems;
        load_rows(next, kb, kv_stride, int64_t(tile + 1) * kTile, seq);
        load_rows(next + kTileElems, vb, kv_stride, int64_t(tile + 1) * kTile, seq);
      }
      cp_async_commit();
      const int64_t j0 = int64_t(tile) * kTile;
      if (j0 > warp_last) continue;  // uniform over the warp
      const T* ks = ring + (tile & 1) * 2 * kTileElems;
      const T* vs = ks + kTileElems;
      Accum s, dp;
      abt(s, qf, ks);    // S = Q K^T
      abt(dp, dof, vs);  // dP = dO V^T
      const bool edge = j0 + kTile - 1 > warp_first || j0 + kTile > seq;
#pragma unroll
      for (int j = 0; j < kFrags; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hr = e >> 1;
          const int64_t key = j0 + 8 * j + 2 * t4 + (e & 1), row = warp_first + g + 8 * hr;
          const float p =
              edge && (key > row || key >= seq) ? 0.0f : exp2_ftz(s[j][e] * scale_log2 - lse2[hr]);
          s[j][e] = p * (dp[j][e] - d_row[hr]);  // dS
        }
      cb(dqa, s, ks);  // dQ += dS K
    }
    cp_async_wait<0>();
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t row = warp_first + g + 8 * hr;
      if (row < seq) store_row(dq + q_off + row * q_stride, dqa, hr, scale);
    }
  }
}

// ---- dk / dv ------------------------------------------------------------------------------------

// One stage of the dk/dv ring: a query tile's Q and dO rows and, per row, lse (log2 domain; +inf
// past T) and D.
template <class T>
struct QueryStage {
  T* q;
  T* dout;
  float* lse2;
  float* d;
  static constexpr size_t kBytes = 2 * kTileElems * sizeof(T) + 2 * kTile * sizeof(float);
  __device__ QueryStage(unsigned char* base)
      : q(reinterpret_cast<T*>(base)),
        dout(q + kTileElems),
        lse2(reinterpret_cast<float*>(dout + kTileElems)),
        d(lse2 + kTile) {}
};

template <class T>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_sm80_kernel(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                           const T* out, const float* lse, int64_t seq, int heads, int kv_heads,
                           float scale, float scale_log2) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* ks = reinterpret_cast<T*>(smem_raw);
    T* vs = ks + kTileElems;
    unsigned char* ring = reinterpret_cast<unsigned char*>(vs + kTileElems);
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int64_t k0 = int64_t(blockIdx.x) * kTile;  // the first key tiles see the most queries
    const int kvh = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
    const int64_t q_stride = int64_t(heads) * kD, kv_stride = int64_t(kv_heads) * kD;
    const int64_t kv_off = (int64_t(b) * seq * kv_heads + kvh) * kD;
    const int64_t q_tiles = (seq + kTile - 1) / kTile, first_tile = k0 / kTile;
    const int per_head = static_cast<int>(q_tiles - first_tile);
    const int steps = group * per_head;  // (query head, query tile) pairs, head-major

    // Starts loading step `it` into its stage: Q and dO rows by cp.async; lse and D by plain
    // loads and stores (two threads per row), visible after the next barrier.
    auto stage_in = [&](int it) {
      const QueryStage<T> st(ring + (it & 1) * QueryStage<T>::kBytes);
      const int h = kvh * group + it / per_head;
      const int64_t i0 = (first_tile + it % per_head) * kTile;
      const int64_t q_off = (int64_t(b) * seq * heads + h) * kD;
      load_rows(st.q, q + q_off, q_stride, i0, seq);
      load_rows(st.dout, dout + q_off, q_stride, i0, seq);
      const int r = static_cast<int>(threadIdx.x) >> 1, half = threadIdx.x & 1;
      const int64_t row = i0 + r;
      const bool in = row < seq;
      float part = in ? dot(dout + q_off + row * q_stride + 32 * half,
                            out + q_off + row * q_stride + 32 * half, 32)
                      : 0.0f;
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      if (half == 0) {
        st.d[r] = part;
        st.lse2[r] = in ? lse[(int64_t(b) * heads + h) * seq + row] * kLog2e : INFINITY;
      }
    };

    load_rows(ks, k + kv_off, kv_stride, k0, seq);
    load_rows(vs, v + kv_off, kv_stride, k0, seq);
    if (steps > 0) stage_in(0);
    cp_async_commit();

    Frags kf, vf;
    Accum dka, dva;
    zero(dka);
    zero(dva);
    const int64_t warp_key = k0 + warp * 16;  // this warp's first key
    for (int it = 0; it < steps; ++it) {
      cp_async_wait<0>();
      __syncthreads();  // step `it` landed for all; every warp is done with step it - 1
      if (it == 0) {
        load_a(kf, ks, warp * 16);
        load_a(vf, vs, warp * 16);
      }
      if (it + 1 < steps) stage_in(it + 1);
      cp_async_commit();
      const QueryStage<T> st(ring + (it & 1) * QueryStage<T>::kBytes);
      const int64_t i0 = (first_tile + it % per_head) * kTile;
      Accum s, dp;
      abt(s, kf, st.q);      // S^T = K Q^T
      abt(dp, vf, st.dout);  // dP^T = V dO^T
      const bool edge = i0 < k0 + kTile || i0 + kTile > seq;
#pragma unroll
      for (int j = 0; j < kFrags; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * j + 2 * t4 + (e & 1);
          const int64_t query = i0 + c, key = warp_key + g + 8 * (e >> 1);
          const float p = edge && (query < key || query >= seq)
                              ? 0.0f
                              : exp2_ftz(s[j][e] * scale_log2 - st.lse2[c]);
          s[j][e] = p;                          // P^T
          dp[j][e] = p * (dp[j][e] - st.d[c]);  // dS^T
        }
      cb(dva, s, st.dout);  // dV += P^T dO
      cb(dka, dp, st.q);    // dK += dS^T Q
    }
    cp_async_wait<0>();
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t key = warp_key + g + 8 * hr;
      if (key >= seq) continue;
      store_row(dk + kv_off + key * kv_stride, dka, hr, scale);
      store_row(dv + kv_off + key * kv_stride, dva, hr, 1.0f);
    }
  }
}

constexpr size_t kDqSmem = 4 * kTileElems * 2 + 2 * kTileElems * 2;  // Q, dO, K/V x 2 stages
template <class T>
constexpr size_t kDkdvSmem = 2 * kTileElems * sizeof(T) + 2 * QueryStage<T>::kBytes;

template <class T>
void launch_backward(Ctx& ctx, void* dq, void* dk, void* dv, const void* dout, const void* q,
                     const void* k, const void* v, const void* out, const float* lse,
                     const AttentionShape& s) {
  static std::once_flag once;
  std::call_once(once, [] {
    allow_dynamic_smem(flash_dq_sm80_kernel<T>, kDqSmem);
    allow_dynamic_smem(flash_dkdv_sm80_kernel<T>, kDkdvSmem<T>);
  });
  const double scale = 1.0 / std::sqrt(double(kD));
  const auto scale_f = static_cast<float>(scale);
  const auto scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const dim3 dq_grid(blocks_for(s.seq, kTile), static_cast<unsigned>(s.heads),
                     static_cast<unsigned>(s.batch));
  flash_dq_sm80_kernel<T><<<dq_grid, kThreads, kDqSmem, stream_of(ctx)>>>(
      static_cast<T*>(dq), static_cast<const T*>(dout), static_cast<const T*>(q),
      static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out), lse, s.seq,
      static_cast<int>(s.heads), static_cast<int>(s.kv_heads), scale_f, scale_log2);
  MOE_CUDA_LAUNCH_CHECK();
  const dim3 kv_grid(blocks_for(s.seq, kTile), static_cast<unsigned>(s.kv_heads),
                     static_cast<unsigned>(s.batch));
  flash_dkdv_sm80_kernel<T><<<kv_grid, kThreads, kDkdvSmem<T>, stream_of(ctx)>>>(
      static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout),
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
      static_cast<const T*>(out), lse, s.seq, static_cast<int>(s.heads),
      static_cast<int>(s.kv_heads), scale_f, scale_log2);
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T>
bool compiled_for_sm80() {
  return compiled_arch(flash_dq_sm80_kernel<T>) >= 80 &&
         compiled_arch(flash_dkdv_sm80_kernel<T>) >= 80;
}

}  // namespace

bool attention_sm80_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, const void* dout,
                             const void* q, const void* k, const void* v, const void* out,
                             const float* lse, const AttentionShape& s) {
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    half_ok = compiled_for_sm80<__half>();
    bf16_ok = compiled_for_sm80<__nv_bfloat16>();
  });
  const bool ok = t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
  if (!ok || !aligned16({dq, dk, dv, dout, q, k, v, out})) return false;
  if (t == DType::f16)
    launch_backward<__half>(ctx, dq, dk, dv, dout, q, k, v, out, lse, s);
  else
    launch_backward<__nv_bfloat16>(ctx, dq, dk, dv, dout, q, k, v, out, lse, s);
  return true;
}

}  // namespace moe::cuda_detail
