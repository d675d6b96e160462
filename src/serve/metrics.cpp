#include "serve/metrics.h"

#include <cstdio>
#include <cstdlib>

namespace merlin::serve {
namespace {

const char* kRoutes[] = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/tokenize", "/detokenize"};

// The shortest text that reads back as the same double ("0.025", not "0.025000000000000001").
std::string number(double v) {
  char buf[64];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const char* name, const char* type, const char* help, double value) {
  header(out, name, type, help);
  out += std::string(name) + " " + number(value) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_sum " + number(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}),
      duration_({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}) {}

void Metrics::count_request(std::string_view endpoint, int status) {
  std::string route = "other";
  for (const char* r : kRoutes)
    if (endpoint == r) route = r;
  std::lock_guard lock(mu_);
  ++requests_[{route, status}];
}

void Metrics::observe_ttft(double seconds) {
  std::lock_guard lock(mu_);
  ttft_.observe(seconds);
}

void Metrics::observe_duration(double seconds) {
  std::lock_guard lock(mu_);
  duration_.observe(seconds);
}

std::string Metrics::render(const EngineStats& s) const {
  std::string out;
  {
    std::lock_guard lock(mu_);
    header(out, "merlin_http_requests_total", "counter", "HTTP requests by endpoint and status code.");
    for (const auto& [key, n] : requests_)
      out += "merlin_http_requests_total{endpoint=\"" + key.first + "\",status=\"" + std::to_string(key.second) + "\"} " +
             std::to_string(n) + "\n";
    header(out, "merlin_time_to_first_token_seconds", "histogram", "Time from request arrival to its first generated token.");
    ttft_.render(out, "merlin_time_to_first_token_seconds");
    header(out, "merlin_request_duration_seconds", "histogram", "Time from arrival to the end of a generation request.");
    duration_.render(out, "merlin_request_duration_seconds");
  }
  sample(out, "merlin_requests_finished_total", "counter", "Generation requests the engine finished (any reason).", (double)s.requests_finished);
  sample(out, "merlin_prompt_tokens_total", "counter", "Prompt tokens submitted to the engine.", (double)s.prompt_tokens);
  sample(out, "merlin_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.", (double)s.cached_prompt_tokens);
  sample(out, "merlin_generated_tokens_total", "counter", "Tokens generated.", (double)s.generated_tokens);
  sample(out, "merlin_engine_steps_total", "counter", "Batched forward steps run by the engine.", (double)s.steps);
  sample(out, "merlin_preemptions_total", "counter", "Sequences preempted to free KV blocks.", (double)s.preemptions);
  sample(out, "merlin_generation_tokens_per_second", "gauge", "Generated tokens per second over the last few seconds.", s.generated_tokens_per_second);
  sample(out, "merlin_requests_running", "gauge", "Sequences being generated.", s.running);
  sample(out, "merlin_requests_waiting", "gauge", "Requests waiting in the queue (queue depth).", s.waiting);
  sample(out, "merlin_kv_blocks_total", "gauge", "KV cache blocks.", s.kv_blocks_total);
  sample(out, "merlin_kv_blocks_used", "gauge", "KV cache blocks held by running sequences.", s.kv_blocks_total - s.kv_blocks_free);
  sample(out, "merlin_kv_blocks_free", "gauge", "KV cache blocks not held by any sequence (including cached ones).", s.kv_blocks_free);
  sample(out, "merlin_kv_blocks_cached", "gauge", "Free KV cache blocks that still hold a reusable prompt prefix.", s.kv_blocks_cached);
  sample(out, "merlin_kv_block_size", "gauge", "Positions per KV cache block.", s.kv_block_size);
  return out;
}

}  // namespace merlin::serve
