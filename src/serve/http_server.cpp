#include "serve/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>

#include "core/error.h"
#include "core/sys.h"
#include "runtime/model.h"
#include "serve/chat_template.h"
#include "serve/engine.h"
#include "serve/http_generation.h"
#include "serve/metrics.h"
#include "serve/openai_response.h"
#include "tokenizer/tokenizer.h"

namespace merlin::serve {

using json = Json;
using httplib::Request;
using httplib::Response;

namespace {

// What the per-request log line and the metrics need, filled in as the request goes.
struct RequestInfo {
  std::string id, method, path;
  double t_start = 0;
  bool generation = false;
  bool streaming = false;  // logged by the stream's releaser when it ends, not by the handler
  Usage usage;
  double t_first_token = 0;
  std::string finish;  // finish reasons of the choices, comma-separated
};

// X-Request-Id as sent, if it is a sane token; otherwise one of ours.
std::string request_id(const Request& req) {
  const std::string v = req.get_header_value("X-Request-Id");
  const bool ok = !v.empty() && v.size() <= 128 &&
                  std::all_of(v.begin(), v.end(), [](char c) { return std::isgraph((unsigned char)c) != 0; });
  return ok ? v : random_id("req");
}

void send_json(Response& res, const json& body, int status = 200) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void send_error(Response& res, const ApiError& e) {
  send_json(res, error_json(e), e.status);
  if (e.status == 503) res.set_header("Retry-After", "1");
  if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
}

// Compares without an early exit, so the response time does not reveal how much of a guess was right.
bool same_secret(const std::string& given, const std::string& key) {
  if (given.size() != key.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= (unsigned char)(given[i] ^ key[i]);
  return diff == 0;
}

// The distinct finish reasons of a request's choices, for its log line ("length", "stop,length").
std::string finish_reasons(const Generation& gen) {
  std::vector<std::string> seen;
  for (const auto& run : gen.choices()) {
    const std::string& r = run->output().finish_reason;
    const std::string reason = r.empty() ? "cancelled" : r;
    if (std::find(seen.begin(), seen.end(), reason) == seen.end()) seen.push_back(reason);
  }
  std::string out;
  for (const std::string& r : seen) out += (out.empty() ? "" : ",") + r;
  return out;
}

}  // namespace

struct HttpServer::Impl {
  Impl(Engine& e, const ServerOptions& o)
      : engine(e),
        model(e.model()),
        tok(model.tokenizer()),
        opts(o),
        tmpl(ChatTemplate::detect(model.file().metadata().get_string("tokenizer.chat_template", ""))),
        created((int64_t)std::time(nullptr)) {}

  Engine& engine;
  const Model& model;
  const Tokenizer& tok;
  ServerOptions opts;
  ChatTemplate tmpl;
  int64_t created;
  Metrics metrics;
  httplib::Server svr;
  std::atomic<bool> stopping{false};
  int listen_fd = -1;  // the listening socket, once bind() made it

  using Body = std::function<void(const Request&, const std::string& body, Response&, std::shared_ptr<RequestInfo>)>;

  void setup();
  void post(const std::string& path, Body fn, bool auth);
  void get(const std::string& path, Body fn, bool auth);
  void method_not_allowed(const std::string& path, const char* allowed);
  void handle(const Request& req, Response& res, const httplib::ContentReader* reader, const Body& fn, bool auth);
  std::string read_body(const Request& req, const httplib::ContentReader& reader, Response& res);
  void authorize(const Request& req) const;
  void finish(const RequestInfo& info, int status);
  httplib::Server::HandlerResponse on_http_error(const Request& req, Response& res);

  void models(Response& res, const std::string& only);
  void health(Response& res);
  void tokenize(const std::string& body, Response& res);
  void detokenize(const std::string& body, Response& res);
  void completions(ApiKind kind, const std::string& body, Response& res, std::shared_ptr<RequestInfo> info);
  void respond_whole(Generation& gen, const ResponseMeta& meta, Response& res, RequestInfo& info);
  void respond_stream(std::unique_ptr<Generation> gen, const ResponseMeta& meta, bool include_usage, Response& res,
                      std::shared_ptr<RequestInfo> info);
};

void HttpServer::Impl::setup() {
  const int threads = std::max(4, opts.http_threads);
  svr.new_task_queue = [threads] { return new httplib::ThreadPool((size_t)threads); };
  svr.set_payload_max_length(opts.max_body_bytes);
  svr.set_tcp_nodelay(true);
  // Remembers the listening socket so bind() can widen its backlog (see there).
  svr.set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd = sock;
  });
  svr.set_keep_alive_max_count(1000);
  svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const Request& req, Response& res) { return on_http_error(req, res); }));

  get("/health", [this](const Request&, const std::string&, Response& res, auto) { health(res); }, false);
  get("/metrics", [this](const Request&, const std::string&, Response& res, auto) {
    res.set_content(metrics.render(engine.stats()), "text/plain; version=0.0.4; charset=utf-8");
  }, false);
  get("/v1/models", [this](const Request&, const std::string&, Response& res, auto) { models(res, ""); }, true);
  get(R"(/v1/models/([^/]+))", [this](const Request& req, const std::string&, Response& res, auto) { models(res, req.matches[1]); }, true);
  post("/v1/completions", [this](const Request&, const std::string& body, Response& res, auto info) {
    completions(ApiKind::Completion, body, res, info);
  }, true);
  post("/v1/chat/completions", [this](const Request&, const std::string& body, Response& res, auto info) {
    completions(ApiKind::Chat, body, res, info);
  }, true);
  post("/tokenize", [this](const Request&, const std::string& body, Response& res, auto) { tokenize(body, res); }, true);
  post("/detokenize", [this](const Request&, const std::string& body, Response& res, auto) { detokenize(body, res); }, true);
  for (const char* p : {"/health", "/metrics", "/v1/models"}) method_not_allowed(p, "GET");
  for (const char* p : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}) method_not_allowed(p, "POST");
}

void HttpServer::Impl::post(const std::string& path, Body fn, bool auth) {
  svr.Post(path, [this, fn, auth](const Request& req, Response& res, const httplib::ContentReader& reader) {
    handle(req, res, &reader, fn, auth);
  });
}

void HttpServer::Impl::get(const std::string& path, Body fn, bool auth) {
  svr.Get(path, [this, fn, auth](const Request& req, Response& res) { handle(req, res, nullptr, fn, auth); });
}

void HttpServer::Impl::method_not_allowed(const std::string& path, const char* allowed) {
  Body fn = [allowed](const Request& req, const std::string&, Response& res, auto) {
    res.set_header("Allow", allowed);
    throw ApiError(405, cat("Method ", req.method, " is not allowed for ", req.path, " (use ", allowed, ")."), "", "method_not_allowed");
  };
  // Only the methods the route does not have: registering GET for a GET route would shadow it.
  if (std::string(allowed) == "GET") {
    svr.Post(path, [this, fn](const Request& req, Response& res, const httplib::ContentReader& reader) { handle(req, res, &reader, fn, false); });
  } else {
    svr.Get(path, [this, fn](const Request& req, Response& res) { handle(req, res, nullptr, fn, false); });
  }
  svr.Put(path, [this, fn](const Request& req, Response& res, const httplib::ContentReader& reader) { handle(req, res, &reader, fn, false); });
  svr.Delete(path, [this, fn](const Request& req, Response& res, const httplib::ContentReader& reader) { handle(req, res, &reader, fn, false); });
}

// Reads the body ourselves, so that a chunked upload is held to the same size limit as one with a
// Content-Length (cpp-httplib only checks the latter).
std::string HttpServer::Impl::read_body(const Request& req, const httplib::ContentReader& reader, Response& res) {
  std::string body;
  // Without Content-Length or chunked encoding a request has no body (RFC 9112 6.3); reading would wait
  // for the read timeout.
  if (!req.has_header("Content-Length") && req.get_header_value("Transfer-Encoding").find("chunked") == std::string::npos)
    return body;
  bool too_large = false;
  size_t dropped = 0;
  const bool ok = reader([&](const char* data, size_t n) {
    if (too_large || body.size() + n > opts.max_body_bytes) {
      // Read on (up to a bound) and drop it, so that the connection stays in step for the 413 response.
      too_large = true;
      dropped += n;
      return dropped <= 4 * opts.max_body_bytes;
    }
    body.append(data, n);
    return true;
  });
  if (too_large || res.status == 413)
    throw ApiError(413, cat("The request body is larger than the limit of ", opts.max_body_bytes, " bytes."), "", "request_too_large");
  if (!ok) throw ApiError(400, "The request body could not be read.", "", "invalid_body");
  return body;
}

void HttpServer::Impl::authorize(const Request& req) const {
  if (opts.api_key.empty()) return;
  const std::string auth = req.get_header_value("Authorization");
  const std::string prefix = "Bearer ";
  if (auth.empty()) throw ApiError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", "", "invalid_api_key");
  const std::string key = auth.compare(0, prefix.size(), prefix) == 0 ? auth.substr(prefix.size()) : "";
  if (!same_secret(key, opts.api_key)) throw ApiError(401, "Incorrect API key provided.", "", "invalid_api_key");
}

void HttpServer::Impl::handle(const Request& req, Response& res, const httplib::ContentReader* reader, const Body& fn, bool auth) {
  auto info = std::make_shared<RequestInfo>();
  info->id = request_id(req);
  info->method = req.method;
  info->path = req.path;
  info->t_start = now_seconds();
  res.set_header("X-Request-Id", info->id);
  try {
    const std::string body = reader ? read_body(req, *reader, res) : "";
    if (auth) authorize(req);
    fn(req, body, res, info);
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (const std::bad_alloc&) {
    send_error(res, ApiError(500, "out of memory", "", "internal_error"));
  } catch (const std::exception& e) {
    send_error(res, ApiError(500, cat("internal error: ", e.what()), "", "internal_error"));
  }
  if (res.status == -1) res.status = 200;
  if (!info->streaming) finish(*info, res.status);
}

void HttpServer::Impl::finish(const RequestInfo& info, int status) {
  const double t_end = now_seconds();
  metrics.count_request(info.path, status);
  if (info.generation) {
    metrics.observe_duration(t_end - info.t_start);
    if (info.t_first_token > 0) metrics.observe_ttft(info.t_first_token - info.t_start);
  }
  if (!opts.log_requests) return;
  std::string line = cat("[serve] ", info.id, " ", info.method, " ", info.path, " ", status);
  if (info.generation) {
    const double ttft_ms = info.t_first_token > 0 ? (info.t_first_token - info.t_start) * 1e3 : 0;
    const double decode_s = info.t_first_token > 0 ? t_end - info.t_first_token : 0;
    const int n_out = info.usage.completion_tokens;
    const double tps = decode_s > 0 && n_out > 1 ? (n_out - 1) / decode_s : 0;
    char buf[256];
    std::snprintf(buf, sizeof buf, " | in %d (cached %d) | out %d | ttft %.1f ms | %.1f tok/s | %.3f s | %s",
                  info.usage.prompt_tokens, info.usage.cached_tokens, n_out, ttft_ms, tps, t_end - info.t_start,
                  info.finish.empty() ? "-" : info.finish.c_str());
    line += buf;
  } else {
    char buf[64];
    std::snprintf(buf, sizeof buf, " | %.3f s", t_end - info.t_start);
    line += buf;
  }
  line += "\n";
  std::fputs(line.c_str(), stderr);
}

// Responses cpp-httplib makes on its own (unknown route, unparsable request line) get an OpenAI body.
httplib::Server::HandlerResponse HttpServer::Impl::on_http_error(const Request& req, Response& res) {
  if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // one of our own errors
  RequestInfo info;
  info.id = request_id(req);
  info.method = req.method.empty() ? "-" : req.method;
  info.path = req.path.empty() ? "-" : req.path;
  info.t_start = now_seconds();
  res.set_header("X-Request-Id", info.id);
  if (res.status == 404)
    send_error(res, ApiError(404, cat("Unknown endpoint: ", req.method, " ", req.path), "", "unknown_url"));
  else if (res.status == 413)
    send_error(res, ApiError(413, cat("The request body is larger than the limit of ", opts.max_body_bytes, " bytes."), "", "request_too_large"));
  else
    send_error(res, ApiError(res.status, cat("Bad request (HTTP ", res.status, ")."), "", "bad_request"));
  finish(info, res.status);
  return httplib::Server::HandlerResponse::Handled;
}

void HttpServer::Impl::models(Response& res, const std::string& only) {
  if (!only.empty() && only != opts.model_id)
    throw ApiError(404, cat("The model '", only, "' does not exist; this server serves '", opts.model_id, "'."), "model", "model_not_found");
  const ModelConfig& c = model.config();
  json m = {{"id", opts.model_id}, {"object", "model"}, {"created", created}, {"owned_by", "merlin"},
            {"meta", {{"n_ctx", engine.n_ctx()}, {"n_ctx_train", c.context_length}, {"n_vocab", c.vocab_size},
                      {"n_params", c.n_params()}, {"size", model.weight_bytes()},
                      {"chat_template", tmpl.name()}}}};
  if (!only.empty()) return send_json(res, m);
  send_json(res, {{"object", "list"}, {"data", json::array({m})}});
}

void HttpServer::Impl::health(Response& res) {
  const EngineStats s = engine.stats();
  send_json(res, {{"status", stopping ? "shutting_down" : "ok"}, {"model", opts.model_id},
                  {"requests_running", s.running}, {"requests_waiting", s.waiting}},
            stopping ? 503 : 200);
}

// llama.cpp's shape: {"content": "text", "add_special": false, "with_pieces": false} -> {"tokens": [...]}
void HttpServer::Impl::tokenize(const std::string& body, Response& res) {
  const nlohmann::json j = parse_json_object(body);
  auto content = j.find("content");
  if (content == j.end() || content->is_null()) throw ApiError(400, "'content' is a required property", "content", "missing_required_parameter");
  if (!content->is_string()) throw ApiError(400, "Invalid type for 'content': expected a string.", "content", "invalid_type");
  auto flag = [&](const char* name) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) return false;
    if (!it->is_boolean()) throw ApiError(400, cat("Invalid type for '", name, "': expected a boolean."), name, "invalid_type");
    return it->get<bool>();
  };
  const bool add_special = flag("add_special"), with_pieces = flag("with_pieces");
  std::vector<int32_t> ids;
  if (add_special && tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  try {
    const auto body_ids = tok.encode(content->get<std::string>(), true);
    ids.insert(ids.end(), body_ids.begin(), body_ids.end());
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "content", "invalid_value");
  }
  json tokens = json::array();
  int32_t prev = -1;
  for (int32_t id : ids) {
    if (with_pieces)
      tokens.push_back({{"id", id}, {"piece", tok.decode_token(id, prev)}});
    else
      tokens.push_back(id);
    prev = id;
  }
  send_json(res, {{"tokens", tokens}});
}

void HttpServer::Impl::detokenize(const std::string& body, Response& res) {
  const nlohmann::json j = parse_json_object(body);
  auto tokens = j.find("tokens");
  if (tokens == j.end() || tokens->is_null()) throw ApiError(400, "'tokens' is a required property", "tokens", "missing_required_parameter");
  if (!tokens->is_array()) throw ApiError(400, "Invalid type for 'tokens': expected an array of integers.", "tokens", "invalid_type");
  std::vector<int32_t> ids;
  for (const nlohmann::json& t : *tokens) {
    if (!t.is_number_integer()) throw ApiError(400, "Invalid type for 'tokens': expected an array of integers.", "tokens", "invalid_type");
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= tok.vocab_size())
      throw ApiError(400, cat("token id ", id, " is out of range [0, ", tok.vocab_size(), ")."), "tokens", "invalid_value");
    ids.push_back((int32_t)id);
  }
  send_json(res, {{"content", tok.decode(ids)}});
}

void HttpServer::Impl::completions(ApiKind kind, const std::string& body, Response& res, std::shared_ptr<RequestInfo> info) {
  if (stopping) throw ApiError(503, "The server is shutting down.", "", "shutting_down", "server_error");
  const CompletionParams params = parse_completion_params(parse_json_object(body), kind, opts.limits);
  PreparedPrompts prepared = prepare_prompts(params, tok, tmpl, engine.n_ctx());
  info->generation = true;
  auto gen = std::make_unique<Generation>(engine, tok, params, std::move(prepared), info->id);
  ResponseMeta meta{kind, random_id(kind == ApiKind::Chat ? "chatcmpl" : "cmpl"), (int64_t)std::time(nullptr), opts.model_id,
                    params.logprobs()};
  if (params.stream)
    respond_stream(std::move(gen), meta, params.include_usage, res, info);
  else
    respond_whole(*gen, meta, res, *info);
}

void HttpServer::Impl::respond_whole(Generation& gen, const ResponseMeta& meta, Response& res, RequestInfo& info) {
  std::vector<std::pair<int, ChoiceDelta>> deltas;
  bool done = false;
  while (!done && !stopping) {
    done = gen.pump(std::chrono::milliseconds(250), deltas);
    deltas.clear();
  }
  if (!done) gen.cancel_all();
  info.usage = gen.usage();
  info.t_first_token = gen.first_token_time();
  info.finish = finish_reasons(gen);
  if (!done) throw ApiError(503, "The server is shutting down.", "", "shutting_down", "server_error");
  if (!gen.error().empty()) throw ApiError(500, cat("Generation failed: ", gen.error()), "", "internal_error", "server_error");
  std::vector<ChoiceOutput> outputs;
  for (const auto& run : gen.choices()) outputs.push_back(run->output());
  send_json(res, response_json(meta, outputs, info.usage));
}

namespace {

// The SSE side of one streaming response; shared by the content provider and its releaser.
struct SseStream {
  std::unique_ptr<Generation> gen;
  ResponseMeta meta;
  bool include_usage = false;
  bool opened = false;
  double last_write = 0;
  std::shared_ptr<RequestInfo> info;

  // SSE text for what the choices produced since the last call.
  std::string chunks(const std::vector<std::pair<int, ChoiceDelta>>& deltas) const {
    std::string out;
    for (const auto& [index, d] : deltas) out += meta.kind == ApiKind::Chat ? chat_chunks(index, d) : completion_chunk(index, d);
    return out;
  }

  // Completions: text, log-probabilities and the finish reason travel in one chunk.
  std::string completion_chunk(int index, const ChoiceDelta& d) const {
    ChunkPart part;
    part.index = index;
    part.text = d.text;
    part.logprobs = &d.logprobs;
    part.finish_reason = d.finish_reason;
    return sse_event(chunk_json(meta, part));
  }

  // Chat: the content in one chunk, then (as OpenAI does) the finish reason in its own with an empty delta.
  std::string chat_chunks(int index, const ChoiceDelta& d) const {
    std::string out;
    if (!d.text.empty() || !d.logprobs.empty()) {
      ChunkPart part;
      part.index = index;
      part.text = d.text;
      part.logprobs = &d.logprobs;
      out += sse_event(chunk_json(meta, part));
    }
    if (d.finish_reason) {
      ChunkPart end;
      end.index = index;
      end.finish_reason = d.finish_reason;
      out += sse_event(chunk_json(meta, end));
    }
    return out;
  }

  std::string opening() const {
    std::string out;
    if (meta.kind != ApiKind::Chat) return out;
    for (const auto& run : gen->choices()) {
      ChunkPart part;
      part.index = run->index();
      part.role = true;
      part.text = "";
      out += sse_event(chunk_json(meta, part));
    }
    return out;
  }

  // One call of the content provider: waits up to 100 ms for tokens and sends what came. False when the
  // client is gone (the choices are cancelled then).
  bool step(httplib::DataSink& sink, bool stopping) {
    std::string out;
    if (!opened) {
      out = opening();
      opened = true;
    }
    std::vector<std::pair<int, ChoiceDelta>> deltas;
    bool done = gen->pump(std::chrono::milliseconds(100), deltas);
    out += chunks(deltas);
    if (stopping && !done) {
      gen->cancel_all();
      out += sse_event(error_json(ApiError(503, "The server is shutting down.", "", "shutting_down", "server_error")));
      out += kSseDone;
      done = true;
    } else if (done) {
      out += closing();
    }
    // While a request waits in the queue nothing is written, and a client that left would go unnoticed:
    // an SSE comment once a second finds out (clients ignore comments).
    const double now = now_seconds();
    if (out.empty() && now - last_write > 1.0) out = ": keep-alive\n\n";
    if (!out.empty()) {
      if (!sink.write(out.data(), out.size())) {
        gen->cancel_all();
        return false;
      }
      last_write = now;
    }
    if (done) sink.done();
    return true;
  }

  std::string closing() const {
    std::string out;
    const std::string error = gen->error();
    if (!error.empty()) out += sse_event(error_json(ApiError(500, cat("Generation failed: ", error), "", "internal_error", "server_error")));
    if (include_usage) out += sse_event(usage_chunk_json(meta, gen->usage()));
    return out + kSseDone;
  }
};

}  // namespace

void HttpServer::Impl::respond_stream(std::unique_ptr<Generation> gen, const ResponseMeta& meta, bool include_usage,
                                      Response& res, std::shared_ptr<RequestInfo> info) {
  auto sse = std::make_shared<SseStream>();
  sse->gen = std::move(gen);
  sse->meta = meta;
  sse->include_usage = include_usage;
  sse->info = std::move(info);
  sse->last_write = now_seconds();
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  auto provider = [this, sse](size_t, httplib::DataSink& sink) { return sse->step(sink, stopping); };
  // Runs when the response is finished or abandoned (client gone): free the engine's blocks, then log.
  auto releaser = [this, sse](bool complete) {
    sse->gen->cancel_all();
    sse->info->usage = sse->gen->usage();
    sse->info->t_first_token = sse->gen->first_token_time();
    sse->info->finish = complete ? finish_reasons(*sse->gen) : "disconnected";
    finish(*sse->info, 200);
  };
  res.set_chunked_content_provider("text/event-stream", provider, releaser);
  sse->info->streaming = true;
}

HttpServer::HttpServer(Engine& engine, const ServerOptions& opts) : impl_(std::make_unique<Impl>(engine, opts)) { impl_->setup(); }

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  const ServerOptions& o = impl_->opts;
  int port = o.port;
  if (o.port == 0) {
    port = impl_->svr.bind_to_any_port(o.host);
    MERLIN_CHECK(port > 0, "cannot listen on ", o.host, " (any port)");
  } else {
    MERLIN_CHECK(impl_->svr.bind_to_port(o.host, o.port), "cannot listen on ", o.host, ":", o.port,
                 " (in use, or not an address of this machine)");
  }
  // cpp-httplib listens with a backlog of 5: when more clients connect at once than the accept thread
  // takes in, the kernel drops their SYNs and they retry a second later (32 clients starting together
  // saw time-to-first-token p99 of 1 s). Calling listen() again on a listening socket only changes the
  // backlog.
  if (impl_->listen_fd >= 0) ::listen(impl_->listen_fd, SOMAXCONN);
  return port;
}

void HttpServer::run() { impl_->svr.listen_after_bind(); }

void HttpServer::stop() {
  impl_->stopping = true;
  impl_->svr.stop();
}

std::string HttpServer::chat_template_description() const {
  return cat(impl_->tmpl.name(), impl_->tmpl.from_model() ? " (from the model)" : " (built-in)");
}

}  // namespace merlin::serve
