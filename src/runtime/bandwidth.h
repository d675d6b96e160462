// Memory read bandwidth, for reporting decode speed against its roofline: generating one token reads
// every weight once, so tokens/s can never exceed bandwidth / bytes of weights read per token.
#pragma once
#include <cstddef>
#include <cstdint>

namespace merlin {

// Median GB/s (1e9 bytes/s) of `reps` passes summing a `bytes` buffer (64-byte AVX-512 loads where the CPU
// has them, four independent accumulators) split over n_threads threads. The buffer is far larger than
// the caches, so this is DRAM bandwidth.
double read_bandwidth_gbps(int n_threads, size_t bytes = size_t{1} << 30, int reps = 5);

}  // namespace merlin
