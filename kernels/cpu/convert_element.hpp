// One element converted between float storage types on the CPU, exactly as the convert op rounds
// it: the arithmetic in float, or in double when either side is f64, then one rounding, to
// nearest even, into the destination (f16 / bf16 as raw 16-bit patterns through
// common/float16.hpp). Shared by convert (kernels/cpu/elementwise.cpp) and by the AdamW op's
// compute-copy output (kernels/cpu/optim.cpp), so the two write the same bits by construction.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/float16.hpp"
#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe::cpu {

// The 16-bit storage formats, as raw bit patterns.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// Calls fn(S{}) with S the storage type of t: float, double, Half or BFloat16.
template <class Fn>
void dispatch_any_float(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::f32:
      return fn(float{});
    case DType::f64:
      return fn(double{});
    case DType::f16:
      return fn(Half{});
    case DType::bf16:
      return fn(BFloat16{});
    default:
      throw InternalError(std::string(op) + ": unsupported dtype " + dtype_name(t));
  }
}

// The arithmetic type of a conversion between S and D: double if either is f64, else float
// (which holds every f16 / bf16 value exactly).
template <class D, class S>
using convert_math_t =
    std::conditional_t<std::is_same_v<D, double> || std::is_same_v<S, double>, double, float>;

template <class W>
W widen(float v) {
  return static_cast<W>(v);
}
template <class W>
W widen(double v) {
  return static_cast<W>(v);  // W is double whenever a side is double
}
template <class W>
W widen(Half v) {
  return static_cast<W>(float16::f16_to_float(v.bits));
}
template <class W>
W widen(BFloat16 v) {
  return static_cast<W>(float16::bf16_to_float(v.bits));
}

// v rounded once, to nearest even, into D.
template <class D>
D narrow(float v) {
  if constexpr (std::is_same_v<D, Half>)
    return Half{float16::float_to_f16(v)};
  else if constexpr (std::is_same_v<D, BFloat16>)
    return BFloat16{float16::float_to_bf16(v)};
  else
    return static_cast<D>(v);
}
template <class D>
D narrow(double v) {
  if constexpr (std::is_same_v<D, Half>)
    return Half{float16::double_to_f16(v)};
  else if constexpr (std::is_same_v<D, BFloat16>)
    return BFloat16{float16::double_to_bf16(v)};
  else
    return static_cast<D>(v);
}

// v (stored as S) converted to D: what convert(dst, src, false) writes for one element.
template <class D, class S>
D convert_element(S v) {
  return narrow<D>(widen<convert_math_t<D, S>>(v));
}

}  // namespace moe::cpu
