// Throughput measurements of `merlin bench`, llama-bench style:
//   pp N  prompt processing: N random tokens from an empty cache, in forward passes of n_batch tokens
//         (llama-bench's n_batch, 512), t/s = N / time;
//   tg N  generation: N single-token decode steps from an empty cache (the first token is BOS, then random
//         tokens; what is sampled does not change the cost), t/s = N / time. Without the KV cache every step
//         recomputes the whole sequence so far (generate(use_kv_cache = false)'s cost).
//   tg N xB  B sequences decoding together, one token of each per forward step (what a server's continuous
//         batching does); t/s = B * N / time, the aggregate.
// On a GPU (device "cuda") each tg row also gets its bandwidth roofline: (bytes of weights + bytes of K/V read
// per step) / the device-to-device copy bandwidth measured at the start of the bench.
// Each test runs once untimed (warm-up: page faults of the mmapped weights, thread start) and then `reps`
// times; the result is the mean and sample standard deviation of the per-run t/s, and their median (robust
// on a shared, noisy machine).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace merlin {

class Model;

struct BenchOptions {
  int n_prompt = 512;  // 0: no pp test
  int n_gen = 128;     // 0: no tg test
  int reps = 5;
  int n_threads = 2;
  int n_batch = 512;
  bool kv_cache = true;
  DType kv_type = DType::F16;
  uint64_t seed = 1;
  std::string device = "cpu";          // make_backend device
  std::vector<int> decode_batches{1};  // tg tests: sequences decoding together
  std::function<void(const std::string&)> log;  // progress lines
};

struct BenchTest {
  std::string name;  // "pp512", "tg128"
  int n_prompt = 0, n_gen = 0, batch = 1;
  double bytes_per_step = 0;  // tg: weights + K/V read per decode step
  double roofline_tps = 0;    // tg on a GPU: tokens/s if every step moved bytes_per_step at copy bandwidth
  std::vector<double> tps;  // one per repetition
  double mean = 0, sd = 0, median = 0;
};

// What the device looked like during the bench (GPU runs only).
struct BenchDevice {
  std::string name;
  double copy_gbps = 0;          // measured device-to-device copy bandwidth (read + write)
  uint64_t memory_in_use = 0;    // device memory in use after the tests (weights, K/V, scratch, context)
};

std::vector<BenchTest> bench_model(const Model& model, const BenchOptions& opts, BenchDevice* device = nullptr);

// Bytes of weights one decode step reads: every tensor except, when the output head is separate, the
// token embedding table (of which a step reads one row).
uint64_t weight_bytes_per_token(const Model& model);

}  // namespace merlin
