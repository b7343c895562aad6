// The interface every backend implements (cpu, cuda, metal).
//
// A Session holds one conversation's state: the tokens fed so far, the KV cache of the
// full-attention layers and the conv + recurrent state of the Gated DeltaNet layers.
// Backends subclass it. Generation leaves the last chosen token "pending" (chosen but
// not yet fed), so a later call continues exactly where the previous one stopped.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sampling.h"
#include "weights.h"

namespace lily {

class Session {
 public:
  virtual ~Session() = default;
  int64_t max_context = 0;        // positions the session may hold
  std::vector<int32_t> tokens;    // tokens fed so far; position = tokens.size()
  int32_t pending = -1;           // chosen by generate(), not yet fed
  std::vector<float> last_logits; // [V] logits after the last fed token (host copy; forward and
                                  // generate refresh it, a device executor's verify steps do not)
  // [layers, E] tokens routed to each expert so far, for executors that count (cpu);
  // empty otherwise.
  std::vector<int64_t> expert_load;
  // Tokens fed by the last Executor::verify that keep_verified may still cut back; 0 once
  // anything else has touched the session.
  int64_t verified = 0;
  bool mtp = false;  // the MTP head's cache follows every fed token (Executor::draft)
  int64_t position() const { return static_cast<int64_t>(tokens.size()); }
};

// Tokens one speculative verify feeds at most: the pending token and up to 3 drafts.
constexpr int64_t kMaxVerifyTokens = 4;

struct GenerateRequest {
  int64_t max_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
  // Tokens this generation chose in earlier calls (a stream that paused and resumes): the
  // last generated_before tokens of the session are its output, so the output penalties
  // count them and the random stream continues after them.
  int64_t generated_before = 0;
  // Speculative decoding with the MTP head (speculative_loop.h): drafts a round, 0: off; with
  // adaptive_drafts the most a round, each round's count chosen by measurement (draft_policy.h).
  int64_t draft_tokens = 0;
  bool adaptive_drafts = false;
  // Benchmarks of the bounds (an oracle drafter, an always-wrong one): drafts read from here,
  // the one for output token i at [i] (its end: token 0), instead of from the MTP head.
  std::vector<int32_t> scripted_drafts;
};

struct GenerateResult {
  int64_t n_tokens = 0;
  std::string finish_reason;  // "stop" (stop id), "length" (max_tokens or context), "cancelled"
  // Speculative decoding: verify steps, drafts, accepted drafts, and tokens handed out by the
  // rounds (the rest came from plain decode steps, when adaptive drafting chose none).
  int64_t rounds = 0, drafted = 0, accepted = 0, round_tokens = 0;
};

// Receives each token as soon as it is known; returning false cancels generation, unless
// that token ends it anyway (a stop id, max_tokens, the context's end), whose reason wins.
using TokenCallback = std::function<bool(int32_t)>;

class StepQueue;
class DraftPolicy;

class Executor {
 public:
  explicit Executor(std::shared_ptr<const ModelWeights> w);  // out of line, as ~Executor: DraftPolicy is opaque here
  virtual ~Executor();

  virtual std::string device_name() const = 0;
  // How prompts are fed: "chunked" (whole chunks through each layer), or "token by
  // token (reason)" where an executor must fall back to its decode step.
  virtual std::string prefill_route() const { return "chunked"; }
  virtual std::unique_ptr<Session> new_session(int64_t max_context) = 0;

  // Feeds n tokens (in chunks of at most prefill_chunk), appending them to the session
  // and leaving the last position's logits in session.last_logits. With all_logits
  // non-null, also writes [n, V] logits of every position there (teacher forcing).
  // Refuses (and changes nothing) when the tokens would not fit the context.
  void forward(Session& s, const int32_t* tokens, int64_t n, float* all_logits);

  // Chooses up to max_tokens tokens, calling on_token for each (decode_loop.h: one loop
  // for every executor, over its decode_steps).
  GenerateResult generate(Session& s, const GenerateRequest& req, const TokenCallback& on_token);

  // Speculative decoding's verify: feeds tokens[0..n) (1 <= n <= max_verify_tokens(); a
  // pending token must be tokens[0]) as one step and writes every fed token's logits to
  // logits [n, V] (when non-null), row i bit-identical to feeding the tokens one at a time,
  // and each row's greedy choice among ids < vocab_limit (0: all; ties to the lower id) to
  // argmax [n] (when non-null). The session then holds all n; keep_verified(s, m) keeps the
  // first m (1 <= m <= n) with the state after token m - 1 and its logits, recomputing nothing.
  void verify(Session& s, const int32_t* tokens, int64_t n, float* logits, int32_t* argmax = nullptr,
              int64_t vocab_limit = 0);
  void keep_verified(Session& s, int64_t m);
  // The most tokens one verify step takes with these weights (<= kMaxVerifyTokens; 0: none),
  // and in *why the reason when fewer.
  virtual int64_t max_verify_tokens(std::string* why = nullptr) const { return kMaxVerifyTokens; }

  // The MTP head (weights().has_mtp; MODEL.md §7). Sessions made while use_mtp is set keep
  // the head's cache through every fed token. draft(s, next, n, ...) then drafts n tokens
  // after `next` (the token to be fed at s's position: the pending one): each the greedy
  // choice among ids < vocab_limit (0: all) of the head, fed back with the head's output for
  // the next (recursive drafts), with their logits [n, V] when non-null; s is left as it was.
  bool use_mtp = false;
  // Whether this executor runs the head of these weights; if not, why in *why.
  virtual bool supports_mtp(std::string* why = nullptr) const {
    if (why) *why = "the " + device_name() + " executor has no MTP head";
    return false;
  }
  void draft(Session& s, int32_t next, int64_t n, int32_t* drafts, float* logits = nullptr, int64_t vocab_limit = 0);
  // The adaptive draft count's measurements (draft_policy.h), kept across generate calls and
  // sessions (costs are the executor's, acceptance the head's): one per most drafts a round,
  // greedy or chosen on the host (whose sampling adds to a round's cost).
  DraftPolicy& draft_policy(int64_t most, bool host_choice);
  void forget_draft_policies();  // the next generate starts measuring again

  // Snapshots: an independent copy of the session's state with room for `capacity`
  // positions (at least what s holds; a compact snapshot costs only its positions'
  // K/V), and copying one back. restore keeps dst's own max_context and refuses a
  // state that does not fit it.
  virtual std::unique_ptr<Session> clone(const Session& s, int64_t capacity) = 0;
  virtual void restore(Session& dst, const Session& src) = 0;

  const ModelWeights& weights() const { return *weights_; }
  int64_t prefill_chunk = 512;

 protected:
  // One chunk: tokens are appended to s.tokens by the caller after this returns.
  // Writes the last position's logits to last_logits ([V]), and all positions' to
  // all_logits ([n, V]) when non-null.
  virtual void forward_chunk(Session& s, const int32_t* tokens, int64_t n, float* last_logits,
                             float* all_logits) = 0;
  // verify and keep_verified after their checks: verify_step appends the tokens to
  // s.tokens; keep_step(s, n, m) undoes the last n - m of the n verified (none when m == n;
  // the caller then drops them from s.tokens); forget_verified(s) drops what a verify kept
  // for keep_step once anything else touches the session.
  virtual void verify_step(Session& s, const int32_t* tokens, int64_t n, float* logits, int32_t* argmax,
                           int64_t vocab_limit) = 0;
  virtual void keep_step(Session& s, int64_t n, int64_t m) = 0;
  virtual void forget_verified(Session& s) {}
  // draft after its checks (executors whose supports_mtp() is true).
  virtual void draft_step(Session& s, int32_t next, int64_t n, int32_t* drafts, float* logits, int64_t vocab_limit);
  // The decode steps generate() queues (decode_loop.h). The default runs each step when
  // queued: forward_chunk, then the host sampler on last_logits.
  virtual std::unique_ptr<StepQueue> decode_steps(Session& s, const GenerateRequest& req);
  void drop_verified(Session& s) {
    s.verified = 0;
    forget_verified(s);
  }

  std::shared_ptr<const ModelWeights> weights_;

 private:
  class HostSteps;
  std::map<std::pair<int64_t, bool>, std::unique_ptr<DraftPolicy>> draft_policies_;
};

void check_tokens(const ModelConfig& c, const int32_t* tokens, int64_t n);
void check_restore(const Session& dst, const Session& src);
void check_clone_capacity(const Session& src, int64_t capacity);

}  // namespace lily
