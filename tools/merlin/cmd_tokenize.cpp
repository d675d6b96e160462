// merlin tokenize / detokenize helpers: text -> ids with the model's own tokenizer (for checking
// tokenization against other implementations by hand or in tests).
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace merlin::cli {
namespace {

struct TokenizeArgs {
  std::string model, prompt;
  bool bos = false, special = false, pieces = false;
};

int tokenize(const TokenizeArgs& a) {
  auto file = gguf::File::open(a.model);
  auto tok = Tokenizer::from_gguf(file->metadata());
  const std::string bad = utf8_error(a.prompt);
  MERLIN_CHECK(bad.empty(), "the text is not valid UTF-8: ", bad);
  std::vector<int32_t> ids;
  if (a.bos && tok->bos_id() >= 0) ids.push_back(tok->bos_id());
  for (int32_t id : tok->encode(a.prompt, a.special)) ids.push_back(id);
  int32_t prev = -1;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (a.pieces) std::printf("%d\t'%s'\n", ids[i], tok->decode_token(ids[i], prev).c_str());
    else std::printf(i ? " %d" : "%d", ids[i]);
    prev = ids[i];
  }
  if (!a.pieces) std::printf("\n");
  return 0;
}

}  // namespace

Action add_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  app.add_option("-m,--model", a->model, "GGUF model (or vocabulary-only GGUF)")->required();
  app.add_option("-p,--prompt", a->prompt, "text to tokenize")->required();
  app.add_flag("--bos", a->bos, "prepend BOS");
  app.add_flag("--special", a->special, "recognise special-token text such as <|endoftext|>");
  app.add_flag("--pieces", a->pieces, "print one token per line with its text");
  return [a] { return tokenize(*a); };
}

}  // namespace merlin::cli
