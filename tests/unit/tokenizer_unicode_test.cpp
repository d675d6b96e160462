// UTF-8 validation, code point classes and the GPT-2 pre-tokenizer, without any vocabulary.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tokenizer/gpt2_pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace merlin {
namespace {

using tok::char_class;
using tok::CharClass;
using tok::gpt2_split;
using Pieces = std::vector<std::string>;

TEST(Utf8, AcceptsValidText) {
  EXPECT_EQ(utf8_error(""), "");
  EXPECT_EQ(utf8_error("plain ascii, long enough for the 8-byte fast path"), "");
  EXPECT_EQ(utf8_error("F\xC3\xBChrer \xE2\x82\xAC \xF0\x9F\xA6\x99"), "");  // ü € 🦙
  EXPECT_EQ(utf8_error("\xF4\x8F\xBF\xBF"), "");                             // U+10FFFF
  EXPECT_EQ(utf8_error("\xED\x9F\xBF\xEE\x80\x80"), "");                     // U+D7FF U+E000
  EXPECT_EQ(utf8_error(std::string("a\0b", 3)), "");                         // NUL is valid
}

TEST(Utf8, RejectsMalformedText) {
  const std::vector<std::string> bad = {
      "\x80",                  // lone continuation
      "abc\xBF",               // continuation after ASCII
      "\xC0\x80",              // overlong NUL
      "\xC1\xBF",              // overlong 2-byte
      "\xE0\x80\xAF",          // overlong 3-byte
      "\xF0\x8F\xBF\xBF",      // overlong 4-byte
      "\xED\xA0\x80",          // U+D800 surrogate
      "\xED\xBF\xBF",          // U+DFFF surrogate
      "\xF4\x90\x80\x80",      // U+110000
      "\xF5\x80\x80\x80",      // > U+10FFFF lead
      "\xF8\x88\x80\x80\x80",  // 5-byte form
      "\xFF",
      "\xC3",                  // truncated at end
      "\xE2\x82",              // truncated at end
      "\xE2\x82x",             // truncated by ASCII
      "12345678\xF0\x9F\xA6",  // truncated after the fast path
  };
  for (const std::string& s : bad) EXPECT_NE(utf8_error(s), "") << "accepted " << ::testing::PrintToString(s);
}

TEST(Utf8, MessageSaysWhere) {
  EXPECT_EQ(utf8_error("ab\xC0\x80"), "byte 0xC0 at offset 2 starts an overlong encoding");
  EXPECT_EQ(utf8_error("\xED\xA0\x80"), "byte 0xED at offset 0 encodes a UTF-16 surrogate");
}

TEST(CharClass, MatchesUnicodeCategories) {
  EXPECT_EQ(char_class('a'), CharClass::kLetter);
  EXPECT_EQ(char_class('Z'), CharClass::kLetter);
  EXPECT_EQ(char_class('7'), CharClass::kNumber);
  EXPECT_EQ(char_class('_'), CharClass::kOther);
  EXPECT_EQ(char_class('\''), CharClass::kOther);
  EXPECT_EQ(char_class(' '), CharClass::kSpace);
  EXPECT_EQ(char_class('\t'), CharClass::kSpace);
  EXPECT_EQ(char_class('\n'), CharClass::kSpace);
  EXPECT_EQ(char_class(0x1C), CharClass::kOther);      // not White_Space, though Python's isspace() says so
  EXPECT_EQ(char_class(0xA0), CharClass::kSpace);      // NO-BREAK SPACE
  EXPECT_EQ(char_class(0x3000), CharClass::kSpace);    // IDEOGRAPHIC SPACE
  EXPECT_EQ(char_class(0x200B), CharClass::kOther);    // ZERO WIDTH SPACE is Cf
  EXPECT_EQ(char_class(0x00FC), CharClass::kLetter);   // ü
  EXPECT_EQ(char_class(0x00BD), CharClass::kNumber);   // ½ (No)
  EXPECT_EQ(char_class(0x00B2), CharClass::kNumber);   // ² (No)
  EXPECT_EQ(char_class(0x2167), CharClass::kNumber);   // Ⅷ (Nl)
  EXPECT_EQ(char_class(0x0660), CharClass::kNumber);   // Arabic-Indic zero (Nd)
  EXPECT_EQ(char_class(0x6211), CharClass::kLetter);   // 我 (Lo)
  EXPECT_EQ(char_class(0x17B6), CharClass::kOther);    // Khmer vowel sign (Mc): marks are not letters
  EXPECT_EQ(char_class(0x0301), CharClass::kOther);    // combining acute (Mn)
  EXPECT_EQ(char_class(0x1F999), CharClass::kOther);   // 🦙
  EXPECT_EQ(char_class(0x20000), CharClass::kLetter);  // CJK Extension B
  EXPECT_EQ(char_class(0x10FFFF), CharClass::kOther);
}

TEST(Gpt2Split, Words) {
  EXPECT_EQ(gpt2_split("Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(gpt2_split(" Hello, world!"), (Pieces{" Hello", ",", " world", "!"}));
  EXPECT_EQ(gpt2_split("w048 7tuijk"), (Pieces{"w", "048", " 7", "tuijk"}));
  EXPECT_EQ(gpt2_split("3..3 -- ??"), (Pieces{"3", "..", "3", " --", " ??"}));
}

TEST(Gpt2Split, Contractions) {
  EXPECT_EQ(gpt2_split("I've he's we'll 'd"), (Pieces{"I", "'ve", " he", "'s", " we", "'ll", " '", "d"}));
  EXPECT_EQ(gpt2_split("'sam"), (Pieces{"'s", "am"}));
  EXPECT_EQ(gpt2_split("We'Ve a'lL 'RE"), (Pieces{"We", "'", "Ve", " a", "'", "lL", " '", "RE"}));
  EXPECT_EQ(gpt2_split("''s"), (Pieces{"''", "s"}));
  EXPECT_EQ(gpt2_split("'"), (Pieces{"'"}));
  EXPECT_EQ(gpt2_split("'r"), (Pieces{"'", "r"}));
}

TEST(Gpt2Split, WhiteSpace) {
  EXPECT_EQ(gpt2_split(" "), (Pieces{" "}));
  EXPECT_EQ(gpt2_split("   "), (Pieces{"   "}));
  EXPECT_EQ(gpt2_split("  Hello"), (Pieces{" ", " Hello"}));
  EXPECT_EQ(gpt2_split("    Hello\n    Hello"), (Pieces{"   ", " Hello", "\n   ", " Hello"}));
  EXPECT_EQ(gpt2_split("a\n\nb"), (Pieces{"a", "\n", "\n", "b"}));
  EXPECT_EQ(gpt2_split("a \n"), (Pieces{"a", " \n"}));
  EXPECT_EQ(gpt2_split("\t\tx"), (Pieces{"\t", "\t", "x"}));
  EXPECT_EQ(gpt2_split("\n ="), (Pieces{"\n", " ="}));
  // U+3000 is white space, so a run ending in it gives it back like an ASCII space.
  EXPECT_EQ(gpt2_split("a \xE3\x80\x80"
                       "b"),
            (Pieces{"a", " ", "\xE3\x80\x80", "b"}));
}

TEST(Gpt2Split, Unicode) {
  EXPECT_EQ(gpt2_split("F\xC3\xBChrer"), (Pieces{"F\xC3\xBChrer"}));
  EXPECT_EQ(gpt2_split("ied 4 \xC2\xBD months"), (Pieces{"ied", " 4", " \xC2\xBD", " months"}));
  EXPECT_EQ(gpt2_split("\xF0\x9F\xA6\x99.cpp"), (Pieces{"\xF0\x9F\xA6\x99.", "cpp"}));
  EXPECT_EQ(gpt2_split("\xE6\x88\x91"
                       "apple1314"),
            (Pieces{"\xE6\x88\x91"
                    "apple",
                    "1314"}));
}

TEST(Gpt2Split, PiecesTileTheText) {
  const std::string s = "Once upon a time,  there was\ta   dog's 12 bones!!\n\n The end.  \n";
  std::string joined;
  for (const std::string& p : gpt2_split(s)) {
    EXPECT_FALSE(p.empty());
    joined += p;
  }
  EXPECT_EQ(joined, s);
}

}  // namespace
}  // namespace merlin
