// Host conversions between f32 / f64 and the 16-bit storage formats (f16, bf16), rounding to
// nearest even, for the CPU convert op (so GPU tests have a CPU oracle for 16-bit tensors). The
// bit tricks are those of src/checkpoint/float_convert.hpp (which rounds like PyTorch's .to()),
// plus conversions from double that round once: a double is first rounded to float "to odd"
// (truncate, then set the last bit if anything was cut off), which keeps enough information for
// the second, round-to-nearest-even step to give the correctly rounded 16-bit value (the float has
// 24 bits, more than the 16-bit format's 11 + 2). Rounding a double to float to nearest first
// could round twice (a double just above a 16-bit tie would become the tie, then go to even).
// kernels/cuda/elementwise.cu does the same on the device, so both backends agree bitwise.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace moe::float16 {

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

// d rounded to float "to odd": the float toward zero, with its last bit set when d was not exact.
// (A finite d beyond the float range gives +-FLT_MAX, whose last bit is set: it then rounds to inf
// in both 16-bit formats, as d itself would.)
inline float double_to_float_odd(double d) {
  const float f = static_cast<float>(d);  // to nearest
  if (static_cast<double>(f) == d || std::isnan(d)) return f;
  uint32_t u = float_bits(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) --u;  // went away from zero: step back
  return float_from_bits(u | 1u);
}

inline uint16_t double_to_bf16(double d) {
  return float_to_bf16(double_to_float_odd(d));
}
inline uint16_t double_to_f16(double d) {
  return float_to_f16(double_to_float_odd(d));
}

}  // namespace moe::float16
