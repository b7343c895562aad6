#include <algorithm>
#include <map>
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

int max_cluster_size(const void* kernel, int threads, size_t smem, int want, const char* op) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t, int>, int> found;
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, kernel, threads, smem, want);
  if (auto it = found.find(key); it != found.end()) return it->second;
  if (want > 8) check(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), op);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(want);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  int size = 1;
  check(cudaOccupancyMaxPotentialClusterSize(&size, kernel, &cfg), op);
  return found[key] = std::max(1, std::min(size, want));
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
