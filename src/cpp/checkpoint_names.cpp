#include "checkpoint_names.h"

#include <algorithm>
#include <map>

#include "weights.h"

namespace lily {

namespace {

constexpr QuantSpec kFloatQuant{64, 4};  // what lily quantizes float checkpoints to
constexpr QuantSpec kGateQuant{64, 8};   // the router and shared-expert gate, as mlx_lm quantizes them

// Prefixes: MLX's text model and lm_head, HF's, and a text-only HF checkpoint's (Qwen3_5MoeForCausalLM).
const std::string kMlxModel = "language_model.model.", kMlxBeside = "language_model.";
const std::string kHfModel = "model.language_model.", kHfTextOnly = "model.";
const std::string kLmHead = "lm_head";
const std::string kMtp = "mtp.", kMlxVision = "vision_tower.", kHfVision = "model.visual.";
// Every prefix of a tensor lily skips: the vision tower (as mlx-vlm, Qwen and a bare save name it).
const std::string kSkipped[] = {kMlxVision, kHfVision, "visual."};

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The spec config.json gives `module` (lily's name): an override whose key names it, else the
// block's default; without a quantization block, `fallback`.
QuantSpec mlx_spec(const ModelConfig& c, const std::string& module, const QuantSpec& fallback) {
  // "mtp.layers.0.mlp.gate" ends like "layers.0.mlp.gate": the head's keys name only its modules.
  for (const auto& [key, spec] : c.quant_overrides)
    if ((key == module || ends_with(key, "." + module)) && is_mtp_name(key) == is_mtp_name(module)) return spec;
  return c.quantized ? c.quant : fallback;
}

// Pointers to the field a weight fills, one function per field, for the table to hold.
template <auto Member>
auto& model_field(ModelWeights& w, int64_t) { return w.*Member; }
template <auto Member>
auto& mtp_field(ModelWeights& w, int64_t) { return w.mtp.*Member; }
LayerWeights& layer_at(ModelWeights& w, int64_t layer) { return layer == kMtpLayer ? w.mtp.layer : w.layers[layer]; }
template <auto Member>
auto& layer_field(ModelWeights& w, int64_t layer) { return layer_at(w, layer).*Member; }
template <auto Block, auto Member>
auto& block_field(ModelWeights& w, int64_t layer) { return layer_at(w, layer).*Block.*Member; }

using MatrixField = QWeight& (*)(ModelWeights&, int64_t);
using DenseField = Dense& (*)(ModelWeights&, int64_t);
using L = LayerWeights;
using G = GdnWeights;
using A = AttnWeights;
using M = MoeWeights;

// Appends table entries; inside a layer, fields and names get the layer's prefix.
class TableBuilder {
 public:
  TableBuilder(const ModelConfig& c, std::vector<WeightEntry>& table) : c_(c), table_(table) {}

  void begin_layer(int64_t i) {
    layer_ = i;
    prefix_ = "layers." + std::to_string(i) + ".";
  }
  // The MTP head's tensors ("mtp."), then its decoder layer ("mtp.layers.0.").
  void begin_mtp() { prefix_ = kMtp; }
  void begin_mtp_layer() {
    layer_ = kMtpLayer;
    prefix_ = kMtp + "layers.0.";
  }

  void matrix(WeightKind kind, const std::string& field, const std::string& name, Shape shape, MatrixField f,
              const QuantSpec& fallback = kFloatQuant) {
    WeightEntry& w = add(kind, field, name, std::move(shape));
    w.matrix_field = f;
    w.quant = mlx_spec(c_, w.name, fallback);
    w.hf_name = w.name + ".weight";
    w.hf_shape = w.shape;
  }

  // An expert stack: MLX's switch_mlp.<proj>; HF's rows [first_row, first_row + N) of each
  // expert's block of experts.<fused>, or experts.{e}.<proj>.weight.
  void experts(WeightKind kind, const std::string& field, const std::string& proj, Shape shape, MatrixField f,
               const std::string& fused, Shape fused_shape, int64_t first_row) {
    matrix(kind, field, "mlp.switch_mlp." + proj, std::move(shape), f);
    WeightEntry& w = table_.back();
    w.hf_experts = prefix_ + "mlp.experts.";
    w.hf_proj = proj;
    w.hf_name = w.hf_experts + fused;
    w.hf_shape = std::move(fused_shape);
    w.hf_first_row = first_row;
  }

  // hf_shape: where HF's differs (conv1d's [C, 1, Kc]: the same memory order).
  void dense(WeightKind kind, const std::string& field, const std::string& name, Shape shape, DenseField f,
             DType dtype = DType::BF16, Shape hf_shape = {}) {
    WeightEntry& w = add(kind, field, name, std::move(shape));
    w.dense_field = f;
    w.dtype = dtype;
    w.hf_name = w.name;
    w.hf_shape = hf_shape.empty() ? w.shape : std::move(hf_shape);
  }

 private:
  const ModelConfig& c_;
  std::vector<WeightEntry>& table_;
  int64_t layer_ = -1;
  std::string prefix_;

  WeightEntry& add(WeightKind kind, const std::string& field, const std::string& name, Shape shape) {
    WeightEntry& w = table_.emplace_back();
    w.field = prefix_ + field;
    w.layer = layer_;
    w.kind = kind;
    w.name = prefix_ + name;
    w.shape = std::move(shape);
    return w;
  }
};

Dim hidden(const ModelConfig& c) { return {c.hidden_size, "hidden_size"}; }

void add_gdn(TableBuilder& t, const ModelConfig& c) {
  const std::string value_name = "linear_num_value_heads * linear_value_head_dim";
  const Dim H = hidden(c), value{c.gdn_value_dim(), value_name},
            conv{c.gdn_conv_dim(), "2 * linear_num_key_heads * linear_key_head_dim + " + value_name},
            Hv{c.linear_num_value_heads, "linear_num_value_heads"},
            Kc{c.linear_conv_kernel_dim, "linear_conv_kernel_dim"}, one{1, "1"};
  using K = WeightKind;
  t.matrix(K::Linear, "gdn.in_proj_qkv", "linear_attn.in_proj_qkv", {conv, H}, &block_field<&L::gdn, &G::in_proj_qkv>);
  t.matrix(K::Linear, "gdn.in_proj_z", "linear_attn.in_proj_z", {value, H}, &block_field<&L::gdn, &G::in_proj_z>);
  t.matrix(K::Linear, "gdn.in_proj_b", "linear_attn.in_proj_b", {Hv, H}, &block_field<&L::gdn, &G::in_proj_b>);
  t.matrix(K::Linear, "gdn.in_proj_a", "linear_attn.in_proj_a", {Hv, H}, &block_field<&L::gdn, &G::in_proj_a>);
  t.matrix(K::ResidualOut, "gdn.out_proj", "linear_attn.out_proj", {H, value}, &block_field<&L::gdn, &G::out_proj>);
  t.dense(K::Conv, "gdn.conv1d", "linear_attn.conv1d.weight", {conv, Kc, one}, &block_field<&L::gdn, &G::conv1d>,
          DType::BF16, {conv, one, Kc});
  t.dense(K::DtBias, "gdn.dt_bias", "linear_attn.dt_bias", {Hv}, &block_field<&L::gdn, &G::dt_bias>);
  t.dense(K::ALog, "gdn.A_log", "linear_attn.A_log", {Hv}, &block_field<&L::gdn, &G::A_log>, DType::F32);
  t.dense(K::Gain, "gdn.norm", "linear_attn.norm.weight", {{c.linear_value_head_dim, "linear_value_head_dim"}},
          &block_field<&L::gdn, &G::norm>);
}

void add_attention(TableBuilder& t, const ModelConfig& c) {
  const Dim H = hidden(c), q{c.attn_q_dim(), "num_attention_heads * head_dim"},
            q_and_gate{2 * c.attn_q_dim(), "2 * num_attention_heads * head_dim"},
            kv{c.attn_kv_dim(), "num_key_value_heads * head_dim"}, D{c.head_dim, "head_dim"};
  using K = WeightKind;
  t.matrix(K::Linear, "attn.q_proj", "self_attn.q_proj", {q_and_gate, H}, &block_field<&L::attn, &A::q_proj>);
  t.matrix(K::Linear, "attn.k_proj", "self_attn.k_proj", {kv, H}, &block_field<&L::attn, &A::k_proj>);
  t.matrix(K::Linear, "attn.v_proj", "self_attn.v_proj", {kv, H}, &block_field<&L::attn, &A::v_proj>);
  t.matrix(K::ResidualOut, "attn.o_proj", "self_attn.o_proj", {H, q}, &block_field<&L::attn, &A::o_proj>);
  t.dense(K::Norm, "attn.q_norm", "self_attn.q_norm.weight", {D}, &block_field<&L::attn, &A::q_norm>);
  t.dense(K::Norm, "attn.k_norm", "self_attn.k_norm.weight", {D}, &block_field<&L::attn, &A::k_norm>);
}

void add_moe(TableBuilder& t, const ModelConfig& c) {
  const Dim H = hidden(c), E{c.num_experts, "num_experts"}, I{c.moe_intermediate_size, "moe_intermediate_size"},
            gate_up{2 * c.moe_intermediate_size, "2 * moe_intermediate_size"},
            Is{c.shared_expert_intermediate_size, "shared_expert_intermediate_size"}, one{1, "1"};
  using K = WeightKind;
  t.matrix(K::Router, "moe.router", "mlp.gate", {E, H}, &block_field<&L::moe, &M::router>, kGateQuant);
  t.matrix(K::Linear, "moe.shared_expert_gate", "mlp.shared_expert_gate", {one, H},
           &block_field<&L::moe, &M::shared_expert_gate>, kGateQuant);
  t.matrix(K::Linear, "moe.shared_gate_proj", "mlp.shared_expert.gate_proj", {Is, H},
           &block_field<&L::moe, &M::shared_gate_proj>);
  t.matrix(K::Linear, "moe.shared_up_proj", "mlp.shared_expert.up_proj", {Is, H},
           &block_field<&L::moe, &M::shared_up_proj>);
  t.matrix(K::ResidualOut, "moe.shared_down_proj", "mlp.shared_expert.down_proj", {H, Is},
           &block_field<&L::moe, &M::shared_down_proj>);
  t.experts(K::Linear, "moe.gate_proj", "gate_proj", {E, I, H}, &block_field<&L::moe, &M::gate_proj>, "gate_up_proj",
            {E, gate_up, H}, 0);
  t.experts(K::Linear, "moe.up_proj", "up_proj", {E, I, H}, &block_field<&L::moe, &M::up_proj>, "gate_up_proj",
            {E, gate_up, H}, c.moe_intermediate_size);
  t.experts(K::ResidualOut, "moe.down_proj", "down_proj", {E, H, I}, &block_field<&L::moe, &M::down_proj>,
            "down_proj", {E, H, I}, 0);
}

}  // namespace

const char* kind_name(WeightKind kind) {
  switch (kind) {
    case WeightKind::Embedding: return "embedding";
    case WeightKind::Linear: return "linear";
    case WeightKind::Router: return "router";
    case WeightKind::ResidualOut: return "residual_out";
    case WeightKind::Norm: return "norm";
    case WeightKind::Gain: return "gain";
    case WeightKind::Conv: return "conv";
    case WeightKind::DtBias: return "dt_bias";
    case WeightKind::ALog: return "A_log";
  }
  return "?";
}

std::vector<int64_t> sizes(const Shape& shape) {
  std::vector<int64_t> out;
  for (const Dim& d : shape) out.push_back(d.size);
  return out;
}

std::string dims(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i].name;
  return s + "]";
}

// Reading a field through the non-const accessor changes nothing.
const QWeight& WeightEntry::matrix(const ModelWeights& w) const { return matrix(const_cast<ModelWeights&>(w)); }
const Dense& WeightEntry::dense(const ModelWeights& w) const { return dense(const_cast<ModelWeights&>(w)); }

std::vector<WeightEntry> weight_table(const ModelConfig& c, bool with_mtp) {
  std::vector<WeightEntry> table;
  TableBuilder t(c, table);
  const Dim H = hidden(c), V{c.vocab_size, "vocab_size"};
  t.matrix(WeightKind::Embedding, "embed", "embed_tokens", {V, H}, &model_field<&ModelWeights::embed>);
  if (!c.tie_word_embeddings)  // tied: lm_head is the embedding
    t.matrix(WeightKind::Linear, "lm_head", kLmHead, {V, H}, &model_field<&ModelWeights::lm_head>);
  t.dense(WeightKind::Norm, "final_norm", "norm.weight", {H}, &model_field<&ModelWeights::final_norm>);
  auto layer_norms = [&] {
    t.dense(WeightKind::Norm, "input_norm", "input_layernorm.weight", {H}, &layer_field<&L::input_norm>);
    t.dense(WeightKind::Norm, "post_norm", "post_attention_layernorm.weight", {H}, &layer_field<&L::post_norm>);
  };
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    t.begin_layer(i);
    layer_norms();
    if (c.layer_kinds[i] == LayerKind::Linear) add_gdn(t, c);
    else add_attention(t, c);
    add_moe(t, c);
  }
  if (!with_mtp) return table;
  using Mt = MtpWeights;
  t.begin_mtp();
  t.matrix(WeightKind::Linear, "fc", "fc", {H, {2 * c.hidden_size, "2 * hidden_size"}}, &mtp_field<&Mt::fc>);
  t.dense(WeightKind::Norm, "pre_fc_norm_embedding", "pre_fc_norm_embedding.weight", {H},
          &mtp_field<&Mt::pre_fc_norm_embedding>);
  t.dense(WeightKind::Norm, "pre_fc_norm_hidden", "pre_fc_norm_hidden.weight", {H}, &mtp_field<&Mt::pre_fc_norm_hidden>);
  t.dense(WeightKind::Norm, "norm", "norm.weight", {H}, &mtp_field<&Mt::norm>);
  t.begin_mtp_layer();
  layer_norms();
  add_attention(t, c);
  add_moe(t, c);
  return table;
}

QuantSpec default_quant(const ModelConfig& c) { return c.quantized ? c.quant : kFloatQuant; }

const char* part_name(Part part) {
  switch (part) {
    case Part::Float: return "float";
    case Part::Codes: return "codes";
    case Part::Scales: return "scales";
    case Part::Biases: return "biases";
  }
  return "?";
}

std::string part_tensor(const std::string& module, Part part) {
  switch (part) {
    case Part::Scales: return module + ".scales";
    case Part::Biases: return module + ".biases";
    default: return module + ".weight";  // the codes, or the float matrix
  }
}

std::vector<StoredTensor> stored_tensors(const WeightEntry& w, Layout layout, const QuantSpec& spec) {
  auto tensor = [&](const std::string& name, std::vector<int64_t> shape) {
    StoredTensor t;
    t.name = stored_name(layout, name);
    t.dtype = w.dtype;
    t.shape = std::move(shape);
    if (w.is_stack() && (layout == Layout::Mlx || layout == Layout::HfPerExpert)) {
      t.first_row = w.hf_first_row;
      t.end_row = w.hf_first_row + w.shape[1].size;
    }
    return t;
  };
  if (layout == Layout::Mlx) {
    const int64_t K = w.shape.back().size;
    if (!is_matrix(w.kind) || K % spec.group_size) {
      StoredTensor t = tensor(is_matrix(w.kind) ? part_tensor(w.name, Part::Float) : w.name, sizes(w.shape));
      t.plus_one = w.kind == WeightKind::Norm;
      return {t};
    }
    std::vector<StoredTensor> out;
    for (Part part : {Part::Codes, Part::Scales, Part::Biases}) {
      std::vector<int64_t> shape = sizes(w.shape);
      shape.back() = part == Part::Codes ? K * spec.bits / 32 : K / spec.group_size;
      StoredTensor& t = out.emplace_back(tensor(part_tensor(w.name, part), std::move(shape)));
      t.dtype = part == Part::Codes ? DType::U32 : DType::BF16;
      t.part = part;
      t.quant = spec;
    }
    return out;
  }
  if (layout != Layout::HfPerExpert || !w.is_stack()) return {tensor(w.hf_name, sizes(w.hf_shape))};
  std::vector<StoredTensor> out;
  const std::vector<int64_t> one = {w.shape[1].size, w.shape[2].size};
  for (int64_t e = 0; e < w.shape[0].size; ++e) {
    out.push_back(tensor(w.hf_expert_name(e), one));
    out.back().expert = e;
  }
  return out;
}

std::vector<StoredTensor> checkpoint_tensors(const std::vector<WeightEntry>& table, Layout layout) {
  std::map<std::string, StoredTensor> by_name;
  for (size_t i = 0; i < table.size(); ++i)
    for (StoredTensor& t : stored_tensors(table[i], layout, table[i].quant)) {
      const std::string name = t.name;
      by_name.try_emplace(name, std::move(t)).first->second.weights.push_back(i);
    }
  std::vector<StoredTensor> out;
  for (auto& [name, t] : by_name) out.push_back(std::move(t));
  return out;
}

std::string stored_name(Layout layout, const std::string& name) {
  const bool beside = starts_with(name, kLmHead) || starts_with(name, kMtp);
  if (layout == Layout::Mlx) return (beside ? kMlxBeside : kMlxModel) + name;
  return beside ? name : (layout == Layout::HfText ? kHfTextOnly : kHfModel) + name;
}

std::string lily_name(const std::string& name, bool& is_mlx) {
  for (const std::string& skipped : kSkipped)
    if (starts_with(name, skipped)) return "";
  std::string rest;
  if (starts_with(name, kMlxModel)) { is_mlx = true; rest = name.substr(kMlxModel.size()); }
  else if (starts_with(name, kMlxBeside + kLmHead + ".") || starts_with(name, kMlxBeside + kMtp)) {
    is_mlx = true;
    rest = name.substr(kMlxBeside.size());
  }
  else if (starts_with(name, kHfModel)) rest = name.substr(kHfModel.size());
  else if (starts_with(name, kHfTextOnly)) rest = name.substr(kHfTextOnly.size());
  else return name;  // lm_head.*, mtp.*, or unknown: kept, so that it is reported as unexpected
  return rest;
}

bool is_mtp_name(const std::string& name) { return starts_with(name, kMtp) || name.find("." + kMtp) != std::string::npos; }

const char* vision_prefix(Layout layout) { return layout == Layout::Mlx ? kMlxVision.c_str() : kHfVision.c_str(); }

}  // namespace lily
