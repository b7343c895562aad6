// The CPU ops: plain fp32 kernels of the op contracts (src/cpp/ops/*.h: the maths, shapes
// and tolerances; docs/ops.md: the map), multithreaded with parallel_for. One op per .cpp
// file beside this header. Every op checks its arguments and throws lily::Error naming
// itself. CPU specifics are noted here.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "ops/attention.h"
#include "ops/gated_delta.h"
#include "ops/host_ops.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/qmatmul.h"

namespace lily::cpu {

using ops::MoeExpert;
using ops::QMatmul;

void qmatmul(const ops::QMatmul& args);
// Independent products as one parallel loop over all their row blocks: products each
// too small to split (a decode step's experts) together keep every thread busy. Every
// output equals qmatmul's.
void qmatmul_batch(std::span<const QMatmul> products);
void embedding(const ops::Embedding& args);

void rmsnorm(const ops::RmsNorm& args);              // y may alias x
void gated_rmsnorm(const ops::GatedRmsNorm& args);  // y may alias x
void l2norm(const ops::L2Norm& args);

void rope(const ops::Rope& args);
void attention(const ops::Attention& args);
void gated_attention(const ops::GatedAttention& args);  // the rows pos0.. of the caches are written

void gated_delta_conv(const ops::GatedDeltaConv& args);
void gated_delta_gates(const ops::GatedDeltaGates& args);
void gated_delta(const ops::GatedDelta& args);
void gated_delta_step(const ops::GatedDeltaStep& args);

void moe_router(const ops::MoeRouter& args);
// Several experts' MLPs at once: their gate and up products in one parallel loop, their
// down products in another. scratch grows to 2 * sum(T * I) floats.
void moe_experts(std::span<const MoeExpert> mlps, std::vector<float>& scratch);

// These ops as the layer loop takes them (ops/host_ops.h).
const ops::HostOps& host_ops();

}  // namespace lily::cpu
