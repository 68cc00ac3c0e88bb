#include "moe/tensor.hpp"

#include <cstdint>
#include <sstream>

#include "moe/ops/common.hpp"

namespace moe {

std::string shown(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void throw_check_failed(const char* cond, const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << msg << " (check `" << cond << "` failed at " << file << ":" << line << ")";
  throw InternalError(os.str());
}

void throw_no_backend(const char* op, const Device& d) {
  throw InternalError(std::string(op) + ": no implementation for device " + d.str() +
                      " in this build");
}

std::string Device::str() const {
  return type == DeviceType::cpu ? "cpu" : "cuda:" + std::to_string(index);
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::f16:
      return 2;
    case DType::bf16:
      return 2;
    case DType::i32:
      return 4;
    case DType::u16:
      return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
    case DType::u16:
      return "u16";
  }
  return "?";
}

DType acc_dtype(DType t) {
  switch (t) {
    case DType::f64:
      return DType::f64;
    case DType::f32:
    case DType::f16:
    case DType::bf16:
      return DType::f32;
    case DType::i32:
    case DType::u16:
      break;
  }
  throw InternalError(std::string("acc_dtype: ") + dtype_name(t) +
                      " is not a float dtype (no accumulation dtype)");
}

Tensor::Tensor(void* d, DType t, Device dev, std::initializer_list<int64_t> dims)
    : data(d), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
  MOE_CHECK(dims.size() <= kMaxDims, "too many dimensions");
  int i = 0;
  for (int64_t v : dims) shape[i++] = v;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Tensor Tensor::view(std::initializer_list<int64_t> dims) const {
  Tensor t(data, dtype, device, dims);
  MOE_CHECK(t.numel() == numel(), "view " + t.shape_str() + " of tensor " + shape_str());
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  MOE_CHECK(ndim >= 1 && 0 <= begin && begin <= end && end <= shape[0],
            "rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " + shape_str());
  Tensor t = *this;
  int64_t row = numel() / (shape[0] == 0 ? 1 : shape[0]);
  // A planned tensor (no memory yet) stays without: no offset from a null pointer.
  if (data != nullptr) t.data = static_cast<char*>(data) + begin * row * dtype_size(dtype);
  t.shape[0] = end - begin;
  return t;
}

void check_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what) {
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t v : dims) ok = ok && (i < t.ndim && t.shape[i++] == v);
  if (!ok) {
    Tensor want(nullptr, t.dtype, t.device, dims);
    throw InternalError(std::string(what) + ": shape " + t.shape_str() + ", expected " +
                        want.shape_str());
  }
}

void check_same_dtype(const Tensor& a, const Tensor& b, const char* what) {
  if (a.dtype != b.dtype)
    throw InternalError(std::string(what) + ": dtype " + dtype_name(a.dtype) + " vs " +
                        dtype_name(b.dtype));
}

void check_row_stat(const Tensor& stat, int64_t rows, const Tensor& x, const char* what) {
  check_shape(stat, {rows}, what);
  check_acc_dtype(stat, x, what);
}

void check_acc_dtype(const Tensor& stat, const Tensor& x, const char* what) {
  if (x.dtype == DType::i32)
    throw InternalError(std::string(what) + ": the compute dtype is i32, expected a float dtype");
  const DType want = acc_dtype(x.dtype);
  if (stat.dtype != want)
    throw InternalError(std::string(what) + ": dtype " + dtype_name(stat.dtype) + ", expected " +
                        dtype_name(want) + " (the accumulation dtype of " + dtype_name(x.dtype) +
                        ")");
}

bool memory_overlaps(const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty()) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace moe
