// Shared helpers for tests: where the shared data lives, temporary directories.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace merlin::test {

inline std::string data_dir() {
  if (const char* env = std::getenv("MERLIN_DATA"); env != nullptr && *env) return env;
  return MERLIN_DEFAULT_DATA_DIR;
}

// Full path of a shared data file, or "" when it is absent.
inline std::string data_file(const std::string& rel) {
  const std::string p = data_dir() + "/" + rel;
  return std::filesystem::exists(p) ? p : std::string();
}

inline std::string merlin_binary() { return std::string(MERLIN_BINARY_DIR) + "/bin/merlin"; }

// A fresh directory under the system temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "merlin-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace merlin::test

// Skips the current test with a clear message when a shared data file is missing.
#define MERLIN_REQUIRE_DATA(var, rel)                                                              \
  const std::string var = ::merlin::test::data_file(rel);                                          \
  if (var.empty()) GTEST_SKIP() << "shared data file '" << rel << "' not found under "            \
                                << ::merlin::test::data_dir() << " (set MERLIN_DATA)"
