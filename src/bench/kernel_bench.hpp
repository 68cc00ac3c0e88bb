// `moe-train bench`: times each kernel family at a config's shapes on one device and sets it
// against a roofline measured in the same run: the device's copy bandwidth for memory-bound
// families, the dense GEMM rate (cuBLAS on a GPU, OpenBLAS on the CPU) at the same FLOPs and
// dtype for the matmul families. Inputs are random (never zeros), times are medians over
// iterations after a warm-up, measured with CUDA events on a GPU.
#pragma once
#include <string>
#include <vector>

#include "moe/config.hpp"
#include "moe/tensor.hpp"

namespace moe {

struct BenchOptions {
  int iters = 20;
  // Expert-load skews for the grouped GEMM rows: maxvio = max load / mean load - 1 (0 =
  // balanced). Values above E - 1 are capped (one expert takes every row).
  std::vector<double> skews = {0, 1, 10};
  // Families to time (a row runs when its family starts with one of these); empty = all. The
  // references (copy, dense_gemm, dense_gemm_bwd) always run: the other rows are set against them.
  std::vector<std::string> families;
};

struct BenchRow {
  std::string family;   // router, permute, grouped_gemm, ...
  std::string detail;   // shape and variant
  double ms = 0;        // median time per call
  double work = 0;      // bytes (memory-bound) or FLOPs (matmul) per call
  bool flops = false;   // work is FLOPs
  double roofline = 0;  // bytes/s or FLOP/s of the reference
  double target = 0;    // the fraction of the roofline issue 5 asks for (0 = none)
  double fraction() const { return ms > 0 && roofline > 0 ? work / (ms * 1e-3) / roofline : 0; }
};

// Every family run_kernel_bench can time, in the order it runs them (overlap_* on a GPU only).
const std::vector<std::string>& bench_families();
// Whether some family starts with `prefix` (what BenchOptions::families selects by).
bool names_a_family(const std::string& prefix);

// Runs every family; `compute` is the activation dtype (f32 on the CPU).
std::vector<BenchRow> run_kernel_bench(const ModelConfig& m, int batch, int seq_len, DType compute,
                                       Device dev, const BenchOptions& opt);
std::string format_bench(const std::vector<BenchRow>& rows);

}  // namespace moe
