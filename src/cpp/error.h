// lily: one exception type for every user-facing error. Messages name the file,
// tensor, field or parameter at fault; the Python layer maps it to LilyError.
#pragma once
#include <stdexcept>
#include <string>

namespace lily {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] inline void fail(const Args&... parts) {
  std::string msg;
  ((msg += parts), ...);
  throw Error(msg);
}

}  // namespace lily
