// A loaded model: configuration, tokenizer and weight views into the mmapped GGUF file, in whatever type
// the file stores. When memory allows, the matrices are copied once into huge pages, those with a CPU
// load-time layout (kernels::PackedMatmul) only in that layout; only small 1-D norm vectors are converted to
// f32 and owned.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/huge_pages.h"
#include "format/gguf.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace merlin::kernels {
struct PackedMatmul;
}

namespace merlin {

// A 2-D weight matrix: `rows` output features, each a row of `cols` elements of `type`.
struct Weight {
  DType type = DType::F32;
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  size_t row_bytes = 0;
  const uint8_t* row(int64_t r) const { return static_cast<const uint8_t*>(data) + (size_t)r * row_bytes; }
  // The same matrix in the active CPU kernel level's load-time layout, when the model keeps its weights in
  // huge pages and that level has one for this type (then `data` stays in the file map, unused by the CPU
  // backend and paged in only if something else reads it). Row lookups go through
  // packed_kernel->unpack_row.
  const void* packed = nullptr;
  const kernels::PackedMatmul* packed_kernel = nullptr;
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;
  Weight wq, wk, wv, wo;
  Weight gate, up, down;
};

// Where the weights live while the model runs.
enum class WeightMemory {
  Auto,       // HugePages when they fit comfortably in available memory, else Mapped
  Mapped,     // in place in the mmapped file (4 KiB pages; the kernel pages weights in on demand)
  HugePages,  // copied once into anonymous memory backed by 2 MiB transparent huge pages
};

class Model {
 public:
  // Maps and validates the file: architecture, shapes of every tensor against the config, tokenizer.
  // Decode streams every weight once per token, so TLB misses on 4 KiB pages cost a third of the memory
  // bandwidth on this class of machine; a huge-page copy avoids them. MERLIN_MMAP=1 forces Mapped.
  static std::unique_ptr<Model> load(const std::string& path, WeightMemory memory = WeightMemory::Auto);

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const gguf::File& file() const { return *file_; }

  const Weight& token_embd() const { return token_embd_; }
  const Weight& output() const { return output_; }  // token_embd when tied
  const std::vector<float>& output_norm() const { return output_norm_; }
  const LayerWeights& layer(int i) const { return layers_[(size_t)i]; }

  // Main weight type (of the attention Q projection), e.g. for `merlin bench` rows.
  DType weight_type() const { return layers_.empty() ? token_embd_.type : layers_[0].wq.type; }
  uint64_t weight_bytes() const;  // bytes of all tensors in the file

 private:
  Model() = default;
  Weight matrix(const std::string& name, int64_t rows, int64_t cols) const;
  std::vector<float> vector(const std::string& name, int64_t n) const;

  std::unique_ptr<gguf::File> file_;
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  Weight token_embd_, output_;
  std::vector<float> output_norm_;
  std::vector<LayerWeights> layers_;
  // The huge-page copy of the matrices (null when weights are used in place).
  std::unique_ptr<uint8_t, HugePageUnmap> weights_copy_{nullptr, HugePageUnmap{0}};
  void place_weights_in_huge_pages();
  void release_load_memory();
};

}  // namespace merlin
