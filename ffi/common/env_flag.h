// Development switches read from the environment (A/B runs, measurements).
#pragma once
#include <cstdlib>
#include <cstring>

namespace jaxcp {

// True when the variable is set, non-empty and not "0". Read at each call, so that one process
// (a test, a benchmark) can switch between calls.
inline bool env_flag(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && env[0] != '\0' && std::strcmp(env, "0") != 0;
}

}  // namespace jaxcp
