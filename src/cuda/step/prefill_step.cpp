#include "step/prefill_step.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention/attention_prefill.h"
#include "norm/embedding_prefill.h"
#include "error.h"
#include "attention/attention_flash.h"
#include "gated_delta/gated_delta_chunked_prefill.h"
#include "gated_delta/gated_delta_conv_prefill.h"
#include "gated_delta/gated_rmsnorm_prefill.h"
#include "gated_delta/gated_delta_scan_prefill.h"
#include "head/lm_head.h"
#include "moe/moe_combine_prefill.h"
#include "moe/moe_route_prefill.h"
#include "qmatmul/qmatmul_prefill.h"
#include "norm/rmsnorm_prefill.h"
#include "common/stage_timer.h"

namespace lily::cuda {
namespace {

// Rows per grouped-GEMM tile from the rows an expert receives on average (T*k/E): 16 for
// a few rows per expert, else 32 (measured at T = 4096, 128 rows per expert: 32-row tiles
// 24.8K tok/s, 64: 24.0K, 16: 23.3K, 128: 21.6K; perf-log P2).
int moe_tile_rows(const ModelConfig& c, int T, const PrefillOptions& opt) {
  if (opt.moe_tile) return opt.moe_tile;
  const int64_t per_expert = static_cast<int64_t>(T) * c.num_experts_per_tok / c.num_experts;
  return per_expert <= 12 ? 16 : 32;
}

// The ablation of GPU-resident routing: the host reads the expert counts back, waits,
// and builds the tile list itself (what an engine without device-side routing does once
// per layer). The list equals the device's, so results are bit-identical.
void host_tile_list(PrefillWorkspace& ws, int E, int rows, int max_tiles, cudaStream_t stream) {
  std::vector<int> counts(E);
  check(cudaMemcpyAsync(counts.data(), ws.counts, E * sizeof(int), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (counts)");
  check(cudaStreamSynchronize(stream), "prefill routing (host round trip)");
  std::vector<int4> tiles;
  int sum = 0;
  for (int e = 0; e < E; sum += counts[e], ++e)
    for (int r = 0; r < counts[e]; r += ws.tile_m) tiles.push_back(make_int4(e, sum + r, std::min(ws.tile_m, counts[e] - r), 0));
  if (sum != rows) fail("prefill routing: the expert counts add up to ", std::to_string(sum), " rows, not ", std::to_string(rows));
  if (static_cast<int>(tiles.size()) > max_tiles)
    fail("prefill routing: ", std::to_string(tiles.size()), " tiles exceed the bound ", std::to_string(max_tiles));
  tiles.push_back(make_int4(static_cast<int>(tiles.size()), 0, 0, 0));  // its .x: the count
  const size_t n = tiles.size() - 1;
  check(cudaMemcpyAsync(ws.tiles, tiles.data(), n * sizeof(int4), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (tiles)");
  check(cudaMemcpyAsync(ws.n_tiles, &tiles.back().x, sizeof(int), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (tile count)");
  check(cudaStreamSynchronize(stream), "prefill routing (host round trip)");  // `tiles` is freed on return
}

// Dense-GEMM tile rows by chunk length (64 beats 128 at T = 4096, perf-log P1).
int dense_tile_rows(int T, const PrefillOptions& opt) {
  if (opt.dense_tile) return opt.dense_tile;
  return T <= 16 ? 16 : T <= 32 ? 32 : 64;
}


}  // namespace

PrefillOptions PrefillOptions::from(const ExecutorOptions& o, const ModelConfig& c) {
  PrefillOptions p;
  p.moe_tile = o.prefill_moe_tile;
  p.dense_tile = o.prefill_dense_tile;
  p.host_routing = o.prefill_host_routing;
  p.profile = o.prefill_profile;
  p.gemm = o.prefill_gemm;
  p.gdn = o.prefill_gdn;
  p.attn = o.prefill_attn;
  // Refused here, so a bad setting fails the engine's load instead of a prefill halfway
  // through its layers.
  if (p.attn == AttnRoute::Wgmma && c.num_full_layers() > 0 && !flash_wgmma_supports(c.head_dim))
    fail("LILY_PREFILL_ATTN=wgmma: the wgmma kernel takes head dim 256, the model has ", std::to_string(c.head_dim));
  return p;
}

template <typename T>
T* PrefillWorkspace::alloc(size_t n, const char* what) {
  owned_.emplace_back(std::max<size_t>(n, 1) * sizeof(T), what);
  return owned_.back().as<T>();
}

PrefillWorkspace::PrefillWorkspace(const ModelConfig& c, int cap, const PrefillOptions& opt, bool mtp) : capacity(cap) {
  const size_t T = cap, H = c.hidden_size, k = c.num_experts_per_tok, E = c.num_experts;
  const size_t gdn_rows = c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads;
  const size_t attn_rows = 2 * c.attn_q_dim() + 2 * c.attn_kv_dim();
  const size_t x_cols = std::max<size_t>({H, static_cast<size_t>(c.gdn_value_dim()), static_cast<size_t>(c.attn_q_dim())});
  tokens = alloc<int>(T, "prefill tokens");
  h = alloc<float>(T * H, "prefill residual");
  xb = alloc<uint16_t>(T * x_cols, "prefill GEMM input");
  xf = alloc<float>(T * H, "prefill router input");
  proj = alloc<float>(T * std::max(gdn_rows, attn_rows), "prefill projections");
  if (c.num_linear_layers() > 0) {
    const size_t key = c.gdn_key_dim(), val = c.gdn_value_dim(), Hv = c.linear_num_value_heads;
    q = alloc<float>(T * key, "prefill GDN q");
    this->k = alloc<float>(T * key, "prefill GDN k");
    v = alloc<float>(T * val, "prefill GDN v");
    beta = alloc<float>(T * Hv, "prefill GDN beta");
    decay = alloc<float>(T * Hv, "prefill GDN decay");
    o = alloc<float>(T * val, "prefill GDN output");
    if (opt.gdn != GdnRoute::Scan) {
      gdn_scratch_bytes = gated_delta_chunked_prefill_scratch_bytes(cap, static_cast<int>(Hv), static_cast<int>(c.linear_key_head_dim),
                                                            static_cast<int>(c.linear_value_head_dim));
      gdn_scratch = alloc<unsigned char>(gdn_scratch_bytes, "prefill GDN chunk factors");
    }
  }
  if (c.num_full_layers() > 0) {
    attn_scratch_bytes = attention_prefill_scratch_bytes(cap, c.num_attention_heads, c.head_dim);
    attn_scratch = alloc<unsigned char>(attn_scratch_bytes, "prefill attention scratch");
  }
  route_w = alloc<float>(T * k, "prefill routing weights");
  shared_logit = alloc<float>(T, "prefill shared-expert gate");
  expert_ids = alloc<int>(T * k, "prefill expert ids");
  counts = alloc<int>(E, "prefill expert counts");
  offsets = alloc<int>(E + 1, "prefill expert offsets");
  cursor = alloc<int>(E, "prefill expert cursors");
  route_counter = alloc<unsigned>(1, "prefill routing counter");
  router_partials = alloc<float>(moe_router_partial_floats(cap, static_cast<int>(E)), "prefill router partials");
  x_rows = alloc<int>(T * k, "prefill routed rows");
  y_rows = alloc<int>(T * k, "prefill routed slots");
  n_tiles = alloc<int>(1, "prefill tile count");
  max_tiles = moe_max_tiles(static_cast<int>(T * k), 16, static_cast<int>(E));
  tiles = alloc<int4>(max_tiles, "prefill tile list");
  act = alloc<uint16_t>(T * k * c.moe_intermediate_size, "prefill expert activations");
  act_shared = alloc<uint16_t>(T * c.shared_expert_intermediate_size, "prefill shared-expert activations");
  y_slots = alloc<float>(T * k * H, "prefill expert outputs");
  y_shared = alloc<float>(T * H, "prefill shared-expert output");
  logits = alloc<float>(static_cast<size_t>(kLogitRows) * c.vocab_size, "prefill logits");
  if (!mtp) return;
  mtp_state = alloc<float>((T + 1) * H, "prefill MTP states");
  mtp_cat = alloc<uint16_t>(T * 2 * H, "prefill MTP input");
}

bool prefill_supported(const ModelConfig& c, const DeviceWeights& W, std::string* why) {
  auto no = [&](const std::string& reason) {
    *why = reason;
    return false;
  };
  if (!W.lm_head.tiled) return no("lm_head is not a 4-bit group-64 matrix in the tensor-core layout");
  for (size_t i = 0; i < W.layers.size(); ++i) {
    const DeviceLayer& L = W.layers[i];
    const std::string at = "layer " + std::to_string(i) + ": ";
    const bool tiled = L.kind == LayerKind::Linear ? L.gdn_in.tiled && L.gdn_out.tiled : L.attn_in.tiled && L.attn_out.tiled;
    if (!tiled) return no(at + "a mixer projection is not 4-bit group-64 (tensor-core layout)");
    const MoeExperts& m = L.experts;
    if (!m.gate_up.tiled || !m.down.tiled || !m.shared_gate_up.tiled || !m.shared_down.tiled)
      return no(at + "expert matrices are not 4-bit group-64 (tensor-core layout)");
  }
  // Every limit a prefill kernel checks at launch is checked here, before anything of a
  // chunk runs: a chunk never stops half-way with the session's state part-updated.
  // (Head dims, RoPE, top-k <= 16 and hidden_size % 128 are validated for the executor.)
  const MoeExperts& m0 = W.layers.front().experts;
  const QMat& router = W.layers.front().router;
  if (c.hidden_size > 8192) return no("hidden_size " + std::to_string(c.hidden_size) + " (prefill norms: <= 8192)");
  if (c.num_experts > kMoeMaxExperts) return no("more than " + std::to_string(kMoeMaxExperts) + " experts");
  if (router.tiled || (router.bits != 4 && router.bits != 8) || (router.cols / router.groups()) % 16 != 0)
    return no("the router is not a 4- or 8-bit matrix in MLX row order with groups of a multiple of 16");
  if (m0.inter % 8 != 0 || m0.shared_inter % 8 != 0) return no("expert intermediate sizes not multiples of 8");
  if (c.num_linear_layers() > 0 && (c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads) % 4 != 0)
    return no("Gated DeltaNet projection rows not a multiple of 4");
  if (c.num_full_layers() > 0 && c.num_attention_heads / c.num_key_value_heads > 16)
    return no("more than 16 query heads per KV head");
  return true;
}

namespace {

// The GEMMs of a chunk of T rows through the prefill options (all the MoE block needs).
struct ChunkGemms {
  const ModelConfig& c;
  PrefillWorkspace& ws;
  const PrefillOptions& opt;
  int T;
  cudaStream_t stream;
  StageTimer* timer;
  int H = static_cast<int>(c.hidden_size);
  float eps = static_cast<float>(c.rms_norm_eps);
  int dense_tile = dense_tile_rows(T, opt);

  void mark(const char* op) const {
    if (timer) timer->mark(op);
  }
  // Arguments of a qmatmul_prefill over `rows` rows of x [rows][ldx] with W.
  GemmArgs gemm(const QMat& Wm, const uint16_t* x, int ldx, int rows) const {
    GemmArgs g;
    g.W = Wm;
    g.x = x;
    g.ldx = ldx;
    g.M = rows;
    g.weights_bf16 = opt.gemm_bf16w();
    g.wgmma = opt.gemm_wgmma_grouped();
    return g;
  }
  // A dense GEMM over the chunk's T rows: 128 x 256 wgmma blocks where they pay
  // (PrefillOptions::gemm_wgmma_dense), else mma.sync tiles of dense_tile rows.
  // LILY_PREFILL_DENSE_TILE sizes the wgmma blocks only under LILY_PREFILL_GEMM=wgmma
  // (16-64: 64 x 128 blocks); the default's wgmma GEMMs are measured at 128 x 256.
  void dense(GemmArgs g) const {
    g.wgmma = opt.gemm_wgmma_dense(g.W.cols, T);
    const bool sized = opt.gemm == GemmRoute::Wgmma && opt.dense_tile;
    qmatmul_prefill(g, g.wgmma && !sized ? 128 : dense_tile, stream);
  }
  // y [T][ldy] = x Wᵀ (Store) or h += x Wᵀ (Add, y = h).
  void project(const QMat& Wm, const uint16_t* x, int ldx, float* y, int ldy, GemmEpilogue epi) const {
    GemmArgs g = gemm(Wm, x, ldx, T);
    g.epi = epi;
    g.y = y;
    g.ldy = ldy;
    dense(g);
  }
};

// What every op of one chunk needs: the model, the session, the chunk and its schedule (the
// chunk's prompt at positions pos0 .. pos0 + T - 1).
struct Chunk : ChunkGemms {
  const DeviceWeights& W;
  const SessionState& s;
  int parity, pos0;
};

void gated_delta_mixer(const Chunk& k, const DeviceLayer& L, int lin) {
  const ModelConfig& c = k.c;
  PrefillWorkspace& ws = k.ws;
  const int gdn_rows = static_cast<int>(c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads);
  const int Hk = static_cast<int>(c.linear_num_key_heads), Hv = static_cast<int>(c.linear_num_value_heads);
  const int Dk = static_cast<int>(c.linear_key_head_dim), Dv = static_cast<int>(c.linear_value_head_dim);
  k.project(L.gdn_in, ws.xb, k.H, ws.proj, gdn_rows, GemmEpilogue::Store);
  k.mark("gemm mixer in");
  const GdnConvPrefillArgs conv{.proj = ws.proj, .ldp = gdn_rows, .conv_w = L.conv_w, .ring = k.s.ring[lin],
                                .dt_bias = L.dt_bias, .neg_A = L.neg_A, .q = ws.q, .k = ws.k, .v = ws.v,
                                .beta = ws.beta, .decay = ws.decay, .T = k.T, .pos0 = k.pos0,
                                .Hk = Hk, .Hv = Hv, .Dk = Dk, .Dv = Dv};
  gated_delta_conv_prefill(conv, k.stream);
  k.mark("gdn conv");
  const GdnScanPrefillArgs x{.q = ws.q, .k = ws.k, .v = ws.v, .beta = ws.beta, .decay = ws.decay,
                             .state = k.s.state[k.parity][lin], .o = ws.o, .T = k.T,
                             .Hk = Hk, .Hv = Hv, .Dk = Dk, .Dv = Dv};
  if (k.opt.gdn_chunked(k.T)) {
    GdnChunkedPrefillArgs cx;
    static_cast<GdnScanPrefillArgs&>(cx) = x;
    cx.scratch = ws.gdn_scratch;
    cx.scratch_bytes = ws.gdn_scratch_bytes;
    gated_delta_chunked_prefill(cx, k.stream);
  } else {
    gated_delta_scan_prefill(x, k.stream);
  }
  k.mark("gdn recurrence");
  const GdnGatedNormArgs norm{.o = ws.o, .z = ws.proj + c.gdn_conv_dim(), .ldz = gdn_rows, .w = L.gdn_norm,
                              .eps = k.eps, .out = ws.xb, .T = k.T, .Hv = Hv, .Dv = Dv};
  gated_rmsnorm_prefill(norm, k.stream);
  k.mark("gdn gated norm");
  k.project(L.gdn_out, ws.xb, static_cast<int>(c.gdn_value_dim()), ws.h, k.H, GemmEpilogue::Add);
  k.mark("gemm mixer out");
}

// Attention over the chunk from ws.xb (the normed rows): keys into the cache, then, with
// `out`, h += attn_out(attention); without, only the cache rows are kept (the MTP head's).
void attention_mixer(const Chunk& k, const DeviceLayer& L, uint16_t* k_cache, uint16_t* v_cache, bool out) {
  const ModelConfig& c = k.c;
  PrefillWorkspace& ws = k.ws;
  const int attn_rows = static_cast<int>(2 * c.attn_q_dim() + 2 * c.attn_kv_dim());
  k.project(L.attn_in, ws.xb, k.H, ws.proj, attn_rows, GemmEpilogue::Store);
  k.mark("gemm mixer in");
  const AttnPrefillArgs a{.proj = ws.proj, .ldp = attn_rows, .q_norm = L.q_norm, .k_norm = L.k_norm,
                          .inv_freq = k.W.rope_inv_freq, .k_cache = k_cache, .v_cache = v_cache,
                          .out = ws.xb, .scratch = ws.attn_scratch, .scratch_bytes = ws.attn_scratch_bytes,
                          .T = k.T, .pos0 = k.pos0, .ctx = k.s.ctx,
                          .Hq = static_cast<int>(c.num_attention_heads), .Hkv = static_cast<int>(c.num_key_value_heads),
                          .D = static_cast<int>(c.head_dim), .rot_dim = static_cast<int>(c.rotary_dim()),
                          .eps = k.eps, .route = k.opt.attn};
  attention_prefill(a, k.stream);
  k.mark("attention");
  if (!out) return;
  k.project(L.attn_out, ws.xb, static_cast<int>(c.attn_q_dim()), ws.h, k.H, GemmEpilogue::Add);
  k.mark("gemm mixer out");
}

// Routes on the GPU, then grouped expert GEMMs over the rows sorted by expert, the shared
// expert as two dense GEMMs, and the combine into the residual.
void moe_block(const ChunkGemms& k, const DeviceLayer& L) {
  const ModelConfig& c = k.c;
  PrefillWorkspace& ws = k.ws;
  const int top_k = static_cast<int>(c.num_experts_per_tok), E = static_cast<int>(c.num_experts);
  const int I = static_cast<int>(c.moe_intermediate_size), Is = static_cast<int>(c.shared_expert_intermediate_size);
  const int rows = k.T * top_k, max_tiles = moe_max_tiles(rows, ws.tile_m, E);
  rmsnorm_prefill(ws.h, L.post_norm, k.T, k.H, k.eps, ws.xb, ws.xf, k.stream);
  k.mark("rmsnorm");
  const MoeRouteArgs r{.router = L.router, .x = ws.xf, .T = k.T, .E = E, .k = top_k, .norm_topk = c.norm_topk_prob,
                       .tile_m = ws.tile_m, .route_w = ws.route_w, .expert_ids = ws.expert_ids,
                       .shared_logit = ws.shared_logit, .counts = ws.counts, .offsets = ws.offsets,
                       .x_rows = ws.x_rows, .y_rows = ws.y_rows, .tiles = ws.tiles, .n_tiles = ws.n_tiles,
                       .max_tiles = max_tiles, .partials = ws.router_partials, .cursor = ws.cursor,
                       .counter = ws.route_counter};
  moe_route_prefill(r, k.stream);
  if (k.opt.host_routing) host_tile_list(ws, E, rows, max_tiles, k.stream);
  k.mark("moe route");

  const MoeExperts& m = L.experts;
  auto grouped = [&](GemmArgs g, int expert_rows) {
    g.tiles = ws.tiles;
    g.n_tiles = ws.n_tiles;
    g.max_tiles = max_tiles;
    g.expert_rows = expert_rows;
    qmatmul_prefill(g, ws.tile_m, k.stream);
  };
  GemmArgs gu = k.gemm(m.gate_up, ws.xb, k.H, rows);
  gu.x_rows = ws.x_rows;
  gu.epi = GemmEpilogue::SwiGlu;
  gu.act = ws.act;
  gu.ldy = I;
  gu.swiglu_inter = I;
  grouped(gu, 2 * I);
  k.mark("moe experts gate/up");
  GemmArgs dn = k.gemm(m.down, ws.act, I, rows);
  dn.y = ws.y_slots;
  dn.ldy = k.H;
  dn.y_rows = ws.y_rows;
  dn.y_scale = ws.route_w;
  grouped(dn, k.H);
  k.mark("moe experts down");

  GemmArgs sgu = k.gemm(m.shared_gate_up, ws.xb, k.H, k.T);
  sgu.epi = GemmEpilogue::SwiGlu;
  sgu.act = ws.act_shared;
  sgu.ldy = Is;
  sgu.swiglu_inter = Is;
  k.dense(sgu);
  k.project(m.shared_down, ws.act_shared, Is, ws.y_shared, k.H, GemmEpilogue::Store);
  k.mark("moe shared expert");
  moe_combine_prefill(ws.h, ws.y_slots, ws.y_shared, ws.shared_logit, k.T, k.H, top_k, k.stream);
  k.mark("moe combine");
}

}  // namespace

void enqueue_prefill(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, const PrefillOptions& opt,
                     const SessionState& s, int parity, int pos0, int T, cudaStream_t stream) {
  if (T > ws.capacity) fail("prefill: chunk of ", std::to_string(T), " tokens exceeds the workspace (", std::to_string(ws.capacity), ")");
  std::unique_ptr<StageTimer> timer = opt.profile ? std::make_unique<StageTimer>(stream) : nullptr;
  const Chunk k{{c, ws, opt, T, stream, timer.get()}, W, s, parity, pos0};
  ws.tile_m = moe_tile_rows(c, T, opt);
  embedding_prefill(W.embed, ws.tokens, T, ws.h, stream);
  k.mark("embed");
  int full = 0, lin = 0;
  for (const DeviceLayer& L : W.layers) {
    rmsnorm_prefill(ws.h, L.input_norm, T, k.H, k.eps, ws.xb, nullptr, stream);
    k.mark("rmsnorm");
    if (L.kind == LayerKind::Linear) {
      gated_delta_mixer(k, L, lin++);
    } else {
      attention_mixer(k, L, s.k_cache[full], s.v_cache[full], true);
      ++full;
    }
    moe_block(k, L);
  }
  if (timer) timer->report(T);
}

void enqueue_moe_prefill(const ModelConfig& c, const DeviceLayer& L, PrefillWorkspace& ws, const PrefillOptions& opt, int T,
                         cudaStream_t stream) {
  if (T > ws.capacity) fail("prefill MoE: ", std::to_string(T), " rows exceed the workspace (", std::to_string(ws.capacity), ")");
  ws.tile_m = moe_tile_rows(c, T, opt);
  moe_block(ChunkGemms{c, ws, opt, T, stream, nullptr}, L);
}

void enqueue_mtp_prefill(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, const PrefillOptions& opt,
                         const SessionState& s, int parity, int pos0, int T, cudaStream_t stream) {
  const int H = static_cast<int>(c.hidden_size), skip = pos0 == 0 ? 1 : 0, n = T - skip;
  const float eps = c.rms_norm_eps;
  const size_t row = static_cast<size_t>(H) * sizeof(float);
  float* state = ws.mtp_state;  // row 0: the state before the chunk (position pos0 - 1); row 1 + r: token r's
  rmsnorm_prefill(ws.h, W.final_norm, T, H, eps, nullptr, state + H, stream);
  if (!skip) check(cudaMemcpyAsync(state, s.mtp_hidden[parity], row, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync (MTP state)");
  if (n > 0) {  // the head's rows at positions pos0 - 1 + skip ..: state at q, token at q + 1
    const Chunk k{{c, ws, opt, n, stream, nullptr}, W, s, parity, pos0 - 1 + skip};
    embedding_prefill(W.embed, ws.tokens + skip, n, ws.xf, stream);
    rmsnorm_prefill(ws.xf, W.mtp.norm_embed, n, H, eps, ws.mtp_cat, nullptr, stream, 2 * H);
    rmsnorm_prefill(state + static_cast<size_t>(skip) * H, W.mtp.norm_hidden, n, H, eps, ws.mtp_cat + H, nullptr, stream, 2 * H);
    k.project(W.mtp.fc, ws.mtp_cat, 2 * H, ws.h, H, GemmEpilogue::Store);
    rmsnorm_prefill(ws.h, W.mtp.layer.input_norm, n, H, eps, ws.xb, nullptr, stream);
    attention_mixer(k, W.mtp.layer, s.mtp_k, s.mtp_v, false);
  }
  check(cudaMemcpyAsync(s.mtp_hidden[parity], state + static_cast<size_t>(T) * H, row, cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpyAsync (MTP state)");
}

void enqueue_logit_rows(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, int row0, int rows,
                        cudaStream_t stream) {
  if (rows > PrefillWorkspace::kLogitRows) fail("prefill logits: at most ", std::to_string(PrefillWorkspace::kLogitRows), " rows at a time");
  const int H = static_cast<int>(c.hidden_size);
  rmsnorm_prefill(ws.h + static_cast<size_t>(row0) * H, W.final_norm, rows, H, static_cast<float>(c.rms_norm_eps), ws.xb,
               nullptr, stream);
  GemmArgs g;  // exact weights: teacher-forced logits are the reference-facing output
  g.W = W.lm_head;
  g.x = ws.xb;
  g.ldx = H;
  g.M = rows;
  g.y = ws.logits;
  g.ldy = static_cast<int>(c.vocab_size);
  qmatmul_prefill(g, dense_tile_rows(rows, PrefillOptions{}), stream);
}

}  // namespace lily::cuda
