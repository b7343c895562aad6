#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "error.h"

namespace lily {

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) fail("top_p must be in (0, 1], got ", std::to_string(p.top_p));
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) fail("min_p must be in [0, 1], got ", std::to_string(p.min_p));
  if (p.top_k < 0) fail("top_k must be >= 0, got ", std::to_string(p.top_k));
  if (!(p.repetition_penalty > 0.0f)) fail("repetition_penalty must be > 0, got ", std::to_string(p.repetition_penalty));
  if (!std::isfinite(p.temperature) || p.temperature < 0)
    fail("temperature must be finite and >= 0 (0 is greedy), got ", std::to_string(p.temperature));
  if (!std::isfinite(p.presence_penalty)) fail("presence_penalty must be finite");
  if (!std::isfinite(p.frequency_penalty)) fail("frequency_penalty must be finite");
  if (!std::isfinite(p.repetition_penalty)) fail("repetition_penalty must be finite");
}

void Sampler::skip(int64_t n) {
  if (!p_.greedy() && n > 0) rng_.discard(static_cast<unsigned long long>(n));  // one draw per sample
}

int32_t Sampler::sample(const float* logits, int64_t vocab, const std::vector<int32_t>& history,
                        int64_t n_generated) {
  const int64_t V = p_.vocab_limit > 0 ? std::min(p_.vocab_limit, vocab) : vocab;
  work_.assign(logits, logits + V);

  // Penalties. Repetition (HF): divide positive logits, multiply negative ones, over
  // every distinct token seen. Presence/frequency (OpenAI): subtract per generated token.
  if (p_.repetition_penalty != 1.0f) {
    std::vector<bool> seen(V, false);
    for (int32_t t : history)
      if (t >= 0 && t < V && !seen[t]) {
        seen[t] = true;
        work_[t] = work_[t] > 0 ? work_[t] / p_.repetition_penalty : work_[t] * p_.repetition_penalty;
      }
  }
  if ((p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f) && n_generated > 0) {
    std::unordered_map<int32_t, int> counts;
    for (size_t i = history.size() - std::min<size_t>(history.size(), n_generated); i < history.size(); ++i)
      ++counts[history[i]];
    for (auto [t, n] : counts)
      if (t >= 0 && t < V) work_[t] -= p_.presence_penalty + p_.frequency_penalty * static_cast<float>(n);
  }

  if (p_.greedy()) {
    // First index of the maximum, like argmax everywhere else.
    return static_cast<int32_t>(std::max_element(work_.begin(), work_.end()) - work_.begin());
  }

  // Candidates sorted by logit (descending), cut by top-k.
  idx_.resize(V);
  std::iota(idx_.begin(), idx_.end(), 0);
  int64_t k = p_.top_k > 0 ? std::min(p_.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) { return work_[a] > work_[b] || (work_[a] == work_[b] && a < b); };
  if (k < V) {
    std::partial_sort(idx_.begin(), idx_.begin() + k, idx_.end(), by_logit);
    idx_.resize(k);
  } else {
    std::sort(idx_.begin(), idx_.end(), by_logit);
  }

  // Softmax at temperature over the candidates (fp64 sums for a stable cut).
  const double inv_t = 1.0 / p_.temperature;
  const double top = work_[idx_[0]];
  std::vector<double> prob(idx_.size());
  double sum = 0;
  for (size_t i = 0; i < idx_.size(); ++i) sum += prob[i] = std::exp((work_[idx_[i]] - top) * inv_t);
  for (double& q : prob) q /= sum;

  // top-p: the smallest prefix whose mass reaches top_p; min-p: p >= min_p * p_max.
  size_t keep = prob.size();
  if (p_.top_p < 1.0f) {
    double acc = 0;
    for (size_t i = 0; i < prob.size(); ++i) {
      acc += prob[i];
      if (acc >= p_.top_p) { keep = i + 1; break; }
    }
  }
  if (p_.min_p > 0.0f) {
    const double floor = p_.min_p * prob[0];
    size_t n = 1;
    while (n < keep && prob[n] >= floor) ++n;
    keep = n;
  }

  double mass = 0;
  for (size_t i = 0; i < keep; ++i) mass += prob[i];
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * mass;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (u < acc) return idx_[i];
  }
  return idx_[keep - 1];
}

}  // namespace lily
