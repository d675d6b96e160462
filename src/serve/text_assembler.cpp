#include "serve/text_assembler.h"

#include <algorithm>

namespace merlin::serve {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Expected length of a UTF-8 sequence from its first byte; 0 for a byte that cannot start one.
int sequence_length(unsigned char b) {
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// Whether bytes s[0..n) (n >= 2) are a valid sequence or a valid prefix of one: the second byte's range
// depends on the first (no overlongs, no surrogates, nothing above U+10FFFF).
bool valid_prefix(std::string_view s) {
  const auto b0 = (unsigned char)s[0];
  for (size_t i = 1; i < s.size(); ++i)
    if (!is_continuation((unsigned char)s[i])) return false;
  if (s.size() < 2) return true;
  const auto b1 = (unsigned char)s[1];
  if (b0 == 0xE0) return b1 >= 0xA0;
  if (b0 == 0xED) return b1 <= 0x9F;
  if (b0 == 0xF0) return b1 >= 0x90;
  if (b0 == 0xF4) return b1 <= 0x8F;
  return true;
}

}  // namespace

size_t incomplete_utf8_tail(std::string_view s) {
  const size_t look = std::min<size_t>(3, s.size());
  for (size_t k = 1; k <= look; ++k) {
    const auto b = (unsigned char)s[s.size() - k];
    if (is_continuation(b)) continue;
    const int len = sequence_length(b);
    if (len > (int)k && valid_prefix(s.substr(s.size() - k))) return k;
    return 0;
  }
  return 0;
}

std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const int len = sequence_length((unsigned char)s[i]);
    if (len == 1) {
      out += s[i++];
      continue;
    }
    if (len > 0 && i + len <= s.size() && valid_prefix(s.substr(i, len))) {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    // Skip the maximal invalid prefix as one replacement (WHATWG's "maximal subpart" rule, simplified).
    out.append(kReplacement);
    size_t j = i + 1;
    if (len > 0)
      while (j < s.size() && j < i + len && is_continuation((unsigned char)s[j]) && valid_prefix(s.substr(i, j - i + 1))) ++j;
    i = j;
  }
  return out;
}

TextAssembler::TextAssembler(std::vector<std::string> stop_strings) {
  for (auto& s : stop_strings)
    if (!s.empty()) stops_.push_back(std::move(s));
}

// Longest tail of `text` that is a proper prefix of some stop string: it may become a stop string.
size_t TextAssembler::stop_hold(std::string_view text) const {
  size_t best = 0;
  for (const std::string& stop : stops_) {
    const size_t most = std::min(text.size(), stop.size() - 1);
    for (size_t k = most; k > best; --k) {
      if (text.substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        best = k;
        break;
      }
    }
  }
  return best;
}

std::string TextAssembler::push(std::string_view bytes) {
  if (stopped_) return "";
  pending_.append(bytes);
  size_t first = std::string::npos;
  for (const std::string& stop : stops_) first = std::min(first, pending_.find(stop));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = sanitize_utf8(std::string_view(pending_).substr(0, first));
    pending_.clear();
    return out;
  }
  const size_t hold = std::max(stop_hold(pending_), incomplete_utf8_tail(pending_));
  const size_t cut = pending_.size() - hold;
  std::string out = sanitize_utf8(std::string_view(pending_).substr(0, cut));
  pending_.erase(0, cut);
  return out;
}

std::string TextAssembler::finish() {
  if (stopped_) return "";
  std::string out = sanitize_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace merlin::serve
