// GPU test helpers: device buffers filled from host data in any storage dtype (f32, f64, f16,
// bf16, i32), read back as double, and poisoned before each run so an op that leaves an output
// unwritten fails. GPU test files (tests/test_gpu_*.cpp) get a main that exits 77 — reported by
// ctest as skipped — when no GPU is present.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe/cuda_runtime.hpp"
#include "moe/memory.hpp"
#include "moe/ops/common.hpp"

namespace moe::test {

inline Device gpu0() { return Device{DeviceType::cuda, 0}; }
inline Ctx gpu_ctx() { return make_ctx(gpu0()); }

// Host-side conversions for the 16-bit storage types (round to nearest even).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_half(float f);
float half_to_float(uint16_t h);

// A device tensor that owns its memory.
struct DeviceTensor {
  Buffer buf;
  Tensor t;
  DeviceTensor(DType dt, std::initializer_list<int64_t> dims)
      : buf(gpu0(), Tensor(nullptr, dt, gpu0(), dims).nbytes()),
        t(buf.data(), dt, gpu0(), dims) {}
  operator Tensor() const { return t; }
};

// Uploads values (converted to the tensor's dtype).
void upload(Tensor t, const std::vector<double>& values);
void upload_i32(Tensor t, const std::vector<int32_t>& values);
// Downloads as doubles.
std::vector<double> download(Tensor t);
std::vector<int32_t> download_i32(Tensor t);
// Fills with a NaN pattern (floats) or -777 (i32).
void poison(Tensor t);

// The same values rounded through a storage dtype (what the GPU op actually sees).
std::vector<double> round_to(DType dt, const std::vector<double>& v);

// max_i |a_i - b_i| / (atol + rtol * |b_i|) <= 1 ; returns the worst ratio for reporting.
double worst_ratio(const std::vector<double>& a, const std::vector<double>& b, double rtol,
                   double atol);

// Tolerances per dtype for results computed with fp32 accumulation from rounded inputs.
inline double rtol_for(DType dt) {
  return dt == DType::bf16 ? 2e-2 : dt == DType::f16 ? 4e-3 : dt == DType::f32 ? 2e-5 : 1e-11;
}

}  // namespace moe::test
