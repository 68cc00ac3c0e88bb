// One element converted between storage types on the device, exactly as the convert op rounds it
// (and as its CPU twin, kernels/cpu/convert_element.hpp): the arithmetic in float, or in double
// when either side is f64, then one rounding, to nearest even, into the destination. A double
// goes to f16 / bf16 through a float rounded "to odd" (see kernels/common/float16.hpp), never
// through a float rounded to nearest, which could round twice. Shared by convert
// (kernels/cuda/elementwise.cu) and the AdamW kernel's compute-copy output (kernels/cuda/optim.cu),
// so the two write the same bits by construction.
#pragma once
#include <type_traits>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {

// The arithmetic type of a conversion between S and D: double if either is double, else float.
template <class D, class S>
using convert_math_t =
    std::conditional_t<std::is_same_v<D, double> || std::is_same_v<S, double>, double, float>;

// d rounded to float "to odd" (kernels/common/float16.hpp has the host twin): toward zero, with the
// last bit set when d was not exact, so the one rounding to 16 bits that follows is correct.
__device__ __forceinline__ float double_to_float_odd(double d) {
  const float f = __double2float_rz(d);
  if (static_cast<double>(f) == d || d != d) return f;
  return __uint_as_float(__float_as_uint(f) | 1u);
}

// v rounded once, to nearest even, into D (W = float or double: the conversion's arithmetic type).
template <class D, class W>
__device__ __forceinline__ D narrow(W v) {
  if constexpr (std::is_same_v<D, double>) {
    return static_cast<double>(v);
  } else if constexpr (std::is_same_v<D, float>) {
    return static_cast<float>(v);  // double -> float: to nearest
  } else if constexpr (std::is_same_v<W, double>) {
    return store<D>(double_to_float_odd(v));
  } else {
    return store<D>(v);
  }
}

// v (stored as S) converted to D: what convert(dst, src, false) writes for one element.
template <class D, class S>
__device__ __forceinline__ D convert_element(S v) {
  using W = convert_math_t<D, S>;
  return narrow<D, W>(static_cast<W>(load(v)));
}

}  // namespace moe::cuda_detail
