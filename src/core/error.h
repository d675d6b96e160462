// Error handling: every recoverable failure (bad file, bad flag, bad prompt) is a merlin::Error with a
// one-line message; the CLI prints it and exits non-zero. Programming errors still assert.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace merlin {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// Concatenate any streamable values into one string (GCC 12 has no <format>).
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(cat(std::forward<Args>(args)...));
}

}  // namespace merlin

#define MERLIN_CHECK(cond, ...)              \
  do {                                       \
    if (!(cond)) ::merlin::fail(__VA_ARGS__); \
  } while (0)
