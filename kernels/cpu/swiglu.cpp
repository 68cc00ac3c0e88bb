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
namespace {

template <class T>
T silu(T a) {
  return a * sigmoid(a);
}

template <class T>
T silu_grad(T a) {
  const T s = sigmoid(a);
  return s * (T(1) + a * (T(1) - s));
}

}  // namespace

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
