// The mixture of experts: routing and the experts' SwiGLU MLPs (docs/ops.md says what
// a contract holds). Token choice after the head is sampling.h's Sampler.
#pragma once
#include <cstdint>

#include "weights.h"

namespace lily::ops {

// moe_router: p = softmax(logits[t]) over E in fp32; the K largest p (ties: the lower expert first)
// into experts and weights, the weights divided by their sum when renormalize.
// The experts must equal the reference's; the tolerance is the weights'.
// tolerance moe_router: cpu 1e-6, metal-emulator 1e-6
struct MoeRouter {
  const float* logits = nullptr;  // [T, E]
  int64_t T = 0, E = 0, K = 0;
  bool renormalize = true;
  int32_t* experts = nullptr;     // [T, K]
  float* weights = nullptr;       // [T, K]
};

// moe_experts, one expert's SwiGLU MLP (a backend may run several at once):
// y = down(silu(x gate^T) * (x up^T)), gate/up [I, H], down [H, I].
// tolerance moe_experts: cpu 2e-6, metal-emulator 5e-6
struct MoeExpert {
  const float* x = nullptr;  // [T, H]
  int64_t T = 0;
  QWeight gate, up, down;
  float* y = nullptr;        // [T, H]
};

}  // namespace lily::ops
