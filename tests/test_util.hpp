// Test helpers: owning host buffers behind Tensor views, seeded random fills (never zeros),
// the central finite-difference gradient check used by every op's backward test, f32-vs-f64
// comparison helpers, and scratch directories / small file and error helpers for the I/O tests.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "moe/error.hpp"
#include "moe/ops/common.hpp"
#include "moe/rng.hpp"

namespace moe::test {

// n token ids below `vocab`, seeded (moe::Rng): the model and trainer tests' batches.
inline std::vector<int32_t> tokens(size_t n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng.below(vocab));
  return v;
}

inline Ctx cpu_ctx() {
  return Ctx{};
}

// An owning host buffer of T with a Tensor view of the given shape.
template <class T>
struct Buf {
  std::vector<T> v;
  Tensor t;
  Buf() = default;
  explicit Buf(std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    v.assign(static_cast<size_t>(n), T(0));
    t = Tensor(v.data(), dtype_of<T>(), Device{}, dims);
  }
  Buf(const Buf& o) : v(o.v), t(o.t) { t.data = v.data(); }
  Buf& operator=(const Buf& o) {
    v = o.v;
    t = o.t;
    t.data = v.data();
    return *this;
  }
  operator Tensor() const { return t; }
  T& operator[](size_t i) { return v[i]; }
  const T& operator[](size_t i) const { return v[i]; }
  size_t size() const { return v.size(); }
};

// Uniform in [lo, hi), seeded.
template <class T>
void fill_uniform(Buf<T>& b, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  for (auto& x : b.v) x = static_cast<T>(u(rng));
}

// A buffer of the given shape holding `vals` (sizes must agree).
template <class T>
Buf<T> make(std::initializer_list<int64_t> dims, const std::vector<T>& vals) {
  Buf<T> b(dims);
  REQUIRE(b.size() == vals.size());
  std::copy(vals.begin(), vals.end(), b.v.begin());
  return b;
}

// An f64 buffer of the given shape, uniform in [lo, hi), seeded.
inline Buf<double> random_buf(std::initializer_list<int64_t> dims, uint64_t seed, double lo = -1,
                              double hi = 1) {
  Buf<double> b(dims);
  fill_uniform(b, seed, lo, hi);
  return b;
}

// An f32 copy of an f64 buffer (same shape).
inline Buf<float> to_f32(const Buf<double>& b) {
  Buf<float> f;
  f.v.assign(b.v.begin(), b.v.end());
  f.t = b.t;
  f.t.dtype = DType::f32;
  f.t.data = f.v.data();
  return f;
}

// max_i |a_i - b_i| / (1 + |b_i|): relative for large values, absolute near zero.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(a[i] - b[i]) / (1.0 + std::fabs(b[i])));
  return worst;
}

// Checks analytic[i] == d loss / d x[i] by central differences, perturbing x in place.
// Compares |a - n| <= atol + rtol * max(|a|, |n|) for every element; reports the worst.
inline void check_gradient(std::vector<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& loss, double h = 1e-6, double rtol = 1e-5,
                           double atol = 1e-8, const char* what = "") {
  REQUIRE(x.size() == analytic.size());
  double worst = 0;
  size_t worst_i = 0;
  double worst_a = 0, worst_n = 0;
  bool ok = true;
  for (size_t i = 0; i < x.size(); ++i) {
    double x0 = x[i];
    x[i] = x0 + h;
    double lp = loss();
    x[i] = x0 - h;
    double lm = loss();
    x[i] = x0;
    double num = (lp - lm) / (2 * h);
    double err = std::fabs(num - analytic[i]);
    double bound = atol + rtol * std::max(std::fabs(num), std::fabs(analytic[i]));
    if (err > bound) ok = false;
    double rel = err / bound;
    if (rel > worst) {
      worst = rel;
      worst_i = i;
      worst_a = analytic[i];
      worst_n = num;
    }
  }
  INFO(what << ": worst element " << worst_i << " analytic " << worst_a << " numeric " << worst_n
            << " (error / bound = " << worst << ")");
  CHECK(ok);
}

// sum_i w[i] * y[i]: the scalar a backward test differentiates (w random, so every output counts).
inline double dot(const std::vector<double>& w, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += w[i] * y[i];
  return s;
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit. The
// pid and a counter keep test processes running in parallel (ctest -j) out of each other's way.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("moe_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  // The path of `name` (a file or a subdirectory) inside the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// Every file of a checkpoint directory but the configs (which name the run's own out_dir), as
// (name, bytes) sorted by name: two runs' checkpoints compared bit for bit.
inline std::vector<std::pair<std::string, std::string>> checkpoint_files(
    const std::filesystem::path& dir) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find("config") != std::string::npos) continue;
    std::ifstream in(e.path(), std::ios::binary);
    files.emplace_back(name, std::string(std::istreambuf_iterator<char>(in), {}));
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Writes `text` (any bytes) as the whole file.
inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// The whole file's bytes ("" when it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The message of the InputError that `f` throws (the test fails if it throws nothing).
template <class F>
std::string input_error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("expected an InputError");
  return "";
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace moe::test
