// The Metal backend's ops on host arrays in the reference layout (src/cpp/ops/*.h), for the
// per-backend op tests (tests/test_ops.py through lily._lily.ops, device="metal-emulator"):
// each call NaN-poisons the outputs and dispatches the op's .metal kernel on the MSL
// emulator (src/metal/emulator), its buffers the host arrays themselves.
#pragma once
#include "ops/attention.h"
#include "ops/gated_delta.h"
#include "ops/host_ops.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/qmatmul.h"

namespace lily::metal_ops {

void rmsnorm(const ops::RmsNorm& a);             // src/metal/norm/rmsnorm.metal
void gated_rmsnorm(const ops::GatedRmsNorm& a);  // src/metal/norm/rmsnorm.metal
void l2norm(const ops::L2Norm& a);               // src/metal/norm/rmsnorm.metal
// gated_delta_conv and gated_delta_gates (src/metal/gated_delta/gated_delta_conv.metal): Kc <= 8.
void gated_delta_conv(const ops::GatedDeltaConv& a);
void gated_delta_gates(const ops::GatedDeltaGates& a);
// qmatmul_decode_{4,8}bit (src/metal/qmatmul/qmatmul_decode.metal), all T rows in one dispatch.
void qmatmul(const ops::QMatmul& a);
// embedding (src/metal/qmatmul/embedding.metal): 4- or 8-bit tables.
void embedding(const ops::Embedding& a);
// rope (src/metal/attention/rope.metal), in place.
void rope(const ops::Rope& a);
// gated_delta_dk{32,64,128} (src/metal/gated_delta/gated_delta.metal), all T tokens in one
// dispatch: Dk a multiple of 4 up to 128, Hv a multiple of Hk.
void gated_delta(const ops::GatedDelta& a);
// The mixer between its projections by those kernels: gated_delta_conv, l2norm of q and k,
// gated_delta_gates, gated_delta, gated_rmsnorm. No states per token (keep_rows).
void gated_delta_step(const ops::GatedDeltaStep& a);
// attention_d{64,128,256} (src/metal/attention/attention.metal), all T tokens in one dispatch:
// D a multiple of 4 up to 256, Hq a multiple of Hkv by at most 32.
void attention(const ops::Attention& a);
// The attention mixer between its projections by those kernels: rmsnorm of each q and k head,
// rope, the cache rows pos0.. written, attention, attention_gate (src/metal/attention/rope.metal).
void gated_attention(const ops::GatedAttention& a);
// moe_router_topk (src/metal/moe/moe_router.metal): a simdgroup a token, E <= 512.
void moe_router(const ops::MoeRouter& a);
// moe_gate_up then moe_down (src/metal/moe/moe_experts.metal) on one expert's matrices.
void moe_experts(const ops::MoeExpert& a);
// The MoE block as the decode step runs it: rmsnorm (when norm), the router and shared-gate
// rows by qmatmul_decode, moe_router_topk, moe_gate_up for the K routed experts and for the
// shared one, moe_down with the routing weights, the gated shared expert and (residual) x.
// 4- or 8-bit experts, one width for all of them.
void moe_block(const MoeWeights& w, int top_k, bool norm_topk_prob, const float* x, int64_t T, float* y,
               const float* norm, float eps, bool residual);

// These kernels as the CPU executor's layer loop takes them (device "metal-emulator"): the
// whole model by the Metal kernels, each dispatched on the emulator from the host's loop (not
// yet the Metal executor: no device buffers, command buffers or token slots of its own).
const ops::HostOps& host_ops();

}  // namespace lily::metal_ops
