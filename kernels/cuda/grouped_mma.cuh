// Tensor-core grouped (per-expert) GEMMs for f16 and bf16 storage, fp32 accumulation
// (kernels/cuda/grouped_mma.cu). Used by grouped_linear_forward / grouped_linear_backward when the
// code that runs on the device has tensor-core instructions for the dtype (f16: compiled for
// sm_70+, which includes the sm_75 / T4 build; bf16: sm_80+); otherwise the SIMT kernels of
// linear.cu run. Offsets stay on the device, as there.
#pragma once
#include <cstdint>

#include "moe/ops/common.hpp"

namespace moe::cuda_detail {

struct AdamRider;  // adam_rider.cuh

// Whether the tensor-core path exists in this binary for dtype t on the current device.
bool grouped_mma_available(DType t);

// c[r, :] = a[r, :] B_e (overwritten) over the rows of each expert, B_e(k, n) read from w + e *
// expert_stride: w[n * k_total + k] when b_k_fast (forward: y = x w_e^T) else w[k * n_total + n]
// (dx = dy w_e). a: [rows, k_total], c: [rows, n_total], all of dtype t.
void grouped_mma_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                      const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                      int64_t k_total, int64_t expert_stride, bool b_k_fast);

// The pipelined sm_80+ kernels (grouped_mma_sm80.cu) behind the two calls above: each returns
// false, launching nothing, when the binary has no sm_80 code for dtype t on this device or the
// operands are not 16-byte aligned with leading dimensions that are multiples of 8; the WMMA
// kernels then run.
bool grouped_sm80_available(DType t);
bool grouped_sm80_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                       const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                       int64_t k_total, int64_t expert_stride, bool b_k_fast);
bool grouped_sm80_dw(Ctx& ctx, DType t, float* dw, const void* dy, const void* x,
                     const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in);

// The wgmma kernels for sm_90 (grouped_wgmma_sm90.cu), tried before the sm_80 ones with the same
// contract: false, launching nothing, when the device is not sm_90, the binary has no sm_90a code
// for them, or the operands miss the same alignment requirements.
// With row_token ([rows] i32; the dx = dy w[e] form, !b_k_fast, only), a is [tokens, k_total]
// and row r of the product reads its row row_token[r] (the MoE permute fused into the loads).
// With a rider (adam_rider.cuh; not with row_token) the kernel's spare warps carry its AdamW
// update while the product runs; the caller then finishes it (finish_adam_rider). With rows == 0
// nothing is launched and the riders carry nothing.
bool grouped_sm90_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                       const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                       int64_t k_total, int64_t expert_stride, bool b_k_fast,
                       const int32_t* row_token = nullptr, int64_t tokens = 0,
                       const AdamRider* rider = nullptr);
// c = a B(w) + a2 B(w2) in the dx = dy w[e] form (!b_k_fast), one product over both k ranges
// (the experts' gate and up backward: dx = dgate w1[e] + dup w3[e], rounded once): a2 shaped as
// a, w2 as w. False, launching nothing, where grouped_sm90_rows would decline for either pair.
bool grouped_sm90_rows_pair(Ctx& ctx, DType t, void* c, const void* a, const void* a2,
                            const void* w, const void* w2, const int32_t* offsets, int experts,
                            int64_t rows, int64_t n_total, int64_t k_total, int64_t expert_stride);
// Whether grouped_sm90_rows_pair runs at these sizes (its operands 16-byte aligned, as the
// arena's are): the one-product decision without the pointers (grouped_linear_backward_pair_
// needs_dx2).
bool grouped_sm90_rows_pair_runs(DType t, int64_t rows, int experts, int64_t n_total,
                                 int64_t k_total);
// The MoE permute fused into the dw product's loads: the gathered operand is [tokens, cols] and
// its row r is row row_token[r] ([rows] i32) of that.
struct DwGather {
  const int32_t* row_token = nullptr;
  int64_t tokens = 0;
  bool dy = false, x = false;  // which of the dw product's operands is gathered (one at most)
};
// overwrite: dw[e] = dy_e^T x_e (an expert without rows: zeros) instead of +=. dw of dtype dw_t:
// f32, or bf16 beside bf16 t (linear.hpp's bf16 gradient form: each of a tile's chunks loads, adds
// in fp32 and rounds); other combinations decline.
bool grouped_sm90_dw(Ctx& ctx, DType t, void* dw, DType dw_t, const void* dy, const void* x,
                     const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in,
                     bool overwrite, DwGather gather = {});
// dw[e] (+)= dy_e^T x_e and dw2[e] (+)= dy2_e^T x_e in one launch (overwrite and dw_t as
// grouped_sm90_dw's): dy2 shaped as dy, dw2 as dw; x may be gathered (gather.x), dy not. False,
// launching nothing, where grouped_sm90_dw would decline, or with no rows or experts (the
// caller's two calls handle those).
bool grouped_sm90_dw_pair(Ctx& ctx, DType t, void* dw, void* dw2, DType dw_t, const void* dy,
                          const void* dy2, const void* x, const int32_t* offsets, int experts,
                          int64_t rows, int64_t out, int64_t in, bool overwrite,
                          DwGather gather = {});

// The SwiGLU-fused forward on sm_90 (grouped_wgmma_sm90.cu): gate = x w1_e^T, up = x w3_e^T and
// h = row_w * silu(gate) * up of the rounded gate and up, all [rows, features]; w1, w3: [E,
// features, in]; row_w: [rows] fp32. False, launching nothing, where grouped_sm90_rows would
// decline, with 128-column tiles, or without row_w. With row_token ([rows] i32), x is [tokens,
// in] and row r of the product reads its row row_token[r] (the MoE permute fused into the loads).
bool grouped_sm90_swiglu(Ctx& ctx, DType t, void* gate, void* up, void* h, const void* x,
                         const void* w1, const void* w3, const float* row_w, const int32_t* offsets,
                         int experts, int64_t rows, int64_t features, int64_t in,
                         const int32_t* row_token = nullptr, int64_t tokens = 0);

// dw[e] += dy_e^T x_e in fp32: dw [E, out, in] of dtype dw_t, dy [rows, out], x [rows, in] of
// dtype t. An expert without rows leaves dw[e] untouched. overwrite: dw[e] = dy_e^T x_e (zeros
// for an expert without rows); the sm_90 kernel stores instead of adding, the others run on a
// zeroed dw. dw_t: f32, or bf16 beside bf16 t (linear.hpp's bf16 gradient form): natively on
// sm_90, elsewhere the fp32 gradient into bf16_dw_sums' scratch, then round_grouped_dw_bf16.
void grouped_mma_dw(Ctx& ctx, DType t, void* dw, DType dw_t, const void* dy, const void* x,
                    const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in,
                    bool overwrite = false);

// The bf16 gradient form behind the kernels that only sum into fp32: dw [E, per_expert] bf16 =
// bf16(sums), or bf16(float(dw) + sums) without overwrite, where an expert without rows keeps its
// bits; sums: the fp32 gradient from zero (zeros for an expert without rows).
void round_grouped_dw_bf16(Ctx& ctx, void* dw, const float* sums, const int32_t* offsets,
                           int experts, int64_t rows, int64_t per_expert, bool overwrite);

// The fp32 sums of that form: `floats` floats of ctx's device, contents undefined (the callers
// zero or overwrite them). One grow-only buffer per device, so a training step allocates it in its
// first backward and never again (a cudaMalloc per call synchronised the device inside every
// step); reused in stream order, as the dw kernel's flags are: the ops of one device run on one
// stream (moe::gpu::default_stream).
float* bf16_dw_sums(Ctx& ctx, size_t floats);

}  // namespace moe::cuda_detail
