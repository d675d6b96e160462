// CpuBackend's declaration and helpers, shared by its two source files: cpu_backend.cpp (set-up, the forward
// pass, the products, the output head, sampling) and cpu_attention.cpp (attention over the paged K/V cache).
// cpu_backend.cpp describes the design. Internal to merlin_runtime.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>

#include "core/error.h"
#include "core/huge_pages.h"
#include "core/sys.h"
#include "core/thread_pool.h"
#include "kernels/cpu/head_screen.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"
#include "runtime/backend.h"
#include "runtime/model.h"
#include "runtime/row_sampling.h"

namespace merlin::cpu_backend_detail {

// Uninitialised memory on a 64-byte boundary. malloc gives 16-byte alignment (a large block from mmap sits 16
// bytes past a page), so whether the kernels' 512-bit loads of activations and K/V rows split cache lines
// would depend on the heap's history: F32 prefill ran 10-15% faster or slower with unrelated allocations.
template <typename T>
struct AlignedFree {
  void operator()(T* p) const { ::operator delete[](p, std::align_val_t{64}); }
};
template <typename T>
using AlignedArray = std::unique_ptr<T[], AlignedFree<T>>;
template <typename T>
AlignedArray<T> aligned_array(size_t n) {
  return AlignedArray<T>(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t{64})));
}

// MERLIN_KV_RESIDENT=0 / =1 overrides BackendOptions::resident_kv (A/B timing).
inline bool resident_kv(const BackendOptions& opts) {
  return env_is("MERLIN_KV_RESIDENT", "1") || (opts.resident_kv && !env_is("MERLIN_KV_RESIDENT", "0"));
}

// Activation scratch sized for the largest batch. Left uninitialised: large allocations come from fresh pages,
// so a decode step that uses one row of a 512-row buffer keeps the rest out of the resident set.
class Scratch {
 public:
  void resize(size_t n) {
    p_ = aligned_array<float>(n);
    n_ = n;
  }
  float* data() { return p_.get(); }
  float& operator[](size_t i) { return p_[i]; }
  size_t size() const { return n_; }

 private:
  AlignedArray<float> p_;
  size_t n_ = 0;
};

// Tokens of one sequence whose attention scores are computed in one call of the score kernel: each K row
// is loaded (and widened) once for all of them. 6 is the float kernels' widest token tile.
constexpr int64_t kAttnGroup = 6;

// forward_greedy screens the output head from this many rows on (fewer: the exact product is cheap enough), and
// recomputes at most this many candidate rows of a token exactly (more: the token's whole row, exactly).
constexpr int kScreenMinRows = 8;
constexpr int64_t kScreenMaxCandidates = 512;

struct MatmulJob {
  const Weight* w;
  float* y;  // [n_tokens][w->rows]
};

// Writes batch token t's float input row of a product (k values) to `out`: how a fused product produces its
// input one row at a time (RMSNorm, SwiGLU) instead of reading a materialised [n_tokens][k] buffer.
using RowFn = std::function<void(int64_t t, float* out)>;

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Model& model, const BackendOptions& opts);
  std::string name() const override { return std::string("cpu-") + kernel_level_name(kt_.level); }
  int n_ctx() const override { return n_ctx_; }
  int max_batch() const override { return max_batch_; }
  int n_seq() const override { return n_seq_; }
  void forward(const Batch& batch, float* logits) override;
  void forward_greedy(const Batch& batch, int64_t n_vocab, int32_t* tokens) override;
  void forward_sample(const Batch& batch, int64_t n_vocab, std::span<const RowSampling> rows,
                      std::span<const LogitAdjust> adjust, int32_t* tokens) override;
  void clear_sequence(int seq) override;
  int kv_block_size() const override { return block_size_; }
  int n_kv_blocks() const override { return n_blocks_; }
  void set_block_table(int seq, std::span<const int32_t> blocks) override;
  size_t kv_block_bytes() const override { return 2 * (size_t)c_.n_layers * block_size_ * kv_row_bytes_; }

 private:
  void validate(const Batch& batch) const;
  void run_layers(const Batch& batch);  // validate, embed, every layer: x_ holds the final hidden states
  bool greedy_screened(const Batch& batch, int32_t* tokens);
  int32_t screened_token(int64_t t, const float* screen, int thread);
  void embed(const Batch& batch);
  void attention_block(int layer, const Batch& batch);
  void ffn_block(int layer, int64_t n);
  void output_head(const Batch& batch, float* logits);
  void matmul(const float* x, int64_t n_tokens, int64_t k, std::initializer_list<MatmulJob> jobs);
  void matmul_rows(const RowFn& produce, float* x, int64_t n_tokens, int64_t k, std::initializer_list<MatmulJob> jobs);
  void matmul_prepared(const kernels::MatmulKernel* const* kern, const void* const* xin, const size_t* x_row_bytes,
                       int64_t n_tokens, int64_t k, std::initializer_list<MatmulJob> jobs);
  void attend(int layer, const Batch& batch, int64_t t0, int64_t nt, int64_t h0, int64_t h1, int thread);
  void weigh_values(int layer, const Batch& batch, int64_t t0, int64_t nt, int64_t h0, int64_t h1, float* scores,
                    int thread);
  // Byte offset of head `head`'s K/V slice in a cached row (heads share a K/V head under GQA).
  size_t kv_head_offset(int64_t head) const {
    return (size_t)(head / (c_.n_heads / c_.n_kv_heads)) * kv_head_bytes_;
  }
  // Asks for the head slices (kv_head_bytes_ at p) of n consecutive cached rows: the next block's, requested
  // while this one is computed. A block's rows for one head are a kv_row_bytes_ stride apart, which the hardware
  // prefetchers did not follow across a many-sequence step whose K/V do not fit in the caches.
  void prefetch_slice(const uint8_t* p, int n) const {
    for (int r = 0; r < n; ++r, p += kv_row_bytes_)
      for (size_t b = 0; b < kv_head_bytes_; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
  void accumulate_values(const uint8_t* v0, const float* w, int n, float* out, int thread);
  void store_kv_row(const float* src, uint8_t* dst);
  void identity_table(int seq);
  // First byte of the cached row at `pos` of `seq` (its block must be mapped: validate() checks).
  size_t kv_offset(int seq, int pos) const {
    const int32_t block = tables_[(size_t)seq][(size_t)(pos / block_size_)];
    return ((size_t)block * block_size_ + (size_t)(pos % block_size_)) * kv_row_bytes_;
  }
  uint8_t* k_at(int layer, int seq, int pos) { return k_cache_[layer] + kv_offset(seq, pos); }
  uint8_t* v_at(int layer, int seq, int pos) { return v_cache_[layer] + kv_offset(seq, pos); }

  const Model& m_;
  const ModelConfig& c_;
  const kernels::KernelTable& kt_;
  ThreadPool pool_;
  int n_ctx_, n_seq_, max_batch_;
  int block_size_, n_blocks_;
  bool identity_tables_;                       // n_kv_blocks == 0: sequence s owns a fixed range of blocks
  int blocks_per_seq_;                         // ceil(n_ctx / block_size)
  std::vector<std::vector<int32_t>> tables_;   // per sequence: logical block -> physical block
  int64_t q_dim_;
  DType kv_type_;
  size_t kv_row_bytes_, kv_head_bytes_;
  const kernels::MatmulKernel* score_kernel_;  // q · K rows for the cache type
  // K/V cache per layer: [block][pos in block][kv row]. Allocated untouched so unused context costs no RSS, or,
  // with BackendOptions::resident_kv, as one region of huge pages faulted in ahead by idle_work().
  std::vector<uint8_t*> k_cache_, v_cache_;
  std::vector<AlignedArray<uint8_t>> kv_arrays_;
  std::unique_ptr<uint8_t, HugePageUnmap> kv_region_{nullptr, HugePageUnmap{0}};
  size_t kv_populated_ = 0;                    // bytes of kv_region_ that idle_work has faulted in
  void allocate_kv_cache(size_t layer_bytes, bool resident);
  bool idle_work() override;
  Scratch x_, xn_, q_, k_, v_, att_, gate_, up_, tmp_;
  std::vector<float> scores_, qconv_, vrow_;     // per-thread attention scratch
  std::vector<int64_t> group_starts_;           // attention token groups of the current batch
  struct AttnItem {
    int64_t group, h0, h1;                      // a token group and a range of its heads
  };
  std::vector<AttnItem> attn_items_;
  int64_t attn_slots_;                          // per-thread score rows: max(kAttnGroup, n_heads)
  std::vector<uint8_t> embd_row_;               // a packed embedding row in the file's layout
  std::vector<uint8_t> act_buf_, qact_;         // qact_: per-thread q in the score kernel's format
  std::vector<float> row_;                      // per thread: one fused input row (max(dim, ffn_dim) floats)
  std::vector<float> rope_cs_;                  // per thread: cos/sin of a position's RoPE angles
  AlignedArray<float> greedy_logits_;           // forward_greedy's / forward_sample's logits rows (kept)
  size_t greedy_logits_size_ = 0;
  std::vector<SampleScratch> sample_scratch_;   // per thread: forward_sample's sample_row scratch
  float* step_logits(size_t n_rows, int64_t n_vocab);
  // Greedy screening of a float output head (kernels/cpu/head_screen.h), for backends of many sequences.
  const kernels::HeadScreen* screen_ = nullptr;
  AlignedArray<uint8_t> screen_w_;              // the head's rows in int8, packed
  std::vector<float> screen_scale_, screen_err_, screen_hull_;  // per output row (head_screen.h)
  std::vector<int8_t> screen_x_;                // the step's final hidden states in int8
  std::vector<kernels::ScreenToken> screen_tok_;  // and their scales and bound factors
  std::vector<float> screen_x_scale_;
  std::vector<int32_t> screen_x_sum_;
  std::vector<float> screen_exact_;             // per thread: a row of exact logits (candidates only)
  std::vector<int32_t> screen_cand_;            // per thread: candidate rows
  bool fuse_;                                   // MERLIN_FUSE=0: materialise inputs, then quantize (A/B runs)
  bool prefetch_;                               // MERLIN_KV_PREFETCH=0: no software prefetch of K/V (A/B runs)
};

}  // namespace merlin::cpu_backend_detail
