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
    const int64_t H = c.hidden_size, V = c.vocab_size;
    // A tied embedding doubles as lm_head, so it takes lm_head's spread.
    w_.embed = linear("embed_tokens", 1, V, H, c.tie_word_embeddings ? 1 / std::sqrt(float(H)) : 1.0f);
    w_.lm_head = c.tie_word_embeddings ? w_.embed : linear("lm_head", 1, V, H);
    w_.final_norm = norm(H);
    w_.layers.resize(c.num_hidden_layers);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) build_layer(i);
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

  // The spec a checkpoint of this config would carry at `module` (the loader's rule):
  // a quantization override for the module, else the config's default; without a
  // quantization block, 8-bit for the router and shared-expert gate and 4-bit elsewhere.
  QuantSpec spec_for(const std::string& module) const {
    const ModelConfig& c = w_.config;
    auto ends_with = [](const std::string& s, const std::string& tail) {
      return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
    };
    for (const auto& [key, spec] : c.quant_overrides)
      if (key == module || ends_with(key, "." + module)) return spec;
    if (c.quantized) return c.quant;
    const bool gate = ends_with(module, "mlp.gate") || ends_with(module, "shared_expert_gate");
    return gate ? QuantSpec{64, 8} : QuantSpec{64, 4};
  }

  // [experts, rows, cols] codes with scales and biases for weights of spread `target`
  // (default 1/sqrt(cols)).
  QWeight linear(const std::string& module, int64_t experts, int64_t rows, int64_t cols, float target = 0) {
    const QuantSpec s = spec_for(module);
    if (cols % s.group_size)
      fail("random weights: '", module, "' input size ", std::to_string(cols), " is not a multiple of the group size ",
           std::to_string(s.group_size));
    QWeight q;
    q.experts = experts;
    q.rows = rows;
    q.cols = cols;
    q.bits = s.bits;
    q.group_size = s.group_size;
    const int64_t words = experts * rows * q.words_per_row(), groups = experts * rows * q.groups_per_row();
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
    const float spread = target > 0 ? target : 1 / std::sqrt(static_cast<float>(cols));
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

  // RMSNorm multipliers (the +1 already applied, as MLX stores them): about 1.
  Dense norm(int64_t n) { return uniform({n}, 0.9f, 1.1f); }

  // Spread of a residual branch's output projection with fan-in `cols`.
  float branch_out(int64_t cols) const {
    const float plain = 1 / std::sqrt(static_cast<float>(cols));
    return conditioned_ ? plain / std::sqrt(2.0f * static_cast<float>(w_.config.num_hidden_layers)) : plain;
  }

  void build_layer(int64_t i) {
    const ModelConfig& c = w_.config;
    const int64_t H = c.hidden_size;
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& L = w_.layers[i];
    L.kind = c.layer_kinds[i];
    L.input_norm = norm(H);
    L.post_norm = norm(H);
    if (L.kind == LayerKind::Linear) {
      const std::string a = p + "linear_attn.";
      const int64_t conv = c.gdn_conv_dim(), Hv = c.linear_num_value_heads, vdim = c.gdn_value_dim();
      const int64_t Kc = c.linear_conv_kernel_dim;
      GdnWeights& g = L.gdn;
      g.in_proj_qkv = linear(a + "in_proj_qkv", 1, conv, H);
      g.in_proj_z = linear(a + "in_proj_z", 1, vdim, H);
      g.in_proj_b = linear(a + "in_proj_b", 1, Hv, H);
      g.in_proj_a = linear(a + "in_proj_a", 1, Hv, H);
      g.out_proj = linear(a + "out_proj", 1, H, vdim, branch_out(vdim));
      // Spread 1/sqrt(Kc) keeps the convolved q, k, v at the scale of their input.
      const float tap = std::sqrt(3.0f / static_cast<float>(Kc));
      g.conv1d = uniform({conv, Kc, 1}, -tap, tap);
      g.dt_bias = uniform({Hv}, 0.9f, 1.1f);
      g.A_log = uniform({Hv}, 1.0f, 16.0f, DType::F32);
      for (float& v : g.A_log.values) v = std::log(v);  // decay rates A in [1, 16)
      g.norm = uniform({c.linear_value_head_dim}, 1.0f, 1.0f);
    } else {
      const std::string a = p + "self_attn.";
      AttnWeights& t = L.attn;
      t.q_proj = linear(a + "q_proj", 1, 2 * c.attn_q_dim(), H);
      t.k_proj = linear(a + "k_proj", 1, c.attn_kv_dim(), H);
      t.v_proj = linear(a + "v_proj", 1, c.attn_kv_dim(), H);
      t.o_proj = linear(a + "o_proj", 1, H, c.attn_q_dim(), branch_out(c.attn_q_dim()));
      t.q_norm = norm(c.head_dim);
      t.k_norm = norm(c.head_dim);
    }
    const std::string m = p + "mlp.";
    const int64_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
    MoeWeights& moe = L.moe;
    moe.router = linear(m + "gate", 1, E, H, (conditioned_ ? kRouterLogitRms : 1.0f) / std::sqrt(float(H)));
    moe.shared_expert_gate = linear(m + "shared_expert_gate", 1, 1, H);
    moe.shared_gate_proj = linear(m + "shared_expert.gate_proj", 1, Is, H);
    moe.shared_up_proj = linear(m + "shared_expert.up_proj", 1, Is, H);
    moe.shared_down_proj = linear(m + "shared_expert.down_proj", 1, H, Is, branch_out(Is));
    moe.gate_proj = linear(m + "switch_mlp.gate_proj", E, I, H);
    moe.up_proj = linear(m + "switch_mlp.up_proj", E, I, H);
    moe.down_proj = linear(m + "switch_mlp.down_proj", E, H, I, branch_out(I));
  }
};

}  // namespace

std::shared_ptr<ModelWeights> ModelWeights::random(const std::string& config_path, uint64_t seed,
                                                   const std::string& style) {
  if (style != "plain" && style != "conditioned")
    fail("random weights: style must be 'plain' or 'conditioned', got '", style, "'");
  auto w = std::make_shared<ModelWeights>();
  w->config = ModelConfig::from_file(config_path);
  w->source_layout = style == "plain" ? "random" : "random (conditioned)";
  RandomWeights(*w, seed, style == "conditioned").build();
  return w;
}

}  // namespace lily
