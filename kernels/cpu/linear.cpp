// Linear layers on the CPU, weights stored [out_features, in_features] (Hugging Face layout), all
// through BLAS gemm. OpenBLAS threads each call itself; its gemm splits the output among threads,
// not the inner sums, so results should not depend on the thread count. The grouped variant runs
// the experts' matmuls one after another over the row ranges given by offsets; an expert with no
// rows is skipped, which is exactly "+= 0" for its weight gradient and writes no rows.
#include <string>

#include "cpu/cpu_common.hpp"
#include "moe/ops/linear.hpp"

namespace moe::cpu {
namespace {

// The [N, in] / [N, out] / [out, in] shapes shared by linear_forward and linear_backward.
struct LinearDims {
  int64_t n, in, out;
};

LinearDims linear_dims(const Tensor& x, const Tensor& w, const char* op) {
  MOE_CHECK(x.ndim == 2, std::string(op) + ": x must be [N, in], got " + x.shape_str());
  MOE_CHECK(w.ndim == 2, std::string(op) + ": w must be [out, in], got " + w.shape_str());
  MOE_CHECK(w.size(1) == x.size(1), std::string(op) + ": x " + x.shape_str() + " and w " +
                                        w.shape_str() + " disagree on in_features");
  return {x.size(0), x.size(1), w.size(0)};
}

// offsets: [E+1] i32, 0 = offsets[0] <= ... <= offsets[E] = rows. Returns the host pointer.
const int32_t* checked_offsets(const Tensor& offsets, int64_t experts, int64_t rows,
                               const char* op) {
  MOE_CHECK(offsets.dtype == DType::i32,
            std::string(op) + ": offsets must be i32, got " + dtype_name(offsets.dtype));
  check_shape(offsets, {experts + 1}, (std::string(op) + ": offsets").c_str());
  const int32_t* o = offsets.ptr<int32_t>();
  MOE_CHECK(o[0] == 0 && o[experts] == rows,
            std::string(op) + ": offsets must run from 0 to the row count " + std::to_string(rows) +
                ", got " + std::to_string(o[0]) + " .. " + std::to_string(o[experts]));
  for (int64_t e = 0; e < experts; ++e)
    MOE_CHECK(o[e] <= o[e + 1],
              std::string(op) + ": offsets decrease at expert " + std::to_string(e));
  return o;
}

// The [E, out, in] weight and [R, in] rows of a grouped linear.
struct GroupedDims {
  int64_t rows, in, out, experts;
};

GroupedDims grouped_dims(const Tensor& x, const Tensor& w, const char* op) {
  MOE_CHECK(x.ndim == 2, std::string(op) + ": x must be [R, in], got " + x.shape_str());
  MOE_CHECK(w.ndim == 3, std::string(op) + ": w must be [E, out, in], got " + w.shape_str());
  MOE_CHECK(w.size(2) == x.size(1), std::string(op) + ": x " + x.shape_str() + " and w " +
                                        w.shape_str() + " disagree on in_features");
  return {x.size(0), x.size(1), w.size(1), w.size(0)};
}

}  // namespace

// y: [N, out] (= or +=), x: [N, in], w: [out, in]
void linear_forward(Ctx& ctx, Tensor y, Tensor x, Tensor w, bool accumulate) {
  const LinearDims s = linear_dims(x, w, "linear_forward");
  check_shape(y, {s.n, s.out}, "linear_forward: y");
  check_same_dtype(x, w, "linear_forward: x, w");
  check_same_dtype(y, x, "linear_forward: y, x");
  dispatch_float(x.dtype, "linear_forward", [&](auto zero) {
    using T = decltype(zero);
    // y = x w^T
    gemm(false, true, s.n, s.out, s.in, T(1), x.ptr<T>(), s.in, w.ptr<T>(), s.in,
         T(accumulate ? 1 : 0), y.ptr<T>(), s.out);
  });
}

// dx: [N, in] (= or +=; skipped when empty), dw: [out, in] (+=), dy: [N, out]
void linear_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                     bool accumulate_dx) {
  const LinearDims s = linear_dims(x, w, "linear_backward");
  check_shape(dy, {s.n, s.out}, "linear_backward: dy");
  check_shape(dw, {s.out, s.in}, "linear_backward: dw");
  if (!dx.empty()) check_shape(dx, {s.n, s.in}, "linear_backward: dx");
  for (const Tensor* t : {&dw, &dy, &w}) check_same_dtype(*t, x, "linear_backward");
  if (!dx.empty()) check_same_dtype(dx, x, "linear_backward: dx, x");
  dispatch_float(x.dtype, "linear_backward", [&](auto zero) {
    using T = decltype(zero);
    // dx = dy w
    if (!dx.empty())
      gemm(false, false, s.n, s.in, s.out, T(1), dy.ptr<T>(), s.out, w.ptr<T>(), s.in,
           T(accumulate_dx ? 1 : 0), dx.ptr<T>(), s.in);
    // dw += dy^T x
    if (s.n > 0)
      gemm(true, false, s.out, s.in, s.n, T(1), dy.ptr<T>(), s.out, x.ptr<T>(), s.in, T(1),
           dw.ptr<T>(), s.in);
  });
}

// y: [R, out], x: [R, in], w: [E, out, in], offsets: [E+1]
void grouped_linear_forward(Ctx& ctx, Tensor y, Tensor x, Tensor w, Tensor offsets) {
  const GroupedDims s = grouped_dims(x, w, "grouped_linear_forward");
  check_shape(y, {s.rows, s.out}, "grouped_linear_forward: y");
  check_same_dtype(x, w, "grouped_linear_forward: x, w");
  check_same_dtype(y, x, "grouped_linear_forward: y, x");
  const int32_t* off = checked_offsets(offsets, s.experts, s.rows, "grouped_linear_forward");
  dispatch_float(x.dtype, "grouped_linear_forward", [&](auto zero) {
    using T = decltype(zero);
    for (int64_t e = 0; e < s.experts; ++e) {
      const int64_t r0 = off[e], m = off[e + 1] - off[e];
      if (m == 0) continue;
      // y_e = x_e w[e]^T
      gemm(false, true, m, s.out, s.in, T(1), x.ptr<T>() + r0 * s.in, s.in,
           w.ptr<T>() + e * s.out * s.in, s.in, T(0), y.ptr<T>() + r0 * s.out, s.out);
    }
  });
}

// dx: [R, in] (overwritten), dw: [E, out, in] (+=), dy: [R, out]
void grouped_linear_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                             Tensor offsets) {
  const GroupedDims s = grouped_dims(x, w, "grouped_linear_backward");
  check_shape(dx, {s.rows, s.in}, "grouped_linear_backward: dx");
  check_shape(dy, {s.rows, s.out}, "grouped_linear_backward: dy");
  check_shape(dw, {s.experts, s.out, s.in}, "grouped_linear_backward: dw");
  for (const Tensor* t : {&dx, &dw, &dy, &w}) check_same_dtype(*t, x, "grouped_linear_backward");
  const int32_t* off = checked_offsets(offsets, s.experts, s.rows, "grouped_linear_backward");
  dispatch_float(x.dtype, "grouped_linear_backward", [&](auto zero) {
    using T = decltype(zero);
    for (int64_t e = 0; e < s.experts; ++e) {
      const int64_t r0 = off[e], m = off[e + 1] - off[e];
      if (m == 0) continue;  // no rows: dw[e] += 0
      const T* dy_e = dy.ptr<T>() + r0 * s.out;
      const T* x_e = x.ptr<T>() + r0 * s.in;
      const T* w_e = w.ptr<T>() + e * s.out * s.in;
      // dx_e = dy_e w[e]
      gemm(false, false, m, s.in, s.out, T(1), dy_e, s.out, w_e, s.in, T(0),
           dx.ptr<T>() + r0 * s.in, s.in);
      // dw[e] += dy_e^T x_e
      gemm(true, false, s.out, s.in, m, T(1), dy_e, s.out, x_e, s.in, T(1),
           dw.ptr<T>() + e * s.out * s.in, s.in);
    }
  });
}

}  // namespace moe::cpu
