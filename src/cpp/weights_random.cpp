// ModelWeights::random: weights for a config without a checkpoint file, so that the
// full 35B-A3B dimensions can be benchmarked without writing 19 GB first.
//
// Codes are uniform over [0, 2^b - 1], so a group's values scale*q + bias have mean
// scale*(2^b-1)/2 + bias and standard deviation |scale|*sqrt((4^b-1)/12). Taking
// scale = target/that spread and bias = -scale*(2^b-1)/2 gives zero-mean weights with
// the target spread. Every matrix gets target = 1/sqrt(fan_in): an RMS-normalised input
// then gives outputs of RMS ~1, so the residual stream stays finite and the logits stay
// spread (no one-hot softmax, no NaN) through every layer. Per group, the scale is
// jittered by +-20%, signed at random (MLX scales may be negative; kernels must cope),
// and the bias offset by up to +-10% of the spread, so no two groups are alike.
//
// That "plain" stack is chaotic when deep: its router logits have RMS ~1, so the 8th and
// 9th of 256 experts sit ~0.05 apart and the 8th still carries ~9 % of the mix; rounding
// flips experts, and every residual branch adds as much as the stream holds, so the flips
// compound over 40 layers (docs/perf-log.md: even fp32 decode drifts to 75 % top-1 against
// the CPU). Style "conditioned" shapes the weights like a trained model's instead:
// router logits of RMS kRouterLogitRms (a confident router: the 8th expert weighs ~2 % of
// the 1st) and residual-branch outputs (GDN out_proj, o_proj, expert and shared down)
// scaled by 1/sqrt(2 layers), the depth scaling of GPT-2's initialisation, so a change
// early in the stack stays as small as it began.
//
// Each value comes from a counter-based generator, splitmix64 of (seed, tensor, index):
// any thread may fill any range, and the weights depend on the seed alone.
#include <cmath>

#include "bf16.h"
#include "checkpoint_names.h"
#include "error.h"
#include "threadpool.h"
#include "weights.h"

namespace lily {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

uint64_t splitmix64(uint64_t z) {
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The random stream of one tensor: bits(i) is the i-th 64-bit value.
struct Stream {
  uint64_t key;
  uint64_t bits(uint64_t i) const { return splitmix64(key + i * kGolden); }
  // Uniform in [0, 1) from 24 bits of a value (`shift` picks which).
  static float unit(uint64_t r, int shift) { return static_cast<float>((r >> shift) & 0xffffff) * 0x1p-24f; }
};

constexpr float kRouterLogitRms = 4;
constexpr int64_t kStreamWork = 8;  // one splitmix64 value, in parallel_for work units

class RandomWeights {
 public:
  RandomWeights(ModelWeights& w, uint64_t seed, bool conditioned)
      : w_(w), seed_key_(splitmix64(seed)), conditioned_(conditioned) {}

  void build() {
    const ModelConfig& c = w_.config;
    w_.layers.resize(c.num_hidden_layers);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) w_.layers[i].kind = c.layer_kinds[i];
    // Each weight draws its streams in table order, so the weights depend on the seed alone.
    for (const WeightEntry& e : weight_table(c, w_.has_mtp)) {
      if (is_matrix(e.kind)) e.matrix(w_) = linear(e);
      else e.dense(w_) = dense(e);
    }
    if (c.tie_word_embeddings) w_.lm_head = w_.embed;
  }

 private:
  ModelWeights& w_;
  uint64_t seed_key_;
  bool conditioned_;
  uint64_t tensors_ = 0;

  Stream next_stream() { return Stream{splitmix64(seed_key_ ^ splitmix64(++tensors_))}; }

  template <typename T>
  T* alloc(int64_t count) {
    w_.owned.emplace_back(new uint8_t[static_cast<size_t>(count) * sizeof(T)]);  // left uninitialised: filled below
    return reinterpret_cast<T*>(w_.owned.back().get());
  }

  // The spread a matrix's weights get: 1/sqrt(fan_in), but for the embedding (a tied one is
  // lm_head too, so it takes lm_head's), the router and, when conditioned, residual branches.
  float spread(const WeightEntry& e) const {
    const int64_t cols = e.shape.back().size;
    const float plain = 1 / std::sqrt(static_cast<float>(cols));
    switch (e.kind) {
      case WeightKind::Embedding: return w_.config.tie_word_embeddings ? plain : 1.0f;
      case WeightKind::Router: return (conditioned_ ? kRouterLogitRms : 1.0f) / std::sqrt(static_cast<float>(cols));
      case WeightKind::ResidualOut:
        return conditioned_ ? plain / std::sqrt(2.0f * static_cast<float>(w_.config.num_hidden_layers)) : plain;
      default: return plain;
    }
  }

  // [experts, rows, cols] codes with scales and biases in the spec a checkpoint of this config
  // would carry (the table's), for weights of spread(e).
  QWeight linear(const WeightEntry& e) {
    const QuantSpec& s = e.quant;
    const int64_t cols = e.shape.back().size;
    if (cols % s.group_size)
      fail("random weights: '", e.name, "' input size ", std::to_string(cols), " is not a multiple of the group size ",
           std::to_string(s.group_size));
    QWeight q;
    q.experts = e.is_stack() ? e.shape[0].size : 1;
    q.rows = e.shape.end()[-2].size;
    q.cols = cols;
    q.bits = s.bits;
    q.group_size = s.group_size;
    const int64_t words = q.experts * q.rows * q.words_per_row(), groups = q.experts * q.rows * q.groups_per_row();
    uint32_t* codes = alloc<uint32_t>(words);
    uint16_t* scales = alloc<uint16_t>(groups);
    uint16_t* biases = alloc<uint16_t>(groups);

    // Any 32 random bits are 8 uniform 4-bit or 4 uniform 8-bit codes.
    const Stream code_stream = next_stream();
    parallel_for((words + 1) / 2, kStreamWork, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint64_t r = code_stream.bits(i);
        codes[2 * i] = static_cast<uint32_t>(r);
        if (2 * i + 1 < words) codes[2 * i + 1] = static_cast<uint32_t>(r >> 32);
      }
    });

    const float levels = static_cast<float>((1 << s.bits) - 1);
    const float code_spread = std::sqrt(levels * (levels + 2) / 12);  // sqrt((4^b - 1) / 12)
    const float spread = this->spread(e);
    const Stream group_stream = next_stream();
    parallel_for(groups, 4 * kStreamWork, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const uint64_t r = group_stream.bits(g);
        float scale = spread / code_spread * (0.8f + 0.4f * Stream::unit(r, 0));
        if (r >> 63) scale = -scale;
        const float offset = (Stream::unit(r, 24) - 0.5f) * 0.2f * spread;
        scales[g] = float_to_bf16(scale);
        biases[g] = float_to_bf16(-bf16_to_float(scales[g]) * levels / 2 + offset);
      }
    });

    q.codes = codes;
    q.scales = scales;
    q.biases = biases;
    return q;
  }

  // Values uniform in [lo, hi), rounded to `dtype`.
  Dense uniform(std::vector<int64_t> shape, float lo, float hi, DType dtype = DType::BF16) {
    Dense d;
    d.shape = std::move(shape);
    d.dtype = dtype;
    int64_t n = 1;
    for (int64_t dim : d.shape) n *= dim;
    d.values.resize(n);
    const Stream stream = next_stream();
    for (int64_t i = 0; i < n; ++i) {
      const float v = lo + (hi - lo) * Stream::unit(stream.bits(i), 0);
      d.values[i] = dtype == DType::BF16 ? round_bf16(v) : v;
    }
    return d;
  }

  // A dense tensor of e's shape: norms about 1 (MLX's multipliers, the +1 already applied), a
  // conv1d of tap spread 1/sqrt(Kc), which keeps the convolved q, k, v at the scale of their
  // input, and decay rates A in [1, 16).
  Dense dense(const WeightEntry& e) {
    std::vector<int64_t> shape = sizes(e.shape);
    switch (e.kind) {
      case WeightKind::Norm: case WeightKind::DtBias: return uniform(shape, 0.9f, 1.1f);
      case WeightKind::Gain: return uniform(shape, 1.0f, 1.0f);
      case WeightKind::Conv: {
        const float tap = std::sqrt(3.0f / static_cast<float>(w_.config.linear_conv_kernel_dim));
        return uniform(shape, -tap, tap);
      }
      default: {  // A_log
        Dense d = uniform(shape, 1.0f, 16.0f, e.dtype);
        for (float& v : d.values) v = std::log(v);
        return d;
      }
    }
  }
};

}  // namespace

std::shared_ptr<ModelWeights> ModelWeights::random(const std::string& config_path, uint64_t seed,
                                                   const std::string& style, bool with_mtp) {
  if (style != "plain" && style != "conditioned")
    fail("random weights: style must be 'plain' or 'conditioned', got '", style, "'");
  auto w = std::make_shared<ModelWeights>();
  w->config = ModelConfig::from_file(config_path);
  w->source_layout = style == "plain" ? "random" : "random (conditioned)";
  w->has_mtp = with_mtp;
  RandomWeights(*w, seed, style == "conditioned").build();
  return w;
}

}  // namespace lily
