// The op seam. Every op is declared once with MOE_OP: that declares its CPU implementation
// (moe::cpu::name, kernels/cpu), the slot of its CUDA implementation when built with CUDA
// (moe::cuda::name, set by kernels/cuda) and the dispatching moe::name, which picks the backend
// from ctx.device.
//
// Conventions shared by every op:
// - Parameter gradients (dw, dtable, ...) ACCUMULATE (+=), so micro-batches and tied weights
//   add up.
// - Activation gradients (dx, dq, ...) OVERWRITE unless an argument says otherwise.
// - Float tensors of one call share one compute dtype T: f32 or f64 (gradient checks) on both
//   backends, f16 / bf16 on CUDA (mixed precision). The exceptions are named in each op's comment
//   as "in acc_dtype(T)": statistics (rstd, lse, losses), routing weights (topk_w, MoD scores),
//   rope tables and parameter gradients (dw, dtable) are kept in acc_dtype(T) (f32 for f32 / f16 /
//   bf16, f64 for f64), so 16-bit activations never round a statistic or a sum over rows to 16
//   bits. For f32 and f64 acc_dtype(T) == T: those calls look exactly as before.
// - Index tensors are i32. Shapes are checked; a mismatch throws with the op and argument name.
#pragma once
#include "moe/profiler.hpp"
#include "moe/tensor.hpp"

namespace moe {

// Execution context of an op: where it runs and the handles it may use.
struct Ctx {
  Device device;
  void* stream = nullptr;  // cudaStream_t on CUDA
  void* blas = nullptr;    // cublasHandle_t on CUDA
  // Planning pass: ops return at once, so a layer's backward can run over data-less tensors
  // while its scratch Arena measures the peak it will need.
  bool dry_run = false;
};

[[noreturn]] void throw_no_backend(const char* op, const Device& d);

}  // namespace moe

// CUDA kernels register themselves (kernels/cuda/*.cu, linked whole-archive) in a function pointer
// of the op's exact signature; an op without a CUDA kernel yet throws when called on a GPU.
#ifdef MOE_WITH_CUDA
#define MOE_OP_CUDA_DECL(name, params)               \
  namespace cuda {                                   \
  inline decltype(&::moe::cpu::name) name = nullptr; \
  }
#define MOE_OP_CUDA_CALL(name, args)      \
  if (cuda::name) return cuda::name args; \
  throw_no_backend(#name, ctx.device)
#else
#define MOE_OP_CUDA_DECL(name, params)
#define MOE_OP_CUDA_CALL(name, args) throw_no_backend(#name, ctx.device)
#endif

// MOE_OP(name, (Ctx& ctx, ...params), (ctx, ...args)): the first parameter must be `ctx`.
#define MOE_OP(name, params, args)                                   \
  namespace cpu {                                                    \
  void name params;                                                  \
  }                                                                  \
  MOE_OP_CUDA_DECL(name, params)                                     \
  inline void name params {                                          \
    if (ctx.dry_run) return;                                         \
    if (profile::enabled()) {                                        \
      profile::Scope moe_profile_scope(#name, ctx);                  \
      if (ctx.device.type == DeviceType::cpu) return cpu::name args; \
      MOE_OP_CUDA_CALL(name, args);                                  \
    }                                                                \
    if (ctx.device.type == DeviceType::cpu) return cpu::name args;   \
    MOE_OP_CUDA_CALL(name, args);                                    \
  }
