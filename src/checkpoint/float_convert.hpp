// Scalar conversions between the float formats a checkpoint may hold (F64, F32, BF16, F16) and
// the model's dtype, for src/checkpoint. Hugging Face checkpoints are usually BF16 while this
// trainer keeps F32 weights, so loading widens; narrowing rounds to nearest even, the rounding
// PyTorch's .to() uses, so a weight converted here matches one converted there. The conversions
// themselves are the ones the CPU convert op uses (kernels/common/float16.hpp).
#pragma once
#include "common/float16.hpp"

namespace moe::checkpoint_internal {

using float16::bf16_to_float;
using float16::f16_to_float;
using float16::float_bits;
using float16::float_from_bits;
using float16::float_to_bf16;
using float16::float_to_f16;

}  // namespace moe::checkpoint_internal
