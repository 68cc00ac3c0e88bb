// include/moe/cuda_runtime.hpp in a build without CUDA: no devices; anything else is a bug.
#include "moe/cuda_runtime.hpp"
#include "moe/error.hpp"

#ifndef MOE_WITH_CUDA
namespace moe::gpu {

namespace {
[[noreturn]] void absent(const char* what) {
  throw InternalError(std::string(what) + ": this build has no CUDA backend");
}
}  // namespace

bool built_with_cuda() {
  return false;
}
int device_count() {
  return 0;
}
DeviceInfo device_info(int) {
  absent("device_info");
}
bool has_code_for(int, std::string* why_not) {
  if (why_not) *why_not = "this build has no CUDA backend (rebuild with scripts/build.sh)";
  return false;
}
int code_arch(int) {
  return 0;
}
void set_device(int) {
  absent("set_device");
}
void* malloc_device(size_t, int) {
  absent("malloc_device");
}
void free_device(void*) {}
void set_memory_limit(size_t) {}
size_t memory_limit() {
  return 0;
}
size_t allocated_bytes() {
  return 0;
}
size_t peak_allocated_bytes() {
  return 0;
}
void copy_to_device(void*, const void*, size_t) {
  absent("copy_to_device");
}
void copy_to_host(void*, const void*, size_t) {
  absent("copy_to_host");
}
void memset_device(void*, int, size_t) {
  absent("memset_device");
}
void synchronize() {}
void* default_stream(int) {
  absent("default_stream");
}
void* blas_handle(int) {
  absent("blas_handle");
}
void* malloc_pinned(size_t) {
  absent("malloc_pinned");
}
void free_pinned(void*) {}
void copy_to_device_async(void*, const void*, size_t, void*) {
  absent("copy_to_device_async");
}
void* event_create() {
  absent("event_create");
}
void* event_create_timed() {
  absent("event_create_timed");
}
float event_elapsed_ms(void*, void*) {
  absent("event_elapsed_ms");
}
void event_destroy(void*) {}
void event_record(void*, void*) {
  absent("event_record");
}
void event_synchronize(void*) {
  absent("event_synchronize");
}
void stream_synchronize(void*) {
  absent("stream_synchronize");
}
void* side_stream(int) {
  absent("side_stream");
}
void stream_wait_event(void*, void*) {
  absent("stream_wait_event");
}
void copy_to_host_on(void*, const void*, size_t, void*) {
  absent("copy_to_host_on");
}
void launch_host_func(void*, std::function<void()>) {
  absent("launch_host_func");
}

}  // namespace moe::gpu
#endif
