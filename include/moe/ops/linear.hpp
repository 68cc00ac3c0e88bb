// Matmuls with weights stored [out_features, in_features] row-major (Hugging Face layout).
#pragma once
#include "moe/ops/common.hpp"
#include "moe/ops/optim.hpp"

namespace moe {

// y = x w^T (accumulate: y += x w^T)        y: [N, out], x: [N, in], w: [out, in]; y in x's dtype
// or, for 16-bit x on CUDA, in acc_dtype(x) (the fp32 sums stored unrounded).
MOE_OP(linear_forward, (Ctx & ctx, Tensor y, Tensor x, Tensor w, bool accumulate),
       (ctx, y, x, w, accumulate))
// dx = dy w (or dx += when accumulate_dx; skipped when dx is empty), dw += dy^T x
// dw in acc_dtype(x): a 16-bit product is accumulated into the fp32 gradient with one rounding.
MOE_OP(linear_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, bool accumulate_dx),
       (ctx, dx, dw, dy, x, w, accumulate_dx))

// One x against B weights (the attention's q, k and v projections): y[b] = x w[b]^T, y: [B, N,
// out], w: [B, out, in], x: [N, in]; B >= 1. Bitwise linear_forward per b; the CUDA backend
// issues the B products as one launch (cuBLAS strided batched).
MOE_OP(linear_forward_batched, (Ctx & ctx, Tensor y, Tensor x, Tensor w), (ctx, y, x, w))
// dx = sum_b dy[b] w[b] (+= when accumulate_dx; skipped when dx is empty), dw[b] += dy[b]^T x:
// linear_backward per b in turn (the first with accumulate_dx, the others accumulating), dw
// [B, out, in] in acc_dtype(x), dy: [B, N, out]. The CUDA backend issues the B weight gradients
// as one launch.
MOE_OP(linear_backward_batched,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, bool accumulate_dx),
       (ctx, dx, dw, dy, x, w, accumulate_dx))

// Grouped (per-expert) linear over rows sorted by expert: rows [offsets[e], offsets[e+1]) use w[e].
// y: [R, out], x: [R, in], w: [E, out, in], offsets: [E+1] i32 (offsets[0] = 0, offsets[E] = R),
// resident on ctx's device (never copied to the host by the CUDA backend). Empty groups are fine.
MOE_OP(grouped_linear_forward, (Ctx & ctx, Tensor y, Tensor x, Tensor w, Tensor offsets),
       (ctx, y, x, w, offsets))
// dx = dy w[e] per group (overwritten), dw[e] += dy_e^T x_e (an expert with no rows gets += 0),
// dw in acc_dtype(x). dw_overwrite: dw[e] = dy_e^T x_e instead (0 for an expert with no rows),
// whatever dw held: the first backward after the gradients were cleared, which so needs no
// zeroing pass over the experts' gradients (Model::zero_grads leaves them) and, on sm_90, no read
// of them either. The one exception to the ops' parameter-gradient convention (+=).
// bf16 dw (bf16 x only; the CPU backend, which computes in f32, takes it beside f32 x as the
// reference): the product is summed in fp32 and rounded to nearest even once per element,
// dw[e] = bf16(dy_e^T x_e) with dw_overwrite, else bf16(float(dw[e]) + dy_e^T x_e); an expert
// with no rows is left untouched (zeros with dw_overwrite). The precision of PyTorch's
// torch._grouped_mm gradient, half the stores and the optimizer's reads. One exception: the sm_90
// dw kernel splits a hot expert's rows into chunks that add to dw in chunk order (deterministic),
// and in bf16 each chunk's addition is rounded, so such an expert's dw is rounded once per chunk.
// Elsewhere (and where that kernel declines) the fp32 sums go through a scratch buffer kept per
// GPU, allocated by the first call. The same holds for the ops below that take dw, dw1 / dw3 or
// dw2.
MOE_OP(grouped_linear_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor offsets,
        bool dw_overwrite = false),
       (ctx, dx, dw, dy, x, w, offsets, dw_overwrite))
// The experts' gate and up projections' backward together: dx = dy1 w1[e] + dy3 w3[e] per group
// (overwritten), dw1[e] += dy1_e^T x_e and dw3[e] += dy3_e^T x_e (= with dw_overwrite, as in
// grouped_linear_backward). dx2: a workspace shaped and typed as dx, which the op may overwrite
// (where it sums the two products apart: the second into dx2, then added into dx). The CUDA
// backend on sm_90 runs dx as one product over k = 2F (the second operands loaded for the
// second half of the k-slices, one rounding) and leaves dx2: no second [R, in] written and read
// back. dx2 may share dy1's memory (dy1 is read before dx2 is written). dy1, dy3: [R, F]; x, dx,
// dx2: [R, in]; w1, w3: [E, F, in]; dw1, dw3: [E, F, in] in acc_dtype(x) or both bf16 (as
// grouped_linear_backward's dw); offsets as above.
MOE_OP(grouped_linear_backward_pair,
       (Ctx & ctx, Tensor dx, Tensor dx2, Tensor dw1, Tensor dw3, Tensor dy1, Tensor dy3, Tensor x,
        Tensor w1, Tensor w3, Tensor offsets, bool dw_overwrite = false),
       (ctx, dx, dx2, dw1, dw3, dy1, dy3, x, w1, w3, offsets, dw_overwrite))
// Whether grouped_linear_backward_pair (and _gathered) over R rows, E experts, [F, in] weights
// and dtype dt needs its dx2 workspace on ctx's device: false only where the CUDA backend runs dx
// as the one sm_90 product (then dx2 may be empty: moe-fine's backward saves an [R, d] buffer,
// 256 MiB). Decided from sizes and the device alone (the planning dry run asks it too), assuming
// 16-byte aligned tensors (arena allocations are); handed an empty dx2 where it then sums the
// products apart after all, the op throws.
#ifdef MOE_WITH_CUDA
namespace cuda {
inline bool (*grouped_pair_one_product)(DType dt, int64_t rows, int64_t experts, int64_t in,
                                        int64_t out) = nullptr;
}
#endif
inline bool grouped_linear_backward_pair_needs_dx2(const Ctx& ctx, DType dt, int64_t rows,
                                                   int64_t experts, int64_t in, int64_t out) {
#ifdef MOE_WITH_CUDA
  if (ctx.device.type == DeviceType::cuda && cuda::grouped_pair_one_product != nullptr)
    return !cuda::grouped_pair_one_product(dt, rows, experts, in, out);
#endif
  (void)ctx, (void)dt, (void)rows, (void)experts, (void)in, (void)out;
  return true;
}
// grouped_linear_backward_pair on the MoE layer's permuted rows without the permuted copy of x
// (as grouped_linear_backward_gathered): row r of its x is row row_token[r] of x [N, in]; bitwise
// permute_forward into a buffer, then grouped_linear_backward_pair.
MOE_OP(grouped_linear_backward_pair_gathered,
       (Ctx & ctx, Tensor dx, Tensor dx2, Tensor dw1, Tensor dw3, Tensor dy1, Tensor dy3, Tensor x,
        Tensor row_token, Tensor w1, Tensor w3, Tensor offsets, bool dw_overwrite = false),
       (ctx, dx, dx2, dw1, dw3, dy1, dy3, x, row_token, w1, w3, offsets, dw_overwrite))
// grouped_linear_forward(y, x, w, offsets), then adamw_step_split(hi, lo, g, m, v, a) over a
// parameter slab that y, x, w and offsets do not overlap (hi, lo, g, m, v as adamw_step_split
// takes them): bitwise the two ops in turn. The CUDA backend runs the update in the sm_90
// product's spare warps while its tensor cores work (kernels/cuda/adam_rider.cuh) and finishes
// what they left behind it; elsewhere, or with a.grad_sq_out, it runs the two ops in turn.
MOE_OP(grouped_linear_forward_adamw,
       (Ctx & ctx, Tensor y, Tensor x, Tensor w, Tensor offsets, Tensor hi, Tensor lo, Tensor g,
        Tensor m, Tensor v, const AdamWArgs& a),
       (ctx, y, x, w, offsets, hi, lo, g, m, v, a))
// grouped_linear_backward on the MoE layer's permuted rows without the permuted copy: row r of
// its x is row row_token[r] of x [N, in] (bitwise permute_forward into a buffer, then
// grouped_linear_backward; the CUDA backend fuses the gather into the sm_90 dw kernel's loads).
// row_token: [R] i32, values in [0, N) (a value outside reads nothing: NaN rows in the permute,
// zeros in the fused kernel); dx: [R, in]; the rest as above.
MOE_OP(grouped_linear_backward_gathered,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor row_token, Tensor w,
        Tensor offsets, bool dw_overwrite = false),
       (ctx, dx, dw, dy, x, row_token, w, offsets, dw_overwrite))
// The experts' gate and up projections and SwiGLU in one call: gate = x w1[e]^T, up = x w3[e]^T
// per group, h = row_w * silu(gate) * up of the rounded gate and up (bitwise grouped_linear_forward
// twice and swiglu_weighted_forward; the CUDA backend fuses them on sm_90). gate, up, h: [R, F];
// x: [R, in]; w1, w3: [E, F, in]; row_w: [R] in acc_dtype (each row's routing weight); offsets as
// above. All overwritten.
MOE_OP(grouped_swiglu_forward,
       (Ctx & ctx, Tensor gate, Tensor up, Tensor h, Tensor x, Tensor w1, Tensor w3, Tensor row_w,
        Tensor offsets),
       (ctx, gate, up, h, x, w1, w3, row_w, offsets))
// grouped_swiglu_forward on the MoE layer's permuted rows without the permuted copy: row r of its
// x is row row_token[r] of x [N, in] (bitwise permute_forward into a buffer, then
// grouped_swiglu_forward; the CUDA backend fuses the gather into the products' loads on sm_90).
// row_token: [R] i32, values in [0, N) (a value outside reads nothing: permute_forward's row
// of NaN, zeros in the fused kernel); the rest as above.
MOE_OP(grouped_swiglu_forward_gathered,
       (Ctx & ctx, Tensor gate, Tensor up, Tensor h, Tensor x, Tensor row_token, Tensor w1,
        Tensor w3, Tensor row_w, Tensor offsets),
       (ctx, gate, up, h, x, row_token, w1, w3, row_w, offsets))
// The backward of the experts' down projection and weighted SwiGLU together: dh = dy w2[e] per
// group (rounded to the dtype), then swiglu_weighted_backward (dgate, dup and the routing weights'
// gradient drow_w); dw2[e] += dy_e^T h_e. Bitwise grouped_linear_backward into dh followed by
// swiglu_weighted_backward; dh lives in dgate (the elementwise backward runs in place), so the
// caller keeps no dh buffer. dgate, dup (overwritten), gate, up, h: [R, F]; dy: [R, d]; w2: [E, d,
// F]; dw2 (+=, or = with dw_overwrite as above): [E, d, F] in acc_dtype or bf16 (as
// grouped_linear_backward's dw); row_w, drow_w (overwritten): [R] in acc_dtype; offsets as above.
MOE_OP(grouped_swiglu_down_backward,
       (Ctx & ctx, Tensor dgate, Tensor dup, Tensor drow_w, Tensor dw2, Tensor dy, Tensor h,
        Tensor w2, Tensor gate, Tensor up, Tensor row_w, Tensor offsets, bool dw_overwrite = false),
       (ctx, dgate, dup, drow_w, dw2, dy, h, w2, gate, up, row_w, offsets, dw_overwrite))
// grouped_swiglu_down_backward on the MoE layer's output gradient without its permuted copy: row
// r of its dy is row row_token[r] of dy [N, d] (bitwise permute_forward into a buffer, then
// grouped_swiglu_down_backward; the CUDA backend fuses the gather into the sm_90 dh and dw
// kernels' loads). row_token: [R] i32, values in [0, N) (a value outside reads nothing: NaN rows
// in the permute, zeros in the fused kernels); the rest as above.
MOE_OP(grouped_swiglu_down_backward_gathered,
       (Ctx & ctx, Tensor dgate, Tensor dup, Tensor drow_w, Tensor dw2, Tensor dy, Tensor row_token,
        Tensor h, Tensor w2, Tensor gate, Tensor up, Tensor row_w, Tensor offsets,
        bool dw_overwrite = false),
       (ctx, dgate, dup, drow_w, dw2, dy, row_token, h, w2, gate, up, row_w, offsets, dw_overwrite))

}  // namespace moe
