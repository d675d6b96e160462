#include "core/sys.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace merlin {
namespace {
uint64_t status_field_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0) return std::strtoull(line.c_str() + n + 1, nullptr, 10);
  return 0;
}
}  // namespace

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

uint64_t peak_rss_bytes() { return status_field_kib("VmHWM") * 1024; }
uint64_t current_rss_bytes() { return status_field_kib("VmRSS") * 1024; }

std::string format_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

bool stderr_is_terminal() { return ::isatty(2) != 0; }

bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::strcmp(e, value) == 0;
}

long env_int(const char* name, long dflt) {
  const char* e = std::getenv(name);
  return e != nullptr ? std::atol(e) : dflt;
}

}  // namespace merlin
