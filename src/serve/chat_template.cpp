#include "serve/chat_template.h"

namespace merlin::serve {
namespace {

bool has(const std::string& s, const char* marker) { return s.find(marker) != std::string::npos; }

std::string role_of(const ChatMessage& m) { return m.role == "developer" ? "system" : m.role; }

std::string render_chatml(const std::vector<ChatMessage>& messages) {
  std::string out;
  for (const ChatMessage& m : messages) out += "<|im_start|>" + role_of(m) + "\n" + m.content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

std::string render_llama3(const std::vector<ChatMessage>& messages) {
  std::string out;
  for (const ChatMessage& m : messages)
    out += "<|start_header_id|>" + role_of(m) + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
  return out + "<|start_header_id|>assistant<|end_header_id|>\n\n";
}

// Llama 2: the system prompt goes inside the first [INST] block; every finished exchange is closed with
// </s> and the next one opened with <s> (the very first <s> is the tokenizer's BOS).
std::string render_llama2(const std::vector<ChatMessage>& messages) {
  std::string out, system;
  bool first_turn = true;
  for (const ChatMessage& m : messages) {
    const std::string role = role_of(m);
    if (role == "system") {
      system += system.empty() ? m.content : "\n" + m.content;
    } else if (role == "assistant") {
      out += " " + m.content + " </s>";
    } else {
      if (!first_turn) out += "<s>";
      out += "[INST] ";
      if (!system.empty()) out += "<<SYS>>\n" + system + "\n<</SYS>>\n\n";
      system.clear();
      out += m.content + " [/INST]";
      first_turn = false;
    }
  }
  return out;
}

// Gemma has no system role: a system message is prefixed to the next user turn.
std::string render_gemma(const std::vector<ChatMessage>& messages) {
  std::string out, system;
  for (const ChatMessage& m : messages) {
    const std::string role = role_of(m);
    if (role == "system") {
      system += m.content + "\n\n";
      continue;
    }
    const std::string turn = role == "assistant" ? "model" : "user";
    out += "<start_of_turn>" + turn + "\n" + (turn == "user" ? system : "") + m.content + "<end_of_turn>\n";
    if (turn == "user") system.clear();
  }
  return out + "<start_of_turn>model\n";
}

}  // namespace

ChatTemplate ChatTemplate::detect(const std::string& src) {
  if (src.empty()) return ChatTemplate(ChatFormat::ChatML, false);
  if (has(src, "<|im_start|>")) return ChatTemplate(ChatFormat::ChatML, true);
  if (has(src, "<|start_header_id|>") && has(src, "<|eot_id|>")) return ChatTemplate(ChatFormat::Llama3, true);
  if (has(src, "<start_of_turn>")) return ChatTemplate(ChatFormat::Gemma, true);
  if (has(src, "[INST]")) return ChatTemplate(ChatFormat::Llama2, true);
  return ChatTemplate(ChatFormat::ChatML, false);
}

const char* ChatTemplate::name() const {
  switch (format_) {
    case ChatFormat::ChatML: return "chatml";
    case ChatFormat::Llama3: return "llama3";
    case ChatFormat::Llama2: return "llama2";
    case ChatFormat::Gemma: return "gemma";
  }
  return "chatml";
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages) const {
  switch (format_) {
    case ChatFormat::ChatML: return render_chatml(messages);
    case ChatFormat::Llama3: return render_llama3(messages);
    case ChatFormat::Llama2: return render_llama2(messages);
    case ChatFormat::Gemma: return render_gemma(messages);
  }
  return render_chatml(messages);
}

std::vector<std::string> ChatTemplate::end_of_turn() const {
  switch (format_) {
    case ChatFormat::ChatML: return {"<|im_end|>"};
    case ChatFormat::Llama3: return {"<|eot_id|>"};
    case ChatFormat::Llama2: return {"</s>"};
    case ChatFormat::Gemma: return {"<end_of_turn>"};
  }
  return {};
}

}  // namespace merlin::serve
