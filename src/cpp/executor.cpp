#include "executor.h"

#include <algorithm>

#include "decode_loop.h"
#include "draft_policy.h"
#include "speculative_loop.h"
#include "error.h"

namespace lily {

Executor::Executor(std::shared_ptr<const ModelWeights> w) : weights_(std::move(w)) {}
Executor::~Executor() = default;

DraftPolicy& Executor::draft_policy(int64_t most, bool host_choice) {
  std::unique_ptr<DraftPolicy>& p = draft_policies_[{most, host_choice}];
  if (!p) p = std::make_unique<DraftPolicy>(most);
  return *p;
}

void Executor::forget_draft_policies() { draft_policies_.clear(); }

void check_tokens(const ModelConfig& c, const int32_t* tokens, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      fail("token id ", std::to_string(tokens[i]), " at index ", std::to_string(i), " is outside the vocabulary [0, ",
           std::to_string(c.vocab_size), ")");
}

void check_restore(const Session& dst, const Session& src) {
  if (dst.mtp != src.mtp)
    fail("restore: the snapshot was made ", src.mtp ? "with" : "without", " the MTP head and the session ",
         dst.mtp ? "with" : "without", " it");
  const int64_t need = src.position() + (src.pending >= 0 ? 1 : 0);
  if (need > dst.max_context)
    fail("restore: the snapshot holds ", std::to_string(need), " positions but the session has room for ",
         std::to_string(dst.max_context));
}

void check_clone_capacity(const Session& src, int64_t capacity) {
  const int64_t need = src.position() + (src.pending >= 0 ? 1 : 0);
  if (capacity < std::max<int64_t>(need, 1))
    fail("clone: capacity ", std::to_string(capacity), " is smaller than the ", std::to_string(need),
         " positions the session holds");
}

void Executor::forward(Session& s, const int32_t* tokens, int64_t n, float* all_logits) {
  const ModelConfig& c = weights_->config;
  if (n <= 0) fail("forward: no tokens given");
  check_tokens(c, tokens, n);
  std::vector<int32_t> seq;
  if (s.pending >= 0) seq.push_back(s.pending);
  seq.insert(seq.end(), tokens, tokens + n);
  const int64_t total = static_cast<int64_t>(seq.size());
  if (s.position() + total > s.max_context)
    fail("prompt of ", std::to_string(n), " tokens does not fit: the session holds ", std::to_string(s.position()),
         " of its ", std::to_string(s.max_context), " context positions");
  const int64_t V = c.vocab_size;
  const int64_t skip = total - n;  // the pending token's logits are not asked for
  drop_verified(s);
  s.last_logits.resize(V);
  std::vector<float> chunk_logits;
  for (int64_t begin = 0; begin < total; begin += prefill_chunk) {
    const int64_t len = std::min(prefill_chunk, total - begin);
    float* all = nullptr;
    if (all_logits) {
      chunk_logits.resize(len * V);
      all = chunk_logits.data();
    }
    forward_chunk(s, seq.data() + begin, len, s.last_logits.data(), all);
    s.tokens.insert(s.tokens.end(), seq.begin() + begin, seq.begin() + begin + len);
    s.pending = -1;
    if (all_logits)
      for (int64_t t = 0; t < len; ++t)
        if (begin + t >= skip)
          std::copy(all + t * V, all + (t + 1) * V, all_logits + (begin + t - skip) * V);
  }
}

void Executor::verify(Session& s, const int32_t* tokens, int64_t n, float* logits, int32_t* argmax,
                      int64_t vocab_limit) {
  std::string why;
  const int64_t most = max_verify_tokens(&why);
  if (most == 0) fail("verify: ", why);
  if (n < 1 || n > most)
    fail("verify: ", std::to_string(n), " tokens given; a verify step feeds 1 to ", std::to_string(most),
         why.empty() ? "" : " (" + why + ")");
  if (s.pending >= 0 && tokens[0] != s.pending)
    fail("verify: the session's pending token ", std::to_string(s.pending), " must be the first token, not ",
         std::to_string(tokens[0]));
  check_tokens(weights_->config, tokens, n);
  if (s.position() + n > s.max_context)
    fail("verify: ", std::to_string(n), " tokens do not fit: the session holds ", std::to_string(s.position()), " of its ",
         std::to_string(s.max_context), " context positions");
  if (!logits && !argmax) fail("verify: neither logits nor argmax asked for");
  if (vocab_limit < 0) fail("verify: vocab_limit must be >= 0, got ", std::to_string(vocab_limit));
  drop_verified(s);
  const int32_t pending = s.pending;
  s.pending = -1;  // fed as the first row
  try {
    verify_step(s, tokens, n, logits, argmax, std::min<int64_t>(vocab_limit, weights_->config.vocab_size));
  } catch (...) {
    s.pending = pending;
    throw;
  }
  s.verified = n;
}

void Executor::keep_verified(Session& s, int64_t m) {
  if (s.verified <= 0) fail("keep_verified: the session's last step was not a verify");
  if (m < 1 || m > s.verified)
    fail("keep_verified: keeps 1 to ", std::to_string(s.verified), " of the verified tokens, not ", std::to_string(m));
  keep_step(s, s.verified, m);
  s.tokens.resize(s.tokens.size() - (s.verified - m));
  s.verified = 0;
}

void Executor::draft(Session& s, int32_t next, int64_t n, int32_t* drafts, float* logits, int64_t vocab_limit) {
  if (!weights_->has_mtp) fail("draft: the checkpoint has no MTP head");
  if (!s.mtp) fail("draft: the session was made without the MTP head (set use_mtp before making sessions)");
  if (n < 1 || n >= kMaxVerifyTokens)
    fail("draft: ", std::to_string(n), " drafts asked for; a verify step takes 1 to ", std::to_string(kMaxVerifyTokens - 1));
  if (s.position() == 0) fail("draft: the session holds no token yet (drafting continues a fed position)");
  if (s.position() - 1 + n > s.max_context)
    fail("draft: ", std::to_string(n), " drafts at position ", std::to_string(s.position()),
         " would pass the session's context of ", std::to_string(s.max_context), " positions");
  if (s.pending >= 0 && next != s.pending)
    fail("draft: the session's pending token ", std::to_string(s.pending), " must be the one drafted after, not ",
         std::to_string(next));
  check_tokens(weights_->config, &next, 1);
  if (vocab_limit < 0) fail("draft: vocab_limit must be >= 0, got ", std::to_string(vocab_limit));
  draft_step(s, next, n, drafts, logits, std::min<int64_t>(vocab_limit, weights_->config.vocab_size));
}

void Executor::draft_step(Session&, int32_t, int64_t, int32_t*, float*, int64_t) {
  fail("draft: the ", device_name(), " executor has no MTP head");  // supports_mtp() keeps sessions off it
}

// Each step runs when queued, on the host: feed the token (forward_chunk), then sample
// from the logits it leaves, with the history of everything fed.
class Executor::HostSteps final : public StepQueue {
 public:
  HostSteps(Executor& e, Session& s, const GenerateRequest& req)
      : e_(e), s_(s), req_(req), sampler_(req.sampling), history_(s.tokens) {
    sampler_.skip(req.generated_before);
  }
  int depth() const override { return 1; }
  void feed(int32_t token) override {
    const int32_t t = token == kPrevious ? chosen_ : token;
    s_.last_logits.resize(e_.weights_->config.vocab_size);
    e_.forward_chunk(s_, &t, 1, s_.last_logits.data(), nullptr);
    history_.push_back(t);
    choose();
  }
  void choose() override {
    if (s_.last_logits.empty()) fail("generate: the session is empty; prefill a prompt first");
    chosen_ = sampler_.sample(s_.last_logits.data(), e_.weights_->config.vocab_size, history_,
                              req_.generated_before + n_chosen_++);
  }
  int32_t next_token() override { return chosen_; }

 private:
  Executor& e_;
  Session& s_;
  const GenerateRequest& req_;
  Sampler sampler_;
  std::vector<int32_t> history_;
  int64_t n_chosen_ = 0;
  int32_t chosen_ = -1;
};

std::unique_ptr<StepQueue> Executor::decode_steps(Session& s, const GenerateRequest& req) {
  return std::make_unique<HostSteps>(*this, s, req);
}

GenerateResult Executor::generate(Session& s, const GenerateRequest& req, const TokenCallback& on_token) {
  drop_verified(s);
  GenerateResult r;
  r.finish_reason = "length";
  if (s.pending >= 0 && s.position() + 1 > s.max_context) return r;
  if (s.pending < 0 && s.position() == 0) fail("generate: the session is empty; prefill a prompt first");
  Sampler check(req.sampling);
  if (req.draft_tokens == 0 && (req.adaptive_drafts || !req.scripted_drafts.empty()))
    fail("generate: adaptive_drafts and scripted_drafts need draft_tokens >= 1 (speculative decoding)");
  if (req.draft_tokens > 0) check_speculative(*this, s, req);
  if (req.max_tokens <= 0) {  // nothing to choose: only the pending token is fed
    if (s.pending >= 0) {
      const int32_t t = s.pending;
      s.pending = -1;
      forward(s, &t, 1, nullptr);
    }
    return r;
  }
  if (req.draft_tokens > 0) return speculative_loop(*this, s, req, on_token);
  const std::unique_ptr<StepQueue> steps = decode_steps(s, req);
  return decode_loop(s, req, *steps, on_token);
}

}  // namespace lily
