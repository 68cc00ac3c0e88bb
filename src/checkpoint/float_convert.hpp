// Scalar conversions between the float formats a checkpoint may hold (F64, F32, BF16, F16) and
// the model's dtype, private to src/checkpoint. Hugging Face checkpoints are usually BF16 while
// this trainer keeps F32 weights, so loading widens; narrowing rounds to nearest even, the
// rounding PyTorch's .to() uses, so a weight converted here matches one converted there.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace moe::checkpoint_internal {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// BF16 is the top half of an F32, so widening is exact.
inline float bf16_to_float(uint16_t b) {
  return float_from_bits(static_cast<uint32_t>(b) << 16);
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // stays a (quiet) NaN
  u += 0x7FFF + ((u >> 16) & 1);                                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return float_from_bits(sign | 0x7F800000 | (mant << 13));  // inf / NaN
  return float_from_bits(sign | ((exp + 112) << 23) | (mant << 13));        // rebias 15 -> 127
}

inline uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  u &= 0x7FFFFFFF;
  if (u > 0x7F800000) return sign | 0x7E00;     // NaN
  if (u >= 0x477FF000) return sign | 0x7C00;    // rounds past 65504: inf
  if (u < 0x38800000) {                         // below 2^-14: F16 subnormal (or zero)
    float scaled = std::fabs(f) * 16777216.0f;  // * 2^24, exact
    return sign | static_cast<uint16_t>(std::lrint(scaled));
  }
  u += 0xC8000FFF + ((u >> 13) & 1);  // exponent 127 -> 15, plus round to nearest even
  return sign | static_cast<uint16_t>(u >> 13);
}

}  // namespace moe::checkpoint_internal
