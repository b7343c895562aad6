// Stop strings, found in the bytes of the generated tokens. Matching in the core lets
// generation stop exactly at the token that completes a stop string, so the session
// holds no token beyond the text returned.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lily {

class StopStringMatcher {
 public:
  // token_bytes: the bytes each token id stands for (the tokenizer's); may be null when
  // there are no stops.
  StopStringMatcher(std::shared_ptr<const std::vector<std::string>> token_bytes, std::vector<std::string> stops);
  bool empty() const { return stops_.empty(); }
  // Appends a token's bytes; true when a stop string now ends inside them.
  bool push(int32_t tok);

 private:
  std::shared_ptr<const std::vector<std::string>> token_bytes_;
  std::vector<std::string> stops_;
  std::string tail_;  // the last bytes, enough to hold any stop that ends in the next token
  size_t longest_ = 0;
};

}  // namespace lily
