// Strict UTF-8 validation (RFC 3629) and the code point class lookup.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace merlin {

namespace {

std::string where(size_t offset, unsigned char b) {
  char hex[8];
  std::snprintf(hex, sizeof(hex), "0x%02X", b);
  return cat("byte ", hex, " at offset ", offset);
}

// Returns the length of the valid sequence at s[i], or 0 with `why` set.
size_t check_sequence(std::string_view s, size_t i, std::string* why) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const unsigned char b = p[i];
  size_t len;
  uint32_t min_cp;
  uint32_t cp;
  if (b >= 0x80 && b < 0xC0) {
    *why = where(i, b) + " is an unexpected continuation byte";
    return 0;
  } else if (b < 0xE0) {
    len = 2, min_cp = 0x80, cp = b & 0x1F;
  } else if (b < 0xF0) {
    len = 3, min_cp = 0x800, cp = b & 0x0F;
  } else if (b < 0xF8) {
    len = 4, min_cp = 0x10000, cp = b & 0x07;
  } else {
    *why = where(i, b) + " can never appear in UTF-8";
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size() || (p[i + k] & 0xC0) != 0x80) {
      *why = where(i, b) + " starts a truncated sequence";
      return 0;
    }
    cp = (cp << 6) | (p[i + k] & 0x3F);
  }
  if (cp < min_cp) {
    *why = where(i, b) + " starts an overlong encoding";
  } else if (cp >= 0xD800 && cp <= 0xDFFF) {
    *why = where(i, b) + " encodes a UTF-16 surrogate";
  } else if (cp > 0x10FFFF) {
    *why = where(i, b) + " encodes a code point above U+10FFFF";
  } else {
    return len;
  }
  return 0;
}

}  // namespace

std::string utf8_error(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // Plain ASCII dominates real text; skip it eight bytes at a time.
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    std::string why;
    const size_t len = check_sequence(s, i, &why);
    if (len == 0) return why;
    i += len;
  }
  return {};
}

namespace tok {

CharClass char_class_slow(uint32_t cp) {
  // The last run whose start is <= cp; the table starts at code point 0, so there is always one.
  const uint32_t key = (cp << 8) | 0xFF;
  const uint32_t* it = std::upper_bound(kClassRuns, kClassRuns + kClassRunCount, key);
  return static_cast<CharClass>(it[-1] & 0xFF);
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace tok
}  // namespace merlin
