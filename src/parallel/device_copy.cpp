// The byte copy the comms use for their local chunk (SingleComm's gathers, NcclComm's self part
// of all_to_all_v) and for Comm::copy_from_host: memmove on the CPU, a stream-ordered copy on a
// GPU (device to device, or from host memory: the direction is taken from the pointers).
#include <cstring>
#include <string>

#include "parallel/comm_impl.hpp"
#include "moe/error.hpp"

#ifdef MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::dist {

void copy_bytes(Device dev, void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0 || dst == src) return;
  if (dev.type == DeviceType::cpu) {
    std::memmove(dst, src, bytes);
    return;
  }
#ifdef MOE_WITH_CUDA
  cudaError_t err =
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess)
    throw CommError(std::string("CUDA error: ") + cudaGetErrorString(err) +
                    " in cudaMemcpyAsync (comm copy of " + std::to_string(bytes) + " bytes on " +
                    dev.str() + ") at " + __FILE__ + ":" + std::to_string(__LINE__));
#else
  throw InternalError("comm copy on " + dev.str() + ": this build has no CUDA backend");
#endif
}

}  // namespace moe::dist
