// The CPU executor: the readable fp32 reference of the whole forward pass.
#pragma once
#include <memory>

#include "cpu/ops.h"
#include "executor.h"

namespace lily {

// kernels: the ops its layer loop calls (ops/host_ops.h), the CPU's unless another backend's
// on host memory (metal_ops::host_ops(): the Metal kernels on the MSL emulator).
std::unique_ptr<Executor> make_cpu_executor(std::shared_ptr<const ModelWeights> weights,
                                            const ops::HostOps& kernels = cpu::host_ops());

}  // namespace lily
