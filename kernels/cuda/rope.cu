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
// rope_forward / rope_backward work in place, one thread per (row, head, pair j): the thread reads
// both elements of its pair before writing them, so no two threads touch the same element. The
// rotation runs in fp32 (double for f64) on the table values. Positions are read on the device
// only; the CPU op's InternalError for a position outside [0, P) cannot be raised without a host
// read, so such a row is overwritten with NaN instead (a caller bug made loud, never an
// out-of-bounds read).
#include <algorithm>
#include <cmath>
#include <string>

#include "common/rope_checks.hpp"
#include "cuda/cuda_common.cuh"
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

// x: [N, H, 2*half] in place; sign +1 rotates forward, -1 back.
template <class T>
__global__ void rope_rotate_kernel(T* x, const int32_t* pos, const acc_t<T>* cos_t,
                                   const acc_t<T>* sin_t, int64_t n, int64_t heads, int64_t half,
                                   int64_t max_pos, acc_t<T> sign) {
  using A = acc_t<T>;
  const int64_t total = n * heads * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t vec = i / half, j = i - vec * half;  // vec = row * heads + head
    const int64_t row = vec / heads;
    T* v = x + vec * 2 * half;
    const int32_t p = pos[row];
    if (p < 0 || p >= max_pos) {
      v[j] = v[j + half] = store<T>(A(NAN));
      continue;
    }
    const A c = cos_t[p * half + j], s = sign * sin_t[p * half + j];
    const A a = load(v[j]), b = load(v[j + half]);
    v[j] = store<T>(a * c - b * s);
    v[j + half] = store<T>(b * c + a * s);
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
    rope_rotate_kernel<T><<<grid_for(total), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(x), data_of<int32_t>(pos), data_of<acc_t<T>>(cos_t), data_of<acc_t<T>>(sin_t), n,
        heads, half, max_pos, static_cast<acc_t<T>>(sign));
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
