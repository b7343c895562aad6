// MoE routing for a chunk of T prompt tokens (prefill), on the GPU with no host sync:
//   1. router GEMM   logits[t][e] = W_e . x[t] for the E experts and the shared-expert
//                    gate (row E of W), fp32 SIMT, split over H for small T;
//   2. top-k         softmax over the E logits, the k largest (equal logits: the lower
//                    id first), weights renormalised when norm_topk; per-expert counts;
//                    the last block scans the counts and writes the grouped-GEMM tiles;
//   3. scatter       the T*k (token, slot) pairs grouped by expert.
// Three launches (moe_router_prefill.cu: 1, moe_sort_prefill.cu: 2-3), ordered by PDL.
// Everything is deterministic except the order of rows within an expert (atomics). The
// H slices of step 1 depend on T (router_splits), so a token's logits may differ in the
// last bits between chunk sizes (fp32 rounding only).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "common/kernel_types.h"

namespace lily::cuda {

struct MoeRouteArgs {
  QMat router;               // [E + 1, H] MLX row layout (not tiled), 4 or 8 bits; row E: shared-expert gate
  const float* x = nullptr;  // [T, H] fp32 (H = router.cols), 16-byte aligned
  int T = 0, E = 0, k = 0;   // tokens >= 1, experts <= 512, top-k <= min(16, E)
  bool norm_topk = true;     // weights / their sum (norm_topk_prob), else softmax probabilities
  int tile_m = 0;            // rows per grouped-GEMM tile: 16, 32, 64 or 128

  // Outputs. Slot s = t * k + j is the j-th choice of token t (descending probability).
  float* logits = nullptr;        // optional [T, E] router logits (nullptr: not written)
  float* route_w = nullptr;       // [T * k] routing weights
  int* expert_ids = nullptr;      // [T * k]
  float* shared_logit = nullptr;  // [T] raw shared-expert gate logit (the combine applies the sigmoid)
  int* counts = nullptr;          // [E] slots routed to each expert
  int* offsets = nullptr;         // [E + 1] exclusive prefix sum of counts; offsets[E] = T * k
  int* x_rows = nullptr;          // [T * k] sorted row r -> token (rows of expert e: offsets[e] .. offsets[e+1]-1)
  int* y_rows = nullptr;          // [T * k] sorted row r -> slot (order within an expert is arbitrary)
  int4* tiles = nullptr;          // [max_tiles] {expert, row0, rows <= tile_m, 0}, experts ascending
  int* n_tiles = nullptr;         // [1] tiles written
  int max_tiles = 0;              // >= moe_max_tiles(T * k, tile_m, E)

  // Scratch, initialised by the launches themselves (never assumed zero).
  float* partials = nullptr;    // moe_router_partial_floats(T, E) floats, 16-byte aligned
  int* cursor = nullptr;        // [E]
  unsigned* counter = nullptr;  // [1]
};

// All launches of the routing (steps 1-3 above) on `stream`.
void moe_route_prefill(const MoeRouteArgs& a, cudaStream_t stream);

// Bound on the tiles of `rows` sorted rows over `n_experts` experts in pieces of at most
// tile_m rows: ceil(rows / tile_m) + min(n_experts, rows).
int moe_max_tiles(int rows, int tile_m, int n_experts);

// Floats of MoeRouteArgs::partials enough for every chunk of at most max_T tokens.
size_t moe_router_partial_floats(int max_T, int n_experts);

namespace moe_route_detail {
// The stages of moe_route_prefill (arguments already validated). The router GEMM splits
// H into `splits` slices whose partial sums the top-k kernel adds in slice order.
int router_splits(int T, int H);
void launch_router_gemm(const MoeRouteArgs& a, int splits, cudaStream_t stream);
void launch_route_sort(const MoeRouteArgs& a, int splits, cudaStream_t stream);
}  // namespace moe_route_detail

}  // namespace lily::cuda
