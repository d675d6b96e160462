// One description of the model, shared by inference, training, export and the CUDA backend.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace merlin::gguf {
class Metadata;
}

namespace merlin {

struct ModelConfig {
  std::string name = "merlin";
  int64_t dim = 0;          // d_model
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;   // GQA: n_heads % n_kv_heads == 0
  int64_t ffn_dim = 0;      // SwiGLU hidden size
  int64_t vocab_size = 50257;
  int64_t context_length = 0;
  int64_t n_rot = 0;        // rotary dims per head (llama.rope.dimension_count); 0 means head_dim
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  bool tied_embeddings = true;  // output head shares token_embd

  int64_t head_dim() const { return dim / n_heads; }
  int64_t kv_dim() const { return head_dim() * n_kv_heads; }
  int64_t rot_dims() const { return n_rot > 0 ? n_rot : head_dim(); }
  uint64_t n_params() const;  // counting the tied head once
  void validate() const;      // throws merlin::Error on inconsistent dimensions

  // llama.* keys (plus general.architecture/name) in GGUF metadata.
  static ModelConfig from_gguf(const gguf::Metadata& md);
  void write_gguf(gguf::Metadata& md) const;
};

// Presets: sanity, experiment, base, iphone, macbook.
std::optional<ModelConfig> preset(const std::string& name);
std::vector<std::string> preset_names();

// Tensor names of the llama architecture in GGUF.
namespace tensor_names {
inline const char* kTokenEmbd = "token_embd.weight";
inline const char* kOutputNorm = "output_norm.weight";
inline const char* kOutput = "output.weight";
std::string blk(int layer, const char* suffix);  // blk(3, "attn_q") -> "blk.3.attn_q.weight"
}  // namespace tensor_names

}  // namespace merlin
