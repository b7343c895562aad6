#include "speculative_loop.h"

#include <algorithm>
#include <chrono>

#include "draft_policy.h"
#include "error.h"

namespace lily {

namespace {

// The most drafts a round: req.draft_tokens, or with adaptive_drafts as many as the
// executor's verify step takes (up to it).
int64_t most_drafts(const Executor& e, const GenerateRequest& req) {
  return req.adaptive_drafts ? std::min(req.draft_tokens, e.max_verify_tokens() - 1) : req.draft_tokens;
}

}  // namespace

void check_speculative(const Executor& e, const Session& s, const GenerateRequest& req) {
  std::string why;
  const int64_t most = e.max_verify_tokens(&why), drafts = most_drafts(e, req);
  if (drafts < 1 || drafts >= most)
    fail("generate: ", std::to_string(req.draft_tokens), " drafts a round do not fit a verify step of ",
         std::to_string(most), " tokens", why.empty() ? "" : " (" + why + ")");
  if (!s.mtp && req.scripted_drafts.empty())
    fail("generate: speculative decoding needs a session made with the MTP head (use_mtp)");
  check_tokens(e.weights().config, req.scripted_drafts.data(), static_cast<int64_t>(req.scripted_drafts.size()));
}

GenerateResult speculative_loop(Executor& e, Session& s, const GenerateRequest& req, const TokenCallback& on_token) {
  check_speculative(e, s, req);
  const SamplingParams& p = req.sampling;
  const int64_t V = e.weights().config.vocab_size, limit = p.vocab_limit > 0 ? std::min(p.vocab_limit, V) : V;
  // Greedy without penalties takes the verify step's own argmax; anything else is chosen on
  // the host from the rows' logits, drafts by rejection sampling.
  const bool on_host = !p.greedy() || p.penalised();
  // Output token j's draws are the random stream of j (Sampler::seek): no draw is used twice,
  // however rounds, plain runs and resumed calls divide the output.
  Sampler sampler(p);
  std::vector<float> rows(on_host ? kMaxVerifyTokens * V : 0);  // [d + 1, V] a round's logits
  std::vector<int32_t> history;

  GenerateResult r;
  // Hands out the next token, the session then holding `position` tokens with it pending;
  // false when generation ends there (r.finish_reason says why).
  auto emit = [&](int32_t tok, int64_t position) {
    ++r.n_tokens;
    const bool keep_going = on_token(tok);
    const bool stop = std::find(req.stop_ids.begin(), req.stop_ids.end(), tok) != req.stop_ids.end();
    const bool length = r.n_tokens == req.max_tokens || position + 1 >= s.max_context;
    if (!stop && !length && keep_going) return true;
    r.finish_reason = stop ? "stop" : length ? "length" : "cancelled";  // natural ends win over a cancel
    return false;
  };

  if (s.pending < 0) {  // the first choice, from the logits a prompt left
    sampler.seek(req.generated_before);
    s.pending = on_host ? sampler.sample(s.last_logits.data(), V, s.tokens, req.generated_before)
                        : static_cast<int32_t>(std::max_element(s.last_logits.begin(), s.last_logits.begin() + limit) -
                                               s.last_logits.begin());
    if (!emit(s.pending, s.position())) return r;
  }
  // Consulted with adaptive_drafts only; scripted drafts (benchmarks) teach the executor's nothing.
  DraftPolicy scripted(std::max<int64_t>(1, most_drafts(e, req)));
  DraftPolicy& policy = req.scripted_drafts.empty() ? e.draft_policy(most_drafts(e, req), on_host) : scripted;
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  // A run of plain decode steps (the executor's own loop); false when generation ends in it.
  // Its cost a token leaves out the time spent in on_token (a stream's reader may pause it).
  auto plain_run = [&] {
    GenerateRequest plain = req;
    plain.draft_tokens = 0;
    plain.adaptive_drafts = false;
    plain.scripted_drafts.clear();
    plain.max_tokens = std::min(policy.plain_run(), req.max_tokens - r.n_tokens);
    plain.generated_before = req.generated_before + r.n_tokens;
    double reading = 0;
    const Clock::time_point t0 = Clock::now();
    const GenerateResult g = e.generate(s, plain, [&](int32_t tok) {
      const Clock::time_point c0 = Clock::now();
      const bool more = on_token(tok);
      reading += since(c0);
      return more;
    });
    policy.decoded(g.n_tokens, since(t0) - reading);
    r.n_tokens += g.n_tokens;
    r.finish_reason = g.finish_reason;
    // "length" from the run's own bound is not the end
    return g.finish_reason == "length" && r.n_tokens < req.max_tokens && s.position() + 1 < s.max_context;
  };

  for (;;) {
    const int64_t wanted = req.adaptive_drafts ? policy.choose() : req.draft_tokens;
    if (wanted == 0) {
      if (!plain_run()) return r;
      continue;
    }
    // Drafts: as many as wanted, within max_tokens and the context (the last choice stays pending).
    const int64_t base = s.position();
    const int64_t d =
        std::max<int64_t>(0, std::min({wanted, req.max_tokens - r.n_tokens - 1, s.max_context - 2 - base}));
    int32_t step[kMaxVerifyTokens], choice[kMaxVerifyTokens];
    step[0] = s.pending;
    const Clock::time_point t0 = Clock::now();
    if (d > 0 && !req.scripted_drafts.empty()) {
      const int64_t script = static_cast<int64_t>(req.scripted_drafts.size());
      for (int64_t i = 0, j = req.generated_before + r.n_tokens; i < d; ++i, ++j)  // j: the draft's output index
        step[1 + i] = j < script ? req.scripted_drafts[j] : 0;
    } else if (d > 0) {
      e.draft(s, s.pending, d, step + 1, nullptr, limit);
    }
    const double draft_s = since(t0);
    const Clock::time_point t1 = Clock::now();
    int64_t accepted = 0;
    double host_s = 0;  // the host's choices, a cost per token handed out (priced apart from the verify)
    if (on_host) {
      e.verify(s, step, d + 1, rows.data(), nullptr, limit);
      const Clock::time_point t2 = Clock::now();
      // Row i's distribution follows the pending token and the drafts before it. Draft x is kept
      // with probability p(x); else the token comes from p without x, renormalised: each token
      // is then distributed exactly as p (the drafts are the head's argmax, a point mass).
      history.assign(s.tokens.begin(), s.tokens.end() - d);
      for (int64_t i = 0; i <= d; ++i) {
        const int64_t j = req.generated_before + r.n_tokens + i;  // the output index row i chooses
        sampler.seek(j);
        const Distribution& dist = sampler.distribution(rows.data() + i * V, V, history, j);
        if (i == d) {
          choice[i] = sampler.draw();
        } else if (sampler.uniform() < dist.prob(step[i + 1])) {
          choice[i] = step[i + 1];
          history.push_back(choice[i]);
          ++accepted;
          continue;
        } else {
          choice[i] = sampler.draw(step[i + 1]);
        }
        break;
      }
      host_s = since(t2);
    } else {
      e.verify(s, step, d + 1, nullptr, choice, limit);
      while (accepted < d && step[accepted + 1] == choice[accepted]) ++accepted;
    }
    const double verify_s = since(t1) - host_s;
    policy.drafted(d, accepted, draft_s, verify_s, host_s / (accepted + 1));
    ++r.rounds;
    r.drafted += d;
    r.accepted += accepted;
    // The accepted drafts are the model's own choices: choice[0 .. accepted] in order. The
    // session keeps what was handed out, also when on_token throws.
    int64_t kept = 0;
    bool more = true;
    auto keep = [&] {  // kept >= 1: the first emit has begun
      e.keep_verified(s, kept);
      s.pending = choice[kept - 1];
      r.round_tokens += kept;
    };
    try {
      while (more && kept <= accepted) {
        ++kept;
        more = emit(choice[kept - 1], base + kept);
      }
    } catch (...) {
      keep();
      throw;
    }
    keep();
    if (!more) return r;
  }
}

}  // namespace lily
