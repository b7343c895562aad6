#include "engine.h"

#include "cpu/cpu_executor.h"
#include "error.h"
#include "options.h"
#ifdef LILY_HAS_CUDA
#include "step/cuda_executor.h"
#endif
#ifdef LILY_HAS_METAL_EMULATOR
#include "contract/metal_ops.h"
#endif

namespace lily {

std::vector<std::string> available_devices() {
  std::vector<std::string> d{"cpu"};
#ifdef LILY_HAS_CUDA
  if (cuda_device_count() > 0) d.push_back("cuda");
#endif
  return d;
}

// "cuda:N" -> N; "cuda" -> 0. Messages name the device as the caller wrote it.
int cuda_index(const std::string& device) {
  if (device == "cuda") return 0;
  const std::string n = device.substr(5);
  if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
    fail("device '", device, "': expected 'cuda' or 'cuda:N' with N a device number");
  return std::stoi(n);
}

std::unique_ptr<Executor> make_executor(std::shared_ptr<const ModelWeights> weights, const std::string& device) {
  const ExecutorOptions options = ExecutorOptions::from_env();  // every LILY_* checked, whichever device
  if (device == "cpu") return make_cpu_executor(std::move(weights));
  if (device == "metal-emulator") {  // the Metal kernels on the MSL emulator: a slow test device
#ifdef LILY_HAS_METAL_EMULATOR
    return make_cpu_executor(std::move(weights), metal_ops::host_ops());
#else
    fail("device 'metal-emulator': this build of lily has no MSL emulator (LILY_METAL_EMULATOR=OFF)");
#endif
  }
  const bool want_cuda = device == "cuda" || device.rfind("cuda:", 0) == 0;
  if (!want_cuda && device != "auto") fail("device '", device, "' is unknown; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'metal-emulator'");
  const int index = want_cuda ? cuda_index(device) : 0;
#ifdef LILY_HAS_CUDA
  const int count = cuda_device_count();
  if (index < count) return make_cuda_executor(std::move(weights), index, options);
  if (want_cuda)
    fail("device '", device, "': ",
         count == 0 ? std::string("no CUDA device is visible")
                    : std::to_string(count) + " CUDA device(s) visible, cuda:0 to cuda:" + std::to_string(count - 1));
#else
  if (want_cuda) fail("device '", device, "': this build of lily has no CUDA executor (built without nvcc)");
#endif
  return make_cpu_executor(std::move(weights));
}

}  // namespace lily
