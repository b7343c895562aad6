#include "engine.h"

#include "cpu/cpu_executor.h"
#include "error.h"
#ifdef LILY_HAS_CUDA
#include "cuda_executor.h"
#endif

namespace lily {

std::vector<std::string> available_devices() {
  std::vector<std::string> d{"cpu"};
#ifdef LILY_HAS_CUDA
  if (cuda_device_count() > 0) d.push_back("cuda");
#endif
  return d;
}

std::unique_ptr<Executor> make_executor(std::shared_ptr<const ModelWeights> weights, const std::string& device) {
  if (device == "cpu") return make_cpu_executor(std::move(weights));
  const bool want_cuda = device == "cuda" || device.rfind("cuda:", 0) == 0;
#ifdef LILY_HAS_CUDA
  if (want_cuda || device == "auto") {
    if (cuda_device_count() > 0) {
      int index = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
      return make_cuda_executor(std::move(weights), index);
    }
    if (want_cuda) fail("device 'cuda': no CUDA device is visible");
  }
#else
  if (want_cuda) fail("device '", device, "': this build of lily has no CUDA executor (built without nvcc)");
#endif
  if (device == "auto") return make_cpu_executor(std::move(weights));
  fail("device '", device, "' is unknown; use 'auto', 'cpu' or 'cuda'");
}

}  // namespace lily
