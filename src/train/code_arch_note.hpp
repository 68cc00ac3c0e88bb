// The warning a GPU run prints when the binary holds only slower code for its device than the
// build could give it: the CUDA runtime runs the newest code it finds at or below the device's
// arch (PTX JIT-compiled if need be), so a build for the wrong card trains, silently on the slower
// kernels (e.g. a T4 build on an H100: no wgmma, TMA or bf16 tensor cores).
#pragma once
#include <string>

#include "moe/tensor.hpp"

namespace moe {

// `major`.`minor`: the device's compute capability; `code_arch`: gpu::code_arch (e.g. 75 for
// the compute_75 PTX); `sm90a_built`: the build's 9.0 code is sm_90a (MOE_WITH_SM90A: entry 90,
// not 90-virtual, whose plain compute_90 PTX has no wgmma). "" when the code is the best kind the
// kernels have for the device: sm_90a on sm_90, sm_80 or newer on other sm_80+ devices, any on
// older ones.
std::string code_arch_note(const std::string& gpu_name, int major, int minor, int code_arch,
                           bool sm90a_built);
// The same for `dev` as found ("" on the CPU), for the train and bench banners.
std::string code_arch_note(Device dev);

}  // namespace moe
