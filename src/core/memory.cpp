#include "moe/memory.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace moe {

Buffer::Buffer(Device dev, size_t bytes) : bytes_(bytes), dev_(dev) {
  MOE_CHECK(dev.type == DeviceType::cpu, "Buffer: device " + dev.str() + " is not in this build");
  size_t rounded = (bytes + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign;
  ptr_ = std::aligned_alloc(Arena::kAlign, rounded == 0 ? Arena::kAlign : rounded);
  if (!ptr_)
    throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
  std::memset(ptr_, 0, rounded == 0 ? Arena::kAlign : rounded);
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
  if (ptr_) std::free(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

Buffer::Buffer(Buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), dev_(o.dev_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    dev_ = o.dev_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

Tensor Buffer::as(DType t, std::initializer_list<int64_t> dims) const {
  Tensor v(ptr_, t, dev_, dims);
  MOE_CHECK(v.nbytes() <= bytes_, "Buffer::as: view larger than the buffer");
  return v;
}

void Arena::allocate() {
  MOE_CHECK(measuring(), "Arena::allocate called twice");
  buffer_ = Buffer(dev_, peak_);
  used_ = 0;
}

Tensor Arena::alloc(DType t, std::initializer_list<int64_t> dims) {
  Tensor v(nullptr, t, dev_, dims);
  size_t bytes = (v.nbytes() + kAlign - 1) / kAlign * kAlign;
  if (!measuring()) {
    MOE_CHECK(used_ + bytes <= buffer_.bytes(),
              "Arena: allocation beyond the planned size (plan and step disagree)");
    v.data = static_cast<char*>(buffer_.data()) + used_;
  }
  used_ += bytes;
  if (used_ > peak_) peak_ = used_;
  return v;
}

}  // namespace moe

namespace moe {

void copy_from_host(Tensor dst, const void* src) {
  MOE_CHECK(dst.device.type == DeviceType::cpu, "copy_from_host: device not in this build");
  std::memcpy(dst.data, src, dst.nbytes());
}

void copy_to_host(void* dst, Tensor src) {
  MOE_CHECK(src.device.type == DeviceType::cpu, "copy_to_host: device not in this build");
  std::memcpy(dst, src.data, src.nbytes());
}

}  // namespace moe
