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

void Sampler::seek(int64_t index) {
  // splitmix64 of the seed and the index: distinct, well-mixed seeds for neighbouring tokens
  uint64_t z = p_.seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(index) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  rng_.seed(z ^ (z >> 31));
}

int32_t Sampler::sample(const float* logits, int64_t vocab, const std::vector<int32_t>& history,
                        int64_t n_generated) {
  const int64_t V = penalised(logits, vocab, history, n_generated);
  // Greedy: the first index of the maximum, like argmax everywhere else.
  if (p_.greedy()) return static_cast<int32_t>(std::max_element(work_.begin(), work_.begin() + V) - work_.begin());
  kept_distribution(V);
  return draw();
}

const Distribution& Sampler::distribution(const float* logits, int64_t vocab, const std::vector<int32_t>& history,
                                          int64_t n_generated) {
  const int64_t V = penalised(logits, vocab, history, n_generated);
  if (p_.greedy()) {
    dist_.ids.assign(1, static_cast<int32_t>(std::max_element(work_.begin(), work_.begin() + V) - work_.begin()));
    dist_.probs.assign(1, 1.0);
  } else {
    kept_distribution(V);
  }
  return dist_;
}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::draw(int32_t except) {
  const std::vector<int32_t>& ids = dist_.ids;
  const std::vector<double>& probs = dist_.probs;
  double mass = 0;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] != except) mass += probs[i];
  if (!(mass > 0)) return except;  // nothing else is possible (the caller accepted except with probability 1)
  const double u = uniform() * mass;
  double acc = 0;
  int32_t last = except;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == except) continue;
    acc += probs[i];
    last = ids[i];
    if (u < acc) return ids[i];
  }
  return last;
}

double Distribution::prob(int32_t id) const {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == id) return probs[i];
  return 0;
}

int64_t Sampler::penalised(const float* logits, int64_t vocab, const std::vector<int32_t>& history,
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
  return V;
}

void Sampler::kept_distribution(int64_t V) {
  // Candidates sorted by logit (descending), cut by top-k.
  std::vector<int32_t>& idx = dist_.ids;
  idx.resize(V);
  std::iota(idx.begin(), idx.end(), 0);
  int64_t k = p_.top_k > 0 ? std::min(p_.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) { return work_[a] > work_[b] || (work_[a] == work_[b] && a < b); };
  if (k < V) {
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), by_logit);
    idx.resize(k);
  } else {
    std::sort(idx.begin(), idx.end(), by_logit);
  }

  // Softmax at temperature over the candidates (fp64 sums for a stable cut).
  const double inv_t = 1.0 / p_.temperature;
  const double top = work_[idx[0]];
  std::vector<double>& prob = dist_.probs;
  prob.resize(idx.size());
  double sum = 0;
  for (size_t i = 0; i < idx.size(); ++i) sum += prob[i] = std::exp((work_[idx[i]] - top) * inv_t);
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
  idx.resize(keep);
  prob.resize(keep);
  double mass = 0;
  for (double q : prob) mass += q;
  for (double& q : prob) q /= mass;
}

}  // namespace lily
