// GPU test helpers: device buffers filled from host data in any storage dtype (f32, f64, f16,
// bf16, i32), read back as double, and poisoned before each run so an op that leaves an output
// unwritten fails. GPU test files (tests/test_gpu_*.cpp) get a main that exits 77 — reported by
// ctest as skipped — when no GPU is present.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/memory.hpp"
#include "moe/ops/common.hpp"
#include "moe/ops/elementwise.hpp"
#include "test_util.hpp"

namespace moe::test {

inline Device gpu0() {
  return Device{DeviceType::cuda, 0};
}
inline Ctx gpu_ctx() {
  return make_ctx(gpu0());
}

// The sm_90 grouped GEMM's setting for a test: MOE_GROUPED_SM90 (grouped_wgmma_sm90.cu's mode()),
// and "<mode>-deferred" / "<mode>-deferredN" the same with the cooperative rows kernels' deferred
// epilogue (MOE_GROUPED_DEFER=1 / N: its held stage freed after slice 0 / N - 1 of the next tile).
// clear_grouped_sm90 puts both back to their defaults.
inline void set_grouped_sm90(const std::string& setting) {
  const std::string tag = "-deferred";
  const size_t at = setting.find(tag);
  const std::string mode = setting.substr(0, at);
  const std::string n = at == std::string::npos ? "0" : setting.substr(at + tag.size());
  setenv("MOE_GROUPED_SM90", mode.c_str(), 1);
  setenv("MOE_GROUPED_DEFER", n.empty() ? "1" : n.c_str(), 1);
}
inline void clear_grouped_sm90() {
  unsetenv("MOE_GROUPED_SM90");
  unsetenv("MOE_GROUPED_DEFER");
}

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

// A host tensor of any float dtype, filled from doubles that dt represents exactly (through the CPU
// convert op from an f64 tensor: exact for such values) and read back as doubles.
struct HostAny {
  std::vector<double> storage;  // enough bytes for any dtype
  Tensor t;
  HostAny(DType dt, const std::vector<double>& values) : storage(values.size()) {
    const int64_t n = static_cast<int64_t>(values.size());
    t = Tensor(storage.data(), dt, Device{}, {n});
    std::vector<double> copy = values;
    Ctx cpu{};
    cpu::convert(cpu, t, Tensor(copy.data(), DType::f64, Device{}, {n}), false);
  }
  std::vector<double> values() const {
    std::vector<double> out(static_cast<size_t>(t.numel()));
    Ctx cpu{};
    cpu::convert(cpu, Tensor(out.data(), DType::f64, Device{}, {t.numel()}), t, false);
    return out;
  }
};

// A device tensor that owns its memory.
struct DeviceTensor {
  Buffer buf;
  Tensor t;
  DeviceTensor(DType dt, std::initializer_list<int64_t> dims)
      : buf(gpu0(), Tensor(nullptr, dt, gpu0(), dims).nbytes()), t(buf.data(), dt, gpu0(), dims) {}
  operator Tensor() const { return t; }
};

// A 4-layer model with dense, MoE (shared expert) and MoD layers on the synthetic source, as
// config overrides (the GPU training tests' model).
inline std::vector<std::string> small_model_overrides() {
  return {"train_micro_batch_size_per_gpu=4",
          "model.vocab_size=61",
          "model.hidden_size=64",
          "model.intermediate_size=48",
          "model.num_hidden_layers=4",
          "model.num_attention_heads=4",
          "model.num_key_value_heads=2",
          "model.max_position_embeddings=64",
          "model.num_local_experts=8",
          "model.num_shared_experts=1",
          "model.moe_layer_freq=2",
          "model.mod={\"enabled\": true, \"every\": 2, \"capacity\": 0.5}",
          "data.seq_len=32",
          "optimizer.params.lr=3e-3"};
}

// Uploads values (converted to the tensor's dtype).
void upload(Tensor t, const std::vector<double>& values);
void upload_i32(Tensor t, const std::vector<int32_t>& values);
// Downloads as doubles.
std::vector<double> download(Tensor t);
// The raw bytes of a tensor (on the device or the host): bitwise comparisons, 16-bit included.
std::vector<unsigned char> bytes_of(Tensor t);
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

// ---- seeded inputs (each generator keeps the exact stream the tests were written against) ----

// Uniform in [lo, hi) with |x| >= 1e-3 (never zero), seeded (mt19937_64).
std::vector<double> random_values(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0);
// Seeded uniform values in [lo, hi), none closer to zero than 1e-3, rounded to dt (mt19937 seeded
// with the low 32 bits of seed: a different stream from random_values).
std::vector<double> rounded_random_values(DType dt, size_t n, uint64_t seed, double lo = -1.0,
                                          double hi = 1.0);
// Uniform in [lo, hi) (mt19937_64), an exact zero replaced by 0.375: never exactly zero.
std::vector<double> uniform_values(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0);
// Values drawn (mt19937_64) from `set`, a few exactly representable numbers: many exact ties.
std::vector<double> tied_values(size_t n, uint64_t seed, std::initializer_list<double> set);

// ---- host and device tensors ----

// An f64 host tensor holding a copy of values (zeros when none are given).
struct Host {
  std::vector<double> v;
  Tensor t;
  Host(std::initializer_list<int64_t> dims, std::vector<double> values) : v(std::move(values)) {
    t = Tensor(v.data(), DType::f64, Device{}, dims);
    REQUIRE(static_cast<int64_t>(v.size()) == t.numel());
  }
  Host(std::initializer_list<int64_t> dims) : Host(dims, std::vector<double>(count(dims), 0.0)) {}
  static size_t count(std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return static_cast<size_t>(n);
  }
  Host(const Host&) = delete;
  operator Tensor() const { return t; }
};

// An f64 host buffer holding v.
inline Buf<double> host(std::initializer_list<int64_t> dims, const std::vector<double>& v) {
  Buf<double> b(dims);
  REQUIRE(b.v.size() == v.size());
  b.v = v;
  b.t.data = b.v.data();
  return b;
}

inline Buf<int32_t> host_i32(const std::vector<int32_t>& v) {
  Buf<int32_t> b({static_cast<int64_t>(v.size())});
  b.v = v;
  b.t.data = b.v.data();
  return b;
}

// A device tensor holding v (already rounded to dt).
inline DeviceTensor on_device(DType dt, std::initializer_list<int64_t> dims,
                              const std::vector<double>& v) {
  DeviceTensor t(dt, dims);
  upload(t, v);
  return t;
}

// A poisoned device tensor (an output the op must write completely).
inline DeviceTensor poisoned(DType dt, std::initializer_list<int64_t> dims) {
  DeviceTensor t(dt, dims);
  poison(t);
  return t;
}

// ---- comparisons ----

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// |gpu - ref| <= rtol (|ref| + max|ref|) everywhere.
inline void expect_close(const std::vector<double>& gpu, const std::vector<double>& ref,
                         double rtol, const char* what) {
  const double scale = max_abs(ref);
  const double ratio = worst_ratio(gpu, ref, rtol, rtol * scale);
  INFO(what << ": worst |gpu - ref| / tolerance = " << ratio << " (rtol " << rtol << ", max|ref| "
            << scale << ")");
  CHECK(ratio <= 1.0);
}

// |got - want| <= atol + rtol_for(dt) |want| everywhere.
inline void check_close(const std::vector<double>& got, const std::vector<double>& want, DType dt,
                        double atol, const char* what) {
  const double r = worst_ratio(got, want, rtol_for(dt), atol);
  INFO(what << " (" << dtype_name(dt) << "): worst |error| / tolerance = " << r);
  CHECK(r <= 1.0);
}
// Tolerance of gradient-like outputs: relative, plus rtol of the output's scale.
inline void check_grad(const std::vector<double>& got, const std::vector<double>& want, DType dt,
                       const char* what) {
  check_close(got, want, dt, rtol_for(dt) * std::max(max_abs(want), 1e-30), what);
}

}  // namespace moe::test
