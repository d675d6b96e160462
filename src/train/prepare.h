// Text to token shards (`merlin prepare`): documents are split out of the input files, encoded with the
// GPT-2 tokenizer in parallel, and written as train-NNNNN.tok / val-NNNNN.tok shards, every document
// preceded by <|endoftext|> (GPT-2's document boundary, as llm.c lays out its data).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace merlin {
class Tokenizer;
}

namespace merlin::train {

// eot: documents separated by "<|endoftext|>"; jsonl: one JSON object per line with a "text" or "story"
// string; lines: one document per line; auto: jsonl if the first line is such an object, else eot if the
// separator occurs, else lines.
enum class TextFormat { Auto, Eot, Jsonl, Lines };
TextFormat parse_text_format(const std::string& name);  // throws merlin::Error on unknown names
const char* text_format_name(TextFormat f);
TextFormat detect_text_format(std::string_view text);

// Documents of `text` (surrounding whitespace dropped, empty documents skipped). `name` is used in
// errors (invalid UTF-8, bad JSON line).
std::vector<std::string> split_documents(std::string_view text, TextFormat format, const std::string& name);

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string val_input;        // held-out file; empty: split off the last val_fraction of the documents
  double val_fraction = 0.01;
  TextFormat format = TextFormat::Auto;
  std::string out_dir;
  uint64_t shard_tokens = 1ull << 27;  // start a new shard past this many tokens
  int threads = 0;
  bool progress = true;
};

struct SplitSummary {
  uint64_t documents = 0, tokens = 0, bytes = 0;
  std::vector<std::string> files;
};

struct PrepareSummary {
  SplitSummary train, val;
};

PrepareSummary prepare_data(const PrepareOptions& opts, const Tokenizer& tokenizer);

}  // namespace merlin::train
