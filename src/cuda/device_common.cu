#include <cstdlib>
#include <cstring>

#include "device_common.cuh"

namespace lily::cuda {

bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("LILY_CUDA_PDL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
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
