// The HTTP server in process, over a tiny random model with a SentencePiece vocabulary (BOS, byte-fallback
// tokens): random weights emit byte tokens that split UTF-8 characters, which is what the streaming text
// assembly must get right. The node/curl tests in tests/serve/ cover the default model.
#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "runtime/backend.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "serve/text_assembler.h"
#include "serve_test_util.h"

namespace merlin::serve {
namespace {

using nlohmann::json;

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = test::write_small_model(dir_, DType::F32);
    if (path_.empty()) GTEST_SKIP() << "shared data (" << test::kTokenizerModel << ") not found";
    model_ = Model::load(path_, WeightMemory::Mapped);
    BackendOptions bo;
    bo.n_threads = 2;
    bo.n_seq = 4;
    bo.kv_block_size = 16;
    bo.n_kv_blocks = 4 * 16;
    EngineOptions eo;
    eo.max_sequences = 4;
    engine_ = std::make_unique<Engine>(*model_, make_cpu_backend(*model_, bo), eo);
    ServerOptions so;
    so.port = 0;
    so.log_requests = false;
    so.http_threads = 8;
    server_ = std::make_unique<HttpServer>(*engine_, so);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  void TearDown() override {
    if (server_) server_->stop();
    if (thread_.joinable()) thread_.join();
  }

  // POSTs a JSON body; for a stream, returns the whole SSE text once the stream has ended.
  httplib::Result post(const std::string& path, const json& body) {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(60);
    return cli.Post(path.c_str(), body.dump(), "application/json");
  }

  // The JSON chunks of an SSE body; checks the framing on the way.
  static std::vector<json> events(const std::string& sse) {
    std::vector<json> out;
    size_t pos = 0;
    bool done = false;
    while (pos < sse.size()) {
      const size_t end = sse.find("\n\n", pos);
      EXPECT_NE(end, std::string::npos) << "unterminated event";
      if (end == std::string::npos) break;
      const std::string ev = sse.substr(pos, end - pos);
      pos = end + 2;
      if (ev.rfind(":", 0) == 0) continue;  // comment
      EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
      EXPECT_FALSE(done) << "event after [DONE]";
      if (ev == "data: [DONE]") {
        done = true;
        continue;
      }
      out.push_back(json::parse(ev.substr(6)));
    }
    EXPECT_TRUE(done) << "no data: [DONE]";
    return out;
  }

  test::TempDir dir_;
  std::string path_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  int port_ = 0;
};

// The streamed text, chunk by chunk, must equal the whole output's bytes made valid: no chunk may end inside
// a character (the two halves would each become U+FFFD).
TEST_F(HttpServerTest, StreamingNeverSplitsUtf8Characters) {
  int with_high_bytes = 0;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const json body = {{"messages", {{{"role", "user"}, {"content", "Tell me a story."}}}},
                       {"max_tokens", 64}, {"temperature", 1.5}, {"seed", seed}, {"ignore_eos", true},
                       {"logprobs", true}, {"stream", true}};
    auto res = post("/v1/chat/completions", body);
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    std::string content, raw;
    int n_tokens = 0;
    for (const json& chunk : events(res->body)) {
      const json& choice = chunk["choices"][0];
      if (choice["delta"].contains("content")) content += choice["delta"]["content"].get<std::string>();
      if (!choice["logprobs"].is_null())
        for (const json& t : choice["logprobs"]["content"]) {
          for (int b : t["bytes"]) raw += (char)b;
          ++n_tokens;
        }
    }
    EXPECT_EQ(n_tokens, 64);
    EXPECT_EQ(content, sanitize_utf8(raw)) << "seed " << seed;
    with_high_bytes += std::any_of(raw.begin(), raw.end(), [](char c) { return (unsigned char)c >= 0x80; });
  }
  EXPECT_GT(with_high_bytes, 0) << "the random model produced no multi-byte text; the test proves little";
}

TEST_F(HttpServerTest, PromptsStartWithBosAndStreamEqualsWhole) {
  const std::string prompt = "Once upon a time";
  const Tokenizer& tok = model_->tokenizer();
  ASSERT_TRUE(tok.add_bos());
  json body = {{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0.9}, {"seed", 42}};
  auto whole = post("/v1/completions", body);
  ASSERT_TRUE(whole);
  ASSERT_EQ(whole->status, 200) << whole->body;
  const json r = json::parse(whole->body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], 1 + tok.encode(prompt, true).size());

  body["stream"] = true;
  auto streamed = post("/v1/completions", body);
  ASSERT_TRUE(streamed);
  std::string text;
  for (const json& chunk : events(streamed->body)) text += chunk["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, r["choices"][0]["text"].get<std::string>());
}

TEST_F(HttpServerTest, ErrorsAreOpenAIShaped) {
  httplib::Client cli("127.0.0.1", port_);
  auto res = cli.Post("/v1/completions", "{nope", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  const json e = json::parse(res->body)["error"];
  EXPECT_EQ(e["type"], "invalid_request_error");
  EXPECT_EQ(e["code"], "invalid_json");
  EXPECT_TRUE(e.contains("param"));
  res = cli.Get("/nowhere");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_FALSE(res->get_header_value("X-Request-Id").empty());
  res = cli.Post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 300}}.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);  // context 256
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "context_length_exceeded");
}

}  // namespace
}  // namespace merlin::serve
