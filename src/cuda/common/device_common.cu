#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "common/device_common.cuh"

namespace lily::cuda {

namespace {
std::atomic<bool> pdl_on{true};
}

bool pdl_enabled() { return pdl_on.load(std::memory_order_relaxed); }
void set_pdl_enabled(bool on) { pdl_on.store(on, std::memory_order_relaxed); }

void allow_dynamic_smem(const void* kernel, size_t bytes, const char* op) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> allowed;  // only ever raised: graphs keep earlier launches
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = allowed[{dev, kernel}];
  if (bytes <= have) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op);
  have = bytes;
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
