// serve_load: a load generator for `merlin serve` in C++ (cpp-httplib), for machines without node and where a
// Python client is the bottleneck (the GPU machine: scripts/gpu_serve_load.py topped out near 9-10k tok/s at
// 32 clients). C client threads, each on its own keep-alive connection, send /v1/completions requests one after
// another until R are done; every request generates exactly N tokens (ignore_eos), each with its own seed.
// Prints one JSON line like gpu_serve_load.py: aggregate generated tokens/s over the wall time, request latency
// p50 / p99, and with --stream the time to the first streamed chunk (TTFT) p50 / p99.
//
//   serve_load URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS] [-t TEMPERATURE] [--top-k K] [--top-p P]
//              [--min-p P] [--stream]
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::string host = "127.0.0.1";
  int port = 8080;
  int clients = 1, requests = 0, max_tokens = 128, top_k = 0;
  double temperature = 1.0, top_p = 1.0, min_p = 0.0;
  bool stream = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "serve_load: %s\nusage: serve_load URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS] [-t TEMPERATURE] "
               "[--top-k K] [--top-p P] [--min-p P] [--stream]\n",
               why);
  std::exit(2);
}

// http://HOST:PORT[/] only: the server listens on plain HTTP.
void parse_url(const std::string& url, Options& o) {
  const std::string prefix = "http://";
  if (url.rfind(prefix, 0) != 0) usage("the URL must start with http://");
  std::string rest = url.substr(prefix.size());
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) usage("the URL needs a port");
  o.host = rest.substr(0, colon);
  o.port = std::atoi(rest.c_str() + colon + 1);
  if (o.port <= 0 || o.port > 65535) usage("bad port");
}

Options parse(int argc, char** argv) {
  Options o;
  if (argc < 2) usage("no URL");
  parse_url(argv[1], o);
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "-c") o.clients = std::atoi(value());
    else if (a == "-r") o.requests = std::atoi(value());
    else if (a == "-n") o.max_tokens = std::atoi(value());
    else if (a == "-t") o.temperature = std::atof(value());
    else if (a == "--top-k") o.top_k = std::atoi(value());
    else if (a == "--top-p") o.top_p = std::atof(value());
    else if (a == "--min-p") o.min_p = std::atof(value());
    else if (a == "--stream") o.stream = true;
    else usage(("unknown option " + a).c_str());
  }
  if (o.clients < 1 || o.max_tokens < 1) usage("-c and -n must be positive");
  if (o.requests <= 0) o.requests = std::max(8, 2 * o.clients);
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Outcome {
  int tokens = 0;
  bool ok = false;
  double latency = 0, ttft = -1;
};

// One request on the client's connection. Streaming: tokens are the chunks' text pieces counted through the
// final usage chunk (stream_options.include_usage), TTFT the first chunk's arrival.
Outcome run_request(httplib::Client& cli, const Options& o, int i) {
  nlohmann::json body = {{"prompt", "Story " + std::to_string(i) + ": once upon a time"},
                         {"max_tokens", o.max_tokens},
                         {"temperature", o.temperature},
                         {"top_k", o.top_k},
                         {"top_p", o.top_p},
                         {"min_p", o.min_p},
                         {"ignore_eos", true},
                         {"seed", i}};
  if (o.stream) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
  }
  Outcome out;
  const auto t0 = std::chrono::steady_clock::now();
  if (!o.stream) {
    auto res = cli.Post("/v1/completions", body.dump(), "application/json");
    out.latency = seconds_since(t0);
    if (!res || res->status != 200) return out;
    const auto j = nlohmann::json::parse(res->body, nullptr, false);
    if (j.is_discarded()) return out;
    out.tokens = j.value("/usage/completion_tokens"_json_pointer, 0);
    out.ok = out.tokens == o.max_tokens;
    return out;
  }
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (out.ttft < 0) out.ttft = seconds_since(t0);
    buffer.append(data, n);
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = cli.send(req, res, err);
  out.latency = seconds_since(t0);
  if (!sent || res.status != 200) return out;
  // The usage chunk is the last data line before [DONE].
  for (size_t p = buffer.find("data: "); p != std::string::npos; p = buffer.find("data: ", p + 6)) {
    const size_t end = buffer.find('\n', p);
    const auto j = nlohmann::json::parse(buffer.substr(p + 6, end - p - 6), nullptr, false);
    if (!j.is_discarded() && j.contains("usage") && j["usage"].is_object())
      out.tokens = j["usage"].value("completion_tokens", 0);
  }
  out.ok = out.tokens == o.max_tokens && buffer.find("data: [DONE]") != std::string::npos;
  return out;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * (double)v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::atomic<int> next{0};
  std::mutex mu;
  std::vector<Outcome> done;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < o.clients; ++c)
    threads.emplace_back([&] {
      httplib::Client cli(o.host, o.port);
      cli.set_keep_alive(true);
      // Without it a request's header and body writes meet Nagle's algorithm and the server's delayed ACK:
      // ~40 ms per request (measured: one client's TTFT 44 ms, 1.8k tok/s instead of ~4k on the H200).
      cli.set_tcp_nodelay(true);
      cli.set_read_timeout(600, 0);
      for (int i; (i = next.fetch_add(1)) < o.requests;) {
        const Outcome r = run_request(cli, o, i);
        std::lock_guard<std::mutex> lock(mu);
        done.push_back(r);
      }
    });
  for (auto& t : threads) t.join();
  const double wall = seconds_since(t0);
  int tokens = 0, errors = 0;
  std::vector<double> latency, ttft, decode;  // decode: a streamed request's tok/s after its first chunk
  for (const Outcome& r : done) {
    tokens += r.tokens;
    errors += r.ok ? 0 : 1;
    latency.push_back(r.latency);
    if (r.ttft >= 0) ttft.push_back(r.ttft);
    if (r.ttft >= 0 && r.tokens > 1 && r.latency > r.ttft) decode.push_back((r.tokens - 1) / (r.latency - r.ttft));
  }
  nlohmann::json j = {{"clients", o.clients},       {"requests", o.requests},
                      {"temperature", o.temperature}, {"top_k", o.top_k},
                      {"top_p", o.top_p},           {"min_p", o.min_p},
                      {"max_tokens", o.max_tokens}, {"stream", o.stream},
                      {"tokens", tokens},           {"errors", errors},
                      {"seconds", wall},            {"tokens_per_s", wall > 0 ? tokens / wall : 0.0},
                      {"latency_p50_s", percentile(latency, 0.5)}, {"latency_p99_s", percentile(latency, 0.99)}};
  if (o.stream) {
    j["ttft_p50_s"] = percentile(ttft, 0.5);
    j["ttft_p99_s"] = percentile(ttft, 0.99);
    j["per_request_tokens_per_s_p50"] = percentile(decode, 0.5);
  }
  std::printf("%s\n", j.dump().c_str());
  return errors == 0 ? 0 : 1;
}
