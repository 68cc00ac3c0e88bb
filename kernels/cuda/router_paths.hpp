// Fast paths of the router matmul ops (router_logits.cu) that live in files of their own. Each
// returns false, launching nothing, where it does not apply; the caller then runs its general
// kernels. The arguments have been checked by the op.
#pragma once
#include "moe/ops/common.hpp"

namespace moe::cuda_detail {

// logits = x w^T on tf32 tensor cores (router_fused.cu): sm_80+ device code, 16-bit x, E <= 8.
bool router_logits_forward_mma(Ctx& ctx, Tensor logits, Tensor x, Tensor w);

// dx += dl w (unless dx is empty) and dw += dl^T x in one pass (router_backward_rows.cu): 16-bit
// x, E <= 8, d a multiple of 8 up to 2048.
bool router_logits_backward_rows(Ctx& ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x,
                                 Tensor w);

// logits = x w^T, and dx += dl w (unless dx is empty) with dw += dl^T x, on bf16 tensor cores with
// every fp32 operand split exactly into three bf16 parts (router_split_mma.cu): sm_80+ device
// code, bf16 x, 16 < E <= 64 and a multiple of 4, d a multiple of 128 up to 8192.
bool router_logits_forward_split_mma(Ctx& ctx, Tensor logits, Tensor x, Tensor w);
bool router_logits_backward_split_mma(Ctx& ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x,
                                      Tensor w);

// mod_select's selection of f32 scores (mod.cu), launched as the programmatic dependent of the
// kernel just queued that writes the scores (mod_route on sm_90 devices, unless
// MOE_MOD_ROUTE_PDL=0): its blocks can be resident before that kernel ends and wait for its grid
// (griddepcontrol.wait), with no launch gap between the two.
void mod_select_after_scores(Ctx& ctx, Tensor sel, Tensor mask, Tensor scores);

}  // namespace moe::cuda_detail
