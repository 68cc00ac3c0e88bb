// The CUDA runtime as the rest of the trainer sees it: plain C++ declarations (no CUDA headers),
// implemented in kernels/cuda/runtime.cu. In a build without CUDA, device_count() is 0 and the
// other calls throw. Every CUDA / cuBLAS call behind these is checked and reported with file:line.
#pragma once
#include <cstddef>
#include <string>

namespace moe::gpu {

bool built_with_cuda();
// GPUs the driver reports (0 when there is no driver or no device).
int device_count();

struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0;  // compute capability
  size_t total_bytes = 0, free_bytes = 0;
};
DeviceInfo device_info(int index);
// Whether this binary holds code the device can run (SASS for its arch or PTX it can JIT).
// Otherwise the message says which build flag to use (scripts/build.sh --arch sm_XY).
bool has_code_for(int index, std::string* why_not);

void set_device(int index);
void* malloc_device(size_t bytes, int index);  // throws with sizes on out-of-memory
void free_device(void* p);
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void memset_device(void* p, int value, size_t bytes);
void synchronize();

// Per-device handles the ops use (Ctx::stream, Ctx::blas): created once, on first use.
void* default_stream(int index);
void* blas_handle(int index);

}  // namespace moe::gpu
