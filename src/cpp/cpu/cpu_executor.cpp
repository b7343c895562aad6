// The CPU executor: the whole forward pass in fp32 (MODEL.md §4.2), chunk by chunk, by one
// backend's ops on host memory (ops/host_ops.h): the CPU's, or the Metal kernels on the MSL
// emulator (device "metal-emulator", a slow test device).
//   h = embed(tokens)
//   per layer: h += mixer(rmsnorm(h, input_norm));  h += moe(rmsnorm(h, post_norm))
//   logits = lm_head(rmsnorm(h, final_norm))
// A session holds, per layer, the GDN conv + recurrent state or the attention KV cache
// (fp32, grown as positions arrive). Everything a chunk computes depends only on the
// state and the chunk's tokens, so any chunking of a prompt gives the same logits.
#include "cpu_executor.h"

#include <algorithm>
#include <mutex>

#include "cpu/layers.h"
#include "cpu/ops.h"
#include "error.h"

namespace lily {
namespace {

class CpuSession : public Session {
 public:
  struct Layer {
    cpu::GdnState gdn;  // Gated DeltaNet layers
    cpu::KvCache kv;    // full-attention layers
  };
  std::vector<Layer> layers;
  // With the MTP head (Session::mtp): its cache holds a row for every fed position but the
  // last, whose normed trunk state waits in mtp_hidden [H] for the token after it.
  cpu::KvCache mtp_kv;
  std::vector<float> mtp_hidden;
  // After a verify of n tokens (one forward): every row's logits, and the state after each of
  // its first n - 1 tokens that keep_verified may return to.
  struct Verified {
    std::vector<std::vector<float>> conv, recurrent;  // per layer (GDN layers): [n - 1, state]
    std::vector<int64_t> expert_load;                 // [n - 1, layers * E]
    std::vector<float> logits, mtp_hidden;            // [n, V], [n - 1, H]
  };
  // Not copied with the session: a clone or a restore holds nothing verified (Session::verified
  // is 0 there), and a snapshot does not carry a verify's buffers. Kept for the next verify.
  struct VerifiedRows : Verified {
    VerifiedRows() = default;
    VerifiedRows(const VerifiedRows&) : Verified() {}
    VerifiedRows& operator=(const VerifiedRows&) { return *this; }
  };
  VerifiedRows verified_rows;
};

CpuSession& as_cpu(Session& s, const char* op) {
  auto* cpu = dynamic_cast<CpuSession*>(&s);
  if (!cpu) fail(op, ": the session was not made by the cpu executor");
  return *cpu;
}

const CpuSession& as_cpu(const Session& s, const char* op) { return as_cpu(const_cast<Session&>(s), op); }

class CpuExecutor : public Executor {
 public:
  CpuExecutor(std::shared_ptr<const ModelWeights> w, const ops::HostOps& kernels) : Executor(std::move(w)), k_(kernels) {}

  std::string device_name() const override { return k_.device; }
  // The MTP head and verify steps keep the state after each token, which only the CPU's
  // Gated DeltaNet step does.
  bool supports_mtp(std::string* why) const override {
    if (!k_.keeps_rows && why) *why = "the " + device_name() + " executor keeps no state per token: no MTP head";
    return k_.keeps_rows;
  }
  int64_t max_verify_tokens(std::string* why) const override {
    if (!k_.keeps_rows && why) *why = "the " + device_name() + " executor keeps no state per token: no verify step";
    return k_.keeps_rows ? kMaxVerifyTokens : 0;
  }

  std::unique_ptr<Session> new_session(int64_t max_context) override {
    if (max_context <= 0) fail("new_session: max_context must be positive, got ", std::to_string(max_context));
    const ModelConfig& c = weights_->config;
    auto s = std::make_unique<CpuSession>();
    s->max_context = max_context;
    if (std::string why; use_mtp && !supports_mtp(&why)) fail("new_session: ", why);
    s->mtp = use_mtp;
    s->layers.resize(c.num_hidden_layers);
    if (!k_.moe_block) s->expert_load.assign(c.num_hidden_layers * c.num_experts, 0);  // the CPU's block counts
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      if (c.layer_kinds[l] == LayerKind::Linear) s->layers[l].gdn.reset(c);
    return s;
  }

  std::unique_ptr<Session> clone(const Session& s, int64_t capacity) override {
    check_clone_capacity(s, capacity);
    auto copy = std::make_unique<CpuSession>(as_cpu(s, "clone"));
    copy->max_context = capacity;
    drop_verified(*copy);
    return copy;
  }

  void restore(Session& dst, const Session& src) override {
    check_restore(dst, src);
    const int64_t capacity = dst.max_context;
    as_cpu(dst, "restore") = as_cpu(src, "restore");
    dst.max_context = capacity;
    drop_verified(dst);
  }

 protected:
  void forward_chunk(Session& session, const int32_t* tokens, int64_t T, float* last_logits,
                     float* all_logits) override {
    forward_tokens(as_cpu(session, "forward"), tokens, T, last_logits, all_logits, nullptr);
  }

  // forward_chunk, and with rows (a verify) the state after each token but the last kept there.
  void forward_tokens(CpuSession& s, const int32_t* tokens, int64_t T, float* last_logits, float* all_logits,
                      CpuSession::Verified* rows) {
    const ModelWeights& w = *weights_;
    const ModelConfig& c = w.config;
    const int64_t H = c.hidden_size, V = c.vocab_size, pos0 = s.position();
    const float eps = c.rms_norm_eps;
    if (T <= 0) fail("forward: no tokens given");

    std::lock_guard<std::mutex> lock(mu_);  // the buffers are shared by all sessions
    h_.resize(T * H);
    x_.resize(T * H);
    mix_.resize(T * H);
    float *h = h_.data(), *x = x_.data(), *mix = mix_.data();

    k_.embedding({w.embed, tokens, T, h});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const LayerWeights& L = w.layers[l];
      k_.rmsnorm({h, T, H, L.input_norm.values.data(), eps, x});
      if (L.kind == LayerKind::Linear) {
        const cpu::GdnStateRows slots{rows ? rows->conv[l].data() : nullptr, rows ? rows->recurrent[l].data() : nullptr};
        cpu::gated_delta_mixer(L.gdn, c, x, T, s.layers[l].gdn, gdn_buf_, mix, rows ? &slots : nullptr, k_);
      } else {
        cpu::attention_mixer(L.attn, c, x, T, pos0, s.layers[l].kv, attn_buf_, mix, k_);
      }
      add(h, mix, T * H);
      k_.rmsnorm({h, T, H, L.post_norm.values.data(), eps, x});
      if (k_.moe_block) k_.moe_block(L.moe, c, x, T, mix);
      else cpu::moe_block(L.moe, c, x, T, moe_buf_, mix, s.expert_load.data() + l * c.num_experts);
      if (rows) count_rows_experts(*rows, l, T);
      add(h, mix, T * H);
    }

    if (all_logits || s.mtp) {
      k_.rmsnorm({h, T, H, w.final_norm.values.data(), eps, x});
      if (rows && s.mtp) std::copy_n(x, (T - 1) * H, rows->mtp_hidden.data());
      if (s.mtp) mtp_follow(s, tokens, T, x);
    }
    if (all_logits) {
      k_.qmatmul({x, T, w.lm_head, all_logits});
      std::copy_n(all_logits + (T - 1) * V, V, last_logits);
    } else {  // only the last position's logits are needed
      if (!s.mtp) k_.rmsnorm({h + (T - 1) * H, 1, H, w.final_norm.values.data(), eps, x});
      else if (T > 1) std::copy_n(x + (T - 1) * H, H, x);  // the last row, normed above
      k_.qmatmul({x, 1, w.lm_head, last_logits});
    }
  }

  // The MTP head's cache rows for a chunk at positions pos0..pos0+T-1 whose normed trunk
  // states are x [T, H]: row p - 1 pairs the state at p - 1 with the token at p.
  void mtp_follow(CpuSession& s, const int32_t* tokens, int64_t T, const float* x) {
    const int64_t H = weights_->config.hidden_size, pos0 = s.position(), skip = pos0 == 0 ? 1 : 0;
    mtp_in_.resize(T * H);
    if (!skip) std::copy_n(s.mtp_hidden.data(), H, mtp_in_.data());
    std::copy_n(x, (T - 1) * H, mtp_in_.data() + (1 - skip) * H);
    cpu::mtp_head(*weights_, mtp_in_.data(), tokens + skip, T - skip, pos0 - 1 + skip, s.mtp_kv, mtp_buf_, nullptr);
    s.mtp_hidden.assign(x + (T - 1) * H, x + T * H);
  }

  // Draft i + 1 comes from the head's row at position P - 1 + i (P = s.position()) on the
  // previous row's output (the trunk's state for the first) and draft i (next for the
  // first); the rows' cache entries are dropped afterwards.
  void draft_step(Session& session, int32_t next, int64_t n, int32_t* drafts, float* logits,
                  int64_t vocab_limit) override {
    CpuSession& s = as_cpu(session, "draft");
    const ModelWeights& w = *weights_;
    const int64_t H = w.config.hidden_size, V = w.config.vocab_size, limit = vocab_limit > 0 ? vocab_limit : V;
    std::lock_guard<std::mutex> lock(mu_);
    // The drafts' cache rows go, however the loop ends.
    struct Rewind {
      cpu::KvCache& kv;
      size_t rows;
      ~Rewind() {
        kv.k.resize(rows);
        kv.v.resize(rows);
      }
    } rewind{s.mtp_kv, s.mtp_kv.k.size()};
    mtp_in_ = s.mtp_hidden;
    mtp_out_.resize(H);
    row_logits_.resize(V);
    int32_t token = next;
    for (int64_t i = 0; i < n; ++i) {
      cpu::mtp_head(w, mtp_in_.data(), &token, 1, s.position() - 1 + i, s.mtp_kv, mtp_buf_, mtp_out_.data());
      cpu::qmatmul({mtp_out_.data(), 1, w.lm_head, row_logits_.data()});
      if (logits) std::copy_n(row_logits_.data(), V, logits + i * V);
      token = drafts[i] = static_cast<int32_t>(std::max_element(row_logits_.begin(), row_logits_.begin() + limit) -
                                               row_logits_.begin());
      mtp_in_ = mtp_out_;
    }
  }

  // One forward of the n tokens (the weights read once for all rows); every op computes each
  // row from the same values in the same order as feeding it alone, so the rows are
  // single-token steps to the bit. The states keep_step may return to are copied out per row.
  void verify_step(Session& session, const int32_t* tokens, int64_t n, float* logits, int32_t* argmax,
                   int64_t vocab_limit) override {
    CpuSession& s = as_cpu(session, "verify");
    const ModelConfig& c = weights_->config;
    const int64_t V = c.vocab_size, limit = vocab_limit > 0 ? vocab_limit : V, L = c.num_hidden_layers;
    CpuSession::Verified& rows = s.verified_rows;
    rows.conv.resize(L);
    rows.recurrent.resize(L);
    for (int64_t l = 0; l < L; ++l) {
      if (c.layer_kinds[l] != LayerKind::Linear) continue;
      rows.conv[l].resize((n - 1) * s.layers[l].gdn.conv.size());
      rows.recurrent[l].resize((n - 1) * s.layers[l].gdn.recurrent.size());
    }
    rows.expert_load.resize((n - 1) * s.expert_load.size());
    for (int64_t r = 0; r + 1 < n; ++r)
      std::copy(s.expert_load.begin(), s.expert_load.end(), rows.expert_load.begin() + r * s.expert_load.size());
    rows.logits.resize(n * V);
    rows.mtp_hidden.resize(s.mtp ? (n - 1) * c.hidden_size : 0);
    s.last_logits.resize(V);
    forward_tokens(s, tokens, n, s.last_logits.data(), rows.logits.data(), &rows);
    s.tokens.insert(s.tokens.end(), tokens, tokens + n);
    if (logits) std::copy(rows.logits.begin(), rows.logits.end(), logits);
    for (int64_t i = 0; argmax && i < n; ++i) {
      const float* row = rows.logits.data() + i * V;
      argmax[i] = static_cast<int32_t>(std::max_element(row, row + limit) - row);
    }
  }

  // Row r of the verify's expert counts adds the experts of its rows 0 .. r (layer l's routing,
  // moe_buf_.experts [T, K], as moe_block left it).
  void count_rows_experts(CpuSession::Verified& rows, int64_t l, int64_t T) {
    const ModelConfig& c = weights_->config;
    const int64_t E = c.num_experts, K = c.num_experts_per_tok, stride = c.num_hidden_layers * E;
    for (int64_t slot = 0; slot < (T - 1) * K; ++slot)
      for (int64_t r = slot / K; r + 1 < T; ++r) ++rows.expert_load[r * stride + l * E + moe_buf_.experts[slot]];
  }

  void keep_step(Session& session, int64_t n, int64_t m) override {
    CpuSession& s = as_cpu(session, "keep_verified");
    const ModelConfig& c = weights_->config;
    CpuSession::Verified& rows = s.verified_rows;
    if (m < n) {
      const int64_t r = m - 1, kv_floats = (s.position() - (n - m)) * c.num_key_value_heads * c.head_dim;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        if (c.layer_kinds[l] == LayerKind::Linear) {
          cpu::GdnState& g = s.layers[l].gdn;
          std::copy_n(rows.conv[l].data() + r * g.conv.size(), g.conv.size(), g.conv.data());
          std::copy_n(rows.recurrent[l].data() + r * g.recurrent.size(), g.recurrent.size(), g.recurrent.data());
        } else {
          s.layers[l].kv.k.resize(kv_floats);
          s.layers[l].kv.v.resize(kv_floats);
        }
      }
      const size_t load = s.expert_load.size();
      std::copy_n(rows.expert_load.data() + r * load, load, s.expert_load.data());
      std::copy_n(rows.logits.data() + r * c.vocab_size, c.vocab_size, s.last_logits.data());
      if (s.mtp) {  // the head's cache: a row for every kept position but the last
        const int64_t mtp_floats = (s.position() - (n - m) - 1) * c.num_key_value_heads * c.head_dim;
        s.mtp_kv.k.resize(mtp_floats);
        s.mtp_kv.v.resize(mtp_floats);
        s.mtp_hidden.assign(rows.mtp_hidden.data() + r * c.hidden_size, rows.mtp_hidden.data() + m * c.hidden_size);
      }
    }
  }


 private:
  static void add(float* h, const float* delta, int64_t n) {
    for (int64_t i = 0; i < n; ++i) h[i] += delta[i];
  }

  const ops::HostOps& k_;  // the backend's ops
  std::mutex mu_;
  std::vector<float> h_, x_, mix_;  // [T, H]: residual stream, normed input, block output
  std::vector<float> mtp_in_, mtp_out_, row_logits_;  // the MTP head's inputs, output, a draft's logits
  cpu::MtpBuffers mtp_buf_;
  cpu::GdnBuffers gdn_buf_;
  cpu::AttnBuffers attn_buf_;
  cpu::MoeBuffers moe_buf_;
};

}  // namespace

std::unique_ptr<Executor> make_cpu_executor(std::shared_ptr<const ModelWeights> weights, const ops::HostOps& kernels) {
  if (!weights) fail("make_cpu_executor: no weights");
  return std::make_unique<CpuExecutor>(std::move(weights), kernels);
}

}  // namespace lily
