// Owned memory: Buffer (one allocation on a device) and Arena (a bump allocator over a Buffer).
// Static memory is a design rule: parameters, gradients and optimizer state each live in one
// Buffer, activations in an Arena planned before the first step. An Arena runs in two modes:
// measuring (alloc returns data-less tensors and counts bytes) and then allocating, driven by the
// same plan function, so the sizes can never drift apart.
#pragma once
#include <cstddef>
#include <memory>

#include "moe/tensor.hpp"

namespace moe {

class Buffer {
 public:
  Buffer() = default;
  // Zeroed. On the host, buffers of kMapMinBytes or more are mapped pages, zeroed by the kernel
  // on first touch: what is never written costs no memory.
  Buffer(Device dev, size_t bytes);
  static constexpr size_t kMapMinBytes = size_t{1} << 20;
  // Host memory (zeroed), page-locked when `pinned` (a build with CUDA: cudaMallocHost, so copies
  // to and from a GPU run at full speed and asynchronously), else ordinary aligned memory.
  static Buffer host(size_t bytes, bool pinned);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return dev_; }
  bool pinned() const { return pinned_; }
  Tensor as(DType t, std::initializer_list<int64_t> dims) const;

 private:
  void release();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Device dev_;
  bool pinned_ = false;
  size_t mapped_ = 0;  // host buffers from mmap: the mapped length (else 0)
};

class Arena {
 public:
  static constexpr size_t kAlign = 256;  // keeps every tensor aligned for vector loads

  explicit Arena(Device dev) : dev_(dev) {}
  // Switch from measuring to allocating: reserves the peak measured so far.
  void allocate();
  bool measuring() const { return buffer_.data() == nullptr; }

  Tensor alloc(DType t, std::initializer_list<int64_t> dims);
  // Stack discipline for transient scratch: release everything allocated after `mark()`.
  size_t mark() const { return used_; }
  void release(size_t mark) { used_ = mark; }
  size_t peak_bytes() const { return peak_; }
  Device device() const { return dev_; }

 private:
  Device dev_;
  Buffer buffer_;
  size_t used_ = 0;
  size_t peak_ = 0;
};

}  // namespace moe

namespace moe {
// Host <-> tensor copies (the only way model code touches device memory from the host).
void copy_from_host(Tensor dst, const void* src);
void copy_to_host(void* dst, Tensor src);
struct Ctx;
// The same, waiting only for ctx's stream (on a GPU): work of another stream goes on.
void copy_to_host(Ctx& ctx, void* dst, Tensor src);
// The execution context for a device: its stream and cuBLAS handle on CUDA.
Ctx make_ctx(Device dev);
}  // namespace moe
