// The CUDA executor: sessions on the device, prefill of whole chunks (prefill_step.h;
// token by token through the decode step for 1-token feeds, or where a model's matrices
// do not fit the prefill kernels), and decode steps queued two at a time on the device
// for the one generate loop (decode_loop.h; Steps below for the hand-off).
#include "step/cuda_executor.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>

#include "step/decode_step.h"
#include "step/mtp_step.h"
#include "gated_delta/gated_delta_decode.h"
#include "common/launch_options.h"
#include "head/lm_head.h"
#include "step/prefill_step.h"
#include "decode_loop.h"
#include "error.h"

namespace lily {
namespace {

using namespace cuda;

// Captured variants of a step, per session (graphs bake in the session's buffers).
enum class Graph : int {
  Body,    // feed slot p
  Logits,  // logits[p] = head(h)
  Step,    // feed slot p, logits[1-p], choose into slot 1-p
  Choose,  // choose from logits[p] into slot p
  Verify,  // feed the workspace's `rows` step tokens from state p, their logits and argmax below `limit`
  Draft,   // `rows` MTP drafts after the workspace's draft token from state p, argmax below `limit`
};

struct GraphKey {
  Graph kind;
  int parity;
  Choice how;     // the token choice (Step, Choose)
  int rows = 1;   // Verify: tokens fed
  int limit = 0;  // Verify, Draft: the argmax's vocabulary limit
  int skip = 0;   // feeding steps of an MTP session at its first position: the head has no row before it
  auto operator<=>(const GraphKey&) const = default;
};

static_assert(kMaxVerifyTokens == kMaxStepRows, "a verify is one decode step of several rows");

class CudaSession : public Session {
 public:
  CudaSession(const ModelConfig& c, int64_t ctx, bool with_mtp) {
    max_context = ctx;
    mtp = with_mtp;
    dev.ctx = static_cast<int>(ctx);
    const size_t kv_bytes = static_cast<size_t>(ctx) * c.attn_kv_dim() * 2;
    const size_t ring_floats = kGdnRingRows * static_cast<size_t>(c.gdn_conv_dim());
    const size_t state_floats = static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
    for (LayerKind k : c.layer_kinds) {
      if (k == LayerKind::Full) {
        dev.k_cache.push_back(alloc(kv_bytes, "KV cache", false).as<uint16_t>());
        dev.v_cache.push_back(alloc(kv_bytes, "KV cache", false).as<uint16_t>());
      } else {
        dev.ring.push_back(alloc(ring_floats * 4, "conv state", true).as<float>());
        for (int p = 0; p < 2; ++p) dev.state[p].push_back(alloc(state_floats * 4, "recurrent state", true).as<float>());
      }
    }
    for (int p = 0; p < 2; ++p) dev.logits[p] = alloc(c.vocab_size * 4, "logits", true).as<float>();
    if (mtp) {
      dev.mtp_k = alloc(kv_bytes, "MTP KV cache", false).as<uint16_t>();
      dev.mtp_v = alloc(kv_bytes, "MTP KV cache", false).as<uint16_t>();
      for (int p = 0; p < 2; ++p)
        dev.mtp_hidden[p] = alloc((kMaxStepRows + 1) * c.hidden_size * 4, "MTP states", true).as<float>();
    }
    dev.pos = alloc(sizeof(int), "position", true).as<int>();
    kv_row_bytes = static_cast<size_t>(c.attn_kv_dim()) * 2;
    ring_bytes = ring_floats * 4;
    state_bytes = state_floats * 4;
  }

  // What verify steps write: the recurrent state after each token but the last, per linear
  // layer (kMaxStepRows - 1 states each), and every row's logits; allocated at the first
  // verify (the graphs that write them bake the pointers in).
  void reserve_verify(const ModelConfig& c) {
    if (dev.verify_logits) return;
    std::vector<float*> rows;
    for (size_t l = 0; l < dev.ring.size(); ++l)
      rows.push_back(alloc((kMaxStepRows - 1) * state_bytes, "verify states", false).as<float>());
    float* logits = alloc(static_cast<size_t>(kMaxStepRows) * c.vocab_size * 4, "verify logits", false).as<float>();
    dev.state_rows = std::move(rows);
    dev.verify_logits = logits;
  }
  ~CudaSession() override {
    for (auto& [key, g] : graphs) cudaGraphExecDestroy(g);
  }

  SessionState dev;
  int parity = 0;  // state[parity], logits[parity] and token slot parity are current
  std::map<GraphKey, cudaGraphExec_t> graphs;
  size_t kv_row_bytes = 0, ring_bytes = 0, state_bytes = 0;

 private:
  const DeviceBuffer& alloc(size_t bytes, const char* what, bool zero) {
    owned_.emplace_back(bytes, what);
    if (zero) check(cudaMemset(owned_.back().as<void>(), 0, bytes), what);
    return owned_.back();
  }
  std::deque<DeviceBuffer> owned_;
};

CudaSession& cs(Session& s) { return static_cast<CudaSession&>(s); }
const CudaSession& cs(const Session& s) { return static_cast<const CudaSession&>(s); }

void validate(const ModelConfig& c) {
  if (c.hidden_size % 128 != 0 || c.hidden_size > 12288)
    fail("CUDA executor: hidden_size ", std::to_string(c.hidden_size), " must be a multiple of 128, <= 12288");
  if (c.num_full_layers() > 0 && c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256)
    fail("CUDA executor: head_dim ", std::to_string(c.head_dim), " is not supported (64, 128, 256)");
  if (c.num_linear_layers() > 0 && (c.linear_key_head_dim % 16 != 0 || c.linear_key_head_dim > 128 ||
                                    c.linear_value_head_dim % 16 != 0 || c.linear_value_head_dim > 128))
    fail("CUDA executor: linear head dims must be multiples of 16, <= 128");
  if (c.num_experts_per_tok > 16) fail("CUDA executor: num_experts_per_tok > 16 is not supported");
  if (c.num_full_layers() > 0) {  // partial rotate-half RoPE: pairs must sit a power-of-two lanes apart
    const int64_t per_lane = c.head_dim / 32, half = c.rotary_dim() / 2;
    if (half <= 0 || 2 * half > c.head_dim || half % per_lane != 0 || ((half / per_lane) & (half / per_lane - 1)) != 0)
      fail("CUDA executor: rotary dim ", std::to_string(c.rotary_dim()), " does not fit head_dim ", std::to_string(c.head_dim));
  }
  if (c.layer_kinds.empty()) fail("CUDA executor: the model has no layers");
}

class CudaExecutor : public Executor {
 public:
  CudaExecutor(std::shared_ptr<const ModelWeights> w, int device, const ExecutorOptions& opt)
      : Executor(std::move(w)), device_(device), opt_(opt) {
    validate(weights_->config);
    set_pdl_enabled(opt.cuda_pdl);
    check(cudaSetDevice(device_), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    name_ = "cuda:" + std::to_string(device_) + " (" + prop.name + ")";
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (auto& e : events_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    dw_ = std::make_unique<DeviceWeights>(*weights_, opt.cuda_tensor_cores);
    ws_ = std::make_unique<Workspace>(weights_->config, opt.cuda_attn_tc, opt.cuda_attn_split_keys, dw_->has_mtp);
    reserve_staging(64);
    prefill_chunk = opt.prefill_chunk;
    prefill_min_ = opt.prefill_min_tokens;
    popt_ = PrefillOptions::from(opt, weights_->config);
    verify_rows_ = verify_rows_limit(weights_->config, *dw_, *ws_, &verify_why_);
    mtp_why_ = mtp_unsupported(weights_->config, *dw_, verify_rows_);
    if (!opt.cuda_prefill)
      prefill_route_ = "token by token (LILY_CUDA_PREFILL=0)";
    else if (std::string why; !prefill_supported(weights_->config, *dw_, &why))
      prefill_route_ = "token by token (" + why + ")";
    else {
      prefill_route_ = "chunked";
      chunked_prefill_ = true;
    }
  }
  ~CudaExecutor() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (auto& e : events_) cudaEventDestroy(e);
    if (staging_) cudaFreeHost(staging_);
    cudaStreamDestroy(stream_);
  }

  std::string device_name() const override { return name_; }
  int64_t max_verify_tokens(std::string* why) const override {
    if (why) *why = verify_why_;
    return verify_rows_;
  }
  std::string prefill_route() const override { return prefill_route_; }
  bool supports_mtp(std::string* why) const override {
    if (why) *why = mtp_why_;
    return mtp_why_.empty();
  }

  std::unique_ptr<Session> new_session(int64_t max_context) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    return std::make_unique<CudaSession>(weights_->config, max_context, use_mtp);
  }

  std::unique_ptr<Session> clone(const Session& src, int64_t capacity) override {
    check_clone_capacity(src, capacity);
    check(cudaSetDevice(device_), "cudaSetDevice");
    auto dst = std::make_unique<CudaSession>(weights_->config, capacity, src.mtp);
    copy_session(*dst, cs(src));
    return dst;
  }

  void restore(Session& dst, const Session& src) override {
    check_restore(dst, src);
    check(cudaSetDevice(device_), "cudaSetDevice");
    copy_session(cs(dst), cs(src));
  }

  std::unique_ptr<StepQueue> decode_steps(Session& s, const GenerateRequest& req) override;

 protected:
  void forward_chunk(Session& s, const int32_t* tokens, int64_t n, float* last_logits, float* all_logits) override;
  void verify_step(Session& s, const int32_t* tokens, int64_t n, float* logits, int32_t* argmax,
                   int64_t vocab_limit) override;
  void keep_step(Session& s, int64_t n, int64_t m) override;
  void draft_step(Session& s, int32_t next, int64_t n, int32_t* drafts, float* logits, int64_t vocab_limit) override;

 private:
  class Steps;
  cudaGraphExec_t graph(CudaSession& s, GraphKey key);
  void run(cudaGraphExec_t g) { check(cudaGraphLaunch(g, stream_), "cudaGraphLaunch (decode step)"); }
  // A feeding step's body: `rows` tokens through the trunk, then the MTP head's rows.
  void enqueue_feed(const CudaSession& s, int p, const int* tokens, int rows, int skip);
  void copy_session(CudaSession& dst, const CudaSession& src);
  void prefill(CudaSession& s, const int32_t* tokens, int T, int pos0, float* last_logits, float* all_logits);
  void reserve_staging(int64_t n);
  void upload_ctl(const CudaSession& s, const GenerateRequest& req);
#ifdef LILY_CUDA_TIMELINE
  void dump_timeline();
  DeviceBuffer timeline_, stamps_;
  int timeline_calls_ = 0;
#endif

  int device_;
  ExecutorOptions opt_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t events_[2] = {};
  std::unique_ptr<DeviceWeights> dw_;
  std::unique_ptr<Workspace> ws_;
  int32_t* staging_ = nullptr;  // pinned token ids for host-to-device copies
  int64_t staging_cap_ = 0;
  std::string prefill_route_;   // for prefill_route(): "chunked" or why not
  bool chunked_prefill_ = false;
  int prefill_min_ = 2;  // shorter feeds run through the decode step
  int verify_rows_ = 0;  // the most tokens a verify step takes (verify_rows_limit), and why no more
  std::string verify_why_;
  std::string mtp_why_;  // why this executor cannot run the checkpoint's MTP head; empty when it can
  MappedHostBuffer kept_pos_{sizeof(int)};  // keep_step's new position
  PrefillOptions popt_;
  std::unique_ptr<PrefillWorkspace> pws_;
};

void CudaExecutor::reserve_staging(int64_t n) {
  if (n <= staging_cap_) return;
  if (staging_) check(cudaFreeHost(staging_), "cudaFreeHost");
  staging_ = nullptr;
  check(cudaMallocHost(reinterpret_cast<void**>(&staging_), n * sizeof(int32_t)), "cudaMallocHost (token staging)");
  staging_cap_ = n;
}

cudaGraphExec_t CudaExecutor::graph(CudaSession& s, GraphKey key) {
  if (auto it = s.graphs.find(key); it != s.graphs.end()) return it->second;
  const int p = key.parity;
  const Choice how = key.how;
  const ModelConfig& c = weights_->config;
  cudaGraph_t g = nullptr;
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
  try {
    switch (key.kind) {
      case Graph::Body: enqueue_feed(s, p, ws_->tok_slots + p, 1, key.skip); break;
      case Graph::Logits: enqueue_head(c, *dw_, *ws_, s.dev, p, true, false, how, stream_); break;
      case Graph::Step:
        enqueue_feed(s, p, ws_->tok_slots + p, 1, 0);
        enqueue_head(c, *dw_, *ws_, s.dev, 1 - p, true, true, how, stream_);
        break;
      case Graph::Choose: enqueue_head(c, *dw_, *ws_, s.dev, p, false, true, how, stream_); break;
      case Graph::Verify:
        enqueue_feed(s, p, ws_->step_tokens, key.rows, key.skip);
        enqueue_verify_head(c, *dw_, *ws_, s.dev, key.rows, key.limit, stream_);
        break;
      case Graph::Draft: enqueue_mtp_draft(c, *dw_, *ws_, s.dev, p, key.rows, key.limit, stream_); break;
    }
  } catch (...) {
    cudaStreamEndCapture(stream_, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  check(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  check(err, "cudaGraphInstantiate (decode step)");
  s.graphs[key] = exec;
  return exec;
}

void CudaExecutor::enqueue_feed(const CudaSession& s, int p, const int* tokens, int rows, int skip) {
  enqueue_body(weights_->config, *dw_, *ws_, s.dev, p, tokens, rows, stream_);
  if (s.mtp) enqueue_mtp_follow(weights_->config, *dw_, *ws_, s.dev, p, tokens, rows, skip, stream_);
}

// One chunk through prefill_step: tokens up, every layer over the chunk, the new
// position written, then the last row's logits (and, teacher-forced, every row's).
void CudaExecutor::prefill(CudaSession& s, const int32_t* tokens, int T, int pos0, float* last_logits, float* all_logits) {
  const ModelConfig& c = weights_->config;
  const int64_t V = c.vocab_size, n = T;
  if (!pws_ || pws_->capacity < T) {  // grows to the chunk size at most, in powers of two
    pws_.reset();
    int cap = 64;
    while (cap < T) cap *= 2;
    pws_ = std::make_unique<PrefillWorkspace>(c, static_cast<int>(std::min<int64_t>(cap, std::max<int64_t>(prefill_chunk, T))), popt_,
                                              dw_->has_mtp);
  }
  reserve_staging(n + 1);
  std::copy(tokens, tokens + n, staging_);
  staging_[n] = pos0 + T;
  check(cudaMemcpyAsync(pws_->tokens, staging_, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (prompt)");
  enqueue_prefill(c, *dw_, *pws_, popt_, s.dev, s.parity, pos0, T, stream_);
  check(cudaMemcpyAsync(s.dev.pos, staging_ + n, sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (position)");
  if (all_logits)
    for (int row0 = 0; row0 < T; row0 += PrefillWorkspace::kLogitRows) {
      const int rows = std::min(PrefillWorkspace::kLogitRows, T - row0);
      enqueue_logit_rows(c, *dw_, *pws_, row0, rows, stream_);
      check(cudaMemcpyAsync(all_logits + row0 * V, pws_->logits, rows * V * 4, cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (logits)");
    }
  HeadArgs h;
  h.W = dw_->lm_head;
  h.X.mode = XMode::RmsNorm;
  h.X.x = pws_->h + static_cast<size_t>(T - 1) * c.hidden_size;
  h.X.w = dw_->final_norm;
  h.X.eps = c.rms_norm_eps;
  h.logits = s.dev.logits[s.parity];
  h.partial = ws_->head_partial;
  h.counter = ws_->head_counter;
  lm_head(h, nullptr, stream_);
  if (s.mtp) enqueue_mtp_prefill(c, *dw_, *pws_, popt_, s.dev, s.parity, pos0, T, stream_);
  check(cudaMemcpyAsync(last_logits, s.dev.logits[s.parity], V * 4, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (logits)");
  check(cudaStreamSynchronize(stream_), "prefill");
}

void CudaExecutor::forward_chunk(Session& base, const int32_t* tokens, int64_t n, float* last_logits,
                                 float* all_logits) {
  CudaSession& s = cs(base);
  check(cudaSetDevice(device_), "cudaSetDevice");
  if (chunked_prefill_ && n >= prefill_min_) {
    // At most kMaxPrefillChunk tokens per pass: one grid row per token (embedding), and
    // grouped-GEMM tile lists under 65,536 blocks.
    constexpr int64_t kMaxPrefillChunk = 16384;
    const int64_t V = weights_->config.vocab_size;
    for (int64_t off = 0; off < n; off += kMaxPrefillChunk) {
      const int len = static_cast<int>(std::min(kMaxPrefillChunk, n - off));
      prefill(s, tokens + off, len, static_cast<int>(s.position() + off), last_logits, all_logits ? all_logits + off * V : nullptr);
    }
    return;
  }
  const int64_t V = weights_->config.vocab_size;
  // An MTP session's first token: the head has no row before it.
  auto body = [&](int64_t i) { return GraphKey{Graph::Body, s.parity, Choice::Greedy, 1, 0, s.mtp && s.position() + i == 0}; };
  for (int p = 0; p < 2; ++p) {  // capture before anything is queued
    graph(s, {Graph::Body, p, Choice::Greedy});
    graph(s, {Graph::Logits, p, Choice::Greedy});
  }
  graph(s, body(0));
  reserve_staging(n);
  std::copy(tokens, tokens + n, staging_);
  for (int64_t i = 0; i < n; ++i) {
    check(cudaMemcpyAsync(ws_->tok_slots + s.parity, staging_ + i, sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync (token)");
    run(graph(s, body(i)));
    s.parity ^= 1;
    if (all_logits) {
      run(graph(s, {Graph::Logits, s.parity, Choice::Greedy}));
      check(cudaMemcpyAsync(all_logits + i * V, s.dev.logits[s.parity], V * 4, cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (logits)");
    }
  }
  if (!all_logits) run(graph(s, {Graph::Logits, s.parity, Choice::Greedy}));
  check(cudaMemcpyAsync(last_logits, s.dev.logits[s.parity], V * 4, cudaMemcpyDeviceToHost, stream_),
        "cudaMemcpyAsync (logits)");
  check(cudaStreamSynchronize(stream_), "forward (decode step kernels)");
}

// Verify: one step of n rows (decode_step.h) from state[parity]; the state after the last
// row lands in state[1 - parity] (then current), the others in state_rows. One host wait.
void CudaExecutor::verify_step(Session& base, const int32_t* tokens, int64_t n, float* logits, int32_t* argmax,
                               int64_t vocab_limit) {
  CudaSession& s = cs(base);
  check(cudaSetDevice(device_), "cudaSetDevice");
  const int64_t V = weights_->config.vocab_size;
  s.reserve_verify(weights_->config);
  cudaGraphExec_t g = graph(s, {Graph::Verify, s.parity, Choice::Greedy, static_cast<int>(n), static_cast<int>(vocab_limit),
                                s.mtp && s.position() == 0});
  reserve_staging(n);
  std::copy(tokens, tokens + n, staging_);
  check(cudaMemcpyAsync(ws_->step_tokens, staging_, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (verify tokens)");
  run(g);
  if (logits)
    check(cudaMemcpyAsync(logits, s.dev.verify_logits, n * V * 4, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (logits)");
  if (argmax)
    check(cudaMemcpyAsync(staging_, ws_->step_argmax, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync (argmax)");
  s.parity ^= 1;
  check(cudaMemcpyAsync(s.dev.logits[s.parity], s.dev.verify_logits + (n - 1) * V, V * 4, cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync (logits)");
  check(cudaStreamSynchronize(stream_), "verify");
  if (argmax) std::copy(staging_, staging_ + n, argmax);
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
}

// Keeps m of the n verified rows: the state after row m - 1 becomes current, its logits
// too, and the position steps back (the dropped rows' K/V and ring rows lie past it). No
// host wait: the next verify's waits for this; the position goes from its own pinned word.
void CudaExecutor::keep_step(Session& base, int64_t n, int64_t m) {
  if (m == n) return;
  CudaSession& s = cs(base);
  check(cudaSetDevice(device_), "cudaSetDevice");
  const int64_t V = weights_->config.vocab_size;
  for (size_t l = 0; l < s.dev.state_rows.size(); ++l)
    check(cudaMemcpyAsync(s.dev.state[s.parity][l], s.dev.state_rows[l] + (m - 1) * (s.state_bytes / 4), s.state_bytes,
                          cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpyAsync (verify state)");
  check(cudaMemcpyAsync(s.dev.logits[s.parity], s.dev.verify_logits + (m - 1) * V, V * 4, cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync (logits)");
  if (s.mtp)  // the head's state after row m - 1 (the verify wrote its rows on the other parity)
    check(cudaMemcpyAsync(s.dev.mtp_hidden[s.parity], s.dev.mtp_hidden[1 - s.parity] + m * weights_->config.hidden_size,
                          weights_->config.hidden_size * 4, cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpyAsync (MTP state)");
  *kept_pos_.host<int>() = static_cast<int>(s.position() - (n - m));
  check(cudaMemcpyAsync(s.dev.pos, kept_pos_.host<int>(), sizeof(int), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (position)");
}

// Drafts: one graph of n head steps from the current state (mtp_step.h), one host wait.
void CudaExecutor::draft_step(Session& base, int32_t next, int64_t n, int32_t* drafts, float* logits, int64_t vocab_limit) {
  CudaSession& s = cs(base);
  check(cudaSetDevice(device_), "cudaSetDevice");
  const int64_t V = weights_->config.vocab_size;
  cudaGraphExec_t g = graph(s, {Graph::Draft, s.parity, Choice::Greedy, static_cast<int>(n), static_cast<int>(vocab_limit)});
  reserve_staging(kMaxStepRows);
  staging_[0] = next;
  check(cudaMemcpyAsync(ws_->draft_tokens, staging_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (draft token)");
  run(g);
  check(cudaMemcpyAsync(staging_, ws_->draft_tokens + 1, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_),
        "cudaMemcpyAsync (drafts)");
  if (logits)
    check(cudaMemcpyAsync(logits, ws_->draft_logits, n * V * 4, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (draft logits)");
  check(cudaStreamSynchronize(stream_), "draft");
  std::copy(staging_, staging_ + n, drafts);
}

void CudaExecutor::upload_ctl(const CudaSession& s, const GenerateRequest& req) {
#ifdef LILY_CUDA_TIMELINE
  if (timeline_.bytes()) dump_timeline();  // the verify steps since the last generate()
#endif
  const SamplingParams& p = req.sampling;
  if (req.stop_ids.size() > static_cast<size_t>(kMaxStopIds))
    fail("generate: at most ", std::to_string(kMaxStopIds), " stop ids are supported on CUDA");
  DecodeCtl ctl;
  // A resumed generation counts on from its earlier tokens: the stop rule, the random
  // stream (uniform01's step) and the penalty counts continue where it paused.
  ctl.n_generated = static_cast<int>(req.generated_before);
  ctl.max_tokens = static_cast<int>(std::min<int64_t>(req.generated_before + req.max_tokens, 1 << 30));
  ctl.max_context = static_cast<int>(s.max_context);
  ctl.n_stop = static_cast<int>(req.stop_ids.size());
  std::copy(req.stop_ids.begin(), req.stop_ids.end(), ctl.stop_ids);
  ctl.penalties = p.penalised();
  ctl.top_k = static_cast<int>(std::min<int64_t>(p.top_k, 1 << 30));
  ctl.vocab_limit = static_cast<int>(std::min<int64_t>(p.vocab_limit, 1 << 30));
  ctl.temperature = p.temperature;
  ctl.top_p = p.top_p;
  ctl.min_p = p.min_p;
  ctl.repetition = p.repetition_penalty;
  ctl.presence = p.presence_penalty;
  ctl.frequency = p.frequency_penalty;
  ctl.seed = p.seed;
#ifdef LILY_CUDA_TIMELINE
  if (!timeline_.bytes()) timeline_ = DeviceBuffer(kTimelineCap * sizeof(TimelineRec), "decode timeline");
  ctl.timeline = timeline_.as<TimelineRec>();
  if (!opt_.timeline_blocks.empty()) {
    if (!stamps_.bytes()) stamps_ = DeviceBuffer(kBlockStampCap * sizeof(BlockStamp), "decode block stamps");
    ctl.stamps = stamps_.as<BlockStamp>();
  }
#endif
  check(cudaMemcpyAsync(ws_->ctl, &ctl, sizeof(ctl), cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (decode control)");
  if (ctl.penalties) {
    const int64_t V = weights_->config.vocab_size;
    std::vector<int32_t> history = s.tokens;
    if (s.pending >= 0) history.push_back(s.pending);  // fed first, so part of the history
    std::vector<unsigned char> seen(V, 0);
    std::vector<int> counts(V, 0);
    for (int32_t t : history) seen[t] = 1;
    const size_t earlier = std::min<size_t>(history.size(), static_cast<size_t>(req.generated_before));
    for (size_t i = history.size() - earlier; i < history.size(); ++i) ++counts[history[i]];
    check(cudaMemcpyAsync(ws_->seen, seen.data(), V, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (seen)");
    check(cudaMemcpyAsync(ws_->counts, counts.data(), V * sizeof(int), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync (counts)");
    check(cudaStreamSynchronize(stream_), "generate setup");
  }
}

// Decode steps two at a time on the device: each writes its choice into the token slot the
// next one reads and into mapped host memory; the device halts at stop ids and limits, and
// an unaccepted step changes nothing kept (state and logits double-buffered, position rewritten).
class CudaExecutor::Steps final : public StepQueue {
 public:
  Steps(CudaExecutor& e, CudaSession& s, const GenerateRequest& req) : e_(e), s_(s), how_(choice_for(req.sampling)) {
    check(cudaSetDevice(e.device_), "cudaSetDevice");
    for (int p = 0; p < 2; ++p) {  // capture before anything is queued
      e.graph(s, {Graph::Step, p, how_});
      e.graph(s, {Graph::Choose, p, how_});
    }
    e.upload_ctl(s, req);
    lp_ = s.parity;
  }
  int depth() const override { return 2; }
  void feed(int32_t token) override {
    if (token != kPrevious) {  // else the graph reads the slot the step before chose into
      e_.staging_[0] = token;
      check(cudaMemcpyAsync(e_.ws_->tok_slots + lp_, e_.staging_, sizeof(int32_t), cudaMemcpyHostToDevice, e_.stream_),
            "cudaMemcpyAsync (token)");
    }
    e_.run(e_.graph(s_, {Graph::Step, lp_, how_}));
    check(cudaEventRecord(e_.events_[1 - lp_], e_.stream_), "cudaEventRecord");
    slots_.push_back(1 - lp_);
    lp_ ^= 1;
  }
  void choose() override {
    e_.run(e_.graph(s_, {Graph::Choose, lp_, how_}));
    check(cudaEventRecord(e_.events_[lp_], e_.stream_), "cudaEventRecord");
    slots_.push_back(lp_);
  }
  int32_t next_token() override {
    const int slot = slots_.front();
    slots_.pop_front();
    check(cudaEventSynchronize(e_.events_[slot]), "decode step");
    return static_cast<volatile int*>(e_.ws_->host_tokens.host<int>())[slot];  // written by the device
  }
  void accept() override { s_.parity ^= 1; }
  // An unaccepted step may have advanced the device position: rewrite it, clear the halt
  // flag, and bring the accepted logits to the host.
  void finish() override {
    check(cudaStreamSynchronize(e_.stream_), "decode loop");
    e_.staging_[0] = static_cast<int32_t>(s_.position());
    check(cudaMemcpyAsync(s_.dev.pos, e_.staging_, sizeof(int), cudaMemcpyHostToDevice, e_.stream_),
          "cudaMemcpyAsync (position)");
    check(cudaMemsetAsync(&e_.ws_->ctl->halt, 0, sizeof(int), e_.stream_), "cudaMemsetAsync (halt)");
    const int64_t V = e_.weights_->config.vocab_size;
    s_.last_logits.resize(V);
    check(cudaMemcpyAsync(s_.last_logits.data(), s_.dev.logits[s_.parity], V * 4, cudaMemcpyDeviceToHost, e_.stream_),
          "cudaMemcpyAsync (logits)");
    check(cudaStreamSynchronize(e_.stream_), "decode loop end");
#ifdef LILY_CUDA_TIMELINE
    e_.dump_timeline();
#endif
  }
  // The same without checks, on the decode stream, so later work on it sees the rewritten values.
  void abort() noexcept override {
    cudaStreamSynchronize(e_.stream_);
    const int pos = static_cast<int>(s_.position());
    cudaMemcpyAsync(s_.dev.pos, &pos, sizeof(int), cudaMemcpyHostToDevice, e_.stream_);
    cudaMemsetAsync(&e_.ws_->ctl->halt, 0, sizeof(int), e_.stream_);
    cudaStreamSynchronize(e_.stream_);
  }

 private:
  CudaExecutor& e_;
  CudaSession& s_;
  const Choice how_;
  int lp_;                // parity of the next feeding step
  std::deque<int> slots_;  // the token slot each queued step chooses into, oldest first
};

std::unique_ptr<StepQueue> CudaExecutor::decode_steps(Session& s, const GenerateRequest& req) {
  return std::make_unique<Steps>(*this, cs(s), req);
}

#ifdef LILY_CUDA_TIMELINE
// The first min(*count, cap) records of `buf` (count and records on the device).
template <class Rec>
std::vector<Rec> fetch_records(const unsigned* count, const DeviceBuffer& buf, unsigned cap, const char* what) {
  unsigned n = 0;
  check(cudaMemcpy(&n, count, sizeof(n), cudaMemcpyDeviceToHost), what);
  std::vector<Rec> recs(std::min(n, cap));
  check(cudaMemcpy(recs.data(), buf.as<Rec>(), recs.size() * sizeof(Rec), cudaMemcpyDeviceToHost), what);
  return recs;
}

// Appends the kernels recorded since the last dump (a generate() call's, or the verify
// steps' since it, dumped when the next generate() starts) to $LILY_CUDA_TIMELINE_OUT as
// one call, a line per kernel: call, index, grid, threads, start, released and the marks
// (ns); with $LILY_CUDA_TIMELINE_BLOCKS, writes the call's block stamps there.
void CudaExecutor::dump_timeline() {
  const char* path = opt_.timeline_out.c_str();
  if (!*path) return;
  const auto recs = fetch_records<TimelineRec>(&ws_->ctl->timeline_n, timeline_, kTimelineCap, "timeline records");
  check(cudaMemset(&ws_->ctl->timeline_n, 0, sizeof(unsigned)), "timeline reset");
  if (recs.empty()) return;
  std::FILE* f = std::fopen(path, "a");
  if (!f) fail("LILY_CUDA_TIMELINE_OUT: cannot open ", path);
  for (size_t i = 0; i < recs.size(); ++i) {
    std::fprintf(f, "%d %zu %u %u %llu %llu", timeline_calls_, i, recs[i].grid, recs[i].threads, recs[i].start,
                 recs[i].released);
    for (unsigned long long m : recs[i].mark) std::fprintf(f, " %llu", m);
    std::fputc('\n', f);
  }
  std::fclose(f);
  ++timeline_calls_;
  // Every block's stamps of this call (the last call's stay): raw BlockStamp records.
  const char* bpath = opt_.timeline_blocks.c_str();
  if (!*bpath || !stamps_.bytes()) return;
  const auto stamps = fetch_records<BlockStamp>(&ws_->ctl->stamps_n, stamps_, kBlockStampCap, "block stamps");
  check(cudaMemset(&ws_->ctl->stamps_n, 0, sizeof(unsigned)), "block stamps reset");
  std::FILE* b = std::fopen(bpath, "wb");
  if (!b) fail("LILY_CUDA_TIMELINE_BLOCKS: cannot open ", bpath);
  const size_t written = std::fwrite(stamps.data(), sizeof(BlockStamp), stamps.size(), b);
  std::fclose(b);
  if (written != stamps.size()) fail("LILY_CUDA_TIMELINE_BLOCKS: short write to ", bpath);
}
#endif

void CudaExecutor::copy_session(CudaSession& dst, const CudaSession& src) {
  if (src.position() > dst.max_context)
    fail("restore: the source holds ", std::to_string(src.position()), " positions, more than the destination's ",
         std::to_string(dst.max_context));
  if (&dst == &src) return;
  auto copy = [&](void* d, const void* s, size_t n) {
    check(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync (session copy)");
  };
  const size_t kv = static_cast<size_t>(src.position()) * src.kv_row_bytes;
  for (size_t l = 0; l < src.dev.k_cache.size(); ++l) {
    copy(dst.dev.k_cache[l], src.dev.k_cache[l], kv);
    copy(dst.dev.v_cache[l], src.dev.v_cache[l], kv);
  }
  for (size_t l = 0; l < src.dev.ring.size(); ++l) {
    copy(dst.dev.ring[l], src.dev.ring[l], src.ring_bytes);
    copy(dst.dev.state[src.parity][l], src.dev.state[src.parity][l], src.state_bytes);
  }
  copy(dst.dev.logits[src.parity], src.dev.logits[src.parity], weights_->config.vocab_size * 4);
  if (src.mtp) {  // check_restore and clone keep both sessions' MTP setting equal
    copy(dst.dev.mtp_k, src.dev.mtp_k, kv);
    copy(dst.dev.mtp_v, src.dev.mtp_v, kv);
    copy(dst.dev.mtp_hidden[src.parity], src.dev.mtp_hidden[src.parity], weights_->config.hidden_size * 4);
  }
  copy(dst.dev.pos, src.dev.pos, sizeof(int));
  check(cudaStreamSynchronize(stream_), "session copy");
  dst.tokens = src.tokens;
  dst.pending = src.pending;
  dst.last_logits = src.last_logits;
  dst.parity = src.parity;
  drop_verified(dst);
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Executor> make_cuda_executor(std::shared_ptr<const ModelWeights> weights, int device_index,
                                             const ExecutorOptions& options) {
  const int n = cuda_device_count();
  if (device_index < 0 || device_index >= n)
    fail("device 'cuda:", std::to_string(device_index), "': ", std::to_string(n), " CUDA device(s) visible");
  return std::make_unique<CudaExecutor>(std::move(weights), device_index, options);
}

}  // namespace lily
