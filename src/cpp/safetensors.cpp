#include "safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "error.h"
#include "json.h"

namespace lily {

namespace fs = std::filesystem;

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U64: return "U64";
    case DType::U32: return "U32";
    case DType::U16: return "U16";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: case DType::U64: return 8;
    case DType::F32: case DType::I32: case DType::U32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: case DType::U16: return 2;
    default: return 1;
  }
}

bool parse_dtype(const std::string& s, DType& out) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"F64", DType::F64},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16},   {"I8", DType::I8},
      {"U64", DType::U64}, {"U32", DType::U32}, {"U16", DType::U16},   {"U8", DType::U8},
      {"BOOL", DType::BOOL}};
  for (auto& [name, t] : table)
    if (s == name) { out = t; return true; }
  return false;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

MappedFile::MappedFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0) { ::close(fd); fail(path, ": cannot stat"); }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) { ::close(fd); fail(path, ": mmap failed (", std::strerror(errno), ")"); }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) fail(dir, ": not a directory");
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream f(index);
    std::stringstream ss;
    ss << f.rdbuf();
    Json j = Json::parse(ss.str(), index.string());
    const Json* map = j.find("weight_map");
    if (!map || !map->is_object()) fail(index.string(), ": field 'weight_map' is missing or not an object");
    for (const auto& [name, file] : map->members()) {
      if (!file.is_string()) fail(index.string(), ": weight_map entry for '", name, "' is not a file name");
      if (file.as_string().find('/') != std::string::npos || file.as_string().find("..") != std::string::npos)
        fail(index.string(), ": weight_map entry for '", name, "' points outside the checkpoint");
      if (std::find(files.begin(), files.end(), file.as_string()) == files.end()) files.push_back(file.as_string());
    }
    for (const auto& f : files) add_file((fs::path(dir) / f).string());
    for (const auto& [name, file] : map->members())
      if (!tensors_.count(name))
        fail(index.string(), ": tensor '", name, "' is listed in weight_map but missing from ", file.as_string());
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    if (files.empty()) fail(dir, ": no .safetensors files found");
    for (const auto& f : files) add_file(f);
  }
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void Checkpoint::add_file(const std::string& path) {
  auto file = std::make_unique<MappedFile>(path);
  const size_t size = file->size();
  if (size < 8) fail(path, ": truncated safetensors file (", std::to_string(size), " bytes, no header)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file->data(), 8);  // little-endian on every supported host
  if (header_len > size - 8 || header_len > (100u << 20))
    fail(path, ": corrupt safetensors header (header length ", std::to_string(header_len),
         " exceeds the file size ", std::to_string(size), ")");
  std::string_view text(reinterpret_cast<const char*>(file->data() + 8), header_len);
  Json header = Json::parse(text, path + " (safetensors header)");
  if (!header.is_object()) fail(path, ": corrupt safetensors header (not a JSON object)");
  const uint8_t* base = file->data() + 8 + header_len;
  const size_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end) of every tensor

  for (const auto& [name, info] : header.members()) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& why) { fail(path, ": tensor '", name, "': ", why); };
    if (!info.is_object()) bad("header entry is not an object");
    const Json* dt = info.find("dtype");
    const Json* shape = info.find("shape");
    const Json* offs = info.find("data_offsets");
    if (!dt || !dt->is_string() || !shape || !shape->is_array() || !offs || !offs->is_array() ||
        offs->items().size() != 2)
      bad("header entry needs dtype, shape and two data_offsets");
    TensorView t;
    t.name = name;
    t.file = path;
    if (!parse_dtype(dt->as_string(), t.dtype)) bad("unsupported dtype '" + dt->as_string() + "'");
    uint64_t numel = 1;
    for (const Json& d : shape->items()) {
      if (!d.is_integer() || d.as_int() < 0) bad("shape entries must be non-negative integers");
      t.shape.push_back(d.as_int());
      if (d.as_int() > 0 && numel > (uint64_t(1) << 62) / static_cast<uint64_t>(d.as_int())) bad("shape too large");
      numel *= static_cast<uint64_t>(d.as_int());
    }
    const Json& b = offs->items()[0];
    const Json& e = offs->items()[1];
    if (!b.is_integer() || !e.is_integer() || b.as_int() < 0 || e.as_int() < b.as_int())
      bad("data_offsets must be two non-decreasing non-negative integers");
    uint64_t begin = b.as_int(), end = e.as_int();
    if (end > data_size)
      bad("data ends at byte " + std::to_string(end) + " but the file holds only " + std::to_string(data_size) +
          " data bytes (truncated file?)");
    if (end - begin != numel * dtype_size(t.dtype))
      bad("data size " + std::to_string(end - begin) + " bytes does not match shape " + t.shape_str() + " of " +
          dt->as_string());
    t.data = base + begin;
    t.nbytes = end - begin;
    ranges.emplace_back(begin, end);
    if (tensors_.count(name)) bad("appears in more than one file (also in " + tensors_[name].file + ")");
    tensors_.emplace(name, std::move(t));
  }
  // The format indexes the data buffer whole, without holes or overlaps: anything else
  // means a wrong header length or offsets, and reading on would give shifted weights.
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered)
      fail(path, ": corrupt safetensors header: tensor data ", begin < covered ? "overlaps" : "leaves a hole",
           " at byte ", std::to_string(std::min(begin, covered)), " of the data section");
    covered = end;
  }
  if (covered != data_size)
    fail(path, ": corrupt safetensors header: the tensors cover ", std::to_string(covered), " of the ",
         std::to_string(data_size), " data bytes (wrong header length, or trailing bytes)");
  files_.push_back(std::move(file));
}

// ---- writing --------------------------------------------------------------------------

size_t TensorHeader::nbytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

namespace {

// The header: tensors in order, data offsets packed, padded with spaces to 8 bytes so that the
// data stays aligned.
std::string header_json(const std::vector<const TensorHeader*>& tensors, const std::string& format) {
  std::string header = "{\"__metadata__\":{\"format\":" + json_quote(format) + "}";
  size_t offset = 0;
  for (const TensorHeader* t : tensors) {
    header += "," + json_quote(t->name) + ":{\"dtype\":\"" + dtype_name(t->dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < t->shape.size(); ++i) header += (i ? "," : "") + std::to_string(t->shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t->nbytes()) + "]}";
    offset += t->nbytes();
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}

void write_file(const std::string& path, const std::vector<const TensorHeader*>& tensors,
                const std::vector<size_t>& indices, const std::string& format,
                const std::function<void(size_t, const ByteSink&)>& fill) {
  std::ofstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open for writing");
  const std::string header = header_json(tensors, format);
  const uint64_t n = header.size();  // little-endian on every supported host
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (size_t k = 0; k < tensors.size(); ++k) {
    size_t written = 0;
    fill(indices[k], [&](const void* data, size_t size) {
      f.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
      written += size;
    });
    if (written != tensors[k]->nbytes())
      fail(path, ": tensor '", tensors[k]->name, "' was given ", std::to_string(written),
           " bytes; its dtype and shape take ", std::to_string(tensors[k]->nbytes()));
  }
  if (!f.flush()) fail(path, ": write failed (disk full?)");
}

// model.safetensors.index.json, laid out as Hugging Face writes it (json.dumps with indent 2).
void write_index(const std::string& path, size_t total_size, std::vector<std::pair<std::string, std::string>> map) {
  std::sort(map.begin(), map.end());
  std::string text = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total_size) +
                     "\n  },\n  \"weight_map\": {";
  for (size_t i = 0; i < map.size(); ++i)
    text += std::string(i ? "," : "") + "\n    " + json_quote(map[i].first) + ": " + json_quote(map[i].second);
  text += "\n  }\n}\n";
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f.flush()) fail(path, ": write failed (disk full?)");
}

}  // namespace

void write_safetensors(const std::string& dir, const std::vector<TensorHeader>& tensors, const std::string& format,
                       int64_t max_shard_bytes, const std::function<void(size_t, const ByteSink&)>& fill,
                       size_t own_from, const std::string& own_file) {
  // Shards in order: a new one whenever the next tensor would take this one past the limit.
  const size_t sharded = std::min(own_from, tensors.size());
  std::vector<std::vector<size_t>> shards(1);
  size_t shard_bytes = 0, total = 0;
  for (size_t i = 0; i < sharded; ++i) {
    const size_t n = tensors[i].nbytes();
    if (!shards.back().empty() && static_cast<int64_t>(shard_bytes + n) > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += n;
    total += n;
  }
  std::vector<std::string> files;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    files.push_back(shards.size() == 1 ? "model.safetensors" : name);
  }
  if (sharded < tensors.size()) {
    shards.emplace_back();
    for (size_t i = sharded; i < tensors.size(); ++i) {
      shards.back().push_back(i);
      total += tensors[i].nbytes();
    }
    files.push_back(own_file);
  }
  fs::create_directories(dir);
  std::vector<std::pair<std::string, std::string>> weight_map;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<const TensorHeader*> in_file;
    for (size_t i : shards[s]) {
      in_file.push_back(&tensors[i]);
      weight_map.emplace_back(tensors[i].name, files[s]);
    }
    write_file((fs::path(dir) / files[s]).string(), in_file, shards[s], format, fill);
  }
  if (shards.size() > 1) write_index((fs::path(dir) / "model.safetensors.index.json").string(), total, weight_map);
}

}  // namespace lily
