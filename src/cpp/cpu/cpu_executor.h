// The CPU executor: the readable fp32 reference of the whole forward pass.
#pragma once
#include <memory>

#include "executor.h"

namespace lily {

std::unique_ptr<Executor> make_cpu_executor(std::shared_ptr<const ModelWeights> weights);

}  // namespace lily
