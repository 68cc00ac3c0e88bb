// Linear layers on the GPU, weights stored [out_features, in_features] row-major (Hugging Face
// layout).
//
// linear_forward / linear_backward call cuBLAS. cuBLAS is column-major and a row-major M[r, c] is
// the column-major M^T, so each row-major product C = A B is issued as the column-major C^T = B^T
// A^T:  y = x w^T -> y^T = w x^T (op T on w's buffer, N on x's);  dx = dy w -> dx^T = w^T dy^T
// (N, N);  dw += dy^T x -> dw^T += x^T dy (N on x's buffer, T on dy's), beta = 1. f32 / f16 / bf16
// go through cublasGemmEx with CUBLAS_COMPUTE_32F (true fp32: no TF32, and reduced-precision
// split-K reductions disallowed for the call), f64 through cublasDgemm. Empty products are skipped
// (a non-accumulating forward with in = 0 writes zeros). dw is in acc_dtype(x): for f16 / bf16 the
// dw product is issued with A, B of the 16-bit type and C of CUDA_R_32F (a supported GemmEx
// combination with CUBLAS_COMPUTE_32F), so the fp32 product is added to the fp32 gradient and
// rounded once, instead of being rounded to 16 bits before and after the add. The forward's y may
// be f32 for 16-bit x and w in the same way (the router's bf16-split products, router_matmul.cpp).
//
// grouped_linear_forward / grouped_linear_backward: rows [offsets[e], offsets[e+1]) use w[e], with
// the offsets on the device, never copied to the host (no synchronisation). f16 / bf16 run on
// tensor cores (grouped_mma.cu) when the device code has them; otherwise (f32, f64, and bf16 in a
// build for sm_75) these tiled SIMT kernels run: 64x64 output tiles, 256 threads with 4x4 outputs
// each, K in steps of 16 staged in shared memory as fp32 (double for f64), a fixed summation order
// (deterministic), one rounding on store.
// - y = x w[e]^T and dx = dy w[e] (overwritten): the row tiles are cut per expert, so a tile never
//   mixes experts. The host sizes the grid from what it knows, ceil(R/64) + E row tiles (each
//   expert wastes at most one partial tile), x out-column tiles. A block's first warp scans the
//   offsets (32 experts per step with a warp prefix sum) to find which expert and rows its row tile
//   is; blocks past the last tile exit at once.
// - dw[e] += dy_e^T x_e: grid (in tiles, out tiles, E); a block loops over expert e's rows in
//   K-steps of 16. An expert with no rows returns before touching dw[e] (+= 0, bitwise unchanged).
//   dw is acc_t<T> (fp32 for 16-bit x): the tile's fp32 sums are added to it without a 16-bit
//   rounding. A bf16 dw (beside bf16 x: linear.hpp's bf16 gradient form) is native to the sm_90
//   dw kernel only; every other path sums into an fp32 scratch from zero (bf16_dw_sums: one
//   grow-only buffer per device) and rounds it into dw once per element (round_grouped_dw_bf16).
// Offsets are clamped to [0, R] on the device, so malformed offsets (a caller bug; the CPU op
// checks them) can leave rows unwritten but never read or write out of bounds.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common/linear_checks.hpp"
#include "common/optim_checks.hpp"
#include "cuda/adam_rider.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/grouped_mma.cuh"
#include "cuda/grouped_tiles.cuh"
#include "moe/env_switch.hpp"
#include "moe/memory.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kTile = 64;                          // output tile edge (rows and columns)
constexpr int kStepK = 16;                         // K per shared-memory step
constexpr int kThreads = 256;                      // 16 x 16 threads, 4 x 4 outputs each
constexpr int kSub = 4;                            // outputs per thread along each tile edge
constexpr int kLanes = kTile / kSub;               // 16 threads along each tile edge
constexpr int kLoads = kTile * kStepK / kThreads;  // elements each thread stages per operand

// ---- kernels ------------------------------------------------------------------------------------

// Stages a kTile x kStepK slab of an operand into dst[k][m] (as fp32 / double, zero outside the
// bounds). Element (m, k) is src[k*ld + m] when kMFast (m contiguous) else src[m*ld + k].
template <class T, bool kMFast>
__device__ __forceinline__ void stage(acc_t<T> (*dst)[kTile + 1], const T* src, int64_t ld,
                                      int64_t m0, int64_t m1, int64_t k0, int64_t k1) {
#pragma unroll
  for (int it = 0; it < kLoads; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * kThreads;
    const int mm = kMFast ? idx % kTile : idx / kStepK;
    const int kk = kMFast ? idx / kTile : idx % kStepK;
    const int64_t m = m0 + mm, k = k0 + kk;
    acc_t<T> v = 0;
    if (m < m1 && k < k1) v = load(kMFast ? src[k * ld + m] : src[m * ld + k]);
    dst[kk][mm] = v;
  }
}

// acc[i][j] = sum_{k in [k0, k1)} A(m0 + ty + 16 i, k) * B(k, n0 + tx + 16 j), rows < m1 and
// columns < n1 (others are 0). A(m, k) = a[k*lda + m] if kAKM else a[m*lda + k]; B(k, n) =
// b[k*ldb + n] if kBKN else b[n*ldb + k]. All threads of the block must call it.
template <class T, bool kAKM, bool kBKN>
__device__ __forceinline__ void tile_product(acc_t<T> (&acc)[kSub][kSub], const T* a, int64_t lda,
                                             int64_t m0, int64_t m1, const T* b, int64_t ldb,
                                             int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
  using A = acc_t<T>;
  __shared__ A as[kStepK][kTile + 1];
  __shared__ A bs[kStepK][kTile + 1];
  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int j = 0; j < kSub; ++j) acc[i][j] = 0;
  for (int64_t kb = k0; kb < k1; kb += kStepK) {
    stage<T, kAKM>(as, a, lda, m0, m1, kb, k1);
    stage<T, kBKN>(bs, b, ldb, n0, n1, kb, k1);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kStepK; ++kk) {
      A av[kSub], bv[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) av[i] = as[kk][ty + kLanes * i];
#pragma unroll
      for (int j = 0; j < kSub; ++j) bv[j] = bs[kk][tx + kLanes * j];
#pragma unroll
      for (int i = 0; i < kSub; ++i)
#pragma unroll
        for (int j = 0; j < kSub; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
}

// C[r, :] = A[r, :] B_e over expert row tiles: grid (ceil(R/64) + E, ceil(n/64)).
// Forward: A = x [R, in], B_e(k, n) = w[e][n, k] (kBKN false), n = out, k = in.
// dx:      A = dy [R, out], B_e(k, n) = w[e][k, n] (kBKN true), n = in, k = out.
template <class T, bool kBKN>
__global__ void __launch_bounds__(kThreads)
    grouped_rows_kernel(T* c, const T* a, const T* w, const int32_t* offsets, int experts,
                        int64_t rows, int64_t n, int64_t k, int64_t expert_stride) {
  int64_t r0 = 0, r1 = 0;
  const int expert = block_row_tile<kTile>(offsets, experts, rows, blockIdx.x, &r0, &r1);
  if (expert < 0) return;  // uniform over the block
  const int64_t n0 = int64_t(blockIdx.y) * kTile;
  const T* b = w + expert * expert_stride;
  acc_t<T> acc[kSub][kSub];
  // A(m, k) = a[m*k_total + k]; B(k, n) = b[k*n_total + n] (kBKN) or b[n*k_total + k].
  tile_product<T, false, kBKN>(acc, a, k, r0, r1, b, kBKN ? n : k, n0, n, 0, k);
  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t r = r0 + ty + kLanes * i;
    if (r >= r1) continue;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int64_t col = n0 + tx + kLanes * j;
      if (col < n) c[r * n + col] = store<T>(acc[i][j]);
    }
  }
}

// dw[e] += dy_e^T x_e: grid (ceil(in/64), ceil(out/64), E). C(o, i) = sum_r dy[r, o] x[r, i].
template <class T>
__global__ void __launch_bounds__(kThreads)
    grouped_dw_kernel(acc_t<T>* dw, const T* dy, const T* x, const int32_t* offsets, int64_t rows,
                      int64_t out, int64_t in) {
  const int e = blockIdx.z;
  const int64_t r0 = clamp_offset(offsets[e], rows), r1 = clamp_offset(offsets[e + 1], rows);
  if (r1 <= r0) return;  // no rows: dw[e] += 0, left untouched (uniform over the block)
  const int64_t m0 = int64_t(blockIdx.y) * kTile, n0 = int64_t(blockIdx.x) * kTile;
  acc_t<T> acc[kSub][kSub];
  // A(m = o, k = r) = dy[r*out + o] (m fast); B(k = r, n = i) = x[r*in + i] (n fast).
  tile_product<T, true, true>(acc, dy, out, m0, out, x, in, n0, in, r0, r1);
  acc_t<T>* dw_e = dw + int64_t(e) * out * in;
  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t o = m0 + ty + kLanes * i;
    if (o >= out) continue;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int64_t col = n0 + tx + kLanes * j;
      if (col < in) dw_e[o * in + col] += acc[i][j];
    }
  }
}

// ---- host side: cuBLAS --------------------------------------------------------------------------

int as_int(int64_t v, const char* op) {
  MOE_CHECK(v <= INT_MAX,
            std::string(op) + ": dimension " + std::to_string(v) + " exceeds the cuBLAS int range");
  return static_cast<int>(v);
}

// Sets the handle's stream to ctx's and disallows reduced-precision split-K reductions for the
// duration of one call, restoring the previous math mode after.
class BlasCall {
 public:
  explicit BlasCall(Ctx& ctx) : h_(blas_of(ctx)) {
    MOE_CHECK(h_ != nullptr, "linear: the context has no cuBLAS handle");
    cudaStream_t current = nullptr;
    MOE_CUBLAS_CHECK(cublasGetStream(h_, &current));
    if (current != stream_of(ctx)) MOE_CUBLAS_CHECK(cublasSetStream(h_, stream_of(ctx)));
    MOE_CUBLAS_CHECK(cublasGetMathMode(h_, &saved_));
    MOE_CUBLAS_CHECK(cublasSetMathMode(
        h_, static_cast<cublasMath_t>(saved_ | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  }
  ~BlasCall() { cublasSetMathMode(h_, saved_); }  // never throws
  BlasCall(const BlasCall&) = delete;
  BlasCall& operator=(const BlasCall&) = delete;
  cublasHandle_t handle() const { return h_; }

 private:
  cublasHandle_t h_;
  cublasMath_t saved_ = CUBLAS_DEFAULT_MATH;
};

cudaDataType_t cuda_type(DType t, const char* op) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::f16:
      return CUDA_R_16F;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      throw InternalError(std::string(op) + ": unsupported dtype " + dtype_name(t));
  }
}

// Column-major C[m, n] = op(A) op(B) + beta C (alpha 1), A and B of dtype dt, C of dtype c_dt (dt,
// or f32 for 16-bit dt); m, n, k > 0.
void gemm_cm(Ctx& ctx, DType dt, DType c_dt, cublasOperation_t opa, cublasOperation_t opb,
             int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b,
             int64_t ldb, double beta, void* c, int64_t ldc, const char* op) {
  BlasCall call(ctx);
  if (dt == DType::f64) {
    const double one = 1.0;
    MOE_CUBLAS_CHECK(cublasDgemm(call.handle(), opa, opb, as_int(m, op), as_int(n, op),
                                 as_int(k, op), &one, static_cast<const double*>(a),
                                 as_int(lda, op), static_cast<const double*>(b), as_int(ldb, op),
                                 &beta, static_cast<double*>(c), as_int(ldc, op)));
    return;
  }
  const cudaDataType_t type = cuda_type(dt, op), c_type = cuda_type(c_dt, op);
  const float one = 1.0f, beta_f = static_cast<float>(beta);
  MOE_CUBLAS_CHECK(cublasGemmEx(call.handle(), opa, opb, as_int(m, op), as_int(n, op),
                                as_int(k, op), &one, a, type, as_int(lda, op), b, type,
                                as_int(ldb, op), &beta_f, c, c_type, as_int(ldc, op),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// gemm_cm over `batch` products, operand i at a + i stride_a (stride 0: one shared operand), b
// and c likewise; one cuBLAS launch (f32 / f16 / bf16; f64 runs the products in turn).
void gemm_cm_batched(Ctx& ctx, DType dt, DType c_dt, cublasOperation_t opa, cublasOperation_t opb,
                     int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, int64_t stride_a,
                     const void* b, int64_t ldb, int64_t stride_b, double beta, void* c,
                     int64_t ldc, int64_t stride_c, int64_t batch, const char* op) {
  if (dt == DType::f64) {
    const size_t es = sizeof(double);
    for (int64_t i = 0; i < batch; ++i)
      gemm_cm(ctx, dt, c_dt, opa, opb, m, n, k, static_cast<const char*>(a) + i * stride_a * es,
              lda, static_cast<const char*>(b) + i * stride_b * es, ldb, beta,
              static_cast<char*>(c) + i * stride_c * es, ldc, op);
    return;
  }
  BlasCall call(ctx);
  const cudaDataType_t type = cuda_type(dt, op), c_type = cuda_type(c_dt, op);
  const float one = 1.0f, beta_f = static_cast<float>(beta);
  MOE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      call.handle(), opa, opb, as_int(m, op), as_int(n, op), as_int(k, op), &one, a, type,
      as_int(lda, op), stride_a, b, type, as_int(ldb, op), stride_b, &beta_f, c, c_type,
      as_int(ldc, op), stride_c, as_int(batch, op), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void check_float(DType t, const char* op) {
  MOE_CHECK(t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16,
            std::string(op) + ": unsupported dtype " + dtype_name(t));
}

// y: [N, out] (= or +=), x: [N, in], w: [out, in]
void linear_forward_cuda(Ctx& ctx, Tensor y, Tensor x, Tensor w, bool accumulate) {
  const LinearDims s = check_linear_forward_args(y, x, w);
  check_float(x.dtype, "linear_forward");
  if (s.n == 0 || s.out == 0) return;
  if (s.in == 0) {  // y = 0 (or += 0)
    if (!accumulate) MOE_CUDA_CHECK(cudaMemsetAsync(y.data, 0, y.nbytes(), stream_of(ctx)));
    return;
  }
  // y^T [out, N] = w [out, in] (T of w's buffer) x^T [in, N] (x's buffer)
  gemm_cm(ctx, x.dtype, y.dtype, CUBLAS_OP_T, CUBLAS_OP_N, s.out, s.n, s.in, w.data, s.in, x.data,
          s.in, accumulate ? 1.0 : 0.0, y.data, s.out, "linear_forward");
}

// dx: [N, in] (= or +=; skipped when empty), dw: [out, in] (+=), dy: [N, out]
void linear_backward_cuda(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                          bool accumulate_dx) {
  const LinearDims s = check_linear_backward_args(dx, dw, dy, x, w);
  check_float(x.dtype, "linear_backward");
  if (s.n == 0 || s.in == 0) return;  // dx has no elements; dw += 0
  if (!dx.empty()) {
    if (s.out == 0) {
      if (!accumulate_dx) MOE_CUDA_CHECK(cudaMemsetAsync(dx.data, 0, dx.nbytes(), stream_of(ctx)));
    } else {
      // dx^T [in, N] = w^T [in, out] (w's buffer) dy^T [out, N] (dy's buffer)
      gemm_cm(ctx, x.dtype, x.dtype, CUBLAS_OP_N, CUBLAS_OP_N, s.in, s.n, s.out, w.data, s.in,
              dy.data, s.out, accumulate_dx ? 1.0 : 0.0, dx.data, s.in, "linear_backward");
    }
  }
  if (s.out == 0) return;
  // dw^T [in, out] += x^T [in, N] (x's buffer) dy [N, out] (T of dy's buffer), dw in acc_dtype(x)
  gemm_cm(ctx, x.dtype, dw.dtype, CUBLAS_OP_N, CUBLAS_OP_T, s.in, s.out, s.n, x.data, s.in, dy.data,
          s.out, 1.0, dw.data, s.in, "linear_backward");
}

// y: [B, N, out] (=), x: [N, in], w: [B, out, in]: the B products in one launch.
void linear_forward_batched_cuda(Ctx& ctx, Tensor y, Tensor x, Tensor w) {
  const int64_t batch = linear_batch(y, w, "linear_forward_batched");
  const LinearDims s = check_linear_forward_args(batch_item(y, 0), x, batch_item(w, 0));
  check_float(x.dtype, "linear_forward_batched");
  if (s.n == 0 || s.out == 0 || s.in == 0) {  // the plain op's empty cases
    for (int64_t b = 0; b < batch; ++b)
      linear_forward_cuda(ctx, batch_item(y, b), x, batch_item(w, b), false);
    return;
  }
  // y[b]^T [out, N] = w[b] [out, in] (T of w's buffer) x^T [in, N] (x's buffer, shared)
  gemm_cm_batched(ctx, x.dtype, y.dtype, CUBLAS_OP_T, CUBLAS_OP_N, s.out, s.n, s.in, w.data, s.in,
                  s.out * s.in, x.data, s.in, 0, 0.0, y.data, s.out, s.n * s.out, batch,
                  "linear_forward_batched");
}

// dx: [N, in] (= or +=; skipped when empty), dw: [B, out, in] (+=), dy: [B, N, out]: dx as B
// products in turn (each adds into dx), the weight gradients in one launch.
void linear_backward_batched_cuda(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                                  bool accumulate_dx) {
  const int64_t batch = linear_batch(dy, w, "linear_backward_batched");
  check_shape(dw, {batch, w.size(1), w.size(2)}, "linear_backward_batched: dw");
  const LinearDims s =
      check_linear_backward_args(dx, batch_item(dw, 0), batch_item(dy, 0), x, batch_item(w, 0));
  check_float(x.dtype, "linear_backward_batched");
  if (s.n == 0 || s.in == 0 || s.out == 0) {  // the plain op's empty cases
    for (int64_t b = 0; b < batch; ++b)
      linear_backward_cuda(ctx, dx, batch_item(dw, b), batch_item(dy, b), x, batch_item(w, b),
                           accumulate_dx || b > 0);
    return;
  }
  if (!dx.empty())
    for (int64_t b = 0; b < batch; ++b)  // dx^T [in, N] (+)= w[b]^T [in, out] dy[b]^T [out, N]
      gemm_cm(ctx, x.dtype, x.dtype, CUBLAS_OP_N, CUBLAS_OP_N, s.in, s.n, s.out,
              batch_item(w, b).data, s.in, batch_item(dy, b).data, s.out,
              accumulate_dx || b > 0 ? 1.0 : 0.0, dx.data, s.in, "linear_backward_batched");
  // dw[b]^T [in, out] += x^T [in, N] (x's buffer, shared) dy[b] [N, out] (T of dy[b]'s buffer)
  gemm_cm_batched(ctx, x.dtype, dw.dtype, CUBLAS_OP_N, CUBLAS_OP_T, s.in, s.out, s.n, x.data, s.in,
                  0, dy.data, s.out, s.n * s.out, 1.0, dw.data, s.in, s.out * s.in, batch,
                  "linear_backward_batched");
}

// ---- host side: grouped -------------------------------------------------------------------------

GroupedDims grouped_dims(const Tensor& x, const Tensor& w, const Tensor& offsets, const char* op) {
  const std::string name(op);
  const GroupedDims s = linear_grouped_dims(x, w, op);
  check_grouped_offsets_args(offsets, s.experts, op);
  MOE_CHECK(offsets.device == x.device,
            name + ": offsets must be on " + x.device.str() + ", got " + offsets.device.str());
  MOE_CHECK(s.experts <= 65535, name + ": at most 65535 experts, got " + std::to_string(s.experts));
  MOE_CHECK(blocks_for(std::max(s.in, s.out), kTile) <= 65535,
            name + ": features too large for the grid, got " + w.shape_str());
  return s;
}

// y: [R, out], x: [R, in], w: [E, out, in], offsets: [E+1] (device)
void grouped_linear_forward_cuda(Ctx& ctx, Tensor y, Tensor x, Tensor w, Tensor offsets) {
  const GroupedDims s = grouped_dims(x, w, offsets, "grouped_linear_forward");
  check_grouped_linear_forward_args(s, y, x, w);
  if (s.rows == 0 || s.out == 0 || s.experts == 0) return;
  if (grouped_mma_available(x.dtype)) {  // tensor cores (f16 / bf16)
    grouped_mma_rows(ctx, x.dtype, y.data, x.data, w.data, data_of<int32_t>(offsets),
                     static_cast<int>(s.experts), s.rows, s.out, s.in, s.out * s.in, true);
    return;
  }
  dispatch_storage(x.dtype, "grouped_linear_forward", [&](auto zero) {
    using T = decltype(zero);
    const dim3 grid(static_cast<unsigned>(blocks_for(s.rows, kTile) + s.experts),
                    blocks_for(s.out, kTile));
    grouped_rows_kernel<T, false><<<grid, kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(y), data_of<T>(x), data_of<T>(w), data_of<int32_t>(offsets),
        static_cast<int>(s.experts), s.rows, s.out, s.in, s.out * s.in);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// The update rides in the sm_90 product's spare warps where it can (adam_rider.cuh), finished
// behind it; otherwise the two ops in turn.
void grouped_linear_forward_adamw_cuda(Ctx& ctx, Tensor y, Tensor x, Tensor w, Tensor offsets,
                                       Tensor hi, Tensor lo, Tensor g, Tensor m, Tensor v,
                                       const AdamWArgs& a) {
  const GroupedDims s = grouped_dims(x, w, offsets, "grouped_linear_forward_adamw");
  check_grouped_linear_forward_args(s, y, x, w);
  check_adamw_step_split_args(hi, lo, g, m, v, a);
  check_on_gpu({&hi, &lo, &g, &m, &v}, "grouped_linear_forward_adamw");
  check_update_apart({&hi, &lo, &g, &m, &v}, {&y, &x, &w, &offsets},
                     "grouped_linear_forward_adamw");
  if (s.out > 0 && s.experts > 0 && hi.numel() > 0 && adam_rider_fits(hi, lo, g, m, v, a)) {
    const AdamRider r = make_adam_rider(ctx, hi, lo, g, m, v, a);
    if (grouped_sm90_rows(ctx, x.dtype, y.data, x.data, w.data, data_of<int32_t>(offsets),
                          static_cast<int>(s.experts), s.rows, s.out, s.in, s.out * s.in, true,
                          nullptr, 0, &r)) {
      finish_adam_rider(ctx, r);
      return;
    }
  }
  grouped_linear_forward_cuda(ctx, y, x, w, offsets);
  adamw_step_split(ctx, hi, lo, g, m, v, a);
}

// dw[e] += dy_e^T x_e by the SIMT kernel (dw already zeroed for dw_overwrite); a bf16 dw through
// the fp32 sums from zero, then rounded (dw_overwrite: without dw's own value).
template <class T>
void launch_grouped_dw(Ctx& ctx, Tensor dw, const Tensor& dy, const Tensor& x,
                       const Tensor& offsets, const GroupedDims& s, bool dw_overwrite) {
  const dim3 grid(blocks_for(s.in, kTile), blocks_for(s.out, kTile),
                  static_cast<unsigned>(s.experts));
  const int32_t* off = data_of<int32_t>(offsets);
  if (dw.dtype != DType::bf16) {
    grouped_dw_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(
        data_of<acc_t<T>>(dw), data_of<T>(dy), data_of<T>(x), off, s.rows, s.out, s.in);
    MOE_CUDA_LAUNCH_CHECK();
    return;
  }
  if constexpr (std::is_same_v<acc_t<T>, float>) {
    float* f = bf16_dw_sums(ctx, size_t(dw.numel()));  // (the kernel adds: from zeros)
    MOE_CUDA_CHECK(cudaMemsetAsync(f, 0, size_t(dw.numel()) * sizeof(float), stream_of(ctx)));
    grouped_dw_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(f, data_of<T>(dy), data_of<T>(x),
                                                                off, s.rows, s.out, s.in);
    MOE_CUDA_LAUNCH_CHECK();
    round_grouped_dw_bf16(ctx, dw.data, f, off, static_cast<int>(s.experts), s.rows, s.out * s.in,
                          dw_overwrite);
  }
}

// dx: [R, in] (overwritten), dw: [E, out, in] (+=, or = with dw_overwrite), dy: [R, out]
void grouped_linear_backward_cuda(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                                  Tensor offsets, bool dw_overwrite) {
  const GroupedDims s = grouped_dims(x, w, offsets, "grouped_linear_backward");
  check_grouped_linear_backward_args(s, dx, dw, dy, x, w);
  if (s.rows == 0 || s.experts == 0 || s.in == 0) {  // nothing to write; dw += 0
    if (dw_overwrite) cuda::fill(ctx, dw, 0.0);
    return;
  }
  if (grouped_mma_available(x.dtype)) {  // tensor cores (f16 / bf16); dw is fp32 or bf16
    const int32_t* off = data_of<int32_t>(offsets);
    grouped_mma_rows(ctx, x.dtype, dx.data, dy.data, w.data, off, static_cast<int>(s.experts),
                     s.rows, s.in, s.out, s.out * s.in, false);
    if (s.out > 0)
      grouped_mma_dw(ctx, x.dtype, dw.data, dw.dtype, dy.data, x.data, off,
                     static_cast<int>(s.experts), s.rows, s.out, s.in, dw_overwrite);
    return;
  }
  // then += as below (a bf16 dw: launch_grouped_dw's rounding overwrites)
  if (dw_overwrite && dw.dtype != DType::bf16) cuda::fill(ctx, dw, 0.0);
  dispatch_storage(x.dtype, "grouped_linear_backward", [&](auto zero) {
    using T = decltype(zero);
    // dx = dy w[e] per expert row tile (k = out; out = 0 gives zeros).
    const dim3 dx_grid(static_cast<unsigned>(blocks_for(s.rows, kTile) + s.experts),
                       blocks_for(s.in, kTile));
    grouped_rows_kernel<T, true><<<dx_grid, kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dx), data_of<T>(dy), data_of<T>(w), data_of<int32_t>(offsets),
        static_cast<int>(s.experts), s.rows, s.in, s.out, s.out * s.in);
    MOE_CUDA_LAUNCH_CHECK();
    if (s.out == 0) return;
    launch_grouped_dw<T>(ctx, dw, dy, x, offsets, s, dw_overwrite);
  });
}

// gate, up, h: [R, F]; x: [R, in]; w1, w3: [E, F, in]; row_w: [R]. Fused on sm_90 (the tile's
// epilogue applies the weighted SwiGLU: gate and up are stored and read back once less);
// elsewhere the three ops.
void grouped_swiglu_forward_cuda(Ctx& ctx, Tensor gate, Tensor up, Tensor h, Tensor x, Tensor w1,
                                 Tensor w3, Tensor row_w, Tensor offsets) {
  const GroupedDims s = grouped_dims(x, w1, offsets, "grouped_swiglu_forward");
  check_grouped_swiglu_forward_args(s, gate, up, h, x, w1, w3, row_w);
  if (s.rows == 0 || s.out == 0) return;
  if (s.experts > 0 &&
      grouped_sm90_swiglu(ctx, x.dtype, gate.data, up.data, h.data, x.data, w1.data, w3.data,
                          row_w.dtype == DType::f32 ? data_of<float>(row_w) : nullptr,
                          data_of<int32_t>(offsets), static_cast<int>(s.experts), s.rows, s.out,
                          s.in))
    return;
  grouped_linear_forward_cuda(ctx, gate, x, w1, offsets);
  grouped_linear_forward_cuda(ctx, up, x, w3, offsets);
  cuda::swiglu_weighted_forward(ctx, h, gate, up, row_w);
}

// dgate, dup, gate, up, h: [R, F]; dy: [R, d]; w2, dw2: [E, d, F]; row_w, drow_w: [R]. dh goes
// into dgate and the elementwise backward runs in place (no dh buffer). Applying the SwiGLU
// backward in the sm_90 dh GEMM's epilogue instead was measured slower on the H200 (857 against
// 816 us per moe-small layer: its gate / up loads sit between two tiles' main loops).
void grouped_swiglu_down_backward_cuda(Ctx& ctx, Tensor dgate, Tensor dup, Tensor drow_w,
                                       Tensor dw2, Tensor dy, Tensor h, Tensor w2, Tensor gate,
                                       Tensor up, Tensor row_w, Tensor offsets, bool dw_overwrite) {
  const GroupedDims s = grouped_dims(h, w2, offsets, "grouped_swiglu_down_backward");
  check_grouped_swiglu_down_backward_args(s, dgate, dup, drow_w, dw2, dy, h, w2, gate, up, row_w);
  grouped_linear_backward_cuda(ctx, dgate, dw2, dy, h, w2, offsets, dw_overwrite);
  cuda::swiglu_weighted_backward(ctx, dgate, dup, drow_w, dgate, gate, up, row_w);
}

// ---- the gathered ops: the MoE permute fused into the sm_90 kernels' loads -------------------

// A gathered op's device checks: grouped_dims' (the offsets, the grid's limits) over the
// product's x-like operand and w, and row_token on the gathered `src`'s device.
void check_gathered_device(const Tensor& x, const Tensor& w, const Tensor& offsets,
                           const Tensor& row_token, const Tensor& src, const char* op) {
  grouped_dims(x, w, offsets, op);
  MOE_CHECK(row_token.device == src.device, std::string(op) + ": row_token must be on " +
                                                src.device.str() + ", got " +
                                                row_token.device.str());
}

// Where the fused kernels decline (not sm_90, MOE_GROUPED_SM90 set otherwise): src's rows
// row_token[r] copied into `rows`, allocated here (cudaMalloc per call: the trainer gathers only
// on request, for sm_90).
Tensor permuted_copy(Ctx& ctx, Buffer& rows, const Tensor& src, const Tensor& row_token) {
  const int64_t r = row_token.size(0), width = src.size(1);
  rows = Buffer(src.device, std::max<size_t>(16, size_t(r * width) * dtype_size(src.dtype)));
  const Tensor copy = rows.as(src.dtype, {r, width});
  cuda::permute_forward(ctx, copy, src, row_token);
  return copy;
}

// grouped_linear_backward on rows row_token[r] of x [N, in]: dw by the sm_90 dw kernel with the
// gather fused into its loads, dx = dy w[e] as always.
void grouped_linear_backward_gathered_cuda(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x,
                                           Tensor row_token, Tensor w, Tensor offsets,
                                           bool dw_overwrite) {
  check_gathered_device(x, w, offsets, row_token, x, "grouped_linear_backward_gathered");
  const GroupedDims s = check_grouped_linear_backward_gathered_args(dx, dw, dy, x, row_token, w);
  const int32_t* off = data_of<int32_t>(offsets);
  if (s.rows > 0 && s.experts > 0 && s.in > 0 && s.out > 0 && x.size(0) > 0 &&
      grouped_mma_available(x.dtype) &&
      grouped_sm90_dw(ctx, x.dtype, dw.data, dw.dtype, dy.data, x.data, off,
                      static_cast<int>(s.experts), s.rows, s.out, s.in, dw_overwrite,
                      {data_of<int32_t>(row_token), x.size(0), false, true})) {
    grouped_mma_rows(ctx, x.dtype, dx.data, dy.data, w.data, off, static_cast<int>(s.experts),
                     s.rows, s.in, s.out, s.out * s.in, false);
    return;
  }
  Buffer rows;
  grouped_linear_backward_cuda(ctx, dx, dw, dy, permuted_copy(ctx, rows, x, row_token), w, offsets,
                               dw_overwrite);
}

// MOE_GROUPED_PAIR=0 (read at every call): the pair's two products apart, to measure the one.
bool pair_product_wanted() {
  return env_switch("MOE_GROUPED_PAIR", true);
}

// grouped_linear_backward_pair_needs_dx2's answer on CUDA: pair_one_product's conditions from
// the sizes alone (the arena's tensors are 16-byte aligned).
bool pair_one_product_runs(DType dt, int64_t rows, int64_t experts, int64_t in, int64_t out) {
  return pair_product_wanted() && rows > 0 && experts > 0 && in > 0 && out > 0 &&
         experts <= INT_MAX && grouped_mma_available(dt) &&
         grouped_sm90_rows_pair_runs(dt, rows, static_cast<int>(experts), in, out);
}

// An empty dx2 (the caller asked grouped_linear_backward_pair_needs_dx2) where the products are
// summed apart after all: a caller bug, reported instead of a write through a null pointer.
void require_dx2(const Tensor& dx2, const char* op) {
  MOE_CHECK(!dx2.empty(), std::string(op) +
                              ": dx2 is empty, but the two products are summed apart here "
                              "(grouped_linear_backward_pair_needs_dx2 disagrees)");
}

// The pair's sm_90 path: dx = dy1 w1[e] + dy3 w3[e] as one product over both k ranges, then both
// weight gradients by one dw launch (x's rows gathered in its loads when row_token is given),
// else each apart (from x, or gathering, from a permuted copy). False, launching nothing, where
// the one product does not apply (the caller sums the two products apart).
bool pair_one_product(Ctx& ctx, const GroupedDims& s, Tensor dx, Tensor dw1, Tensor dw3, Tensor dy1,
                      Tensor dy3, Tensor x, Tensor row_token, Tensor w1, Tensor w3, Tensor offsets,
                      bool dw_overwrite) {
  const int32_t* off = data_of<int32_t>(offsets);
  const bool gather = !row_token.empty();
  // (the sizes' decision is the one grouped_linear_backward_pair_needs_dx2 gave the caller)
  if (x.size(0) <= 0 || !pair_one_product_runs(x.dtype, s.rows, s.experts, s.in, s.out) ||
      !grouped_sm90_rows_pair(ctx, x.dtype, dx.data, dy1.data, dy3.data, w1.data, w3.data, off,
                              static_cast<int>(s.experts), s.rows, s.in, s.out, s.out * s.in))
    return false;
  const DwGather g =
      gather ? DwGather{data_of<int32_t>(row_token), x.size(0), false, true} : DwGather{};
  if (grouped_sm90_dw_pair(ctx, x.dtype, dw1.data, dw3.data, dw1.dtype, dy1.data, dy3.data, x.data,
                           off, static_cast<int>(s.experts), s.rows, s.out, s.in, dw_overwrite, g))
    return true;
  Buffer rows;
  const void* xr = gather ? permuted_copy(ctx, rows, x, row_token).data : x.data;
  grouped_mma_dw(ctx, x.dtype, dw1.data, dw1.dtype, dy1.data, xr, off, static_cast<int>(s.experts),
                 s.rows, s.out, s.in, dw_overwrite);
  grouped_mma_dw(ctx, x.dtype, dw3.data, dw3.dtype, dy3.data, xr, off, static_cast<int>(s.experts),
                 s.rows, s.out, s.in, dw_overwrite);
  return true;
}

// The one product where it applies (dx2 untouched), else the two products apart and dx += dx2
// (the first product, the only reader of dy1, before dx2 is written: they may share memory).
void grouped_linear_backward_pair_cuda(Ctx& ctx, Tensor dx, Tensor dx2, Tensor dw1, Tensor dw3,
                                       Tensor dy1, Tensor dy3, Tensor x, Tensor w1, Tensor w3,
                                       Tensor offsets, bool dw_overwrite) {
  const GroupedDims s = grouped_dims(x, w1, offsets, "grouped_linear_backward_pair");
  check_grouped_linear_backward_pair_args(s, dx, dx2, dw1, dw3, dy1, dy3, x, w1, w3);
  check_on_gpu({&dw3, &dy3, &w3}, "grouped_linear_backward_pair");
  if (!dx2.empty()) check_on_gpu({&dx2}, "grouped_linear_backward_pair");
  if (pair_one_product(ctx, s, dx, dw1, dw3, dy1, dy3, x, Tensor(), w1, w3, offsets, dw_overwrite))
    return;
  require_dx2(dx2, "grouped_linear_backward_pair");
  grouped_linear_backward_cuda(ctx, dx, dw1, dy1, x, w1, offsets, dw_overwrite);
  grouped_linear_backward_cuda(ctx, dx2, dw3, dy3, x, w3, offsets, dw_overwrite);
  cuda::add(ctx, dx, dx, dx2);
}

// The pair with x's rows gathered: pair_one_product gathering x's rows in the dw launch's loads,
// elsewhere grouped_linear_backward_gathered twice and dx += dx2. The same bits as the permuted
// copy through grouped_linear_backward_pair.
void grouped_linear_backward_pair_gathered_cuda(Ctx& ctx, Tensor dx, Tensor dx2, Tensor dw1,
                                                Tensor dw3, Tensor dy1, Tensor dy3, Tensor x,
                                                Tensor row_token, Tensor w1, Tensor w3,
                                                Tensor offsets, bool dw_overwrite) {
  constexpr const char* op = "grouped_linear_backward_pair_gathered";
  check_gathered_device(x, w1, offsets, row_token, x, op);
  const GroupedDims s = check_grouped_linear_backward_pair_gathered_args(dx, dx2, dw1, dw3, dy1,
                                                                         dy3, x, row_token, w1, w3);
  check_on_gpu({&dw3, &dy3, &w3}, op);
  if (!dx2.empty()) check_on_gpu({&dx2}, op);
  if (pair_one_product(ctx, s, dx, dw1, dw3, dy1, dy3, x, row_token, w1, w3, offsets, dw_overwrite))
    return;
  require_dx2(dx2, op);
  grouped_linear_backward_gathered_cuda(ctx, dx, dw1, dy1, x, row_token, w1, offsets, dw_overwrite);
  grouped_linear_backward_gathered_cuda(ctx, dx2, dw3, dy3, x, row_token, w3, offsets,
                                        dw_overwrite);
  cuda::add(ctx, dx, dx, dx2);
}

// grouped_swiglu_forward on rows row_token[r] of x [N, in]: the gather fused into the sm_90
// kernel's loads (its producer warpgroup copies A's rows by cp.async).
void grouped_swiglu_forward_gathered_cuda(Ctx& ctx, Tensor gate, Tensor up, Tensor h, Tensor x,
                                          Tensor row_token, Tensor w1, Tensor w3, Tensor row_w,
                                          Tensor offsets) {
  check_gathered_device(x, w1, offsets, row_token, x, "grouped_swiglu_forward_gathered");
  const GroupedDims s =
      check_grouped_swiglu_forward_gathered_args(gate, up, h, x, row_token, w1, w3, row_w);
  if (s.rows == 0 || s.out == 0) return;
  if (s.experts > 0 && x.size(0) > 0 &&
      grouped_sm90_swiglu(ctx, x.dtype, gate.data, up.data, h.data, x.data, w1.data, w3.data,
                          row_w.dtype == DType::f32 ? data_of<float>(row_w) : nullptr,
                          data_of<int32_t>(offsets), static_cast<int>(s.experts), s.rows, s.out,
                          s.in, data_of<int32_t>(row_token), x.size(0)))
    return;
  Buffer rows;
  grouped_swiglu_forward_cuda(ctx, gate, up, h, permuted_copy(ctx, rows, x, row_token), w1, w3,
                              row_w, offsets);
}

// grouped_swiglu_down_backward with dy's rows row_token[r] of dy [N, d]: dw2 and dh by the
// sm_90 kernels with the gather fused into their loads, then the SwiGLU backward as there.
void grouped_swiglu_down_backward_gathered_cuda(Ctx& ctx, Tensor dgate, Tensor dup, Tensor drow_w,
                                                Tensor dw2, Tensor dy, Tensor row_token, Tensor h,
                                                Tensor w2, Tensor gate, Tensor up, Tensor row_w,
                                                Tensor offsets, bool dw_overwrite) {
  check_gathered_device(h, w2, offsets, row_token, dy, "grouped_swiglu_down_backward_gathered");
  const GroupedDims s = check_grouped_swiglu_down_backward_gathered_args(
      dgate, dup, drow_w, dw2, dy, row_token, h, w2, gate, up, row_w);
  const int32_t* off = data_of<int32_t>(offsets);
  const int32_t* tok = data_of<int32_t>(row_token);
  const int experts = static_cast<int>(s.experts);
  const int64_t n = dy.size(0), d = s.out, f = s.in;
  Buffer rows;
  if (!(s.rows > 0 && s.experts > 0 && f > 0 && d > 0 && n > 0 && grouped_mma_available(h.dtype) &&
        grouped_sm90_dw(ctx, h.dtype, dw2.data, dw2.dtype, dy.data, h.data, off, experts, s.rows, d,
                        f, dw_overwrite, {tok, n, true, false}))) {
    grouped_swiglu_down_backward_cuda(ctx, dgate, dup, drow_w, dw2,
                                      permuted_copy(ctx, rows, dy, row_token), h, w2, gate, up,
                                      row_w, offsets, dw_overwrite);
    return;
  }
  // dh = dy w2[e] into dgate (the gathered rows kernel, or a permuted copy where it declines)
  if (!grouped_sm90_rows(ctx, h.dtype, dgate.data, dy.data, w2.data, off, experts, s.rows, f, d,
                         d * f, false, tok, n))
    grouped_mma_rows(ctx, h.dtype, dgate.data, permuted_copy(ctx, rows, dy, row_token).data,
                     w2.data, off, experts, s.rows, f, d, d * f, false);
  cuda::swiglu_weighted_backward(ctx, dgate, dup, drow_w, dgate, gate, up, row_w);
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(linear_forward, &cuda_detail::linear_forward_cuda);
MOE_REGISTER_CUDA_OP(linear_backward, &cuda_detail::linear_backward_cuda);
MOE_REGISTER_CUDA_OP(linear_forward_batched, &cuda_detail::linear_forward_batched_cuda);
MOE_REGISTER_CUDA_OP(linear_backward_batched, &cuda_detail::linear_backward_batched_cuda);
MOE_REGISTER_CUDA_OP(grouped_linear_forward, &cuda_detail::grouped_linear_forward_cuda);
MOE_REGISTER_CUDA_OP(grouped_linear_forward_adamw, &cuda_detail::grouped_linear_forward_adamw_cuda);
MOE_REGISTER_CUDA_OP(grouped_linear_backward, &cuda_detail::grouped_linear_backward_cuda);
static const bool moe_cuda_registered_pair_query =
    (::moe::cuda::grouped_pair_one_product = &cuda_detail::pair_one_product_runs, true);
MOE_REGISTER_CUDA_OP(grouped_linear_backward_pair, &cuda_detail::grouped_linear_backward_pair_cuda);
MOE_REGISTER_CUDA_OP(grouped_linear_backward_pair_gathered,
                     &cuda_detail::grouped_linear_backward_pair_gathered_cuda);
MOE_REGISTER_CUDA_OP(grouped_linear_backward_gathered,
                     &cuda_detail::grouped_linear_backward_gathered_cuda);
MOE_REGISTER_CUDA_OP(grouped_swiglu_forward, &cuda_detail::grouped_swiglu_forward_cuda);
MOE_REGISTER_CUDA_OP(grouped_swiglu_forward_gathered,
                     &cuda_detail::grouped_swiglu_forward_gathered_cuda);
MOE_REGISTER_CUDA_OP(grouped_swiglu_down_backward, &cuda_detail::grouped_swiglu_down_backward_cuda);
MOE_REGISTER_CUDA_OP(grouped_swiglu_down_backward_gathered,
                     &cuda_detail::grouped_swiglu_down_backward_gathered_cuda);
}  // namespace moe
