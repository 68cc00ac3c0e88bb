#include "moe/memory.hpp"

#include "moe/cuda_runtime.hpp"
#include "moe/ops/common.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace moe {

Buffer::Buffer(Device dev, size_t bytes) : bytes_(bytes), dev_(dev) {
  if (dev.type == DeviceType::cuda) {
    ptr_ = gpu::malloc_device(bytes, dev.index);
    gpu::memset_device(ptr_, 0, bytes);
    return;
  }
  size_t rounded = (bytes + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign;
  if (rounded == 0) rounded = Arena::kAlign;
#if !defined(__SANITIZE_ADDRESS__)
  // Large buffers are mapped: the kernel hands out zero pages on first touch, so the parts of a
  // buffer nothing writes cost no memory (the gradient buffer of the CPU model that holds a
  // ZeRO-3 run's whole weights while it saves: 4 bytes per parameter). AddressSanitizer builds
  // keep the heap, whose bounds it checks.
  if (rounded >= kMapMinBytes) {
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
    ptr_ = p;
    mapped_ = rounded;
    return;
  }
#endif
  ptr_ = std::aligned_alloc(Arena::kAlign, rounded);
  if (!ptr_)
    throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
  std::memset(ptr_, 0, rounded);
}

Buffer Buffer::host(size_t bytes, bool pinned) {
  if (!pinned) return Buffer(Device{}, bytes);
  Buffer b;
  b.ptr_ = gpu::malloc_pinned(bytes == 0 ? 1 : bytes);
  b.bytes_ = bytes;
  b.pinned_ = true;
  std::memset(b.ptr_, 0, bytes);
  return b;
}

Buffer::~Buffer() {
  release();
}

void Buffer::release() {
  if (ptr_ && dev_.type == DeviceType::cuda)
    gpu::free_device(ptr_);
  else if (ptr_ && pinned_)
    gpu::free_pinned(ptr_);
  else if (ptr_ && mapped_ > 0)
    munmap(ptr_, mapped_);
  else if (ptr_)
    std::free(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  pinned_ = false;
  mapped_ = 0;
}

Buffer::Buffer(Buffer&& o) noexcept
    : ptr_(o.ptr_), bytes_(o.bytes_), dev_(o.dev_), pinned_(o.pinned_), mapped_(o.mapped_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
  o.pinned_ = false;
  o.mapped_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    dev_ = o.dev_;
    pinned_ = o.pinned_;
    mapped_ = o.mapped_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
    o.pinned_ = false;
    o.mapped_ = 0;
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
  if (dst.device.type == DeviceType::cuda)
    gpu::copy_to_device(dst.data, src, dst.nbytes());
  else
    std::memcpy(dst.data, src, dst.nbytes());
}

void copy_to_host(void* dst, Tensor src) {
  if (src.device.type == DeviceType::cuda)
    gpu::copy_to_host(dst, src.data, src.nbytes());
  else
    std::memcpy(dst, src.data, src.nbytes());
}

void copy_to_host(Ctx& ctx, void* dst, Tensor src) {
  if (src.device.type == DeviceType::cuda)
    gpu::copy_to_host_on(dst, src.data, src.nbytes(), ctx.stream);
  else
    std::memcpy(dst, src.data, src.nbytes());
}

Ctx make_ctx(Device dev) {
  Ctx ctx;
  ctx.device = dev;
  if (dev.type == DeviceType::cuda) {
    gpu::set_device(dev.index);
    ctx.stream = gpu::default_stream(dev.index);
    ctx.blas = gpu::blas_handle(dev.index);
  }
  return ctx;
}

}  // namespace moe
