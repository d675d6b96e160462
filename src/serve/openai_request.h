// OpenAI-compatible request bodies: JSON → validated parameters → token prompts for the engine. Every
// problem with a request is an ApiError carrying the HTTP status and OpenAI's error fields, never a crash.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/chat_template.h"
#include "serve/engine.h"

namespace merlin {
class Tokenizer;
}

namespace merlin::serve {

// An error the client gets as {"error": {"message", "type", "param", "code"}} with HTTP `status`.
struct ApiError : std::exception {
  ApiError(int status, std::string message, std::string param = "", std::string code = "", std::string type = "");
  const char* what() const noexcept override { return message.c_str(); }

  int status;
  std::string message, param, code, type;
};

enum class ApiKind { Completion, Chat };

struct PromptInput {
  bool is_tokens = false;
  std::string text;
  std::vector<int32_t> tokens;
};

struct RequestLimits {
  int max_n = 16;            // n per prompt
  int max_choices = 64;      // prompts × n
  int max_stop = 16;         // stop strings
  size_t max_stop_bytes = 256;
  int max_logit_bias = 1024;  // entries of logit_bias
};

struct CompletionParams {
  ApiKind kind = ApiKind::Completion;
  std::string model;
  std::vector<PromptInput> prompts;   // /v1/completions: one or more
  std::vector<ChatMessage> messages;  // /v1/chat/completions
  std::optional<int> max_tokens;
  int n = 1;
  SamplingParams sampling;  // sampling.top_logprobs >= 0 when log-probabilities were asked for
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  bool ignore_eos = false;  // llama.cpp's extension: generate max_tokens even past end-of-text (benchmarks)
  // Completions: the prompt's text comes back before the generated text, with log-probabilities of its tokens
  // when logprobs is set (the first one null); max_tokens may then be 0 (score a text without generating).
  bool echo = false;
  bool logprobs() const { return sampling.top_logprobs >= 0; }
};

// Parses a request body that must be a JSON object (400 otherwise).
nlohmann::json parse_json_object(std::string_view body);
// Reads and checks every supported field of a completions or chat completions body; unknown fields are
// ignored, fields of the wrong type or out of range are a 400 naming the field in `param`.
CompletionParams parse_completion_params(const nlohmann::json& body, ApiKind kind, const RequestLimits& limits = {});

// What the engine needs, per prompt (choice i of prompt p is index p * n + i).
struct PreparedPrompts {
  std::vector<std::vector<int32_t>> prompts;
  int max_tokens = 16;
  std::vector<std::string> stop_strings;  // the client's, plus the chat template's end of turn
  std::vector<int32_t> stop_tokens;       // special tokens that end a chat turn
  bool stop_at_eos = true;
};

// Tokenizes (chat: renders the template first) and checks the lengths against the context: 400 with
// code "context_length_exceeded" when prompt + max_tokens does not fit.
PreparedPrompts prepare_prompts(const CompletionParams& params, const Tokenizer& tok, const ChatTemplate& tmpl, int n_ctx);

// The token ids of a text as a prompt: BOS first when the model wants it; an empty text becomes the
// BOS (or end-of-text) token alone so that there is something to continue from.
std::vector<int32_t> tokenize_prompt(const Tokenizer& tok, const std::string& text);

}  // namespace merlin::serve
