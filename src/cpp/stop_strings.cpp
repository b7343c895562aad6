#include "stop_strings.h"

#include <algorithm>

namespace lily {

StopStringMatcher::StopStringMatcher(std::shared_ptr<const std::vector<std::string>> token_bytes,
                                     std::vector<std::string> stops)
    : token_bytes_(std::move(token_bytes)), stops_(std::move(stops)) {
  for (const auto& s : stops_) longest_ = std::max(longest_, s.size());
}

bool StopStringMatcher::push(int32_t tok) {
  if (stops_.empty() || !token_bytes_ || tok < 0 || tok >= static_cast<int32_t>(token_bytes_->size())) return false;
  const size_t before = tail_.size();
  tail_ += (*token_bytes_)[tok];
  for (const auto& s : stops_) {
    // Only matches that end in the new bytes; older ones would have stopped earlier.
    size_t from = before >= s.size() ? before - s.size() + 1 : 0;
    if (tail_.find(s, from) != std::string::npos) return true;
  }
  if (tail_.size() > 2 * longest_ + 64) tail_.erase(0, tail_.size() - longest_);
  return false;
}

}  // namespace lily
