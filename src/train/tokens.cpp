#include "train/tokens.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/atomic_file.h"
#include "core/error.h"

namespace merlin::train {
namespace {

template <typename T>
T read_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // x86-64 and arm64 are little-endian, like the format
  return v;
}

template <typename T>
void put_le(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

void check_range(const int32_t* row, int64_t n, int64_t vocab, const std::string& where) {
  for (int64_t i = 0; i < n; ++i)
    MERLIN_CHECK(row[i] < vocab, where, ": token id ", row[i], " is outside the model's vocabulary of ", vocab,
                 " (data prepared with a different tokenizer?)");
}

}  // namespace

void write_shard(const std::string& path, const ShardHeader& h, const uint16_t* tokens, uint64_t n) {
  MERLIN_CHECK(h.tokenizer.size() <= kShardHeaderBytes - 48, "tokenizer id too long: ", h.tokenizer);
  uint8_t head[kShardHeaderBytes] = {};
  std::memcpy(head, kShardMagic, 8);
  put_le<uint32_t>(head + 8, kShardVersion);
  put_le<uint32_t>(head + 12, kShardHeaderBytes);
  put_le<uint64_t>(head + 16, n);
  put_le<uint64_t>(head + 24, h.n_documents);
  put_le<uint64_t>(head + 32, h.n_text_bytes);
  put_le<uint32_t>(head + 40, h.vocab_size);
  put_le<uint32_t>(head + 44, (uint32_t)h.tokenizer.size());
  std::memcpy(head + 48, h.tokenizer.data(), h.tokenizer.size());
  AtomicFileWriter w(path);
  w.write(head, sizeof head);
  w.write(tokens, n * sizeof(uint16_t));
  w.commit();
}

TokenShard::TokenShard(const std::string& path) : map_(path) {
  const uint8_t* p = map_.data();
  const size_t size = map_.size();
  MERLIN_CHECK(size >= kShardHeaderBytes && std::memcmp(p, kShardMagic, 8) == 0, path,
               ": not a token shard (expected a file written by 'merlin prepare')");
  const uint32_t version = read_le<uint32_t>(p + 8), header_bytes = read_le<uint32_t>(p + 12);
  MERLIN_CHECK(version == kShardVersion && header_bytes == kShardHeaderBytes, path, ": unsupported token shard version ",
               version);
  header_.n_tokens = read_le<uint64_t>(p + 16);
  header_.n_documents = read_le<uint64_t>(p + 24);
  header_.n_text_bytes = read_le<uint64_t>(p + 32);
  header_.vocab_size = read_le<uint32_t>(p + 40);
  const uint32_t name_len = read_le<uint32_t>(p + 44);
  MERLIN_CHECK(name_len <= kShardHeaderBytes - 48, path, ": corrupt token shard header");
  header_.tokenizer.assign(reinterpret_cast<const char*>(p + 48), name_len);
  MERLIN_CHECK(header_.n_tokens == (size - kShardHeaderBytes) / 2 && (size - kShardHeaderBytes) % 2 == 0, path,
               ": token shard is truncated or has trailing bytes (header says ", header_.n_tokens, " tokens, file has ",
               (size - kShardHeaderBytes) / 2, ")");
  tokens_ = reinterpret_cast<const uint16_t*>(p + kShardHeaderBytes);
}

TokenDataset TokenDataset::open(const std::string& path, const std::string& split) {
  namespace fs = std::filesystem;
  TokenDataset d;
  std::vector<std::string> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(split + "-", 0) == 0 && e.path().extension() == ".tok") files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    MERLIN_CHECK(!files.empty(), path, ": no ", split, "-*.tok shards in this directory (run 'merlin prepare')");
  } else {
    MERLIN_CHECK(fs::exists(path), path, ": no such file or directory");
    files.push_back(path);
  }
  for (const std::string& f : files) {
    d.shards_.push_back(std::make_unique<TokenShard>(f));
    MERLIN_CHECK(d.shards_.back()->header().tokenizer == d.shards_.front()->header().tokenizer, f,
                 ": shards were written by different tokenizers");
  }
  MERLIN_CHECK(d.n_tokens() > 0, path, ": the token data is empty");
  return d;
}

uint64_t TokenDataset::n_tokens() const {
  uint64_t n = 0;
  for (const auto& s : shards_) n += s->size();
  return n;
}

uint64_t TokenDataset::n_text_bytes() const {
  uint64_t n = 0;
  for (const auto& s : shards_) n += s->header().n_text_bytes;
  return n;
}

double TokenDataset::bytes_per_token() const {
  const uint64_t t = n_tokens();
  return t ? (double)n_text_bytes() / (double)t : 0.0;
}

const std::string& TokenDataset::tokenizer() const { return shards_.front()->header().tokenizer; }

std::string TokenDataset::describe() const {
  return cat(shards_.size(), shards_.size() == 1 ? " shard, " : " shards, ", n_tokens(), " tokens");
}

BatchSampler::BatchSampler(const TokenDataset& data, int64_t seq, int64_t batch, int64_t vocab_size, uint64_t seed)
    : data_(data), seq_(seq), batch_(batch), vocab_(vocab_size), rng_(seed) {
  uint64_t total = 0;
  for (const auto& s : data.shards()) {
    if (s->size() >= (uint64_t)seq + 1) total += s->size() - (uint64_t)seq;  // window starts per shard
    cumulative_windows_.push_back(total);
  }
  // Far fewer tokens than one batch would repeat the same few windows over and over.
  MERLIN_CHECK(total > 0 && data.n_tokens() >= (uint64_t)(batch * seq + 1), "training data (", data.describe(),
               ") is smaller than one batch of ", batch, " x ", seq, " tokens; use more data or a smaller --batch/--seq");
}

void BatchSampler::next(int32_t* out) {
  const uint64_t total = cumulative_windows_.back();
  for (int64_t b = 0; b < batch_; ++b) {
    const uint64_t r = rng_.below(total);
    const size_t si = std::upper_bound(cumulative_windows_.begin(), cumulative_windows_.end(), r) -
                      cumulative_windows_.begin();
    const uint64_t start = r - (si == 0 ? 0 : cumulative_windows_[si - 1]);
    const uint16_t* src = data_.shards()[si]->tokens() + start;
    int32_t* row = out + b * (seq_ + 1);
    for (int64_t i = 0; i <= seq_; ++i) row[i] = src[i];
    check_range(row, seq_ + 1, vocab_, data_.shards()[si]->path());
  }
}

uint64_t eval_windows(const TokenDataset& data, int64_t seq) {
  uint64_t n = 0;
  for (const auto& s : data.shards())
    if (s->size() > 0) n += (s->size() - 1) / (uint64_t)seq;
  return n;
}

void copy_eval_window(const TokenDataset& data, int64_t seq, uint64_t index, int64_t vocab_size, int32_t* out) {
  for (const auto& s : data.shards()) {
    const uint64_t n = s->size() > 0 ? (s->size() - 1) / (uint64_t)seq : 0;
    if (index < n) {
      const uint16_t* src = s->tokens() + index * (uint64_t)seq;
      for (int64_t i = 0; i <= seq; ++i) out[i] = src[i];
      check_range(out, seq + 1, vocab_size, s->path());
      return;
    }
    index -= n;
  }
  fail("evaluation window ", index, " is past the end of the data");
}

}  // namespace merlin::train
