// merlin serve: the OpenAI-compatible HTTP server (src/serve/http_server.h) over the batching engine
// (src/serve/engine.h). docs/SERVER.md documents the endpoints.
#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <thread>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "core/thread_pool.h"
#include "runtime/backend.h"
#include "runtime/model.h"
#include "serve/engine.h"
#include "serve/http_server.h"

namespace merlin::cli {
namespace {

struct ServeArgs {
  std::string model, host = "127.0.0.1", api_key, api_key_file, device = "cpu", kv_type = "f16", alias;
  int port = 8080, parallel = 32, ctx = 0, kv_blocks = 0, kv_block_size = 16, threads = 0, max_queue = 64;
  bool no_prefix_cache = false, quiet = false;
  double stream_interval_ms = 10;
};

std::string read_api_key(const ServeArgs& a) {
  MERLIN_CHECK(a.api_key.empty() || a.api_key_file.empty(), "give --api-key or --api-key-file, not both");
  if (a.api_key_file.empty()) return a.api_key;
  std::ifstream in(a.api_key_file);
  MERLIN_CHECK(in.good(), "cannot read the API key file '", a.api_key_file, "'");
  std::string key;
  std::getline(in, key);
  while (!key.empty() && (key.back() == '\r' || key.back() == ' ' || key.back() == '\t')) key.pop_back();
  MERLIN_CHECK(!key.empty(), "the API key file '", a.api_key_file, "' is empty");
  return key;
}

// Enough blocks for every sequence to reach the full context, but at most 4 GiB of K/V (at least one
// full-context sequence): sequences rarely all run to the end, and the engine queues when blocks run out.
int default_kv_blocks(const Model& model, const ServeArgs& a, int n_ctx, DType kv_type) {
  const ModelConfig& c = model.config();
  const int per_seq = (n_ctx + a.kv_block_size - 1) / a.kv_block_size;
  const uint64_t block_bytes = 2ull * (uint64_t)c.n_layers * (uint64_t)a.kv_block_size * dtype_row_bytes(kv_type, (uint64_t)c.kv_dim());
  const uint64_t budget = 4ull << 30;
  const uint64_t affordable = std::max<uint64_t>((uint64_t)per_seq, budget / std::max<uint64_t>(1, block_bytes));
  return (int)std::min<uint64_t>((uint64_t)per_seq * (uint64_t)a.parallel, affordable);
}

std::string model_id(const ServeArgs& a) {
  if (!a.alias.empty()) return a.alias;
  std::string name = a.model.substr(a.model.find_last_of('/') + 1);
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".gguf") == 0) name.resize(name.size() - 5);
  return name;
}

// SIGINT/SIGTERM are blocked in every thread and taken by one that stops the server: the handlers run on
// ordinary threads, so stopping needs no async-signal-safe tricks. A second signal exits at once.
sigset_t shutdown_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

int serve(const ServeArgs& a) {
  const double t0 = now_seconds();
  // A client that closes its socket mid-response must not kill the server with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  const sigset_t signals = shutdown_signals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before any thread exists, so all inherit it

  serve::ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.api_key = read_api_key(a);
  so.model_id = model_id(a);
  so.log_requests = !a.quiet;
  so.http_threads = a.parallel + a.max_queue + 8;  // every waiting or running request holds a connection
  // A request whose choices could not all be queued at once would be refused (503) however long it retried.
  so.limits.max_choices = std::min(so.limits.max_choices, a.max_queue);

  auto model = Model::load(a.model);
  BackendOptions bo;
  bo.n_threads = a.threads;
  bo.n_ctx = a.ctx;
  bo.n_seq = a.parallel;
  bo.kv_type = parse_kv_type(a.kv_type);
  bo.kv_block_size = a.kv_block_size;
  bo.resident_kv = true;
  const int n_ctx = a.ctx > 0 ? a.ctx : (int)model->config().context_length;
  bo.n_kv_blocks = a.kv_blocks > 0 ? a.kv_blocks : default_kv_blocks(*model, a, n_ctx, bo.kv_type);
  auto backend = make_backend(a.device, *model, bo);
  const std::string backend_name = backend->name();
  const size_t kv_bytes = backend->kv_block_bytes() * (size_t)backend->n_kv_blocks();
  const int kv_blocks = backend->n_kv_blocks();

  serve::EngineOptions eo;
  eo.max_sequences = a.parallel;
  eo.max_queue = a.max_queue;
  eo.prefix_cache = !a.no_prefix_cache;
  eo.stream_interval_ms = a.stream_interval_ms;
  serve::Engine engine(*model, std::move(backend), eo);
  serve::HttpServer server(engine, so);
  const int port = server.bind();

  std::fprintf(stderr,
               "merlin serve: %s (%s, context %d), %s backend, %d threads | %d sequences, queue %d | "
               "KV cache %d blocks x %d positions = %s %s%s | chat template %s%s\n",
               so.model_id.c_str(), format_bytes(model->weight_bytes()).c_str(), engine.n_ctx(), backend_name.c_str(),
               a.threads > 0 ? a.threads : ThreadPool::default_threads(), a.parallel, a.max_queue, kv_blocks,
               a.kv_block_size, format_bytes(kv_bytes).c_str(), a.kv_type.c_str(),
               eo.prefix_cache ? ", prefix cache on" : "", server.chat_template_description().c_str(),
               so.api_key.empty() ? "" : " | API key required");
  std::fprintf(stderr, "merlin serve: listening on http://%s:%d (ready in %.2f s)\n", a.host.c_str(), port, now_seconds() - t0);
  std::fflush(stderr);

  std::thread waiter([&server, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    std::fprintf(stderr, "merlin serve: %s, shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    server.stop();
    sigwait(&signals, &sig);
    std::fprintf(stderr, "merlin serve: second signal, exiting now\n");
    std::_Exit(130);
  });
  engine.start_idle_work();
  server.run();
  // run() only returns after stop(); a second signal from here on still exits at once.
  waiter.detach();
  std::fprintf(stderr, "merlin serve: stopped\n");
  return 0;
}

}  // namespace

Action add_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  app.add_option("-m,--model", a->model, "GGUF model file")->required();
  app.add_option("--host", a->host, "address to listen on (default 127.0.0.1: this machine only)");
  app.add_option("--port", a->port, "TCP port (0: any free port, printed at startup)")->check(CLI::Range(0, 65535));
  app.add_option("--parallel", a->parallel, "sequences generated at once (continuous batching)")->check(CLI::Range(1, 1024));
  app.add_option("-c,--ctx", a->ctx, "context size per sequence (default: the model's)")->check(CLI::Range(0, 1 << 20));
  app.add_option("--kv-blocks", a->kv_blocks, "K/V cache blocks shared by all sequences (default: parallel x ctx, at most 4 GiB)")
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--kv-block-size", a->kv_block_size, "positions per K/V cache block")->check(CLI::Range(1, 4096));
  app.add_option("--kv-type", a->kv_type, "K/V cache type: f16 (default) | f32 | q8_0");
  app.add_option("--max-queue", a->max_queue, "requests that may wait for a sequence slot; beyond it: 503")->check(CLI::Range(1, 1 << 16));
  app.add_option("--api-key", a->api_key, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize");
  app.add_option("--api-key-file", a->api_key_file, "read the API key from the first line of this file");
  app.add_option("--alias", a->alias, "model id reported to clients (default: the file name without .gguf)");
  app.add_option("-t,--threads", a->threads, "compute threads (default: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--device", a->device, "cpu | cuda");
  app.add_option("--stream-interval-ms", a->stream_interval_ms,
                 "hold a streamed token up to this long to send it with the next ones (fewer wake-ups; 0: every token at once)")
      ->check(CLI::Range(0.0, 100.0));
  app.add_flag("--no-prefix-cache", a->no_prefix_cache, "do not reuse the K/V of repeated prompt prefixes");
  app.add_flag("-q,--quiet", a->quiet, "no per-request log lines");
  return [a] { return serve(*a); };
}

}  // namespace merlin::cli
