// The CUDA kernels of the op contracts (src/cpp/ops) on host arrays, for tests/test_ops.py:
// inputs uploaded and converted to the kernels' layouts, outputs NaN-poisoned on the device
// (an element a kernel skips fails the test), then brought back in the reference layout.
#pragma once
#include "ops/attention.h"
#include "ops/gated_delta.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/qmatmul.h"

namespace lily::cuda_ops {

// The decode and prefill kernels of a quantized matmul: Decode, qmatmul_decode one row at a
// time on MLX-order weights (fp32 dot); DecodeTiles, on tensor-core tiles, up to 4 rows a
// launch; Prefill, qmatmul_prefill's exact GEMM (bf16 x); PrefillBf16w, its weights rounded to
// bf16 with one fp32 sum over K; PrefillWgmma, the same on warpgroup MMA (sm_90a).
enum class QMatmulRoute { Decode, DecodeTiles, Prefill, PrefillBf16w, PrefillWgmma };
void qmatmul(const ops::QMatmul& a, QMatmulRoute route);
void embedding(const ops::Embedding& a);  // embedding_prefill

void rmsnorm(const ops::RmsNorm& a);              // rmsnorm_prefill, its fp32 output
void gated_rmsnorm(const ops::GatedRmsNorm& a);   // gated_rmsnorm_prefill (bf16 output)

// The prefill recurrence: gated_delta_scan_prefill, or with chunked
// gated_delta_chunked_prefill (chunks of 64 tokens on tensor cores).
void gated_delta(const ops::GatedDelta& a, bool chunked);
// The mixer between its projections: gated_delta_decode (conv, gates, delta rule, gated norm in
// one launch; Kc = 4), rows_per_launch tokens a launch (1: decode steps; up to 4: verify steps).
void gated_delta_step(const ops::GatedDeltaStep& a, int rows_per_launch);
// The same by the prefill's three kernels over the whole chunk: gated_delta_conv_prefill (conv,
// q/k norms, gates) on projection rows padded past their width, the recurrence (chunked:
// gated_delta_chunked_prefill, else gated_delta_scan_prefill), gated_rmsnorm_prefill (bf16
// output). No states per token (keep_rows).
void gated_delta_step_prefill(const ops::GatedDeltaStep& a, bool chunked);

// The attention mixer's kernels between its projections: Decode, attention_decode (SIMT) a
// token a launch; DecodeTensorCores, attention_decode_tc, up to 4 rows a launch (a verify
// step's); Prefill*, attention_prefill over the whole chunk with its flash kernel by head dim
// (the executor's default), on mma.sync, or on wgmma. Caches in bf16, as the executor's.
// The decode routes split the keys as the executor does (attention_decode.h's max_splits and
// min_chunk; 0: its defaults).
enum class AttentionRoute { Decode, DecodeTensorCores, Prefill, PrefillMma, PrefillWgmma };
struct AttentionSplits {
  int max_splits = 0, min_chunk = 0;
};
void gated_attention(const ops::GatedAttention& a, AttentionRoute route, AttentionSplits splits = {});

// The MoE block (src/cpp/cpu/layers.h's moe_block: routed experts + gated shared expert) by
// its decode kernels, moe_router_decode, moe_gate_up_decode, moe_down_decode: Decode on
// MLX-order weights a token a launch, DecodeTiles on tensor-core tiles up to 4 tokens a launch;
// or Prefill, the prefill's over the whole chunk (step/prefill_step.h's enqueue_moe_prefill:
// rmsnorm_prefill, moe_route_prefill, grouped qmatmul_prefill GEMMs, moe_combine_prefill),
// which runs it as a layer only (norm and residual).
// router_cluster caps the router's cluster (0: the executor's; smaller ones route the same bits).
// As the decode step runs it, x may be normalised in the kernels' staging (norm: the
// post-attention RMSNorm's weight) and y = x + the block (residual: down adds into the
// residual stream); else y starts at zero, not NaN, as down adds every token's experts into it.
enum class MoeRoute { Decode, DecodeTiles, Prefill };
struct MoeSublayer {
  const float* norm = nullptr;  // [H] or null: x as given
  float eps = 1e-6f;
  bool residual = false;
};
void moe_block(const MoeWeights& w, int top_k, bool norm_topk_prob, const float* x, int64_t T, float* y, MoeRoute route,
               int router_cluster = 0, const MoeSublayer& sub = {});

}  // namespace lily::cuda_ops
