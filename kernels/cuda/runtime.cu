// The CUDA runtime behind include/moe/cuda_runtime.hpp: device discovery, the compiled-arch check,
// memory, and the per-device stream and cuBLAS handle the ops run on.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <string>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "moe/cuda_runtime.hpp"

namespace moe::cuda_detail {

void throw_cuda(const char* what, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error: ") + what + " in " + call + " at " + file +
                           ":" + std::to_string(line));
}

}  // namespace moe::cuda_detail

namespace moe::gpu {

namespace {

__global__ void probe_kernel(int* out) {
  if (out) *out = 1;
}

struct PerDevice {
  cudaStream_t stream = nullptr;
  cudaStream_t side = nullptr;  // side_stream
  cublasHandle_t blas = nullptr;
  void* blas_workspace = nullptr;  // lives as long as the process, like the handle
};

std::vector<PerDevice>& per_device() {
  static std::vector<PerDevice> d(static_cast<size_t>(std::max(device_count(), 0)));
  return d;
}
std::mutex& handles_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

bool built_with_cuda() {
  return true;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: clear the sticky error, report none
    return 0;
  }
  return n;
}

DeviceInfo device_info(int index) {
  cudaDeviceProp p{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  DeviceInfo info;
  info.name = p.name;
  info.major = p.major;
  info.minor = p.minor;
  set_device(index);
  MOE_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

namespace {

// The probe kernel's attributes on device `index`; an error (cleared) when this binary holds no
// code the device can run. has_code_for and code_arch both read it.
cudaError_t probe_attributes(int index, cudaFuncAttributes* attr) {
  set_device(index);
  const cudaError_t err = cudaFuncGetAttributes(attr, probe_kernel);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

}  // namespace

bool has_code_for(int index, std::string* why_not) {
  cudaFuncAttributes attr{};
  const cudaError_t err = probe_attributes(index, &attr);
  if (err == cudaSuccess) return true;
  if (why_not) {
    DeviceInfo info = device_info(index);
    *why_not = "this binary has no code for " + info.name + " (sm_" + std::to_string(info.major) +
               std::to_string(info.minor) +
               "; built for MOE_CUDA_ARCHS=" MOE_CUDA_ARCHS_STR
               "): rebuild with scripts/build.sh --arch sm_" +
               std::to_string(info.major) + std::to_string(info.minor) + " (" +
               cudaGetErrorString(err) + ")";
  }
  return false;
}

int code_arch(int index) {
  cudaFuncAttributes attr{};
  return probe_attributes(index, &attr) == cudaSuccess ? attr.ptxVersion : 0;
}

void set_device(int index) {
  MOE_CUDA_CHECK(cudaSetDevice(index));
}

namespace {
// Bytes held by malloc_device, for the peak the trainer reports (what PyTorch's
// max_memory_allocated counts: allocations, not the CUDA context).
struct Accounting {
  std::mutex mutex;
  std::unordered_map<void*, size_t> sizes;
  size_t live = 0, peak = 0;
  size_t limit = 0;  // 0 = the device's own capacity
};
Accounting& accounting() {
  static Accounting a;
  return a;
}
}  // namespace

size_t allocated_bytes() {
  std::lock_guard<std::mutex> lock(accounting().mutex);
  return accounting().live;
}
size_t peak_allocated_bytes() {
  std::lock_guard<std::mutex> lock(accounting().mutex);
  return accounting().peak;
}

void set_memory_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(accounting().mutex);
  accounting().limit = bytes;
}
size_t memory_limit() {
  std::lock_guard<std::mutex> lock(accounting().mutex);
  return accounting().limit;
}

void* malloc_device(size_t bytes, int index) {
  set_device(index);
  const size_t size = bytes == 0 ? 256 : bytes;  // a distinct pointer even for nothing
  // One lock over the limit check, the allocation and the record, so concurrent callers cannot
  // both pass the limit.
  Accounting& a = accounting();
  std::lock_guard<std::mutex> lock(a.mutex);
  if (a.limit > 0 && a.live + size > a.limit) {
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "out of GPU memory on cuda:%d allocating %.1f MiB: the GPU memory limit of "
                  "%.1f MiB (train.gpu_memory_limit_gib / --gpu-memory-limit) leaves %.1f MiB",
                  index, size / 1048576.0, a.limit / 1048576.0,
                  (a.limit - std::min(a.limit, a.live)) / 1048576.0);
    throw std::runtime_error(msg);
  }
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, size);
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "out of GPU memory on cuda:%d allocating %.1f MiB (%.1f MiB free of %.1f MiB)",
                  index, size / 1048576.0, free_b / 1048576.0, total_b / 1048576.0);
    throw std::runtime_error(msg);
  }
  a.sizes[p] = size;
  a.live += size;
  a.peak = std::max(a.peak, a.live);
  return p;
}

void free_device(void* p) {
  if (!p) return;
  cudaFree(p);  // never throws from destructors
  Accounting& a = accounting();
  std::lock_guard<std::mutex> lock(a.mutex);
  auto it = a.sizes.find(p);
  if (it == a.sizes.end()) return;
  a.live -= it->second;
  a.sizes.erase(it);
}

// Host copies wait for all work first: ops run on non-blocking streams, which a plain cudaMemcpy
// does not order against. (The training step keeps such copies out of its hot path.)
// (A pageable host-to-device cudaMemcpy may return before the DMA lands: wait after it too.)
void copy_to_device(void* dst, const void* src, size_t bytes) {
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  MOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  MOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void memset_device(void* p, int value, size_t bytes) {
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  MOE_CUDA_CHECK(cudaMemset(p, value, bytes));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
}
void synchronize() {
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

void* default_stream(int index) {
  std::lock_guard<std::mutex> lock(handles_mutex());
  PerDevice& d = per_device().at(static_cast<size_t>(index));
  if (!d.stream) {
    set_device(index);
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
  }
  return d.stream;
}

void* blas_handle(int index) {
  void* stream = default_stream(index);
  std::lock_guard<std::mutex> lock(handles_mutex());
  PerDevice& d = per_device().at(static_cast<size_t>(index));
  if (!d.blas) {
    set_device(index);
    MOE_CUBLAS_CHECK(cublasCreate(&d.blas));
    MOE_CUBLAS_CHECK(cublasSetStream(d.blas, static_cast<cudaStream_t>(stream)));
    // Without a workspace of its own cuBLAS may allocate inside a call, which a CUDA graph
    // capture forbids. 32 MiB covers the split-K and Hopper kernels (cuBLAS's own guidance).
    constexpr size_t kWorkspace = size_t{32} << 20;
    d.blas_workspace = malloc_device(kWorkspace, index);
    MOE_CUBLAS_CHECK(cublasSetWorkspace(d.blas, d.blas_workspace, kWorkspace));
  }
  return d.blas;
}

void* side_stream(int index) {
  std::lock_guard<std::mutex> lock(handles_mutex());
  PerDevice& d = per_device().at(static_cast<size_t>(index));
  if (!d.side) {
    set_device(index);
    int least = 0, greatest = 0;
    MOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MOE_CUDA_CHECK(cudaStreamCreateWithPriority(&d.side, cudaStreamNonBlocking, greatest));
  }
  return d.side;
}

void stream_wait_event(void* stream, void* event) {
  MOE_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

void copy_to_host_on(void* dst, const void* src, size_t bytes, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
}

void* malloc_pinned(size_t bytes) {
  void* p = nullptr;
  MOE_CUDA_CHECK(cudaMallocHost(&p, bytes));
  return p;
}
void free_pinned(void* p) {
  if (p) cudaFreeHost(p);  // never throws from destructors
}
void copy_to_device_async(void* dst, const void* pinned_src, size_t bytes, void* stream) {
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, pinned_src, bytes, cudaMemcpyHostToDevice,
                                 static_cast<cudaStream_t>(stream)));
}
void* event_create() {
  cudaEvent_t e = nullptr;
  MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}
void* event_create_timed() {
  cudaEvent_t e = nullptr;
  MOE_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}
float event_elapsed_ms(void* start, void* stop) {
  float ms = 0;
  MOE_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)));
  return ms;
}
void event_destroy(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}
void event_record(void* event, void* stream) {
  MOE_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}
void event_synchronize(void* event) {
  MOE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}
void stream_synchronize(void* stream) {
  MOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}
void launch_host_func(void* stream, std::function<void()> fn) {
  // The driver takes a plain function pointer: the callable travels on the heap and the
  // trampoline frees it after the call.
  auto* owned = new std::function<void()>(std::move(fn));
  const cudaError_t err = cudaLaunchHostFunc(
      static_cast<cudaStream_t>(stream),
      [](void* arg) {
        std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(arg));
        (*f)();
      },
      owned);
  if (err != cudaSuccess) delete owned;
  MOE_CUDA_CHECK(err);
}

}  // namespace moe::gpu
