// MoE routing for one token (or `rows` tokens, each routed exactly as alone), in one
// launch of one thread-block cluster: router logits (W rows 0..E-1) and the shared-expert
// gate logit (row E) from RMSNorm(h), gathered in the first block's shared memory; that
// block then does softmax over the E experts (fp32), top-k (ties to the lower id),
// renormalisation, and sigmoid of the shared gate. E <= kMoeMaxExperts, k <= kMoeMaxTopK.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "common/kernel_types.h"

namespace lily::cuda {

struct RouterOut {  // per token t of the rows, at t * (E + 1), t * k and t
  float* logits = nullptr;       // [E + 1] the logits, copied here after routing; null: not kept (decode)
  int* ids = nullptr;            // [k] chosen experts, by descending probability
  float* weights = nullptr;      // [k] routing weights
  float* shared_gate = nullptr;  // [1] sigmoid(shared_expert_gate . x)
};

// The largest cluster the router asks for (Hopper places up to 16 blocks, non-portable
// above 8). A partitioned GPU (MIG, MPS) may place fewer: the router then takes the
// largest size it gets, down to one block; max_cluster caps it (tests run those sizes).
constexpr int kRouterMaxCluster = 16;

// Dynamic shared memory of the router for `rows` tokens; at most kRouterMaxSmem (a cluster's
// blocks are not given more).
constexpr size_t kRouterMaxSmem = 48 * 1024;
size_t moe_router_decode_smem_bytes(const QMat& W, int n_experts, int rows);

// W: [E + 1, H]; X: how x is built (RMSNorm of h with the post-attention norm; token t's h
// at X.x + t * H).
void moe_router_decode(const QMat& W, const XSpec& X, int n_experts, int top_k, bool norm_topk, const RouterOut& out,
                const int* halt, cudaStream_t stream, int max_cluster = kRouterMaxCluster, int rows = 1);

}  // namespace lily::cuda
