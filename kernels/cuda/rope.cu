// Rotary position embedding on the GPU, Hugging Face "rotate_half" convention: for j < hd/2 the
// pair (x_j, x_{j+hd/2}) at position p turns by the angle p * theta^(-2j/hd):
//   y_j        = x_j cos - x_{j+hd/2} sin
//   y_{j+hd/2} = x_{j+hd/2} cos + x_j sin
// The backward turns by minus the angle (the transpose), so it undoes the forward.
//
// rope_table computes every angle, cos and sin in double and rounds once to the table dtype (as
// the CPU op), one thread per table entry; it runs once per model, so the double math is fine. The
// table is f32 or f64 (acc_dtype of the activations it rotates): 16-bit activations are rotated by
// fp32 cos/sin, not by 16-bit roundings of them.
// rope_forward / rope_backward work in place, one thread per (row, head, chunk of pairs): the
// thread reads both elements of its pairs before writing them, so no two threads touch the same
// element. A chunk is 16 bytes of x (8 pairs of 16-bit, 4 of f32, 2 of f64) where head_dim/2 and
// the pointers allow it, read and written whole (scalar 2-byte accesses 128 bytes apart ran at
// ~30% of the copy bandwidth), else one pair; both paths do the same arithmetic, so they give
// the same bits. The rotation runs in fp32 (double for f64) on the table values. Positions are read
// on the device only; the CPU op's InternalError for a position outside [0, P) cannot be raised
// without a host read, so such a row is overwritten with NaN instead (a caller bug made loud, never
// an out-of-bounds read).
#include <algorithm>
#include <cmath>
#include <string>

#include "common/rope_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "moe/ops/rope.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1 << 16;  // grid cap (grid-stride loops)

// ---- kernels ------------------------------------------------------------------------------------

// cos, sin: [P, half], A = float or double
template <class A>
__global__ void rope_table_kernel(A* cos_t, A* sin_t, int64_t max_pos, int64_t half, double theta) {
  const int64_t total = max_pos * half;
  const double hd = 2.0 * static_cast<double>(half);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / half, j = i - p * half;
    const double angle = static_cast<double>(p) * pow(theta, -2.0 * static_cast<double>(j) / hd);
    cos_t[i] = static_cast<A>(cos(angle));
    sin_t[i] = static_cast<A>(sin(angle));
  }
}

// The rotation of one pair, with its roundings pinned: left to nvcc, the FMA contraction of
// b c + a s depends on the surrounding code (fma(a, s, b c) in the old one-pair kernel,
// fma(b, c, a s) in a four-line test kernel), so the two paths could differ in the last bit.
// These are the roundings of the old kernel's sm_90 SASS (all dtypes): fma(a, c, -(b s)) and
// fma(a, s, b c), each inner product rounded once.
__device__ __forceinline__ void rotate_pair(float a, float b, float c, float s, float& y_lo,
                                            float& y_hi) {
  y_lo = __fmaf_rn(a, c, -__fmul_rn(b, s));
  y_hi = __fmaf_rn(a, s, __fmul_rn(b, c));
}
__device__ __forceinline__ void rotate_pair(double a, double b, double c, double s, double& y_lo,
                                            double& y_hi) {
  y_lo = __fma_rn(a, c, -__dmul_rn(b, s));
  y_hi = __fma_rn(a, s, __dmul_rn(b, c));
}

// x: [N, H, 2*half] in place; sign +1 rotates forward, -1 back. Each thread takes W consecutive
// pairs j .. j+W-1 of one (row, head): with kVector, W = kVec<T> and x[j..], x[j+half..] and
// the table entries are read and written 16 bytes at a time (the caller checks half % W == 0 and
// 16-byte aligned pointers); without, W = 1, element by element. Same arithmetic either way.
template <class T, bool kVector>
__global__ void rope_rotate_kernel(T* __restrict__ x, const int32_t* __restrict__ pos,
                                   const acc_t<T>* __restrict__ cos_t,
                                   const acc_t<T>* __restrict__ sin_t, int64_t n, int64_t heads,
                                   int64_t half, int64_t max_pos, acc_t<T> sign) {
  using A = acc_t<T>;
  constexpr int W = kVector ? kVec<T> : 1;
  constexpr int kTab = kVector ? W / kVec<A> : 0;  // 16-byte table loads per thread (W >= kVec<A>)
  const int64_t chunks = half / W;                 // per head
  const int64_t total = n * heads * chunks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t vec = i / chunks, j = (i - vec * chunks) * W;  // vec = row * heads + head
    const int64_t row = vec / heads;
    T* lo = x + vec * 2 * half + j;
    T* hi = lo + half;
    const int32_t p = pos[row];
    A a[W], b[W], c[W], s[W];
    if (p < 0 || p >= max_pos) {
#pragma unroll
      for (int k = 0; k < W; ++k) a[k] = b[k] = A(NAN);
    } else {
      const A* pc = cos_t + p * half + j;
      const A* ps = sin_t + p * half + j;
      if constexpr (kVector) {
        const Vec16<T> va = load16(lo), vb = load16(hi);
#pragma unroll
        for (int k = 0; k < W; ++k) a[k] = load(va.v[k]), b[k] = load(vb.v[k]);
#pragma unroll
        for (int t = 0; t < kTab; ++t) {
          const Vec16<A> vc = load16(pc + t * kVec<A>), vs = load16(ps + t * kVec<A>);
#pragma unroll
          for (int k = 0; k < kVec<A>; ++k)
            c[t * kVec<A> + k] = vc.v[k], s[t * kVec<A> + k] = vs.v[k];
        }
      } else {
        a[0] = load(lo[0]), b[0] = load(hi[0]), c[0] = pc[0], s[0] = ps[0];
      }
#pragma unroll
      for (int k = 0; k < W; ++k) rotate_pair(a[k], b[k], c[k], sign * s[k], a[k], b[k]);
    }
    // a, b: the new x_j, x_{j+half} (NaN for a position outside the table)
    if constexpr (kVector) {
      Vec16<T> va, vb;
#pragma unroll
      for (int k = 0; k < W; ++k) va.v[k] = store<T>(a[k]), vb.v[k] = store<T>(b[k]);
      store16(lo, va);
      store16(hi, vb);
    } else {
      lo[0] = store<T>(a[0]);
      hi[0] = store<T>(b[0]);
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>(blocks_for(n, kThreads), kMaxBlocks));
}

void rotate(Ctx& ctx, Tensor x, Tensor pos, Tensor cos_t, Tensor sin_t, double sign,
            const char* op) {
  check_rope_rotate_args(x, pos, cos_t, sin_t, op);
  const int64_t n = x.size(0), heads = x.size(1), half = x.size(2) / 2, max_pos = cos_t.size(0);
  const int64_t total = n * heads * half;
  if (total == 0) return;
  dispatch_storage(x.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const auto launch = [&](auto kernel, int64_t width) {
      kernel<<<grid_for(total / width), kThreads, 0, stream_of(ctx)>>>(
          data_of<T>(x), data_of<int32_t>(pos), data_of<A>(cos_t), data_of<A>(sin_t), n, heads,
          half, max_pos, static_cast<A>(sign));
    };
    // 16-byte accesses when every row's chunks start on 16 bytes (x and the table rows).
    if (half % kVec<T> == 0 && aligned16({x.data, cos_t.data, sin_t.data}))
      launch(rope_rotate_kernel<T, true>, kVec<T>);
    else
      launch(rope_rotate_kernel<T, false>, 1);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// cos, sin: [P, hd/2]
void rope_table_cuda(Ctx& ctx, Tensor cos_t, Tensor sin_t, double theta) {
  check_rope_table_args(cos_t, sin_t, theta);
  const int64_t max_pos = cos_t.size(0), half = cos_t.size(1);
  const int64_t total = max_pos * half;
  if (total == 0) return;
  dispatch_acc(cos_t.dtype, "rope_table", [&](auto zero) {
    using A = decltype(zero);
    rope_table_kernel<A><<<grid_for(total), kThreads, 0, stream_of(ctx)>>>(
        data_of<A>(cos_t), data_of<A>(sin_t), max_pos, half, theta);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// x: [N, H, hd] in place, pos: [N]
void rope_forward_cuda(Ctx& ctx, Tensor x, Tensor pos, Tensor cos_t, Tensor sin_t) {
  rotate(ctx, x, pos, cos_t, sin_t, 1.0, "rope_forward");
}

// dx: [N, H, hd] in place, pos: [N]
void rope_backward_cuda(Ctx& ctx, Tensor dx, Tensor pos, Tensor cos_t, Tensor sin_t) {
  rotate(ctx, dx, pos, cos_t, sin_t, -1.0, "rope_backward");
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(rope_table, &cuda_detail::rope_table_cuda);
MOE_REGISTER_CUDA_OP(rope_forward, &cuda_detail::rope_forward_cuda);
MOE_REGISTER_CUDA_OP(rope_backward, &cuda_detail::rope_backward_cuda);
}  // namespace moe
