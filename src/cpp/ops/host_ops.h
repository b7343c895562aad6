// The ops the CPU executor's layer loop calls (cpu_executor.cpp, the mixers of layers.h), one
// backend's kernels on host memory: the CPU's, or the Metal kernels on the MSL emulator, whose
// device memory is the host's (src/metal/contract/metal_ops.h). Layouts are the references'.
#pragma once
#include <cstdint>
#include <span>

#include "ops/attention.h"
#include "ops/gated_delta.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/qmatmul.h"

namespace lily::ops {

struct HostOps {
  const char* device;  // the executor's device name
  void (*embedding)(const Embedding&);
  void (*rmsnorm)(const RmsNorm&);
  void (*qmatmul)(const QMatmul&);
  void (*qmatmul_batch)(std::span<const QMatmul>);  // independent products
  void (*gated_delta_step)(const GatedDeltaStep&);
  void (*gated_attention)(const GatedAttention&);
  // out [T, H] = the MoE block of x; null: the CPU's own (which also counts each expert's tokens).
  void (*moe_block)(const MoeWeights&, const ModelConfig&, const float* x, int64_t T, float* out);
  bool keeps_rows;  // gated_delta_step keeps the states after each token (verify steps, the MTP head)
};

}  // namespace lily::ops
