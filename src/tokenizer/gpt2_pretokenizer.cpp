#include "tokenizer/gpt2_pretokenizer.h"

#include "tokenizer/unicode.h"

namespace merlin::tok {

namespace {

// End of the run of code points of class `c` that starts at s[i].
size_t run_end(std::string_view s, size_t i, CharClass c) {
  const size_t n = s.size();
  while (i < n) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      if (kAsciiClass[b] != static_cast<uint8_t>(c)) break;
      ++i;
      continue;
    }
    int len;
    const uint32_t cp = decode_utf8(s, i, &len);
    if (char_class_slow(cp) != c) break;
    i += len;
  }
  return i;
}

// \s+(?!\S)|\s+ at s[i], which is white space.
size_t space_end(std::string_view s, size_t i) {
  const size_t n = s.size();
  size_t last = i;  // start of the run's last code point
  size_t j = i;
  while (j < n) {
    int len;
    const uint32_t cp = decode_utf8(s, j, &len);
    if (char_class(cp) != CharClass::kSpace) break;
    last = j;
    j += len;
  }
  if (j == n) return n;
  // The lookahead fails before a non-space, so the greedy run gives back its last code point (which then
  // becomes the " " prefix of the next word); a single white space has nothing to give and \s+ takes it.
  return last > i ? last : j;
}

size_t contraction_end(std::string_view s, size_t i) {
  if (i + 1 >= s.size()) return 0;
  const char c1 = s[i + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
  if (i + 2 >= s.size()) return 0;
  const char c2 = s[i + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return i + 3;
  return 0;
}

}  // namespace

size_t gpt2_piece_end(std::string_view s, size_t i) {
  const char c0 = s[i];
  if (c0 == '\'') {
    if (const size_t e = contraction_end(s, i)) return e;
  }
  // " ?\p{L}+", " ?\p{N}+" and " ?[^\s\p{L}\p{N}]+" differ only in the class of the run after an
  // optional single space, so classify that code point once.
  const size_t j = (c0 == ' ' && i + 1 < s.size()) ? i + 1 : i;
  int len;
  const CharClass c = char_class(decode_utf8(s, j, &len));
  if (c != CharClass::kSpace) return run_end(s, j + len, c);
  return space_end(s, i);
}

std::vector<std::string> gpt2_split(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const size_t e = gpt2_piece_end(s, i);
    out.emplace_back(s.substr(i, e - i));
    i = e;
  }
  return out;
}

}  // namespace merlin::tok
