// Prometheus text exposition for GET /metrics: HTTP requests by endpoint and status, time to first token
// and request duration histograms (recorded by the HTTP layer), and the engine's counters and gauges
// (tokens, throughput, queue depth, running sequences, KV blocks) read from EngineStats at scrape time.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "serve/engine.h"

namespace merlin::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // Appends the _bucket/_sum/_count lines (the caller holds whatever lock guards this histogram).
  void render(std::string& out, const std::string& name) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last one is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  // `endpoint` is a route path; anything that is not one of ours is counted as "other".
  void count_request(std::string_view endpoint, int status);
  void observe_ttft(double seconds);
  void observe_duration(double seconds);
  std::string render(const EngineStats& engine) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  Histogram ttft_, duration_;
};

}  // namespace merlin::serve
