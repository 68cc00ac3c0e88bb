// Token embedding on the GPU. The forward gathers table rows by token id: one grid-stride loop over
// the N*d output elements, a plain copy (no rounding). The backward scatters dout back into the
// table rows (dtable += , a parameter gradient) and must be deterministic when a token repeats, so
// it uses no atomics: a block owns a slice of kColumns columns and one residue class of vocab rows
// (id % buckets == blockIdx.y); per chunk of tokens its first warp lists the tokens of its bucket
// in token order and its threads (one per column) add those rows. Every (row, column) element is
// thus updated by exactly one thread, in token order: bitwise the same for any bucket count or
// device. dtable is in acc_dtype(dout) (acc_t<T>: fp32 for 16-bit activations), so each add rounds
// once, in fp32 (double for f64), as a sequence of += would.
//
// Ids live on the device and are never read by the host, so the InputError of the CPU op (an id
// outside [0, V)) cannot be raised here: the data loader validates ids on the host. As a guard the
// forward writes NaN into the output row of an out-of-range id (it then shows up as a non-finite
// loss instead of reading out of bounds) and the backward skips it.
#include <algorithm>
#include <cmath>
#include <string>

#include "common/embedding_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "moe/ops/embedding.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;        // forward
constexpr int kMaxBlocks = 1 << 16;  // forward grid cap (grid-stride)
constexpr int kColumns = 128;        // backward: columns per block (one thread each)
constexpr int kIdChunk = 4096;       // backward: ids staged in shared memory per step
constexpr int kGroup = 16;           // backward: list entries added at once (distinct ids)
constexpr int kTargetBlocks = 1024;  // backward: column blocks x buckets aimed at

// ---- kernels ------------------------------------------------------------------------------------

template <class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* ids, const T* table, int64_t n,
                                         int64_t d, int64_t vocab) {
  const int64_t total = n * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / d, col = i - row * d;
    const int32_t id = ids[row];
    out[i] = (id >= 0 && id < vocab) ? table[id * d + col] : store<T>(acc_t<T>(NAN));
  }
}

// grid (ceil(d / kColumns), buckets), block kColumns. Per chunk of kIdChunk tokens, the block
// stages the chunk's ids in shared memory (every thread loads a share at once), its first warp
// lists the chunk's tokens whose id is in this block's bucket (in token order, by ballots), then
// every thread adds those rows for its column: each id is tested once per block instead of once
// per thread (with 64 buckets, 63 of 64 tests found nothing).
// The adds go kGroup list entries at a time when their ids are pairwise distinct (then no two of
// them touch the same dtable element, and loading all of them before any store changes no bit);
// an entry whose id repeats within its group is added alone, in order. One entry at a time, each
// add waited for the previous one's store (the compiler cannot know the ids differ): ~256 L2
// round trips in a row per block at moe-small's shape, 320 us a step.
template <class T>
__global__ void embedding_backward_kernel(acc_t<T>* dtable, const T* dout, const int32_t* ids,
                                          int64_t n, int64_t d, int64_t vocab) {
  using A = acc_t<T>;
  __shared__ int32_t chunk_id[kIdChunk];  // the chunk's ids
  __shared__ int32_t list_tok[kIdChunk];  // token positions in the chunk, in token order
  __shared__ int list_len;
  const int64_t col = blockIdx.x * int64_t(kColumns) + threadIdx.x;
  const int buckets = static_cast<int>(gridDim.y), bucket = static_cast<int>(blockIdx.y);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int64_t c0 = 0; c0 < n; c0 += kIdChunk) {
    const int64_t left = n - c0;
    const int count = left < kIdChunk ? static_cast<int>(left) : kIdChunk;
    __syncthreads();  // the previous chunk's list is consumed
    for (int i = threadIdx.x; i < count; i += kColumns) chunk_id[i] = ids[c0 + i];
    __syncthreads();
    if (threadIdx.x < 32) {
      int found = 0;
      for (int i0 = 0; i0 < count; i0 += 32) {
        const int i = i0 + lane;
        const int32_t id = i < count ? chunk_id[i] : -1;
        const bool mine = id >= 0 && id < vocab && id % buckets == bucket;
        const unsigned hits = __ballot_sync(0xffffffffu, mine);
        if (mine) list_tok[found + __popc(hits & ((1u << lane) - 1u))] = i;
        found += __popc(hits);
      }
      if (lane == 0) list_len = found;
    }
    __syncthreads();
    if (col >= d) continue;
    const int len = list_len;
    for (int j = 0; j < len;) {  // token order
      if (j + kGroup <= len) {
        int32_t tok[kGroup], id[kGroup];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          tok[u] = list_tok[j + u];
          id[u] = chunk_id[tok[u]];
        }
        bool distinct = true;
#pragma unroll
        for (int u = 1; u < kGroup; ++u)
#pragma unroll
          for (int v = 0; v < u; ++v) distinct &= id[u] != id[v];
        if (distinct) {  // the same for every thread of the block
          A sum[kGroup];
#pragma unroll
          for (int u = 0; u < kGroup; ++u)
            sum[u] = dtable[id[u] * d + col] + load(dout[(c0 + tok[u]) * d + col]);
#pragma unroll
          for (int u = 0; u < kGroup; ++u) dtable[id[u] * d + col] = sum[u];
          j += kGroup;
          continue;
        }
      }
      const int32_t tok = list_tok[j];
      dtable[chunk_id[tok] * d + col] += load(dout[(c0 + tok) * d + col]);
      ++j;
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------

// out: [N, d], ids: [N], table: [V, d]
void embedding_forward_cuda(Ctx& ctx, Tensor out, Tensor ids, Tensor table) {
  check_embedding_forward_args(out, ids, table);
  const int64_t vocab = table.size(0), d = table.size(1), n = ids.numel();
  check_embedding_ids_args(ids, n, "embedding_forward");
  if (n * d == 0) return;
  dispatch_storage(table.dtype, "embedding_forward", [&](auto zero) {
    using T = decltype(zero);
    const unsigned grid =
        static_cast<unsigned>(std::min<int64_t>(blocks_for(n * d, kThreads), kMaxBlocks));
    embedding_forward_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(out), data_of<int32_t>(ids), data_of<T>(table), n, d, vocab);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// dtable: [V, d] (+=), dout: [N, d], ids: [N]
void embedding_backward_cuda(Ctx& ctx, Tensor dtable, Tensor dout, Tensor ids) {
  check_embedding_backward_args(dtable, dout, ids);
  const int64_t vocab = dtable.size(0), d = dtable.size(1), n = ids.numel();
  check_embedding_ids_args(ids, n, "embedding_backward");
  if (n * d == 0 || vocab == 0) return;
  const int64_t column_blocks = blocks_for(d, kColumns);
  MOE_CHECK(column_blocks <= 0x7fffffff, "embedding_backward: d too large");
  const int64_t buckets =
      std::max<int64_t>(1, std::min({int64_t{kTargetBlocks} / column_blocks, vocab, int64_t{64}}));
  dispatch_storage(dout.dtype, "embedding_backward", [&](auto zero) {
    using T = decltype(zero);
    const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(buckets));
    embedding_backward_kernel<T><<<grid, kColumns, 0, stream_of(ctx)>>>(
        data_of<acc_t<T>>(dtable), data_of<T>(dout), data_of<int32_t>(ids), n, d, vocab);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(embedding_forward, &cuda_detail::embedding_forward_cuda);
MOE_REGISTER_CUDA_OP(embedding_backward, &cuda_detail::embedding_backward_cuda);
}  // namespace moe
