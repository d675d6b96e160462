#include "serve/openai_response.h"

#include <atomic>
#include <chrono>
#include <cstdio>

#include "core/rng.h"
#include "serve/text_assembler.h"

namespace merlin::serve {

using json = Json;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) { return "data: " + dump(j) + "\n\n"; }

std::string random_id(const char* prefix) {
  // Unique, not secret: a clock-seeded counter is enough for response ids.
  static std::atomic<uint64_t> counter{(uint64_t)std::chrono::steady_clock::now().time_since_epoch().count()};
  Rng rng(counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx%08llx", (unsigned long long)rng.next_u64(), (unsigned long long)(rng.next_u64() >> 32));
  return std::string(prefix) + "-" + buf;
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

namespace {

json byte_array(const std::string& s) {
  json a = json::array();
  for (unsigned char c : s) a.push_back((int)c);
  return a;
}

// Legacy completions format: parallel arrays, alternatives as {text: logprob} maps.
json completion_logprobs(const std::vector<TokenLogprob>& entries) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  for (const TokenLogprob& e : entries) {
    tokens.push_back(sanitize_utf8(e.bytes));
    offsets.push_back(e.text_offset);
    if (!e.has_logprob) {  // an echoed prompt's first token: nothing before it to condition on
      token_logprobs.push_back(nullptr);
      top.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(e.logprob);
    json alternatives = json::object();
    for (const auto& [text, lp] : e.top) {
      const std::string key = sanitize_utf8(text);
      if (!alternatives.contains(key)) alternatives[key] = lp;  // two ids can decode alike; keep the likelier
    }
    top.push_back(std::move(alternatives));
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

// Chat format: one object per token with its raw bytes, so a client can rebuild split characters.
json chat_logprobs(const std::vector<TokenLogprob>& entries) {
  json content = json::array();
  for (const TokenLogprob& e : entries) {
    json top = json::array();
    for (const auto& [text, lp] : e.top)
      top.push_back({{"token", sanitize_utf8(text)}, {"logprob", lp}, {"bytes", byte_array(text)}});
    content.push_back({{"token", sanitize_utf8(e.bytes)}, {"logprob", e.logprob}, {"bytes", byte_array(e.bytes)}, {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json object_name(ApiKind kind, bool chunk) {
  if (kind == ApiKind::Completion) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}

json envelope(const ResponseMeta& meta, bool chunk) {
  return {{"id", meta.id}, {"object", object_name(meta.kind, chunk)}, {"created", meta.created}, {"model", meta.model},
          {"system_fingerprint", "merlin"}};
}

}  // namespace

json logprobs_json(ApiKind kind, const std::vector<TokenLogprob>& entries) {
  return kind == ApiKind::Chat ? chat_logprobs(entries) : completion_logprobs(entries);
}

json response_json(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices, const Usage& usage) {
  json out = envelope(meta, false);
  json arr = json::array();
  for (const ChoiceOutput& c : choices) {
    json choice = {{"index", c.index}, {"finish_reason", c.finish_reason}};
    choice["logprobs"] = meta.logprobs ? logprobs_json(meta.kind, c.logprobs) : json(nullptr);
    if (meta.kind == ApiKind::Chat)
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
    else
      choice["text"] = c.text;
    arr.push_back(std::move(choice));
  }
  out["choices"] = std::move(arr);
  out["usage"] = usage_json(usage);
  return out;
}

json chunk_json(const ResponseMeta& meta, const ChunkPart& part) {
  json out = envelope(meta, true);
  json choice = {{"index", part.index}};
  if (meta.kind == ApiKind::Chat) {
    json delta = json::object();
    if (part.role) delta["role"] = "assistant";
    if (part.text) delta["content"] = *part.text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = part.text.value_or("");
  }
  const bool has_lp = part.logprobs && !part.logprobs->empty();
  choice["logprobs"] = has_lp ? logprobs_json(meta.kind, *part.logprobs) : json(nullptr);
  choice["finish_reason"] = part.finish_reason ? json(*part.finish_reason) : json(nullptr);
  out["choices"] = json::array({std::move(choice)});
  return out;
}

json usage_chunk_json(const ResponseMeta& meta, const Usage& usage) {
  json out = envelope(meta, true);
  out["choices"] = json::array();
  out["usage"] = usage_json(usage);
  return out;
}

json error_json(const ApiError& e) {
  auto or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
  return {{"error", {{"message", e.message}, {"type", e.type}, {"param", or_null(e.param)}, {"code", or_null(e.code)}}}};
}

}  // namespace merlin::serve
