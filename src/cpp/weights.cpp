#include "weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "bf16.h"
#include "checkpoint_names.h"
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

float read_float(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32: { float f; std::memcpy(&f, t.data + 4 * i, 4); return f; }
    case DType::BF16: { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); return bf16_to_float(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); return half_to_float(h); }
    default: return 0;
  }
}

// Fills every weight of weight_table() from a checkpoint, found by lily's name whatever the
// layout; a layer's experts may be MLX's, HF's fused or HF's per expert.
class Loader {
 public:
  Loader(const std::string& dir, ModelWeights& w) : w_(w) {
    w_.config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
    w_.checkpoint = std::make_shared<Checkpoint>(dir);
    bool any_mlx = false;
    for (const auto& [name, t] : w_.checkpoint->tensors()) {
      bool is_mlx = false;
      std::string c = lily_name(name, is_mlx);
      any_mlx |= is_mlx;
      if (c.empty()) continue;
      if (by_canon_.count(c))
        fail(t.file, ": tensor '", name, "' duplicates '", by_canon_[c]->name, "' (same weight under two names)");
      by_canon_[c] = &t;
    }
    w_.source_layout = any_mlx ? "mlx" : "hf";
  }

  void load() {
    const ModelConfig& c = w_.config;
    // A checkpoint with any tensor of the MTP head carries all of it (each missing one is named).
    w_.has_mtp = std::any_of(by_canon_.begin(), by_canon_.end(), [](const auto& t) { return is_mtp_name(t.first); });
    const std::vector<WeightEntry> table = weight_table(c, w_.has_mtp);
    // mlx-lm's rule: norms are zero-centred (need +1) exactly when conv1d is in the raw
    // HF layout [C, 1, K] (last dim != 1); an MLX-sanitized checkpoint has [C, K, 1].
    for (const WeightEntry& e : table)
      if (auto it = by_canon_.find(e.name); e.kind == WeightKind::Conv && it != by_canon_.end())
        shift_norms_ |= !it->second->shape.empty() && it->second->shape.back() != 1;
    w_.layers.resize(c.num_hidden_layers);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) w_.layers[i].kind = c.layer_kinds[i];
    for (const WeightEntry& e : table) {
      if (e.is_stack()) e.matrix(w_) = experts(e);
      else if (is_matrix(e.kind)) e.matrix(w_) = linear(e);
      else e.dense(w_) = dense(e);
    }
    if (c.tie_word_embeddings) w_.lm_head = w_.embed;
    check_all_consumed();
  }

 private:
  ModelWeights& w_;
  std::map<std::string, const TensorView*> by_canon_;
  std::set<std::string> consumed_;
  bool shift_norms_ = false;
  int64_t experts_layer_ = -1;  // the layer whose experts' layout is experts_layout_
  Layout experts_layout_ = Layout::Mlx;

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
  static void expect_shape(const TensorView& t, const Shape& shape) { expect_shape(t, sizes(shape), dims(shape)); }
  static void expect_float(const TensorView& t) {
    if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32)
      bad(t, std::string("has dtype ") + dtype_name(t.dtype) + ", expected BF16, F16 or F32");
  }

  uint8_t* alloc(size_t bytes) {
    w_.owned.emplace_back(new uint8_t[bytes]);
    return w_.owned.back().get();
  }

  static bool supported(const QuantSpec& s) {
    return (s.bits == 4 || s.bits == 8) && (s.group_size == 32 || s.group_size == 64 || s.group_size == 128);
  }

  // Quantized tensors as stored: weight U32 [.., N, K*b/32], scales/biases BF16 [.., N, K/g].
  // The shapes config.json implies are checked as in the float layout; a bit width or group
  // size that differs from the config's (same matrix) is named as such.
  QWeight quantized(const WeightEntry& e, const TensorView& wt) {
    const std::string& module = e.name;
    const std::string dims = lily::dims(e.shape);
    const int64_t E = e.is_stack() ? e.shape[0].size : 0, N = e.shape.end()[-2].size, K = e.shape.back().size;
    const TensorView& st = need(part_tensor(module, Part::Scales));
    const TensorView* bt = find(part_tensor(module, Part::Biases));
    if (!bt)
      fail(st.file, ": tensor '", part_tensor(module, Part::Biases), "' is missing (lily reads the affine mode only)");
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
    QuantSpec want = e.quant;
    if (!w_.config.quantized) {  // no quantization block: the stored codes decide
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

  // Quantizes float rows (bf16-rounded first, as mlx_lm.convert casts to bf16) in e's spec: row
  // r of expert x is row first_row + r of parts[x] or, from one tensor, of its x-th block of
  // block_rows rows.
  QWeight quantize_rows(const WeightEntry& e, const std::vector<const TensorView*>& parts, int64_t first_row,
                        int64_t block_rows) {
    const QuantSpec& s = e.quant;
    const int64_t E = e.is_stack() ? e.shape[0].size : 0, N = e.shape.end()[-2].size, K = e.shape.back().size;
    if (K % s.group_size) fail(w_.checkpoint->dir(), ": '", e.name, "' input size ", std::to_string(K),
                               " is not a multiple of the quantization group size ", std::to_string(s.group_size));
    QWeight q = shaped(E, N, K, s);
    const int64_t total_rows = q.experts * N;
    auto* codes = reinterpret_cast<uint32_t*>(alloc(total_rows * q.words_per_row() * 4));
    auto* scales = reinterpret_cast<uint16_t*>(alloc(total_rows * q.groups_per_row() * 2));
    auto* biases = reinterpret_cast<uint16_t*>(alloc(total_rows * q.groups_per_row() * 2));
    std::vector<float> buf(N * K);
    for (int64_t x = 0; x < q.experts; ++x) {
      const TensorView& t = *parts[parts.size() == 1 ? 0 : x];
      const int64_t first = (parts.size() == 1 ? x * block_rows : 0) + first_row;
      for (int64_t i = 0; i < N * K; ++i) buf[i] = round_bf16(read_float(t, first * K + i));
      affine_quantize(buf.data(), N, K, q.group_size, q.bits, codes + x * N * q.words_per_row(),
                      scales + x * N * q.groups_per_row(), biases + x * N * q.groups_per_row());
    }
    q.codes = codes;
    q.scales = scales;
    q.biases = biases;
    return q;
  }

  // A matrix, quantized (U32 codes with scales and biases) or float.
  QWeight linear(const WeightEntry& e) {
    const TensorView& wt = need(part_tensor(e.name, Part::Codes));
    if (by_canon_.count(part_tensor(e.name, Part::Scales)) || wt.dtype == DType::U32) return quantized(e, wt);
    expect_float(wt);
    expect_shape(wt, e.shape);
    return quantize_rows(e, {&wt}, 0, e.shape.end()[-2].size);
  }

  // An expert stack. A layer's first stack (the gate's) decides where the layer's experts are:
  // MLX's switch_mlp, HF's fused 3-D tensors or HF's per-expert tensors.
  QWeight experts(const WeightEntry& e) {
    if (e.layer != experts_layer_) {
      experts_layer_ = e.layer;
      experts_layout_ = by_canon_.count(part_tensor(e.name, Part::Codes)) ? Layout::Mlx
                        : by_canon_.count(e.hf_name)                      ? Layout::Hf
                                                                          : Layout::HfPerExpert;
    }
    if (experts_layout_ == Layout::Mlx) return linear(e);
    if (experts_layout_ == Layout::Hf) {
      const TensorView& t = need(e.hf_name);
      expect_float(t);
      expect_shape(t, e.hf_shape);
      return quantize_rows(e, {&t}, e.hf_first_row, e.hf_shape[1].size);
    }
    const Shape one(e.shape.begin() + 1, e.shape.end());
    std::vector<const TensorView*> parts;
    for (int64_t x = 0; x < e.shape[0].size; ++x) {
      const TensorView& t = need(e.hf_expert_name(x));
      expect_float(t);
      expect_shape(t, one);
      parts.push_back(&t);
    }
    return quantize_rows(e, parts, 0, 0);
  }

  // A dense tensor: rounded to bf16 unless it is float32 by nature (A_log, kept as stored up to
  // float32); norms stored zero-centred get their +1.
  Dense dense(const WeightEntry& e) {
    const TensorView& t = need(e.name);
    expect_float(t);
    if (e.kind != WeightKind::Conv) {
      expect_shape(t, e.shape);
    } else if (t.shape != sizes(e.shape) && t.shape != sizes(e.hf_shape)) {  // the same memory order
      bad(t, "has shape " + t.shape_str() + ", expected " + shape_str(sizes(e.shape)) + " (MLX) or " +
                 shape_str(sizes(e.hf_shape)) + " (HF)");
    }
    Dense d;
    d.shape = sizes(e.shape);
    d.dtype = e.dtype == DType::F32 && t.dtype != DType::BF16 ? DType::F32 : DType::BF16;
    d.values.resize(t.numel());
    for (int64_t i = 0; i < t.numel(); ++i) {
      float v = read_float(t, i);
      if (d.dtype == DType::BF16) v = round_bf16(v);
      if (e.kind == WeightKind::Norm && shift_norms_) v = round_bf16(v + 1.0f);
      d.values[i] = v;
    }
    return d;
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

// A tensor to write: quantized parts point at the loaded buffers (no copy); dense tensors own
// their converted bytes.
struct OutTensor {
  TensorHeader header;
  const void* data = nullptr;
  std::vector<uint8_t> storage;
};

// One part of a quantized matrix. A QWeight's input size is a multiple of its group size, so
// MLX stores it quantized: t is codes, scales or biases.
OutTensor quantized_part(const StoredTensor& t, const QWeight& q) {
  const void* data = t.part == Part::Codes ? static_cast<const void*>(q.codes)
                     : t.part == Part::Scales ? static_cast<const void*>(q.scales)
                                              : static_cast<const void*>(q.biases);
  return {{t.name, t.dtype, t.shape}, data, {}};
}

OutTensor dense_tensor(const std::string& name, const Dense& d) {
  OutTensor t{{name, d.dtype, d.shape}, nullptr, {}};
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
  return t;
}

}  // namespace

std::shared_ptr<ModelWeights> ModelWeights::load(const std::string& dir) {
  auto w = std::make_shared<ModelWeights>();
  Loader loader(dir, *w);
  loader.load();
  return w;
}

size_t ModelWeights::nbytes() const {
  size_t n = 0;
  for (const WeightEntry& e : weight_table(config, has_mtp))
    if (is_matrix(e.kind)) n += e.matrix(*this).nbytes();
  return n;
}

void ModelWeights::save_mlx(const std::string& out_dir, int64_t max_shard_bytes, bool keep_mtp) const {
  if (keep_mtp && !has_mtp)
    fail(checkpoint ? checkpoint->dir() : std::string("these weights"), ": no MTP head (mtp.* tensors) to keep");
  std::vector<OutTensor> out;
  for (const WeightEntry& e : weight_table(config, keep_mtp)) {
    if (!is_matrix(e.kind)) {
      out.push_back(dense_tensor(stored_tensors(e, Layout::Mlx, e.quant)[0].name, e.dense(*this)));
      continue;
    }
    const QWeight& q = e.matrix(*this);
    for (const StoredTensor& t : stored_tensors(e, Layout::Mlx, QuantSpec{q.group_size, q.bits}))
      out.push_back(quantized_part(t, q));
  }
  // By name, the MTP head's last (in a file of its own).
  auto mtp_tensor = [](const OutTensor& t) { return is_mtp_name(t.header.name); };
  std::sort(out.begin(), out.end(), [&](const OutTensor& a, const OutTensor& b) {
    return std::make_pair(mtp_tensor(a), a.header.name) < std::make_pair(mtp_tensor(b), b.header.name);
  });
  std::vector<TensorHeader> headers;
  for (const OutTensor& t : out) headers.push_back(t.header);
  const size_t trunk = std::count_if(out.begin(), out.end(), [&](const OutTensor& t) { return !mtp_tensor(t); });
  write_safetensors(out_dir, headers, "mlx", max_shard_bytes,
                    [&](size_t i, const ByteSink& sink) { sink(out[i].data, out[i].header.nbytes()); }, trunk,
                    "model-mtp.safetensors");
}

}  // namespace lily
