// Memory-mapped safetensors files and multi-file checkpoints.
// The header parser checks every offset against the file size.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace lily {

enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

const char* dtype_name(DType t);
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

}  // namespace lily
