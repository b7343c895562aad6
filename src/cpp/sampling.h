// Token choice from logits on the host: penalties, temperature, top-k, top-p, min-p,
// seeded. GPU executors implement the same rules on the device.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace lily {

struct SamplingParams {
  float temperature = 0.0f;         // <= 0: greedy (argmax)
  int64_t top_k = 0;                // 0: off
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off; keeps p >= min_p * p_max
  float repetition_penalty = 1.0f;  // over prompt and generated tokens (HF rule)
  float presence_penalty = 0.0f;    // over generated tokens (OpenAI rule)
  float frequency_penalty = 0.0f;   // over generated tokens (OpenAI rule)
  uint64_t seed = 0;
  int64_t vocab_limit = 0;          // tokens >= vocab_limit are never chosen (padded rows); 0: all

  bool greedy() const { return temperature <= 0.0f; }
  bool penalised() const { return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f; }
};

// What a sample is drawn from once every rule is applied: the candidates, most likely first,
// and their probabilities (summing to 1). Greedy: the argmax alone.
struct Distribution {
  std::vector<int32_t> ids;
  std::vector<double> probs;
  double prob(int32_t id) const;  // 0 for an id that is not a candidate
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);

  // history: every token of the sequence so far; the last n_generated were generated.
  int32_t sample(const float* logits, int64_t vocab, const std::vector<int32_t>& history, int64_t n_generated);

  // The same rules as sample, for speculative sampling's acceptance test: the distribution
  // (valid until the next call), a uniform draw in [0, 1), and a draw from the distribution
  // with `except` removed and the rest renormalised (-1: nothing removed).
  const Distribution& distribution(const float* logits, int64_t vocab, const std::vector<int32_t>& history,
                                   int64_t n_generated);
  double uniform();
  int32_t draw(int32_t except = -1);

  // Continues the random stream after n earlier samples with the same parameters.
  void skip(int64_t n);
  // Restarts the draws on output token `index`'s own stream (seed and index mixed), so a
  // token's draws do not depend on how many came before it (speculative rounds vary).
  void seek(int64_t index);

 private:
  // The logits with the penalties applied, into work_; the ids it covers (vocab_limit).
  int64_t penalised(const float* logits, int64_t vocab, const std::vector<int32_t>& history, int64_t n_generated);
  void kept_distribution(int64_t V);  // dist_ from work_: temperature, top-k, top-p, min-p

  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> work_;
  Distribution dist_;
};

}  // namespace lily
