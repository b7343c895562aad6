#include "config.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "error.h"
#include "json.h"

namespace lily {
namespace {

// The fields a Reader looked up, and the optional ones it found absent (their default used).
struct Consulted {
  std::set<std::string> read;
  std::vector<std::string> defaulted;
};

struct Reader {
  const Json& obj;
  const std::string& path;
  std::string scope;  // "text_config." or ""
  Consulted* seen = nullptr;

  [[noreturn]] void bad(const std::string& field, const std::string& why) const {
    fail(path, ": field '", scope, field, "' ", why);
  }
  const Json* get(const char* field) const {
    if (seen) seen->read.insert(field);
    return obj.find(field);
  }
  void defaulted(const char* field) const {
    if (seen) seen->defaulted.push_back(field);
  }

  int64_t integer(const char* field, int64_t min_value, const int64_t* fallback = nullptr) const {
    const Json* v = get(field);
    if (!v || v->is_null()) {
      if (fallback) {
        defaulted(field);
        return *fallback;
      }
      bad(field, "is missing");
    }
    if (!v->is_integer()) bad(field, "must be an integer");
    if (v->as_int() < min_value) bad(field, "must be >= " + std::to_string(min_value) + ", got " + std::to_string(v->as_int()));
    return v->as_int();
  }
  double number(const char* field, double fallback) const {
    const Json* v = get(field);
    if (!v || v->is_null()) {
      defaulted(field);
      return fallback;
    }
    if (!v->is_number()) bad(field, "must be a number");
    return v->as_number();
  }
  bool boolean(const char* field, bool fallback) const {
    const Json* v = get(field);
    if (!v || v->is_null()) {
      defaulted(field);
      return fallback;
    }
    if (!v->is_bool()) bad(field, "must be true or false");
    return v->as_bool();
  }
};

void add_ids(const Json* v, std::vector<int64_t>& out, const Reader& r, const char* field) {
  if (!v || v->is_null()) return;
  auto add = [&](const Json& x) {
    if (!x.is_integer() || x.as_int() < 0) r.bad(field, "must be a token id or a list of token ids");
    for (int64_t id : out)
      if (id == x.as_int()) return;
    out.push_back(x.as_int());
  };
  if (v->is_array()) for (const Json& x : v->items()) add(x);
  else add(*v);
}

QuantSpec read_quant_spec(const Json& q, const std::string& path, const std::string& where,
                          const QuantSpec& fallback) {
  QuantSpec s = fallback;
  if (const Json* g = q.find("group_size")) {
    if (!g->is_integer() || g->as_int() <= 0) fail(path, ": field '", where, ".group_size' must be a positive integer");
    s.group_size = static_cast<int>(g->as_int());
  }
  if (const Json* b = q.find("bits")) {
    if (!b->is_integer()) fail(path, ": field '", where, ".bits' must be an integer");
    s.bits = static_cast<int>(b->as_int());
  }
  if (const Json* m = q.find("mode")) {
    if (!m->is_string() || m->as_string() != "affine")
      fail(path, ": field '", where, ".mode' is '", m->is_string() ? m->as_string() : "?",
           "'; lily reads only the MLX affine quantization mode");
  }
  if (s.bits != 4 && s.bits != 8)
    fail(path, ": field '", where, ".bits' is ", std::to_string(s.bits), "; lily supports 4 and 8 bits");
  if (s.group_size != 32 && s.group_size != 64 && s.group_size != 128)
    fail(path, ": field '", where, ".group_size' is ", std::to_string(s.group_size), "; lily supports 32, 64 and 128");
  return s;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// A field lily does not read that looks like a misspelt optional one left at its default
// ("rms_norm_epsilon" for "rms_norm_eps"): a typo there would change the model silently.
std::vector<std::string> typo_warnings(const Json& obj, const Reader& r, const Consulted& seen) {
  std::vector<std::string> out;
  for (const auto& [key, value] : obj.members()) {
    if (seen.read.count(key)) continue;
    for (const std::string& field : seen.defaulted) {
      const bool prefix = std::min(key.size(), field.size()) >= 6 &&
                          (key.rfind(field, 0) == 0 || field.rfind(key, 0) == 0);
      if (prefix || (key.size() >= 6 && edit_distance(key, field) <= 2)) {
        out.push_back(r.path + ": field '" + r.scope + key + "' is not one lily reads; did you mean '" + field +
                      "'? (it is not set, so lily uses its default)");
        break;
      }
    }
  }
  return out;
}

}  // namespace

int ModelConfig::num_full_layers() const {
  int n = 0;
  for (LayerKind k : layer_kinds) n += k == LayerKind::Full;
  return n;
}
int ModelConfig::num_linear_layers() const {
  return static_cast<int>(layer_kinds.size()) - num_full_layers();
}

ModelConfig ModelConfig::from_json(const Json& root, const std::string& path) {
  if (!root.is_object()) fail(path, ": the config must be a JSON object");
  ModelConfig c;
  const Json* mt = root.find("model_type");
  if (!mt || !mt->is_string()) fail(path, ": field 'model_type' is missing");
  c.model_type = mt->as_string();
  const Json* text = root.find("text_config");
  if (text && !text->is_object()) fail(path, ": field 'text_config' must be an object");
  const Json& t = text ? *text : root;
  if (c.model_type != "qwen3_5_moe" && c.model_type != "qwen3_5_moe_text")
    fail(path, ": field 'model_type' is '", c.model_type,
         "'; lily runs the qwen3_5_moe family (Qwen3.5/3.6 hybrid MoE) only");
  if (text) {
    if (const Json* tm = t.find("model_type"); tm && tm->is_string() && tm->as_string() != "qwen3_5_moe_text" &&
                                                 tm->as_string() != "qwen3_5_moe")
      fail(path, ": field 'text_config.model_type' is '", tm->as_string(), "'; expected 'qwen3_5_moe_text'");
  }
  Consulted seen;
  for (const char* field : {"model_type", "text_config", "quantization", "quantization_config"})
    seen.read.insert(field);  // read from the root
  Reader r{t, path, text ? "text_config." : "", &seen};

  c.hidden_size = r.integer("hidden_size", 1);
  c.num_hidden_layers = r.integer("num_hidden_layers", 1);
  c.vocab_size = r.integer("vocab_size", 1);
  c.rms_norm_eps = static_cast<float>(r.number("rms_norm_eps", 1e-6));
  if (!(c.rms_norm_eps > 0)) r.bad("rms_norm_eps", "must be positive");
  bool tie_top = Reader{root, path, ""}.boolean("tie_word_embeddings", false);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", tie_top);

  c.num_attention_heads = r.integer("num_attention_heads", 1);
  c.num_key_value_heads = r.integer("num_key_value_heads", 1);
  int64_t default_head_dim = c.hidden_size / c.num_attention_heads;
  c.head_dim = r.integer("head_dim", 2, &default_head_dim);
  if (c.num_attention_heads % c.num_key_value_heads)
    r.bad("num_key_value_heads", "must divide num_attention_heads (" + std::to_string(c.num_attention_heads) + ")");
  int64_t default_max_pos = 262144;
  c.max_position_embeddings = r.integer("max_position_embeddings", 1, &default_max_pos);

  // RoPE: rope_parameters (new style) or top-level rope_theta / partial_rotary_factor.
  c.rope_theta = r.number("rope_theta", 1e7);
  c.partial_rotary_factor = r.number("partial_rotary_factor", 0.25);
  if (const Json* rp = r.get("rope_parameters"); rp && !rp->is_null()) {
    if (!rp->is_object()) r.bad("rope_parameters", "must be an object");
    Reader rr{*rp, path, r.scope + "rope_parameters."};
    const Json* type = rp->find("rope_type");
    if (!type) type = rp->find("type");
    if (type && (!type->is_string() || type->as_string() != "default"))
      rr.bad("rope_type", "is '" + (type->is_string() ? type->as_string() : std::string("?")) +
                              "'; lily implements the default (unscaled) RoPE only");
    c.rope_theta = rr.number("rope_theta", c.rope_theta);
    c.partial_rotary_factor = rr.number("partial_rotary_factor", c.partial_rotary_factor);
  }
  if (!(c.rope_theta > 1)) r.bad("rope_theta", "must be > 1");
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
    r.bad("partial_rotary_factor", "must be in (0, 1]");
  if (c.rotary_dim() < 2 || c.rotary_dim() % 2)
    r.bad("partial_rotary_factor", "gives an odd or empty rotary dimension (head_dim * factor = " +
                                       std::to_string(c.rotary_dim()) + ")");

  c.linear_num_key_heads = r.integer("linear_num_key_heads", 1);
  c.linear_key_head_dim = r.integer("linear_key_head_dim", 1);
  c.linear_num_value_heads = r.integer("linear_num_value_heads", 1);
  c.linear_value_head_dim = r.integer("linear_value_head_dim", 1);
  int64_t default_conv = 4;
  c.linear_conv_kernel_dim = r.integer("linear_conv_kernel_dim", 1, &default_conv);
  if (c.linear_num_value_heads % c.linear_num_key_heads)
    r.bad("linear_num_value_heads", "must be a multiple of linear_num_key_heads");

  c.num_experts = r.integer("num_experts", 1);
  c.num_experts_per_tok = r.integer("num_experts_per_tok", 1);
  if (c.num_experts_per_tok > c.num_experts)
    r.bad("num_experts_per_tok", "must not exceed num_experts (" + std::to_string(c.num_experts) + ")");
  c.moe_intermediate_size = r.integer("moe_intermediate_size", 1);
  c.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size", 1);
  c.norm_topk_prob = r.boolean("norm_topk_prob", true);

  // Layer kinds: layer_types wins; else every full_attention_interval-th layer is full.
  if (const Json* lt = r.get("layer_types"); lt && !lt->is_null()) {
    if (!lt->is_array() || static_cast<int64_t>(lt->items().size()) != c.num_hidden_layers)
      r.bad("layer_types", "must be a list of num_hidden_layers (" + std::to_string(c.num_hidden_layers) + ") entries");
    for (const Json& k : lt->items()) {
      if (k.is_string() && k.as_string() == "linear_attention") c.layer_kinds.push_back(LayerKind::Linear);
      else if (k.is_string() && k.as_string() == "full_attention") c.layer_kinds.push_back(LayerKind::Full);
      else r.bad("layer_types", "entries must be 'linear_attention' or 'full_attention'");
    }
  } else {
    int64_t default_interval = 4;
    int64_t interval = r.integer("full_attention_interval", 1, &default_interval);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_kinds.push_back((i + 1) % interval == 0 ? LayerKind::Full : LayerKind::Linear);
  }

  add_ids(r.get("eos_token_id"), c.eos_token_ids, r, "eos_token_id");
  add_ids(root.find("eos_token_id"), c.eos_token_ids, Reader{root, path, ""}, "eos_token_id");
  if (const Json* b = r.get("bos_token_id"); b && b->is_integer()) c.bos_token_id = b->as_int();

  const Json* q = root.find("quantization");
  if (!q || q->is_null()) q = root.find("quantization_config");
  if (q && !q->is_null()) {
    if (!q->is_object()) fail(path, ": field 'quantization' must be an object");
    c.quantized = true;
    c.quant = read_quant_spec(*q, path, "quantization", QuantSpec{});
    for (const auto& [key, value] : q->members()) {
      if (key == "group_size" || key == "bits" || key == "mode" || key == "quant_method") continue;
      if (value.is_object()) c.quant_overrides[key] = read_quant_spec(value, path, "quantization." + key, c.quant);
      else if (!value.is_bool()) fail(path, ": field 'quantization.", key, "' must be an object or a boolean");
    }
  }
  c.warnings = typo_warnings(t, r, seen);
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open the config file");
  std::stringstream ss;
  ss << f.rdbuf();
  return from_json(Json::parse(ss.str(), path), path);
}

}  // namespace lily
