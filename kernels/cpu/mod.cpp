// Mixture-of-Depths on the CPU: per-sequence top-C token selection, the gather of the selected rows
// (and its accumulating backward), and the gated scatter out_i = x_i + sigmoid(r_i) (ys_i - x_i)
// that writes the block's output back (and its backward into x, ys and the scores).
//
// Selection ranks positions by a strict total order (higher score first, then lower position), so
// the kept set is unique even with ties and the same on every backend; the kept positions are then
// listed in ascending order so causal attention among them stays causal. Each sequence is an
// independent task over OpenMP threads with one index scratch per thread.
// The gather/scatter loops run over rows on OpenMP threads. They rely on sel being strictly
// ascending within a sequence (what mod_select produces), which makes every written row owned by
// exactly one selected slot: no races, results bitwise the same for any thread count. sel is
// validated serially before the parallel loops, so nothing throws inside them.
#include <algorithm>
#include <string>
#include <vector>

#include "common/mod_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/mod.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kSelectWork = 16;  // scalar operations per position of a top-C selection

// Throws unless sel is i32 and each of its rows is strictly ascending inside [0, T).
void check_sel(const Tensor& sel, int64_t t, const char* op) {
  check_mod_sel_args(sel, t, op);
  const int64_t b = sel.size(0), c = sel.size(1);
  const int32_t* s = sel.ptr<int32_t>();
  for (int64_t i = 0; i < b * c; ++i) {
    const bool first = i % c == 0;
    MOE_CHECK(0 <= s[i] && s[i] < t && (first || s[i - 1] < s[i]),
              std::string(op) + ": sel[" + std::to_string(i / c) + ", " + std::to_string(i % c) +
                  "] = " + std::to_string(s[i]) + " is outside [0, T) or not ascending");
  }
}

// Top-C positions of one sequence, ascending.  score: [T], sel: [C], idx: scratch of T.
template <class T>
void select_row(const T* score, int64_t t, int64_t c, int32_t* sel, std::vector<int32_t>& idx) {
  idx.resize(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) idx[i] = static_cast<int32_t>(i);
  auto ranks_before = [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + c, idx.end(), ranks_before);
  std::sort(idx.begin(), idx.begin() + c);
  std::copy(idx.begin(), idx.begin() + c, sel);
}

template <class T>
void select_impl(Tensor sel, Tensor mask, Tensor scores) {
  const int64_t b = scores.size(0), t = scores.size(1), c = sel.size(1);
  const T* r = scores.ptr<T>();
  T* m = mask.ptr<T>();
  int32_t* s = sel.ptr<int32_t>();
#pragma omp parallel if (parallel_worth(b * t * kSelectWork))
  {
    std::vector<int32_t> idx;  // one scratch per thread
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < b; ++bi) {
      select_row(r + bi * t, t, c, s + bi * c, idx);
      T* mb = m + bi * t;
      for (int64_t i = 0; i < t; ++i) mb[i] = T(0);
      for (int64_t j = 0; j < c; ++j) mb[s[bi * c + j]] = T(1);
    }
  }
}

// Row of x (in [B*T, d]) that selected slot i = b*C + c reads.
inline int64_t source_row(const int32_t* sel, int64_t i, int64_t c, int64_t t) {
  return (i / c) * t + sel[i];
}

template <class T>
void gather_forward_impl(Tensor xs, Tensor x, Tensor sel, int64_t t) {
  const int64_t rows = xs.size(0), d = xs.size(1), c = sel.size(1);
  T* out = xs.ptr<T>();
  const T* in = x.ptr<T>();
  const int32_t* s = sel.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (parallel_worth(rows * d))
  for (int64_t i = 0; i < rows; ++i) {
    const T* src = in + source_row(s, i, c, t) * d;
    for (int64_t j = 0; j < d; ++j) out[i * d + j] = src[j];
  }
}

template <class T>
void gather_backward_impl(Tensor dx, Tensor dxs, Tensor sel, int64_t t) {
  const int64_t rows = dxs.size(0), d = dxs.size(1), c = sel.size(1);
  T* out = dx.ptr<T>();
  const T* in = dxs.ptr<T>();
  const int32_t* s = sel.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (parallel_worth(rows * d))
  for (int64_t i = 0; i < rows; ++i) {
    T* dst = out + source_row(s, i, c, t) * d;
    for (int64_t j = 0; j < d; ++j) dst[j] += in[i * d + j];
  }
}

template <class T>
void copy_rows(T* dst, const T* src, int64_t n) {
  if (dst == src) return;
#pragma omp parallel for schedule(static) if (parallel_worth(n))
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

template <class T>
void scatter_forward_impl(Tensor out, Tensor x, Tensor ys, Tensor scores, Tensor sel, int64_t t) {
  const int64_t rows = ys.size(0), d = ys.size(1), c = sel.size(1);
  T* o = out.ptr<T>();
  const T* xp = x.ptr<T>();
  const T* y = ys.ptr<T>();
  const T* r = scores.ptr<T>();
  const int32_t* s = sel.ptr<int32_t>();
  copy_rows(o, xp, x.numel());  // skipped rows: out = x
#pragma omp parallel for schedule(static) if (parallel_worth(rows * d))
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = source_row(s, i, c, t);
    const T g = sigmoid(r[row]);  // scores: [B, T] has the same flat index as the row of x
    for (int64_t j = 0; j < d; ++j) {
      const T xv = xp[row * d + j];
      o[row * d + j] = xv + g * (y[i * d + j] - xv);
    }
  }
}

template <class T>
void scatter_backward_impl(Tensor dx, Tensor dys, Tensor dscores, Tensor dout, Tensor x, Tensor ys,
                           Tensor scores, Tensor sel, int64_t t) {
  const int64_t rows = ys.size(0), d = ys.size(1), c = sel.size(1);
  T* dxp = dx.ptr<T>();
  T* dy = dys.ptr<T>();
  T* dr = dscores.ptr<T>();
  const T* go = dout.ptr<T>();
  const T* xp = x.ptr<T>();
  const T* y = ys.ptr<T>();
  const T* r = scores.ptr<T>();
  const int32_t* s = sel.ptr<int32_t>();
  copy_rows(dxp, go, dout.numel());  // skipped rows: dx = dout
  const int64_t n_scores = scores.numel();
#pragma omp parallel for schedule(static) if (parallel_worth(n_scores))
  for (int64_t i = 0; i < n_scores; ++i) dr[i] = T(0);
#pragma omp parallel for schedule(static) if (parallel_worth(rows * d))
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = source_row(s, i, c, t);
    const T g = sigmoid(r[row]);
    double dot = 0;  // <dout, ys - x>, read before dx (which may alias dout) is scaled
    for (int64_t j = 0; j < d; ++j) {
      const T gj = go[row * d + j];
      dot += static_cast<double>(gj) * (static_cast<double>(y[i * d + j]) - xp[row * d + j]);
      dy[i * d + j] = g * gj;
      dxp[row * d + j] = (T(1) - g) * gj;
    }
    dr[row] = static_cast<T>(static_cast<double>(g) * (1.0 - g) * dot);
  }
}

}  // namespace

// ---- selection ----------------------------------------------------------------------------------

void mod_select(Ctx& ctx, Tensor sel, Tensor mask, Tensor scores) {
  check_mod_select_args(sel, mask, scores);
  dispatch_float(scores.dtype, "mod_select", [&](auto zero) {
    using T = decltype(zero);
    select_impl<T>(sel, mask, scores);
  });
}

// ---- gather -------------------------------------------------------------------------------------

void mod_gather_forward(Ctx& ctx, Tensor xs, Tensor x, Tensor sel) {
  const int64_t t = mod_seq_len(x, sel, "mod_gather_forward");
  check_sel(sel, t, "mod_gather_forward");
  check_shape(xs, {sel.size(0) * sel.size(1), x.size(1)}, "mod_gather_forward: xs");
  check_same_dtype(xs, x, "mod_gather_forward: xs, x");
  dispatch_float(x.dtype, "mod_gather_forward", [&](auto zero) {
    using T = decltype(zero);
    gather_forward_impl<T>(xs, x, sel, t);
  });
}

void mod_gather_backward(Ctx& ctx, Tensor dx, Tensor dxs, Tensor sel) {
  const int64_t t = mod_seq_len(dx, sel, "mod_gather_backward");
  check_sel(sel, t, "mod_gather_backward");
  check_shape(dxs, {sel.size(0) * sel.size(1), dx.size(1)}, "mod_gather_backward: dxs");
  check_same_dtype(dxs, dx, "mod_gather_backward: dxs, dx");
  dispatch_float(dx.dtype, "mod_gather_backward", [&](auto zero) {
    using T = decltype(zero);
    gather_backward_impl<T>(dx, dxs, sel, t);
  });
}

// ---- gated scatter ------------------------------------------------------------------------------

void mod_scatter_forward(Ctx& ctx, Tensor out, Tensor x, Tensor ys, Tensor scores, Tensor sel) {
  const int64_t t = mod_seq_len(x, sel, "mod_scatter_forward");
  check_sel(sel, t, "mod_scatter_forward");
  check_mod_scatter_forward_args(out, x, ys, scores, sel, t);
  dispatch_float(x.dtype, "mod_scatter_forward", [&](auto zero) {
    using T = decltype(zero);
    scatter_forward_impl<T>(out, x, ys, scores, sel, t);
  });
}

void mod_scatter_backward(Ctx& ctx, Tensor dx, Tensor dys, Tensor dscores, Tensor dout, Tensor x,
                          Tensor ys, Tensor scores, Tensor sel) {
  const int64_t t = mod_seq_len(x, sel, "mod_scatter_backward");
  check_sel(sel, t, "mod_scatter_backward");
  check_mod_scatter_backward_args(dx, dys, dscores, dout, x, ys, scores, sel, t);
  dispatch_float(x.dtype, "mod_scatter_backward", [&](auto zero) {
    using T = decltype(zero);
    scatter_backward_impl<T>(dx, dys, dscores, dout, x, ys, scores, sel, t);
  });
}

}  // namespace moe::cpu
