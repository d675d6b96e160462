// libFuzzer target: arbitrary bytes through the GPT-2 tokenizer (encoder.json + vocab.bpe) and the
// stories260K SentencePiece tokenizer. Valid UTF-8 must round-trip through encode/decode; invalid UTF-8
// must be refused with merlin::Error. Shared data comes from $MERLIN_DATA or a shared/data folder found
// beside the checkout (searched upward from the binary and the working directory).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace {

std::unique_ptr<merlin::Tokenizer> g_gpt2;
std::unique_ptr<merlin::Tokenizer> g_llama;

std::string find_data_dir(const char* argv0) {
  if (const char* env = std::getenv("MERLIN_DATA"); env != nullptr && *env) return env;
  namespace fs = std::filesystem;
  std::vector<fs::path> starts = {fs::current_path()};
  std::error_code ec;
  const fs::path exe = fs::weakly_canonical(fs::path(argv0), ec);
  if (!ec) starts.push_back(exe.parent_path());
  for (fs::path dir : starts) {
    for (int up = 0; up < 6 && !dir.empty(); ++up, dir = dir.parent_path()) {
      const fs::path candidate = dir / "shared" / "data";
      if (fs::exists(candidate / "tokenizer" / "gpt2" / "encoder.json")) return candidate.string();
      if (dir == dir.parent_path()) break;
    }
  }
#ifdef MERLIN_DEFAULT_DATA_DIR
  return MERLIN_DEFAULT_DATA_DIR;
#else
  return "../shared/data";
#endif
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "fuzz_tokenizer: %s\n", what.c_str());
  std::abort();
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) {
    s.replace(p, from.size(), to);
  }
  return s;
}

void check_ids(const merlin::Tokenizer& tok, const std::vector<int32_t>& ids) {
  for (const int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) die(tok.model_name() + ": encode produced an out-of-range id");
  }
}

// `expected` is what decode(encode(text, allow_special=false)) must give back.
void check_round_trip(const merlin::Tokenizer& tok, std::string_view text, const std::string& expected) {
  const std::vector<int32_t> ids = tok.encode(text, false);
  check_ids(tok, ids);
  if (tok.decode(ids) != expected) die(tok.model_name() + ": decode(encode(x)) != x");
  // Special-token parsing must not crash and must still give valid ids.
  check_ids(tok, tok.encode(text, true));
}

void check_rejected(const merlin::Tokenizer& tok, std::string_view text) {
  try {
    tok.encode(text);
  } catch (const merlin::Error&) {
    return;
  }
  die(tok.model_name() + ": encode accepted invalid UTF-8");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** argv) {
  const std::string dir = find_data_dir((*argv)[0]);
  try {
    g_gpt2 =
        merlin::Tokenizer::from_gpt2_files(dir + "/tokenizer/gpt2/encoder.json", dir + "/tokenizer/gpt2/vocab.bpe");
    const auto file = merlin::gguf::File::open(dir + "/models/stories260K/stories260K.gguf");
    g_llama = merlin::Tokenizer::from_gguf(file->metadata());
  } catch (const std::exception& e) {
    die(std::string("cannot load the tokenizers from ") + dir + " (set MERLIN_DATA): " + e.what());
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (!merlin::utf8_error(text).empty()) {
    check_rejected(*g_gpt2, text);
    check_rejected(*g_llama, text);
    return 0;
  }
  check_round_trip(*g_gpt2, text, std::string(text));
  // SentencePiece spells a space "▁", so a literal "▁" in the input comes back as a space.
  check_round_trip(*g_llama, text, replace_all(std::string(text), "\xE2\x96\x81", " "));
  return 0;
}
