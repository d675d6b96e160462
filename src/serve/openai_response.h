// OpenAI-shaped response bodies: completion and chat completion objects, their streaming chunks, usage,
// log-probabilities in both formats (legacy completions and chat), errors, and SSE framing.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/openai_request.h"

namespace merlin::serve {

// Output JSON keeps keys in the order written (id, object, created, model, choices, usage), as OpenAI sends them.
using Json = nlohmann::ordered_json;

struct TokenLogprob {
  std::string bytes;  // the token's bytes in context (may be part of a UTF-8 character)
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;  // alternatives' bytes and log-probabilities, most likely first
  size_t text_offset = 0;  // byte offset of the token in the choice's text
  bool has_logprob = true;  // false for an echoed prompt's first token (null in the response)
};

struct ChoiceOutput {
  int index = 0;
  std::string text;
  std::string finish_reason;  // "stop" | "length"
  std::vector<TokenLogprob> logprobs;
};

struct Usage {
  int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

// What every body of one response shares.
struct ResponseMeta {
  ApiKind kind = ApiKind::Completion;
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::string model;
  bool logprobs = false;
};

Json usage_json(const Usage& u);
Json logprobs_json(ApiKind kind, const std::vector<TokenLogprob>& entries);

// The non-streaming response.
Json response_json(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices, const Usage& usage);

// One streaming chunk for choice `index`. Chat: `role` opens the assistant message (first chunk only).
struct ChunkPart {
  int index = 0;
  bool role = false;
  std::optional<std::string> text;
  const std::vector<TokenLogprob>* logprobs = nullptr;  // null or empty: "logprobs": null
  std::optional<std::string> finish_reason;
};
Json chunk_json(const ResponseMeta& meta, const ChunkPart& part);
// The last chunk when stream_options.include_usage: no choices, only usage.
Json usage_chunk_json(const ResponseMeta& meta, const Usage& usage);

Json error_json(const ApiError& e);

// JSON text; invalid UTF-8 in strings (a token's partial bytes) is replaced with U+FFFD rather than thrown.
std::string dump(const Json& j);
// One server-sent event: "data: <json>\n\n".
std::string sse_event(const Json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

// "prefix-" + 24 random hex digits.
std::string random_id(const char* prefix);

}  // namespace merlin::serve
