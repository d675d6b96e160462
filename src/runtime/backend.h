// The backend interface: one forward step over a batch of tokens. The CPU backend implements it today;
// a CUDA (or Metal) backend implements the same interface, so the generator, sampler, scheduler and
// server never know which one runs.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "runtime/row_sampling.h"

namespace merlin {

class Model;

// One forward step. Token i sits at position pos[i] of sequence seq[i]; its K/V are written to that
// sequence's cache and it attends to positions 0..pos[i] of the same sequence. Rows with want_logits
// produce a row of vocab_size logits, in batch order.
struct Batch {
  std::vector<int32_t> tokens, pos, seq;
  std::vector<uint8_t> want_logits;

  void clear() { tokens.clear(); pos.clear(); seq.clear(); want_logits.clear(); }
  void add(int32_t token, int32_t position, int32_t sequence, bool logits) {
    tokens.push_back(token);
    pos.push_back(position);
    seq.push_back(sequence);
    want_logits.push_back(logits ? 1 : 0);
  }
  size_t size() const { return tokens.size(); }
  size_t n_logits() const {
    size_t n = 0;
    for (uint8_t w : want_logits) n += w;
    return n;
  }
};

struct BackendOptions {
  int n_threads = 0;     // 0: all hardware threads
  int n_ctx = 0;         // 0: the model's context length
  int n_seq = 1;         // independent sequences (KV cache slots)
  int max_batch = 512;   // most tokens in one forward() call
  // K/V cache element type: F16 (default, as llama.cpp), F32 (exact fp32 attention, used by the parity
  // tests) or Q8_0 (half the memory of F16 again; needs a head size that is a multiple of 32).
  DType kv_type = DType::F16;
  // Paged K/V cache: n_kv_blocks blocks of kv_block_size positions each, shared by all sequences; a block
  // table per sequence maps its logical block i (positions i*B .. i*B+B-1) to a physical block.
  // n_kv_blocks == 0: every sequence gets its own fixed range of ceil(n_ctx / B) blocks (identity tables),
  // which is what generate(), perplexity and bench use; the server's block allocator sets tables itself.
  int kv_block_size = 16;
  int n_kv_blocks = 0;
  // The caller decodes long runs of one sequence, so one-time costs do not matter (merlin bench, whose warm-up
  // absorbs them; merlin run for thousands of tokens): the CUDA backend's decode loops then run 8 steps per
  // iteration and up to 64 per launch (~0.3 % faster per token on a 7B model, ~1 % on base) for a one-time
  // capture of ~5-8 ms per loop kind, repaid after ~2,000 tokens (docs/GPU.md).
  bool long_decode = false;
  // A long-running server: the CPU backend keeps its K/V cache in huge pages and faults them in ahead, in
  // idle_work() (llama.cpp's server clears its whole cache buffer at start), instead of as they are first
  // written. Costs the whole cache in RSS; left off for one-off runs.
  bool resident_kv = false;
};

// "f32" | "f16" | "q8_0" -> DType; throws merlin::Error otherwise.
DType parse_kv_type(const std::string& name);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int n_ctx() const = 0;
  virtual int max_batch() const = 0;
  virtual int n_seq() const = 0;
  // Runs the batch; `logits` receives batch.n_logits() rows of vocab_size floats.
  virtual void forward(const Batch& batch, float* logits) = 0;
  // Runs the batch like forward(), but `tokens` receives, per row with want_logits (batch order), only the id
  // of its largest logit: greedy sampling without moving logits. Ties go to the lowest id, as argmax() in
  // sampler.h. n_vocab is the model's vocabulary size (the length of a logits row). The default computes the
  // logits and takes argmax() on the host; the CUDA backend finds the maximum on the device and copies back
  // only batch.n_logits() int32 ids.
  virtual void forward_greedy(const Batch& batch, int64_t n_vocab, int32_t* tokens);
  // Runs the batch like forward(), but `tokens` receives, per row with want_logits (batch order), the token
  // that sample_row (row_sampling.h) picks with rows[r] and its adjustments in `adjust`. The default computes
  // the logits and samples on the host; the CUDA backend samples on the device and copies back only the ids.
  virtual void forward_sample(const Batch& batch, int64_t n_vocab, std::span<const RowSampling> rows,
                              std::span<const LogitAdjust> adjust, int32_t* tokens);
  // Greedy decoding of one sequence without a host round trip per token: step 0 feeds `token` at position
  // `pos` of `seq`, step i > 0 feeds step i - 1's greedy id at pos + i, for up to n_steps steps (positions
  // pos .. pos + n_steps - 1 must be valid). on_token receives the ids in order, the same ids as
  // forward_greedy step by step; returning false stops. Returns how many ids it delivered. Steps already
  // queued past a stop have written K/V rows at later positions: no step reads a position before one
  // writes it again, so they are harmless. The default runs forward_greedy per step; the CUDA backend
  // replays chains of steps as one graph whose steps take their token from the previous step's argmax.
  virtual int decode_greedy(int32_t token, int32_t pos, int seq, int n_steps, int64_t n_vocab,
                            const std::function<bool(int32_t)>& on_token);
  // The same with sampling: step i draws its id as forward_sample does with rows[i] (no adjustments), for
  // rows.size() steps at most. The default runs forward_sample per step; the CUDA backend chains the steps
  // with the draws on the device.
  virtual int decode_sample(int32_t token, int32_t pos, int seq, std::span<const RowSampling> rows,
                            int64_t n_vocab, const std::function<bool(int32_t)>& on_token);
  // Greedy decoding of n sequences together (n = tokens.size(), rows r of pos and seqs alike): step 0 feeds
  // tokens[r] at pos[r] of seqs[r] for every row, step i > 0 feeds row r's step i - 1 greedy id at pos[r] + i,
  // for n_steps steps (every position must be valid). ids receives n_steps x n ids, step-major: the same ids
  // as forward_greedy step by step. The default runs forward_greedy per step; the CUDA backend runs loops of
  // steps on the device (as decode_greedy does for one sequence), without a host round trip per step.
  virtual void decode_greedy_batch(std::span<const int32_t> tokens, std::span<const int32_t> pos,
                                   std::span<const int32_t> seqs, int n_steps, int64_t n_vocab, int32_t* ids);
  // Whether decode_greedy / decode_sample run their steps without a host round trip per token (the CUDA
  // backend's loops). The server then decodes a lone sequence through them (EngineOptions::decode_loop).
  virtual bool loops_decode() const { return false; }
  // Forgets everything cached for a sequence (the next token of it starts at position 0).
  virtual void clear_sequence(int seq) = 0;

  // Paged K/V cache (see BackendOptions). A forward step may only touch positions of a sequence whose
  // logical block is mapped. Several sequences may map the same physical block (prefix caching) provided
  // none of them writes into it. set_block_table replaces the sequence's whole table; blocks are indices
  // in [0, n_kv_blocks()). Cached K/V live in the physical block, so remapping copies nothing.
  virtual int kv_block_size() const = 0;
  virtual int n_kv_blocks() const = 0;
  virtual void set_block_table(int seq, std::span<const int32_t> blocks) = 0;
  // Bytes of K/V cache per block (all layers, K and V): what a block costs, for logs and metrics.
  virtual size_t kv_block_bytes() const = 0;

  // One short piece (about a millisecond) of work the backend can do ahead while it has nothing to run: the
  // CPU backend faults in 2 MiB of a resident K/V cache (BackendOptions::resident_kv). The server's engine
  // thread calls it while no request runs, so it never delays one. True while more remains.
  virtual bool idle_work() { return false; }

 private:
  // forward_sample's default: the step's logits rows and the sampling scratch, kept between steps (a 32-row
  // step's 6 MB would otherwise be allocated and faulted in every time).
  std::vector<float> sample_logits_;
  SampleScratch sample_scratch_;
};

std::unique_ptr<Backend> make_cpu_backend(const Model& model, const BackendOptions& opts);

// "cpu" or "cuda" (when built with MERLIN_CUDA and a GPU is present); throws merlin::Error otherwise.
std::unique_ptr<Backend> make_backend(const std::string& device, const Model& model, const BackendOptions& opts);

}  // namespace merlin
