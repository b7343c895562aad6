// The checkpoint names lily reads and writes, in one table (docs/MODEL.md §2-3).
//
// weight_table(config) lists every weight of ModelWeights in load order: the field it fills,
// lily's name for it, its shape in config.json's terms, its kind, the MLX quantization it is
// stored in, and where the Hugging Face layout keeps it. stored_tensors() turns a weight into the
// tensors a layout stores. The loader, save_mlx, nbytes, the random weights and lily.synthetic
// (through _lily.checkpoint_tensors) walk this table; no other code spells a checkpoint name.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "safetensors.h"

namespace lily {

struct ModelWeights;
struct QWeight;
struct Dense;

// Mlx: mlx-community's affine 4-bit layout (language_model.model.*, switch_mlp experts, norms
// stored as 1 + w). Hf: Qwen's bf16 layout (model.language_model.*, fused 3-D experts, zero-
// centred norms). HfPerExpert: Hf with experts as mlp.experts.{e}.{gate,up,down}_proj.weight.
// HfText: Hf as a text-only model names it (Qwen3_5MoeForCausalLM: model.*).
enum class Layout { Mlx, Hf, HfPerExpert, HfText };

// What a weight is: how the layouts store it and how random weights draw it.
enum class WeightKind {
  Embedding,    // [V, H]
  Linear,       // a matrix [N, K] or an expert stack [E, N, K]
  Router,       // the MoE router [E, H]
  ResidualOut,  // the output projection of a residual branch (out_proj, o_proj, the down projections)
  Norm,         // a zero-centred RMSNorm weight: the model scales by 1 + w, which MLX stores
  Gain,         // a plain RMSNorm weight (Gated DeltaNet's output norm)
  Conv,         // the depthwise conv1d
  DtBias,
  ALog,         // log decay rates, kept in float32
};
const char* kind_name(WeightKind kind);
// Embedding to ResidualOut: a QWeight in lily, quantized in the MLX layout.
inline bool is_matrix(WeightKind kind) { return kind <= WeightKind::ResidualOut; }

// A dimension: its size, and how config.json's fields give it (for messages).
struct Dim {
  int64_t size;
  std::string name;
};
using Shape = std::vector<Dim>;
std::vector<int64_t> sizes(const Shape& shape);
std::string dims(const Shape& shape);  // "[vocab_size, hidden_size]"

// One weight of ModelWeights.
struct WeightEntry {
  std::string field;   // what it fills: "embed", "final_norm", "layers.3.attn.q_proj", "layers.0.moe.up_proj"
  int64_t layer = -1;  // -1 outside the layers
  WeightKind kind = WeightKind::Linear;
  // lily's name: the checkpoint name under the model prefix, with MLX's switch_mlp for experts;
  // a matrix's module ("layers.3.self_attn.q_proj"), a dense tensor's own ("norm.weight").
  std::string name;
  Shape shape;                // as lily holds it: [N, K], [E, N, K] or a dense tensor's
  DType dtype = DType::BF16;  // its float dtype (F32 for A_log)
  QuantSpec quant;            // a matrix's in the MLX layout: config.json's, else 4-bit (8-bit gates)

  // Hugging Face: the float tensor that holds it (lily's name) and the weight's first row in
  // each expert's block of it (the up projection in experts.gate_up_proj); per expert, an
  // expert stack is the tensors hf_expert_name(e).
  std::string hf_name;
  Shape hf_shape;
  int64_t hf_first_row = 0;
  std::string hf_experts;  // "layers.0.mlp.experts."
  std::string hf_proj;     // "gate_proj"

  QWeight& (*matrix_field)(ModelWeights&, int64_t layer) = nullptr;  // matrices
  Dense& (*dense_field)(ModelWeights&, int64_t layer) = nullptr;     // the others

  bool is_stack() const { return is_matrix(kind) && shape.size() == 3; }
  std::string hf_expert_name(int64_t e) const { return hf_experts + std::to_string(e) + "." + hf_proj + ".weight"; }
  QWeight& matrix(ModelWeights& w) const { return matrix_field(w, layer); }
  const QWeight& matrix(const ModelWeights& w) const;
  Dense& dense(ModelWeights& w) const { return dense_field(w, layer); }
  const Dense& dense(const ModelWeights& w) const;
};

// The `layer` of the MTP head's decoder layer's entries.
constexpr int64_t kMtpLayer = -2;
// Whether a name (lily's, or a checkpoint's under any prefix) is the MTP head's.
bool is_mtp_name(const std::string& name);

// Every weight of a model of config c, in load order (lm_head only when not tied); with_mtp:
// then the MTP head's (MODEL.md §7), after the trunk's.
std::vector<WeightEntry> weight_table(const ModelConfig& c, bool with_mtp = false);

// config.json's default quantization, else 4-bit in groups of 64 (what lily quantizes floats to).
QuantSpec default_quant(const ModelConfig& c);

// How a stored tensor holds its weight: floats, or one part of the MLX affine triple.
enum class Part { Float, Codes, Scales, Biases };
const char* part_name(Part part);
std::string part_tensor(const std::string& module, Part part);  // "<module>.weight", ".scales", ".biases"

// One tensor as a layout stores it.
struct StoredTensor {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  Part part = Part::Float;
  QuantSpec quant;              // of a quantized part
  bool plus_one = false;        // holds 1 + w (MLX's norms)
  int64_t expert = -1;          // HfPerExpert: the expert it holds
  // An expert stack's rows [first, end) of each expert's block of its HF tensor (hf_name), when
  // it holds only those (MLX's switch_mlp, HfPerExpert); first == end: the whole tensor.
  int64_t first_row = 0, end_row = 0;
  std::vector<size_t> weights;  // the table entries it holds (experts.gate_up_proj: gate and up)
};

// The tensors `layout` stores for weight w. MLX quantizes a matrix in `spec` (w.quant, or a
// loaded weight's own), unless, as mlx_lm does, its input size is not a multiple of the group
// size: then it stays a float tensor.
std::vector<StoredTensor> stored_tensors(const WeightEntry& w, Layout layout, const QuantSpec& spec);

// Every tensor of a `layout` checkpoint holding `table`, once each, sorted by name.
std::vector<StoredTensor> checkpoint_tensors(const std::vector<WeightEntry>& table, Layout layout);

// lily's name -> the layout's: the text model's tensors sit under a model prefix, lm_head and
// the MTP head beside it (HF: at the top level, as Qwen ships "mtp.*").
std::string stored_name(Layout layout, const std::string& name);

// A checkpoint name -> lily's name (MLX, HF and HF text-only prefixes; the MTP head's "mtp."
// wherever a layout keeps it); "" for the tensors lily skips (the vision tower); is_mlx is
// set when the name is in the MLX layout.
std::string lily_name(const std::string& checkpoint_name, bool& is_mlx);

// Where `layout` keeps the vision tower, whose tensors lily skips.
const char* vision_prefix(Layout layout);

}  // namespace lily
