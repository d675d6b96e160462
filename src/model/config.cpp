#include "model/config.h"

#include "core/error.h"
#include "format/gguf.h"

namespace merlin {

uint64_t ModelConfig::n_params() const {
  const uint64_t d = dim, hd = head_dim();
  const uint64_t attn = d * (n_heads * hd) + 2 * d * (n_kv_heads * hd) + (n_heads * hd) * d;
  const uint64_t ffn = 3 * d * (uint64_t)ffn_dim;
  const uint64_t per_layer = attn + ffn + 2 * d;
  const uint64_t embd = (uint64_t)vocab_size * d;
  return embd + (tied_embeddings ? 0 : embd) + (uint64_t)n_layers * per_layer + d;
}

void ModelConfig::validate() const {
  MERLIN_CHECK(dim > 0 && n_layers > 0 && n_heads > 0 && ffn_dim > 0 && vocab_size > 0 && context_length > 0,
               "model dimensions must be positive (dim ", dim, ", layers ", n_layers, ", heads ", n_heads, ", ffn ",
               ffn_dim, ", vocab ", vocab_size, ", context ", context_length, ")");
  MERLIN_CHECK(dim % n_heads == 0, "embedding size ", dim, " is not a multiple of the head count ", n_heads);
  MERLIN_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "head count ", n_heads,
               " is not a multiple of the KV head count ", n_kv_heads);
  MERLIN_CHECK(rot_dims() % 2 == 0 && rot_dims() <= head_dim(), "rope dimension count ", rot_dims(),
               " must be even and at most the head size ", head_dim());
  MERLIN_CHECK(norm_eps > 0, "RMSNorm epsilon must be positive");
  MERLIN_CHECK(dim <= (1 << 16) && n_layers <= 1024 && vocab_size <= (1 << 22) && context_length <= (1 << 20) &&
                   ffn_dim <= (1 << 18),
               "model dimensions are implausibly large");
}

ModelConfig ModelConfig::from_gguf(const gguf::Metadata& md) {
  const std::string arch = md.get_string("general.architecture", "");
  MERLIN_CHECK(arch == "llama", "unsupported model architecture '", arch, "' (Merlin runs 'llama')");
  ModelConfig c;
  c.name = md.get_string("general.name", "merlin");
  c.dim = md.at("llama.embedding_length").as_int("llama.embedding_length");
  c.n_layers = md.at("llama.block_count").as_int("llama.block_count");
  c.n_heads = md.at("llama.attention.head_count").as_int("llama.attention.head_count");
  c.n_kv_heads = md.get_int("llama.attention.head_count_kv", c.n_heads);
  c.ffn_dim = md.at("llama.feed_forward_length").as_int("llama.feed_forward_length");
  c.context_length = md.at("llama.context_length").as_int("llama.context_length");
  c.n_rot = md.get_int("llama.rope.dimension_count", 0);
  c.rope_theta = (float)md.get_double("llama.rope.freq_base", 10000.0);
  c.norm_eps = (float)md.get_double("llama.attention.layer_norm_rms_epsilon", 1e-5);
  if (const gguf::Value* v = md.find("llama.vocab_size")) c.vocab_size = v->as_int("llama.vocab_size");
  else if (const gguf::Value* t = md.find("tokenizer.ggml.tokens")) c.vocab_size = (int64_t)t->as_array("tokenizer.ggml.tokens").items.size();
  else c.vocab_size = 0;  // taken from token_embd by the loader
  return c;
}

void ModelConfig::write_gguf(gguf::Metadata& md) const {
  md.set("general.architecture", "llama");
  md.set("general.name", name);
  md.set("llama.context_length", (uint32_t)context_length);
  md.set("llama.embedding_length", (uint32_t)dim);
  md.set("llama.block_count", (uint32_t)n_layers);
  md.set("llama.feed_forward_length", (uint32_t)ffn_dim);
  md.set("llama.attention.head_count", (uint32_t)n_heads);
  md.set("llama.attention.head_count_kv", (uint32_t)n_kv_heads);
  md.set("llama.rope.dimension_count", (uint32_t)rot_dims());
  md.set("llama.rope.freq_base", rope_theta);
  md.set("llama.attention.layer_norm_rms_epsilon", norm_eps);
  md.set("llama.vocab_size", (uint32_t)vocab_size);
}

std::optional<ModelConfig> preset(const std::string& name) {
  auto make = [&](int64_t d, int64_t h, int64_t l, int64_t ctx, int64_t ffn) {
    ModelConfig c;
    c.name = "merlin-" + name;
    c.dim = d;
    c.n_heads = h;
    c.n_kv_heads = h;
    c.n_layers = l;
    c.context_length = ctx;
    c.ffn_dim = ffn;
    return c;
  };
  if (name == "sanity") return make(32, 2, 2, 64, 128);
  if (name == "experiment") return make(256, 8, 8, 512, 1024);
  if (name == "base") return make(768, 12, 12, 1024, 2048);
  if (name == "iphone") return make(3072, 24, 20, 4096, 12288);
  if (name == "macbook") return make(4096, 32, 26, 4096, 16384);
  return std::nullopt;
}

std::vector<std::string> preset_names() { return {"sanity", "experiment", "base", "iphone", "macbook"}; }

std::string tensor_names::blk(int layer, const char* suffix) {
  return "blk." + std::to_string(layer) + "." + suffix + ".weight";
}

}  // namespace merlin
