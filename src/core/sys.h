// Process-level measurements used by the CLI's timing line and by benchmarks.
#pragma once
#include <cstdint>
#include <string>

namespace merlin {

double now_seconds();            // monotonic clock
uint64_t peak_rss_bytes();       // VmHWM of this process
uint64_t current_rss_bytes();    // VmRSS of this process
std::string format_bytes(uint64_t bytes);  // "123.4 MiB"
bool stderr_is_terminal();
// Whether environment variable `name` is set to exactly `value` (the A/B switches of the kernels: "0" = off).
bool env_is(const char* name, const char* value);
// The integer value of environment variable `name` (the kernels' tuning knobs), `dflt` when it is unset.
long env_int(const char* name, long dflt);

}  // namespace merlin
