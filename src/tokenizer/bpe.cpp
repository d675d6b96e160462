#include "tokenizer/bpe.h"

#include <algorithm>

namespace merlin::tok {

namespace {

void rebuild(std::vector<PairMap::Entry>& slots, size_t capacity) {
  slots.assign(capacity, PairMap::Entry{~uint64_t{0}, 0, 0});
}

}  // namespace

PairMap::PairMap(size_t expected) {
  size_t cap = 16;
  while (cap < 2 * expected) cap *= 2;
  rebuild(slots_, cap);
  mask_ = cap - 1;
  shift_ = 64 - __builtin_ctzll(cap);
}

void PairMap::grow() {
  std::vector<Entry> old;
  old.swap(slots_);
  const size_t cap = old.size() * 2;
  rebuild(slots_, cap);
  mask_ = cap - 1;
  shift_ = 64 - __builtin_ctzll(cap);
  for (const Entry& e : old) {
    if (e.key == kEmpty) continue;
    size_t i = slot(e.key);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i] = e;
  }
}

bool PairMap::insert(int32_t a, int32_t b, int32_t rank, int32_t merged) {
  if (2 * (size_ + 1) > slots_.size()) grow();
  const uint64_t key = pack(a, b);
  size_t i = slot(key);
  for (; slots_[i].key != kEmpty; i = (i + 1) & mask_) {
    if (slots_[i].key == key) return false;
  }
  slots_[i] = Entry{key, rank, merged};
  ++size_;
  return true;
}

namespace {

// Min-heap order on (rank, left): std::push_heap builds a max-heap, so "less" means "worse".
bool worse(const BpeScratch::Candidate& x, const BpeScratch::Candidate& y) {
  return x.rank != y.rank ? x.rank > y.rank : x.left > y.left;
}

void push_candidate(BpeScratch& s, const PairMap& pairs, int32_t left) {
  const int32_t right = s.next[left];
  if (right < 0) return;
  if (const PairMap::Entry* e = pairs.find(s.id[left], s.id[right])) {
    s.heap.push_back({e->rank, left});
    std::push_heap(s.heap.begin(), s.heap.end(), worse);
  }
}

}  // namespace

void bpe_merge(std::string_view piece, const int32_t* byte_token, const PairMap& pairs, BpeScratch& s,
               std::vector<int32_t>& out) {
  const auto n = static_cast<int32_t>(piece.size());
  if (n == 0) return;
  s.id.resize(n);
  s.prev.resize(n);
  s.next.resize(n);
  s.heap.clear();
  for (int32_t i = 0; i < n; ++i) {
    s.id[i] = byte_token[static_cast<unsigned char>(piece[i])];
    s.prev[i] = i - 1;
    s.next[i] = i + 1 < n ? i + 1 : -1;
  }
  for (int32_t i = 0; i + 1 < n; ++i) push_candidate(s, pairs, i);

  while (!s.heap.empty()) {
    std::pop_heap(s.heap.begin(), s.heap.end(), worse);
    const BpeScratch::Candidate c = s.heap.back();
    s.heap.pop_back();
    // Candidates are not removed when a neighbour merges; a stale one is recognised here because its
    // symbol is gone (id -1), has no right neighbour, or now forms a pair of a different rank.
    const int32_t l = c.left;
    const int32_t r = s.next[l];
    if (s.id[l] < 0 || r < 0) continue;
    const PairMap::Entry* e = pairs.find(s.id[l], s.id[r]);
    if (e == nullptr || e->rank != c.rank) continue;
    s.id[l] = e->merged;
    s.id[r] = -1;
    s.next[l] = s.next[r];
    if (s.next[r] >= 0) s.prev[s.next[r]] = l;
    if (s.prev[l] >= 0) push_candidate(s, pairs, s.prev[l]);
    push_candidate(s, pairs, l);
  }
  for (int32_t i = 0; i >= 0; i = s.next[i]) out.push_back(s.id[i]);
}

}  // namespace merlin::tok
