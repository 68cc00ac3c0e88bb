// Rotary position embedding on the CPU, Hugging Face "rotate_half" convention: for j < hd/2 the
// pair (x_j, x_{j+hd/2}) at position p turns by the angle p * theta^(-2j/hd):
//   y_j        = x_j cos - x_{j+hd/2} sin
//   y_{j+hd/2} = x_{j+hd/2} cos + x_j sin
// The backward applies the transpose (a turn by minus the angle), so rope_backward undoes
// rope_forward. The table's angles are computed in double and rounded once, so long positions do
// not lose phase the way a float p * inv_freq would. Both directions work in place, parallel over
// rows.
#include <cmath>
#include <string>

#include "common/rope_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/rope.hpp"

namespace moe::cpu {
namespace {

// Checks x: [N, H, hd], pos: [N] i32 in [0, P), cos/sin: [P, hd/2]; returns the position pointer.
const int32_t* check_rope_args(const Tensor& x, const Tensor& pos, const Tensor& cos,
                               const Tensor& sin, const char* op) {
  check_rope_rotate_args(x, pos, cos, sin, op);
  const std::string name(op);
  const int64_t n = x.size(0), max_pos = cos.size(0);
  const int32_t* p = pos.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(p[i] >= 0 && p[i] < max_pos,
              name + ": position " + std::to_string(p[i]) + " of row " + std::to_string(i) +
                  " is outside the table [0, " + std::to_string(max_pos) + ")");
  return p;
}

// Rotates every head of x by (cos, sin) when sign = +1, by the inverse turn when sign = -1.
template <class T>
void rotate_rows(Tensor x, const int32_t* pos, const Tensor& cos, const Tensor& sin, T sign) {
  const int64_t n = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  T* px = x.ptr<T>();
  const T* pc = cos.ptr<T>();
  const T* ps = sin.ptr<T>();
#pragma omp parallel for if (parallel_worth(n * heads * hd))
  for (int64_t i = 0; i < n; ++i) {
    const T* c = pc + pos[i] * half;
    const T* s = ps + pos[i] * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = px + (i * heads + h) * hd;  // v: [hd]
      for (int64_t j = 0; j < half; ++j) {
        const T a = v[j], b = v[j + half], sj = sign * s[j];
        v[j] = a * c[j] - b * sj;
        v[j + half] = b * c[j] + a * sj;
      }
    }
  }
}

}  // namespace

// cos, sin: [P, hd/2]
void rope_table(Ctx& ctx, Tensor cos, Tensor sin, double theta) {
  check_rope_table_args(cos, sin, theta);
  const int64_t max_pos = cos.size(0), half = cos.size(1);
  dispatch_float(cos.dtype, "rope_table", [&](auto zero) {
    using T = decltype(zero);
    T* pc = cos.ptr<T>();
    T* ps = sin.ptr<T>();
    const double hd = 2.0 * static_cast<double>(half);
#pragma omp parallel for if (parallel_worth(max_pos * half * 3 * kExpWork))
    for (int64_t p = 0; p < max_pos; ++p) {
      for (int64_t j = 0; j < half; ++j) {
        const double angle = static_cast<double>(p) * std::pow(theta, -2.0 * j / hd);
        pc[p * half + j] = static_cast<T>(std::cos(angle));
        ps[p * half + j] = static_cast<T>(std::sin(angle));
      }
    }
  });
}

// x: [N, H, hd] in place, pos: [N]
void rope_forward(Ctx& ctx, Tensor x, Tensor pos, Tensor cos, Tensor sin) {
  const int32_t* p = check_rope_args(x, pos, cos, sin, "rope_forward");
  dispatch_float(x.dtype, "rope_forward", [&](auto zero) {
    using T = decltype(zero);
    rotate_rows<T>(x, p, cos, sin, T(1));
  });
}

// dx: [N, H, hd] in place, pos: [N]
void rope_backward(Ctx& ctx, Tensor dx, Tensor pos, Tensor cos, Tensor sin) {
  const int32_t* p = check_rope_args(dx, pos, cos, sin, "rope_backward");
  dispatch_float(dx.dtype, "rope_backward", [&](auto zero) {
    using T = decltype(zero);
    rotate_rows<T>(dx, p, cos, sin, T(-1));
  });
}

}  // namespace moe::cpu
