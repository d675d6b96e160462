// GPT-2 byte-level BPE (tokenizer.ggml.model = "gpt2", pre-tokenizer "gpt-2"), token for token as
// tiktoken's r50k_base / OpenAI's encoder.py.
#include <array>
#include <mutex>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/bpe.h"
#include "tokenizer/gpt2_pretokenizer.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace merlin::tok {

namespace {

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves and the other 68 bytes for
// U+0100.., so every token is a string of visible, non-space characters.
std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> m{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    m[b] = printable ? b : next++;
  }
  return m;
}

// Token strings in GGUF spell bytes through byte_to_codepoint(); this undoes it. Returns false when a
// character is outside that alphabet.
bool unmap_bytes(std::string_view token, std::string* bytes) {
  static const std::array<int, 324> kByteOf = [] {
    std::array<int, 324> inv;
    inv.fill(-1);
    const auto fwd = byte_to_codepoint();
    for (int b = 0; b < 256; ++b) inv[fwd[b]] = b;
    return inv;
  }();
  bytes->clear();
  for (size_t i = 0; i < token.size();) {
    int len;
    const uint32_t cp = decode_utf8(token, i, &len);
    if (cp >= kByteOf.size() || kByteOf[cp] < 0) return false;
    bytes->push_back(static_cast<char>(kByteOf[cp]));
    i += len;
  }
  return true;
}

// Piece -> ids of pieces already encoded. Text repeats its words, so after a few kilobytes almost every
// piece is a hit and the merge loop rarely runs. Bounded, so arbitrary input cannot grow it forever.
struct PieceCache {
  static constexpr size_t kMaxPieceBytes = 64;
  static constexpr size_t kMaxEntries = 1 << 16;
  std::mutex mu;
  StringMap<std::pair<uint32_t, uint32_t>> map;  // piece -> (offset, count) in ids
  std::vector<int32_t> ids;
};

class Gpt2Tokenizer final : public Tokenizer {
 public:
  Gpt2Tokenizer(Vocab v, const std::vector<std::string>& merges);

  std::vector<int32_t> encode(std::string_view text, bool allow_special) const override;
  std::string decode_token(int32_t id, int32_t prev) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(v_.tokens.size()); }
  int32_t bos_id() const override { return v_.bos; }
  int32_t eos_id() const override { return v_.eos; }
  bool add_bos() const override { return v_.add_bos; }
  std::string model_name() const override { return "gpt2"; }
  void write_gguf(gguf::Metadata& md) const override;

 private:
  void init_bytes();
  void init_merges(const std::vector<std::string>& merges, const StringMap<int32_t>& index);
  void encode_ordinary(std::string_view text, BpeScratch& s, PieceCache* cache, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, BpeScratch& s, PieceCache* cache, std::vector<int32_t>& out) const;

  Vocab v_;
  std::vector<std::string> bytes_;                   // what each token decodes to
  std::vector<std::pair<int32_t, int32_t>> merges_;  // in rank order, for write_gguf
  std::array<int32_t, 256> byte_token_{};
  PairMap pairs_;
  SpecialMatcher specials_;
  std::unique_ptr<PieceCache> cache_ = std::make_unique<PieceCache>();
};

Gpt2Tokenizer::Gpt2Tokenizer(Vocab v, const std::vector<std::string>& merges) : v_(std::move(v)) {
  v_.validate("gpt2");
  init_bytes();
  init_merges(merges, v_.index());
  specials_ = special_tokens_of(v_);
}

void Gpt2Tokenizer::init_bytes() {
  bytes_.resize(v_.tokens.size());
  byte_token_.fill(-1);
  for (size_t id = 0; id < v_.tokens.size(); ++id) {
    const int32_t type = v_.types[id];
    if (type == kTypeControl || type == kTypeUserDefined) {
      bytes_[id] = v_.tokens[id];  // spelled literally, not through the byte alphabet
      continue;
    }
    if (!unmap_bytes(v_.tokens[id], &bytes_[id])) {
      fail("gpt2 tokenizer: token ", id, " '", v_.tokens[id], "' has characters outside GPT-2's byte alphabet");
    }
    if (bytes_[id].size() == 1 && type == kTypeNormal) {
      int32_t& slot = byte_token_[static_cast<unsigned char>(bytes_[id][0])];
      if (slot < 0) slot = static_cast<int32_t>(id);
    }
  }
  for (int b = 0; b < 256; ++b) {
    MERLIN_CHECK(byte_token_[b] >= 0, "gpt2 tokenizer: no token for byte ", b, " (every byte needs one)");
  }
}

void Gpt2Tokenizer::init_merges(const std::vector<std::string>& merges, const StringMap<int32_t>& index) {
  pairs_ = PairMap(merges.size());
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& m = merges[rank];
    // Tokens never contain a real space (it is spelled U+0120), but search from 1 as llama.cpp does.
    const size_t sp = m.find(' ', 1);
    MERLIN_CHECK(sp != std::string::npos, "gpt2 tokenizer: merge ", rank, " '", m, "' is not 'A B'");
    const std::string_view a(m.data(), sp), b(m.data() + sp + 1, m.size() - sp - 1);
    joined.assign(a).append(b);
    const auto ia = index.find(a), ib = index.find(b), ij = index.find(std::string_view(joined));
    if (ia == index.end() || ib == index.end() || ij == index.end()) {
      fail("gpt2 tokenizer: merge ", rank, " '", m, "' uses or makes a token that is not in the vocabulary");
    }
    if (pairs_.insert(ia->second, ib->second, static_cast<int32_t>(rank), ij->second)) {
      merges_.emplace_back(ia->second, ib->second);
    }
  }
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text, bool allow_special) const {
  check_utf8_input(text);
  std::vector<int32_t> out;
  out.reserve(text.size() / 4 + 16);
  BpeScratch scratch;
  // One encode() at a time uses the shared cache; a concurrent caller encodes without it rather than wait.
  std::unique_lock<std::mutex> lock(cache_->mu, std::try_to_lock);
  PieceCache* cache = lock.owns_lock() ? cache_.get() : nullptr;
  if (!allow_special || specials_.empty()) {
    encode_ordinary(text, scratch, cache, out);
    return out;
  }
  // Like tiktoken, the regex runs on each stretch between special tokens separately.
  specials_.split(
      text, [&](std::string_view part) { encode_ordinary(part, scratch, cache, out); },
      [&](int32_t id) { out.push_back(id); });
  return out;
}

void Gpt2Tokenizer::encode_ordinary(std::string_view text, BpeScratch& s, PieceCache* cache,
                                    std::vector<int32_t>& out) const {
  for (size_t i = 0; i < text.size();) {
    const size_t end = gpt2_piece_end(text, i);
    const std::string_view piece = text.substr(i, end - i);
    i = end;
    if (piece.size() == 1) {
      out.push_back(byte_token_[static_cast<unsigned char>(piece[0])]);
    } else {
      encode_piece(piece, s, cache, out);
    }
  }
}

void Gpt2Tokenizer::encode_piece(std::string_view piece, BpeScratch& s, PieceCache* cache,
                                 std::vector<int32_t>& out) const {
  if (cache == nullptr || piece.size() > PieceCache::kMaxPieceBytes) {
    bpe_merge(piece, byte_token_.data(), pairs_, s, out);
    return;
  }
  if (const auto it = cache->map.find(piece); it != cache->map.end()) {
    const int32_t* ids = cache->ids.data() + it->second.first;
    out.insert(out.end(), ids, ids + it->second.second);
    return;
  }
  const size_t before = out.size();
  bpe_merge(piece, byte_token_.data(), pairs_, s, out);
  if (cache->map.size() >= PieceCache::kMaxEntries) {
    cache->map.clear();
    cache->ids.clear();
  }
  const auto offset = static_cast<uint32_t>(cache->ids.size());
  cache->ids.insert(cache->ids.end(), out.begin() + before, out.end());
  cache->map.emplace(std::string(piece), std::make_pair(offset, static_cast<uint32_t>(out.size() - before)));
}

std::string Gpt2Tokenizer::decode_token(int32_t id, int32_t /*prev*/) const {
  MERLIN_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocabulary (", vocab_size(), " tokens)");
  const int32_t type = v_.types[id];
  if (type == kTypeNormal || type == kTypeUserDefined || type == kTypeByte) return bytes_[id];
  return {};
}

void Gpt2Tokenizer::write_gguf(gguf::Metadata& md) const {
  std::vector<std::string> merges;
  merges.reserve(merges_.size());
  for (const auto& [a, b] : merges_) merges.push_back(v_.tokens[a] + " " + v_.tokens[b]);
  md.set("tokenizer.ggml.model", "gpt2");
  md.set("tokenizer.ggml.pre", "gpt-2");
  md.set("tokenizer.ggml.tokens", gguf::make_array(v_.tokens));
  md.set("tokenizer.ggml.token_type", gguf::make_array(v_.types));
  md.set("tokenizer.ggml.merges", gguf::make_array(merges));
  if (v_.bos >= 0) md.set("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v_.bos));
  if (v_.eos >= 0) md.set("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v_.eos));
  md.set("tokenizer.ggml.add_bos_token", v_.add_bos);
}

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2(Vocab v, const std::vector<std::string>& merges) {
  return std::make_unique<Gpt2Tokenizer>(std::move(v), merges);
}

}  // namespace merlin::tok
