// The router's gate matmul on the CPU: logits = x w^T and its backward, with x in any float
// storage dtype and everything else in acc_dtype(x) (the oracle of kernels/cuda/router_logits.cu).
//
// Plain loops, one fixed summation order per output, so results are bitwise the same for any
// thread count:
// - logits[n, e] = sum_k x[n, k] w[e, k], k ascending, in A (float, or double for f64 x); each
//   x value is widened exactly (16-bit storage fits in float);
// - dx[n, k] = round(dx[n, k] + sum_e dl[n, e] w[e, k]), the sum e ascending in A, then added to
//   the widened dx and rounded once to dx's dtype;
// - dw[e, k] += sum_n dl[n, e] x[n, k], the sum n ascending in A, then added to dw.
// Threads split rows (forward, dx) or (expert, column block) pairs (dw), never a sum.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/router_checks.hpp"
#include "cpu/convert_element.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/router.hpp"

namespace moe::cpu {
namespace {

// The arithmetic type of storage S: double for f64, float for the rest.
template <class S>
using acc_of = std::conditional_t<std::is_same_v<S, double>, double, float>;

// Columns per dw work item: long enough runs over a row of x, enough items to share out.
constexpr int64_t kDwColumns = 256;

template <class S>
void forward_impl(Tensor logits, Tensor x, Tensor w) {
  using A = acc_of<S>;
  const int64_t n_tok = x.size(0), d = x.size(1), n_exp = w.size(0);
  const S* xs = static_cast<const S*>(x.data);
  const A* ws = w.ptr<A>();
  A* out = logits.ptr<A>();
#pragma omp parallel if (parallel_worth(n_tok * d * (n_exp + 1)))
  {
    std::vector<A> row(static_cast<size_t>(d));  // x[n, :] widened once, used E times
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_tok; ++n) {
      for (int64_t k = 0; k < d; ++k) row[k] = widen<A>(xs[n * d + k]);
      for (int64_t e = 0; e < n_exp; ++e) {
        const A* we = ws + e * d;
        A s = 0;
        for (int64_t k = 0; k < d; ++k) s += row[k] * we[k];
        out[n * n_exp + e] = s;
      }
    }
  }
}

// dx[n, :] = round(dx[n, :] + dl[n, :] w)
template <class S>
void backward_dx_impl(Tensor dx, Tensor dlogits, Tensor w) {
  using A = acc_of<S>;
  const int64_t n_tok = dx.size(0), d = dx.size(1), n_exp = w.size(0);
  S* dxs = static_cast<S*>(dx.data);
  const A* dl = dlogits.ptr<A>();
  const A* ws = w.ptr<A>();
#pragma omp parallel if (parallel_worth(n_tok * d * (n_exp + 1)))
  {
    std::vector<A> sum(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_tok; ++n) {
      std::fill(sum.begin(), sum.end(), A(0));
      for (int64_t e = 0; e < n_exp; ++e) {  // e ascending for every column
        const A g = dl[n * n_exp + e];
        const A* we = ws + e * d;
        for (int64_t k = 0; k < d; ++k) sum[k] += g * we[k];
      }
      S* row = dxs + n * d;
      for (int64_t k = 0; k < d; ++k) row[k] = narrow<S>(widen<A>(row[k]) + sum[k]);
    }
  }
}

// dw[e, :] += dl[:, e]^T x, by (expert, column block) items.
template <class S>
void backward_dw_impl(Tensor dw, Tensor dlogits, Tensor x) {
  using A = acc_of<S>;
  const int64_t n_tok = x.size(0), d = x.size(1), n_exp = dw.size(0);
  const S* xs = static_cast<const S*>(x.data);
  const A* dl = dlogits.ptr<A>();
  A* out = dw.ptr<A>();
  const int64_t blocks = (d + kDwColumns - 1) / kDwColumns;
#pragma omp parallel if (parallel_worth(n_tok * d * n_exp))
  {
    std::vector<A> sum(static_cast<size_t>(kDwColumns));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_exp * blocks; ++item) {
      const int64_t e = item / blocks, k0 = (item % blocks) * kDwColumns;
      const int64_t cols = std::min(kDwColumns, d - k0);
      std::fill(sum.begin(), sum.end(), A(0));
      for (int64_t n = 0; n < n_tok; ++n) {  // n ascending for every column
        const A g = dl[n * n_exp + e];
        const S* xr = xs + n * d + k0;
        for (int64_t k = 0; k < cols; ++k) sum[k] += g * widen<A>(xr[k]);
      }
      for (int64_t k = 0; k < cols; ++k) out[e * d + k0 + k] += sum[k];
    }
  }
}

}  // namespace

// logits: [N, E] acc, x: [N, d] any float dtype, w: [E, d] acc
void router_logits_forward(Ctx& ctx, Tensor logits, Tensor x, Tensor w) {
  check_router_logits_forward_args(logits, x, w, ctx.device);
  dispatch_any_float(x.dtype, "router_logits_forward",
                     [&](auto zero) { forward_impl<decltype(zero)>(logits, x, w); });
}

// dx: [N, d] x's dtype (+=, one rounding), dw: [E, d] acc (+=), dlogits: [N, E] acc
void router_logits_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x, Tensor w) {
  check_router_logits_backward_args(dx, dw, dlogits, x, w, ctx.device);
  // Nothing to add: leave every bit alone (an added +0 would turn a -0 into +0).
  if (x.size(0) == 0 || x.size(1) == 0 || w.size(0) == 0) return;
  dispatch_any_float(x.dtype, "router_logits_backward", [&](auto zero) {
    using S = decltype(zero);
    if (!dx.empty()) backward_dx_impl<S>(dx, dlogits, w);
    backward_dw_impl<S>(dw, dlogits, x);
  });
}

}  // namespace moe::cpu
