// Chat prompts: the conversation in `messages` rendered as the text the model was trained to continue.
// We do not run Jinja. A GGUF's tokenizer.chat_template is recognised by the markers it uses (ChatML,
// Llama 3, Llama 2 [INST], Gemma) and rendered by hand-written code; a model without a template, or with
// one we do not recognise, gets the built-in ChatML template (docs/SERVER.md).
#pragma once
#include <string>
#include <vector>

namespace merlin::serve {

struct ChatMessage {
  std::string role;  // system, user, assistant, tool ("developer" is read as system)
  std::string content;
};

enum class ChatFormat { ChatML, Llama3, Llama2, Gemma };

class ChatTemplate {
 public:
  // Picks the format from the text of tokenizer.chat_template ("" when the model has none).
  static ChatTemplate detect(const std::string& jinja_source);
  explicit ChatTemplate(ChatFormat format = ChatFormat::ChatML, bool from_model = false)
      : format_(format), from_model_(from_model) {}

  ChatFormat format() const { return format_; }
  const char* name() const;  // "chatml", "llama3", "llama2", "gemma"
  bool from_model() const { return from_model_; }  // recognised in the model file (else built-in)

  // The prompt text for `messages`, ending with the opening of the assistant's turn. Does not include
  // BOS: the tokenizer adds it when the model wants one.
  std::string render(const std::vector<ChatMessage>& messages) const;
  // Text that closes an assistant turn in this format: generation stops there.
  std::vector<std::string> end_of_turn() const;

 private:
  ChatFormat format_;
  bool from_model_;
};

}  // namespace merlin::serve
