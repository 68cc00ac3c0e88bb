// SwiGLU and SiLU on the GPU: h = silu(gate) * up, silu(a) = a * sigmoid(a),
// silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a))) (silu.cuh). Elementwise grid-stride loops in
// fp32 (double for f64), one rounding on store. Each thread reads all inputs of an element before
// writing its outputs, so outputs may alias inputs elementwise (e.g. dgate over dh), as on the CPU.
// The MoE experts' weighted SwiGLU scales row r by its routing weight; its backward also reduces
// each row to the weight's gradient, so it runs a warp per row (a fixed shuffle tree: the same
// bits on every run).
#include <algorithm>
#include <string>

#include "common/swiglu_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/silu.cuh"
#include "cuda/vec16.cuh"
#include "cuda/warp_reduce.cuh"
#include "moe/ops/swiglu.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kRowWarps = kThreads / kWarpLanes;  // rows in flight per block (weighted backward)

// ---- kernels ------------------------------------------------------------------------------------

// 16-byte accesses when every pointer allows them (vec16.cuh), scalar otherwise and for the tail.
template <class T>
__global__ void swiglu_forward_kernel(T* h, const T* gate, const T* up, int64_t n, bool vec) {
  grid_elements<T>(
      n, vec,
      [&](int64_t i) {
        const Vec16<T> g = load16(gate + i), u = load16(up + i);
        Vec16<T> o;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) o.v[j] = store<T>(silu(load(g.v[j])) * load(u.v[j]));
        store16(h + i, o);
      },
      [&](int64_t i) { h[i] = store<T>(silu(load(gate[i])) * load(up[i])); });
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dh, const T* gate, const T* up,
                                       int64_t n, bool vec) {
  grid_elements<T>(
      n, vec,
      [&](int64_t i) {
        const Vec16<T> g = load16(gate + i), u = load16(up + i), d = load16(dh + i);
        Vec16<T> dg, du;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) {
          const auto gj = load(g.v[j]), uj = load(u.v[j]), dj = load(d.v[j]);
          dg.v[j] = store<T>(dj * uj * silu_grad(gj));
          du.v[j] = store<T>(dj * silu(gj));
        }
        store16(dgate + i, dg);
        store16(dup + i, du);
      },
      [&](int64_t i) {
        const auto g = load(gate[i]), u = load(up[i]), d = load(dh[i]);
        dgate[i] = store<T>(d * u * silu_grad(g));
        dup[i] = store<T>(d * silu(g));
      });
}

// h = row_w[r] * silu(gate) * up, r = i / f, as round(w * round(silu(g) * u)) in the storage
// dtype: the sm_90 fused epilogue (grouped_wgmma_sm90.cu) rounds silu(g) * u, then scales it by
// the row's weight on its way into the staging buffer, and this is its arithmetic, so both give
// the same bits (for f32 / f64 it is the plain product). The vector path needs f % kVec == 0 (a
// 16-byte chunk inside one row).
template <class T>
__device__ __forceinline__ T weighted_swiglu(T g, T u, acc_t<T> w) {
  return store<T>(load(store<T>(silu(load(g)) * load(u))) * w);
}

template <class T>
__global__ void swiglu_weighted_forward_kernel(T* h, const T* gate, const T* up,
                                               const acc_t<T>* row_w, int64_t n, int64_t f,
                                               bool vec) {
  grid_elements<T>(
      n, vec,
      [&](int64_t i) {
        const Vec16<T> g = load16(gate + i), u = load16(up + i);
        const acc_t<T> w = row_w[i / f];
        Vec16<T> o;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) o.v[j] = weighted_swiglu(g.v[j], u.v[j], w);
        store16(h + i, o);
      },
      [&](int64_t i) { h[i] = weighted_swiglu(gate[i], up[i], row_w[i / f]); });
}

// A warp per row: dgate = w dh up silu'(g), dup = w dh silu(g), drow_w[r] = sum dh silu(g) up
// (lane partials in a fixed order, then the shuffle tree). dgate / dup may alias dh.
template <class T>
__global__ void swiglu_weighted_backward_kernel(T* dgate, T* dup, acc_t<T>* drow_w, const T* dh,
                                                const T* gate, const T* up, const acc_t<T>* row_w,
                                                int64_t rows, int64_t f, bool vec) {
  using A = acc_t<T>;
  const int lane = static_cast<int>(threadIdx.x) % kWarpLanes;
  const int64_t warp = blockIdx.x * int64_t(kRowWarps) + threadIdx.x / kWarpLanes;
  const int64_t warps = int64_t(gridDim.x) * kRowWarps;
  for (int64_t r = warp; r < rows; r += warps) {
    const A w = row_w[r];
    const int64_t base = r * f;
    A dot = 0;
    auto element = [&](A g, A u, A d, T* dg, T* du) {
      const A sg = silu(g), dw = d * w;
      dot += d * (sg * u);
      *dg = store<T>(dw * u * silu_grad(g));
      *du = store<T>(dw * sg);
    };
    if (vec) {
      for (int64_t c = lane * int64_t(kVec<T>); c < f; c += kWarpLanes * int64_t(kVec<T>)) {
        const Vec16<T> g = load16(gate + base + c), u = load16(up + base + c),
                       d = load16(dh + base + c);
        Vec16<T> dg, du;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j)
          element(load(g.v[j]), load(u.v[j]), load(d.v[j]), &dg.v[j], &du.v[j]);
        store16(dgate + base + c, dg);
        store16(dup + base + c, du);
      }
    } else {
      for (int64_t j = base + lane; j < base + f; j += kWarpLanes) {
        const A g = load(gate[j]), u = load(up[j]), d = load(dh[j]);
        element(g, u, d, &dgate[j], &dup[j]);
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) drow_w[r] = dot;
  }
}

template <class T>
__global__ void silu_forward_kernel(T* y, const T* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = store<T>(silu(load(x[i])));
}

template <class T>
__global__ void silu_backward_kernel(T* dx, const T* dy, const T* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dx[i] = store<T>(load(dy[i]) * silu_grad(load(x[i])));
}

// ---- host side ----------------------------------------------------------------------------------

unsigned grid_for(int64_t items) {
  return grid_stride_blocks(items, kThreads);
}

// h, gate, up: [R, F]
void swiglu_forward_cuda(Ctx& ctx, Tensor h, Tensor gate, Tensor up) {
  check_like(gate, {&h, &up}, {"h", "up"}, "swiglu_forward");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_storage(gate.dtype, "swiglu_forward", [&](auto zero) {
    using T = decltype(zero);
    const bool vec = aligned16({h.data, gate.data, up.data});
    swiglu_forward_kernel<T><<<grid_for(element_items<T>(n, vec)), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(h), data_of<T>(gate), data_of<T>(up), n, vec);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// dgate, dup (overwritten), dh, gate, up: [R, F]
void swiglu_backward_cuda(Ctx& ctx, Tensor dgate, Tensor dup, Tensor dh, Tensor gate, Tensor up) {
  check_like(gate, {&dgate, &dup, &dh, &up}, {"dgate", "dup", "dh", "up"}, "swiglu_backward");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_storage(gate.dtype, "swiglu_backward", [&](auto zero) {
    using T = decltype(zero);
    const bool vec = aligned16({dgate.data, dup.data, dh.data, gate.data, up.data});
    swiglu_backward_kernel<T><<<grid_for(element_items<T>(n, vec)), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dgate), data_of<T>(dup), data_of<T>(dh), data_of<T>(gate), data_of<T>(up), n,
        vec);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// h, gate, up: [R, F]; row_w: [R] in acc_dtype
void swiglu_weighted_forward_cuda(Ctx& ctx, Tensor h, Tensor gate, Tensor up, Tensor row_w) {
  const int64_t f = check_swiglu_weighted_args(gate, {&h, &up}, {"h", "up"}, {&row_w}, {"row_w"},
                                               "swiglu_weighted_forward");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_storage(gate.dtype, "swiglu_weighted_forward", [&](auto zero) {
    using T = decltype(zero);
    const bool vec = f % kVec<T> == 0 && aligned16({h.data, gate.data, up.data});
    swiglu_weighted_forward_kernel<T>
        <<<grid_for(element_items<T>(n, vec)), kThreads, 0, stream_of(ctx)>>>(
            data_of<T>(h), data_of<T>(gate), data_of<T>(up), data_of<acc_t<T>>(row_w), n, f, vec);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// dgate, dup (overwritten; may alias dh), dh, gate, up: [R, F]; drow_w (overwritten), row_w: [R]
void swiglu_weighted_backward_cuda(Ctx& ctx, Tensor dgate, Tensor dup, Tensor drow_w, Tensor dh,
                                   Tensor gate, Tensor up, Tensor row_w) {
  const int64_t f = check_swiglu_weighted_args(gate, {&dgate, &dup, &dh, &up},
                                               {"dgate", "dup", "dh", "up"}, {&row_w, &drow_w},
                                               {"row_w", "drow_w"}, "swiglu_weighted_backward");
  const int64_t rows = gate.size(0);
  if (rows == 0) return;
  dispatch_storage(gate.dtype, "swiglu_weighted_backward", [&](auto zero) {
    using T = decltype(zero);
    const unsigned grid = grid_stride_blocks(rows, kRowWarps);
    swiglu_weighted_backward_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dgate), data_of<T>(dup), data_of<acc_t<T>>(drow_w), data_of<T>(dh),
        data_of<T>(gate), data_of<T>(up), data_of<acc_t<T>>(row_w), rows, f,
        f % kVec<T> == 0 && aligned16({dgate.data, dup.data, dh.data, gate.data, up.data}));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// y, x: same shape
void silu_forward_cuda(Ctx& ctx, Tensor y, Tensor x) {
  check_like(x, {&y}, {"y"}, "silu_forward");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype, "silu_forward", [&](auto zero) {
    using T = decltype(zero);
    silu_forward_kernel<T>
        <<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(data_of<T>(y), data_of<T>(x), n);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// dx (overwritten), dy, x: same shape
void silu_backward_cuda(Ctx& ctx, Tensor dx, Tensor dy, Tensor x) {
  check_like(x, {&dx, &dy}, {"dx", "dy"}, "silu_backward");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype, "silu_backward", [&](auto zero) {
    using T = decltype(zero);
    silu_backward_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dx), data_of<T>(dy), data_of<T>(x), n);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(swiglu_forward, &cuda_detail::swiglu_forward_cuda);
MOE_REGISTER_CUDA_OP(swiglu_backward, &cuda_detail::swiglu_backward_cuda);
MOE_REGISTER_CUDA_OP(swiglu_weighted_forward, &cuda_detail::swiglu_weighted_forward_cuda);
MOE_REGISTER_CUDA_OP(swiglu_weighted_backward, &cuda_detail::swiglu_weighted_backward_cuda);
MOE_REGISTER_CUDA_OP(silu_forward, &cuda_detail::silu_forward_cuda);
MOE_REGISTER_CUDA_OP(silu_backward, &cuda_detail::silu_backward_cuda);
}  // namespace moe
