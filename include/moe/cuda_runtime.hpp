// The CUDA runtime as the rest of the trainer sees it: plain C++ declarations (no CUDA headers),
// implemented in kernels/cuda/runtime.cu. In a build without CUDA, device_count() is 0 and the
// other calls throw. Every CUDA / cuBLAS call behind these is checked and reported with file:line.
#pragma once
#include <cstddef>
#include <functional>
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
// The arch of this binary's code that the device runs (e.g. 90 for sm_90a machine code, 75 where
// it JIT-compiles the compute_75 PTX), the arch the kernels' `__CUDA_ARCH__` paths were built for;
// 0 when it has none (and in a build without CUDA). Every kernel is built for the same list.
int code_arch(int index);

void set_device(int index);
void* malloc_device(size_t bytes, int index);  // throws with sizes on out-of-memory
void free_device(void* p);
// A cap on the bytes malloc_device may hold at once (0 = none): a larger card can check that a
// run fits a smaller one's budget (e.g. a T4's 16 GiB). The CUDA context and library workspaces
// outside malloc_device are not counted.
void set_memory_limit(size_t bytes);
size_t memory_limit();
// Bytes held by malloc_device now, and the most held at once since the process started.
size_t allocated_bytes();
size_t peak_allocated_bytes();
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void memset_device(void* p, int value, size_t bytes);
void synchronize();

// Per-device handles the ops use (Ctx::stream, Ctx::blas): created once, on first use. The cuBLAS
// handle gets a fixed workspace, so its calls allocate nothing and can be captured in a CUDA graph.
void* default_stream(int index);
void* blas_handle(int index);
// A second stream of the device, at the greatest priority: work queued there runs beside the op
// stream's (the optimizer's update behind the next step's forward, AdamW::step), its blocks
// placed first whenever an SM frees. Created once, on first use.
void* side_stream(int index);
// The stream's later work waits until the work recorded before `event` is done.
void stream_wait_event(void* stream, void* event);
// copy_to_host that waits only for `stream`'s work, not the whole device's (a side stream's
// update goes on).
void copy_to_host_on(void* dst, const void* src, size_t bytes, void* stream);

// Asynchronous host-to-device uploads for the training step, which must not wait for the device:
// page-locked host memory, a copy queued on a stream, and events to know when a staging slot may
// be reused.
void* malloc_pinned(size_t bytes);
void free_pinned(void* p);
void copy_to_device_async(void* dst, const void* pinned_src, size_t bytes, void* stream);
void* event_create();        // for ordering only (no timing: cheaper)
void* event_create_timed();  // for event_elapsed_ms
float event_elapsed_ms(void* start, void* stop);
void event_destroy(void* event);
void event_record(void* event, void* stream);
void event_synchronize(void* event);  // waits for the work recorded before `event`
void stream_synchronize(void* stream);
// Queues `fn` on `stream`: it runs on a driver thread once the work queued before it is done, and
// the stream's later work waits for it. It must not call CUDA (a quick hand-off to another thread,
// such as a notify, is what it is for).
void launch_host_func(void* stream, std::function<void()> fn);

}  // namespace moe::gpu
