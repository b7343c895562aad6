// Memory-mapped safetensors files and multi-file checkpoints, and the one writer of them.
// The header parser checks every offset against the file size.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace lily {

enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

const char* dtype_name(DType t);
bool parse_dtype(const std::string& name, DType& out);  // "BF16" -> DType::BF16; false if unknown
size_t dtype_size(DType t);

struct TensorView {
  std::string name;
  std::string file;  // file that holds it (for error messages)
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  std::string shape_str() const;
};

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// All tensors of a checkpoint directory: model.safetensors.index.json when present,
// otherwise every *.safetensors file in the directory.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;

  // Parses one file's header and adds its tensors (exposed for tests and tools).
  void add_file(const std::string& path);

 private:
  std::string dir_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

// A tensor to write: its header entry (the bytes come from the caller while the file is written).
struct TensorHeader {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};

// Takes the next bytes of the tensor being written.
using ByteSink = std::function<void(const void* data, size_t size)>;

// Writes `tensors`, in this order, into dir: model.safetensors, or, when they hold more than
// max_shard_bytes, files model-0000i-of-0000n.safetensors of at most that much data each (a
// tensor larger than that alone) with model.safetensors.index.json. fill(i, sink) gives sink
// tensor i's bytes in pieces of any size, so a checkpoint may be produced while it is written;
// too few or too many bytes is an error. `format` is the header's __metadata__ format ("mlx", "pt").
// Tensors [own_from, end) go to a file of their own, `own_file`, after the shards of the rest
// (which are then exactly what they would be without them), and the index lists every file.
void write_safetensors(const std::string& dir, const std::vector<TensorHeader>& tensors, const std::string& format,
                       int64_t max_shard_bytes, const std::function<void(size_t index, const ByteSink& sink)>& fill,
                       size_t own_from = SIZE_MAX, const std::string& own_file = "");

}  // namespace lily
