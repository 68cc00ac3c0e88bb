// The split fp32 master (train.split_master): each fp32 master weight is stored as its bf16
// compute copy `hi` plus a 16-bit word `lo`, 4 bytes as before but without a separate compute
// copy, so a mixed-precision model keeps 4 bytes of weights per parameter instead of 6. Shared
// verbatim by the host (kernels/cpu, the model's host transfers) and the CUDA kernels.
//
// With b the fp32 bit pattern (as an unsigned 32-bit integer, arithmetic mod 2^32):
//   hi = (b + 0x7FFF) >> 16            round to nearest, ties toward zero (on the magnitude)
//   D  = b - (hi << 16)                in [-0x7FFF, 0x8000]; lo = D mod 2^16
//   b  = (hi << 16) + D,  D = ((lo + 0x7FFF) mod 2^16) - 0x7FFF
// A decode gives back every encoded bit pattern exactly, so AdamW over (hi, lo) computes the same
// master weights as over an fp32 buffer. Ties go toward zero, not to even: a 16-bit lo can tell
// apart only 65536 fp32 values per hi, and ties-to-even would give an even hi 65537 (both
// D = +0x8000 and -0x8000). So hi is the bf16 conversion convert() would write except where the
// low 16 bits are exactly 0x8000 (one pattern in 65536), where it is the other neighbour at the
// same distance. NaNs are canonicalised first (a NaN payload near 0x7FFFFFFF would otherwise
// round over into the sign bit and give hi = -0, hiding the NaN from the forward).
#pragma once
#include <cstdint>

#include "common/float16.hpp"

#if defined(__CUDACC__)
#define MOE_SPLIT_HD __host__ __device__ __forceinline__
#else
#define MOE_SPLIT_HD inline
#endif

namespace moe {

// The bit casts on both sides (the host's are float16.hpp's).
MOE_SPLIT_HD uint32_t split_float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return float16::float_bits(x);
#endif
}

MOE_SPLIT_HD float split_bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return float16::float_from_bits(b);
#endif
}

// x -> (hi, lo); hi is the bf16 bit pattern.
MOE_SPLIT_HD void split_master_encode_one(float x, uint16_t* hi, uint16_t* lo) {
  uint32_t b = split_float_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) b = 0x7FC00000u;  // NaN
  const uint32_t h = (b + 0x7FFFu) >> 16;
  *hi = static_cast<uint16_t>(h);
  *lo = static_cast<uint16_t>(b - (h << 16));
}

// (hi, lo) -> x.
MOE_SPLIT_HD float split_master_decode_one(uint16_t hi, uint16_t lo) {
  const uint32_t d = ((static_cast<uint32_t>(lo) + 0x7FFFu) & 0xFFFFu) - 0x7FFFu;  // D mod 2^32
  return split_bits_float((static_cast<uint32_t>(hi) << 16) + d);
}

}  // namespace moe
