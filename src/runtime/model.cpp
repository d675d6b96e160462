#include "runtime/model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "kernels/cpu/kernels.h"

namespace merlin {

namespace tn = tensor_names;

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

uint64_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  while (f >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    f.ignore(1 << 10, '\n');
  }
  return 0;
}

bool want_huge_pages(WeightMemory memory, uint64_t bytes) {
  if (memory != WeightMemory::Auto) return memory == WeightMemory::HugePages;
  if (const char* e = std::getenv("MERLIN_MMAP"); e != nullptr && std::strcmp(e, "1") == 0) return false;
  // Leave room for the page cache, the KV cache and everything else: copy only up to half of what is free.
  return bytes > 0 && bytes <= mem_available_bytes() / 2;
}

}  // namespace

void Model::AnonDeleter::operator()(uint8_t* p) const {
  if (p != nullptr) ::munmap(p, bytes);
}

// Reads the data section with pread (not through the map), so the copy is the only resident version.
void Model::copy_weights_to_huge_pages() {
  const uint64_t begin = file_->data_offset(), bytes = file_->file_size() - begin;
  const size_t mapped = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return;  // keep the weights in place
  ::madvise(p, mapped, MADV_HUGEPAGE);
  std::unique_ptr<uint8_t, AnonDeleter> copy(static_cast<uint8_t*>(p), AnonDeleter{mapped});
  const int fd = ::open(file_->path().c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, copy.get() + done, std::min<uint64_t>(bytes - done, 64 << 20), (off_t)(begin + done));
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      ::close(fd);
      return;  // the file changed under us: keep the weights in place
    }
    done += (uint64_t)n;
  }
  ::close(fd);
  ::mprotect(copy.get(), mapped, PROT_READ);
  weights_copy_ = std::move(copy);
}

const uint8_t* Model::weight_ptr(const gguf::TensorInfo& t) const {
  return weights_copy_ ? weights_copy_.get() + t.offset : t.data;  // offsets are relative to the data section
}

std::unique_ptr<Model> Model::load(const std::string& path, WeightMemory memory) {
  std::unique_ptr<Model> m(new Model());
  m->file_ = gguf::File::open(path);
  if (want_huge_pages(memory, m->file_->file_size() - m->file_->data_offset())) m->copy_weights_to_huge_pages();
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
  w.data = weight_ptr(t);
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
