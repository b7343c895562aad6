#include "draft_policy.h"

#include <algorithm>

#include "error.h"

namespace lily {
namespace {

// A verify step of T rows and a draft of n tokens in plain steps, before either is measured
// (the CUDA executor's at 4K, docs/perf-log.md section 18); only the counts never tried rest on it.
constexpr double kVerifyShape[kMaxVerifyTokens + 1] = {0, 1.0, 1.6, 2.0, 2.5};
constexpr double kDraftShape = 0.11;
// Acceptance before any round (a later draft's: the one before it's), worth kPriorRounds
// rounds, and how fast an old round's outcome fades (its weight after r more rounds: kDecay^r).
constexpr double kPriorAcceptance = 0.7, kPriorRounds = 1, kDecay = 0.98;

}  // namespace

DraftPolicy::DraftPolicy(int64_t most) : most_(most) {
  if (most < 1 || most >= kMaxVerifyTokens)
    fail("DraftPolicy: 1 to ", std::to_string(kMaxVerifyTokens - 1), " drafts a round, not ", std::to_string(most));
}

double DraftPolicy::Cost::least() const {
  if (n == 0) return 0;
  return *std::min_element(s.begin(), s.begin() + std::min(n, kSamples));
}

double DraftPolicy::unit() const {
  if (plain_.n) return plain_.least();
  for (int64_t t = 1; t <= kMaxVerifyTokens; ++t)
    if (verify_[t].n) return verify_[t].least() / kVerifyShape[t];
  return 0;
}

double DraftPolicy::expected_tokens(int64_t k) const {
  // reach: the chance that drafts 0 .. i are all right; a position rarely reached leans on the
  // one before it (a round that never tries three drafts still learns what a third would do).
  double tokens = 1, reach = 1, prior = kPriorAcceptance;
  for (int64_t i = 0; i < k; ++i) {
    prior = (hit_[i] + kPriorRounds * prior) / (seen_[i] + kPriorRounds);
    reach *= prior;
    tokens += reach;
  }
  return tokens;
}

double DraftPolicy::expected_seconds(int64_t k) const {
  const double u = unit();
  if (k == 0) return u;
  // A count never tried costs what a measured one does, scaled by the prior shape (else by a
  // plain step); one measured once may carry a one-off cost (its graph's capture), so it is
  // taken as at most twice that.
  auto prior = [&](const std::array<Cost, kMaxVerifyTokens + 1>& costs, int64_t i, auto shape) {
    for (int64_t j = 1; j <= kMaxVerifyTokens; ++j)
      if (j != i && costs[j].n > 1) return costs[j].least() * shape(i) / shape(j);
    return u * shape(i);
  };
  auto cost = [&](const std::array<Cost, kMaxVerifyTokens + 1>& costs, int64_t i, auto shape) {
    const Cost& c = costs[i];
    if (c.n > 1) return c.least();
    const double p = prior(costs, i, shape);
    return c.n == 1 ? std::min(c.least(), 2 * p) : p;
  };
  return cost(verify_, k + 1, [](int64_t t) { return kVerifyShape[t]; }) +
         cost(draft_, k, [](int64_t n) { return kDraftShape * n; }) + host_.least() * expected_tokens(k);
}

int64_t DraftPolicy::choose() {
  if (plain_.n == 0) return 0;  // the baseline first: one plain run
  const bool probing = probe_;
  probe_ = false;
  int64_t best = probing ? 1 : 0;
  double best_rate = expected_tokens(best) / expected_seconds(best);
  for (int64_t k = best + 1; k <= most_; ++k) {
    const double rate = expected_tokens(k) / expected_seconds(k);
    if (rate > best_rate) best = k, best_rate = rate;
  }
  if (best == 0) {
    if (after_probe_) run_ = probe_hit_ ? std::max(run_ / 2, kShortestRun) : std::min(2 * run_, kLongestRun);
  } else if (!probing) {
    run_ = kShortestRun;
  }
  after_probe_ = probing;
  return best;
}

void DraftPolicy::drafted(int64_t n, int64_t accepted, double draft_s, double verify_s, double host_s_per_token) {
  if (n == 0) {  // nothing learnt, and no probe outcome for the next run's length
    after_probe_ = false;
    return;
  }
  for (int64_t i = 0; i < kMaxVerifyTokens; ++i) {  // every position fades, reached or not
    seen_[i] *= kDecay;
    hit_[i] *= kDecay;
  }
  for (int64_t i = 0; i < n && i <= accepted; ++i) {  // position i was reached: drafts 0 .. i-1 were right
    seen_[i] += 1;
    hit_[i] += i < accepted ? 1 : 0;
  }
  probe_hit_ = accepted > 0;
  verify_[n + 1].add(verify_s);
  draft_[n].add(draft_s);
  if (host_s_per_token > 0) host_.add(host_s_per_token);
}

void DraftPolicy::decoded(int64_t tokens, double seconds) {
  if (tokens > 0) plain_.add(seconds / tokens);
  probe_ = true;
}

}  // namespace lily
