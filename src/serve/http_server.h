// `merlin serve`'s HTTP front end (cpp-httplib): OpenAI-compatible /v1/models, /v1/completions and
// /v1/chat/completions (JSON or SSE streaming), plus /health, /metrics, /tokenize and /detokenize, over one
// Engine. Every error is an OpenAI-shaped JSON body; docs/SERVER.md lists the endpoints and parameters.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "serve/openai_request.h"

namespace merlin::serve {

class Engine;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                 // 0: any free port (bind() returns it)
  std::string api_key;             // empty: no authentication
  std::string model_id = "merlin"; // reported by /v1/models and in every response
  size_t max_body_bytes = 4u << 20;
  int http_threads = 64;           // connections served at once; each streaming client holds one
  RequestLimits limits;
  bool log_requests = true;        // one line per request on stderr
};

class HttpServer {
 public:
  HttpServer(Engine& engine, const ServerOptions& opts);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket; returns the port. Throws merlin::Error when it cannot.
  int bind();
  // Serves until stop(). Call bind() first.
  void run();
  // Thread-safe: in-flight generations are cancelled, streams end, run() returns.
  void stop();
  // The chat template in use, for the startup line ("chatml (built-in)", "llama3 (from the model)").
  std::string chat_template_description() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace merlin::serve
