// AdamW on CUDA over one contiguous segment of the parameter buffer: the elementwise update of
// include/moe/ops/optim.hpp, exactly as the CPU op writes it,
//   g' = grad_scale g;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
//   p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay p_old)
// with decoupled weight decay on the pre-update parameter. The bias corrections are computed once
// on the host in double; the per-element math is fp32 for f32/f16/bf16 storage (the trainer keeps
// f32 master weights and moments) and double for f64. A grid-stride loop over int64 indices, so
// any segment length works with a bounded grid; each element is read and written by one thread.
//
// With AdamWArgs::norm_sq (a device f64 scalar, the sum of squares of the whole gradient) every
// thread reads it before its loop and derives the gradient scale with common/adamw_scale.hpp, in
// double, as the CPU op does: a non-finite norm makes every thread return at once (the step is
// skipped, p, m and v untouched), a norm over max_norm scales g by max_norm / (norm + 1e-6). The
// trainer so clips and skips overflowed fp16 steps without a device-to-host read. One double load
// (cached) and one sqrt and division per thread, negligible beside the loop.
//
// With AdamWArgs::compute_out the thread that stores p[i] also stores compute_out[i], the stored
// p[i] converted by the convert op's own element conversion (cuda/convert_element.cuh): the bits
// of a convert after the step without its second pass over the weights (the convert's read of
// the fp32 p and its launch are saved; its 2-byte bf16 write moves here). Without compute_out
// the kernel does what it did before (D = void). A skipped step returns before either store.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/optim_checks.hpp"
#include "cuda/adam_element.cuh"
#include "cuda/block_sum.cuh"
#include "cuda/convert_element.cuh"
#include "cuda/cuda_common.cuh"
#include "moe/ops/optim.hpp"

namespace moe::cuda_detail::optim_impl {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

// AdamWArgs::grad_sq_out (kNorm kernels): each thread sums the squares of the gradients it
// reads, in double (exact for f32 / f16 / bf16 values), each block writes its sum to partial[b]
// and a one-block pass adds them in block order into grad_sq_out[0]: deterministic for a shape,
// and no pass over g of its own. The grid is one wave of resident blocks (one_wave): a capped
// grid of several waves left its last, partial wave running on few SMs (7% slower measured).
constexpr int64_t kNormBlocks = 4096;

template <class T>
__device__ __forceinline__ double square_d(T x) {
  const double d = static_cast<double>(load(x));
  return d * d;
}
__device__ __forceinline__ double square_d(const float4& q) {
  return square_d(q.x) + square_d(q.y) + square_d(q.z) + square_d(q.w);
}

// Thread 0 of the block stores the block's sum of `sq` (every thread must call it).
template <bool kNorm>
__device__ __forceinline__ void store_block_norm(double sq, double* partial) {
  if constexpr (kNorm) {
    sq = block_sum_to_thread0(sq);
    if (threadIdx.x == 0) partial[blockIdx.x] = sq;
  }
}

// D: the storage type of the compute-copy output `out`, void when there is none.
template <class T, class D, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                 D* __restrict__ out, int64_t n, AdamConsts<acc_t<T>> c, double* partial) {
  acc_t<T> grad_scale;
  if (!step_scale(c, &grad_scale)) return;  // skipped step (never with kNorm: no norm_sq)
  double sq = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    T mi = m[i], vi = v[i];
    if constexpr (kNorm) sq += square_d(g[i]);
    const T pn = adam_element(p[i], g[i], mi, vi, grad_scale, c);
    p[i] = pn;
    if constexpr (!std::is_void_v<D>) out[i] = convert_element<D>(pn);
    m[i] = mi;
    v[i] = vi;
  }
  store_block_norm<kNorm>(sq, partial);
}

// Four elements of D stored at once (8 bytes for bf16 / f16, 16 for f32).
template <class D>
struct alignas(4 * sizeof(D)) Quad {
  using elem = D;
  D x[4];
};
template <class D>
struct QuadOf {
  using type = Quad<D>;
};
template <>
struct QuadOf<void> {
  using type = void;
};

// f32 storage with every array 16-byte aligned: four elements per thread and iteration, in
// float4 loads and stores. The update is memory-bound (28 bytes per element, 30 with the bf16
// copy); the scalar loop kept fewer bytes in flight per thread and reached ~3.4 TB/s on an H200.
// The n % 4 tail is left to the scalar kernel.
// Q: Quad<D> of the compute-copy output, void when there is none.
template <class Q, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel_f32x4(float4* __restrict__ p, const float4* __restrict__ g, float4* __restrict__ m,
                       float4* __restrict__ v, Q* __restrict__ out, int64_t quads,
                       AdamConsts<float> c, double* partial) {
  float grad_scale;
  if (!step_scale(c, &grad_scale)) return;
  double sq = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += stride) {
    float4 pq = p[i], mq = m[i], vq = v[i];
    const float4 gq = g[i];
    if constexpr (kNorm) sq += square_d(gq);
    pq.x = adam_element(pq.x, gq.x, mq.x, vq.x, grad_scale, c);
    pq.y = adam_element(pq.y, gq.y, mq.y, vq.y, grad_scale, c);
    pq.z = adam_element(pq.z, gq.z, mq.z, vq.z, grad_scale, c);
    pq.w = adam_element(pq.w, gq.w, mq.w, vq.w, grad_scale, c);
    p[i] = pq;
    m[i] = mq;
    v[i] = vq;
    if constexpr (!std::is_void_v<Q>) {
      using D = typename Q::elem;
      out[i] = Q{{convert_element<D>(pq.x), convert_element<D>(pq.y), convert_element<D>(pq.z),
                  convert_element<D>(pq.w)}};
    }
  }
  store_block_norm<kNorm>(sq, partial);
}

bool aligned_to(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// The gradient-norm partials: not sum_squares's, as the update may run on another stream while
// the op stream reduces.
struct NormPartials;
double* norm_scratch() {
  return partials_scratch<NormPartials, kNormBlocks>();
}

// The blocks of Kernel the device holds at once (at most `blocks`, kNormBlocks): the norm
// kernels' grid, so that every block loops over an equal share.
template <auto Kernel>
int64_t one_wave(int64_t blocks) {
  static const int per_sm = [] {
    int n = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0));
    return std::max(n, 1);
  }();
  return std::min<int64_t>({blocks, int64_t(per_sm) * device_sm_count(), kNormBlocks});
}

// Launches the kernel without a norm over `blocks` blocks, or with it over `norm_blocks`
// (one_wave of its kNorm instance) and adds the partials into a.grad_sq_out[0].
// launch(kNorm tag, grid, partial) queues the kernel.
template <class Launch>
void with_norm(Ctx& ctx, const AdamWArgs& a, int64_t blocks, int64_t norm_blocks, Launch launch) {
  if (a.grad_sq_out.empty()) {
    launch(std::false_type{}, blocks, static_cast<double*>(nullptr));
    return;
  }
  double* partial = norm_scratch();
  launch(std::true_type{}, norm_blocks, partial);
  sum_partials_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(data_of<double>(a.grad_sq_out), partial,
                                                          static_cast<int>(norm_blocks), 1.0);
  MOE_CUDA_LAUNCH_CHECK();
}

void adamw_step_cuda(Ctx& ctx, Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a) {
  const int64_t n = p.numel();
  check_adamw_step_args(p, g, m, v, a);
  check_on_gpu({&p, &g, &m, &v}, "adamw_step");  // compute_out: on p's device (checked above)
  if (n == 0) return;
  const int64_t blocks = std::min((n + kThreads - 1) / kThreads, kMaxBlocks);
  dispatch_storage(p.dtype, "adamw_step", [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const AdamConsts<A> c = adam_consts<A>(a);
    auto launch = [&](auto* out) {
      using D = std::remove_pointer_t<decltype(out)>;
      T *pp = data_of<T>(p), *gp = data_of<T>(g), *mp = data_of<T>(m), *vp = data_of<T>(v);
      int64_t done = 0;
      if constexpr (std::is_same_v<T, float>) {
        using Q = typename QuadOf<D>::type;
        bool out_ok = true;
        if constexpr (!std::is_void_v<D>) out_ok = aligned_to(out, sizeof(Q));
        if (out_ok && aligned_to(pp, 16) && aligned_to(gp, 16) && aligned_to(mp, 16) &&
            aligned_to(vp, 16) && n >= 4) {
          const int64_t quads = n / 4;
          const int64_t qblocks = std::min((quads + kThreads - 1) / kThreads, kMaxBlocks);
          const int64_t nblocks = one_wave<adamw_kernel_f32x4<Q, true>>(qblocks);
          with_norm(ctx, a, qblocks, nblocks, [&](auto norm, int64_t grid, double* partial) {
            adamw_kernel_f32x4<Q, decltype(norm)::value>
                <<<static_cast<unsigned>(grid), kThreads, 0, stream_of(ctx)>>>(
                    reinterpret_cast<float4*>(pp), reinterpret_cast<const float4*>(gp),
                    reinterpret_cast<float4*>(mp), reinterpret_cast<float4*>(vp),
                    reinterpret_cast<Q*>(out), quads, c, partial);
            MOE_CUDA_LAUNCH_CHECK();
          });
          done = quads * 4;
        }
      }
      if (done == n) return;
      D* rest = nullptr;
      if constexpr (!std::is_void_v<D>) rest = out + done;
      const int64_t nblocks = one_wave<adamw_kernel<T, D, true>>(blocks);
      with_norm(ctx, a, blocks, nblocks, [&](auto norm, int64_t grid, double* partial) {
        adamw_kernel<T, D, decltype(norm)::value>
            <<<static_cast<unsigned>(grid), kThreads, 0, stream_of(ctx)>>>(
                pp + done, gp + done, mp + done, vp + done, rest, n - done, c, partial);
        MOE_CUDA_LAUNCH_CHECK();
      });
    };
    // compute_out is bf16, f16 or f32 (check_adamw_step_args), or absent.
    if (a.compute_out.empty()) return launch(static_cast<void*>(nullptr));
    if (a.compute_out.dtype == DType::bf16) return launch(data_of<__nv_bfloat16>(a.compute_out));
    if (a.compute_out.dtype == DType::f16) return launch(data_of<__half>(a.compute_out));
    launch(data_of<float>(a.compute_out));
  });
}

// The gradient of the split update: f32, or bf16 for the experts' stacks under
// train.bf16_expert_grads (2 of the 28 bytes an element moves). GradQuad<G>: four of them in
// one load (16 bytes f32, 8 bf16), widened by as_float4.
template <class G>
using GradQuad = std::conditional_t<std::is_same_v<G, float>, float4, Quad<G>>;
__device__ __forceinline__ float4 as_float4(const float4& q) {
  return q;
}
__device__ __forceinline__ float4 as_float4(const Quad<__nv_bfloat16>& q) {
  return make_float4(load(q.x[0]), load(q.x[1]), load(q.x[2]), load(q.x[3]));
}

template <class G, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    adamw_split_kernel(uint16_t* __restrict__ hi, uint16_t* __restrict__ lo,
                       const G* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                       int64_t n, AdamConsts<float> c, double* partial) {
  float grad_scale;
  if (!step_scale(c, &grad_scale)) return;
  double sq = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    uint16_t h = hi[i], l = lo[i];
    float mi = m[i], vi = v[i];
    const float gi = load(g[i]);
    if constexpr (kNorm) sq += square_d(gi);
    adam_split_element(h, l, gi, mi, vi, grad_scale, c);
    hi[i] = h;
    lo[i] = l;
    m[i] = mi;
    v[i] = vi;
  }
  store_block_norm<kNorm>(sq, partial);
}

// Two quads per thread and iteration, both loaded before either is updated (128 bytes in flight
// per thread). Each element still goes through adam_split_element once: the same bits for any
// grid.
template <class G, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    adamw_split_kernel_x4(ushort4* __restrict__ hi, ushort4* __restrict__ lo,
                          const GradQuad<G>* __restrict__ g, float4* __restrict__ m,
                          float4* __restrict__ v, int64_t quads, AdamConsts<float> c,
                          double* partial) {
  float grad_scale;
  if (!step_scale(c, &grad_scale)) return;
  double sq = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + stride < quads; i += 2 * stride) {
    const int64_t j = i + stride;
    ushort4 h0 = hi[i], l0 = lo[i], h1 = hi[j], l1 = lo[j];
    float4 m0 = m[i], v0 = v[i], m1 = m[j], v1 = v[j];
    const float4 g0 = as_float4(g[i]), g1 = as_float4(g[j]);
    if constexpr (kNorm) sq += square_d(g0) + square_d(g1);
    adam_split_quad(h0, l0, g0, m0, v0, grad_scale, c);
    adam_split_quad(h1, l1, g1, m1, v1, grad_scale, c);
    hi[i] = h0, lo[i] = l0, m[i] = m0, v[i] = v0;
    hi[j] = h1, lo[j] = l1, m[j] = m1, v[j] = v1;
  }
  if (i < quads) {
    ushort4 h = hi[i], l = lo[i];
    float4 mq = m[i], vq = v[i];
    const float4 gq = as_float4(g[i]);
    if constexpr (kNorm) sq += square_d(gq);
    adam_split_quad(h, l, gq, mq, vq, grad_scale, c);
    hi[i] = h, lo[i] = l, m[i] = mq, v[i] = vq;
  }
  store_block_norm<kNorm>(sq, partial);
}

template <class G>
void launch_adamw_split(Ctx& ctx, uint16_t* hp, uint16_t* lp, const G* gp, float* mp, float* vp,
                        int64_t n, const AdamWArgs& a) {
  using GQ = GradQuad<G>;
  const AdamConsts<float> c = adam_consts<float>(a);
  int64_t done = 0;
  if (aligned_to(hp, 8) && aligned_to(lp, 8) && aligned_to(gp, sizeof(GQ)) && aligned_to(mp, 16) &&
      aligned_to(vp, 16) && n >= 4) {
    const int64_t quads = n / 4;
    const int64_t blocks = std::min((quads + 2 * kThreads - 1) / (2 * kThreads), kMaxBlocks);
    with_norm(ctx, a, blocks, one_wave<adamw_split_kernel_x4<G, true>>(blocks),
              [&](auto norm, int64_t grid, double* partial) {
                adamw_split_kernel_x4<G, decltype(norm)::value>
                    <<<static_cast<unsigned>(grid), kThreads, 0, stream_of(ctx)>>>(
                        reinterpret_cast<ushort4*>(hp), reinterpret_cast<ushort4*>(lp),
                        reinterpret_cast<const GQ*>(gp), reinterpret_cast<float4*>(mp),
                        reinterpret_cast<float4*>(vp), quads, c, partial);
                MOE_CUDA_LAUNCH_CHECK();
              });
    done = quads * 4;
  }
  if (done == n) return;
  const int64_t blocks = std::min((n - done + kThreads - 1) / kThreads, kMaxBlocks);
  with_norm(ctx, a, blocks, one_wave<adamw_split_kernel<G, true>>(blocks),
            [&](auto norm, int64_t grid, double* partial) {
              adamw_split_kernel<G, decltype(norm)::value>
                  <<<static_cast<unsigned>(grid), kThreads, 0, stream_of(ctx)>>>(
                      hp + done, lp + done, gp + done, mp + done, vp + done, n - done, c, partial);
              MOE_CUDA_LAUNCH_CHECK();
            });
}

void adamw_step_split_cuda(Ctx& ctx, Tensor hi, Tensor lo, Tensor g, Tensor m, Tensor v,
                           const AdamWArgs& a) {
  check_adamw_step_split_args(hi, lo, g, m, v, a);
  check_on_gpu({&hi, &lo, &g, &m, &v}, "adamw_step_split");
  const int64_t n = hi.numel();
  if (n == 0) return;
  auto* hp = data_of<uint16_t>(hi);
  auto* lp = data_of<uint16_t>(lo);
  float *mp = data_of<float>(m), *vp = data_of<float>(v);
  if (g.dtype == DType::bf16)  // train.bf16_expert_grads (check_adamw_step_split_args)
    launch_adamw_split(ctx, hp, lp, data_of<__nv_bfloat16>(g), mp, vp, n, a);
  else
    launch_adamw_split(ctx, hp, lp, data_of<float>(g), mp, vp, n, a);
}

__global__ void __launch_bounds__(kThreads)
    split_decode_kernel(float* __restrict__ out, const uint16_t* __restrict__ hi,
                        const uint16_t* __restrict__ lo, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = split_master_decode_one(hi[i], lo[i]);
}

void split_master_decode_cuda(Ctx& ctx, Tensor master, Tensor hi, Tensor lo) {
  check_split_master_args(hi, lo, {&master}, "split_master_decode");
  check_on_gpu({&master, &hi, &lo}, "split_master_decode");
  const int64_t n = hi.numel();
  if (n == 0) return;
  const int64_t blocks = std::min((n + kThreads - 1) / kThreads, kMaxBlocks);
  split_decode_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream_of(ctx)>>>(
      data_of<float>(master), data_of<uint16_t>(hi), data_of<uint16_t>(lo), n);
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace moe::cuda_detail::optim_impl

MOE_REGISTER_CUDA_OP(adamw_step, &::moe::cuda_detail::optim_impl::adamw_step_cuda);
MOE_REGISTER_CUDA_OP(adamw_step_split, &::moe::cuda_detail::optim_impl::adamw_step_split_cuda);
MOE_REGISTER_CUDA_OP(split_master_decode,
                     &::moe::cuda_detail::optim_impl::split_master_decode_cuda);
