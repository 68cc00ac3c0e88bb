// Implementation of tests/gpu_test_util.hpp, and the main of the GPU test executables.
// Catch2 2.x: this file supplies main, so the runner configuration must precede the first
// Catch include, which gpu_test_util.hpp makes.
#ifndef MOE_CATCH_V3
#define CATCH_CONFIG_RUNNER
#endif
#include "gpu_test_util.hpp"

#include <cstdio>
#include <random>

#ifdef MOE_CATCH_V3
#include <catch2/catch_session.hpp>
#else
#include <catch2/catch.hpp>
#endif

namespace moe::test {

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff)
    return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal
      int e = -1;
      uint32_t m = mant;
      do {
        ++e;
        m <<= 1;
      } while (!(m & 0x400u));
      x = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

void upload(Tensor t, const std::vector<double>& v) {
  MOE_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "upload: size mismatch");
  switch (t.dtype) {
    case DType::f64:
      copy_from_host(t, v.data());
      break;
    case DType::f32: {
      std::vector<float> f(v.begin(), v.end());
      copy_from_host(t, f.data());
      break;
    }
    case DType::bf16:
    case DType::f16: {
      std::vector<uint16_t> h(v.size());
      for (size_t i = 0; i < v.size(); ++i)
        h[i] = t.dtype == DType::bf16 ? float_to_bf16(static_cast<float>(v[i]))
                                      : float_to_half(static_cast<float>(v[i]));
      copy_from_host(t, h.data());
      break;
    }
    default:
      throw InternalError("upload: use upload_i32 for index tensors");
  }
}

void upload_i32(Tensor t, const std::vector<int32_t>& v) {
  MOE_CHECK(static_cast<int64_t>(v.size()) == t.numel() && t.dtype == DType::i32, "upload_i32");
  copy_from_host(t, v.data());
}

std::vector<unsigned char> bytes_of(Tensor t) {
  std::vector<unsigned char> b(t.nbytes());
  copy_to_host(b.data(), t);
  return b;
}

std::vector<double> download(Tensor t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  switch (t.dtype) {
    case DType::f64:
      copy_to_host(out.data(), t);
      break;
    case DType::f32: {
      std::vector<float> f(out.size());
      copy_to_host(f.data(), t);
      out.assign(f.begin(), f.end());
      break;
    }
    case DType::bf16:
    case DType::f16: {
      std::vector<uint16_t> h(out.size());
      copy_to_host(h.data(), t);
      for (size_t i = 0; i < h.size(); ++i)
        out[i] = t.dtype == DType::bf16 ? bf16_to_float(h[i]) : half_to_float(h[i]);
      break;
    }
    case DType::i32: {
      std::vector<int32_t> h(out.size());
      copy_to_host(h.data(), t);
      out.assign(h.begin(), h.end());
      break;
    }
    case DType::u16: {  // the split master's low halves, as their integer values
      std::vector<uint16_t> h(out.size());
      copy_to_host(h.data(), t);
      out.assign(h.begin(), h.end());
      break;
    }
  }
  return out;
}

std::vector<int32_t> download_i32(Tensor t) {
  std::vector<int32_t> h(static_cast<size_t>(t.numel()));
  copy_to_host(h.data(), t);
  return h;
}

void poison(Tensor t) {
  if (t.dtype == DType::i32) {
    upload_i32(t, std::vector<int32_t>(static_cast<size_t>(t.numel()), -777));
    return;
  }
  upload(t, std::vector<double>(static_cast<size_t>(t.numel()), std::nan("")));
}

std::vector<double> random_values(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) {
    do x = u(rng);
    while (std::fabs(x) < 1e-3);
  }
  return v;
}

std::vector<double> rounded_random_values(DType dt, size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) {
    do x = u(rng);
    while (std::fabs(x) < 1e-3);
  }
  return round_to(dt, v);
}

std::vector<double> uniform_values(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) {
    x = u(rng);
    if (x == 0) x = 0.375;
  }
  return v;
}

std::vector<double> tied_values(size_t n, uint64_t seed, std::initializer_list<double> set) {
  const std::vector<double> values(set);
  std::mt19937_64 rng(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = values[rng() % values.size()];
  return v;
}

std::vector<double> round_to(DType dt, const std::vector<double>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    out[i] = dt == DType::f64    ? v[i]
             : dt == DType::f32  ? f
             : dt == DType::bf16 ? bf16_to_float(float_to_bf16(f))
                                 : half_to_float(float_to_half(f));
  }
  return out;
}

double worst_ratio(const std::vector<double>& a, const std::vector<double>& b, double rtol,
                   double atol) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    // An exact match is ratio 0 even where the tolerance is 0 (a zero reference).
    const double diff = std::fabs(a[i] - b[i]);
    const double r = diff == 0 ? 0.0 : diff / (atol + rtol * std::fabs(b[i]));
    worst = std::max(worst, std::isnan(r) ? 1e300 : r);
  }
  return a.size() == b.size() ? worst : 1e300;
}

}  // namespace moe::test

int main(int argc, char** argv) {
  if (moe::gpu::device_count() == 0) {
    std::printf("no GPU: skipping\n");
    return 77;
  }
  std::string why;
  if (!moe::gpu::has_code_for(0, &why)) {
    std::printf("%s\n", why.c_str());
    return 1;
  }
  return Catch::Session().run(argc, argv);
}
