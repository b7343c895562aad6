// Model configuration of the qwen3_5_moe family, read from config.json.
// Field names mirror config.json; validation is strict and names the field.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lily {

class Json;

enum class LayerKind { Linear, Full };  // Gated DeltaNet / gated full attention

struct QuantSpec {
  int group_size = 64;
  int bits = 4;
};

struct ModelConfig {
  std::string model_type;  // top-level model_type as found
  int64_t hidden_size = 0;             // H
  int64_t num_hidden_layers = 0;
  int64_t vocab_size = 0;
  std::vector<LayerKind> layer_kinds;  // from layer_types or full_attention_interval
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;

  // Gated full attention.
  int64_t num_attention_heads = 0;  // Hq
  int64_t num_key_value_heads = 0;  // Hkv
  int64_t head_dim = 0;             // D
  double rope_theta = 1e7;
  double partial_rotary_factor = 0.25;
  int64_t max_position_embeddings = 0;

  // Gated DeltaNet.
  int64_t linear_num_key_heads = 0;    // Hk
  int64_t linear_key_head_dim = 0;     // Dk
  int64_t linear_num_value_heads = 0;  // Hv
  int64_t linear_value_head_dim = 0;   // Dv
  int64_t linear_conv_kernel_dim = 0;  // Kc

  // Mixture of experts.
  int64_t num_experts = 0;                      // E
  int64_t num_experts_per_tok = 0;              // K
  int64_t moe_intermediate_size = 0;            // I
  int64_t shared_expert_intermediate_size = 0;  // Is
  bool norm_topk_prob = true;

  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;

  // Quantization block (MLX affine); absent for bf16 checkpoints.
  bool quantized = false;
  QuantSpec quant;                             // default spec
  std::map<std::string, QuantSpec> quant_overrides;  // module path -> spec

  std::vector<std::string> warnings;  // fields that look like misspelt optional ones

  static ModelConfig from_json(const Json& root, const std::string& path);
  static ModelConfig from_file(const std::string& path);

  // Derived sizes.
  int64_t rotary_dim() const { return static_cast<int64_t>(head_dim * partial_rotary_factor); }
  int64_t gdn_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t gdn_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t gdn_conv_dim() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
  int64_t attn_q_dim() const { return num_attention_heads * head_dim; }
  int64_t attn_kv_dim() const { return num_key_value_heads * head_dim; }
  int num_full_layers() const;
  int num_linear_layers() const;
};

}  // namespace lily
