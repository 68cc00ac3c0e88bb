// FlashAttention-2 style causal GQA attention forward for sm_80+ (f16 / bf16, head_dim 64) with
// mma.sync: the fast path of attention_mma_forward (attention_mma.cuh). The WMMA kernel of
// attention_mma.cu stays for sm_70-sm_75 builds and unaligned tensors.
//
// Why it is faster than the WMMA kernel: scores, probabilities and the output accumulator never
// leave the registers. The accumulator layout of S = Q K^T (m16n8 fragments) is, two n8 fragments
// at a time, the A-fragment layout that O += P V needs, so P is packed to 16 bits in place; row
// max / sum are reduced across the 4 lanes that share a row with two shuffles. K and V tiles
// stream through a two-stage cp.async ring, so the next tile's loads overlap this tile's math.
//
// A block: 8 warps, 128 query rows of one (b, h), 16 rows per warp, its Q fragments loaded once
// (ldmatrix). Key tiles of 64 up to the block's last row (causal), longest query tiles first.
// Softmax in the log2 domain (exp2_ftz; scale folded with log2 e); lse = (m + log2 l) ln 2 in fp32.
// Keys past the row (causal) or past T are -inf; rows past T are computed and not stored.
#include <cmath>
#include <mutex>

#include "cuda/attention_mma.cuh"
#include "cuda/attention_sm80.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma_common.cuh"
#include "cuda/mma_sm80.cuh"
#include "cuda/vec16.cuh"

namespace moe::cuda_detail {
namespace {

using namespace flash;

constexpr int kBM = 128;  // query rows per block
constexpr int kWarps = kBM / 16;
constexpr int kThreads = 32 * kWarps;
constexpr size_t kSmemBytes = (kBM * kLd + 4 * kTileElems) * 2;  // Q, then K/V x 2 stages

template <class T, int kRows>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int64_t stride, int64_t row0,
                                          int64_t seq) {
  cp_async_rows<T, kRows, kD, kLd, kThreads>(dst, src, stride, row0, seq);
}

// Two blocks per SM (16 warps): at most 128 registers a thread.
template <class T>
__global__ void __launch_bounds__(kThreads, 2)
    flash_forward_sm80_kernel(T* out, float* lse, const T* q, const T* k, const T* v, int64_t seq,
                              int heads, int kv_heads, float scale_log2) {
  if constexpr (kHasSm80) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* qs = reinterpret_cast<T*>(smem_raw);
    T* ring = qs + kBM * kLd;  // stage s: K at ring + 2 s tile, V right after
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
    const int g = lane >> 2;
    const int64_t tiles = (seq + kBM - 1) / kBM;
    const int64_t q0 = (tiles - 1 - blockIdx.x) * kBM;  // longest first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (heads / kv_heads);
    const int64_t q_stride = int64_t(heads) * kD, kv_stride = int64_t(kv_heads) * kD;
    const T* qb = q + (int64_t(b) * seq * heads + h) * kD;
    const T* kb = k + (int64_t(b) * seq * kv_heads + kvh) * kD;
    const T* vb = v + (int64_t(b) * seq * kv_heads + kvh) * kD;
    const int64_t kv_end = seq < q0 + kBM ? seq : q0 + kBM;
    const int n_tiles = static_cast<int>((kv_end + kTile - 1) / kTile);

    load_rows<T, kBM>(qs, qb, q_stride, q0, seq);
    load_rows<T, kTile>(ring, kb, kv_stride, 0, seq);
    load_rows<T, kTile>(ring + kTileElems, vb, kv_stride, 0, seq);
    cp_async_commit();

    Frags qf;
    Accum o;
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};  // rows g and g + 8, log2 domain
    const int64_t warp_first = q0 + warp * 16, warp_last = warp_first + 15;
    for (int tile = 0; tile < n_tiles; ++tile) {
      cp_async_wait<0>();
      __syncthreads();  // tile (and Q) landed for all; every warp is done with tile - 1
      if (tile == 0) load_a(qf, qs, warp * 16);
      if (tile + 1 < n_tiles) {
        T* next = ring + ((tile + 1) & 1) * 2 * kTileElems;
        load_rows<T, kTile>(next, kb, kv_stride, int64_t(tile + 1) * kTile, seq);
        load_rows<T, kTile>(next + kTileElems, vb, kv_stride, int64_t(tile + 1) * kTile, seq);
      }
      cp_async_commit();
      const int64_t j0 = int64_t(tile) * kTile;
      if (j0 > warp_last) continue;  // every key of the tile is in this warp's future (uniform)
      const T* ks = ring + (tile & 1) * 2 * kTileElems;
      const T* vs = ks + kTileElems;
      Accum s;
      abt(s, qf, ks);  // S = Q K^T
      // mask, scale to the log2 domain, and the running row maxima
      const bool edge = j0 + kTile - 1 > warp_first || j0 + kTile > seq;
      float mx[2] = {m[0], m[1]};
      for_each(s, [&](int hr, int c, float& x) {
        const int64_t key = j0 + c, row = warp_first + g + 8 * hr;
        x *= scale_log2;
        if (edge && (key > row || key >= seq)) x = -INFINITY;
        mx[hr] = fmaxf(mx[hr], x);
      });
      float base[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
        // A row with no visible key yet keeps m = -inf: subtract 0 so nothing becomes NaN.
        base[hr] = mx[hr] == -INFINITY ? 0.0f : mx[hr];
        const float alpha = exp2_ftz(m[hr] - base[hr]);
        m[hr] = mx[hr];
        l[hr] *= alpha;
#pragma unroll
        for (int j = 0; j < kFrags; ++j) {
          o[j][2 * hr] *= alpha;
          o[j][2 * hr + 1] *= alpha;
        }
      }
      // P = exp2(S - m); l sums it in fp32 before cb() rounds it to T, as FlashAttention does
      for_each(s, [&](int hr, int, float& x) {
        x = exp2_ftz(x - base[hr]);
        l[hr] += x;
      });
      cb(o, s, vs);  // O += P V
    }
    cp_async_wait<0>();
    // finish: l over the quad, O / l, lse = (m + log2 l) ln 2
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
      l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
      const int64_t row = warp_first + g + hr * 8;
      if (row >= seq) continue;
      store_row(out + ((int64_t(b) * seq + row) * heads + h) * kD, o, hr, 1.0f / l[hr]);
      if ((lane & 3) == 0)
        lse[(int64_t(b) * heads + h) * seq + row] = (m[hr] + log2f(l[hr])) * 0.69314718055994531f;
    }
  }
}

template <class T>
void launch_forward(Ctx& ctx, void* out, float* lse, const void* q, const void* k, const void* v,
                    const AttentionShape& s) {
  auto kernel = flash_forward_sm80_kernel<T>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, kSmemBytes); });
  const dim3 grid(blocks_for(s.seq, kBM), static_cast<unsigned>(s.heads),
                  static_cast<unsigned>(s.batch));
  const float scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(double(kD)));
  kernel<<<grid, kThreads, kSmemBytes, stream_of(ctx)>>>(
      static_cast<T*>(out), lse, static_cast<const T*>(q), static_cast<const T*>(k),
      static_cast<const T*>(v), s.seq, static_cast<int>(s.heads), static_cast<int>(s.kv_heads),
      scale_log2);
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool attention_sm80_forward(Ctx& ctx, DType t, void* out, float* lse, const void* q, const void* k,
                            const void* v, const AttentionShape& s) {
  static std::once_flag once;
  static bool half_ok = false, bf16_ok = false;
  std::call_once(once, [] {
    half_ok = compiled_arch(flash_forward_sm80_kernel<__half>) >= 80;
    bf16_ok = compiled_arch(flash_forward_sm80_kernel<__nv_bfloat16>) >= 80;
  });
  const bool ok = t == DType::f16 ? half_ok : t == DType::bf16 ? bf16_ok : false;
  if (!ok || !aligned16({out, q, k, v})) return false;
  if (t == DType::f16)
    launch_forward<__half>(ctx, out, lse, q, k, v, s);
  else
    launch_forward<__nv_bfloat16>(ctx, out, lse, q, k, v, s);
  return true;
}

}  // namespace moe::cuda_detail
