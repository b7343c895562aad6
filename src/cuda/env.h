// Settings read from the environment (route switches and ablations), strictly: a value
// that is not what the setting takes is refused with an error naming the variable, never
// read as some other number.
#pragma once
#include <cerrno>
#include <cstdlib>
#include <string>

#include "error.h"

namespace lily::cuda {

// The integer in `name`, which must lie in [lo, hi]; `fallback` when unset or empty.
inline int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno || *end || x < lo || x > hi)
    fail(name, " must be an integer in [", std::to_string(lo), ", ", std::to_string(hi), "], got '", v, "'");
  return static_cast<int>(x);
}

// A switch: 0 or 1.
inline bool env_flag(const char* name, bool fallback) { return env_int(name, fallback ? 1 : 0, 0, 1) != 0; }

}  // namespace lily::cuda
