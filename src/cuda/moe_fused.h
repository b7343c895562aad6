// The whole decode MoE block of one token in ONE launch (the work of moe_router,
// moe_gate_up and moe_down, same maths, same summation orders):
//   phase 1: x = RMSNorm(h); logits = R x (E router rows + the shared-expert gate row)
//   phase 2: softmax + top-k + renormalisation (every block, redundantly);
//            act[j] = silu(gate_e . x) * (up_e . x) for the k experts and the shared one
//   phase 3: h += sum_j w_j * down_e(act[j]) + sigmoid(g_s) * down_s(act[k])
// The phases are separated by grid-wide barriers, so the grid is sized to be fully
// co-resident. Experts must be in the tiled tensor-core layout, the router 8-bit MLX.
#pragma once
#include <cuda_runtime.h>

#include "kernel_types.h"
#include "moe_experts.h"

namespace lily::cuda {

struct MoeFusedScratch {
  float* logits = nullptr;       // [E + 1] router logits (phase 1 -> phase 2)
  int* ids = nullptr;            // [k] chosen experts, by descending probability (written for inspection)
  float* weights = nullptr;      // [k] routing weights (written for inspection)
  float* shared_gate = nullptr;  // [1] sigmoid of the shared-expert gate logit (written for inspection)
  float* act = nullptr;          // [k * I + Is] expert activations (phase 2 -> phase 3)
  unsigned* sync = nullptr;      // [2] grid barrier (arrivals, generation): zero before the first launch;
                                 // valid again after every launch, so graphs replay it without a reset
};

// router: [E + 1, H] 8-bit MLX rows; X: how x is built from h (RMSNorm with the
// post-attention norm); h [H] += the block's output. pos_inc: when non-null, 1 is added
// to it (after the last layer). halt: when *halt is set, nothing is done.
// One scratch (sync in particular) must not be used by two launches running at once.
void moe_fused(const QMat& router, const MoeExperts& m, const XSpec& X, int top_k, bool norm_topk,
               const MoeFusedScratch& s, float* h, int* pos_inc, const int* halt, cudaStream_t stream);

}  // namespace lily::cuda
