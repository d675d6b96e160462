#include "train/prepare.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "tokenizer/tokenizer.h"
#include "train/tokens.h"

namespace merlin::train {
namespace {

constexpr std::string_view kEot = "<|endoftext|>";

std::string_view trim(std::string_view s) {
  const char* ws = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

void add_document(std::vector<std::string>& docs, std::string_view d) {
  d = trim(d);
  if (!d.empty()) docs.emplace_back(d);
}

std::string_view first_line(std::string_view text) {
  const size_t b = text.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const size_t e = text.find('\n', b);
  return text.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b);
}

// The document of one JSON line, or nullopt for lines that are not such an object.
std::optional<std::string> json_document(std::string_view line) {
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  for (const char* key : {"text", "story"}) {
    auto it = j.find(key);
    if (it != j.end() && it->is_string()) return it->get<std::string>();
  }
  return std::nullopt;
}

void split_jsonl(std::string_view text, const std::string& name, std::vector<std::string>& docs) {
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t e = text.find('\n', pos);
    if (e == std::string_view::npos) e = text.size();
    const std::string_view line = trim(text.substr(pos, e - pos));
    ++line_no;
    pos = e + 1;
    if (line.empty()) continue;
    std::optional<std::string> d = json_document(line);
    MERLIN_CHECK(d.has_value(), name, " line ", line_no,
                 ": not a JSON object with a \"text\" or \"story\" string (--format jsonl)");
    add_document(docs, *d);
  }
}

void split_on(std::string_view text, std::string_view sep, std::vector<std::string>& docs) {
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t e = text.find(sep, pos);
    if (e == std::string_view::npos) e = text.size();
    add_document(docs, text.substr(pos, e - pos));
    pos = e + sep.size();
  }
}

// Tokens of a run of documents, each preceded by <|endoftext|>, encoded in parallel.
class Encoder {
 public:
  Encoder(const Tokenizer& tok, int threads) : tok_(tok), pool_(threads > 0 ? threads : ThreadPool::default_threads()) {}
  std::vector<std::vector<int32_t>> encode(const std::vector<std::string>& docs, size_t b, size_t e) {
    std::vector<std::vector<int32_t>> out(e - b);
    std::atomic<size_t> next{b};
    pool_.run([&](int, int) {
      for (size_t i; (i = next.fetch_add(1)) < e;) out[i - b] = tok_.encode(docs[i], /*allow_special=*/false);
    });
    return out;
  }

 private:
  const Tokenizer& tok_;
  ThreadPool pool_;
};

// Accumulates the tokens of one split and cuts them into shards.
class ShardSink {
 public:
  ShardSink(std::string dir, std::string split, const Tokenizer& tok, uint64_t shard_tokens, SplitSummary& summary)
      : dir_(std::move(dir)), split_(std::move(split)), tok_(tok), shard_tokens_(shard_tokens), s_(summary) {}
  void add(const std::string& doc, const std::vector<int32_t>& ids) {
    if (tokens_.size() >= shard_tokens_) flush();
    tokens_.push_back((uint16_t)kGpt2EndOfText);
    for (int32_t id : ids) tokens_.push_back((uint16_t)id);
    ++docs_;
    bytes_ += doc.size();
    s_.documents += 1;
    s_.tokens += ids.size() + 1;
    s_.bytes += doc.size();
  }
  void flush() {
    if (tokens_.empty()) return;
    char name[64];
    std::snprintf(name, sizeof name, "%s-%05zu.tok", split_.c_str(), s_.files.size());
    const std::string path = dir_ + "/" + name;
    write_shard(path, ShardHeader{tokens_.size(), docs_, bytes_, (uint32_t)tok_.vocab_size(), tok_.model_name()},
                tokens_.data(), tokens_.size());
    s_.files.push_back(path);
    tokens_.clear();
    docs_ = bytes_ = 0;
  }

 private:
  std::string dir_, split_;
  const Tokenizer& tok_;
  uint64_t shard_tokens_;
  SplitSummary& s_;
  std::vector<uint16_t> tokens_;
  uint64_t docs_ = 0, bytes_ = 0;
};

std::vector<std::string> read_documents(const std::string& path, TextFormat format) {
  MERLIN_CHECK(std::filesystem::is_regular_file(path), path, ": no such file");
  MERLIN_CHECK(std::filesystem::file_size(path) > 0, path, ": the input is empty");
  MappedFile f(path);
  const std::string_view text(reinterpret_cast<const char*>(f.data()), f.size());
  std::vector<std::string> docs = split_documents(text, format, path);
  MERLIN_CHECK(!docs.empty(), path, ": no documents (the input holds only whitespace or separators)");
  return docs;
}

void remove_old_shards(const std::string& dir) {
  namespace fs = std::filesystem;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.path().extension() == ".tok" && (n.rfind("train-", 0) == 0 || n.rfind("val-", 0) == 0)) fs::remove(e.path());
  }
}

}  // namespace

TextFormat parse_text_format(const std::string& name) {
  if (name == "auto") return TextFormat::Auto;
  if (name == "eot") return TextFormat::Eot;
  if (name == "jsonl") return TextFormat::Jsonl;
  if (name == "lines") return TextFormat::Lines;
  fail("unknown --format '", name, "' (auto, eot, jsonl, lines)");
}

const char* text_format_name(TextFormat f) {
  switch (f) {
    case TextFormat::Auto: return "auto";
    case TextFormat::Eot: return "eot";
    case TextFormat::Jsonl: return "jsonl";
    case TextFormat::Lines: return "lines";
  }
  return "?";
}

TextFormat detect_text_format(std::string_view text) {
  const std::string_view line = trim(first_line(text));
  if (!line.empty() && line.front() == '{' && json_document(line)) return TextFormat::Jsonl;
  if (text.find(kEot) != std::string_view::npos) return TextFormat::Eot;
  return TextFormat::Lines;
}

std::vector<std::string> split_documents(std::string_view text, TextFormat format, const std::string& name) {
  const std::string err = utf8_error(text);
  MERLIN_CHECK(err.empty(), name, ": invalid UTF-8: ", err, " (the input must be UTF-8 text)");
  if (format == TextFormat::Auto) format = detect_text_format(text);
  std::vector<std::string> docs;
  if (format == TextFormat::Jsonl) split_jsonl(text, name, docs);
  else if (format == TextFormat::Eot) split_on(text, kEot, docs);
  else split_on(text, "\n", docs);
  return docs;
}

PrepareSummary prepare_data(const PrepareOptions& o, const Tokenizer& tok) {
  MERLIN_CHECK(!o.inputs.empty(), "no input files");
  MERLIN_CHECK(tok.vocab_size() <= 65536, "token shards store 16-bit ids; the tokenizer has ", tok.vocab_size(), " tokens");
  MERLIN_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "--val-fraction must be in [0, 1)");
  std::vector<std::string> docs;
  for (const std::string& in : o.inputs) {
    std::vector<std::string> d = read_documents(in, o.format);
    docs.insert(docs.end(), std::make_move_iterator(d.begin()), std::make_move_iterator(d.end()));
  }
  // Held-out documents go last in `docs`, so one pass encodes both splits.
  size_t n_train = docs.size();
  if (!o.val_input.empty()) {
    std::vector<std::string> v = read_documents(o.val_input, o.format);
    docs.insert(docs.end(), std::make_move_iterator(v.begin()), std::make_move_iterator(v.end()));
  } else if (o.val_fraction > 0) {
    MERLIN_CHECK(docs.size() >= 2, "only one document: nothing to split off for validation (pass --val FILE or --val-fraction 0)");
    const size_t n_val = std::max<size_t>(1, (size_t)std::llround(o.val_fraction * (double)docs.size()));
    n_train = docs.size() - std::min(n_val, docs.size() - 1);
  }

  std::filesystem::create_directories(o.out_dir);
  remove_old_shards(o.out_dir);
  PrepareSummary sum;
  ShardSink train(o.out_dir, "train", tok, o.shard_tokens, sum.train), val(o.out_dir, "val", tok, o.shard_tokens, sum.val);
  uint64_t total_bytes = 0, done_bytes = 0;
  for (const std::string& d : docs) total_bytes += d.size();
  std::unique_ptr<Progress> progress;
  if (o.progress) progress = std::make_unique<Progress>("prepare", total_bytes, "B");
  Encoder enc(tok, o.threads);
  constexpr size_t kBlock = 2048;  // documents per parallel batch
  for (size_t b = 0; b < docs.size(); b += kBlock) {
    const size_t e = std::min(docs.size(), b + kBlock);
    const std::vector<std::vector<int32_t>> ids = enc.encode(docs, b, e);
    for (size_t i = b; i < e; ++i) {
      (i < n_train ? train : val).add(docs[i], ids[i - b]);
      done_bytes += docs[i].size();
    }
    if (progress) progress->update(done_bytes);
  }
  train.flush();
  val.flush();
  if (progress) progress->finish();
  return sum;
}

}  // namespace merlin::train
