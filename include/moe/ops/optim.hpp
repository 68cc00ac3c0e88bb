// AdamW with decoupled weight decay over a contiguous segment of the parameter buffer.
//   g' = s * g;  m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2
//   p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * p)
// with s = grad_scale, or, when norm_sq is given (global-norm clipping decided on the device, no
// host read of the norm):
//   norm = grad_scale * sqrt(norm_sq[0])        (the norm of the gradient grad_scale * g)
//   norm not finite (fp16 overflow):  the step is skipped: p, m and v stay bitwise unchanged
//   max_norm > 0 and norm > max_norm: s = grad_scale * max_norm / (norm + 1e-6)
//   otherwise:                        s = grad_scale
// (the same factor as moe::clip_factor, so s equals grad_scale * clip_factor(norm, max_norm)).
//
// With AdamWArgs::compute_out (the 16-bit compute copy of a mixed-precision model) the op also
// writes compute_out[i] = p[i] converted, bitwise what convert(ctx, compute_out, p, false) would
// write after the step: the trainer so saves a whole-buffer pass over the weights per step. A
// skipped step leaves compute_out unchanged too (as it was, not a fresh conversion of p).
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

struct AdamWArgs {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  long step = 1;            // t, 1-based, for bias correction
  double grad_scale = 1.0;  // applied to g first (clipping, loss-scale and accumulation factor)
  // Empty, or a 1-element f64 tensor on p's device holding sum(g^2) of the whole gradient as stored
  // (sum_squares over every segment), read by the op itself: clip and overflow skip on the device.
  Tensor norm_sq;
  double max_norm = 0;  // clip threshold on grad_scale * sqrt(norm_sq[0]); <= 0: no clipping
  // Empty, or as many elements as p, of dtype bf16, f16 or f32, on p's device (not overlapping
  // p, g, m or v): receives the updated p converted, rounded as the convert op rounds.
  Tensor compute_out;
  // Empty, or a 1-element f64 tensor on p's device (not with norm_sq): the op adds sum(g^2) over
  // its g, as stored (what sum_squares adds), into grad_sq_out[0], from its own read of g (CUDA:
  // block partials added in a fixed order: deterministic for a shape, not sum_squares's bits).
  // The trainer's gradient norm when nothing is clipped or skipped, without a pass of its own.
  Tensor grad_sq_out;
};

// p, g, m, v: same element count and float dtype (m, v start at 0); step >= 1. The trainer runs it
// over fp32 master weights, gradients and moments.
MOE_OP(adamw_step, (Ctx & ctx, Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a),
       (ctx, p, g, m, v, a))

// AdamW over a split fp32 master (kernels/common/split_master.hpp, train.split_master): hi (bf16,
// the model's compute copy) and lo (u16) hold p; g, m, v are f32, all of one element count. Each
// element's p is decoded, updated by adamw_step's own element math (so the stored master is
// bitwise what adamw_step would store from the same fp32 p, on the same backend) and encoded
// back. a.compute_out must be empty: hi is the compute copy. A skipped step leaves everything.
MOE_OP(adamw_step_split,
       (Ctx & ctx, Tensor hi, Tensor lo, Tensor g, Tensor m, Tensor v, const AdamWArgs& a),
       (ctx, hi, lo, g, m, v, a))

// master[i] = the fp32 value that (hi[i], lo[i]) encode: master f32, hi bf16, lo u16, one count.
MOE_OP(split_master_decode, (Ctx & ctx, Tensor master, Tensor hi, Tensor lo), (ctx, master, hi, lo))

}  // namespace moe
