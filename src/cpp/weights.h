// The model's weights in lily's names, in the MLX affine format.
//
// Checkpoints in either layout lily reads (checkpoint_names.h: MLX 4-bit, or Hugging Face bf16
// with fused or per-expert experts) load into this one representation: float weights are
// quantized at load to the MLX format, so every executor sees the same.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "safetensors.h"

namespace lily {

// An MLX affine-quantized matrix [rows, cols], or a stack of them [experts, rows, cols].
struct QWeight {
  const uint32_t* codes = nullptr;   // [experts, rows, cols*bits/32]
  const uint16_t* scales = nullptr;  // bf16 [experts, rows, cols/group_size]
  const uint16_t* biases = nullptr;  // bf16, same shape as scales
  int64_t experts = 1, rows = 0, cols = 0;
  int group_size = 64, bits = 4;

  int64_t words_per_row() const { return cols * bits / 32; }
  int64_t groups_per_row() const { return cols / group_size; }
  QWeight expert(int64_t e) const;  // one matrix of a stack
  size_t nbytes() const;            // codes + scales + biases
};

// A small float tensor (norms, conv, gates); values are exactly representable in
// `dtype`, which is how it is written back by `lily convert`.
struct Dense {
  std::vector<float> values;
  std::vector<int64_t> shape;
  DType dtype = DType::BF16;
};

struct GdnWeights {
  QWeight in_proj_qkv;  // [conv_dim, H]: rows q | k | v
  QWeight in_proj_z;    // [Hv*Dv, H]
  QWeight in_proj_b;    // [Hv, H]
  QWeight in_proj_a;    // [Hv, H]
  QWeight out_proj;     // [H, Hv*Dv]
  Dense conv1d;         // [conv_dim, Kc] (tap Kc-1 multiplies the current token)
  Dense dt_bias;        // [Hv]
  Dense A_log;          // [Hv]
  Dense norm;           // [Dv], plain weight (not zero-centred)
};

struct AttnWeights {
  QWeight q_proj;  // [Hq*2*D, H]: per head, D query rows then D gate rows
  QWeight k_proj;  // [Hkv*D, H]
  QWeight v_proj;  // [Hkv*D, H]
  QWeight o_proj;  // [H, Hq*D]
  Dense q_norm;    // [D], 1 + w
  Dense k_norm;    // [D], 1 + w
};

struct MoeWeights {
  QWeight router;              // [E, H]
  QWeight gate_proj, up_proj;  // [E, I, H]
  QWeight down_proj;           // [E, H, I]
  QWeight shared_gate_proj;    // [Is, H]
  QWeight shared_up_proj;      // [Is, H]
  QWeight shared_down_proj;    // [H, Is]
  QWeight shared_expert_gate;  // [1, H]
};

struct LayerWeights {
  LayerKind kind = LayerKind::Linear;
  Dense input_norm;  // [H], 1 + w
  Dense post_norm;   // [H], 1 + w
  GdnWeights gdn;    // when kind == Linear
  AttnWeights attn;  // when kind == Full
  MoeWeights moe;
};

// The multi-token-prediction head (MODEL.md §7), when a checkpoint carries one: it drafts
// the token after next from the trunk's normed hidden state and the next token's embedding.
struct MtpWeights {
  QWeight fc;                   // [H, 2H]: the embedding half of the input first
  Dense pre_fc_norm_embedding;  // [H], 1 + w
  Dense pre_fc_norm_hidden;     // [H], 1 + w
  Dense norm;                   // [H], 1 + w: before the trunk's lm_head
  LayerWeights layer{.kind = LayerKind::Full};  // a full-attention decoder layer with its MoE block
};

struct ModelWeights {
  ModelConfig config;
  std::string source_layout;  // "mlx", "hf", "random" or "random (conditioned)"
  QWeight embed;              // [V, H]
  QWeight lm_head;            // [V, H]; the embedding when tie_word_embeddings
  Dense final_norm;           // [H], 1 + w
  std::vector<LayerWeights> layers;
  bool has_mtp = false;  // the checkpoint's MTP head is loaded into mtp
  MtpWeights mtp;

  // Loads config.json and the safetensors of `dir`; every tensor is checked and every
  // unconsumed tensor is an error. Float weights are quantized in the spec config.json's
  // quantization block gives, else 4-bit (8-bit router and shared-expert gate), group 64.
  static std::shared_ptr<ModelWeights> load(const std::string& dir);

  // Random weights for a config (benchmarks at full size without a 19 GB file):
  // random 4-bit codes with bf16 scales and biases chosen so activations stay finite.
  // config_path is a config.json; the weights come from `seed` alone.
  // style "plain" gives every matrix spread 1/sqrt(fan_in); "conditioned" shapes them like
  // a trained model's (confident router, depth-scaled residual branches: weights_random.cpp).
  // with_mtp: an MTP head too (drawn after the trunk, whose weights it leaves unchanged).
  static std::shared_ptr<ModelWeights> random(const std::string& config_path, uint64_t seed,
                                              const std::string& style = "plain", bool with_mtp = false);

  // Writes the weights as an MLX affine checkpoint (the tensors mlx_lm.convert writes); with
  // keep_mtp the MTP head too, in a file of its own (model-mtp.safetensors), so the trunk's
  // files are what they would be without it.
  void save_mlx(const std::string& out_dir, int64_t max_shard_bytes, bool keep_mtp = false) const;

  size_t nbytes() const;

  std::shared_ptr<Checkpoint> checkpoint;  // keeps the mapped files alive
  std::vector<std::unique_ptr<uint8_t[]>> owned;  // buffers of weights quantized at load
};

}  // namespace lily
