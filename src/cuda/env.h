// Integer settings read from the environment (ablations and routing knobs).
#pragma once
#include <cstdlib>

namespace lily::cuda {

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

}  // namespace lily::cuda
