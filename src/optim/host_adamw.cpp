#include "optim/host_adamw.hpp"

#include <cmath>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/adamw_scale.hpp"

namespace moe {

namespace {

// Below this many elements one thread does the update: a parallel region costs more (the same
// break-even reasoning as kernels/cpu's parallel_worth, ~16 operations per element).
constexpr size_t kParallelMinElems = size_t{1} << 12;

// Reads p, g, m, v and writes p_out, m_out, v_out: the same arrays in place, or a second copy
// of the state (the overlapped step). Not restrict-qualified since in place they alias; the
// `simd` clause is what lets the compiler vectorise (element i reads and writes index i only).
template <class T>
void update(const T* p, const T* g, const T* m, const T* v, T* p_out, T* m_out, T* v_out, size_t n,
            const HostAdamWStep& s) {
  const double lr = s.lr, b1 = s.beta1, b2 = s.beta2, c1 = s.one_minus_beta1,
               c2 = s.one_minus_beta2, eps = s.eps, wd = s.weight_decay, bc1 = s.bias_correction1,
               bc2 = s.bias_correction2, scale = s.grad_scale;
  const auto count = static_cast<long long>(n);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMinElems)
  for (long long i = 0; i < count; ++i) {
    const double gi = scale * g[i];
    const double mi = b1 * m[i] + c1 * gi;
    const double vi = b2 * v[i] + c2 * gi * gi;
    const double step = (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    const double pi = p[i];
    p_out[i] = static_cast<T>(pi - lr * (step + wd * pi));
    m_out[i] = static_cast<T>(mi);
    v_out[i] = static_cast<T>(vi);
  }
}

#if defined(__SSE2__)
// The out-of-place f32 update with streaming stores. The second copy it writes is not in the
// cache, so plain stores would first read each line they fill (read for ownership): 40 bytes of
// memory traffic per element instead of the 28 of an update in place, and the update is
// memory-bound. Non-temporal stores write whole lines without reading them. The arithmetic is
// update()'s, operation for operation in double (SSE2 has no fused multiply-add, and its
// conversions round to nearest as static_cast does), so the bits are the same:
// tests/test_training_parts.cpp compares them.
struct Lanes {  // two elements in double
  __m128d p, g, m, v;
};

inline void update_lanes(Lanes& x, const HostAdamWStep& s) {
  const __m128d gi = _mm_mul_pd(_mm_set1_pd(s.grad_scale), x.g);
  const __m128d mi = _mm_add_pd(_mm_mul_pd(_mm_set1_pd(s.beta1), x.m),
                                _mm_mul_pd(_mm_set1_pd(s.one_minus_beta1), gi));
  const __m128d vi = _mm_add_pd(_mm_mul_pd(_mm_set1_pd(s.beta2), x.v),
                                _mm_mul_pd(_mm_mul_pd(_mm_set1_pd(s.one_minus_beta2), gi), gi));
  const __m128d step = _mm_div_pd(
      _mm_div_pd(mi, _mm_set1_pd(s.bias_correction1)),
      _mm_add_pd(_mm_sqrt_pd(_mm_div_pd(vi, _mm_set1_pd(s.bias_correction2))), _mm_set1_pd(s.eps)));
  x.p = _mm_sub_pd(x.p, _mm_mul_pd(_mm_set1_pd(s.lr),
                                   _mm_add_pd(step, _mm_mul_pd(_mm_set1_pd(s.weight_decay), x.p))));
  x.m = mi;
  x.v = vi;
}

inline __m128 join(__m128d lo, __m128d hi) {
  return _mm_movelh_ps(_mm_cvtpd_ps(lo), _mm_cvtpd_ps(hi));
}

void update_streaming(const float* p, const float* g, const float* m, const float* v, float* p_out,
                      float* m_out, float* v_out, size_t n, const HostAdamWStep& s) {
  auto misaligned = [](const float* x) { return reinterpret_cast<uintptr_t>(x) % 16; };
  // Scalar up to the outputs' 16-byte boundary (the three share it, or all goes scalar).
  size_t head = 0;
  while (head < n && misaligned(p_out + head) != 0) ++head;
  if (misaligned(m_out + head) != misaligned(p_out + head) ||
      misaligned(v_out + head) != misaligned(p_out + head))
    head = n;
  update(p, g, m, v, p_out, m_out, v_out, head, s);
  const auto blocks = static_cast<long long>((n - head) / 4);
#pragma omp parallel if (blocks * 4 >= static_cast <long long>(kParallelMinElems))
  {
#pragma omp for schedule(static)
    for (long long b = 0; b < blocks; ++b) {
      const size_t i = head + static_cast<size_t>(b) * 4;
      const __m128 pf = _mm_loadu_ps(p + i), gf = _mm_loadu_ps(g + i), mf = _mm_loadu_ps(m + i),
                   vf = _mm_loadu_ps(v + i);
      Lanes lo{_mm_cvtps_pd(pf), _mm_cvtps_pd(gf), _mm_cvtps_pd(mf), _mm_cvtps_pd(vf)};
      Lanes hi{_mm_cvtps_pd(_mm_movehl_ps(pf, pf)), _mm_cvtps_pd(_mm_movehl_ps(gf, gf)),
               _mm_cvtps_pd(_mm_movehl_ps(mf, mf)), _mm_cvtps_pd(_mm_movehl_ps(vf, vf))};
      update_lanes(lo, s);
      update_lanes(hi, s);
      _mm_stream_ps(p_out + i, join(lo.p, hi.p));
      _mm_stream_ps(m_out + i, join(lo.m, hi.m));
      _mm_stream_ps(v_out + i, join(lo.v, hi.v));
    }
    _mm_sfence();  // this thread's streaming stores are visible before the region ends
  }
  const size_t tail = head + static_cast<size_t>(blocks) * 4;
  update(p + tail, g + tail, m + tail, v + tail, p_out + tail, m_out + tail, v_out + tail, n - tail,
         s);
}
#endif

}  // namespace

bool host_adamw_scale(const AdamWArgs& a, double norm_sq, double* grad_scale) {
  *grad_scale = a.grad_scale;
  if (a.norm_sq.empty()) return true;
  return adamw_clipped_scale(norm_sq, a.grad_scale, a.max_norm, grad_scale);
}

HostAdamWStep host_adamw_step(const AdamWArgs& a, double grad_scale) {
  const double t = static_cast<double>(a.step);
  HostAdamWStep s;
  s.lr = a.lr;
  s.beta1 = a.beta1;
  s.beta2 = a.beta2;
  s.one_minus_beta1 = 1.0 - a.beta1;
  s.one_minus_beta2 = 1.0 - a.beta2;
  s.eps = a.eps;
  s.weight_decay = a.weight_decay;
  s.bias_correction1 = 1.0 - std::pow(a.beta1, t);
  s.bias_correction2 = 1.0 - std::pow(a.beta2, t);
  s.grad_scale = grad_scale;
  return s;
}

void host_adamw_update(float* p, const float* g, float* m, float* v, size_t n,
                       const HostAdamWStep& s) {
  update(p, g, m, v, p, m, v, n, s);
}
void host_adamw_update(double* p, const double* g, double* m, double* v, size_t n,
                       const HostAdamWStep& s) {
  update(p, g, m, v, p, m, v, n, s);
}
void host_adamw_update(const HostAdamWState<float>& in, const float* g,
                       const HostAdamWState<float>& out, size_t n, const HostAdamWStep& s) {
#if defined(__SSE2__)
  if (out.p != in.p) {
    update_streaming(in.p, g, in.m, in.v, out.p, out.m, out.v, n, s);
    return;
  }
#endif
  update(in.p, g, in.m, in.v, out.p, out.m, out.v, n, s);
}
void host_adamw_update(const HostAdamWState<double>& in, const double* g,
                       const HostAdamWState<double>& out, size_t n, const HostAdamWStep& s) {
  update(in.p, g, in.m, in.v, out.p, out.m, out.v, n, s);
}

}  // namespace moe
