// The expert half of an MoE block for one token (decode), in two launches after the
// router (or in two launches with the routing, moe_routed_gate_up):
//   gate_up: act[j] = silu(gate_e . x) * (up_e . x) for the k routed experts and the
//            shared expert (slot k), x = RMSNorm(h) rebuilt by each block;
//   down:    h += sum_j w_j * down_e(act[j]) + sigmoid(g_s) * down_s(act[k]).
#pragma once
#include <cuda_runtime.h>

#include "kernel_types.h"

namespace lily::cuda {

struct MoeExperts {
  QMat gate_up;         // [E * 2I, H]: per expert, I gate rows then I up rows
  QMat down;            // [E * H, I]
  QMat shared_gate_up;  // [2Is, H]
  QMat shared_down;     // [H, Is]
  int n_experts = 0, inter = 0, shared_inter = 0;  // E, I, Is
};

// act: [k * I + Is] fp32. ids: [k] expert ids on the device.
void moe_gate_up(const MoeExperts& m, const XSpec& X, const int* ids, int top_k, float* act, const int* halt,
                 cudaStream_t stream);

// moe_gate_up that routes for itself, in one phase instead of moe_router's and its own
// (LILY_CUDA_MOE_ROUTED=1; tiled expert weights): every thread-block cluster computes the
// router's logits (router: [E + 1, H] 8-bit, row E the shared-expert gate, x as X) and
// the top-k in shared memory (moe_cluster_route.cuh), bit for bit as moe_router does;
// ids [k], weights [k] and shared_gate [1] are written for moe_down.
void moe_routed_gate_up(const QMat& router, const MoeExperts& m, const XSpec& X, int top_k, bool norm_topk, int* ids,
                        float* weights, float* shared_gate, float* act, const int* halt, cudaStream_t stream);

// h [H] += the combined expert outputs. pos_inc: when non-null, block 0 adds 1 to it
// after the last layer (the token is then fed).
void moe_down(const MoeExperts& m, const float* act, const int* ids, const float* weights, const float* shared_gate,
              int top_k, float* h, int* pos_inc, const int* halt, cudaStream_t stream);

}  // namespace lily::cuda
