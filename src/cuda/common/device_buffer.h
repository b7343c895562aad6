// Owning handles for device memory and mapped pinned host memory (move-only; freed on
// destruction, errors ignored there because a destructor must not throw).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "common/cuda_check.h"

namespace lily::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, const char* what) : p_(device_alloc(bytes, what)), n_(bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory that kernels can write directly (zero-copy).
class MappedHostBuffer {
 public:
  MappedHostBuffer() = default;
  explicit MappedHostBuffer(size_t bytes) {
    check(cudaHostAlloc(&p_, bytes, cudaHostAllocMapped), "cudaHostAlloc (mapped)");
    check(cudaHostGetDevicePointer(&d_, p_, 0), "cudaHostGetDevicePointer");
  }
  MappedHostBuffer(MappedHostBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), d_(std::exchange(o.d_, nullptr)) {}
  MappedHostBuffer& operator=(MappedHostBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(d_, o.d_);
    return *this;
  }
  ~MappedHostBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  template <typename T>
  T* host() const { return static_cast<T*>(p_); }
  template <typename T>
  T* device() const { return static_cast<T*>(d_); }

 private:
  void* p_ = nullptr;
  void* d_ = nullptr;
};

}  // namespace lily::cuda
