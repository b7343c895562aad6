// The last step of the prefill MoE block: the routed expert outputs (one fp32 row per
// slot t * k + j, already scaled by the routing weight) and the gated shared expert
// are added to the residual stream:
//   h[t][n] += sigmoid(shared_logit[t]) * y_shared[t][n] + sum_{j<k} y_slots[t*k + j][n]
// computed as h + fma(g, y_shared, ((y_0 + y_1) + ...) + y_{k-1}): fixed order, deterministic.
#pragma once
#include <cuda_runtime.h>

namespace lily::cuda {

// h, y_shared: [T, H]; y_slots: [T * k, H]; shared_logit: [T] (raw). T >= 1, H % 4 == 0,
// 1 <= k <= 16; h, y_slots and y_shared 16-byte aligned.
void moe_combine_prefill(float* h, const float* y_slots, const float* y_shared, const float* shared_logit, int T, int H, int k,
                 cudaStream_t stream);

}  // namespace lily::cuda
