#include "weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "bf16.h"
#include "error.h"
#include "quant.h"

namespace lily {

namespace fs = std::filesystem;

QWeight QWeight::expert(int64_t e) const {
  QWeight q = *this;
  q.experts = 1;
  q.codes += e * rows * words_per_row();
  q.scales += e * rows * groups_per_row();
  q.biases += e * rows * groups_per_row();
  return q;
}

size_t QWeight::nbytes() const {
  return static_cast<size_t>(experts * rows) * (words_per_row() * 4 + groups_per_row() * 4);
}

namespace {

// A quantized matrix's shape: E experts (0: a plain matrix) of N x K in spec s.
QWeight shaped(int64_t E, int64_t N, int64_t K, const QuantSpec& s) {
  QWeight q;
  q.experts = E ? E : 1;
  q.rows = N;
  q.cols = K;
  q.bits = s.bits;
  q.group_size = s.group_size;
  return q;
}

// Checkpoint name -> lily's canonical name ("layers.3.mlp.gate.weight", "embed_tokens.weight",
// "lm_head.weight"), or "" for tensors lily does not use (vision tower, MTP head).
std::string canonical_name(const std::string& name, bool& is_mlx) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  if (starts("vision_tower.") || starts("model.visual.") || starts("visual.") || starts("mtp.") ||
      starts("model.mtp.") || starts("language_model.mtp."))
    return "";
  std::string rest;
  if (starts("language_model.model.")) { is_mlx = true; rest = name.substr(21); }
  else if (starts("language_model.lm_head.")) { is_mlx = true; rest = name.substr(15); }
  else if (starts("model.language_model.")) rest = name.substr(21);
  else if (starts("model.")) rest = name.substr(6);
  else if (starts("lm_head.")) rest = name;
  else return name;  // unknown: kept, so that it is reported as unexpected
  if (rest.rfind("mtp.", 0) == 0) return "";
  return rest;
}

// Derived sizes, in config.json's fields (for messages).
const std::string kValueDim = "linear_num_value_heads * linear_value_head_dim";
const std::string kConvDim = "2 * linear_num_key_heads * linear_key_head_dim + " + kValueDim;

float read_float(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32: { float f; std::memcpy(&f, t.data + 4 * i, 4); return f; }
    case DType::BF16: { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); return bf16_to_float(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); return half_to_float(h); }
    default: return 0;
  }
}

class Loader {
 public:
  Loader(const std::string& dir, const LoadOptions& opts, ModelWeights& w) : opts_(opts), w_(w) {
    w_.config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
    w_.checkpoint = std::make_shared<Checkpoint>(dir);
    bool any_mlx = false;
    for (const auto& [name, t] : w_.checkpoint->tensors()) {
      bool is_mlx = false;
      std::string c = canonical_name(name, is_mlx);
      any_mlx |= is_mlx;
      if (c.empty()) continue;
      if (by_canon_.count(c))
        fail(t.file, ": tensor '", name, "' duplicates '", by_canon_[c]->name, "' (same weight under two names)");
      by_canon_[c] = &t;
    }
    w_.source_layout = any_mlx ? "mlx" : "hf";
    // mlx-lm's rule: norms are zero-centred (need +1) exactly when conv1d is in the raw
    // HF layout [C, 1, K] (last dim != 1); an MLX-sanitized checkpoint has [C, K, 1].
    for (const auto& [c, t] : by_canon_)
      if (c.find("linear_attn.conv1d.weight") != std::string::npos && !t->shape.empty() && t->shape.back() != 1)
        shift_norms_ = true;
  }

  void load() {
    const ModelConfig& c = w_.config;
    const int64_t H = c.hidden_size, V = c.vocab_size;
    w_.embed = linear("embed_tokens", 0, V, H, "[vocab_size, hidden_size]");
    w_.lm_head = c.tie_word_embeddings ? w_.embed : linear("lm_head", 0, V, H, "[vocab_size, hidden_size]");
    w_.final_norm = dense("norm.weight", {H}, "[hidden_size]", true, true);
    w_.layers.resize(c.num_hidden_layers);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) load_layer(i);
    check_all_consumed();
  }

 private:
  const LoadOptions& opts_;
  ModelWeights& w_;
  std::map<std::string, const TensorView*> by_canon_;
  std::set<std::string> consumed_;
  bool shift_norms_ = false;

  const TensorView* find(const std::string& canon) {
    auto it = by_canon_.find(canon);
    if (it == by_canon_.end()) return nullptr;
    consumed_.insert(canon);
    return it->second;
  }
  const TensorView& need(const std::string& canon) {
    const TensorView* t = find(canon);
    if (!t) fail(w_.checkpoint->dir(), ": missing tensor '", canon, "' (lily's name; checkpoint prefix may differ)");
    return *t;
  }
  [[noreturn]] static void bad(const TensorView& t, const std::string& why) {
    fail(t.file, ": tensor '", t.name, "' ", why);
  }
  static std::string shape_str(const std::vector<int64_t>& shape) {
    TensorView t;
    t.shape = shape;
    return t.shape_str();
  }
  // `dims` names the expected shape in config.json's terms ("[vocab_size, hidden_size]"), so a
  // config that disagrees with the tensors says which field to look at.
  static void expect_shape(const TensorView& t, const std::vector<int64_t>& shape, const std::string& dims) {
    if (t.shape != shape)
      bad(t, "has shape " + t.shape_str() + ", expected " + shape_str(shape) + " (" + dims + " in config.json)");
  }
  static void expect_float(const TensorView& t) {
    if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32)
      bad(t, std::string("has dtype ") + dtype_name(t.dtype) + ", expected BF16, F16 or F32");
  }

  uint8_t* alloc(size_t bytes) {
    w_.owned.emplace_back(new uint8_t[bytes]);
    return w_.owned.back().get();
  }

  // The spec the config asks for at `module` (e.g. "layers.0.mlp.gate").
  bool config_spec(const std::string& module, QuantSpec& spec) const {
    const ModelConfig& c = w_.config;
    for (const auto& [key, s] : c.quant_overrides)
      if (key == module || (key.size() > module.size() && key.compare(key.size() - module.size(), module.size(), module) == 0 &&
                            key[key.size() - module.size() - 1] == '.')) {
        spec = s;
        return true;
      }
    if (c.quantized) { spec = c.quant; return true; }
    return false;
  }

  static bool is_gate_module(const std::string& module) {
    auto ends = [&](const std::string& s) {
      return module.size() >= s.size() && module.compare(module.size() - s.size(), s.size(), s) == 0;
    };
    return ends("mlp.gate") || ends("shared_expert_gate");
  }

  QuantSpec spec_for_float(const std::string& module) const {
    QuantSpec s;
    if (config_spec(module, s)) return s;
    return is_gate_module(module) ? opts_.gate_quant : opts_.default_quant;
  }

  static bool supported(const QuantSpec& s) {
    return (s.bits == 4 || s.bits == 8) && (s.group_size == 32 || s.group_size == 64 || s.group_size == 128);
  }

  // Quantized tensors as stored: weight U32 [.., N, K*b/32], scales/biases BF16 [.., N, K/g].
  // The shapes config.json implies are checked as in the float layout; a bit width or group
  // size that differs from the config's (same matrix) is named as such.
  QWeight quantized(const std::string& module, const TensorView& wt, int64_t E, int64_t N, int64_t K,
                    const std::string& dims) {
    const TensorView& st = need(module + ".scales");
    const TensorView* bt = find(module + ".biases");
    if (!bt) fail(st.file, ": tensor '", module, ".biases' is missing (lily reads the affine mode only)");
    if (wt.dtype != DType::U32) bad(wt, std::string("has dtype ") + dtype_name(wt.dtype) + ", expected U32 codes");
    for (const TensorView* t : {&st, bt})
      if (t->dtype != DType::BF16) bad(*t, std::string("has dtype ") + dtype_name(t->dtype) + ", expected BF16");
    const size_t nd = E ? 3 : 2;
    if (wt.shape.size() != nd || st.shape.size() != nd) bad(wt, "has the wrong number of dimensions");
    std::vector<int64_t> lead = E ? std::vector<int64_t>{E, N} : std::vector<int64_t>{N};
    auto with = [&](int64_t last) { auto s = lead; s.push_back(last); return s; };
    const int64_t words = wt.shape.back(), groups = st.shape.back();
    const bool whole = words > 0 && groups > 0 && (words * 32) % K == 0 && K % groups == 0;
    const QuantSpec stored{whole ? static_cast<int>(K / groups) : 0, whole ? static_cast<int>(words * 32 / K) : 0};
    QuantSpec want;
    if (!config_spec(module, want)) {  // no quantization block: the stored codes decide
      if (!whole) bad(wt, "has shape " + wt.shape_str() + " that does not fit the input size " + std::to_string(K));
      if (stored.bits != 4 && stored.bits != 8)
        bad(wt, "holds " + std::to_string(stored.bits) + "-bit codes; lily supports 4 and 8");
      if (!supported(stored))
        bad(st, "implies group size " + std::to_string(stored.group_size) + "; lily supports 32, 64 and 128");
      want = stored;
    } else if (supported(stored) && (stored.bits != want.bits || stored.group_size != want.group_size) &&
               std::equal(lead.begin(), lead.end(), wt.shape.begin()) && st.shape == with(groups)) {
      bad(wt, "is " + std::to_string(stored.bits) + "-bit with group " + std::to_string(stored.group_size) +
                  " but config.json's quantization block says " + std::to_string(want.bits) + "-bit, group " +
                  std::to_string(want.group_size));
    }
    if (K % want.group_size)
      fail(wt.file, ": '", module, "' input size ", std::to_string(K), " (", dims,
           " in config.json) is not a multiple of the quantization group size ", std::to_string(want.group_size));
    const std::string matrix = shape_str(E ? std::vector<int64_t>{E, N, K} : std::vector<int64_t>{N, K});
    expect_shape(wt, with(K * want.bits / 32), std::to_string(want.bits) + "-bit codes of " + matrix + " = " + dims);
    expect_shape(st, with(K / want.group_size), "group-" + std::to_string(want.group_size) + " scales of " + dims);
    expect_shape(*bt, with(K / want.group_size), "group-" + std::to_string(want.group_size) + " biases of " + dims);
    QWeight q = shaped(E, N, K, want);
    q.codes = reinterpret_cast<const uint32_t*>(wt.data);
    q.scales = reinterpret_cast<const uint16_t*>(st.data);
    q.biases = reinterpret_cast<const uint16_t*>(bt->data);
    return q;
  }

  // Quantizes float rows (bf16-rounded first, as mlx_lm.convert casts to bf16).
  QWeight quantize_rows(const std::string& module, const std::vector<const TensorView*>& parts,
                        const std::vector<int64_t>& row_offsets, int64_t E, int64_t N, int64_t K) {
    QuantSpec s = spec_for_float(module);
    if (K % s.group_size) fail(w_.checkpoint->dir(), ": '", module, "' input size ", std::to_string(K),
                               " is not a multiple of the quantization group size ", std::to_string(s.group_size));
    QWeight q = shaped(E, N, K, s);
    const int64_t total_rows = q.experts * N;
    auto* codes = reinterpret_cast<uint32_t*>(alloc(total_rows * q.words_per_row() * 4));
    auto* scales = reinterpret_cast<uint16_t*>(alloc(total_rows * q.groups_per_row() * 2));
    auto* biases = reinterpret_cast<uint16_t*>(alloc(total_rows * q.groups_per_row() * 2));
    // Row r of expert e comes from parts[e or 0] at row row_offsets[...] + r.
    std::vector<float> buf(N * K);
    for (int64_t e = 0; e < q.experts; ++e) {
      const TensorView& t = *parts[parts.size() == 1 ? 0 : e];
      const int64_t first = (parts.size() == 1 ? e * row_offsets[1] : 0) + row_offsets[0];
      for (int64_t i = 0; i < N * K; ++i) buf[i] = round_bf16(read_float(t, first * K + i));
      affine_quantize(buf.data(), N, K, q.group_size, q.bits, codes + e * N * q.words_per_row(),
                      scales + e * N * q.groups_per_row(), biases + e * N * q.groups_per_row());
    }
    q.codes = codes;
    q.scales = scales;
    q.biases = biases;
    return q;
  }

  // A linear module [N, K] (E == 0) or expert stack [E, N, K], quantized or float; `dims` names
  // its shape in config.json's fields.
  QWeight linear(const std::string& module, int64_t E, int64_t N, int64_t K, const std::string& dims) {
    const TensorView& wt = need(module + ".weight");
    if (by_canon_.count(module + ".scales")) return quantized(module, wt, E, N, K, dims);
    expect_float(wt);
    expect_shape(wt, E ? std::vector<int64_t>{E, N, K} : std::vector<int64_t>{N, K}, dims);
    return quantize_rows(module, {&wt}, {0, N}, E, N, K);
  }

  Dense dense(const std::string& canon, const std::vector<int64_t>& shape, const std::string& dims, bool cast_bf16,
              bool is_norm) {
    const TensorView& t = need(canon);
    expect_float(t);
    expect_shape(t, shape, dims);
    Dense d;
    d.shape = t.shape;
    d.dtype = cast_bf16 ? DType::BF16 : (t.dtype == DType::BF16 ? DType::BF16 : DType::F32);
    d.values.resize(t.numel());
    for (int64_t i = 0; i < t.numel(); ++i) {
      float v = read_float(t, i);
      if (d.dtype == DType::BF16) v = round_bf16(v);
      if (is_norm && shift_norms_) v = round_bf16(v + 1.0f);
      d.values[i] = v;
    }
    return d;
  }

  void load_layer(int64_t i) {
    const ModelConfig& c = w_.config;
    const int64_t H = c.hidden_size;
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& L = w_.layers[i];
    L.kind = c.layer_kinds[i];
    L.input_norm = dense(p + "input_layernorm.weight", {H}, "[hidden_size]", true, true);
    L.post_norm = dense(p + "post_attention_layernorm.weight", {H}, "[hidden_size]", true, true);
    if (L.kind == LayerKind::Linear) {
      const std::string a = p + "linear_attn.";
      const int64_t conv = c.gdn_conv_dim(), Hv = c.linear_num_value_heads, vdim = c.gdn_value_dim();
      GdnWeights& g = L.gdn;
      g.in_proj_qkv = linear(a + "in_proj_qkv", 0, conv, H, "[" + kConvDim + ", hidden_size]");
      g.in_proj_z = linear(a + "in_proj_z", 0, vdim, H, "[" + kValueDim + ", hidden_size]");
      g.in_proj_b = linear(a + "in_proj_b", 0, Hv, H, "[linear_num_value_heads, hidden_size]");
      g.in_proj_a = linear(a + "in_proj_a", 0, Hv, H, "[linear_num_value_heads, hidden_size]");
      g.out_proj = linear(a + "out_proj", 0, H, vdim, "[hidden_size, " + kValueDim + "]");
      const TensorView& cw = need(a + "conv1d.weight");
      const int64_t Kc = c.linear_conv_kernel_dim;
      if (cw.shape != std::vector<int64_t>{conv, Kc, 1} && cw.shape != std::vector<int64_t>{conv, 1, Kc})
        bad(cw, "has shape " + cw.shape_str() + ", expected [" + std::to_string(conv) + ", " + std::to_string(Kc) +
                    ", 1] (MLX) or [" + std::to_string(conv) + ", 1, " + std::to_string(Kc) + "] (HF)");
      g.conv1d = dense(a + "conv1d.weight", cw.shape, "[" + kConvDim + ", linear_conv_kernel_dim]", true, false);
      g.conv1d.shape = {conv, Kc, 1};  // same memory order in both layouts
      g.dt_bias = dense(a + "dt_bias", {Hv}, "[linear_num_value_heads]", true, false);
      g.A_log = dense(a + "A_log", {Hv}, "[linear_num_value_heads]", false, false);
      g.norm = dense(a + "norm.weight", {c.linear_value_head_dim}, "[linear_value_head_dim]", true, false);
    } else {
      const std::string a = p + "self_attn.";
      AttnWeights& t = L.attn;
      t.q_proj = linear(a + "q_proj", 0, 2 * c.attn_q_dim(), H, "[2 * num_attention_heads * head_dim, hidden_size]");
      t.k_proj = linear(a + "k_proj", 0, c.attn_kv_dim(), H, "[num_key_value_heads * head_dim, hidden_size]");
      t.v_proj = linear(a + "v_proj", 0, c.attn_kv_dim(), H, "[num_key_value_heads * head_dim, hidden_size]");
      t.o_proj = linear(a + "o_proj", 0, H, c.attn_q_dim(), "[hidden_size, num_attention_heads * head_dim]");
      t.q_norm = dense(a + "q_norm.weight", {c.head_dim}, "[head_dim]", true, true);
      t.k_norm = dense(a + "k_norm.weight", {c.head_dim}, "[head_dim]", true, true);
    }
    load_moe(p + "mlp.", L.moe);
  }

  void load_moe(const std::string& m, MoeWeights& moe) {
    const ModelConfig& c = w_.config;
    const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size,
                  Is = c.shared_expert_intermediate_size;
    const std::string in_h = "[num_experts, moe_intermediate_size, hidden_size]",
                      in_i = "[num_experts, hidden_size, moe_intermediate_size]";
    moe.router = linear(m + "gate", 0, E, H, "[num_experts, hidden_size]");
    moe.shared_expert_gate = linear(m + "shared_expert_gate", 0, 1, H, "[1, hidden_size]");
    const std::string shared_in = "[shared_expert_intermediate_size, hidden_size]",
                      shared_out = "[hidden_size, shared_expert_intermediate_size]";
    moe.shared_gate_proj = linear(m + "shared_expert.gate_proj", 0, Is, H, shared_in);
    moe.shared_up_proj = linear(m + "shared_expert.up_proj", 0, Is, H, shared_in);
    moe.shared_down_proj = linear(m + "shared_expert.down_proj", 0, H, Is, shared_out);

    const std::string sw = m + "switch_mlp.";
    if (by_canon_.count(sw + "gate_proj.weight")) {  // MLX layout (quantized or not)
      moe.gate_proj = linear(sw + "gate_proj", E, I, H, in_h);
      moe.up_proj = linear(sw + "up_proj", E, I, H, in_h);
      moe.down_proj = linear(sw + "down_proj", E, H, I, in_i);
    } else if (by_canon_.count(m + "experts.gate_up_proj")) {  // HF fused 3-D
      const TensorView& gu = need(m + "experts.gate_up_proj");
      const TensorView& dn = need(m + "experts.down_proj");
      expect_float(gu);
      expect_float(dn);
      expect_shape(gu, {E, 2 * I, H}, "[num_experts, 2 * moe_intermediate_size, hidden_size]");
      expect_shape(dn, {E, H, I}, in_i);
      moe.gate_proj = quantize_rows(sw + "gate_proj", {&gu}, {0, 2 * I}, E, I, H);
      moe.up_proj = quantize_rows(sw + "up_proj", {&gu}, {I, 2 * I}, E, I, H);
      moe.down_proj = quantize_rows(sw + "down_proj", {&dn}, {0, H}, E, H, I);
    } else {  // HF per-expert tensors
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        const bool down = std::strcmp(proj, "down_proj") == 0;
        const int64_t N = down ? H : I, K = down ? I : H;
        std::vector<const TensorView*> parts;
        for (int64_t e = 0; e < E; ++e) {
          const TensorView& t = need(m + "experts." + std::to_string(e) + "." + proj + ".weight");
          expect_float(t);
          expect_shape(t, {N, K},
                       down ? "[hidden_size, moe_intermediate_size]" : "[moe_intermediate_size, hidden_size]");
          parts.push_back(&t);
        }
        QWeight q = quantize_rows(sw + proj, parts, {0, N}, E, N, K);
        (down ? moe.down_proj : std::strcmp(proj, "gate_proj") == 0 ? moe.gate_proj : moe.up_proj) = q;
      }
    }
  }

  void check_all_consumed() {
    std::string extra;
    int n = 0;
    for (const auto& [c, t] : by_canon_)
      if (!consumed_.count(c)) {
        if (n < 5) extra += (n ? ", '" : "'") + t->name + "' in " + fs::path(t->file).filename().string();
        ++n;
      }
    if (n) fail(w_.checkpoint->dir(), ": ", std::to_string(n), " unexpected tensor(s) that lily would not use: ", extra,
                n > 5 ? ", ..." : "", " (wrong model or inconsistent config.json?)");
  }
};

// ---- writing -------------------------------------------------------------------

// A tensor to write: quantized weights point at the loaded buffers (no copy);
// dense tensors own their converted bytes.
struct OutTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t size = 0;
  std::vector<uint8_t> storage;
};

void add_q(std::vector<OutTensor>& out, const std::string& module, const QWeight& q, bool stacked) {
  std::vector<int64_t> lead = stacked ? std::vector<int64_t>{q.experts, q.rows} : std::vector<int64_t>{q.rows};
  auto put = [&](const char* suffix, DType dt, int64_t last, const void* data, size_t elem) {
    OutTensor t;
    t.name = module + suffix;
    t.dtype = dt;
    t.shape = lead;
    t.shape.push_back(last);
    t.data = static_cast<const uint8_t*>(data);
    t.size = static_cast<size_t>(q.experts * q.rows * last) * elem;
    out.push_back(std::move(t));
  };
  put(".weight", DType::U32, q.words_per_row(), q.codes, 4);
  put(".scales", DType::BF16, q.groups_per_row(), q.scales, 2);
  put(".biases", DType::BF16, q.groups_per_row(), q.biases, 2);
}

void add_dense(std::vector<OutTensor>& out, const std::string& name, const Dense& d) {
  OutTensor t;
  t.name = name;
  t.dtype = d.dtype;
  t.shape = d.shape;
  if (d.dtype == DType::BF16) {
    t.storage.resize(d.values.size() * 2);
    for (size_t i = 0; i < d.values.size(); ++i) {
      uint16_t h = float_to_bf16(d.values[i]);
      std::memcpy(&t.storage[2 * i], &h, 2);
    }
  } else {
    t.storage.resize(d.values.size() * 4);
    std::memcpy(t.storage.data(), d.values.data(), t.storage.size());
  }
  t.data = t.storage.data();
  t.size = t.storage.size();
  out.push_back(std::move(t));
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o;
}

void write_safetensors(const std::string& path, const std::vector<const OutTensor*>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"mlx\"}";
  size_t offset = 0;
  for (const OutTensor* t : tensors) {
    header += ",\"" + json_escape(t->name) + "\":{\"dtype\":\"" + dtype_name(t->dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < t->shape.size(); ++i) header += (i ? "," : "") + std::to_string(t->shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t->size) + "]}";
    offset += t->size;
  }
  header += "}";
  while (header.size() % 8) header += ' ';
  std::ofstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open for writing");
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), header.size());
  for (const OutTensor* t : tensors) f.write(reinterpret_cast<const char*>(t->data), t->size);
  if (!f) fail(path, ": write failed (disk full?)");
}

}  // namespace

std::shared_ptr<ModelWeights> ModelWeights::load(const std::string& dir, const LoadOptions& opts) {
  auto w = std::make_shared<ModelWeights>();
  Loader loader(dir, opts, *w);
  loader.load();
  return w;
}

size_t ModelWeights::nbytes() const {
  size_t n = embed.nbytes() + (config.tie_word_embeddings ? 0 : lm_head.nbytes());
  for (const LayerWeights& L : layers) {
    for (const QWeight* q : {&L.gdn.in_proj_qkv, &L.gdn.in_proj_z, &L.gdn.in_proj_b, &L.gdn.in_proj_a,
                             &L.gdn.out_proj, &L.attn.q_proj, &L.attn.k_proj, &L.attn.v_proj, &L.attn.o_proj,
                             &L.moe.router, &L.moe.gate_proj, &L.moe.up_proj, &L.moe.down_proj,
                             &L.moe.shared_gate_proj, &L.moe.shared_up_proj, &L.moe.shared_down_proj,
                             &L.moe.shared_expert_gate})
      if (q->codes) n += q->nbytes();
  }
  return n;
}

void ModelWeights::save_mlx(const std::string& out_dir, int64_t max_shard_bytes) const {
  std::vector<OutTensor> out;
  const std::string m = "language_model.model.";
  add_q(out, m + "embed_tokens", embed, false);
  if (!config.tie_word_embeddings) add_q(out, "language_model.lm_head", lm_head, false);
  add_dense(out, m + "norm.weight", final_norm);
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& L = layers[i];
    const std::string p = m + "layers." + std::to_string(i) + ".";
    add_dense(out, p + "input_layernorm.weight", L.input_norm);
    add_dense(out, p + "post_attention_layernorm.weight", L.post_norm);
    if (L.kind == LayerKind::Linear) {
      const std::string a = p + "linear_attn.";
      add_q(out, a + "in_proj_qkv", L.gdn.in_proj_qkv, false);
      add_q(out, a + "in_proj_z", L.gdn.in_proj_z, false);
      add_q(out, a + "in_proj_b", L.gdn.in_proj_b, false);
      add_q(out, a + "in_proj_a", L.gdn.in_proj_a, false);
      add_q(out, a + "out_proj", L.gdn.out_proj, false);
      add_dense(out, a + "conv1d.weight", L.gdn.conv1d);
      add_dense(out, a + "dt_bias", L.gdn.dt_bias);
      add_dense(out, a + "A_log", L.gdn.A_log);
      add_dense(out, a + "norm.weight", L.gdn.norm);
    } else {
      const std::string a = p + "self_attn.";
      add_q(out, a + "q_proj", L.attn.q_proj, false);
      add_q(out, a + "k_proj", L.attn.k_proj, false);
      add_q(out, a + "v_proj", L.attn.v_proj, false);
      add_q(out, a + "o_proj", L.attn.o_proj, false);
      add_dense(out, a + "q_norm.weight", L.attn.q_norm);
      add_dense(out, a + "k_norm.weight", L.attn.k_norm);
    }
    const std::string mm = p + "mlp.";
    add_q(out, mm + "gate", L.moe.router, false);
    add_q(out, mm + "shared_expert_gate", L.moe.shared_expert_gate, false);
    add_q(out, mm + "shared_expert.gate_proj", L.moe.shared_gate_proj, false);
    add_q(out, mm + "shared_expert.up_proj", L.moe.shared_up_proj, false);
    add_q(out, mm + "shared_expert.down_proj", L.moe.shared_down_proj, false);
    add_q(out, mm + "switch_mlp.gate_proj", L.moe.gate_proj, true);
    add_q(out, mm + "switch_mlp.up_proj", L.moe.up_proj, true);
    add_q(out, mm + "switch_mlp.down_proj", L.moe.down_proj, true);
  }
  std::sort(out.begin(), out.end(), [](const OutTensor& a, const OutTensor& b) { return a.name < b.name; });

  std::vector<std::vector<const OutTensor*>> shards(1);
  size_t shard_bytes = 0;
  for (const OutTensor& t : out) {
    if (shard_bytes > 0 && static_cast<int64_t>(shard_bytes + t.size) > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&t);
    shard_bytes += t.size;
  }
  fs::create_directories(out_dir);
  if (shards.size() == 1) {
    write_safetensors((fs::path(out_dir) / "model.safetensors").string(), shards[0]);
    return;
  }
  std::string index = "{\"metadata\":{\"total_size\":";
  size_t total = 0;
  for (const OutTensor& t : out) total += t.size;
  index += std::to_string(total) + "},\"weight_map\":{";
  bool first = true;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    write_safetensors((fs::path(out_dir) / name).string(), shards[s]);
    for (const OutTensor* t : shards[s]) {
      index += std::string(first ? "" : ",") + "\"" + json_escape(t->name) + "\":\"" + name + "\"";
      first = false;
    }
  }
  index += "}}";
  std::ofstream f((fs::path(out_dir) / "model.safetensors.index.json").string());
  f << index;
}

}  // namespace lily
