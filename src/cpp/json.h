// A small, strict JSON reader for config.json and safetensors headers, and the quoting their
// writers use. Every access is bounds-checked; errors carry the byte offset or the key path.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

class Json {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  static Json parse(std::string_view text, const std::string& what);

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::Null; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_number() const { return kind_ == Kind::Number; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_array() const { return kind_ == Kind::Array; }
  bool is_object() const { return kind_ == Kind::Object; }

  bool as_bool() const { return b_; }
  double as_number() const { return num_; }
  // True when the number is integral and fits int64.
  bool is_integer() const;
  int64_t as_int() const { return static_cast<int64_t>(num_); }
  const std::string& as_string() const { return str_; }
  const std::vector<Json>& items() const { return arr_; }
  const std::vector<std::pair<std::string, Json>>& members() const { return obj_; }

  // Object lookup; nullptr when absent (or when this is not an object).
  const Json* find(std::string_view key) const;

 private:
  friend class JsonParser;
  Kind kind_ = Kind::Null;
  bool b_ = false;
  double num_ = 0;
  std::string str_;
  std::vector<Json> arr_;
  std::vector<std::pair<std::string, Json>> obj_;  // keeps file order
};

// s as a JSON string literal, escaped as Python's json module escapes ASCII text.
std::string json_quote(const std::string& s);

}  // namespace lily
