// Shared by the CUDA ops: checked calls, dtype dispatch over float / half / bfloat16 (and double
// for the gradient-check paths), conversions, and op registration.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>

#include "moe/ops/common.hpp"

namespace moe::cuda_detail {

[[noreturn]] void throw_cuda(const char* what, const char* call, const char* file, int line);

}  // namespace moe::cuda_detail

#define MOE_CUDA_CHECK(call)                                                               \
  do {                                                                                     \
    cudaError_t err_ = (call);                                                             \
    if (err_ != cudaSuccess)                                                               \
      ::moe::cuda_detail::throw_cuda(cudaGetErrorString(err_), #call, __FILE__, __LINE__); \
  } while (0)

#define MOE_CUBLAS_CHECK(call)                                                               \
  do {                                                                                       \
    cublasStatus_t st_ = (call);                                                             \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                        \
      ::moe::cuda_detail::throw_cuda(cublasGetStatusString(st_), #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, at the launch site.
#define MOE_CUDA_LAUNCH_CHECK() MOE_CUDA_CHECK(cudaGetLastError())

// Registers a CUDA implementation of op `name` (the slot MOE_OP declared) at static-init time.
#define MOE_REGISTER_CUDA_OP(name, impl) \
  static const bool moe_cuda_registered_##name = (::moe::cuda::name = (impl), true)

namespace moe::cuda_detail {

inline cudaStream_t stream_of(const Ctx& ctx) {
  return static_cast<cudaStream_t>(ctx.stream);
}
inline cublasHandle_t blas_of(const Ctx& ctx) {
  return static_cast<cublasHandle_t>(ctx.blas);
}

// Arithmetic type of a storage type: fp32 for f32/f16/bf16 (fp32 accumulation), double for the
// f64 gradient-check path.
template <class T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <class T>
using acc_t = typename AccOf<T>::type;

template <class T>
__device__ __forceinline__ acc_t<T> load(T v) {
  return static_cast<acc_t<T>>(v);
}
template <>
__device__ __forceinline__ float load(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float load(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <class T>
__device__ __forceinline__ T store(acc_t<T> v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __half store<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 store<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Calls fn(T{}) with T the storage type of `t`: float, double, __half or __nv_bfloat16.
template <class Fn>
void dispatch_storage(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::f32:
      return fn(float{});
    case DType::f64:
      return fn(double{});
    case DType::f16:
      return fn(__half{});
    case DType::bf16:
      return fn(__nv_bfloat16{});
    default:
      throw InternalError(std::string(op) + ": unsupported dtype " + dtype_name(t));
  }
}

// Calls fn(A{}) with A the accumulation type of `t`, which must be an accumulation dtype (f32:
// float, f64: double): tensors that only ever hold statistics or tables (rope tables, counts).
template <class Fn>
void dispatch_acc(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::f32:
      return fn(float{});
    case DType::f64:
      return fn(double{});
    default:
      throw InternalError(std::string(op) + ": expected f32 or f64, got " + dtype_name(t));
  }
}

// The device pointer of t as T*.
template <class T>
T* data_of(const Tensor& t) {
  return static_cast<T*>(t.data);
}

// Throws unless every tensor is on a CUDA device.
inline void check_on_gpu(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts)
    MOE_CHECK(t->device.type == DeviceType::cuda,
              std::string(op) + ": tensor on " + t->device.str() + ", expected a CUDA device");
}

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// The grid of a grid-stride loop whose threads take one work item per pass: a block per
// `threads` items, capped at kGridStrideMaxBlocks (then the threads loop). Size it from the
// items, not the elements, when a thread takes several elements at once (a 16-byte chunk):
// blocks past the last item only start and exit, and a 16M-element bf16 add launched 65,536
// blocks of which 7/8 had nothing to do.
constexpr int64_t kGridStrideMaxBlocks = int64_t{1} << 16;
inline unsigned grid_stride_blocks(int64_t items, int threads) {
  const int64_t blocks = std::max<int64_t>(1, (items + threads - 1) / threads);
  return static_cast<unsigned>(std::min(blocks, kGridStrideMaxBlocks));
}

// Programmatic dependent launch (sm_90; elsewhere they compile to nothing): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start before the kernel queued ahead of
// it ends; it calls wait_primary_grid() before reading what that kernel writes (the whole grid
// done, its writes visible). The kernel ahead may call allow_dependent_launch() to let its
// dependent launch before its own blocks end (only its dependent's early start changes).
__device__ __forceinline__ void wait_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches `kernel` (grid x block threads, no dynamic shared memory) on `stream` as the
// programmatic dependent of the kernel queued ahead of it there (the kernel calls
// wait_primary_grid() first). Returns the launch's error.
template <class... Params, class... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchAttribute after{};
  after.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  after.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  config.attrs = &after;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Streaming multiprocessors of the current device, read once per process (the trainer uses one
// device per process): the size of persistent grids.
inline int device_sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

}  // namespace moe::cuda_detail
