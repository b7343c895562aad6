// The CUDA executor: decode kernels for NVIDIA GPUs (Hopper first), one decode step
// captured as a CUDA graph, tokens chosen on the device.
#pragma once
#include <memory>

#include "executor.h"
#include "options.h"

namespace lily {

// Visible CUDA devices; 0 (never an exception) when there is no driver or GPU.
int cuda_device_count();

std::unique_ptr<Executor> make_cuda_executor(std::shared_ptr<const ModelWeights> weights, int device_index,
                                             const ExecutorOptions& options);

}  // namespace lily
