// How many MTP drafts each speculative round takes when the count adapts
// (GenerateRequest::adaptive_drafts): the count whose expected tokens a second is highest,
// from the acceptance and the step costs measured so far (an executor keeps one across its
// generate calls), or none, when no count beats plain decode steps (a draft that is always
// wrong then costs little more than them).
#pragma once
#include <array>
#include <cstdint>

#include "executor.h"

namespace lily {

class DraftPolicy {
 public:
  explicit DraftPolicy(int64_t most);  // most drafts a round: 1 .. kMaxVerifyTokens - 1

  // The next round's drafts (1 .. most), or 0: decode plain_run() tokens without drafting.
  // The round after a plain run drafts (a probe of the acceptance); a plain run after a probe
  // is twice as long as the one before when the probe's drafts were all wrong, half as long
  // otherwise (kShortestRun .. kLongestRun).
  int64_t choose();
  int64_t plain_run() const { return run_; }

  // What happened: a round that drafted n (0: none fitted) of which the first `accepted` were
  // right, its draft and verify seconds and the host's seconds a token handed out (choosing
  // on the host: sampling); a run of plain decode steps.
  void drafted(int64_t n, int64_t accepted, double draft_s, double verify_s, double host_s_per_token = 0);
  void decoded(int64_t tokens, double seconds);

  // The model behind choose(), for tests and benchmarks: tokens a round with k drafts is
  // expected to hand out, and its expected seconds (k = 0: one plain step, one token).
  double expected_tokens(int64_t k) const;
  double expected_seconds(int64_t k) const;

  static constexpr int64_t kShortestRun = 8, kLongestRun = 256;

 private:
  // A cost measured a few times: the least of the last kSamples (a stall, a graph capture or
  // the reader pausing a stream inflates one sample, never the cost), 0 until measured.
  struct Cost {
    static constexpr int kSamples = 8;
    std::array<double, kSamples> s{};
    int n = 0;
    void add(double seconds) { s[n++ % kSamples] = seconds; }
    double least() const;
  };
  // One plain step's seconds, measured or inferred from a measured verify or draft step
  // through the prior shape of the costs (kVerifyShape, kDraftShape); 0 with nothing measured.
  double unit() const;

  int64_t most_;
  // Decayed counts per draft position i: rounds that reached it (its earlier drafts right)
  // and rounds where it was right too; acceptance i = hit / seen.
  std::array<double, kMaxVerifyTokens> seen_{}, hit_{};
  std::array<Cost, kMaxVerifyTokens + 1> verify_{}, draft_{};  // by rows fed / drafts
  Cost plain_, host_;
  int64_t run_ = kShortestRun;
  bool probe_ = false, after_probe_ = false, probe_hit_ = false;
};

}  // namespace lily
