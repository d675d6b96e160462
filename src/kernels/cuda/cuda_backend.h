// CudaBackend: the Backend interface on one GPU. Weights are uploaded once (repacked into fragment order,
// ops.h), the activations, the paged K/V cache and the block tables stay on the device, and only the rows
// of logits that the batch asks for come back. The forward pass is the CPU backend's, step for step:
//
//   x = embed(tokens)
//   per layer:  a = act(rmsnorm(x))            (fused: norm + quantize to the matrix's input format)
//               qkv = a · [Wq; Wk; Wv]          (one product over the stacked matrices)
//               rope(q, k); cache <- k, v       (one kernel)
//               o = attention(q, cache)         (paged, per sequence)
//               x += act(o) · Wo                (residual add in the product's epilogue)
//               gu = act(rmsnorm(x)) · [Wg; Wu]
//               x += act(silu(g) * u) · Wd
//   logits = act(rmsnorm(x[rows wanted])) · Wout
//
// Decode steps fold steps into neighbours where that costs no extra round trip: RoPE and the K/V write into
// the QKV product, the next RMSNorm into Wo and down (a deferred scale the reader applies: run_residual; one
// token, and decode-sized batches whose readers stage their input), SwiGLU into the gate/up product (one
// token, long rows) or into the down product's staging (one token, short rows: glu_input), the embedding
// lookup into the first RMSNorm, the greedy argmax into the head's product (one token), and attention
// writes Wo's input.
//
// Decode-sized batches (up to kGraphMaxTokens tokens) run as a CUDA graph captured once per step shape and
// replayed; tokens, positions, sequences and rows travel through fixed device buffers that the graph's first
// node fills from pinned host memory. MERLIN_CUDA_GRAPHS=0 turns graphs off. Kernels use programmatic
// dependent launch inside graphs only (cuda_api.h, PdlScope). Decoding one sequence (decode_greedy,
// decode_sample) runs up to 16 one-token steps per graph launch in a device-side loop (a while node over two
// steps, the bookkeeping in the first layer's preparation): no token goes through the host in between;
// several sequences decoding greedily together (decode_greedy_batch) loop the same way.
//
// The class is shared by cuda_backend.cpp (set-up, steps, sampling), cuda_forward.cpp (the layers of a
// step, enqueue) and cuda_batch_loop.cpp (the batched decode loops); internal to the CUDA backend.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "core/sys.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "runtime/backend.h"
#include "runtime/model.h"

#define MERLIN_CUDA_CHECK(expr)                                                                      \
  do {                                                                                               \
    const cudaError_t err_ = (expr);                                                                 \
    if (err_ != cudaSuccess) ::merlin::fail("CUDA error: ", cudaGetErrorString(err_), " (", #expr, ")"); \
  } while (0)

namespace merlin::cuda_backend_detail {

using cuda::ActBuf;
using cuda::ActKind;
using cuda::Matrix;

constexpr int kGraphMaxTokens = 32;

// Matrices sharing one input, stacked by rows when their types agree (Q/K/V, gate/up), else kept apart.
struct Linear {
  std::vector<Matrix> mats;
  std::vector<int64_t> offset;  // first output column of each matrix
  int64_t rows = 0;             // padded output columns in total
};

Linear make_linear(std::initializer_list<const Weight*> ws, cuda::Stream s);

template <class T>
T* dev_array(size_t n) {
  return static_cast<T*>(cuda::dev_alloc(std::max<size_t>(n, 1) * sizeof(T)));
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Model& model, const BackendOptions& opts);
  ~CudaBackend() override;
  std::string name() const override { return "cuda-" + cuda::device_name(); }
  int n_ctx() const override { return n_ctx_; }
  int max_batch() const override { return max_batch_; }
  int n_seq() const override { return n_seq_; }
  void forward(const Batch& batch, float* logits) override;
  void forward_greedy(const Batch& batch, int64_t n_vocab, int32_t* tokens) override;
  void forward_sample(const Batch& batch, int64_t n_vocab, std::span<const RowSampling> rows,
                      std::span<const LogitAdjust> adjust, int32_t* tokens) override;
  int decode_greedy(int32_t token, int32_t pos, int seq, int n_steps, int64_t n_vocab,
                    const std::function<bool(int32_t)>& on_token) override;
  int decode_sample(int32_t token, int32_t pos, int seq, std::span<const RowSampling> rows, int64_t n_vocab,
                    const std::function<bool(int32_t)>& on_token) override;
  void decode_greedy_batch(std::span<const int32_t> tokens, std::span<const int32_t> pos,
                           std::span<const int32_t> seqs, int n_steps, int64_t n_vocab, int32_t* ids) override;
  bool loops_decode() const override { return chain_max_ >= 2; }
  void clear_sequence(int seq) override {
    MERLIN_CHECK(seq >= 0 && seq < n_seq_, "sequence ", seq, " out of range");  // cached rows are overwritten
  }
  int kv_block_size() const override { return block_size_; }
  int n_kv_blocks() const override { return n_blocks_; }
  void set_block_table(int seq, std::span<const int32_t> blocks) override;
  size_t kv_block_bytes() const override {  // a Q8_0 cache adds an f16 scale per 32 elements
    const size_t row = (size_t)c_.kv_dim() * kv_elem_ + (kv_q8_ ? (size_t)c_.kv_dim() / 32 * 2 : 0);
    return 2 * (size_t)c_.n_layers * block_size_ * row;
  }

 private:
  struct Layer {
    float* attn_norm = nullptr;
    float* ffn_norm = nullptr;
    Linear qkv, wo, gate_up, down;
    void* k = nullptr;
    void* v = nullptr;
    void* ks = nullptr;  // Q8_0 cache: the f16 scales
    void* vs = nullptr;
  };

  // What a step returns: logits rows, only the argmax id of each row (greedy), or nothing yet (the logits stay
  // on the device for sample_rows, queued after the step by run_step).
  enum class Output : int { Logits = 0, GreedyIds = 1, DeviceLogits = 2 };
  void queue_sampling(int n_out);
  void validate(const Batch& batch) const;
  int run_step(const Batch& batch, Output out);
  // Where a step's kernels read their inputs and put a fused argmax (device pointers).
  struct StepIo {
    const int32_t *tokens = nullptr, *pos = nullptr, *seq = nullptr, *rows = nullptr;
    unsigned long long* key = nullptr;  // the fused argmax's key, zero before the step
    int32_t* ids = nullptr;             // argmax_rows' output (null: d_ids_)
    bool copy_out = true;               // queue the result's copy to pinned host memory
    cuda::ChainState* chain = nullptr;  // a decode loop's step (PrepArgs::chain): handle, key slot
    cuda::BatchChainState* bchain = nullptr;  // a batched decode loop's step (PrepArgs::bchain)
    unsigned long long chain_handle = 0;
    int chain_slot = 0;
  };
  StepIo step_io() const;  // run_step's: d_in_, filled from h_in_
  void enqueue(int n, int n_out, Output out, const StepIo& io);
  // Launches a graph on the stream, between the timing events when MERLIN_CUDA_STEP_TIMING is on; after the
  // stream is synchronized, add_timing accounts its GPU span and the host's time since wall0 to `steps` steps.
  void launch_graph(cudaGraphExec_t exec);
  void add_timing(int steps, std::chrono::steady_clock::time_point wall0);
  // The replayable graph for `shape`, captured from `queue_step` the first time; captured: it was just made.
  cudaGraphExec_t graph_for(const std::tuple<int, int, int>& shape, const std::function<void()>& queue_step,
                            bool& captured);
  // Decode loops (decode_greedy, decode_sample): one graph per kind (greedy or sampled) and attention launch
  // (attn_class_now_) holds a while node whose body is loop_unroll_ one-token steps; each reads its input
  // from the ChainState (ops.h), whose bookkeeping the first layer's preparation does (PrepArgs::chain). A
  // launch runs k steps (an even number up to chain_max_, set in the state the graph's first node copies
  // in) and copies the ids back. So a loop costs one body's capture, whatever its length, where a graph of k
  // unrolled steps cost milliseconds per length (docs/GPU.md). MERLIN_CUDA_CHAIN=N: at most N steps per
  // launch (0 or 1: one step per launch); MERLIN_CUDA_LOOP_UNROLL=2, 4, 8 or 16: steps per iteration (each
  // iteration boundary costs ~4 µs on the H200, each step captured ~0.3 ms once). BackendOptions::long_decode
  // makes the defaults 64 and 8 (the variables still override them).
  int chain_max_ = 16;
  cuda::ChainState* h_chain_ = nullptr;  // pinned
  cuda::ChainState* d_chain_ = nullptr;
  struct Loop {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
  };
  Loop loops_[2][3];           // [sampled][attention class]
  int loop_unroll_ = 2;
  bool loops_broken_ = false;  // building a loop graph failed once (warned): single steps from then on
  bool loops_apply(bool sampled) const;
  int loop_length(int p0, int left) const;
  cudaGraphExec_t build_loop(Loop& l, void* d_state, void* h_state, size_t in_bytes, size_t out_bytes,
                             const std::function<void(unsigned long long)>& steps, const char* what);
  // Step u of a loop graph's body (loop_graph, batch_loop_graph): io with the loop's handle and slot and no
  // copy to the host, then the step's kernels for n rows of the given attention class.
  void enqueue_loop_step(int n, Output out, StepIo io, unsigned long long handle, int u, int attn_class);
  cudaGraphExec_t loop_graph(bool sampled, int attn_class);
  // Runs k steps from (token, pos, seq) in one loop launch; ids gets the steps' ids, ending early at a
  // negative one (a draw left to the host). rows: the k steps' draws, or null (greedy). Returns the ids got.
  int run_loop(int32_t token, int32_t pos, int seq, int k, const RowSampling* rows, int32_t* ids);
  // Batched decode loops (decode_greedy_batch, cuda_batch_loop.cpp): one graph per (rows, attention class)
  // whose while node runs loop_unroll_ steps of n rows per iteration from the BatchChainState; a launch runs
  // k steps and copies the state (the ids) back.
  cuda::BatchChainState* h_bchain_ = nullptr;  // pinned
  cuda::BatchChainState* d_bchain_ = nullptr;
  std::map<std::pair<int, int>, Loop> batch_loops_;
  cudaGraphExec_t batch_loop_graph(int n, int attn_class);
  // Runs k steps of the rows (tokens: their step-0 tokens, at pos[r] + from) in one loop launch; ids gets
  // k x n ids. False (nothing run) where the loop graph cannot be built.
  bool run_batch_loop(std::span<const int32_t> tokens, std::span<const int32_t> pos, std::span<const int32_t> seqs,
                      int from, int k, int32_t* ids);
  // decode_greedy (rows null) and decode_sample through loops.
  int decode_looped(int32_t token, int32_t pos, int seq, int n_steps, const RowSampling* rows,
                    const std::function<bool(int32_t)>& on_token);
  ActBuf& act(ActKind kind, int64_t k);
  bool use_gemm(const Linear& l, int n) const;
  void prepare_inputs(const cuda::PrepArgs& p, const Linear& l, int n, bool gemm);
  // prepared: the input buffers already hold p's result (the attention kernel wrote Wo's input itself);
  // in: every matrix reads this buffer instead (a folded RMSNorm, folded_input), which holds p's result.
  void run_linear(const Linear& l, const cuda::PrepArgs& p, int n, float* y, int64_t ldy, int64_t n_out, bool acc,
                  bool prepared = false, const ActBuf* in = nullptr);
  ActBuf* attention_output_act(const Linear& wo, int n);
  bool run_gate_up_swiglu(const Layer& L, const cuda::PrepArgs& norm, int n, int64_t ffn_off, const ActBuf* in);
  bool run_qkv(const Layer& L, const cuda::PrepArgs& norm, int n, const int32_t* pos, const int32_t* seq,
               const cuda::KvArgs& kv, const ActBuf* in);
  cuda::RopeKvArgs rope_args(const int32_t* pos, const int32_t* seq, const cuda::KvArgs& kv) const;
  static int kv_l2_positions(const cuda::KvArgs& kv, int64_t kv_dim);
  // How a producer writes its reader's RMSNorm input (folds_norm, run_residual): not at all, as Q8_0 rows with
  // deferred block scales, or as the half plane with sums of squares per 16 outputs (H-kernel readers).
  // Rows: the row planes at one token, the fragment planes (matmul_norm) at 2+; Few: the row planes of a
  // 2-4-token step (matvec_few_norm); Half: matmul_norm's half plane.
  enum class Fold { None, Rows, Half, Few };
  bool few(const Linear& l, int n) const;  // every matrix of l takes the 2-4-token kernels at n tokens
  Fold folds_norm(const Linear& producer, const Linear& reader, int n, bool half_ok) const;
  ActBuf folded_input(int n, Fold f) const;
  Fold run_residual(const Linear& l, const cuda::PrepArgs& p, int n, bool prepared, const float* next_norm,
                    const Linear* reader, bool half_ok, const ActBuf* in = nullptr);
  const ActBuf* glu_input(const Linear& down, int n, int64_t ffn_off, int64_t gu_ld);
  float* upload_floats(const std::vector<float>& v);
  // MERLIN_CUDA_TWICE=stage,... (timing only: the results are wrong) queues those stages' kernels twice per
  // step, so a replayed graph's step grows by what one of them costs inside it, overlap and launch included
  // (e.g. scripts/gpu_perf.sh with SETTINGS=";MERLIN_CUDA_TWICE=attn"). Stages: norm, qkv, attn, wo, gateup,
  // glu, down, head, embed, argmax.
  enum Stage : unsigned {
    kNorm = 1, kQkv = 2, kAttn = 4, kWo = 8, kGateUp = 16, kGlu = 32, kDown = 64, kHead = 128, kEmbed = 256, kArgmax = 512
  };
  static unsigned parse_stages(const char* list);
  // Queues f (which returns whether it queued anything), twice when `stage` is one of twice_.
  template <class F>
  bool queue(unsigned stage, F&& f) {
    const bool queued = f();
    if (queued && (twice_ & stage)) f();
    return queued;
  }

  const Model& m_;
  const ModelConfig& c_;
  cudaStream_t stream_ = nullptr;
  int n_ctx_, n_seq_, max_batch_, block_size_, n_blocks_, max_blocks_;
  bool graphs_ = true;
  bool fuse_prep_ = false;
  bool attn_emits_ = true;  // MERLIN_CUDA_ATTN_EMIT=0: a separate kernel quantizes the attention output
  bool rope_fuse_ = true;   // MERLIN_CUDA_ROPE_FUSE=0: one-token steps run rope_kv as its own kernel
  bool glu_fuse_ = true;    // MERLIN_CUDA_GLU_FUSE=0: one-token steps run SwiGLU as its own kernel
  // Where the gate/up product does not write SwiGLU (glu_fuse_), the down product computes it while it stages
  // its input (glu_input) for rows of at most kGluStageMaxK (default), for any row (MERLIN_CUDA_GLU_STAGE=1),
  // or never (=0); otherwise a prep_act kernel does.
  enum class GluStage { Never, AnyRow, ShortRows };
  GluStage glu_stage_ = GluStage::ShortRows;
  bool embed_fuse_ = true;  // MERLIN_CUDA_EMBED_FUSE=0: the embedding lookup runs as its own kernel
  ActBuf glu_in_;  // glu_input's buffer view
  bool norm_fold_ = true;   // MERLIN_CUDA_NORM_FOLD=0: every RMSNorm runs as its own kernel
  // Steps of 2 .. norm_fold_mm_ tokens fold it too where it pays (MERLIN_CUDA_NORM_FOLD_MM=N, 0 .. 32; 0: off).
  // It lost 2-5 % at 16 and 32 tokens when it came (eleventh session); with the rounds of 2 chunks since, it
  // gains (fifteenth session, docs/GPU.md).
  int norm_fold_mm_ = kGraphMaxTokens;
  bool norm_fold_always_ = false;  // MERLIN_CUDA_NORM_PAYS=1: batched folds wherever they fit (A/B timing)
  // MERLIN_CUDA_NORM_HALF=0: no half-plane fold (Fold::Half) of the down product into the next QKV's input
  bool norm_half_ = true;
  unsigned twice_ = 0;  // MERLIN_CUDA_TWICE
  // MERLIN_CUDA_STEP_TIMING=1 (A/B timing): per graph step, the GPU's span (events around the launch) and the
  // host's wall time of run_step, averaged and printed to stderr when the backend is destroyed.
  struct StepTiming {
    cudaEvent_t start = nullptr, end = nullptr;
    double gpu_us = 0, wall_us = 0;
    long steps = 0;
  } timing_;
  unsigned stage_ = 0;  // the stage enqueue is queuing
  ActBuf norm_act_;         // the next RMSNorm's input as Wo / down write it (matvec1_norm, matmul_norm)
  double* norm_part_ = nullptr;  // its per-block sums of squares, [tokens][dim / 32]
  // Steps of at least gemm_min_ tokens run their products through cuBLAS (gemm.cu); 0: never.
  int gemm_min_ = 0;
  // Eager steps of at least flash_min_ tokens use the tiled attention kernel (flash_attention.cu); 0: never.
  int flash_min_ = 0;
  bool flash_now_ = false;  // this step's attention runs tiled, over n_tiles_ tiles from h_tiles_
  int n_tiles_ = 0;
  cuda::AttnTile* h_tiles_ = nullptr;
  cuda::AttnTile* d_tiles_ = nullptr;
  cuda::AttnScratch attn_scratch_;  // split-K attention for decode-sized steps on long contexts
  bool split_attention_ = true;     // MERLIN_CUDA_SPLITK=0: one CTA per (head, token) over the whole context
  // How this step's attention launches, from its largest position (attn_class): kAttnSplit, kAttnShort (every
  // token within one split's chunk: the unsplit launch gives the same bits without the splits that would exit
  // at once; base tg128 on the H200: 4,460 -> 4,575 t/s with a 512-position context) or kAttnOnePass (also
  // within one pass of the kernel's plain instance, cuda::attention's one_pass). Graphs and loops are
  // captured per class. kAttnOnePass for heads of up to 64 (MERLIN_CUDA_ATTN_ONE_PASS=0: never, =1: any
  // head size; A/B timing).
  static constexpr int kAttnSplit = 0, kAttnShort = 1, kAttnOnePass = 2;
  int attn_class(int max_pos) const;
  int attn_class_now_ = kAttnSplit;
  int attn_one_pass_ = 0;  // positions below which kAttnOnePass applies (0: never)
  std::unique_ptr<cuda::GemmRunner> gemm_;
  size_t kv_elem_;  // bytes per cached element (Q8_0: its int8 code)
  bool kv_q8_ = false;
  std::vector<Layer> layers_;
  Linear head_;
  float* out_norm_ = nullptr;
  void* embd_ = nullptr;
  float* cos_sin_ = nullptr;
  int32_t* table_ = nullptr;
  std::vector<int32_t> host_table_;
  // Per-step inputs: pinned host staging and their device copies.
  int32_t* h_in_ = nullptr;  // [4][max_batch]: tokens, pos, seq, logits rows; then the argmax key (2 words, 0)
  int32_t* d_in_ = nullptr;
  size_t in_words() const { return 4 * (size_t)max_batch_ + 2; }
  // One-token greedy steps: the head's product also finds the argmax (matvec1_argmax) into this key, which the
  // step's input copy zeroes first; false: argmax_rows runs after the head. MERLIN_CUDA_ARGMAX_FUSE=0: never.
  bool head_argmax_ = false;
  bool fused_argmax(int n_out, Output out) const { return head_argmax_ && n_out == 1 && out == Output::GreedyIds; }
  // Greedy steps of several rows: the head's batched product finds each row's argmax (matmul_argmax) into
  // d_keys_ (zero between steps) instead of writing logits for argmax_rows. MERLIN_CUDA_BATCH_ARGMAX=0: never.
  bool batch_argmax_ = true;
  unsigned long long* d_keys_ = nullptr;  // [max_batch]
  bool batched_argmax(int n_out, Output out) const {
    return batch_argmax_ && out == Output::GreedyIds && n_out >= 2 && !fuse_prep_ && head_.mats.size() == 1 &&
           !use_gemm(head_, n_out) && cuda::matmul_argmax_fits(head_.mats[0], n_out);
  }
  float* h_logits_ = nullptr;
  int32_t* h_ids_ = nullptr;  // [max_batch] greedy or sampled ids (pinned)
  int32_t* d_ids_ = nullptr;
  // forward_sample's rows ([max_batch], pinned and device) and adjustments (grown between steps: the sampling
  // kernel runs after the step's graph, so its buffers may move).
  RowSampling* h_rows_ = nullptr;
  RowSampling* d_rows_ = nullptr;
  void* d_sample_work_ = nullptr;  // sample_rows' slices (null: one CTA per row, MERLIN_CUDA_SAMPLE_SPLIT=0)
  LogitAdjust* h_adjust_ = nullptr;
  LogitAdjust* d_adjust_ = nullptr;
  size_t adjust_cap_ = 0;
  size_t n_adjust_ = 0;  // entries of this step
  SampleScratch sample_scratch_;  // rows the device leaves to the host
  float *x_ = nullptr, *qkv_ = nullptr, *att_ = nullptr, *gu_ = nullptr, *logits_ = nullptr;
  std::vector<ActBuf> acts_;
  std::map<std::tuple<int, int, int>, cudaGraphExec_t> graphs_by_shape_;  // (tokens, logits rows, Output)
};

}  // namespace merlin::cuda_backend_detail
