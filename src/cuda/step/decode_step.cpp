#include "step/decode_step.h"

#include <algorithm>

#include "attention/attention_decode.h"
#include "attention/attention_decode_tc.h"
#include "gated_delta/gated_delta_decode.h"
#include "qmatmul/qmatmul_decode.h"
#include "head/lm_head.h"
#include "moe/moe_experts_decode.h"
#include "moe/moe_router_decode.h"
#include "head/sampler.h"

namespace lily::cuda {

template <typename T>
T* Workspace::alloc(size_t n, const char* what) {
  owned_.emplace_back(std::max<size_t>(n, 1) * sizeof(T), what);
  check(cudaMemset(owned_.back().as<void>(), 0, owned_.back().bytes()), what);
  return owned_.back().as<T>();
}

Workspace::Workspace(const ModelConfig& c, bool attn_tc, int attn_split_keys, bool mtp)
    : attn_tensor_cores(attn_tc), host_tokens(2 * sizeof(int)), min_chunk(attn_split_keys) {
  const size_t H = c.hidden_size, V = c.vocab_size, T = kMaxStepRows;
  const size_t gdn_rows = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
  const size_t attn_rows = 2 * c.attn_q_dim() + 2 * c.attn_kv_dim();
  h = alloc<float>(T * H, "workspace h");
  proj = alloc<float>(T * std::max(gdn_rows, attn_rows), "workspace projections");
  mix = alloc<float>(T * std::max<size_t>(c.gdn_value_dim(), c.attn_q_dim()), "workspace mixer output");
  ids = alloc<int>(T * c.num_experts_per_tok, "workspace expert ids");
  route_w = alloc<float>(T * c.num_experts_per_tok, "workspace routing weights");
  shared_gate = alloc<float>(T, "workspace shared gate");
  act = alloc<float>(T * (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size),
                     "workspace expert activations");
  if (c.num_key_value_heads > 0)
    attn_partial = alloc<float>(
        T * attention_partial_floats(c.num_attention_heads, c.num_key_value_heads, c.head_dim, max_splits),
        "workspace attention splits");
  head_partial = alloc<float2>(T * kLmHeadMaxBlocks, "workspace lm_head partials");
  head_counter = alloc<unsigned>(1, "workspace lm_head counter");
  ctl = alloc<DecodeCtl>(1, "workspace decode control");
  tok_slots = alloc<int>(2, "workspace token slots");
  counts = alloc<int>(V, "workspace token counts");
  seen = alloc<unsigned char>(V, "workspace seen tokens");
  step_tokens = alloc<int>(T, "workspace verify tokens");
  step_argmax = alloc<int>(T, "workspace verify argmax");
  if (!mtp) return;
  mtp_e = alloc<float>(T * H, "workspace MTP embeddings");
  mtp_cat = alloc<float>(T * 2 * H, "workspace MTP input");
  mtp_u = alloc<float>(T * H, "workspace MTP residual");
  mtp_out = alloc<float>(T * H, "workspace MTP outputs");
  draft_logits = alloc<float>(T * V, "workspace draft logits");
  draft_tokens = alloc<int>(T, "workspace drafts");
}

int verify_rows_limit(const ModelConfig& c, const DeviceWeights& W, const Workspace& ws, std::string* why) {
  auto no = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return 0;
  };
  const char* layout = " in the tensor-core layout (4-bit, group 64, at most 4096 columns)";
  if (!W.lm_head.tiled) return no(std::string("lm_head is not") + layout);
  for (size_t i = 0; i < W.layers.size(); ++i) {
    const DeviceLayer& L = W.layers[i];
    const std::string at = "layer " + std::to_string(i) + "'s ";
    if (L.kind == LayerKind::Linear && !(L.gdn_in.tiled && L.gdn_out.tiled)) return no(at + "GDN projections are not" + layout);
    if (L.kind == LayerKind::Full && !(L.attn_in.tiled && L.attn_out.tiled))
      return no(at + "attention projections are not" + layout);
    if (!tiled(L.experts)) return no(at + "expert weights are not" + layout);
  }
  if (!ws.attn_tensor_cores) return no("several tokens a step need the tensor-core attention (LILY_CUDA_ATTN_TC=0 is set)");
  int dev = 0, optin = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "cudaDeviceGetAttribute");
  const int k = static_cast<int>(c.num_experts_per_tok), E = static_cast<int>(c.num_experts);
  // The most rows whose kernels all fit: the expert union's (token, slot) lanes, and each
  // kernel's shared memory for that many staged rows.
  auto fits = [&](int rows, std::string& reason) {
    if (k * rows > 32) return reason = "top_k " + std::to_string(k) + " x rows is more than 32 (token, slot) pairs", false;
    for (const DeviceLayer& L : W.layers) {
      if (moe_router_decode_smem_bytes(L.router, E, rows) > kRouterMaxSmem) return reason = "the router's shared memory", false;
      if (moe_gate_up_decode_smem_bytes(L.experts, rows) > static_cast<size_t>(optin)) return reason = "moe_gate_up_decode's shared memory", false;
      if (moe_down_decode_smem_bytes(L.experts, k, rows) > static_cast<size_t>(optin)) return reason = "moe_down_decode's shared memory", false;
      for (const QMat* m : {&L.gdn_in, &L.gdn_out, &L.attn_in, &L.attn_out})
        if (m->rows && qmatmul_decode_smem_bytes(*m, rows) > static_cast<size_t>(optin)) return reason = "a projection's shared memory", false;
    }
    if (qmatmul_decode_smem_bytes(W.lm_head, rows) > static_cast<size_t>(optin)) return reason = "lm_head's shared memory", false;
    return true;
  };
  std::string reason;
  for (int rows = kMaxStepRows; rows >= 1; --rows) {
    if (fits(rows, reason)) {
      if (why && rows < kMaxStepRows) *why = "more rows exceed " + reason;
      return rows;
    }
  }
  return no("a one-token step does not fit: " + reason);
}

Choice choice_for(const SamplingParams& p) {
  if (p.greedy()) return Choice::Greedy;
  if (p.top_k == 0 && p.top_p >= 1.0f && p.min_p <= 0.0f) return Choice::Gumbel;
  return Choice::TopK;
}

void enqueue_body(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int parity,
                  const int* tokens, int rows, cudaStream_t stream) {
  const int* halt = &ws.ctl->halt;
  const float eps = c.rms_norm_eps;
  int full = 0, lin = 0;
  for (size_t i = 0; i < W.layers.size(); ++i) {
    const DeviceLayer& L = W.layers[i];
    XSpec xin;
    if (i == 0) {  // the step's first kernel: it also reads the halt flag after its wait (decode_ctl.h)
      xin.mode = XMode::EmbedRmsNorm;
      xin.embed = W.embed;
      xin.token = tokens;
      xin.h_out = ws.h;
    } else {
      xin.mode = XMode::RmsNorm;
      xin.x = ws.h;
    }
    xin.w = L.input_norm;
    xin.eps = eps;
    if (L.kind == LayerKind::Linear) {
      GdnArgs g;
      g.proj = ws.proj;
      g.norm_w = L.gdn_norm;
      g.conv_w = L.conv_w;
      g.ring = s.ring[lin];
      g.dt_bias = L.dt_bias;
      g.neg_A = L.neg_A;
      g.state_in = s.state[parity][lin];
      g.state_out = s.state[1 - parity][lin];
      g.state_rows = rows > 1 ? s.state_rows[lin] : nullptr;
      g.out = ws.mix;
      g.pos = s.pos;
      g.Hk = c.linear_num_key_heads;
      g.Hv = c.linear_num_value_heads;
      g.Dk = c.linear_key_head_dim;
      g.Dv = c.linear_value_head_dim;
      g.eps = eps;
      qmatmul_decode(L.gdn_in, xin, {YMode::Store, ws.proj}, halt, stream, rows);
      gated_delta_decode(g, halt, stream, rows);
      XSpec xo;
      xo.x = ws.mix;
      qmatmul_decode(L.gdn_out, xo, {YMode::Add, ws.h}, halt, stream, rows);
      ++lin;
    } else {
      enqueue_attention(c, W, L, ws, {s.k_cache[full], s.v_cache[full], s.pos, 0}, xin, ws.h, rows, stream);
      ++full;
    }
    enqueue_moe(c, L, ws, ws.h, i + 1 == W.layers.size() ? s.pos : nullptr, rows, stream);
  }
}

void enqueue_attention(const ModelConfig& c, const DeviceWeights& W, const DeviceLayer& L, Workspace& ws,
                       const AttnCache& cache, const XSpec& xin, float* y, int rows, cudaStream_t stream) {
  const int* halt = &ws.ctl->halt;
  qmatmul_decode(L.attn_in, xin, {YMode::Store, ws.proj}, halt, stream, rows);
  AttnArgs a;
  a.qkv = ws.proj;
  a.q_norm = L.q_norm;
  a.k_norm = L.k_norm;
  a.k_cache = cache.k;
  a.v_cache = cache.v;
  a.partial = ws.attn_partial;
  a.out = ws.mix;
  a.pos = cache.pos;
  a.pos_offset = cache.pos_offset;
  a.Hq = c.num_attention_heads;
  a.Hkv = c.num_key_value_heads;
  a.D = c.head_dim;
  a.rot_dim = c.rotary_dim();
  a.inv_freq = W.rope_inv_freq;
  a.eps = c.rms_norm_eps;
  a.max_splits = ws.max_splits;
  a.min_chunk = ws.min_chunk;
  if (ws.attn_tensor_cores)
    attention_decode_tc(a, halt, stream, rows);
  else if (rows == 1)
    attention_decode(a, halt, stream);
  else
    fail("decode: several tokens a step need the tensor-core attention");  // verify_rows_limit refuses first
  if (!y) return;
  XSpec xo;
  xo.x = ws.mix;
  qmatmul_decode(L.attn_out, xo, {YMode::Add, y}, halt, stream, rows);
}

void enqueue_moe(const ModelConfig& c, const DeviceLayer& L, Workspace& ws, float* h, int* pos, int rows,
                 cudaStream_t stream) {
  const int* halt = &ws.ctl->halt;
  XSpec xm;
  xm.mode = XMode::RmsNorm;
  xm.x = h;
  xm.w = L.post_norm;
  xm.eps = c.rms_norm_eps;
  const int k = c.num_experts_per_tok;
  moe_router_decode(L.router, xm, c.num_experts, k, c.norm_topk_prob, {nullptr, ws.ids, ws.route_w, ws.shared_gate}, halt,
                    stream, kRouterMaxCluster, rows);
  moe_gate_up_decode(L.experts, xm, ws.ids, k, ws.act, halt, stream, rows);
  moe_down_decode(L.experts, ws.act, ws.ids, ws.route_w, ws.shared_gate, k, h, pos, halt, stream, rows);
}

// The head's matrix, input (the final norm of h) and block scratch.
static HeadArgs head_args(const ModelConfig& c, const DeviceWeights& W, const Workspace& ws) {
  HeadArgs h;
  h.W = W.lm_head;
  h.X.mode = XMode::RmsNorm;
  h.X.x = ws.h;
  h.X.w = W.final_norm;
  h.X.eps = c.rms_norm_eps;
  h.partial = ws.head_partial;
  h.counter = ws.head_counter;
  return h;
}

void enqueue_head(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int dst,
                  bool compute, bool choose, Choice how, cudaStream_t stream) {
  const int* halt = &ws.ctl->halt;
  TokenSink sink;
  sink.ctl = ws.ctl;
  sink.pos = s.pos;
  sink.slot = ws.tok_slots + dst;
  sink.host = ws.host_tokens.device<int>() + dst;
  sink.counts = ws.counts;
  sink.seen = ws.seen;
  HeadArgs h = head_args(c, W, ws);
  h.logits = s.logits[dst];
  h.compute = compute;
  h.select = !choose || how == Choice::TopK ? HeadSelect::None : how == Choice::Greedy ? HeadSelect::Greedy : HeadSelect::Gumbel;
  h.ctl = ws.ctl;
  h.sink = sink;
  if (compute || h.select != HeadSelect::None) lm_head(h, halt, stream);
  if (choose && how == Choice::TopK) sample_topk(s.logits[dst], c.vocab_size, ws.ctl, sink, halt, stream);
}

void enqueue_verify_head(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int rows,
                         int vocab_limit, cudaStream_t stream) {
  HeadArgs h = head_args(c, W, ws);
  h.logits = s.verify_logits;
  h.rows = rows;
  h.argmax = ws.step_argmax;
  h.argmax_limit = vocab_limit;
  lm_head(h, &ws.ctl->halt, stream);
}

}  // namespace lily::cuda
