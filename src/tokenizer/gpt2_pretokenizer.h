// Private to the tokenizer: GPT-2's pre-tokenizer, the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matched by hand with the same leftmost-first, greedy semantics as tiktoken's regex engine.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace merlin::tok {

// End (exclusive) of the regex match that starts at s[i] (i < s.size()). The regex matches every
// position of valid UTF-8 text, so the pieces tile the text: call again from the returned end.
size_t gpt2_piece_end(std::string_view s, size_t i);

// All pieces of `s`, for tests.
std::vector<std::string> gpt2_split(std::string_view s);

}  // namespace merlin::tok
