// Token permutation for dropless MoE on the CPU: the plan that lays the N*K routed slots out in
// expert order, the gather that builds the permuted activations and its backward (which is also the
// combine of the experts' outputs: the routing weights are applied in their SwiGLU), and the
// routing weights put into row order.
//
// The plan is a counting sort by expert that is stable in the slot index s = n*K + k, so the layout
// (and with it every later sum) is the same on every run and every backend. It is O(N*K) index
// work and runs serially; it reuses `offsets` as the running cursor so it needs no scratch.
// Every data movement is written as a gather, or as a write to a row owned by exactly one slot
// (slot_row is a permutation), so the row loops run over OpenMP threads with no races and no
// atomics, and each output element is summed in a fixed order (k = 0..K-1): results are bitwise
// the same for any thread count. Index tensors are validated serially before the parallel loops.
#include <string>

#include "common/permute_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/permute.hpp"

namespace moe::cpu {
namespace {

// Throws unless every idx[i] lies in [0, bound).
void check_indices(const int32_t* idx, int64_t n, int64_t bound, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(0 <= idx[i] && idx[i] < bound, std::string(what) + "[" + std::to_string(i) +
                                                 "] = " + std::to_string(idx[i]) + " outside [0, " +
                                                 std::to_string(bound) + ")");
}

template <class T>
void permute_forward_impl(Tensor xp, Tensor x, Tensor row_token) {
  const int64_t rows = xp.size(0), d = xp.size(1);
  T* out = xp.ptr<T>();
  const T* in = x.ptr<T>();
  const int32_t* tok = row_token.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (parallel_worth(rows * d))
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = in + tok[r] * d;
    T* dst = out + r * d;
    for (int64_t j = 0; j < d; ++j) dst[j] = src[j];
  }
}

// base (optional, dx's shape): the sums start from its rows instead of 0.
template <class T>
void permute_backward_impl(Tensor dx, Tensor dxp, Tensor dxp2, Tensor slot_row, int64_t k,
                           Tensor base = Tensor()) {
  const int64_t n_tok = dx.size(0), d = dx.size(1);
  const T* from = base.empty() ? nullptr : base.ptr<T>();
  T* out = dx.ptr<T>();
  const T* in = dxp.ptr<T>();
  const T* in2 = dxp2.empty() ? nullptr : dxp2.ptr<T>();
  const int32_t* row = slot_row.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (parallel_worth(n_tok * k * d))
  for (int64_t n = 0; n < n_tok; ++n) {
    T* dst = out + n * d;
    for (int64_t j = 0; j < d; ++j) dst[j] = from != nullptr ? from[n * d + j] : T(0);
    for (int64_t i = 0; i < k; ++i) {
      const T* src = in + row[n * k + i] * d;
      for (int64_t j = 0; j < d; ++j) dst[j] += src[j];
      if (in2 == nullptr) continue;
      const T* src2 = in2 + row[n * k + i] * d;
      for (int64_t j = 0; j < d; ++j) dst[j] += src2[j];
    }
  }
}

}  // namespace

// ---- plan ---------------------------------------------------------------------------------------

void moe_permute_plan(Ctx& ctx, Tensor offsets, Tensor row_token, Tensor slot_row,
                      Tensor topk_idx) {
  check_moe_permute_plan_args(offsets, row_token, slot_row, topk_idx);
  const int64_t n_tok = topk_idx.size(0), k = topk_idx.size(1), slots = n_tok * k;
  const int64_t n_exp = offsets.size(0) - 1;
  const int32_t* expert = topk_idx.ptr<int32_t>();
  check_indices(expert, slots, n_exp, "moe_permute_plan: topk_idx");
  int32_t* off = offsets.ptr<int32_t>();
  int32_t* tok = row_token.ptr<int32_t>();
  int32_t* row = slot_row.ptr<int32_t>();
  // Histogram into off[e+1], prefix sum: off[e] = first row of e.
  for (int64_t e = 0; e <= n_exp; ++e) off[e] = 0;
  for (int64_t s = 0; s < slots; ++s) ++off[expert[s] + 1];
  for (int64_t e = 0; e < n_exp; ++e) off[e + 1] += off[e];
  // Stable placement with off[e] as the cursor of e; afterwards off[e] = old off[e+1].
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t r = off[expert[s]]++;
    row[s] = r;
    tok[r] = static_cast<int32_t>(s / k);
  }
  for (int64_t e = n_exp; e > 0; --e) off[e] = off[e - 1];
  off[0] = 0;
}

// ---- permute ------------------------------------------------------------------------------------

void permute_forward(Ctx& ctx, Tensor xp, Tensor x, Tensor row_token) {
  check_permute_forward_args(xp, x, row_token);
  const int64_t rows = row_token.size(0), n_tok = x.size(0);
  check_indices(row_token.ptr<int32_t>(), rows, n_tok, "permute_forward: row_token");
  dispatch_float(x.dtype, "permute_forward", [&](auto zero) {
    using T = decltype(zero);
    permute_forward_impl<T>(xp, x, row_token);
  });
}

// permute_backward and permute_backward_add after their shape checks (dxp2, base: empty or not).
static void gather_sum(Tensor dx, Tensor dxp, Tensor dxp2, Tensor base, Tensor slot_row, int64_t k,
                       const std::string& op) {
  const int64_t slots = slot_row.size(0);
  check_indices(slot_row.ptr<int32_t>(), slots, slots, (op + ": slot_row").c_str());
  dispatch_float(dx.dtype, op.c_str(), [&](auto zero) {
    using T = decltype(zero);
    permute_backward_impl<T>(dx, dxp, dxp2, slot_row, k, base);
  });
}

void permute_backward(Ctx& ctx, Tensor dx, Tensor dxp, Tensor dxp2, Tensor slot_row) {
  const int64_t k = check_permute_backward_args(dx, dxp, dxp2, slot_row);
  gather_sum(dx, dxp, dxp2, Tensor(), slot_row, k, "permute_backward");
}

void permute_backward_add(Ctx& ctx, Tensor y, Tensor base, Tensor yp, Tensor slot_row) {
  const int64_t k = check_permute_backward_add_args(y, base, yp, slot_row);
  gather_sum(y, yp, Tensor(), base, slot_row, k, "permute_backward_add");
}

// ---- routing weights in row order ---------------------------------------------------------------

void permute_weights_forward(Ctx& ctx, Tensor row_w, Tensor topk_w, Tensor slot_row) {
  check_permute_weights_args(row_w, topk_w, slot_row, "permute_weights_forward", "row_w", "topk_w");
  const int64_t slots = slot_row.size(0);
  const int32_t* row = slot_row.ptr<int32_t>();
  check_indices(row, slots, slots, "permute_weights_forward: slot_row");
  dispatch_float(topk_w.dtype, "permute_weights_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* w = topk_w.ptr<T>();
    T* out = row_w.ptr<T>();
    for (int64_t s = 0; s < slots; ++s) out[row[s]] = w[s];  // a permutation: each row once
  });
}

void permute_weights_backward(Ctx& ctx, Tensor dtopk_w, Tensor drow_w, Tensor slot_row) {
  check_permute_weights_args(drow_w, dtopk_w, slot_row, "permute_weights_backward", "drow_w",
                             "dtopk_w");
  const int64_t slots = slot_row.size(0);
  const int32_t* row = slot_row.ptr<int32_t>();
  check_indices(row, slots, slots, "permute_weights_backward: slot_row");
  dispatch_float(dtopk_w.dtype, "permute_weights_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* in = drow_w.ptr<T>();
    T* out = dtopk_w.ptr<T>();
    for (int64_t s = 0; s < slots; ++s) out[s] = in[row[s]];
  });
}

}  // namespace moe::cpu
