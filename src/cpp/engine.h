// The one place that knows every backend: picks an executor for a device name.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "executor.h"

namespace lily {

// device: "cpu", "cuda", "cuda:N" or "auto" (CUDA when available, else CPU). The executor's
// options (options.h) come from the environment, read here once.
std::unique_ptr<Executor> make_executor(std::shared_ptr<const ModelWeights> weights, const std::string& device);

// Backends compiled into this build and usable on this machine.
std::vector<std::string> available_devices();

}  // namespace lily
