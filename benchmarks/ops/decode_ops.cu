// Decode ops (one token) at Qwen3.6-35B-A3B shapes, called as the executor calls them
// (src/cuda/step/decode_step.cpp): weights in the tiled 4-bit layout where the executor uses
// it, the 8-bit router and the embedding in the MLX row layout.
#include "attention/attention_decode.h"
#include "attention/attention_decode_tc.h"
#include "bench.h"
#include "gated_delta/gated_delta_decode.h"
#include "qmatmul/qmatmul_decode.h"
#include "head/lm_head.h"
#include "moe/moe_experts_decode.h"
#include "moe/moe_router_decode.h"
#include "head/sampler.h"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;

// Where lm_head / sample_topk put the chosen token; no penalties, no stop rule fires.
TokenSink token_sink(Arena& A, const DecodeCtl& c) {
  TokenSink s;
  s.ctl = A.upload(std::vector<DecodeCtl>{c});
  s.pos = A.upload(std::vector<int>{4095});
  s.slot = A.zeros<int>(1);
  s.host = A.zeros<int>(1);
  s.counts = A.zeros<int>(kV);
  s.seen = A.zeros<unsigned char>(kV);
  return s;
}

DecodeCtl endless_ctl() {
  DecodeCtl c;
  c.max_tokens = c.max_context = 1 << 30;
  c.seed = 1234;
  return c;
}

MoeExperts experts(Arena& A) {
  return {A.qmat(kE * 2 * kI, kH, 4, true), A.qmat(kE * kH, kI, 4, true), A.qmat(2 * kIs, kH, 4, true), A.qmat(kH, kIs, 4, true),
          kE, kI, kIs};
}

const int* routed_ids(Arena& A) { return A.upload(std::vector<int>{7, 38, 71, 104, 137, 170, 203, 236}); }
const float* routed_weights(Arena& A) {
  return A.upload(std::vector<float>{0.24f, 0.18f, 0.14f, 0.12f, 0.10f, 0.08f, 0.08f, 0.06f});
}

// x (and norm weight) read + W read + y written (read too when added).
void add_qmatmul_decode(std::vector<Op>& ops, const std::string& name, int rows, int cols, XMode mode, YMode ymode, bool tiled) {
  double bytes = qbytes(rows, cols, 4) + cols * 4.0 + rows * 4.0 * (ymode == YMode::Add ? 2 : 1);
  if (mode == XMode::RmsNorm) bytes += cols * 4.0;
  ops.push_back({name, dims(rows, cols), bytes, 2.0 * rows * cols, [=](Arena& A) -> Launch {
                   XSpec X;
                   X.mode = mode;
                   X.x = A.normal(cols);
                   X.eps = kEps;
                   if (mode == XMode::RmsNorm) X.w = A.near_one(cols);
                   const QMat W = A.qmat(rows, cols, 4, tiled);
                   const YSpec Y{ymode, A.normal(rows)};
                   return [=](cudaStream_t s) { qmatmul_decode(W, X, Y, nullptr, s); };
                 }});
}

// attention_decode (SIMT) or attention_decode_tc (tensor cores) at position ctx - 1.
void add_attention(std::vector<Op>& ops, int ctx, bool tensor_cores) {
  const double kv = 2.0 * ctx * kHkv * kD * 2;  // bf16 K and V rows up to the position
  const double bytes = kv + kAttnRows * 4.0 + kHq * kD * 4.0 + 2 * kD * 4.0;
  ops.push_back({tensor_cores ? "attention_decode_tc" : "attention_decode",
                 "ctx " + std::to_string(ctx) + ", 16 q / 2 kv heads x 256", bytes,
                 4.0 * kHq * ctx * kD, [=](Arena& A) -> Launch {
                   AttnArgs a;  // max_splits, min_chunk: the defaults, which the executor's Workspace uses
                   a.qkv = A.normal(kAttnRows);
                   a.q_norm = A.near_one(kD);
                   a.k_norm = A.near_one(kD);
                   a.k_cache = A.normal_bf16(size_t(ctx) * kHkv * kD);
                   a.v_cache = A.normal_bf16(size_t(ctx) * kHkv * kD);
                   a.partial = A.normal(attention_partial_floats(kHq, kHkv, kD, a.max_splits));
                   a.out = A.normal(kHq * kD);
                   a.pos = A.upload(std::vector<int>{ctx - 1});
                   a.inv_freq = A.upload(rope_inv_freq(kRopeTheta, kRot));
                   a.Hq = kHq, a.Hkv = kHkv, a.D = kD, a.rot_dim = kRot;
                   a.eps = kEps;
                   if (tensor_cores) return [=](cudaStream_t s) { attention_decode_tc(a, nullptr, s); };
                   return [=](cudaStream_t s) { attention_decode(a, nullptr, s); };
                 }});
}

}  // namespace

void add_decode_ops(std::vector<Op>& ops) {
  add_qmatmul_decode(ops, "qmatmul_decode gdn in_proj +rmsnorm", kGdnRows, kH, XMode::RmsNorm, YMode::Store, true);
  add_qmatmul_decode(ops, "qmatmul_decode gdn in_proj +rmsnorm (fp32 dot, MLX layout)", kGdnRows, kH, XMode::RmsNorm, YMode::Store, false);
  ops.push_back({"qmatmul_decode gdn in_proj +embed +rmsnorm (layer 0)", dims(kGdnRows, kH),
                 qbytes(kGdnRows, kH, 4) + qbytes(1, kH, 4) + 2 * kH * 4.0 + kGdnRows * 4.0, 2.0 * kGdnRows * kH,
                 [](Arena& A) -> Launch {
                   XSpec X;
                   X.mode = XMode::EmbedRmsNorm;
                   X.embed = A.qmat(kV, kH, 4, false);
                   X.token = A.upload(std::vector<int>{123457});
                   X.h_out = A.normal(kH);
                   X.w = A.near_one(kH);
                   X.eps = kEps;
                   const QMat W = A.qmat(kGdnRows, kH, 4, true);
                   const YSpec Y{YMode::Store, A.normal(kGdnRows)};
                   return [=](cudaStream_t s) { qmatmul_decode(W, X, Y, nullptr, s); };
                 }});
  add_qmatmul_decode(ops, "qmatmul_decode attn qkv +rmsnorm", kAttnRows, kH, XMode::RmsNorm, YMode::Store, true);
  add_qmatmul_decode(ops, "qmatmul_decode gdn out_proj +res", kH, kHv * kDh, XMode::Plain, YMode::Add, true);
  add_qmatmul_decode(ops, "qmatmul_decode attn o_proj +res", kH, kHq * kD, XMode::Plain, YMode::Add, true);

  // GDN: state read + written, q|k|v|z|b|a read, conv and norm weights, ring (3 rows read, 1 written), out written.
  const double gdn_state = 4.0 * kHv * kDh * kDh;
  ops.push_back({"gated_delta_decode", "32 heads x 128x128",
                 2 * gdn_state + (kConv + 2 * kHv) * 4.0 + kConv * 16.0 + 4 * kConv * 4.0 + 2 * kHv * kDh * 4.0 +
                     2 * kHv * 4.0 + kDh * 4.0,
                 7.0 * kHv * kDh * kDh,  // decay, S^T k, rank-1 update, S^T q
                 [](Arena& A) -> Launch {
                   GdnArgs a;
                   a.proj = A.normal(kGdnRows);
                   a.norm_w = A.near_one(kDh);
                   a.conv_w = A.normal(size_t(kConv) * 4, 0.3f);
                   a.ring = A.normal(size_t(4) * kConv);
                   a.dt_bias = A.normal(kHv);
                   a.neg_A = A.upload(gdn_neg_A());
                   a.state_in = A.normal(size_t(kHv) * kDh * kDh, 0.1f);
                   a.state_out = A.normal(size_t(kHv) * kDh * kDh);
                   a.out = A.normal(kHv * kDh);
                   a.pos = A.upload(std::vector<int>{4095});
                   a.Hk = kHk, a.Hv = kHv, a.Dk = kDh, a.Dv = kDh;
                   return [=](cudaStream_t s) { gated_delta_decode(a, nullptr, s); };
                 }});
  for (int ctx : {1024, 4096, 32768, 131072}) add_attention(ops, ctx, false);
  for (int ctx : {1024, 4096, 32768, 131072}) add_attention(ops, ctx, true);

  // MoE: router (8-bit, E rows + the shared-expert gate row), then k experts + shared.
  const double router_bytes = qbytes(kE + 1, kH, 8) + 2 * kH * 4.0 + 2 * kTopK * 4.0 + 4;  // decode keeps no logits
  const double gate_up_w = kTopK * qbytes(2 * kI, kH, 4) + qbytes(2 * kIs, kH, 4);
  const double down_w = kTopK * qbytes(kH, kI, 4) + qbytes(kH, kIs, 4);
  const double act_bytes = (kTopK * kI + kIs) * 4.0;
  ops.push_back({"moe_router_decode 8-bit +rmsnorm +top-8", dims(kE + 1, kH), router_bytes, 2.0 * (kE + 1) * kH,
                 [](Arena& A) -> Launch {
                   const QMat R = A.qmat(kE + 1, kH, 8, false);
                   const XSpec X = rmsnorm_of(A, A.normal(kH));
                   const RouterOut out{nullptr, A.zeros<int>(kTopK), A.normal(kTopK), A.normal(1)};
                   return [=](cudaStream_t s) { moe_router_decode(R, X, kE, kTopK, true, out, nullptr, s); };
                 }});
  ops.push_back({"moe_gate_up_decode 8 experts + shared +rmsnorm", "9x" + dims(2 * kI, kH), gate_up_w + 2 * kH * 4.0 + act_bytes,
                 2.0 * (kTopK * 2 * kI + 2 * kIs) * kH, [](Arena& A) -> Launch {
                   const MoeExperts m = experts(A);
                   const XSpec X = rmsnorm_of(A, A.normal(kH));
                   const int* ids = routed_ids(A);
                   float* act = A.normal(kTopK * kI + kIs);
                   return [=](cudaStream_t s) { moe_gate_up_decode(m, X, ids, kTopK, act, nullptr, s); };
                 }});
  ops.push_back({"moe_down_decode 8 experts + shared +res", "9x" + dims(kH, kI), down_w + act_bytes + 2 * kH * 4.0,
                 2.0 * (kTopK * kI + kIs) * kH, [](Arena& A) -> Launch {
                   const MoeExperts m = experts(A);
                   const float* act = A.normal(kTopK * kI + kIs);
                   const int* ids = routed_ids(A);
                   const float* w = routed_weights(A);
                   const float* shared_gate = A.upload(std::vector<float>{0.4f});
                   float* h = A.normal(kH);
                   return [=](cudaStream_t s) { moe_down_decode(m, act, ids, w, shared_gate, kTopK, h, nullptr, nullptr, s); };
                 }});
  ops.push_back({"moe block: router, gate_up, down (3 launches)", "E 256, top-8, I 512",
                 qbytes(kE + 1, kH, 8) + gate_up_w + down_w + 3 * kH * 4.0,
                 2.0 * ((kE + 1) + kTopK * 3 * kI + 3 * kIs) * kH, [](Arena& A) -> Launch {
                   const QMat R = A.qmat(kE + 1, kH, 8, false);
                   const MoeExperts m = experts(A);
                   float* h = A.normal(kH);  // the residual stream the block reads and adds to
                   const XSpec X = rmsnorm_of(A, h);
                   const RouterOut out{nullptr, A.zeros<int>(kTopK), A.normal(kTopK), A.normal(1)};  // as decode runs it
                   float* act = A.normal(kTopK * kI + kIs);
                   return [=](cudaStream_t s) {
                     moe_router_decode(R, X, kE, kTopK, true, out, nullptr, s);
                     moe_gate_up_decode(m, X, out.ids, kTopK, act, nullptr, s);
                     moe_down_decode(m, act, out.ids, out.weights, out.shared_gate, kTopK, h, nullptr, nullptr, s);
                   };
                 }});
  // Output head: logits + greedy argmax in one launch; or logits, then top-k/top-p sampling.
  const double head_bytes = qbytes(kV, kH, 4) + 2 * kH * 4.0 + kV * 4.0;
  ops.push_back({"lm_head +rmsnorm +argmax", dims(kV, kH), head_bytes, 2.0 * kV * kH, [](Arena& A) -> Launch {
                   HeadArgs a;
                   a.W = A.qmat(kV, kH, 4, true);
                   a.X = rmsnorm_of(A, A.normal(kH));
                   a.logits = A.normal(kV);
                   a.select = HeadSelect::Greedy;
                   a.sink = token_sink(A, endless_ctl());
                   a.ctl = a.sink.ctl;
                   a.partial = A.zeros<float2>(kLmHeadMaxBlocks);
                   a.counter = A.zeros<unsigned>(1);
                   return [=](cudaStream_t s) { lm_head(a, nullptr, s); };
                 }});
  ops.push_back({"lm_head +rmsnorm (logits only)", dims(kV, kH), head_bytes, 2.0 * kV * kH, [](Arena& A) -> Launch {
                   HeadArgs a;
                   a.W = A.qmat(kV, kH, 4, true);
                   a.X = rmsnorm_of(A, A.normal(kH));
                   a.logits = A.normal(kV);
                   return [=](cudaStream_t s) { lm_head(a, nullptr, s); };
                 }});
  ops.push_back({"sample_topk top_k 20, top_p 0.95, T 0.7", "V " + std::to_string(kV), kV * 4.0, 0,
                 [](Arena& A) -> Launch {
                   DecodeCtl c = endless_ctl();
                   c.top_k = 20;
                   c.top_p = 0.95f;
                   c.temperature = 0.7f;
                   const TokenSink sink = token_sink(A, c);
                   const float* logits = A.normal(kV, 3.0f);
                   return [=](cudaStream_t s) { sample_topk(logits, kV, sink.ctl, sink, nullptr, s); };
                 }});
}

}  // namespace lily::bench
