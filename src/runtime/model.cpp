#include "runtime/model.h"

#include <fcntl.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/huge_pages.h"
#include "kernels/cpu/kernels.h"

namespace merlin {

namespace tn = tensor_names;

namespace {

bool want_huge_pages(WeightMemory memory, uint64_t bytes) {
  if (memory != WeightMemory::Auto) return memory == WeightMemory::HugePages;
  if (const char* e = std::getenv("MERLIN_MMAP"); e != nullptr && std::strcmp(e, "1") == 0) return false;
  // Leave room for the page cache, the KV cache and everything else: copy only up to half of what is free.
  return bytes > 0 && bytes <= mem_available_bytes() / 2;
}

}  // namespace

namespace {

// pread of n bytes at off; false on a short file or error.
bool read_at(int fd, uint8_t* dst, uint64_t n, uint64_t off) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, dst + done, std::min<uint64_t>(n - done, 64 << 20), (off_t)(off + done));
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    done += (uint64_t)r;
  }
  return true;
}

// A matrix of the file going into the copy: in the CPU kernels' load-time layout when they have one
// (MERLIN_REPACK=0 keeps the file's layout, for A/B measurements), else as stored.
struct Placement {
  Weight* w;
  uint64_t file_offset;
  const kernels::PackedMatmul* pm;
  size_t bytes, at;
};

// Repacks a matrix from the file in slabs of rows, so only the copy stays resident.
bool read_packed(int fd, const Placement& p, uint8_t* dst) {
  const Weight& w = *p.w;
  constexpr int64_t kSlabRows = 16 * kernels::kRepackRows;
  const size_t group_bytes = p.pm->bytes(kernels::kRepackRows, w.cols);
  std::vector<uint8_t> slab((size_t)kSlabRows * w.row_bytes);
  for (int64_t r = 0; r < w.rows; r += kSlabRows) {
    const int64_t n = std::min(kSlabRows, w.rows - r);
    if (!read_at(fd, slab.data(), (uint64_t)n * w.row_bytes, p.file_offset + (uint64_t)r * w.row_bytes)) return false;
    p.pm->repack(slab.data(), w.row_bytes, n, w.cols, dst + (size_t)(r / kernels::kRepackRows) * group_bytes);
  }
  return true;
}

}  // namespace

// Copies the matrices (not the embedding table, of which a few rows are read per token) into anonymous
// memory backed by 2 MiB pages, read with pread rather than through the map so the copy is the only resident
// version. Types whose CPU kernels have a row-interleaved layout are stored only in that layout (the file's
// size, or 2.8 % more for Q4_K's unpacked scales; sized by `bytes`), for faster decode and prefill; their
// `data` keeps pointing into the file for other readers.
void Model::place_weights_in_huge_pages() {
  const char* e = std::getenv("MERLIN_REPACK");
  const bool repack = e == nullptr || std::strcmp(e, "0") != 0;
  std::vector<Placement> plan;
  size_t total = 0;
  auto add = [&](Weight& w, const std::string& name) {
    const kernels::MatmulKernel* k = kernels::kernels().matmul(w.type);
    const kernels::PackedMatmul* pm = repack && k != nullptr ? k->packed : nullptr;
    const size_t bytes = pm ? pm->bytes(w.rows, w.cols) : (size_t)w.rows * w.row_bytes;
    plan.push_back({&w, file_->data_offset() + file_->tensor(name).offset, pm, bytes, total});
    total += (bytes + 63) / 64 * 64;
  };
  add(output_, config_.tied_embeddings ? tn::kTokenEmbd : tn::kOutput);
  for (int i = 0; i < config_.n_layers; ++i) {
    LayerWeights& l = layers_[(size_t)i];
    const std::pair<Weight*, const char*> mats[] = {{&l.wq, "attn_q"},      {&l.wk, "attn_k"},  {&l.wv, "attn_v"},
                                                    {&l.wo, "attn_output"}, {&l.gate, "ffn_gate"}, {&l.up, "ffn_up"},
                                                    {&l.down, "ffn_down"}};
    for (const auto& [w, name] : mats) add(*w, tn::blk(i, name));
  }
  const size_t mapped = (total + kPageBytes - 1) / kPageBytes * kPageBytes;
  uint8_t* p = map_huge_page_aligned(mapped);
  if (p == nullptr) return;  // keep the weights in place
  std::unique_ptr<uint8_t, HugePageUnmap> copy(p, HugePageUnmap{mapped});
  const int fd = ::open(file_->path().c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  for (const Placement& pl : plan) {
    uint8_t* dst = copy.get() + pl.at;
    const bool ok = pl.pm ? read_packed(fd, pl, dst) : read_at(fd, dst, pl.bytes, pl.file_offset);
    if (!ok) {
      ::close(fd);
      return;  // the file changed under us: keep the weights in place
    }
  }
  ::close(fd);
  ::mprotect(copy.get(), mapped, PROT_READ);
  for (const Placement& pl : plan) {
    if (pl.pm) {
      pl.w->packed = copy.get() + pl.at;
      pl.w->packed_kernel = pl.pm;
    } else {
      pl.w->data = copy.get() + pl.at;
    }
  }
  // A tied table is looked up in the output's copy: rows read through the file map would add resident
  // pages (and the kernel maps 16 around each fault).
  if (config_.tied_embeddings) {
    token_embd_.packed = output_.packed;
    token_embd_.packed_kernel = output_.packed_kernel;
    if (output_.packed == nullptr) token_embd_.data = output_.data;
  }
  weights_copy_ = std::move(copy);
}

// What only loading needed: the tokenizer's arrays in the file's metadata (the Tokenizer holds its own copy
// and can write them back with to_gguf), the pages of the map that parsing and the norm vectors touched, and
// the heap pages freed by both. About 10 MiB on GPT-2-vocabulary models, as much as their KV cache holds
// for a few hundred positions.
void Model::release_load_memory() {
  for (const char* key : {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                          "tokenizer.ggml.scores"})
    file_->release_metadata(key);
  file_->release_resident_pages();
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
}

std::unique_ptr<Model> Model::load(const std::string& path, WeightMemory memory) {
  std::unique_ptr<Model> m(new Model());
  m->file_ = gguf::File::open(path);
  try {
    m->config_ = ModelConfig::from_gguf(m->file_->metadata());
    const gguf::TensorInfo& embd = m->file_->tensor(tn::kTokenEmbd);
    MERLIN_CHECK(embd.dims.size() == 2, "token_embd.weight must be 2-D");
    if (m->config_.vocab_size == 0) m->config_.vocab_size = (int64_t)embd.dims[1];
    m->config_.tied_embeddings = m->file_->find_tensor(tn::kOutput) == nullptr;
    m->config_.validate();
    const ModelConfig& c = m->config_;
    m->tokenizer_ = Tokenizer::from_gguf(m->file_->metadata());
    MERLIN_CHECK(m->tokenizer_->vocab_size() <= c.vocab_size, "tokenizer has ", m->tokenizer_->vocab_size(),
                 " tokens but the model only ", c.vocab_size);

    m->token_embd_ = m->matrix(tn::kTokenEmbd, c.vocab_size, c.dim);
    m->output_ = c.tied_embeddings ? m->token_embd_ : m->matrix(tn::kOutput, c.vocab_size, c.dim);
    m->output_norm_ = m->vector(tn::kOutputNorm, c.dim);
    const int64_t q_dim = c.n_heads * c.head_dim();
    for (int i = 0; i < c.n_layers; ++i) {
      LayerWeights l;
      l.attn_norm = m->vector(tn::blk(i, "attn_norm"), c.dim);
      l.ffn_norm = m->vector(tn::blk(i, "ffn_norm"), c.dim);
      l.wq = m->matrix(tn::blk(i, "attn_q"), q_dim, c.dim);
      l.wk = m->matrix(tn::blk(i, "attn_k"), c.kv_dim(), c.dim);
      l.wv = m->matrix(tn::blk(i, "attn_v"), c.kv_dim(), c.dim);
      l.wo = m->matrix(tn::blk(i, "attn_output"), c.dim, q_dim);
      l.gate = m->matrix(tn::blk(i, "ffn_gate"), c.ffn_dim, c.dim);
      l.up = m->matrix(tn::blk(i, "ffn_up"), c.ffn_dim, c.dim);
      l.down = m->matrix(tn::blk(i, "ffn_down"), c.dim, c.ffn_dim);
      m->layers_.push_back(std::move(l));
    }
    // Before the copy, so the peak of loading is not the copy plus what parsing left behind.
    m->release_load_memory();
    if (want_huge_pages(memory, m->file_->file_size() - m->file_->data_offset())) m->place_weights_in_huge_pages();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(path, 0) == 0) throw;
    fail(path, ": ", msg);
  }
  return m;
}

Weight Model::matrix(const std::string& name, int64_t rows, int64_t cols) const {
  const gguf::TensorInfo& t = file_->tensor(name);
  MERLIN_CHECK(t.dims.size() == 2 && (int64_t)t.dims[0] == cols && (int64_t)t.dims[1] == rows, "tensor '", name,
               "' has shape [", t.dims[0], (t.dims.size() > 1 ? ", " + std::to_string(t.dims[1]) : std::string()),
               "], expected [", cols, ", ", rows, "]");
  const kernels::MatmulKernel* k = kernels::kernels().matmul(t.type);
  MERLIN_CHECK(k != nullptr && k->rows != nullptr, "tensor '", name, "' has type ", dtype_name(t.type),
               ", which Merlin cannot compute with yet");
  Weight w;
  w.type = t.type;
  w.data = t.data;
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = dtype_row_bytes(t.type, (uint64_t)cols);
  return w;
}

std::vector<float> Model::vector(const std::string& name, int64_t n) const {
  const gguf::TensorInfo& t = file_->tensor(name);
  MERLIN_CHECK(t.n_elements == (uint64_t)n, "tensor '", name, "' has ", t.n_elements, " elements, expected ", n);
  std::vector<float> out((size_t)n);
  kernels::dequantize_row(t.type, t.data, out.data(), n);
  return out;
}

uint64_t Model::weight_bytes() const {
  uint64_t total = 0;
  for (const gguf::TensorInfo& t : file_->tensors()) total += t.n_bytes;
  return total;
}

}  // namespace merlin
