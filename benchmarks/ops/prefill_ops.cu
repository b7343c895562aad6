// Prefill ops other than the GEMMs (prefill_gemm_ops.cu), for a chunk of T = 4096 tokens
// at Qwen3.6-35B-A3B shapes, in the order src/cuda/step/prefill_step.cpp runs them.
//
// Adding an op: include its header and push an Op, e.g.
//   ops.push_back({"my_op", dims(kT, kH), bytes, flops, [](Arena& A) -> Launch {
//     const float* x = A.normal(size_t(kT) * kH);          // inputs: random, never zeros
//     float* y = A.normal(size_t(kT) * kH);                // outputs: any contents
//     return [=](cudaStream_t s) { my_op(x, y, kT, s); };  // all of the op's launches
//   }});
// bytes = each input read once + each output written once (scratch not counted);
// flops = the matrix and recurrence maths (0 for element-wise ops: judged by GB/s).
#include <cstdlib>
#include <string>

#include "attention/attention_decode.h"
#include "attention/attention_prefill.h"
#include "bench.h"
#include "norm/embedding_prefill.h"
#include "gated_delta/gated_delta_chunked_prefill.h"
#include "gated_delta/gated_delta_conv_prefill.h"
#include "gated_delta/gated_rmsnorm_prefill.h"
#include "gated_delta/gated_delta_scan_prefill.h"
#include "moe/moe_combine_prefill.h"
#include "moe/moe_route_prefill.h"
#include "norm/rmsnorm_prefill.h"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;

// The conv step of a second chunk (pos0 = T, so its first tokens read the ring).
GdnConvPrefillArgs gated_delta_conv_args(Arena& A) {
  GdnConvPrefillArgs c;
  c.proj = A.normal(size_t(kT) * kGdnRows);
  c.ldp = kGdnRows;
  c.conv_w = A.normal(size_t(kConv) * 4, 0.3f);
  c.ring = A.normal(size_t(4) * kConv);
  c.dt_bias = A.normal(kHv);
  c.neg_A = A.upload(gdn_neg_A());
  c.q = A.normal(size_t(kT) * kHk * kDh);
  c.k = A.normal(size_t(kT) * kHk * kDh);
  c.v = A.normal(size_t(kT) * kHv * kDh);
  c.beta = A.normal(size_t(kT) * kHv);
  c.decay = A.normal(size_t(kT) * kHv);
  c.T = kT, c.pos0 = kT;
  c.Hk = kHk, c.Hv = kHv, c.Dk = kDh, c.Dv = kDh;
  return c;
}

// attention_prefill on the flash kernel `route` names ("mma", "wgmma"; nullptr: by head dim).
void attention_prefill_routed(AttnPrefillArgs a, const char* route, cudaStream_t s) {
  a.route = !route ? AttnRoute::ByHeadDim : std::string(route) == "mma" ? AttnRoute::Mma : AttnRoute::Wgmma;
  attention_prefill(a, s);
}

// One layer's attention over the chunk at positions pos0 .. pos0+T-1 (causal, against
// the pos0 cached rows too): prep (norm, RoPE, cache append) + flash attention, on the
// flash kernel `route` picks (nullptr: the default).
void add_attention(std::vector<Op>& ops, int pos0, const char* route) {
  const double keys = double(kT) * pos0 + double(kT) * (kT + 1) / 2;  // keys seen, summed over the tokens
  const double kv_row = kHkv * kD * 2.0 * 2;                           // one bf16 K row and V row
  const double bytes = kT * 4.0 * kAttnRows + (pos0 + kT) * kv_row + kT * kv_row + kT * 2.0 * kHq * kD;
  ops.push_back({route ? std::string("attention_prefill ") + route : std::string("attention_prefill"), "T " + std::to_string(kT) + " at pos " + std::to_string(pos0) + ", 16 q / 2 kv heads x 256",
                 bytes, 4.0 * kHq * kD * keys, [=](Arena& A) -> Launch {
                   AttnPrefillArgs a;
                   a.proj = A.normal(size_t(kT) * kAttnRows);
                   a.ldp = kAttnRows;
                   a.q_norm = A.near_one(kD);
                   a.k_norm = A.near_one(kD);
                   a.inv_freq = A.upload(rope_inv_freq(kRopeTheta, kRot));
                   a.ctx = pos0 + kT;
                   a.k_cache = A.normal_bf16(size_t(a.ctx) * kHkv * kD);
                   a.v_cache = A.normal_bf16(size_t(a.ctx) * kHkv * kD);
                   a.out = A.normal_bf16(size_t(kT) * kHq * kD);
                   a.scratch_bytes = attention_prefill_scratch_bytes(kT, kHq, kD);
                   a.scratch = A.zeros<unsigned char>(a.scratch_bytes);
                   a.T = kT, a.pos0 = pos0;
                   a.Hq = kHq, a.Hkv = kHkv, a.D = kD, a.rot_dim = kRot;
                   a.eps = kEps;
                   return [=](cudaStream_t s) { attention_prefill_routed(a, route, s); };
                 }});
}

}  // namespace

void add_prefill_ops(std::vector<Op>& ops) {
  const double rows = double(kT) * kH;  // elements of a [T, H] activation
  ops.push_back({"embedding_prefill", "T " + std::to_string(kT) + ", " + dims(kV, kH), kT * (qbytes(1, kH, 4) + 4.0) + rows * 4, 0,
                 [](Arena& A) -> Launch {
                   const QMat embed = A.qmat(kV, kH, 4, false);
                   std::vector<int> tokens(kT);  // BENCHMARK.md's synthetic prompt ids
                   for (int t = 0; t < kT; ++t) tokens[t] = static_cast<int>((t * 2654435761u) % unsigned(kV));
                   const int* d_tokens = A.upload(tokens);
                   float* h = A.normal(size_t(kT) * kH);
                   return [=](cudaStream_t s) { embedding_prefill(embed, d_tokens, kT, h, s); };
                 }});
  for (bool fp32_copy : {false, true})  // before the MoE the normed rows also go to the router in fp32
    ops.push_back({fp32_copy ? "rmsnorm_prefill -> bf16 + fp32" : "rmsnorm_prefill -> bf16", dims(kT, kH),
                   rows * (4 + 2 + (fp32_copy ? 4 : 0)) + kH * 4.0, 0, [=](Arena& A) -> Launch {
                     const float* h = A.normal(size_t(kT) * kH);
                     const float* w = A.near_one(kH);
                     uint16_t* xb = A.normal_bf16(size_t(kT) * kH);
                     float* xf = fp32_copy ? A.normal(size_t(kT) * kH) : nullptr;
                     return [=](cudaStream_t s) { rmsnorm_prefill(h, w, kT, kH, kEps, xb, xf, s); };
                   }});

  // Gated DeltaNet: conv + norms + gates, the recurrence, the gated norm.
  const double qk = 2.0 * kT * kHk * kDh * 4, v = kT * 4.0 * kHv * kDh, gates = 2.0 * kT * kHv * 4;
  const double state = 4.0 * kHv * kDh * kDh;
  ops.push_back({"gated_delta_conv_prefill", "T " + std::to_string(kT) + ", conv_dim " + std::to_string(kConv),
                 kT * 4.0 * (kConv + 2 * kHv) + kConv * 16.0 + 2 * 4 * kConv * 4.0 + qk + v + gates, 0,
                 [](Arena& A) -> Launch {
                   const GdnConvPrefillArgs c = gated_delta_conv_args(A);
                   return [=](cudaStream_t s) { gated_delta_conv_prefill(c, s); };
                 }});
  ops.push_back({"gated_delta_scan_prefill", "T " + std::to_string(kT) + ", 32 heads x 128x128", qk + v + gates + 2 * state + v,
                 7.0 * kT * kHv * kDh * kDh,  // per token: decay, S^T k, rank-1 update, S^T q
                 [](Arena& A) -> Launch {
                   // Inputs as the conv step makes them (l2-normalised q, k; decay in (0, 1)), so
                   // the state stays bounded over the repeated launches.
                   const GdnConvPrefillArgs c = gated_delta_conv_args(A);
                   gated_delta_conv_prefill(c, nullptr);
                   GdnScanPrefillArgs a;
                   a.q = c.q, a.k = c.k, a.v = c.v, a.beta = c.beta, a.decay = c.decay;
                   a.state = A.normal(size_t(kHv) * kDh * kDh, 0.1f);
                   a.o = A.normal(size_t(kT) * kHv * kDh);
                   a.T = kT, a.Hk = kHk, a.Hv = kHv, a.Dk = kDh, a.Dv = kDh;
                   return [=](cudaStream_t s) { gated_delta_scan_prefill(a, s); };
                 }});
  ops.push_back({"gated_delta_chunked_prefill", "T " + std::to_string(kT) + ", 32 heads x 128x128, chunks of 64",
                 qk + v + gates + 2 * state + v,
                 // per token: K K^T, Q K^T rows (2 x 64 Dk), substitution (32 (Dk + Dv)), W S, Q S,
                 // P D, K^T D (3 Dk Dv + 64 Dv) as multiply-adds
                 2.0 * kT * kHv * (2 * 64 * kDh + 32 * 2 * kDh + 3 * kDh * kDh + 64 * kDh),
                 [](Arena& A) -> Launch {
                   const GdnConvPrefillArgs c = gated_delta_conv_args(A);  // as for gated_delta_scan_prefill
                   gated_delta_conv_prefill(c, nullptr);
                   GdnChunkedPrefillArgs a;
                   a.q = c.q, a.k = c.k, a.v = c.v, a.beta = c.beta, a.decay = c.decay;
                   a.state = A.normal(size_t(kHv) * kDh * kDh, 0.1f);
                   a.o = A.normal(size_t(kT) * kHv * kDh);
                   a.scratch_bytes = gated_delta_chunked_prefill_scratch_bytes(kT, kHv, kDh, kDh);
                   a.scratch = A.zeros<unsigned char>(a.scratch_bytes);
                   a.T = kT, a.Hk = kHk, a.Hv = kHv, a.Dk = kDh, a.Dv = kDh;
                   return [=](cudaStream_t s) { gated_delta_chunked_prefill(a, s); };
                 }});
  ops.push_back({"gated_rmsnorm_prefill -> bf16", "T " + std::to_string(kT) + ", 32 heads x 128", 2 * v + kDh * 4.0 + v / 2, 0,
                 [](Arena& A) -> Launch {
                   GdnGatedNormArgs a;
                   a.o = A.normal(size_t(kT) * kHv * kDh);
                   a.z = A.normal(size_t(kT) * kGdnRows) + kConv;  // the z columns of proj
                   a.ldz = kGdnRows;
                   a.w = A.near_one(kDh);
                   a.eps = kEps;
                   a.out = A.normal_bf16(size_t(kT) * kHv * kDh);
                   a.T = kT, a.Hv = kHv, a.Dv = kDh;
                   return [=](cudaStream_t s) { gated_rmsnorm_prefill(a, s); };
                 }});

  // Chunks ending at 4K, 32K, 128K on each flash kernel (the default is wgmma for D = 256).
  for (int pos0 : {0, 28672, 126976}) add_attention(ops, pos0, "mma");
  for (int pos0 : {0, 28672, 126976}) add_attention(ops, pos0, "wgmma");

  // MoE routing (router GEMM, top-k, sort, tile list: tile_m 64 at this T) and the combine.
  const double slots = double(kT) * kTopK;
  const int tile_m = 64, max_tiles = moe_max_tiles(kT * kTopK, tile_m, kE);
  ops.push_back({"moe_route_prefill (router 8-bit, top-8, sort, tiles)", "T " + std::to_string(kT) + ", " + dims(kE + 1, kH),
                 qbytes(kE + 1, kH, 8) + rows * 4 + kT * 4.0 * kE + slots * 16 + kT * 4.0 + 2 * kE * 4.0 + max_tiles * 16.0,
                 2.0 * kT * (kE + 1) * kH, [=](Arena& A) -> Launch {
                   MoeRouteArgs r;
                   r.router = A.qmat(kE + 1, kH, 8, false);
                   r.x = A.normal(size_t(kT) * kH);
                   r.T = kT, r.E = kE, r.k = kTopK;
                   r.norm_topk = true;
                   r.tile_m = tile_m;
                   r.logits = A.normal(size_t(kT) * kE);
                   r.route_w = A.normal(size_t(kT) * kTopK);
                   r.expert_ids = A.zeros<int>(size_t(kT) * kTopK);
                   r.shared_logit = A.normal(kT);
                   r.counts = A.zeros<int>(kE);
                   r.offsets = A.zeros<int>(kE + 1);
                   r.x_rows = A.zeros<int>(size_t(kT) * kTopK);
                   r.y_rows = A.zeros<int>(size_t(kT) * kTopK);
                   r.tiles = A.zeros<int4>(max_tiles);
                   r.n_tiles = A.zeros<int>(1);
                   r.max_tiles = max_tiles;
                   r.partials = A.normal(moe_router_partial_floats(kT, kE));
                   r.cursor = A.zeros<int>(kE);
                   r.counter = A.zeros<unsigned>(1);
                   return [=](cudaStream_t s) { moe_route_prefill(r, s); };
                 }});
  ops.push_back({"moe_combine_prefill", "T " + std::to_string(kT) + ", top-8 + shared, H " + std::to_string(kH),
                 rows * 4 * (2 + kTopK + 1) + kT * 4.0, 0, [](Arena& A) -> Launch {
                   float* h = A.normal(size_t(kT) * kH);
                   const float* y_slots = A.normal(size_t(kT) * kTopK * kH);
                   const float* y_shared = A.normal(size_t(kT) * kH);
                   const float* shared_logit = A.normal(kT);
                   return [=](cudaStream_t s) { moe_combine_prefill(h, y_slots, y_shared, shared_logit, kT, kH, kTopK, s); };
                 }});
}

}  // namespace lily::bench
