// Token shards: the training data format written by `merlin prepare` and read by `merlin train`.
//
// A shard is a 256-byte header followed by little-endian uint16 token ids (so vocabularies up to 65536):
//   0  char[8]  "MRLNTOK1"
//   8  u32      format version (1)
//   12 u32      header size in bytes (256)
//   16 u64      token count
//   24 u64      documents
//   32 u64      UTF-8 bytes of the documents' text (for bits per byte)
//   40 u32      vocabulary size of the tokenizer
//   44 u32      length of the tokenizer id
//   48 char[]   tokenizer id ("gpt2"), zero padded to byte 256
// Shards are memory mapped; batches are windows of seq+1 tokens at offsets drawn from a seeded Rng.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "core/rng.h"

namespace merlin::train {

inline constexpr char kShardMagic[8] = {'M', 'R', 'L', 'N', 'T', 'O', 'K', '1'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr uint32_t kShardHeaderBytes = 256;
inline constexpr int32_t kGpt2EndOfText = 50256;

struct ShardHeader {
  uint64_t n_tokens = 0;
  uint64_t n_documents = 0;
  uint64_t n_text_bytes = 0;
  uint32_t vocab_size = 0;
  std::string tokenizer;  // "gpt2"
};

// Writes a complete shard atomically (temporary file + rename).
void write_shard(const std::string& path, const ShardHeader& header, const uint16_t* tokens, uint64_t n);

class TokenShard {
 public:
  explicit TokenShard(const std::string& path);  // maps and validates; throws merlin::Error
  const ShardHeader& header() const { return header_; }
  const uint16_t* tokens() const { return tokens_; }
  uint64_t size() const { return header_.n_tokens; }
  const std::string& path() const { return map_.path(); }

 private:
  MappedFile map_;
  ShardHeader header_;
  const uint16_t* tokens_ = nullptr;
};

// One or more shards: a shard file, or every "<split>-*.tok" file of a directory written by prepare.
class TokenDataset {
 public:
  static TokenDataset open(const std::string& dir_or_file, const std::string& split);
  const std::vector<std::unique_ptr<TokenShard>>& shards() const { return shards_; }
  uint64_t n_tokens() const;
  uint64_t n_text_bytes() const;
  double bytes_per_token() const;  // 0 when the shards carry no byte count
  const std::string& tokenizer() const;
  std::string describe() const;  // "3 shards, 1234567 tokens" for messages

 private:
  std::vector<std::unique_ptr<TokenShard>> shards_;
};

// Draws training windows: `batch` rows of seq+1 consecutive tokens (inputs = row[0..seq), targets =
// row[1..seq]) from uniformly random offsets. Its whole state is the Rng, so a checkpoint can resume it.
class BatchSampler {
 public:
  BatchSampler(const TokenDataset& data, int64_t seq, int64_t batch, int64_t vocab_size, uint64_t seed);
  void next(int32_t* out);  // [batch][seq + 1]
  Rng::State state() const { return rng_.state(); }
  void set_state(const Rng::State& s) { rng_.set_state(s); }

 private:
  const TokenDataset& data_;
  int64_t seq_, batch_, vocab_;
  std::vector<uint64_t> cumulative_windows_;  // per shard, for picking one in proportion to its size
  Rng rng_;
};

// Copies `n_windows` consecutive non-overlapping windows of seq+1 tokens starting at window `first` of the
// concatenated dataset (for evaluation). Returns how many windows the dataset holds in total.
uint64_t eval_windows(const TokenDataset& data, int64_t seq);
void copy_eval_window(const TokenDataset& data, int64_t seq, uint64_t index, int64_t vocab_size, int32_t* out);

}  // namespace merlin::train
