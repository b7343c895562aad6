// _lily.checkpoint_tensors, mlx_quantization, vision_prefix and write_safetensors: the
// checkpoint name table (checkpoint_names.h) and the safetensors writer, for lily.synthetic and
// lily.convert. Configs travel as JSON text, as config.json holds them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>
#include <vector>

#include "bindings.h"
#include "checkpoint_names.h"
#include "error.h"
#include "json.h"

namespace nb = nanobind;

namespace lily {
namespace {

Layout parse_layout(const std::string& name) {
  if (name == "mlx") return Layout::Mlx;
  if (name == "hf") return Layout::Hf;
  if (name == "hf_per_expert") return Layout::HfPerExpert;
  if (name == "hf_text") return Layout::HfText;
  fail("layout must be 'mlx', 'hf', 'hf_per_expert' or 'hf_text', got '", name, "'");
}

ModelConfig parse_config(const std::string& config_json) {
  return ModelConfig::from_json(Json::parse(config_json, "config"), "config");
}

nb::dict spec_dict(const QuantSpec& s) {
  nb::dict d;
  d["group_size"] = s.group_size;
  d["bits"] = s.bits;
  return d;
}

// One stored tensor, with what its (first) weight says: the field, the kind, the shape lily
// holds, and the HF float tensor whose values it holds (rows: those of each expert's block).
nb::dict tensor_dict(const StoredTensor& t, const std::vector<WeightEntry>& table) {
  const WeightEntry& w = table[t.weights[0]];
  nb::dict d;
  d["name"] = t.name;
  d["dtype"] = dtype_name(t.dtype);
  d["shape"] = t.shape;
  d["part"] = part_name(t.part);
  if (t.part != Part::Float) {
    d["module"] = stored_name(Layout::Mlx, w.name);
    d["group_size"] = t.quant.group_size;
    d["bits"] = t.quant.bits;
  }
  std::vector<std::string> fields;
  for (size_t i : t.weights) fields.push_back(table[i].field);
  d["fields"] = fields;
  d["kind"] = kind_name(w.kind);
  d["weight_shape"] = sizes(w.shape);
  d["plus_one"] = t.plus_one;
  d["source"] = w.hf_name;
  d["source_shape"] = sizes(w.hf_shape);
  d["expert"] = t.expert;
  if (t.end_row > t.first_row) d["rows"] = std::make_tuple(t.first_row, t.end_row);
  else d["rows"] = nb::none();
  return d;
}

nb::list checkpoint_tensors_py(const std::string& config_json, const std::string& layout, bool mtp) {
  const std::vector<WeightEntry> table = weight_table(parse_config(config_json), mtp);
  nb::list out;
  for (const StoredTensor& t : checkpoint_tensors(table, parse_layout(layout))) out.append(tensor_dict(t, table));
  return out;
}

// config.json's quantization block for the MLX layout of a config: the default spec, and each
// quantized module whose spec differs from it, in table order (mlx_lm's block).
nb::dict mlx_quantization(const std::string& config_json, bool mtp) {
  const ModelConfig c = parse_config(config_json);
  const QuantSpec base = default_quant(c);
  nb::dict block = spec_dict(base);
  block["mode"] = "affine";
  for (const WeightEntry& w : weight_table(c, mtp))
    for (const StoredTensor& t : stored_tensors(w, Layout::Mlx, w.quant))
      if (t.part == Part::Codes && (t.quant.bits != base.bits || t.quant.group_size != base.group_size))
        block[stored_name(Layout::Mlx, w.name).c_str()] = spec_dict(t.quant);
  return block;
}

// The numpy dtype that holds a safetensors dtype's bytes (BF16 as its uint16 bit patterns).
nb::dlpack::dtype array_dtype(DType t) {
  switch (t) {
    case DType::F32: return nb::dtype<float>();
    case DType::F64: return nb::dtype<double>();
    case DType::F16: case DType::BF16: case DType::U16: return nb::dtype<uint16_t>();
    case DType::I64: return nb::dtype<int64_t>();
    case DType::I32: return nb::dtype<int32_t>();
    case DType::I16: return nb::dtype<int16_t>();
    case DType::I8: return nb::dtype<int8_t>();
    case DType::U64: return nb::dtype<uint64_t>();
    case DType::U32: return nb::dtype<uint32_t>();
    case DType::U8: case DType::BOOL: return nb::dtype<uint8_t>();
  }
  return nb::dtype<uint8_t>();
}

using Chunk = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

using Header = std::tuple<std::string, std::string, std::vector<int64_t>>;  // name, dtype, shape

// tensors in file order; chunks(i) gives tensor i's data as C-contiguous numpy arrays of its
// dtype (never copied), in order, so a tensor is written as it is produced.
void write_safetensors_py(const std::string& dir, const std::vector<Header>& tensors, const std::string& format,
                          int64_t max_shard_bytes, nb::callable chunks) {
  std::vector<TensorHeader> headers;
  for (const auto& [name, dtype, shape] : tensors) {
    TensorHeader& h = headers.emplace_back(TensorHeader{name, DType::F32, shape});
    if (!parse_dtype(dtype, h.dtype)) fail("write_safetensors: tensor '", name, "' has unknown dtype '", dtype, "'");
  }
  write_safetensors(dir, headers, format, max_shard_bytes, [&](size_t i, const ByteSink& sink) {
    for (nb::handle chunk : chunks(i)) {
      Chunk a;
      if (!nb::try_cast(chunk, a, /*convert=*/false) || a.dtype() != array_dtype(headers[i].dtype))
        fail("write_safetensors: tensor '", headers[i].name, "' was given a chunk that is not a C-contiguous array of ",
             dtype_name(headers[i].dtype));
      sink(a.data(), a.nbytes());
    }
  });
}

}  // namespace

void register_checkpoint(nb::module_& m) {
  m.def("checkpoint_tensors", &checkpoint_tensors_py, nb::arg("config_json"), nb::arg("layout"), nb::arg("mtp") = false,
        "Every tensor of a checkpoint of config.json text `config_json` in `layout` ('mlx', 'hf',\n"
        "'hf_per_expert' or 'hf_text'; with the MTP head's when mtp), sorted by name: dicts of name, dtype, shape, part ('float',\n"
        "'codes', 'scales', 'biases'; quantized parts add module, group_size, bits), fields (what it\n"
        "fills in lily), kind,\n"
        "weight_shape, plus_one (stored as 1 + w), and where its values are in the HF layout: source,\n"
        "source_shape, expert (per-expert tensors) and rows (of each expert's block; None: all).");
  m.def("mlx_quantization", &mlx_quantization, nb::arg("config_json"), nb::arg("mtp") = false,
        "config.json's quantization block of the MLX layout of a config (mlx_lm's; with the MTP head's\n"
        "modules when mtp).");
  m.def(
      "vision_prefix", [](const std::string& layout) { return std::string(vision_prefix(parse_layout(layout))); },
      nb::arg("layout"), "Where `layout` keeps the vision tower's tensors, which lily skips.");
  m.def("write_safetensors", &write_safetensors_py, nb::arg("dir"), nb::arg("tensors"), nb::arg("format"),
        nb::arg("max_shard_bytes"), nb::arg("chunks"),
        "Writes tensors [(name, dtype, shape)] into dir as model.safetensors, or as shards of at most\n"
        "max_shard_bytes with model.safetensors.index.json; chunks(i) yields tensor i's data.");
}

}  // namespace lily
