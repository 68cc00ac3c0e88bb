// Tensor: a typed, shaped view of memory owned elsewhere (an arena or a parameter buffer).
// Views are cheap to copy; they never free memory. Rows are contiguous (row-major, no strides).
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "moe/error.hpp"

namespace moe {

// u16: raw 16-bit words (the low halves of a split fp32 master, common/split_master.hpp).
enum class DType : uint8_t { f32, f64, f16, bf16, i32, u16 };
enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// The dtype that statistics, routing weights and parameter gradients of an op over compute dtype t
// are kept in: f64 for f64, f32 for f32, f16 and bf16 (16-bit activations keep fp32 statistics, so
// a sum over many rows or a log-sum-exp is rounded once, into fp32). Throws InternalError for i32.
DType acc_dtype(DType t);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  Tensor() = default;
  Tensor(void* d, DType t, Device dev, std::initializer_list<int64_t> dims);

  bool empty() const { return data == nullptr; }
  int64_t size(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  size_t nbytes() const { return numel() * dtype_size(dtype); }
  std::string shape_str() const;

  template <class T>
  T* ptr() const {
    MOE_CHECK(dtype == dtype_of<T>(), std::string("tensor holds ") + dtype_name(dtype));
    return static_cast<T*>(data);
  }
  // Same memory seen with another shape of the same element count.
  Tensor view(std::initializer_list<int64_t> dims) const;
  // Rows [begin, end) along dim 0.
  Tensor rows(int64_t begin, int64_t end) const;
};

// Shape checks with a message naming the op and argument.
void check_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what);
void check_same_dtype(const Tensor& a, const Tensor& b, const char* what);
// stat.dtype == acc_dtype(x.dtype), else InternalError "<what>: dtype f16, expected f32 (the
// accumulation dtype of f16)".
void check_acc_dtype(const Tensor& stat, const Tensor& x, const char* what);
// A per-row statistic (a routing weight, its gradient): stat is [rows] in acc_dtype(x).
void check_row_stat(const Tensor& stat, int64_t rows, const Tensor& x, const char* what);
// Whether a's and b's bytes overlap (never when either is empty).
bool memory_overlaps(const Tensor& a, const Tensor& b);

}  // namespace moe
