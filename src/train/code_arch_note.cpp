#include "train/code_arch_note.hpp"

#include "moe/cuda_runtime.hpp"

namespace moe {

std::string code_arch_note(const std::string& gpu_name, int major, int minor, int code_arch,
                           bool sm90a_built) {
  const int device_arch = major * 10 + minor;
  const char* missing = nullptr;
  if (device_arch == 90 && (code_arch < 90 || !sm90a_built))
    missing = "the sm_90 kernels (wgmma and TMA)";
  else if (device_arch >= 80 && code_arch < 80)
    missing = "the sm_80 kernels (bf16 tensor cores, cp.async pipelines)";
  if (missing == nullptr) return "";
  const std::string arch = "sm_" + std::to_string(device_arch);
  const std::string code = code_arch == 90 ? "the plain compute_90 PTX (MOE_CUDA_ARCHS 90-virtual)"
                                           : "sm_" + std::to_string(code_arch);
  return "warning: this binary's newest code for " + gpu_name + " (" + arch + ") is " + code +
         ", so it runs without " + missing + ": rebuild with scripts/build.sh --arch " + arch +
         " (CMake -DMOE_CUDA_ARCHS=" + std::to_string(device_arch) + ") for its full speed\n";
}

std::string code_arch_note(Device dev) {
  if (dev.type != DeviceType::cuda) return "";
#ifdef MOE_WITH_SM90A
  const bool sm90a_built = true;
#else
  const bool sm90a_built = false;
#endif
  const gpu::DeviceInfo info = gpu::device_info(dev.index);
  return code_arch_note(info.name, info.major, info.minor, gpu::code_arch(dev.index), sm90a_built);
}

}  // namespace moe
