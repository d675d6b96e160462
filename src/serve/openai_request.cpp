#include "serve/openai_request.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace merlin::serve {

using nlohmann::json;

ApiError::ApiError(int status_, std::string message_, std::string param_, std::string code_, std::string type_)
    : status(status_), message(std::move(message_)), param(std::move(param_)), code(std::move(code_)), type(std::move(type_)) {
  if (type.empty()) type = status == 401 ? "authentication_error" : status >= 500 ? "server_error" : "invalid_request_error";
}

namespace {

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::null: return "null";
    default: return "an unsupported value";
  }
}

[[noreturn]] void wrong_type(const std::string& name, const char* expected, const json& got) {
  throw ApiError(400, cat("Invalid type for '", name, "': expected ", expected, ", but got ", type_name(got), " instead."),
                 name, "invalid_type");
}

[[noreturn]] void bad_value(const std::string& name, const std::string& why) {
  throw ApiError(400, cat("Invalid value for '", name, "': ", why), name, "invalid_value");
}

// The field's value, or nullptr when it is absent or null (the SDKs send null for "not set").
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> get_number(const json& body, const char* name, double lo, double hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(name, "a number", *v);
  const double x = v->get<double>();
  if (x < lo || x > hi) bad_value(name, cat("expected a value between ", lo, " and ", hi, ", but got ", x, " instead."));
  return x;
}

std::optional<int64_t> get_integer(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(name, "an integer", *v);
  if (v->is_number_unsigned() && v->get<uint64_t>() > (uint64_t)std::numeric_limits<int64_t>::max())
    bad_value(name, cat("expected at most ", hi, "."));
  const int64_t x = v->get<int64_t>();
  if (x < lo) bad_value(name, cat("expected a value >= ", lo, ", but got ", x, " instead."));
  if (x > hi) bad_value(name, cat("expected a value <= ", hi, ", but got ", x, " instead."));
  return x;
}

std::optional<bool> get_bool(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(name, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> get_string(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(name, "a string", *v);
  return v->get<std::string>();
}

// A seed may be any 64-bit integer, signed or not; negative seeds are used as their two's complement.
std::optional<uint64_t> get_seed(const json& body) {
  const json* v = field(body, "seed");
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type("seed", "an integer", *v);
  return v->is_number_unsigned() ? v->get<uint64_t>() : (uint64_t)v->get<int64_t>();
}

std::vector<int32_t> token_array(const json& arr, const char* name) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (const json& t : arr) {
    if (!t.is_number_integer()) wrong_type(name, "integer token ids", t);
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) bad_value(name, cat("token id ", id, " is out of range."));
    ids.push_back((int32_t)id);
  }
  return ids;
}

// prompt: "text" | ["text", ...] | [1, 2, 3] | [[1, 2], [3]]
std::vector<PromptInput> parse_prompts(const json& body) {
  const json* v = field(body, "prompt");
  if (!v) throw ApiError(400, "'prompt' is a required property", "prompt", "missing_required_parameter");
  std::vector<PromptInput> out;
  if (v->is_string()) {
    out.push_back({false, v->get<std::string>(), {}});
    return out;
  }
  if (!v->is_array()) wrong_type("prompt", "a string or an array", *v);
  if (v->empty()) bad_value("prompt", "the prompt array is empty.");
  if ((*v)[0].is_number_integer()) {
    out.push_back({true, "", token_array(*v, "prompt")});
    return out;
  }
  for (const json& p : *v) {
    if (p.is_string()) {
      out.push_back({false, p.get<std::string>(), {}});
    } else if (p.is_array()) {
      if (p.empty()) bad_value("prompt", "a token prompt is empty.");
      out.push_back({true, "", token_array(p, "prompt")});
    } else {
      wrong_type("prompt", "strings or arrays of token ids", p);
    }
  }
  return out;
}

// content: "text" | [{"type": "text", "text": "..."}, ...] | null (an assistant turn that only called tools)
std::string message_content(const json& m, size_t i) {
  const std::string name = cat("messages[", i, "].content");
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) wrong_type(name, "a string or an array of content parts", *it);
  std::string text;
  for (const json& part : *it) {
    if (!part.is_object()) wrong_type(name, "content part objects", part);
    auto type = part.find("type");
    auto t = part.find("text");
    if (type == part.end() || *type != "text" || t == part.end() || !t->is_string())
      bad_value(name, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.");
    if (!text.empty()) text += "\n";
    text += t->get<std::string>();
  }
  return text;
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* v = field(body, "messages");
  if (!v) throw ApiError(400, "'messages' is a required property", "messages", "missing_required_parameter");
  if (!v->is_array()) wrong_type("messages", "an array", *v);
  if (v->empty()) bad_value("messages", "expected an array with minimum length 1, but got an empty array instead.");
  static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool", "function"};
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string name = cat("messages[", i, "]");
    if (!m.is_object()) wrong_type(name, "an object", m);
    auto role = m.find("role");
    if (role == m.end()) throw ApiError(400, cat("'role' is a required property of ", name), name + ".role", "missing_required_parameter");
    if (!role->is_string()) wrong_type(name + ".role", "a string", *role);
    const std::string r = role->get<std::string>();
    if (std::none_of(std::begin(kRoles), std::end(kRoles), [&](const char* k) { return r == k; }))
      bad_value(name + ".role", cat("unknown role '", r, "' (expected system, developer, user, assistant or tool)."));
    out.push_back({r, message_content(m, i)});
  }
  return out;
}

std::vector<std::string> parse_stop(const json& body, const RequestLimits& limits) {
  const json* v = field(body, "stop");
  std::vector<std::string> out;
  if (!v) return out;
  auto add = [&](const json& s) {
    if (!s.is_string()) wrong_type("stop", "a string or an array of strings", s);
    std::string str = s.get<std::string>();
    if (str.size() > limits.max_stop_bytes) bad_value("stop", cat("a stop sequence is longer than ", limits.max_stop_bytes, " bytes."));
    if (!str.empty()) out.push_back(std::move(str));
  };
  if (v->is_array()) {
    if ((int)v->size() > limits.max_stop) bad_value("stop", cat("at most ", limits.max_stop, " stop sequences are supported."));
    for (const json& s : *v) add(s);
  } else {
    add(*v);
  }
  return out;
}

// "logit_bias": {"<token id>": bias in [-100, 100], ...}. Ids are checked against the vocabulary in
// prepare_prompts, which knows the model.
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& body, const RequestLimits& limits) {
  std::vector<std::pair<int32_t, float>> out;
  const json* v = field(body, "logit_bias");
  if (!v) return out;
  if (!v->is_object()) wrong_type("logit_bias", "an object", *v);
  if ((int)v->size() > limits.max_logit_bias)
    bad_value("logit_bias", cat("at most ", limits.max_logit_bias, " tokens may be biased."));
  for (const auto& [key, bias] : v->items()) {
    int64_t id = -1;
    const bool digits = !key.empty() && key.size() <= 9 && std::all_of(key.begin(), key.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    if (digits) id = std::stoll(key);
    if (id < 0) bad_value("logit_bias", cat("keys must be token ids (non-negative integers), but got '", key, "'."));
    if (!bias.is_number()) wrong_type("logit_bias", "numbers as values", bias);
    const double b = bias.get<double>();
    if (!(b >= -100.0 && b <= 100.0))
      bad_value("logit_bias", cat("the bias of token ", id, " must be between -100 and 100, but got ", b, "."));
    // "5" and "05" name the same token: their biases add up (one entry per token, as the samplers expect).
    const auto same = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == (int32_t)id; });
    if (same != out.end()) same->second = (float)((double)same->second + b);
    else out.emplace_back((int32_t)id, (float)b);
  }
  return out;
}

void parse_sampling(const json& body, ApiKind kind, CompletionParams& p, const RequestLimits& limits) {
  SamplingParams& s = p.sampling;
  s.temperature = (float)get_number(body, "temperature", 0.0, 2.0).value_or(1.0);
  s.top_p = (float)get_number(body, "top_p", 0.0, 1.0).value_or(1.0);
  s.top_k = (int)get_integer(body, "top_k", -1, 1 << 20).value_or(0);
  s.min_p = (float)get_number(body, "min_p", 0.0, 1.0).value_or(0.0);
  s.presence_penalty = (float)get_number(body, "presence_penalty", -2.0, 2.0).value_or(0.0);
  s.frequency_penalty = (float)get_number(body, "frequency_penalty", -2.0, 2.0).value_or(0.0);
  s.seed = get_seed(body);
  s.logit_bias = parse_logit_bias(body, limits);
  if (kind == ApiKind::Completion) {
    // Legacy completions: "logprobs": N asks for the sampled token plus N alternatives.
    if (auto n = get_integer(body, "logprobs", 0, 20)) s.top_logprobs = (int)*n;
    return;
  }
  const bool want = get_bool(body, "logprobs").value_or(false);
  const auto top = get_integer(body, "top_logprobs", 0, 20);
  if (top && !want) bad_value("top_logprobs", "'logprobs' must be true when 'top_logprobs' is set.");
  if (want) s.top_logprobs = (int)top.value_or(0);
}

}  // namespace

json parse_json_object(std::string_view body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    throw ApiError(400, cat("We could not parse the JSON body of your request: ", e.what()), "", "invalid_json");
  }
  if (!j.is_object()) throw ApiError(400, cat("The request body must be a JSON object, but got ", type_name(j), "."), "", "invalid_json");
  return j;
}

CompletionParams parse_completion_params(const json& body, ApiKind kind, const RequestLimits& limits) {
  CompletionParams p;
  p.kind = kind;
  p.model = get_string(body, "model").value_or("");
  if (kind == ApiKind::Chat)
    p.messages = parse_messages(body);
  else
    p.prompts = parse_prompts(body);
  // Chat prefers max_completion_tokens (max_tokens is deprecated there); either is accepted.
  auto max_new = get_integer(body, "max_completion_tokens", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
  const char* max_name = "max_completion_tokens";
  if (!max_new) {
    max_new = get_integer(body, "max_tokens", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
    max_name = "max_tokens";
  }
  p.echo = kind == ApiKind::Completion && get_bool(body, "echo").value_or(false);
  const int min_new = p.echo ? 0 : 1;  // with echo, 0 new tokens scores the prompt alone
  if (max_new && *max_new < min_new)
    bad_value(max_name, cat("expected a value >= ", min_new, ", but got ", *max_new, " instead."));
  if (max_new) p.max_tokens = (int)*max_new;
  p.n = (int)get_integer(body, "n", 1, limits.max_n).value_or(1);
  const size_t n_prompts = kind == ApiKind::Chat ? 1 : p.prompts.size();
  if (n_prompts * (size_t)p.n > (size_t)limits.max_choices)
    bad_value("n", cat("prompts × n is ", n_prompts * p.n, "; at most ", limits.max_choices, " choices per request are supported."));
  parse_sampling(body, kind, p, limits);
  p.stop = parse_stop(body, limits);
  p.stream = get_bool(body, "stream").value_or(false);
  p.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    p.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  return p;
}

std::vector<int32_t> tokenize_prompt(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids;
  if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  std::vector<int32_t> body;
  try {
    body = tok.encode(text, true);
  } catch (const Error& e) {
    throw ApiError(400, cat("The prompt could not be tokenized: ", e.what()), "prompt", "invalid_value");
  }
  ids.insert(ids.end(), body.begin(), body.end());
  if (ids.empty()) {
    const int32_t start = tok.bos_id() >= 0 ? tok.bos_id() : tok.eos_id();
    if (start < 0) throw ApiError(400, "The prompt is empty and the model has no BOS/EOS token to start from.", "prompt", "invalid_value");
    ids.push_back(start);
  }
  return ids;
}

namespace {

void check_token_ids(const std::vector<int32_t>& ids, int32_t vocab) {
  for (int32_t id : ids)
    if (id < 0 || id >= vocab) bad_value("prompt", cat("token id ", id, " is out of range [0, ", vocab, ")."));
}

[[noreturn]] void context_exceeded(int n_ctx, size_t n_prompt, std::optional<int> max_tokens, const char* what) {
  std::string msg = cat("This model's maximum context length is ", n_ctx, " tokens. However, ");
  if (max_tokens)
    msg += cat("you requested ", n_prompt + *max_tokens, " tokens (", n_prompt, " in the ", what, ", ", *max_tokens,
               " for the completion). Please reduce the length of the ", what, " or the completion.");
  else
    msg += cat("your ", what, " is ", n_prompt, " tokens. Please reduce the length of the ", what, ".");
  throw ApiError(400, msg, what == std::string("messages") ? "messages" : "prompt", "context_length_exceeded");
}

}  // namespace

PreparedPrompts prepare_prompts(const CompletionParams& params, const Tokenizer& tok, const ChatTemplate& tmpl, int n_ctx) {
  PreparedPrompts out;
  out.stop_strings = params.stop;
  out.stop_at_eos = !params.ignore_eos;
  for (const auto& [id, bias] : params.sampling.logit_bias)
    if (id >= tok.vocab_size())
      bad_value("logit_bias", cat("token id ", id, " is out of range [0, ", tok.vocab_size(), ")."));
  const char* what = params.kind == ApiKind::Chat ? "messages" : "prompt";
  if (params.kind == ApiKind::Chat) {
    out.prompts.push_back(tokenize_prompt(tok, tmpl.render(params.messages)));
    for (const std::string& eot : tmpl.end_of_turn()) {
      out.stop_strings.push_back(eot);
      const std::vector<int32_t> ids = tok.encode(eot, true);
      if (ids.size() == 1) out.stop_tokens.push_back(ids[0]);
    }
  } else {
    for (const PromptInput& p : params.prompts) {
      if (p.is_tokens) check_token_ids(p.tokens, tok.vocab_size());
      out.prompts.push_back(p.is_tokens ? p.tokens : tokenize_prompt(tok, p.text));
    }
  }
  size_t longest = 0;
  for (const auto& ids : out.prompts) longest = std::max(longest, ids.size());
  if (longest >= (size_t)n_ctx) context_exceeded(n_ctx, longest, std::nullopt, what);
  const int room = n_ctx - (int)longest;
  if (params.max_tokens) {
    if (*params.max_tokens > room) context_exceeded(n_ctx, longest, params.max_tokens, what);
    out.max_tokens = *params.max_tokens;
  } else {
    // OpenAI's defaults: 16 new tokens for completions, the rest of the context for chat.
    out.max_tokens = params.kind == ApiKind::Chat ? room : std::min(16, room);
  }
  return out;
}

}  // namespace merlin::serve
