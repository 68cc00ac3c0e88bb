// SwiGLU and SiLU on the CPU. silu(a) = a * sigmoid(a), silu'(a) = sigmoid(a) * (1 + a * (1 -
// sigmoid(a))). The SwiGLU gate h = silu(gate) * up joins the two halves of a gated FFN (dense or
// one expert's rows). Elementwise, so the loops are flat and OpenMP-parallel above a size
// threshold. sigmoid(a) = 1 / (1 + exp(-a)) saturates cleanly at both ends (exp overflow gives
// 1/inf = 0).
#include <string>

#include "common/swiglu_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe::cpu {

// h, gate, up: [R, F]
void swiglu_forward(Ctx& ctx, Tensor h, Tensor gate, Tensor up) {
  check_like(gate, {&h, &up}, {"h", "up"}, "swiglu_forward");
  dispatch_float(gate.dtype, "swiglu_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    T* ph = h.ptr<T>();
    const int64_t n = gate.numel();
#pragma omp parallel for if (parallel_worth(n * kExpWork))
    for (int64_t i = 0; i < n; ++i) ph[i] = silu(g[i]) * u[i];
  });
}

// dgate, dup (overwritten), dh, gate, up: [R, F]
void swiglu_backward(Ctx& ctx, Tensor dgate, Tensor dup, Tensor dh, Tensor gate, Tensor up) {
  check_like(gate, {&dgate, &dup, &dh, &up}, {"dgate", "dup", "dh", "up"}, "swiglu_backward");
  dispatch_float(gate.dtype, "swiglu_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    const T* d = dh.ptr<T>();
    T* dg = dgate.ptr<T>();
    T* du = dup.ptr<T>();
    const int64_t n = gate.numel();
#pragma omp parallel for if (parallel_worth(n * kExpWork))
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i], ui = u[i], di = d[i];  // read all before writing: outputs may alias dh
      dg[i] = di * ui * silu_grad(gi);
      du[i] = di * silu(gi);
    }
  });
}

// h, gate, up: [R, F]; row_w: [R]
void swiglu_weighted_forward(Ctx& ctx, Tensor h, Tensor gate, Tensor up, Tensor row_w) {
  const int64_t f = check_swiglu_weighted_args(gate, {&h, &up}, {"h", "up"}, {&row_w}, {"row_w"},
                                               "swiglu_weighted_forward");
  dispatch_float(gate.dtype, "swiglu_weighted_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    const T* w = row_w.ptr<T>();
    T* ph = h.ptr<T>();
    const int64_t rows = row_w.numel();
#pragma omp parallel for if (parallel_worth(rows * f * kExpWork))
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = r * f; j < (r + 1) * f; ++j) ph[j] = silu(g[j]) * u[j] * w[r];
  });
}

// dgate, dup (overwritten; may alias dh), dh, gate, up: [R, F]; drow_w (overwritten), row_w: [R].
// The row's dot product is summed in double in index order.
void swiglu_weighted_backward(Ctx& ctx, Tensor dgate, Tensor dup, Tensor drow_w, Tensor dh,
                              Tensor gate, Tensor up, Tensor row_w) {
  const int64_t f = check_swiglu_weighted_args(gate, {&dgate, &dup, &dh, &up},
                                               {"dgate", "dup", "dh", "up"}, {&row_w, &drow_w},
                                               {"row_w", "drow_w"}, "swiglu_weighted_backward");
  dispatch_float(gate.dtype, "swiglu_weighted_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate.ptr<T>();
    const T* u = up.ptr<T>();
    const T* d = dh.ptr<T>();
    const T* w = row_w.ptr<T>();
    T* dg = dgate.ptr<T>();
    T* du = dup.ptr<T>();
    T* dw = drow_w.ptr<T>();
    const int64_t rows = row_w.numel();
#pragma omp parallel for if (parallel_worth(rows * f * kExpWork))
    for (int64_t r = 0; r < rows; ++r) {
      double dot = 0;
      for (int64_t j = r * f; j < (r + 1) * f; ++j) {
        const T gi = g[j], ui = u[j], di = d[j];  // read all before writing: outputs may alias dh
        const T s = silu(gi), dwi = di * w[r];
        dot += static_cast<double>(di) * (s * ui);
        dg[j] = dwi * ui * silu_grad(gi);
        du[j] = dwi * s;
      }
      dw[r] = static_cast<T>(dot);
    }
  });
}

// y, x: same shape
void silu_forward(Ctx& ctx, Tensor y, Tensor x) {
  check_like(x, {&y}, {"y"}, "silu_forward");
  dispatch_float(x.dtype, "silu_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* px = x.ptr<T>();
    T* py = y.ptr<T>();
    const int64_t n = x.numel();
#pragma omp parallel for if (parallel_worth(n * kExpWork))
    for (int64_t i = 0; i < n; ++i) py[i] = silu(px[i]);
  });
}

// dx (overwritten), dy, x: same shape
void silu_backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x) {
  check_like(x, {&dx, &dy}, {"dx", "dy"}, "silu_backward");
  dispatch_float(x.dtype, "silu_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* px = x.ptr<T>();
    const T* pdy = dy.ptr<T>();
    T* pdx = dx.ptr<T>();
    const int64_t n = x.numel();
#pragma omp parallel for if (parallel_worth(n * kExpWork))
    for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * silu_grad(px[i]);
  });
}

}  // namespace moe::cpu
