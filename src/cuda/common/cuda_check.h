// Host-side CUDA error checking: every runtime call goes through check(), which turns a
// failure into a lily::Error naming the operation (out of memory gets its own message).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "error.h"

namespace lily::cuda {

inline void check(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky-free error so the next call starts clean
  if (err == cudaErrorMemoryAllocation) fail("CUDA out of memory in ", op);
  fail("CUDA error in ", op, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

// Checks a kernel launch (launch configuration errors surface here).
inline void check_launch(const char* op) { check(cudaGetLastError(), op); }

// cudaMalloc with a message that names what was being allocated and how much was free.
inline void* device_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  if (bytes == 0) return nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("CUDA out of memory allocating ", std::to_string(bytes >> 20), " MiB for ", what, " (", std::to_string(free_b >> 20),
         " MiB free of ", std::to_string(total_b >> 20), " MiB)");
  }
  check(err, what);
  return p;
}

}  // namespace lily::cuda
