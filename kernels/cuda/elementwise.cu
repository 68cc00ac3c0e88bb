// Elementwise CUDA ops over whole tensors: fill, copy, add, axpy, scale, the sum of squares behind
// global gradient-norm clipping, the scaled sum that keeps loss sums on the device, and the dtype
// conversion of mixed precision. Tensors are flat arrays of numel() elements; every kernel is a
// grid-stride loop that loads in fp32 (double for f64), computes, and rounds once on store, so
// f16/bf16 results are the correctly rounded fp32 result. copy is a stream-ordered device memcpy.
//
// convert (dst = or += src in another dtype) computes in float, or in double when either side is
// f64, and rounds once into dst's dtype, exactly as the CPU op (kernels/cpu/elementwise.cpp): a
// double goes to f16 / bf16 through a float rounded "to odd" (toward zero, last bit set when
// inexact; see kernels/common/float16.hpp), never through a float rounded to nearest, which could
// round twice. Both backends give the same bits.
//
// sum_squares (out[0] += sum x^2, out an f64 device scalar) and accumulate_sum (out[0] += scale *
// sum x) share one deterministic two-pass reduction
// in double: pass 1 runs a grid whose size depends only on numel (never on the device), each block
// sums a fixed grid-stride subset and reduces it in a fixed tree into one partial; pass 2 is a
// single block that adds the partials in a fixed tree and adds the total into out. The partials
// live in a per-device scratch of kMaxPartials doubles allocated once per process (the only
// cudaMalloc of these ops). Its use is ordered by the op's stream; ops of one device share one
// stream (moe::gpu::default_stream), so concurrent calls on different streams of one device would
// race on it and are not supported.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "common/elementwise_checks.hpp"
#include "cuda/block_sum.cuh"
#include "cuda/convert_element.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
#include "moe/ops/elementwise.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPartials = 1024;   // pass-1 blocks of sum_squares (= scratch doubles)
constexpr int kReduceThreads = 256;  // threads of both sum_squares passes

// ---- kernels ------------------------------------------------------------------------------------

template <class T>
__global__ void fill_kernel(T* x, int64_t n, acc_t<T> value) {
  const T v = store<T>(value);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = v;
}

// out may alias a or b: each element is read before it is written, by the same thread.
template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n, bool vec) {
  grid_elements<T>(
      n, vec,
      [&](int64_t i) {
        const Vec16<T> va = load16(a + i), vb = load16(b + i);
        Vec16<T> o;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) o.v[j] = store<T>(load(va.v[j]) + load(vb.v[j]));
        store16(out + i, o);
      },
      [&](int64_t i) { out[i] = store<T>(load(a[i]) + load(b[i])); });
}

template <class T>
__global__ void axpy_kernel(T* y, const T* x, int64_t n, acc_t<T> alpha) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = store<T>(load(y[i]) + alpha * load(x[i]));
}

template <class T>
__global__ void scale_kernel(T* x, int64_t n, acc_t<T> alpha) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = store<T>(load(x[i]) * alpha);
}

// Pass 1: partial[b] = sum of x[i]^2 (kSquare) or x[i] over the grid-stride subset of block b.
// Squares of f32/f16/bf16 values are exact in double.
template <class T, bool kSquare>
__global__ void sum_partial_kernel(double* partial, const T* x, int64_t n) {
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = static_cast<double>(load(x[i]));
    s += kSquare ? v * v : v;
  }
  s = block_sum_to_thread0(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// ---- convert ------------------------------------------------------------------------------------

// dst[i] = src[i] (or dst[i] + src[i]) converted; W is double when either side is, else float.
// (The element conversion itself: cuda/convert_element.cuh, shared with the AdamW kernel.) With
// `vec` (both pointers 16-byte aligned) a thread takes groups of kConvertGroup elements in whole
// 16-byte loads and stores (16 bytes of a 16-bit side, 32 of an f32 one), then the tail one by
// one: the scalar loop moved 2-4 bytes per thread per step, about half the copy bandwidth.
constexpr int kConvertGroup = 8;

template <class T>
__device__ __forceinline__ void load_group(const T* p, T (&out)[kConvertGroup]) {
#pragma unroll
  for (int v = 0; v < kConvertGroup / kVec<T>; ++v)
    reinterpret_cast<uint4*>(out)[v] = reinterpret_cast<const uint4*>(p)[v];
}

template <class T>
__device__ __forceinline__ void store_group(T* p, const T (&in)[kConvertGroup]) {
#pragma unroll
  for (int v = 0; v < kConvertGroup / kVec<T>; ++v)
    reinterpret_cast<uint4*>(p)[v] = reinterpret_cast<const uint4*>(in)[v];
}

// dst = src (or dst + src) converted, one element.
template <class D, class S, bool kAccumulate>
__device__ __forceinline__ void convert_one(D& dst, S src) {
  using W = convert_math_t<D, S>;
  if constexpr (kAccumulate)
    dst = narrow<D, W>(static_cast<W>(load(src)) + static_cast<W>(load(dst)));
  else
    dst = convert_element<D>(src);
}

template <class D, class S, bool kAccumulate>
__global__ void convert_kernel(D* dst, const S* src, int64_t n, bool vec) {
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t first_scalar = 0;
  if (vec) {
    const int64_t groups = n / kConvertGroup;
    for (int64_t g = tid; g < groups; g += stride) {
      alignas(16) S s[kConvertGroup];
      alignas(16) D d[kConvertGroup];
      load_group(src + g * kConvertGroup, s);
      if constexpr (kAccumulate) load_group(dst + g * kConvertGroup, d);
#pragma unroll
      for (int j = 0; j < kConvertGroup; ++j) convert_one<D, S, kAccumulate>(d[j], s[j]);
      store_group(dst + g * kConvertGroup, d);
    }
    first_scalar = groups * kConvertGroup;
  }
  for (int64_t i = first_scalar + tid; i < n; i += stride)
    convert_one<D, S, kAccumulate>(dst[i], src[i]);
}

// ---- host side ----------------------------------------------------------------------------------

unsigned grid_for(int64_t items) {
  return grid_stride_blocks(items, kThreads);
}

// The sum_squares / accumulate_sum partials.
struct SumPartials;
double* sum_squares_scratch() {
  return partials_scratch<SumPartials, kMaxPartials>();
}

void fill_cuda(Ctx& ctx, Tensor x, double value) {
  const int64_t n = x.numel();
  if (n == 0) return;
  // +0 is all zero bits in every float dtype: the driver's memset writes whole lines (the
  // gradients' zeroing; the element loop stores 2-4 bytes per thread per step).
  if (value == 0 && !std::signbit(value)) {
    MOE_CUDA_CHECK(cudaMemsetAsync(x.data, 0, x.nbytes(), stream_of(ctx)));
    return;
  }
  dispatch_storage(x.dtype, "fill", [&](auto zero) {
    using T = decltype(zero);
    fill_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(data_of<T>(x), n,
                                                                 static_cast<acc_t<T>>(value));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void copy_cuda(Ctx& ctx, Tensor dst, Tensor src) {
  check_numel(dst, src, "copy: dst, src");
  if (dst.data == src.data || dst.numel() == 0) return;
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

void add_cuda(Ctx& ctx, Tensor out, Tensor a, Tensor b) {
  check_numel(out, a, "add: out, a");
  check_numel(out, b, "add: out, b");
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_storage(out.dtype, "add", [&](auto zero) {
    using T = decltype(zero);
    const bool vec = aligned16({out.data, a.data, b.data});
    add_kernel<T><<<grid_for(element_items<T>(n, vec)), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(out), data_of<T>(a), data_of<T>(b), n, vec);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void axpy_cuda(Ctx& ctx, Tensor y, Tensor x, double alpha) {
  check_numel(y, x, "axpy: y, x");
  const int64_t n = y.numel();
  if (n == 0) return;
  dispatch_storage(y.dtype, "axpy", [&](auto zero) {
    using T = decltype(zero);
    axpy_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(data_of<T>(y), data_of<T>(x), n,
                                                                 static_cast<acc_t<T>>(alpha));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

void scale_cuda(Ctx& ctx, Tensor x, double alpha) {
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype, "scale", [&](auto zero) {
    using T = decltype(zero);
    scale_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(data_of<T>(x), n,
                                                                  static_cast<acc_t<T>>(alpha));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// out[0] += scale * sum of x^2 (kSquare) or of x, by the two-pass reduction.
template <bool kSquare>
void reduce_into(Ctx& ctx, Tensor out, Tensor x, double scale, const char* op) {
  const int64_t n = x.numel();
  if (n == 0) return;  // out[0] += 0
  // Grid from numel alone (4 elements per thread before the grid is capped): the summation order,
  // hence the result, is the same on every device.
  const int blocks =
      static_cast<int>(std::min<int64_t>(blocks_for(n, kReduceThreads * 4), kMaxPartials));
  double* partial = sum_squares_scratch();
  dispatch_storage(x.dtype, op, [&](auto zero) {
    using T = decltype(zero);
    sum_partial_kernel<T, kSquare>
        <<<blocks, kReduceThreads, 0, stream_of(ctx)>>>(partial, data_of<T>(x), n);
    MOE_CUDA_LAUNCH_CHECK();
  });
  sum_partials_kernel<<<1, kReduceThreads, 0, stream_of(ctx)>>>(static_cast<double*>(out.data),
                                                                partial, blocks, scale);
  MOE_CUDA_LAUNCH_CHECK();
}

void sum_squares_cuda(Ctx& ctx, Tensor out, Tensor x) {
  check_sum_squares_args(out);
  reduce_into<true>(ctx, out, x, 1.0, "sum_squares");
}

void accumulate_sum_cuda(Ctx& ctx, Tensor out, Tensor x, double scale) {
  check_accumulate_sum_args(out, x);
  check_on_gpu({&out, &x}, "accumulate_sum");
  reduce_into<false>(ctx, out, x, scale, "accumulate_sum");
}

void convert_cuda(Ctx& ctx, Tensor dst, Tensor src, bool accumulate) {
  check_convert_args(dst, src);
  check_on_gpu({&dst, &src}, "convert");
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (!accumulate && dst.dtype == src.dtype) return copy_cuda(ctx, dst, src);  // exact either way
  dispatch_storage(dst.dtype, "convert", [&](auto dst_zero) {
    using D = decltype(dst_zero);
    dispatch_storage(src.dtype, "convert", [&](auto src_zero) {
      using S = decltype(src_zero);
      const bool vec = aligned16({dst.data, src.data});
      // one thread per group on the vector path (the tail's < 8 elements go to the first threads)
      const unsigned grid = grid_for(vec ? (n + kConvertGroup - 1) / kConvertGroup : n);
      if (accumulate)
        convert_kernel<D, S, true>
            <<<grid, kThreads, 0, stream_of(ctx)>>>(data_of<D>(dst), data_of<S>(src), n, vec);
      else
        convert_kernel<D, S, false>
            <<<grid, kThreads, 0, stream_of(ctx)>>>(data_of<D>(dst), data_of<S>(src), n, vec);
      MOE_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(fill, &cuda_detail::fill_cuda);
MOE_REGISTER_CUDA_OP(copy, &cuda_detail::copy_cuda);
MOE_REGISTER_CUDA_OP(add, &cuda_detail::add_cuda);
MOE_REGISTER_CUDA_OP(axpy, &cuda_detail::axpy_cuda);
MOE_REGISTER_CUDA_OP(scale, &cuda_detail::scale_cuda);
MOE_REGISTER_CUDA_OP(sum_squares, &cuda_detail::sum_squares_cuda);
MOE_REGISTER_CUDA_OP(accumulate_sum, &cuda_detail::accumulate_sum_cuda);
MOE_REGISTER_CUDA_OP(convert, &cuda_detail::convert_cuda);
}  // namespace moe
