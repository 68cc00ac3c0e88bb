// The one-kernel flash attention backward for sm_90a (head_dim 64, f16 / bf16): the dk/dv kernel
// of attention_sm90.cu that also adds each step's share of dQ, dQ_i += dS_ij K_j, so no second
// kernel recomputes S, dP and dS per query tile (FlashAttention-3's schedule). Same op contract,
// layouts and rounding points as attention_sm90.cu's kernels (its top comment); dS is rounded to
// 16 bits before dQ's product, as before.
//
// Deterministic without atomics' races: a block owns one (batch, kv head) and walks its key tiles
// in order, so every dQ element gets its key tiles' shares from one thread, in key-tile order. A
// query tile's first share (key tile 0) is stored to the fp32 scratch `dq_acc` [B, nh, T, 64], the
// middle ones are added there by red.add (one thread per element, so the order is program order:
// same-address operations of a thread are coherence-ordered), and the last one (the key tile on
// the query tile's diagonal) is added to the loaded sum in registers, scaled and stored to dq in
// 16 bits. No zeroing pass and no conversion pass. The price: one block per (b, kv head) chain,
// so the grid fills the SMs' waves only for enough chains (attention_sm90.cu's use_fused decides).
//
// A step (64 queries of one query head against the block's 128 keys) as in the dk/dv kernel, plus:
// each math warpgroup stores its 64 rows of dS^T (rounded) into a [128 keys][64 queries] buffer in
// the 128-byte swizzle, and two steps later, once both halves are there (mbarriers ds_full /
// ds_empty: a barrier every step would run the warpgroups in lockstep, measured 1.5% slower),
// each computes 32 of dQ's 64 columns over all 128 keys: m64n32k16 wgmmas with A = dS read
// MN-major from that buffer and B = the key tile's K read MN-major from column 32 g. Three
// buffers rotate by step, and two K / V sets by key tile (the next key tile's land while this
// one's last steps run). Measured (docs/perf.md, 25th session): 7% under the two kernels at the
// peer shape, far from the dq kernel's whole share: the chains' Q, dO, O and sums overflow L2.
#include <mutex>

#include "cuda/attention_sm90.cuh"
#include "moe/env_switch.hpp"

namespace moe::cuda_detail {
namespace {
using namespace flash90;

// DkdvGeometry's steps (attention_sm90.cuh) over a chain of key tiles: two K / V sets, the dS^T
// buffers, then the ring.
struct Fused : DkdvGeometry {
  static constexpr int kSetBytes = 2 * kKVBytes;    // K, then V
  static constexpr int kDsBytes = kBN * kRowBytes;  // dS^T of a step: [128 keys][64 queries]
  // dQ's product of step i runs two steps late (step i + 2), so the math warpgroups never wait
  // for each other's dS^T halves in lockstep: three buffers rotate.
  static constexpr int kDsBuffers = 3, kDsLag = 2;
  static constexpr int kDs0 = 2 * kSetBytes;  // two K / V sets, then the dS^T buffers
  static constexpr int kRing0 = kDs0 + kDsBuffers * kDsBytes;
  static constexpr size_t kSmem = 1024 + kRing0 + kStages * kStageBytes;
  static constexpr int kMathBarrier = 3;  // both math warpgroups (1 and 2 are store_tile's)
};
static_assert(Fused::kSmem + 1024 <= 232448, "shared memory: 227 KiB with the static barriers");
static_assert(Fused::kDsBytes % 1024 == 0, "1024-byte aligned dS^T buffers");

// Relaxed (strong, gpu-scope) accesses to the fp32 dQ sums: the same thread's store, reductions
// and final load of an element are then ordered by coherence, in program order. The vector
// reduction is sm_90's: the bodies exist only in the sm_90a pass, as the kernel's.
[[maybe_unused]] __device__ __forceinline__ void store_pair(float* p, float x, float y) {
#if MOE_HAS_WGMMA
  asm volatile("st.relaxed.gpu.global.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y)
               : "memory");
#endif
}
[[maybe_unused]] __device__ __forceinline__ void add_pair(float* p, float x, float y) {
#if MOE_HAS_WGMMA
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y)
               : "memory");
#endif
}
[[maybe_unused]] __device__ __forceinline__ float2 load_pair(const float* p) {
  float2 v{0.0f, 0.0f};
#if MOE_HAS_WGMMA
  asm volatile("ld.relaxed.gpu.global.v2.f32 {%0, %1}, [%2];\n"
               : "=f"(v.x), "=f"(v.y)
               : "l"(p)
               : "memory");
#endif
  return v;
}

// kZigzag: the key tiles' passes over their query tiles alternate direction (odd key tiles walk
// them from the last down to the diagonal), so each pass starts on the query tiles the previous
// one read last, which are still in L2: the 132 chains' Q, dO, O and dq sums (~640 KiB each)
// overflow it, and a pass in the same direction as the last one finds only what it evicted.
// The dQ sums' key-tile order (and so their bits) is the same either way; dK and dV add their
// query tiles in the pass's order. Measured (docs/perf.md, 41st session, H100, 16 x 1024 x 16 x
// 64): 463 against 498 us.
template <class T, bool kZigzag>
__global__ void __launch_bounds__(kThreads, 1)
    flash_bwd_fused_sm90_kernel(const __grid_constant__ CUtensorMap map_q,
                                const __grid_constant__ CUtensorMap map_do,
                                const __grid_constant__ CUtensorMap map_k,
                                const __grid_constant__ CUtensorMap map_v,
                                const __grid_constant__ CUtensorMap map_o, T* dq, T* dk, T* dv,
                                float* dq_acc, const float* lse, int64_t seq, int heads,
                                int kv_heads, float scale, float scale_log2) {
  if constexpr (kHasWgmma) {
    using C = Fused;
    constexpr int kS = C::kStages;
    extern __shared__ __align__(1024) unsigned char smem[];
    constexpr int kB = C::kDsBuffers;
    // kv_full[2], kv_empty[2], ds_full[kB], ds_empty[kB], then landed[], full[], empty[] of the
    // ring
    __shared__ __align__(8) uint64_t bars[4 + 2 * kB + 3 * kS];
    const uint32_t base = align1024(shared_addr(smem));
    unsigned char* base_ptr = smem + (base - shared_addr(smem));
    const uint32_t kv_full = shared_addr(bars), kv_empty = kv_full + 16, ds_full = kv_full + 32,
                   ds_empty = ds_full + 8 * kB, landed = ds_empty + 8 * kB, full = landed + 8 * kS,
                   empty = full + 8 * kS;
    if (threadIdx.x == 0) {
      for (int s = 0; s < 2; ++s) {
        mbar_init(kv_full + 8 * s, 1);
        mbar_init(kv_empty + 8 * s, kMathWarps);
      }
      for (int s = 0; s < kB; ++s) {
        mbar_init(ds_full + 8 * s, kMathWarps);
        mbar_init(ds_empty + 8 * s, kMathWarps);
      }
      init_step_ring<C>(landed, full, empty);
      mbar_init_fence();
    }
    __syncthreads();
    const int bkv = static_cast<int>(blockIdx.x);
    const int b = bkv / kv_heads, kvh = bkv % kv_heads, group = heads / kv_heads;
    const int k_tiles = static_cast<int>((seq + C::kBN - 1) / C::kBN);
    const int q_tiles = static_cast<int>((seq + C::kBM - 1) / C::kBM);
    // Key tile kb sees query tiles 2 kb .. q_tiles - 1 of each query head of the group; a step is
    // a (query head, query tile) pair, head-major; `it` counts steps over the whole chain (the
    // ring's index).
    auto per_head = [&](int kb) { return q_tiles - 2 * kb; };
    // The query tile of step i of key tile kb (ph = per_head(kb)): the pass's order (kZigzag).
    auto q_tile_of = [&](int kb, int i, int ph) {
      const int j = i % ph;
      return 2 * kb + (kZigzag && (kb & 1) ? ph - 1 - j : j);
    };
    const int wg = static_cast<int>(threadIdx.x) / 128;
    if (wg == 0) {
      release_registers<C::kProducerRegs>();
      if (threadIdx.x == 0) {
        int it = 0;
        for (int kb = 0; kb < k_tiles; ++kb) {
          const int set = kb & 1;
          if (kb >= 2) mbar_wait(kv_empty + 8 * set, ((kb >> 1) & 1) ^ 1u);
          mbar_arrive_expect_tx(kv_full + 8 * set, 2 * C::kKVBytes);
          const uint32_t kv = base + set * C::kSetBytes;
          const auto k0 = static_cast<int32_t>(kb * C::kBN);
          tma_load_3d(kv, &map_k, kv_full + 8 * set, kvh * kD, k0, b);
          tma_load_3d(kv + C::kKVBytes, &map_v, kv_full + 8 * set, kvh * kD, k0, b);
          const int ph = per_head(kb), steps = group * ph;
          for (int i = 0; i < steps; ++i, ++it) {
            const int s = it % kS;
            if (it >= kS) mbar_wait(empty + 8 * s, ((it / kS) & 1) ^ 1u);
            load_step_tiles<C>(base + C::kRing0 + s * C::kStageBytes, landed + 8 * s, &map_q,
                               &map_do, &map_o, kvh * group + i / ph,
                               static_cast<int32_t>(q_tile_of(kb, i, ph) * C::kBM), b);
          }
        }
      } else if (threadIdx.x >= 64) {
        // lse and D = <dO_i, O_i> of each step's queries, one row per thread (helper_step).
        const int r = static_cast<int>(threadIdx.x) - 64;
        int it = 0;
        for (int kb = 0; kb < k_tiles; ++kb) {
          const int ph = per_head(kb), steps = group * ph;
          for (int i = 0; i < steps; ++i, ++it) {
            const int s = it % kS;
            const int h = kvh * group + i / ph;
            helper_step<C, T>(base_ptr + C::kRing0 + s * C::kStageBytes, landed + 8 * s,
                              full + 8 * s, (it / kS) & 1, r, lse + (int64_t(b) * heads + h) * seq,
                              int64_t(q_tile_of(kb, i, ph)) * C::kBM, seq);
          }
        }
      }
      return;
    }
    claim_registers<C::kMathRegs>();
    const int g = wg - 1, lane = static_cast<int>(threadIdx.x) % 32, t4 = lane & 3;
    const int warp = (static_cast<int>(threadIdx.x) % 128) / 32;
    const int r16 = warp * 16 + lane / 4;  // this thread's rows of an m64 tile: r16 and r16 + 8
    const bool signals = lane == 0;
    float dka[32], dva[32], s[32], dp[32], dqa[16];
    // P^T and dS^T of the previous step, rounded: the A operands of dV += P^T dO, dK += dS^T Q
    uint32_t pa[C::kBM / 16][4], dsa[C::kBM / 16][4];
    auto q_tile = [&](int st) { return base + C::kRing0 + st * C::kStageBytes; };
    // Step it's dS^T buffer, and the parity of its use (the buffer's it / kB-th).
    auto ds_buf = [&](int it) { return base + C::kDs0 + (it % kB) * C::kDsBytes; };
    auto ds_parity = [&](int it) { return static_cast<uint32_t>((it / kB) & 1); };
    // This warpgroup's 64 rows of step it's dS^T (dsa) into its buffer, swizzled as TMA would
    // write it (chunk c of row r at chunk c ^ r % 8), once both warpgroups' dQ products of the
    // buffer's last use have retired; then made visible to the wgmma (async proxy) that reads
    // it, and signalled (ds_full). dsa[k][e] is, for the warp, the 8 x 8 matrix of rows r16 +
    // 8 (e & 1) and 16-byte chunk 2 k + (e >> 1) in the mma fragment layout: one stmatrix x4 a
    // k, lane l giving the address of row l % 8 of matrix l / 8.
    const int st_row = g * kWgRows + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    const int st_chunk = lane >> 4;
    auto write_ds = [&](int it) {
      if (it >= kB) mbar_wait(ds_empty + 8 * (it % kB), ds_parity(it) ^ 1u);
      const uint32_t row_at = ds_buf(it) + st_row * kRowBytes;
#pragma unroll
      for (int k = 0; k < C::kBM / 16; ++k) {
        const uint32_t at = row_at + (((2 * k + st_chunk) ^ (st_row & 7)) << 4);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(at),
                     "r"(dsa[k][0]), "r"(dsa[k][1]), "r"(dsa[k][2]), "r"(dsa[k][3])
                     : "memory");
      }
      fence_proxy_async_smem();
      __syncwarp();
      if (signals) mbar_arrive(ds_full + 8 * (it % kB));
    };
    int it = 0;  // the chain's first step of the current key tile
    for (int kb = 0; kb < k_tiles; ++kb) {
      const int set = kb & 1, ph = per_head(kb), steps = group * ph;
      const int64_t wg_key = int64_t(kb) * C::kBN + g * kWgRows;  // the warpgroup's first key
      const int64_t key = wg_key + r16;  // this thread's keys: key and key + 8
      const uint32_t kv = base + set * C::kSetBytes;
      const uint32_t k_rows = kv + g * kWgBytes, v_rows = kv + C::kKVBytes + g * kWgBytes;
      const uint64_t k_desc = kmajor_desc(k_rows), v_desc = kmajor_desc(v_rows);
      // dQ's B: all 128 keys of K, MN-major, from column 32 g (64 bytes into each swizzled row:
      // the swizzle is applied on address bits, as for the K-major k16 steps' 32-byte moves).
      const uint64_t kq_desc = desc_at(mnmajor_desc(kv), 64 * g);
      // Step `step`'s first query (of its query tile q_tile_of(kb, step, ph)).
      auto query0 = [&](int step) { return int64_t(q_tile_of(kb, step, ph)) * C::kBM; };
      // The step in stage st: its products (dkdv_scores, dkdv_accumulate) and elementwise part.
      auto scores = [&](int st) { dkdv_scores<T, C>(s, dp, k_desc, v_desc, q_tile(st)); };
      auto grads = [&](int step, int st) {
        dkdv_grads<C>(s, dp, base_ptr + C::kRing0 + st * C::kStageBytes, query0(step), wg_key, key,
                      seq, t4, scale_log2);
      };
      auto accumulate = [&](int st) { dkdv_accumulate<T, C>(dva, dka, pa, dsa, q_tile(st)); };
      // dQ's columns 32 g .. 32 g + 31 of step `at` (dS K over the 128 keys, into dqa afresh),
      // once both halves of its dS^T are in the buffer; issued, not committed.
      auto dq_product = [&](int at) {
        mbar_wait(ds_full + 8 * (at % kB), ds_parity(at));
        const uint64_t ds_desc = mnmajor_desc(ds_buf(at));
#pragma unroll
        for (int k = 0; k < C::kBN / 16; ++k)
          wgmma_m64n32<T, 1, 1>(dqa, desc_at(ds_desc, 2048 * k), desc_at(kq_desc, 2048 * k), k > 0);
      };
      // Step `step`'s dQ share (retired in dqa: rows r16 and r16 + 8 of its query tile, columns
      // 32 g + 8 j + 2 t4 of its head) into the sums: stored on key tile 0, added after it, and
      // on the query tile's diagonal key tile (its last) added to the loaded sum, scaled and
      // stored to dq. Rows past T are neither read nor written.
      auto finish_dq = [&](int step) {
        const int h = kvh * group + step / ph;
        const bool first = kb == 0, last = q_tile_of(kb, step, ph) - 2 * kb < 2;
        float* acc = dq_acc + (int64_t(b) * heads + h) * seq * kD + 32 * g + 2 * t4;
        T* out = dq + (int64_t(b) * seq * heads + h) * kD + 32 * g + 2 * t4;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int64_t q = query0(step) + r16 + 8 * hr;
          if (q >= seq) continue;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float* a = acc + q * kD + 8 * j;
            float x = dqa[4 * j + 2 * hr], y = dqa[4 * j + 2 * hr + 1];
            if (last) {
              if (!first) {
                const float2 old = load_pair(a);
                x = old.x + x;
                y = old.y + y;
              }
              *reinterpret_cast<uint32_t*>(out + q * heads * kD + 8 * j) =
                  pack2<T>(x * scale, y * scale);
            } else if (first) {
              store_pair(a, x, y);
            } else {
              add_pair(a, x, y);
            }
          }
        }
      };
      mbar_wait(kv_full + 8 * set, (kb >> 1) & 1);
      zero(dka);
      zero(dva);
      {  // step 0
        const int st = it % kS;
        mbar_wait(landed + 8 * st, (it / kS) & 1);
        mbar_wait(full + 8 * st, (it / kS) & 1);
        wgmma_fence();
        scores(st);
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(s);
        fence_accumulators(dp);
        grads(0, st);
        pack_a<T, C::kBM>(pa, s);
        pack_a<T, C::kBM>(dsa, dp);
        write_ds(it);
      }
      // Step i: S^T and dP^T, then the previous step's dV and dK products and step i - 2's dQ
      // product right behind them, which run while the elementwise part of step i does; the
      // previous step's stage and step i - 2's dS^T buffer are freed after them.
      constexpr int kLag = C::kDsLag;
      for (int i = 1; i < steps; ++i) {
        const int cur = it + i, st = cur % kS, prev = (cur - 1) % kS;
        mbar_wait(landed + 8 * st, (cur / kS) & 1);
        mbar_wait(full + 8 * st, (cur / kS) & 1);
        wgmma_fence();
        scores(st);
        wgmma_commit();
        accumulate(prev);
        if (i >= kLag) dq_product(cur - kLag);
        wgmma_commit();
        wgmma_wait<1>();  // S^T and dP^T have retired
        fence_accumulators(s);
        fence_accumulators(dp);
        grads(i, st);
        wgmma_wait<0>();
        fence_accumulators(dka);
        fence_accumulators(dva);
        fence_accumulators(dqa);
        fence_fragments(pa);
        fence_fragments(dsa);
        if (signals) mbar_arrive(empty + 8 * prev);
        if (i >= kLag) {
          if (signals) mbar_arrive(ds_empty + 8 * ((cur - kLag) % kB));
          finish_dq(i - kLag);
        }
        pack_a<T, C::kBM>(pa, s);
        pack_a<T, C::kBM>(dsa, dp);
        write_ds(cur);
      }
      {  // the last step's dV and dK products, then the dQ products still owed
        const int last = it + steps - 1, st = last % kS;
        wgmma_fence();
        accumulate(st);
        wgmma_commit();
        for (int i = steps > kLag ? steps - kLag : 0; i < steps; ++i) {
          dq_product(it + i);
          wgmma_commit();
          wgmma_wait<0>();
          fence_accumulators(dqa);
          if (signals) mbar_arrive(ds_empty + 8 * ((it + i) % kB));
          finish_dq(i);
          wgmma_fence();
        }
        wgmma_wait<0>();
        fence_accumulators(dka);
        fence_accumulators(dva);
        fence_fragments(pa);
        fence_fragments(dsa);
        if (signals) mbar_arrive(empty + 8 * st);
      }
      it += steps;
      // Both warpgroups' dQ products (which read all 128 rows of K) have retired: each
      // warpgroup's K and V rows can stage its dK and dV; then the set is the producer's again.
      named_barrier_sync(C::kMathBarrier, 256);
      store_dk_dv<T>(dka, dva, k_rows, v_rows, dk, dv, b, seq, wg_key, kv_heads, kvh, scale, g);
      __syncwarp();
      if (signals) mbar_arrive(kv_empty + 8 * set);
    }
  }
}

// MOE_ATTENTION_ZIGZAG (read at every call): "0" walks every pass in the same direction; unset or
// anything else alternates them (kZigzag).
bool zigzag() {
  return env_switch("MOE_ATTENTION_ZIGZAG", true);
}

template <class T, bool kZigzag>
void launch(Ctx& ctx, DType t, void* dq, void* dk, void* dv, float* dq_acc, const void* dout,
            const void* q, const void* k, const void* v, const void* out, const float* lse,
            const AttentionShape& s) {
  using C = Fused;
  auto kernel = flash_bwd_fused_sm90_kernel<T, kZigzag>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, C::kSmem); });
  const DkdvMaps m = dkdv_maps(t, q, dout, k, v, out, s);
  const auto grid = static_cast<unsigned>(s.batch * s.kv_heads);
  kernel<<<grid, kThreads, C::kSmem, stream_of(ctx)>>>(
      m.q, m.dout, m.k, m.v, m.out, static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv),
      dq_acc, lse, s.seq, static_cast<int>(s.heads), static_cast<int>(s.kv_heads),
      static_cast<float>(kScale), static_cast<float>(kScale * 1.4426950408889634));
  MOE_CUDA_LAUNCH_CHECK();
}

template <class T>
void launch(Ctx& ctx, DType t, void* dq, void* dk, void* dv, float* dq_acc, const void* dout,
            const void* q, const void* k, const void* v, const void* out, const float* lse,
            const AttentionShape& s) {
  if (zigzag())
    launch<T, true>(ctx, t, dq, dk, dv, dq_acc, dout, q, k, v, out, lse, s);
  else
    launch<T, false>(ctx, t, dq, dk, dv, dq_acc, dout, q, k, v, out, lse, s);
}

}  // namespace

namespace flash90 {

bool fused_backward_compiled_for_sm90a() {
#ifdef MOE_WITH_SM90A
  auto is90 = [](int v) { return v >= 90 && v < 100; };
  return is90(compiled_arch(flash_bwd_fused_sm90_kernel<__half, true>)) &&
         is90(compiled_arch(flash_bwd_fused_sm90_kernel<__nv_bfloat16, true>)) &&
         is90(compiled_arch(flash_bwd_fused_sm90_kernel<__half, false>)) &&
         is90(compiled_arch(flash_bwd_fused_sm90_kernel<__nv_bfloat16, false>));
#else
  return false;
#endif
}

void launch_fused_backward(Ctx& ctx, DType t, void* dq, void* dk, void* dv, float* dq_acc,
                           const void* dout, const void* q, const void* k, const void* v,
                           const void* out, const float* lse, const AttentionShape& s) {
  if (t == DType::f16)
    launch<__half>(ctx, t, dq, dk, dv, dq_acc, dout, q, k, v, out, lse, s);
  else
    launch<__nv_bfloat16>(ctx, t, dq, dk, dv, dq_acc, dout, q, k, v, out, lse, s);
}

}  // namespace flash90
}  // namespace moe::cuda_detail
