// Linear layers on the CPU, weights stored [out_features, in_features] (Hugging Face layout), all
// through BLAS gemm. OpenBLAS threads each call itself; its gemm splits the output among threads,
// not the inner sums, so results should not depend on the thread count. The grouped variant runs
// the experts' matmuls one after another over the row ranges given by offsets; an expert with no
// rows is skipped, which is exactly "+= 0" for its weight gradient and writes no rows. A bf16
// weight gradient (beside f32 inputs: the reference of linear.hpp's bf16 form) is summed in an
// fp32 temporary and rounded once per element.
#include <algorithm>
#include <string>

#include "common/float16.hpp"
#include "common/linear_checks.hpp"
#include "common/optim_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/memory.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe::cpu {
namespace {

// offsets: [E+1] i32, 0 = offsets[0] <= ... <= offsets[E] = rows. Returns the host pointer.
const int32_t* checked_offsets(const Tensor& offsets, int64_t experts, int64_t rows,
                               const char* op) {
  check_grouped_offsets_args(offsets, experts, op);
  const int32_t* o = offsets.ptr<int32_t>();
  MOE_CHECK(o[0] == 0 && o[experts] == rows,
            std::string(op) + ": offsets must run from 0 to the row count " + std::to_string(rows) +
                ", got " + std::to_string(o[0]) + " .. " + std::to_string(o[experts]));
  for (int64_t e = 0; e < experts; ++e)
    MOE_CHECK(o[e] <= o[e + 1],
              std::string(op) + ": offsets decrease at expert " + std::to_string(e));
  return o;
}

// The gathered ops' reference: src's rows row_token[r] copied into `rows` (allocated here).
Tensor permuted_copy(Ctx& ctx, Buffer& rows, const Tensor& src, const Tensor& row_token) {
  const int64_t r = row_token.size(0), width = src.size(1);
  rows = Buffer(src.device, static_cast<size_t>(r * width) * dtype_size(src.dtype));
  const Tensor copy = rows.as(src.dtype, {r, width});
  cpu::permute_forward(ctx, copy, src, row_token);
  return copy;
}

// The bf16 gradient form's rounding (linear.hpp): dw[e] = bf16(sums[e]), or bf16(float(dw[e]) +
// sums[e]) unless overwrite, where an expert without rows keeps its bits. dw: [E, per_expert]
// bf16, sums: the fp32 gradient from zero.
void round_into_bf16(Tensor dw, const float* sums, const int32_t* off, int64_t experts,
                     int64_t per_expert, bool overwrite) {
  uint16_t* d = static_cast<uint16_t*>(dw.data);
  for (int64_t e = 0; e < experts; ++e) {
    if (!overwrite && off[e] == off[e + 1]) continue;
    const int64_t begin = e * per_expert, end = begin + per_expert;
    for (int64_t i = begin; i < end; ++i)
      d[i] = float16::float_to_bf16(overwrite ? sums[i] : float16::bf16_to_float(d[i]) + sums[i]);
  }
}

}  // namespace

// y: [N, out] (= or +=), x: [N, in], w: [out, in]
void linear_forward(Ctx& ctx, Tensor y, Tensor x, Tensor w, bool accumulate) {
  const LinearDims s = check_linear_forward_args(y, x, w);
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
  const LinearDims s = check_linear_backward_args(dx, dw, dy, x, w);
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

// y: [B, N, out], x: [N, in], w: [B, out, in]
void linear_forward_batched(Ctx& ctx, Tensor y, Tensor x, Tensor w) {
  const int64_t batch = linear_batch(y, w, "linear_forward_batched");
  for (int64_t b = 0; b < batch; ++b)
    cpu::linear_forward(ctx, batch_item(y, b), x, batch_item(w, b), false);
}

// dx: [N, in] (= or +=; skipped when empty), dw: [B, out, in] (+=), dy: [B, N, out]
void linear_backward_batched(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                             bool accumulate_dx) {
  const int64_t batch = linear_batch(dy, w, "linear_backward_batched");
  check_shape(dw, {batch, w.size(1), w.size(2)}, "linear_backward_batched: dw");
  for (int64_t b = 0; b < batch; ++b)
    cpu::linear_backward(ctx, dx, batch_item(dw, b), batch_item(dy, b), x, batch_item(w, b),
                         accumulate_dx || b > 0);
}

// y: [R, out], x: [R, in], w: [E, out, in], offsets: [E+1]
void grouped_linear_forward(Ctx& ctx, Tensor y, Tensor x, Tensor w, Tensor offsets) {
  const GroupedDims s = linear_grouped_dims(x, w, "grouped_linear_forward");
  check_grouped_linear_forward_args(s, y, x, w);
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

// The two backward products in turn, the second's dx in dx2, then dx += dx2.
void grouped_linear_backward_pair(Ctx& ctx, Tensor dx, Tensor dx2, Tensor dw1, Tensor dw3,
                                  Tensor dy1, Tensor dy3, Tensor x, Tensor w1, Tensor w3,
                                  Tensor offsets, bool dw_overwrite) {
  const GroupedDims s = linear_grouped_dims(x, w1, "grouped_linear_backward_pair");
  check_grouped_linear_backward_pair_args(s, dx, dx2, dw1, dw3, dy1, dy3, x, w1, w3);
  MOE_CHECK(!dx2.empty(), "grouped_linear_backward_pair: the CPU op needs dx2 (its workspace)");
  cpu::grouped_linear_backward(ctx, dx, dw1, dy1, x, w1, offsets, dw_overwrite);
  cpu::grouped_linear_backward(ctx, dx2, dw3, dy3, x, w3, offsets, dw_overwrite);
  cpu::add(ctx, dx, dx, dx2);
}

// The permute into a buffer of its own, then the pair.
void grouped_linear_backward_pair_gathered(Ctx& ctx, Tensor dx, Tensor dx2, Tensor dw1, Tensor dw3,
                                           Tensor dy1, Tensor dy3, Tensor x, Tensor row_token,
                                           Tensor w1, Tensor w3, Tensor offsets,
                                           bool dw_overwrite) {
  check_grouped_linear_backward_pair_gathered_args(dx, dx2, dw1, dw3, dy1, dy3, x, row_token, w1,
                                                   w3);
  Buffer rows;
  cpu::grouped_linear_backward_pair(ctx, dx, dx2, dw1, dw3, dy1, dy3,
                                    permuted_copy(ctx, rows, x, row_token), w1, w3, offsets,
                                    dw_overwrite);
}

// The product, then the update (the two ops in turn).
void grouped_linear_forward_adamw(Ctx& ctx, Tensor y, Tensor x, Tensor w, Tensor offsets, Tensor hi,
                                  Tensor lo, Tensor g, Tensor m, Tensor v, const AdamWArgs& a) {
  check_adamw_step_split_args(hi, lo, g, m, v, a);
  check_update_apart({&hi, &lo, &g, &m, &v}, {&y, &x, &w, &offsets},
                     "grouped_linear_forward_adamw");
  cpu::grouped_linear_forward(ctx, y, x, w, offsets);
  cpu::adamw_step_split(ctx, hi, lo, g, m, v, a);
}

// dx: [R, in] (overwritten), dw: [E, out, in] (+=, or = with dw_overwrite), dy: [R, out]
void grouped_linear_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                             Tensor offsets, bool dw_overwrite) {
  const GroupedDims s = linear_grouped_dims(x, w, "grouped_linear_backward");
  check_grouped_linear_backward_args(s, dx, dw, dy, x, w);
  const int32_t* off = checked_offsets(offsets, s.experts, s.rows, "grouped_linear_backward");
  if (dw.dtype == DType::bf16) {  // (beside f32 x) the fp32 sums from zero, then one rounding
    Buffer sums(dw.device, static_cast<size_t>(dw.numel()) * sizeof(float));
    const Tensor f32_dw = sums.as(DType::f32, {s.experts, s.out, s.in});
    cpu::grouped_linear_backward(ctx, dx, f32_dw, dy, x, w, offsets, true);
    round_into_bf16(dw, f32_dw.ptr<float>(), off, s.experts, s.out * s.in, dw_overwrite);
    return;
  }
  dispatch_float(x.dtype, "grouped_linear_backward", [&](auto zero) {
    using T = decltype(zero);
    for (int64_t e = 0; e < s.experts; ++e) {
      const int64_t r0 = off[e], m = off[e + 1] - off[e];
      T* dw_e = dw.ptr<T>() + e * s.out * s.in;
      // dw_overwrite: from zero (whatever dw held, NaN included), then as +=
      if (dw_overwrite) std::fill(dw_e, dw_e + s.out * s.in, T(0));
      if (m == 0) continue;  // no rows: dw[e] += 0
      const T* dy_e = dy.ptr<T>() + r0 * s.out;
      const T* x_e = x.ptr<T>() + r0 * s.in;
      const T* w_e = w.ptr<T>() + e * s.out * s.in;
      // dx_e = dy_e w[e]
      gemm(false, false, m, s.in, s.out, T(1), dy_e, s.out, w_e, s.in, T(0),
           dx.ptr<T>() + r0 * s.in, s.in);
      // dw[e] += dy_e^T x_e
      gemm(true, false, s.out, s.in, m, T(1), dy_e, s.out, x_e, s.in, T(1), dw_e, s.in);
    }
  });
}

// The three ops in turn (the CPU has nothing to gain from fusing them).
void grouped_swiglu_forward(Ctx& ctx, Tensor gate, Tensor up, Tensor h, Tensor x, Tensor w1,
                            Tensor w3, Tensor row_w, Tensor offsets) {
  const GroupedDims s = linear_grouped_dims(x, w1, "grouped_swiglu_forward");
  check_grouped_swiglu_forward_args(s, gate, up, h, x, w1, w3, row_w);
  cpu::grouped_linear_forward(ctx, gate, x, w1, offsets);
  cpu::grouped_linear_forward(ctx, up, x, w3, offsets);
  cpu::swiglu_weighted_forward(ctx, h, gate, up, row_w);
}

// The permute into a buffer of its own, then the backward.
void grouped_linear_backward_gathered(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x,
                                      Tensor row_token, Tensor w, Tensor offsets,
                                      bool dw_overwrite) {
  check_grouped_linear_backward_gathered_args(dx, dw, dy, x, row_token, w);
  Buffer rows;
  cpu::grouped_linear_backward(ctx, dx, dw, dy, permuted_copy(ctx, rows, x, row_token), w, offsets,
                               dw_overwrite);
}

// The permute into a buffer of its own, then the three ops.
void grouped_swiglu_forward_gathered(Ctx& ctx, Tensor gate, Tensor up, Tensor h, Tensor x,
                                     Tensor row_token, Tensor w1, Tensor w3, Tensor row_w,
                                     Tensor offsets) {
  check_grouped_swiglu_forward_gathered_args(gate, up, h, x, row_token, w1, w3, row_w);
  Buffer rows;
  cpu::grouped_swiglu_forward(ctx, gate, up, h, permuted_copy(ctx, rows, x, row_token), w1, w3,
                              row_w, offsets);
}

// dh into dgate, then the elementwise backward in place (swiglu_weighted_backward reads an
// element's inputs before writing its outputs).
void grouped_swiglu_down_backward(Ctx& ctx, Tensor dgate, Tensor dup, Tensor drow_w, Tensor dw2,
                                  Tensor dy, Tensor h, Tensor w2, Tensor gate, Tensor up,
                                  Tensor row_w, Tensor offsets, bool dw_overwrite) {
  const GroupedDims s = linear_grouped_dims(h, w2, "grouped_swiglu_down_backward");
  check_grouped_swiglu_down_backward_args(s, dgate, dup, drow_w, dw2, dy, h, w2, gate, up, row_w);
  cpu::grouped_linear_backward(ctx, dgate, dw2, dy, h, w2, offsets, dw_overwrite);
  cpu::swiglu_weighted_backward(ctx, dgate, dup, drow_w, dgate, gate, up, row_w);
}

// The permute into a buffer of its own, then the backward.
void grouped_swiglu_down_backward_gathered(Ctx& ctx, Tensor dgate, Tensor dup, Tensor drow_w,
                                           Tensor dw2, Tensor dy, Tensor row_token, Tensor h,
                                           Tensor w2, Tensor gate, Tensor up, Tensor row_w,
                                           Tensor offsets, bool dw_overwrite) {
  check_grouped_swiglu_down_backward_gathered_args(dgate, dup, drow_w, dw2, dy, row_token, h, w2,
                                                   gate, up, row_w);
  Buffer rows;
  cpu::grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, dw2,
                                    permuted_copy(ctx, rows, dy, row_token), h, w2, gate, up, row_w,
                                    offsets, dw_overwrite);
}

}  // namespace moe::cpu
