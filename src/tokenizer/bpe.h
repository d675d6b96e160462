// Private to the tokenizer: the byte-pair merge loop of GPT-2-style BPE.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace merlin::tok {

// (left id, right id) -> (merge rank, merged id), open addressing: a lookup is one multiply and, for a
// table at most half full, usually one probe.
class PairMap {
 public:
  struct Entry {
    uint64_t key;
    int32_t rank;
    int32_t merged;
  };
  explicit PairMap(size_t expected = 0);
  // Keeps the first (lowest-rank) entry when a pair is listed twice; returns false then.
  bool insert(int32_t a, int32_t b, int32_t rank, int32_t merged);
  const Entry* find(int32_t a, int32_t b) const {
    const uint64_t key = pack(a, b);
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t pack(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  size_t slot(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void grow();
  std::vector<Entry> slots_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
};

// Buffers one encode() call reuses for every piece, so the merge loop does not allocate.
struct BpeScratch {
  struct Candidate {
    int32_t rank;
    int32_t left;  // symbol index; symbols keep their text order, so lower index = further left
  };
  std::vector<int32_t> id, prev, next;
  std::vector<Candidate> heap;
};

// Appends the BPE encoding of `piece` to `out`: start from one token per byte (byte_token[b]), then
// repeatedly merge the adjacent pair with the lowest merge rank, leftmost first among equal ranks.
// A heap keeps long pieces (a megabyte of digits or CJK) O(n log n) rather than O(n^2).
void bpe_merge(std::string_view piece, const int32_t* byte_token, const PairMap& pairs, BpeScratch& s,
               std::vector<int32_t>& out);

}  // namespace merlin::tok
