// The HTTP layer's pure parts: request parsing and validation, OpenAI response shapes, chat templates,
// UTF-8-safe streaming text with stop strings, Prometheus metrics.
#include <gtest/gtest.h>

#include <filesystem>

#include "runtime/model.h"
#include "serve/chat_template.h"
#include "serve/http_generation.h"
#include "serve/metrics.h"
#include "serve/openai_request.h"
#include "serve/openai_response.h"
#include "serve/text_assembler.h"

namespace merlin::serve {
namespace {

using nlohmann::json;

CompletionParams parse(const std::string& body, ApiKind kind = ApiKind::Completion) {
  return parse_completion_params(parse_json_object(body), kind);
}

// The status, param and code of the ApiError a body raises (status 0 when it parses).
std::tuple<int, std::string, std::string> error_of(const std::string& body, ApiKind kind = ApiKind::Completion) {
  try {
    parse(body, kind);
  } catch (const ApiError& e) {
    return {e.status, e.param, e.code};
  }
  return {0, "", ""};
}

TEST(TextAssembler, HoldsBackSplitUtf8Characters) {
  TextAssembler t;
  EXPECT_EQ(t.push("caf\xC3"), "caf");
  EXPECT_EQ(t.held(), 1u);
  EXPECT_EQ(t.push("\xA9!"), "\xC3\xA9!");
  EXPECT_EQ(t.push("\xF0\x9F"), "");
  EXPECT_EQ(t.push("\x98"), "");
  EXPECT_EQ(t.push("\x80"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(t.finish(), "");
}

TEST(TextAssembler, IncompleteTailAtTheEndBecomesReplacementCharacter) {
  TextAssembler t;
  EXPECT_EQ(t.push("ab\xE2\x82"), "ab");
  EXPECT_EQ(t.finish(), "\xEF\xBF\xBD");
}

TEST(TextAssembler, InvalidBytesAreReplacedNotHeld) {
  TextAssembler t;
  EXPECT_EQ(t.push("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(t.push("\x80x"), "\xEF\xBF\xBDx");  // a lone continuation byte
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate is not UTF-8
}

TEST(TextAssembler, StopStringAcrossTokenBoundaries) {
  TextAssembler t({"o w", "never"});
  EXPECT_EQ(t.push("Hell"), "Hell");
  EXPECT_EQ(t.push("o"), "");  // "o" may start "o w"
  EXPECT_EQ(t.push(" "), "");
  EXPECT_EQ(t.push("world"), "");
  EXPECT_TRUE(t.stopped());
  EXPECT_EQ(t.push("more"), "");
  EXPECT_EQ(t.finish(), "");
}

TEST(TextAssembler, TextBeforeTheStopStringInTheSameTokenIsKept) {
  TextAssembler t({"\n\n"});
  EXPECT_EQ(t.push("end.\n"), "end.");
  EXPECT_EQ(t.push("\nNext"), "");
  EXPECT_TRUE(t.stopped());
}

TEST(TextAssembler, HeldPrefixIsReleasedWhenItDoesNotComplete) {
  TextAssembler t({"STOP"});
  EXPECT_EQ(t.push("ST"), "");
  EXPECT_EQ(t.push("OR"), "STOR");
  EXPECT_EQ(t.push("ST"), "");
  EXPECT_EQ(t.finish(), "ST");
  EXPECT_FALSE(t.stopped());
}

TEST(TextAssembler, EarliestOfSeveralStopStringsWins) {
  TextAssembler t({"cd", "b"});
  EXPECT_EQ(t.push("abcd"), "a");
}

TEST(ChatTemplate, DetectsKnownTemplatesAndFallsBackToChatML) {
  EXPECT_EQ(ChatTemplate::detect("").format(), ChatFormat::ChatML);
  EXPECT_FALSE(ChatTemplate::detect("").from_model());
  const auto chatml = ChatTemplate::detect("{% for m in messages %}<|im_start|>{{m.role}}\n{{m.content}}<|im_end|>{% endfor %}");
  EXPECT_EQ(chatml.format(), ChatFormat::ChatML);
  EXPECT_TRUE(chatml.from_model());
  EXPECT_EQ(ChatTemplate::detect("<|start_header_id|>{{ role }}<|end_header_id|>{{ content }}<|eot_id|>").format(), ChatFormat::Llama3);
  EXPECT_EQ(ChatTemplate::detect("<start_of_turn>user").format(), ChatFormat::Gemma);
  EXPECT_EQ(ChatTemplate::detect("{{ '[INST] ' + content + ' [/INST]' }}").format(), ChatFormat::Llama2);
  const auto unknown = ChatTemplate::detect("{{ something else }}");
  EXPECT_EQ(unknown.format(), ChatFormat::ChatML);
  EXPECT_FALSE(unknown.from_model());
}

TEST(ChatTemplate, RendersEachFormat) {
  const std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}};
  EXPECT_EQ(ChatTemplate(ChatFormat::ChatML).render(msgs),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(ChatTemplate(ChatFormat::Llama2).render(msgs),
            "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello </s><s>[INST] Bye [/INST]");
  EXPECT_EQ(ChatTemplate(ChatFormat::Gemma).render(msgs),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(ChatTemplate(ChatFormat::Llama3).render({{"developer", "x"}}),
            "<|start_header_id|>system<|end_header_id|>\n\nx<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(ChatTemplate(ChatFormat::ChatML).end_of_turn(), std::vector<std::string>{"<|im_end|>"});
}

TEST(OpenAIRequest, MalformedBodiesAre400) {
  for (const char* body : {"", "{", "[1,2]", "\"text\"", "{\"a\":}", "{\"prompt\": \"\xFF\"}"}) {
    try {
      parse_json_object(body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.code, "invalid_json");
    }
  }
}

TEST(OpenAIRequest, Defaults) {
  const CompletionParams p = parse(R"({"model": "m", "prompt": "hi", "unknown_field": {"x": 1}})");
  EXPECT_EQ(p.model, "m");
  ASSERT_EQ(p.prompts.size(), 1u);
  EXPECT_EQ(p.prompts[0].text, "hi");
  EXPECT_FALSE(p.max_tokens.has_value());
  EXPECT_EQ(p.n, 1);
  EXPECT_FLOAT_EQ(p.sampling.temperature, 1.0f);
  EXPECT_FALSE(p.sampling.seed.has_value());
  EXPECT_FALSE(p.logprobs());
  EXPECT_FALSE(p.stream);
}

// echo (completions only) lets max_tokens be 0: scoring a text without generating.
TEST(OpenAIRequest, EchoAllowsZeroMaxTokens) {
  const CompletionParams e = parse(R"({"prompt": "x", "echo": true, "max_tokens": 0, "logprobs": 0})");
  EXPECT_TRUE(e.echo);
  EXPECT_EQ(*e.max_tokens, 0);
  EXPECT_TRUE(e.logprobs());
  EXPECT_FALSE(parse(R"({"prompt": "x"})").echo);
  EXPECT_FALSE(parse(R"({"messages": [{"role": "user", "content": "hi"}], "echo": true})", ApiKind::Chat).echo);
}

TEST(OpenAIRequest, AllSamplingFields) {
  const CompletionParams p = parse(R"({"prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 40,
      "min_p": 0.1, "seed": -1, "presence_penalty": 1.5, "frequency_penalty": -0.5, "n": 3, "stop": ["a", ""],
      "logprobs": 2, "stream": true, "stream_options": {"include_usage": true}, "logit_bias": {"50256": -100, "7": 2.5}})");
  EXPECT_EQ(*p.max_tokens, 7);
  EXPECT_FLOAT_EQ(p.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(p.sampling.top_p, 0.5f);
  EXPECT_EQ(p.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(p.sampling.min_p, 0.1f);
  EXPECT_EQ(*p.sampling.seed, ~0ull);
  EXPECT_FLOAT_EQ(p.sampling.presence_penalty, 1.5f);
  EXPECT_FLOAT_EQ(p.sampling.frequency_penalty, -0.5f);
  EXPECT_EQ(p.n, 3);
  EXPECT_EQ(p.stop, std::vector<std::string>{"a"});
  EXPECT_EQ(p.sampling.top_logprobs, 2);
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
  // keys in the order nlohmann::json keeps them (sorted as strings)
  EXPECT_EQ(p.sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{50256, -100.0f}, {7, 2.5f}}));
  EXPECT_TRUE(parse(R"({"prompt": "x", "logit_bias": null})").sampling.logit_bias.empty());
  // Two keys naming one token ("5", "05"): one entry, the biases added.
  EXPECT_EQ(parse(R"({"prompt": "x", "logit_bias": {"5": 1.5, "05": 2, "6": 1}})").sampling.logit_bias,
            (std::vector<std::pair<int32_t, float>>{{5, 3.5f}, {6, 1.0f}}));
}

TEST(OpenAIRequest, PromptForms) {
  EXPECT_EQ(parse(R"({"prompt": ["a", "b"]})").prompts.size(), 2u);
  const auto tokens = parse(R"({"prompt": [1, 2, 3]})").prompts;
  ASSERT_EQ(tokens.size(), 1u);
  EXPECT_TRUE(tokens[0].is_tokens);
  EXPECT_EQ(tokens[0].tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(parse(R"({"prompt": [[1], [2, 3]]})").prompts.size(), 2u);
  EXPECT_EQ(error_of(R"({"prompt": []})"), std::make_tuple(400, std::string("prompt"), std::string("invalid_value")));
  EXPECT_EQ(std::get<0>(error_of(R"({"prompt": [1, "a"]})")), 400);
  EXPECT_EQ(std::get<0>(error_of(R"({"prompt": [-1]})")), 400);
  EXPECT_EQ(error_of(R"({"max_tokens": 3})"), std::make_tuple(400, std::string("prompt"), std::string("missing_required_parameter")));
}

TEST(OpenAIRequest, ChatMessages) {
  const CompletionParams p = parse(R"({"messages": [{"role": "system", "content": "s"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null}], "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 9})",
                                   ApiKind::Chat);
  ASSERT_EQ(p.messages.size(), 3u);
  EXPECT_EQ(p.messages[1].content, "a\nb");
  EXPECT_EQ(p.messages[2].content, "");
  EXPECT_EQ(p.sampling.top_logprobs, 3);
  EXPECT_EQ(*p.max_tokens, 9);
  EXPECT_EQ(parse(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})", ApiKind::Chat).sampling.top_logprobs, 0);
  EXPECT_EQ(std::get<1>(error_of(R"({"messages": []})", ApiKind::Chat)), "messages");
  EXPECT_EQ(std::get<1>(error_of(R"({"prompt": "x"})", ApiKind::Chat)), "messages");
  EXPECT_EQ(std::get<1>(error_of(R"({"messages": [{"content": "x"}]})", ApiKind::Chat)), "messages[0].role");
  EXPECT_EQ(std::get<1>(error_of(R"({"messages": [{"role": "wizard", "content": "x"}]})", ApiKind::Chat)), "messages[0].role");
  EXPECT_EQ(std::get<1>(error_of(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", ApiKind::Chat)),
            "messages[0].content");
  EXPECT_EQ(std::get<1>(error_of(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", ApiKind::Chat)),
            "top_logprobs");
  EXPECT_EQ(std::get<2>(error_of(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 2})", ApiKind::Chat)),
            "invalid_type");
}

TEST(OpenAIRequest, WrongTypesAndRangesName400Param) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "x", "temperature": 2.5})", "temperature"},
      {R"({"prompt": "x", "top_p": -0.1})", "top_p"},
      {R"({"prompt": "x", "top_k": 1.5})", "top_k"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": "5"})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 99999999999})", "max_tokens"},
      {R"({"prompt": "x", "n": 0})", "n"},
      {R"({"prompt": "x", "n": 1000})", "n"},
      {R"({"prompt": "x", "seed": "1"})", "seed"},
      {R"({"prompt": "x", "stop": 5})", "stop"},
      {R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]})", "stop"},
      {R"({"prompt": "x", "stream": "yes"})", "stream"},
      {R"({"prompt": "x", "stream_options": 1})", "stream_options"},
      {R"({"prompt": "x", "logprobs": 21})", "logprobs"},
      {R"({"prompt": "x", "presence_penalty": 3})", "presence_penalty"},
      {R"({"prompt": "x", "model": 7})", "model"},
      {R"({"prompt": "x", "logit_bias": [1]})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"x": 1}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"-1": 1}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"": 1}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"12345678901": 1}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"5": 100.5}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"5": "1"}})", "logit_bias"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},  // 0 only with echo
      {R"({"prompt": "x", "echo": 1})", "echo"},
  };
  for (const auto& [body, param] : cases) {
    const auto [status, got, code] = error_of(body);
    EXPECT_EQ(status, 400) << body;
    EXPECT_EQ(got, param) << body;
  }
  // Nulls mean "not set", as the SDKs send them.
  EXPECT_EQ(std::get<0>(error_of(R"({"prompt": "x", "temperature": null, "stop": null, "seed": null})")), 0);
}

class HttpWithDefaultModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf";
    if (std::filesystem::exists(path)) model_ = Model::load(path, WeightMemory::Mapped).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    if (!model_) GTEST_SKIP() << "models/merlin-default.gguf not found";
  }
  static Model* model_;
};
Model* HttpWithDefaultModel::model_ = nullptr;

TEST_F(HttpWithDefaultModel, PreparePromptsChecksTheContext) {
  const Tokenizer& tok = model_->tokenizer();
  const ChatTemplate tmpl;
  auto p = parse(R"({"prompt": "Once upon a time"})");
  PreparedPrompts prep = prepare_prompts(p, tok, tmpl, 512);
  ASSERT_EQ(prep.prompts.size(), 1u);
  EXPECT_EQ(prep.prompts[0], tok.encode("Once upon a time", true));
  EXPECT_EQ(prep.max_tokens, 16);

  p = parse(R"({"prompt": "Once upon a time", "max_tokens": 509})");
  try {
    prepare_prompts(p, tok, tmpl, 512);
    ADD_FAILURE() << "prompt + max_tokens > context accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.code, "context_length_exceeded");
  }
  p = parse(R"({"prompt": [50257]})");
  EXPECT_THROW(prepare_prompts(p, tok, tmpl, 512), ApiError);
  // logit_bias ids are checked against the vocabulary here, where it is known
  p = parse(R"({"prompt": "x", "logit_bias": {"50256": 1}})");
  EXPECT_NO_THROW(prepare_prompts(p, tok, tmpl, 512));
  p = parse(R"({"prompt": "x", "logit_bias": {"50257": 1}})");
  try {
    prepare_prompts(p, tok, tmpl, 512);
    ADD_FAILURE() << "logit_bias past the vocabulary accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "logit_bias");
  }

  std::string long_text;
  for (int i = 0; i < 600; ++i) long_text += " the";
  p = parse(json{{"prompt", long_text}}.dump());
  EXPECT_THROW(prepare_prompts(p, tok, tmpl, 512), ApiError);

  // Chat: the rest of the context by default, and the template's end of turn stops generation.
  p = parse(R"({"messages": [{"role": "user", "content": "Hi"}]})", ApiKind::Chat);
  prep = prepare_prompts(p, tok, tmpl, 512);
  EXPECT_EQ(prep.max_tokens, 512 - (int)prep.prompts[0].size());
  EXPECT_EQ(prep.stop_strings, std::vector<std::string>{"<|im_end|>"});
  // An empty prompt starts from the end-of-text token (GPT-2 has no BOS of its own).
  EXPECT_EQ(tokenize_prompt(tok, ""), std::vector<int32_t>{tok.eos_id()});
}

TEST(OpenAIResponse, CompletionAndChatShapes) {
  ResponseMeta meta{ApiKind::Completion, "cmpl-1", 42, "m", true};
  ChoiceOutput c;
  c.text = "hi";
  c.finish_reason = "length";
  c.logprobs.push_back({"hi", -0.5f, {{"hi", -0.5f}, {"ho", -1.5f}}, 0});
  Json r = response_json(meta, {c}, Usage{3, 1, 2});
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "hi");
  EXPECT_EQ(r["choices"][0]["logprobs"]["tokens"][0], "hi");
  EXPECT_DOUBLE_EQ(r["choices"][0]["logprobs"]["top_logprobs"][0]["ho"].get<double>(), -1.5);
  EXPECT_EQ(r["usage"]["total_tokens"], 4);
  EXPECT_EQ(r["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
  EXPECT_EQ(r.begin().key(), "id");

  meta.kind = ApiKind::Chat;
  r = response_json(meta, {c}, Usage{3, 1, 0});
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "hi");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["bytes"], Json::array({104, 105}));
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 2u);

  ChunkPart part;
  part.role = true;
  part.text = "";
  Json chunk = chunk_json(meta, part);
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(usage_chunk_json(meta, Usage{1, 2, 0})["choices"].size(), 0u);
  EXPECT_EQ(sse_event(Json{{"a", 1}}), "data: {\"a\":1}\n\n");
}

TEST(OpenAIResponse, ErrorShapeAndInvalidUtf8) {
  const Json e = error_json(ApiError(401, "bad key", "", "invalid_api_key"));
  EXPECT_EQ(e["error"]["type"], "authentication_error");
  EXPECT_TRUE(e["error"]["param"].is_null());
  EXPECT_EQ(e["error"]["code"], "invalid_api_key");
  EXPECT_EQ(error_json(ApiError(400, "x"))["error"]["type"], "invalid_request_error");
  EXPECT_EQ(dump(Json("a\xFF")), "\"a\xEF\xBF\xBD\"");
}

TEST(ServeMetrics, PrometheusText) {
  Metrics m;
  m.count_request("/v1/completions", 200);
  m.count_request("/v1/completions", 200);
  m.count_request("/secret/../path", 404);
  m.observe_ttft(0.02);
  m.observe_ttft(3);
  EngineStats s;
  s.kv_blocks_total = 10;
  s.kv_blocks_free = 7;
  s.kv_blocks_cached = 2;
  s.waiting = 3;
  const std::string text = m.render(s);
  EXPECT_NE(text.find("merlin_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("merlin_http_requests_total{endpoint=\"other\",status=\"404\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("merlin_time_to_first_token_seconds_bucket{le=\"0.025\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("merlin_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("merlin_time_to_first_token_seconds_count 2\n"), std::string::npos);
  EXPECT_NE(text.find("merlin_kv_blocks_used 3\n"), std::string::npos);
  EXPECT_NE(text.find("merlin_requests_waiting 3\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE merlin_request_duration_seconds histogram\n"), std::string::npos);
}

}  // namespace
}  // namespace merlin::serve

namespace merlin::serve {
namespace {

// A RequestStream that replays prepared events and records cancel().
class FakeStream : public RequestStream {
 public:
  explicit FakeStream(std::vector<TokenEvent> events) : events_(std::move(events)) {}
  bool next(TokenEvent& event, std::chrono::milliseconds) override {
    if (pos_ >= events_.size()) return false;
    event = events_[pos_++];
    return true;
  }
  void cancel() override { cancelled = true; }
  int n_prompt() const override { return 3; }
  int n_cached_prompt() const override { return 0; }
  bool cancelled = false;

 private:
  std::vector<TokenEvent> events_;
  size_t pos_ = 0;
};

TokenEvent token(int32_t id, FinishReason finish = FinishReason::None) {
  TokenEvent e;
  e.token = id;
  e.logprob = -0.25f;
  e.top_logprobs = {{id, -0.25f}};
  e.finish = finish;
  return e;
}

std::string drain(ChoiceRun& run, ChoiceDelta& all) {
  std::string text;
  for (int i = 0; i < 100 && !run.done(); ++i) {
    ChoiceDelta d;
    if (!run.poll(std::chrono::milliseconds(0), d)) break;
    text += d.text;
    all.logprobs.insert(all.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
    if (d.finish_reason) all.finish_reason = d.finish_reason;
  }
  return text;
}

TEST_F(HttpWithDefaultModel, ChoiceRunCutsAtAStopStringAndCancels) {
  const Tokenizer& tok = model_->tokenizer();
  const std::vector<int32_t> ids = tok.encode(" there was a little girl named Lily", false);
  std::vector<TokenEvent> events;
  for (int32_t id : ids) events.push_back(token(id));
  events.back().finish = FinishReason::Length;
  auto stream = std::make_shared<FakeStream>(events);
  PreparedPrompts prep;
  prep.stop_strings = {"le gi"};  // spans " little" and " girl"
  ChoiceRun run(0, stream, tok, prep, tok.eos_id(), true);
  ChoiceDelta all;
  EXPECT_EQ(drain(run, all), " there was a litt");
  EXPECT_EQ(all.finish_reason, "stop");
  EXPECT_TRUE(stream->cancelled);
  EXPECT_EQ(run.output().text, " there was a litt");
  EXPECT_EQ(run.n_generated(), 5);  // " there", " was", " a", " little", " girl"
  EXPECT_EQ(all.logprobs.size(), 5u);
}

TEST_F(HttpWithDefaultModel, ChoiceRunFlushesHeldTextAtLengthAndIgnoresEos) {
  const Tokenizer& tok = model_->tokenizer();
  const std::vector<int32_t> ids = tok.encode(" a b", false);
  std::vector<TokenEvent> events;
  for (int32_t id : ids) events.push_back(token(id));
  events.back().finish = FinishReason::Length;
  auto stream = std::make_shared<FakeStream>(events);
  PreparedPrompts prep;
  prep.stop_strings = {" b c"};  // " b" is held back as a possible start, then released at the end
  ChoiceRun run(0, stream, tok, prep, tok.eos_id(), false);
  ChoiceDelta all;
  EXPECT_EQ(drain(run, all), " a b");
  EXPECT_EQ(all.finish_reason, "length");
  EXPECT_FALSE(stream->cancelled);
  EXPECT_TRUE(all.logprobs.empty());

  // The engine ends with a token-less Stop event at end-of-text.
  TokenEvent end;
  end.finish = FinishReason::Stop;
  auto s2 = std::make_shared<FakeStream>(std::vector<TokenEvent>{token(ids[0]), end});
  const PreparedPrompts none;
  ChoiceRun r2(0, s2, tok, none, tok.eos_id(), false);
  ChoiceDelta a2;
  EXPECT_EQ(drain(r2, a2), " a");
  EXPECT_EQ(a2.finish_reason, "stop");
  EXPECT_EQ(r2.n_generated(), 1);
}

}  // namespace
}  // namespace merlin::serve
