// Tokenizers: GPT-2 byte-level BPE (tokenizer.ggml.model = "gpt2") and SentencePiece-style BPE with byte
// fallback (tokenizer.ggml.model = "llama"), behind one interface.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace merlin::gguf {
class Metadata;
}

namespace merlin {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Reads tokenizer.ggml.* keys; throws merlin::Error when they are missing, inconsistent or unsupported.
  static std::unique_ptr<Tokenizer> from_gguf(const gguf::Metadata& md);
  // GPT-2 from OpenAI's encoder.json + vocab.bpe.
  static std::unique_ptr<Tokenizer> from_gpt2_files(const std::string& encoder_json_path,
                                                    const std::string& vocab_bpe_path);

  // Text to token ids. Throws merlin::Error("invalid UTF-8 ...") on malformed input. With
  // allow_special, literal special-token strings such as "<|endoftext|>" become their ids
  // (tiktoken's allowed_special="all"); otherwise they are encoded as ordinary text.
  // Does not add BOS; callers ask add_bos() and prepend bos_id() themselves.
  virtual std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const = 0;

  // Bytes of one token as it appears in running text after token `prev` (-1 at the start). For
  // SentencePiece this drops the leading space of the first piece after BOS, as llama.cpp and llama2.c do.
  // Control tokens (BOS/EOS) decode to "". The bytes may be an incomplete UTF-8 sequence.
  virtual std::string decode_token(int32_t id, int32_t prev = -1) const = 0;
  std::string decode(const std::vector<int32_t>& ids) const;

  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 if none
  virtual int32_t eos_id() const = 0;  // -1 if none
  virtual bool add_bos() const = 0;    // whether prompts should start with BOS
  virtual std::string model_name() const = 0;  // "gpt2" or "llama"

  // Writes the tokenizer.ggml.* keys that from_gguf() reads back.
  virtual void write_gguf(gguf::Metadata& md) const = 0;
};

// Returns an error message if `s` is not valid UTF-8 (empty when valid).
std::string utf8_error(std::string_view s);

}  // namespace merlin
