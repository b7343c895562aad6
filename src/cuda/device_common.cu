#include <mutex>
#include <set>
#include <tuple>

#include "device_common.cuh"
#include "env.h"

namespace lily::cuda {

bool pdl_enabled() {
  static const bool on = env_flag("LILY_CUDA_PDL", true);
  return on;
}

void allow_dynamic_smem(const void* kernel, size_t bytes, const char* op) {
  static std::mutex mu;
  static std::set<std::tuple<int, const void*, size_t>> done;
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({dev, kernel, bytes})) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op);
  done.insert({dev, kernel, bytes});
}

int sm_count() {
  static thread_local int cached_device = -1, cached = 0;
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev != cached_device) {
    check(cudaDeviceGetAttribute(&cached, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute(SM count)");
    cached_device = dev;
  }
  return cached;
}

}  // namespace lily::cuda
