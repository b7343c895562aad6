// The expert half of an MoE block for one token (decode), in two launches:
//   gate_up: act[j] = silu(gate_e . x) * (up_e . x) for the k routed experts and the
//            shared expert (slot k), x = RMSNorm(h) rebuilt by each block;
//   down:    h += sum_j w_j * down_e(act[j]) + sigmoid(g_s) * down_s(act[k]).
// With rows > 1 (tensor-core weights only, rows * k <= 32): token t's h, act, ids, weights
// and shared gate at t * H, t * (k I + Is), t * k, t * k and t; the union of the tokens'
// experts is read once, and every token's outputs are bit-identical to a one-row launch.
#pragma once
#include <cuda_runtime.h>

#include "common/kernel_types.h"

namespace lily::cuda {

struct MoeExperts {
  QMat gate_up;         // [E * 2I, H]: per expert, I gate rows then I up rows
  QMat down;            // [E * H, I]
  QMat shared_gate_up;  // [2Is, H]
  QMat shared_down;     // [H, Is]
  int n_experts = 0, inter = 0, shared_inter = 0;  // E, I, Is
};

// Whether all four expert matrices are in the tensor-core layout (the only one that
// takes several rows).
bool tiled(const MoeExperts& m);

// act: [k * I + Is] fp32. ids: [k] expert ids on the device.
// The tensor-core kernel builds x (from X.x = h, and the norm weight) and writes the shared
// expert's part of act before the wait on the kernel launched just before (PDL: the
// router), which must therefore not write h nor touch act; the ids are read after it.
void moe_gate_up_decode(const MoeExperts& m, const XSpec& X, const int* ids, int top_k, float* act, const int* halt,
                 cudaStream_t stream, int rows = 1);

// h [H] += the combined expert outputs. pos_inc: when non-null, block 0 adds rows to it
// after the last layer (the tokens are then fed).
// The routing, the block's first expert tiles and its first rows of h are read before
// the wait on the kernel launched just before (PDL), which must therefore write none of
// ids, weights, shared_gate and h (moe_gate_up_decode writes act only); any earlier kernel may,
// as every kernel here lets its dependents start only after its own wait.
void moe_down_decode(const MoeExperts& m, const float* act, const int* ids, const float* weights, const float* shared_gate,
              int top_k, float* h, int* pos_inc, const int* halt, cudaStream_t stream, int rows = 1);

// Warps per block of the tensor-core moe_down_decode for hidden size H: kMoeDownMaxWarps when its
// H / 16 row blocks fit one per multiprocessor (twice the loads in flight behind a
// multiprocessor's bytes), else 8. A token's sum: each (slot, group) pair's partial, then
// weight x partial over the token's pairs in slot-major order, lane L of a warp taking the
// pairs q = L mod 32 in order and the warp's butterfly adding the lanes.
constexpr int kMoeDownMaxWarps = 16;
int moe_down_decode_warps(int hidden);

// Dynamic shared memory of moe_gate_up_decode and of the tensor-core moe_down_decode.
size_t moe_gate_up_decode_smem_bytes(const MoeExperts& m, int rows);
size_t moe_down_decode_smem_bytes(const MoeExperts& m, int top_k, int rows);

}  // namespace lily::cuda
