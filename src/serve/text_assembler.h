// Turns the bytes of generated tokens into text that is safe to send to a client as it is produced:
// never half of a UTF-8 character (a token may end in the middle of one), and never the beginning of a
// stop string that may still be completed by the next tokens (stop strings can span token boundaries).
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace merlin::serve {

class TextAssembler {
 public:
  explicit TextAssembler(std::vector<std::string> stop_strings = {});

  // Appends one token's bytes; returns the text that can be sent now (possibly empty). Once a stop string
  // has appeared, returns the text before it, and every later call returns "".
  std::string push(std::string_view bytes);
  // End of generation: the text still held back. An incomplete UTF-8 tail becomes U+FFFD. "" after a stop.
  std::string finish();

  bool stopped() const { return stopped_; }
  // Bytes held back so far (a possible stop-string prefix or an unfinished character).
  size_t held() const { return pending_.size(); }

 private:
  size_t stop_hold(std::string_view text) const;

  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

// Length of the tail of `s` that is the start of a multi-byte UTF-8 character still missing bytes (0..3).
size_t incomplete_utf8_tail(std::string_view s);
// `s` with every invalid UTF-8 sequence replaced by U+FFFD, so it can go into JSON.
std::string sanitize_utf8(std::string_view s);

}  // namespace merlin::serve
