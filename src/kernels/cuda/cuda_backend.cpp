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
// Decode steps fold steps into products where the product can do them without extra round trips: RoPE and
// the K/V write into the QKV product, the next RMSNorm into Wo and down (a deferred scale the reader applies:
// run_residual; one token, and decode-sized batches whose readers stage their input), SwiGLU into the
// gate/up product (one token, long rows), and attention writes Wo's input.
//
// Decode-sized batches (up to kGraphMaxTokens tokens) run as a CUDA graph captured once per (tokens,
// logits rows) shape and replayed; tokens, positions, sequences and rows travel through fixed device
// buffers that the graph's first nodes fill from pinned host memory. MERLIN_CUDA_GRAPHS=0 turns graphs off.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
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

namespace merlin {
namespace {

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

Linear make_linear(std::initializer_list<const Weight*> ws, cuda::Stream s) {
  Linear l;
  std::vector<cuda::MatrixPart> parts;
  for (const Weight* w : ws) parts.push_back({w->type, w->data, w->rows, w->cols, w->row_bytes});
  bool same = true;
  for (const auto& p : parts) same = same && p.type == parts[0].type;
  if (same) {
    l.mats.push_back(cuda::upload_matrix(parts.data(), (int)parts.size(), s));
    l.offset.push_back(0);
  } else {
    int64_t off = 0;
    for (const auto& p : parts) {
      l.mats.push_back(cuda::upload_matrix(&p, 1, s));
      l.offset.push_back(off);
      off += cuda::padded_rows(p.rows);
    }
  }
  for (const Matrix& m : l.mats) l.rows += m.rows;
  return l;
}

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
  void enqueue(int n, int n_out, Output out);
  ActBuf& act(ActKind kind, int64_t k);
  bool use_gemm(const Linear& l, int n) const;
  void prepare_inputs(const cuda::PrepArgs& p, const Linear& l, int n, bool gemm);
  // prepared: the input buffers already hold p's result (the attention kernel wrote Wo's input itself);
  // in: every matrix reads this buffer instead (a folded RMSNorm, folded_input), which holds p's result.
  void run_linear(const Linear& l, const cuda::PrepArgs& p, int n, float* y, int64_t ldy, int64_t n_out, bool acc,
                  bool prepared = false, const ActBuf* in = nullptr);
  ActBuf* attention_output_act(const Linear& wo, int n);
  bool run_gate_up_swiglu(const Layer& L, const cuda::PrepArgs& norm, int64_t ffn_off, const ActBuf* in);
  void run_qkv(const Layer& L, const cuda::PrepArgs& norm, int n, const int32_t* pos, const int32_t* seq,
               const cuda::KvArgs& kv, const ActBuf* in);
  cuda::RopeKvArgs rope_args(const int32_t* pos, const int32_t* seq, const cuda::KvArgs& kv) const;
  bool folds_norm(const Linear& producer, const Linear& reader, int n) const;
  ActBuf folded_input(int n) const;
  bool run_residual(const Linear& l, const cuda::PrepArgs& p, int n, bool prepared, const float* next_norm,
                    const Linear* reader, const ActBuf* in = nullptr);
  const ActBuf* glu_input(const Linear& down, int n, int64_t ffn_off);
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
  // MERLIN_CUDA_GLU_STAGE=0: where the gate/up product does not write SwiGLU (glu_fuse_), a prep_act kernel does,
  // instead of the down product while it stages its input (glu_input).
  bool glu_stage_ = true;
  bool embed_fuse_ = true;  // MERLIN_CUDA_EMBED_FUSE=0: the embedding lookup runs as its own kernel
  ActBuf glu_in_;  // glu_input's buffer view
  bool norm_fold_ = true;   // MERLIN_CUDA_NORM_FOLD=0: every RMSNorm runs as its own kernel
  // Steps of 2 .. norm_fold_mm_ tokens fold it too where it pays (MERLIN_CUDA_NORM_FOLD_MM=N, 0 .. 32). Off by
  // default: on the H200 16- and 32-token steps lost 2-5 % (the producer keeps at most 4 warps per tile and the
  // reader completes the scales after staging), 8-token steps moved between +5 % and -6 % from call to call
  // (docs/GPU.md).
  int norm_fold_mm_ = 0;
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
  // This step's tokens all lie within one split's chunk: the unsplit launch gives the same bits without the
  // splits that would exit at once (base tg128 on the H200: 4,460 -> 4,575 t/s with a 512-position context).
  bool attn_short_now_ = false;
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
  unsigned long long* argmax_key() const { return reinterpret_cast<unsigned long long*>(d_in_ + 4 * max_batch_); }
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

CudaBackend::CudaBackend(const Model& model, const BackendOptions& opts) : m_(model), c_(model.config()) {
  std::string why;
  MERLIN_CHECK(cuda::gpu_available(&why), "no usable CUDA GPU: ", why);
  MERLIN_CUDA_CHECK(cudaSetDevice(0));
  n_ctx_ = opts.n_ctx > 0 ? opts.n_ctx : (int)c_.context_length;
  MERLIN_CHECK(n_ctx_ <= c_.context_length, "context size ", n_ctx_, " exceeds the model's context length ",
               c_.context_length);
  n_seq_ = std::max(1, opts.n_seq);
  max_batch_ = std::max(1, opts.max_batch);
  MERLIN_CHECK(opts.kv_type == DType::F16 || opts.kv_type == DType::F32 || opts.kv_type == DType::Q8_0,
               "the CUDA backend keeps its KV cache in f16, f32 or q8_0 (got ", dtype_name(opts.kv_type), ")");
  kv_q8_ = opts.kv_type == DType::Q8_0;
  MERLIN_CHECK(!kv_q8_ || c_.head_dim() % 32 == 0, "a q8_0 KV cache needs a head size that is a multiple of 32 "
               "(this model's is ", c_.head_dim(), ")");
  kv_elem_ = opts.kv_type == DType::F16 ? 2 : kv_q8_ ? 1 : 4;
  MERLIN_CHECK(opts.kv_block_size > 0, "KV block size must be positive");
  block_size_ = opts.kv_block_size;
  max_blocks_ = (n_ctx_ + block_size_ - 1) / block_size_;
  n_blocks_ = opts.n_kv_blocks > 0 ? opts.n_kv_blocks : n_seq_ * max_blocks_;
  graphs_ = !env_is("MERLIN_CUDA_GRAPHS", "0");
  fuse_prep_ = env_is("MERLIN_CUDA_FUSE", "1");
  attn_emits_ = !env_is("MERLIN_CUDA_ATTN_EMIT", "0");
  rope_fuse_ = !env_is("MERLIN_CUDA_ROPE_FUSE", "0") && !kv_q8_;  // Q8_0 cache blocks are quantized by rope_kv
  glu_fuse_ = !env_is("MERLIN_CUDA_GLU_FUSE", "0");
  glu_stage_ = !env_is("MERLIN_CUDA_GLU_STAGE", "0");
  embed_fuse_ = !env_is("MERLIN_CUDA_EMBED_FUSE", "0");
  norm_fold_ = !env_is("MERLIN_CUDA_NORM_FOLD", "0") && c_.dim % 32 == 0;
  if (const char* f = std::getenv("MERLIN_CUDA_NORM_FOLD_MM")) norm_fold_mm_ = std::clamp(std::atoi(f), 0, kGraphMaxTokens);
  split_attention_ = !env_is("MERLIN_CUDA_SPLITK", "0");
  twice_ = parse_stages(std::getenv("MERLIN_CUDA_TWICE"));
  if (env_is("MERLIN_CUDA_STEP_TIMING", "1")) {
    MERLIN_CUDA_CHECK(cudaEventCreate(&timing_.start));
    MERLIN_CUDA_CHECK(cudaEventCreate(&timing_.end));
  }
  // Prefill products: from 64 tokens on, dequantizing to halves and cuBLAS beat the batched tensor-core kernel,
  // which reads each weight once per 32 tokens (docs/GPU.md). MERLIN_CUDA_GEMM_MIN=0 keeps every step on it.
  gemm_min_ = 64;
  if (const char* g = std::getenv("MERLIN_CUDA_GEMM_MIN")) gemm_min_ = std::atoi(g);
  if (gemm_min_ > 0 && gemm_min_ <= max_batch_ && cuda::gemm_available()) gemm_ = std::make_unique<cuda::GemmRunner>();
  else gemm_min_ = 0;
  // Tiled attention for eager steps only (graph-captured decode steps keep the per-token kernel).
  flash_min_ = 64;
  if (const char* f = std::getenv("MERLIN_CUDA_FLASH_MIN")) flash_min_ = std::atoi(f);
  if (flash_min_ > 0) flash_min_ = std::max(flash_min_, kGraphMaxTokens + 1);
  MERLIN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

  // Block tables: identity ranges unless the caller manages blocks (n_kv_blocks > 0: all unmapped).
  host_table_.assign((size_t)n_seq_ * max_blocks_, -1);
  if (opts.n_kv_blocks <= 0)
    for (int s = 0; s < n_seq_; ++s)
      for (int b = 0; b < max_blocks_; ++b) host_table_[(size_t)s * max_blocks_ + b] = s * max_blocks_ + b;
  table_ = dev_array<int32_t>(host_table_.size());
  cuda::copy_to_device(table_, host_table_.data(), host_table_.size() * 4);

  // RoPE angles computed on the host exactly as kernels::rope_inplace does (same recurrence, same libm).
  const int n_rot = (int)c_.rot_dims();
  std::vector<float> cs((size_t)n_ctx_ * n_rot);
  const float theta_scale = std::pow(c_.rope_theta, -2.0f / (float)n_rot);
  for (int p = 0; p < n_ctx_; ++p) {
    float angle = (float)p;
    for (int i = 0; i < n_rot / 2; ++i) {
      cs[(size_t)p * n_rot + 2 * i] = std::cos(angle);
      cs[(size_t)p * n_rot + 2 * i + 1] = std::sin(angle);
      angle *= theta_scale;
    }
  }
  cos_sin_ = upload_floats(cs);

  const size_t kv_slots = (size_t)n_blocks_ * block_size_, kv_bytes = kv_slots * c_.kv_dim() * kv_elem_;
  for (int l = 0; l < c_.n_layers; ++l) {
    const LayerWeights& w = m_.layer(l);
    Layer L;
    L.attn_norm = upload_floats(w.attn_norm);
    L.ffn_norm = upload_floats(w.ffn_norm);
    L.qkv = make_linear({&w.wq, &w.wk, &w.wv}, stream_);
    L.wo = make_linear({&w.wo}, stream_);
    L.gate_up = make_linear({&w.gate, &w.up}, stream_);
    L.down = make_linear({&w.down}, stream_);
    L.k = cuda::dev_alloc(kv_bytes);
    L.v = cuda::dev_alloc(kv_bytes);
    if (kv_q8_) {
      L.ks = cuda::dev_alloc(kv_slots * c_.kv_dim() / 32 * 2);
      L.vs = cuda::dev_alloc(kv_slots * c_.kv_dim() / 32 * 2);
    }
    layers_.push_back(std::move(L));
  }
  head_ = make_linear({&m_.output()}, stream_);
  out_norm_ = upload_floats(m_.output_norm());
  if (norm_fold_) {  // a buffer of its own: Wo and down read the shared Q8_0 rows of length dim
    const int rows = std::max(1, std::min(max_batch_, norm_fold_mm_));
    norm_act_ = cuda::act_alloc(ActKind::Q8_0, c_.dim, rows);
    norm_part_ = dev_array<double>((size_t)rows * c_.dim / 32);
  }
  const Weight& e = m_.token_embd();
  embd_ = cuda::dev_alloc((size_t)e.rows * e.row_bytes);
  cuda::copy_to_device(embd_, e.data, (size_t)e.rows * e.row_bytes);

  const size_t B = (size_t)max_batch_;
  MERLIN_CUDA_CHECK(cudaMallocHost(&h_in_, in_words() * sizeof(int32_t)));
  std::memset(h_in_, 0, in_words() * sizeof(int32_t));  // the argmax key's words stay zero
  MERLIN_CUDA_CHECK(cudaMallocHost(&h_logits_, B * c_.vocab_size * sizeof(float)));
  MERLIN_CUDA_CHECK(cudaMallocHost(&h_ids_, (B + 2) * sizeof(int32_t)));  // + the argmax key
  MERLIN_CUDA_CHECK(cudaMallocHost(&h_rows_, B * sizeof(RowSampling)));
  d_rows_ = static_cast<RowSampling*>(cuda::dev_alloc(B * sizeof(RowSampling)));
  if (!env_is("MERLIN_CUDA_SAMPLE_SPLIT", "0"))
    d_sample_work_ = cuda::dev_alloc(cuda::sample_rows_work_bytes((int)B, c_.vocab_size));
  MERLIN_CUDA_CHECK(cudaMallocHost(&h_tiles_, B * sizeof(cuda::AttnTile)));
  d_tiles_ = static_cast<cuda::AttnTile*>(cuda::dev_alloc(B * sizeof(cuda::AttnTile)));
  d_in_ = dev_array<int32_t>(in_words());
  d_ids_ = dev_array<int32_t>(B);
  x_ = dev_array<float>(B * c_.dim);
  qkv_ = dev_array<float>(B * layers_[0].qkv.rows);
  att_ = dev_array<float>(B * c_.n_heads * c_.head_dim());
  gu_ = dev_array<float>(B * layers_[0].gate_up.rows);
  logits_ = dev_array<float>(B * c_.vocab_size);
  // Every activation buffer exists before the first step: nothing may be allocated while a graph is captured.
  auto make_acts = [&](const Linear& l) {
    for (const Matrix& m : l.mats) {
      act(m.act(), m.k);
      if (gemm_ && cuda::gemm_supports(m)) act(cuda::gemm_act_kind(m), m.k);
    }
  };
  for (const Layer& L : layers_)
    for (const Linear* l : {&L.qkv, &L.wo, &L.gate_up, &L.down}) make_acts(*l);
  make_acts(head_);
  head_argmax_ = !env_is("MERLIN_CUDA_ARGMAX_FUSE", "0") && head_.mats.size() == 1 && !use_gemm(head_, 1) &&
                 cuda::matvec1_argmax_fits(head_.mats[0]);
  cuda::attention_prepare(n_ctx_);
  attn_scratch_ = cuda::attention_scratch_alloc(std::min(max_batch_, kGraphMaxTokens), (int)c_.n_heads,
                                                (int)c_.head_dim(), n_ctx_);
  cuda::sync_device();
}

CudaBackend::~CudaBackend() {
  if (timing_.start) {
    if (timing_.steps > 0)
      std::fprintf(stderr, "[cuda] %ld graph steps: GPU span %.1f us, run_step wall %.1f us (mean)\n", timing_.steps,
                   timing_.gpu_us / (double)timing_.steps, timing_.wall_us / (double)timing_.steps);
    cudaEventDestroy(timing_.start);
    cudaEventDestroy(timing_.end);
  }
  for (auto& [shape, g] : graphs_by_shape_) cudaGraphExecDestroy(g);
  gemm_.reset();
  auto free_linear = [](Linear& l) {
    for (Matrix& m : l.mats) cuda::free_matrix(m);
  };
  for (Layer& L : layers_) {
    free_linear(L.qkv);
    free_linear(L.wo);
    free_linear(L.gate_up);
    free_linear(L.down);
    cuda::dev_free(L.attn_norm);
    cuda::dev_free(L.ffn_norm);
    cuda::dev_free(L.k);
    cuda::dev_free(L.v);
    cuda::dev_free(L.ks);
    cuda::dev_free(L.vs);
  }
  free_linear(head_);
  for (ActBuf& a : acts_) cuda::act_free(a);
  if (norm_fold_) cuda::act_free(norm_act_);
  for (void* p : {(void*)norm_part_, (void*)out_norm_, embd_, (void*)cos_sin_, (void*)table_, (void*)d_in_, (void*)x_, (void*)qkv_,
                  (void*)att_, (void*)gu_, (void*)logits_, (void*)d_ids_})
    cuda::dev_free(p);
  cudaFreeHost(h_in_);
  cudaFreeHost(h_logits_);
  cudaFreeHost(h_ids_);
  cudaFreeHost(h_rows_);
  cudaFreeHost(h_adjust_);
  cuda::dev_free(d_rows_);
  cuda::dev_free(d_sample_work_);
  cuda::dev_free(d_adjust_);
  cudaFreeHost(h_tiles_);
  cuda::dev_free(d_tiles_);
  cuda::attention_scratch_free(attn_scratch_);
  cudaStreamDestroy(stream_);
}

float* CudaBackend::upload_floats(const std::vector<float>& v) {
  float* d = dev_array<float>(v.size());
  if (!v.empty()) cuda::copy_to_device(d, v.data(), v.size() * sizeof(float));
  return d;
}

ActBuf& CudaBackend::act(ActKind kind, int64_t k) {
  for (ActBuf& a : acts_)
    if (a.kind == kind && a.k == k) return a;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MERLIN_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
  MERLIN_CHECK(capturing == cudaStreamCaptureStatusNone, "internal: activation buffer allocated during graph capture");
  acts_.push_back(cuda::act_alloc(kind, k, max_batch_));
  return acts_.back();
}

unsigned CudaBackend::parse_stages(const char* list) {
  static const std::pair<const char*, Stage> kNames[] = {{"norm", kNorm}, {"qkv", kQkv},   {"attn", kAttn},
                                                         {"wo", kWo},     {"gateup", kGateUp}, {"glu", kGlu},
                                                         {"down", kDown}, {"head", kHead}, {"embed", kEmbed},
                                                         {"argmax", kArgmax}};
  unsigned bits = 0;
  std::string rest = list ? list : "";
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string name = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    if (name.empty()) continue;
    const auto* it = std::find_if(std::begin(kNames), std::end(kNames), [&](const auto& e) { return name == e.first; });
    MERLIN_CHECK(it != std::end(kNames), "MERLIN_CUDA_TWICE: unknown stage '", name,
                 "' (norm, qkv, attn, wo, gateup, glu, down, head, embed, argmax)");
    bits |= it->second;
  }
  return bits;
}

void CudaBackend::validate(const Batch& batch) const {
  MERLIN_CHECK(batch.size() > 0 && batch.size() <= (size_t)max_batch_, "batch of ", batch.size(), " tokens (1..",
               max_batch_, " allowed)");
  for (size_t i = 0; i < batch.size(); ++i) {
    MERLIN_CHECK(batch.tokens[i] >= 0 && batch.tokens[i] < c_.vocab_size, "token id ", batch.tokens[i],
                 " is outside the vocabulary (0..", c_.vocab_size - 1, ")");
    MERLIN_CHECK(batch.pos[i] >= 0 && batch.pos[i] < n_ctx_, "position ", batch.pos[i], " is outside the context (",
                 n_ctx_, " tokens)");
    MERLIN_CHECK(batch.seq[i] >= 0 && batch.seq[i] < n_seq_, "sequence ", batch.seq[i], " out of range");
    // Every position the token reads or writes must lie in a mapped block.
    const int last_block = batch.pos[i] / block_size_;
    for (int b = 0; b <= last_block; ++b)
      MERLIN_CHECK(host_table_[(size_t)batch.seq[i] * max_blocks_ + b] >= 0, "sequence ", batch.seq[i],
                   " has no KV block mapped for position ", b * block_size_);
  }
}

void CudaBackend::set_block_table(int seq, std::span<const int32_t> blocks) {
  MERLIN_CHECK(seq >= 0 && seq < n_seq_, "sequence ", seq, " out of range");
  MERLIN_CHECK(blocks.size() <= (size_t)max_blocks_, "block table of ", blocks.size(), " blocks exceeds the context's ",
               max_blocks_);
  for (int32_t b : blocks) MERLIN_CHECK(b >= 0 && b < n_blocks_, "KV block ", b, " out of range (0..", n_blocks_ - 1, ")");
  int32_t* row = host_table_.data() + (size_t)seq * max_blocks_;
  std::fill(row, row + max_blocks_, -1);
  std::copy(blocks.begin(), blocks.end(), row);
  // Ordered on the stream: a step already queued reads the old table, the next one the new.
  MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cuda::copy_to_device(table_ + (size_t)seq * max_blocks_, row, (size_t)max_blocks_ * sizeof(int32_t));
}

bool CudaBackend::use_gemm(const Linear& l, int n) const {
  if (!gemm_ || n < gemm_min_) return false;
  for (const Matrix& m : l.mats)
    if (!cuda::gemm_supports(m)) return false;
  return true;
}

void CudaBackend::prepare_inputs(const cuda::PrepArgs& p, const Linear& l, int n, bool gemm) {
  ActKind done[4];
  int n_done = 0;
  for (const Matrix& m : l.mats) {
    const ActKind kind = gemm ? cuda::gemm_act_kind(m) : m.act();
    if (std::find(done, done + n_done, kind) != done + n_done) continue;
    ActBuf out = act(kind, m.k);
    if (gemm) {  // cuBLAS reads the rows only: no fragment-ordered copy for the batched products
      out.fq = nullptr;
      out.fs = nullptr;
      out.fsum = nullptr;
      out.fhi = nullptr;
      out.flo = nullptr;
    }
    const unsigned stage = p.mode == cuda::Prep::RmsNorm ? kNorm : p.mode == cuda::Prep::SwiGlu ? kGlu : stage_;
    queue(stage, [&] { return cuda::prep_act(p, n, out, stream_), true; });
    done[n_done++] = kind;
  }
}

// The per-token attention kernel writes Wo's input in its act format as well (one kernel less per layer)
// when every part of Wo reads the same format and that format is one it can emit.
ActBuf* CudaBackend::attention_output_act(const Linear& wo, int n) {
  if (!attn_emits_ || flash_now_ || use_gemm(wo, n)) return nullptr;
  const ActKind kind = wo.mats[0].act();
  for (const Matrix& m : wo.mats)
    if (m.act() != kind) return nullptr;
  if (!cuda::attention_emits(kind, (int)c_.head_dim())) return nullptr;
  return &act(kind, wo.mats[0].k);
}

// QKV product, RoPE and the K/V cache write. Steps that do not go through cuBLAS do the last two in the
// product's epilogue (matmul_rope_kv: one kernel less per layer, same bits).
void CudaBackend::run_qkv(const Layer& L, const cuda::PrepArgs& norm, int n, const int32_t* pos, const int32_t* seq,
                          const cuda::KvArgs& kv, const ActBuf* in) {
  const int hd = (int)c_.head_dim();
  const int64_t q_dim = c_.n_heads * hd, kv_dim = c_.kv_dim(), qkv_ld = L.qkv.rows;
  const int64_t k_off = cuda::padded_rows(q_dim), v_off = k_off + cuda::padded_rows(kv_dim);
  if (rope_fuse_ && L.qkv.mats.size() == 1 && !use_gemm(L.qkv, n)) {
    if (!in) prepare_inputs(norm, L.qkv, n, false);
    const Matrix& m = L.qkv.mats[0];
    const ActBuf& x = in ? *in : act(m.act(), m.k);
    const cuda::RopeKvArgs r = rope_args(pos, seq, kv);
    if (queue(stage_, [&] { return cuda::matmul_rope_kv(m, x, n, qkv_, qkv_ld, r, stream_); })) return;
    queue(stage_, [&] { return cuda::matmul(m, x, n, qkv_, qkv_ld, qkv_ld, false, stream_), true; });
  } else {
    run_linear(L.qkv, norm, n, qkv_, qkv_ld, qkv_ld, false, false, in);
  }
  queue(stage_, [&] {
    cuda::rope_kv(qkv_, qkv_ld, k_off, v_off, n, pos, seq, cos_sin_, (int)c_.n_heads, (int)c_.n_kv_heads, hd,
                  (int)c_.rot_dims(), kv, stream_);
    return true;
  });
}

cuda::RopeKvArgs CudaBackend::rope_args(const int32_t* pos, const int32_t* seq, const cuda::KvArgs& kv) const {
  cuda::RopeKvArgs r;
  r.d_pos = pos;
  r.d_seq = seq;
  r.d_cos_sin = cos_sin_;
  r.hd = (int)c_.head_dim();
  r.q_dim = c_.n_heads * r.hd;
  r.kv_dim = c_.kv_dim();
  r.k_off = cuda::padded_rows(r.q_dim);
  r.v_off = r.k_off + cuda::padded_rows(r.kv_dim);
  r.n_rot = (int)c_.rot_dims();
  r.kv = kv;
  return r;
}

// One-token steps: the gate/up product writes silu(gate) * up straight into the down product's input
// (matvec1_swiglu: one kernel less per layer, same bits). False where it does not apply (nothing queued).
bool CudaBackend::run_gate_up_swiglu(const Layer& L, const cuda::PrepArgs& norm, int64_t ffn_off, const ActBuf* in) {
  if (!glu_fuse_ || L.gate_up.mats.size() != 1) return false;
  const ActKind kind = L.down.mats[0].act();
  for (const Matrix& m : L.down.mats)
    if (m.act() != kind || m.k != c_.ffn_dim) return false;
  const Matrix& m = L.gate_up.mats[0];
  if (!cuda::swiglu_fuses(m, c_.ffn_dim, ffn_off, kind)) return false;
  if (!in) prepare_inputs(norm, L.gate_up, 1, false);
  return queue(stage_, [&] {
    return cuda::matvec1_swiglu(m, in ? *in : act(m.act(), m.k), c_.ffn_dim, ffn_off, act(kind, c_.ffn_dim), stream_);
  });
}

// Whether `producer` (Wo or down, which add to x_) can also write the RMSNorm input of `reader` (gate/up, or
// the next layer's QKV), so that no RMSNorm kernel runs between them (matvec1_norm for one token,
// matmul_norm for decode-sized steps: the reader's staged scales get 1 / rms(x) from per-block sums of
// squares; within rounding of the separate kernel's result, not bit-identical). The reader must take Q8_0
// rows through the single-token kernels, or through batched ones that stage them (reads_deferred_norm).
bool CudaBackend::folds_norm(const Linear& producer, const Linear& reader, int n) const {
  if (!norm_fold_ || fuse_prep_ || producer.mats.size() != 1 || use_gemm(producer, n) || use_gemm(reader, n))
    return false;
  if (n > 1 && n > std::min(norm_fold_mm_, norm_act_.n_cap)) return false;
  for (const Matrix& m : reader.mats) {
    if (m.act() != ActKind::Q8_0 || m.k != c_.dim) return false;
    if (n > 1 && !cuda::reads_deferred_norm(m, n)) return false;
  }
  const Matrix& m = producer.mats[0];
  return n == 1 ? cuda::norm_fold_fits(m, c_.dim) : cuda::matmul_norm_fits(m, c_.dim, n) && cuda::matmul_norm_pays(m);
}

ActBuf CudaBackend::folded_input(int n) const {
  ActBuf a = norm_act_;
  a.rms_part = norm_part_;
  a.rms_eps = c_.norm_eps;
  a.rms_rows = n;
  return a;
}

// x_ += act(p) · l. With a reader (folds_norm), the product also writes the reader's input, RMSNorm(x_) with
// weights next_norm, into norm_act_ and returns true: the reader takes folded_input().
bool CudaBackend::run_residual(const Linear& l, const cuda::PrepArgs& p, int n, bool prepared, const float* next_norm,
                               const Linear* reader, const ActBuf* in) {
  if (reader && folds_norm(l, *reader, n)) {
    if (!prepared && !in) prepare_inputs(p, l, n, false);
    const Matrix& m = l.mats[0];
    const ActBuf& x = in ? *in : act(m.act(), m.k);
    if (queue(stage_, [&] {
          return n == 1 ? cuda::matvec1_norm(m, x, x_, c_.dim, true, next_norm, norm_act_, norm_part_, stream_)
                        : cuda::matmul_norm(m, x, n, x_, c_.dim, c_.dim, true, next_norm, norm_act_, norm_part_,
                                            stream_);
        }))
      return true;
    prepared = true;
  }
  run_linear(l, p, n, x_, c_.dim, c_.dim, true, prepared, in);
  return false;
}

// One-token steps whose SwiGLU did not go into the gate/up product: the down product computes it while it
// stages its input (ActBuf::glu_src, matvec1_glu_fits), so no SwiGLU kernel runs. Null where it does not
// apply (then prep_act runs it).
const ActBuf* CudaBackend::glu_input(const Linear& down, int n, int64_t ffn_off) {
  if (n != 1 || !glu_stage_ || down.mats.size() != 1 || use_gemm(down, n)) return nullptr;
  const Matrix& m = down.mats[0];
  if (m.act() != ActKind::Q8_0 || m.k != c_.ffn_dim || !cuda::matvec1_glu_fits(m)) return nullptr;
  glu_in_ = act(m.act(), m.k);
  glu_in_.glu_src = gu_;
  glu_in_.glu_offset = ffn_off;
  return &glu_in_;
}

void CudaBackend::run_linear(const Linear& l, const cuda::PrepArgs& p, int n, float* y, int64_t ldy, int64_t n_out,
                             bool acc, bool prepared, const ActBuf* in) {
  if (in) {
    for (size_t i = 0; i < l.mats.size(); ++i)
      queue(stage_, [&] {
        return cuda::matmul(l.mats[i], *in, n, y + l.offset[i], ldy, std::min(n_out - l.offset[i], l.mats[i].rows),
                            acc, stream_),
               true;
      });
    return;
  }
  // With MERLIN_CUDA_FUSE=1, decode-sized steps let each product prepare its own input (one launch instead
  // of two). Off by default: on the H200 the separate preparation kernel, overlapped by programmatic
  // dependent launch, was faster than every CTA repeating the row's preparation (docs/GPU.md).
  if (use_gemm(l, n)) {
    prepare_inputs(p, l, n, true);
    for (size_t i = 0; i < l.mats.size(); ++i) {
      const Matrix& m = l.mats[i];
      const int64_t rows = std::min(n_out - l.offset[i], m.rows);
      queue(stage_, [&] { return gemm_->run(m, act(cuda::gemm_act_kind(m), m.k), n, y + l.offset[i], ldy, rows, acc, stream_), true; });
    }
    return;
  }
  bool fused = fuse_prep_ && !prepared;
  for (const Matrix& m : l.mats) fused = fused && cuda::prep_fuses(m, n);
  if (!fused && !prepared) prepare_inputs(p, l, n, false);
  for (size_t i = 0; i < l.mats.size(); ++i) {
    const Matrix& m = l.mats[i];
    ActBuf& x = act(m.act(), m.k);
    const int64_t rows = std::min(n_out - l.offset[i], m.rows);
    queue(stage_, [&] {
      if (fused) cuda::matmul_prep(m, p, x, n, y + l.offset[i], ldy, rows, acc, stream_);
      else cuda::matmul(m, x, n, y + l.offset[i], ldy, rows, acc, stream_);
      return true;
    });
  }
}

// Queues one forward step of n tokens (n_out logits rows) on the stream, inputs taken from h_in_; the
// output (logits rows or their argmax ids) lands in pinned host memory when the stream reaches the end.
void CudaBackend::enqueue(int n, int n_out, Output out) {
  const size_t B = (size_t)max_batch_;
  MERLIN_CUDA_CHECK(cudaMemcpyAsync(d_in_, h_in_, in_words() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (flash_now_)
    MERLIN_CUDA_CHECK(cudaMemcpyAsync(d_tiles_, h_tiles_, (size_t)n_tiles_ * sizeof(cuda::AttnTile),
                                      cudaMemcpyHostToDevice, stream_));
  const int32_t *tokens = d_in_, *pos = d_in_ + B, *seq = d_in_ + 2 * B, *rows = d_in_ + 3 * B;
  const Weight& e = m_.token_embd();
  // The first layer's RMSNorm reads the embedding rows itself (PrepArgs::d_tokens) where its input goes through
  // prep_act (not with products that prepare their own input, MERLIN_CUDA_FUSE=1).
  const bool embed_in_prep = embed_fuse_ && !fuse_prep_ && !layers_.empty();
  if (!embed_in_prep)
    queue(kEmbed, [&] { return cuda::embed(e.type, embd_, e.row_bytes, c_.dim, tokens, n, x_, stream_), true; });
  const int hd = (int)c_.head_dim();
  const int64_t q_dim = c_.n_heads * hd, k_off = cuda::padded_rows(q_dim);
  const int64_t ffn_off = cuda::padded_rows(c_.ffn_dim);
  const ActBuf folded = folded_input(n);
  bool attn_folded = false;  // the previous layer's down product wrote this layer's QKV input (run_residual)
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& L = layers_[li];
    const Layer* next = li + 1 < layers_.size() ? &layers_[li + 1] : nullptr;
    const int64_t qkv_ld = L.qkv.rows, gu_ld = L.gate_up.rows;
    cuda::PrepArgs norm{cuda::Prep::RmsNorm, x_, c_.dim, L.attn_norm, c_.norm_eps, 0, nullptr};
    if (li == 0 && embed_in_prep) {
      norm.d_tokens = tokens;
      norm.embd = static_cast<const uint8_t*>(embd_);
      norm.embd_type = e.type;
      norm.embd_row_bytes = e.row_bytes;
      norm.d_embed_x = x_;
    }
    const cuda::KvArgs kv{L.k, L.v, kv_elem_ == 2, block_size_, max_blocks_, table_, kv_q8_, L.ks, L.vs};
    stage_ = kQkv;
    ActBuf* wo_in = attention_output_act(L.wo, n);  // null for tiled attention
    run_qkv(L, norm, n, pos, seq, kv, attn_folded ? &folded : nullptr);
    queue(kAttn, [&] {
      if (flash_now_)
        cuda::flash_attention(qkv_, qkv_ld, d_tiles_, n_tiles_, (int)c_.n_heads, (int)c_.n_kv_heads, hd, kv, att_,
                              stream_);
      else
        cuda::attention(qkv_, qkv_ld, k_off, n, pos, seq, (int)c_.n_heads, (int)c_.n_kv_heads, hd, n_ctx_, kv, att_,
                        stream_, split_attention_ && !attn_short_now_ ? &attn_scratch_ : nullptr, wo_in);
      return true;
    });
    cuda::PrepArgs plain{cuda::Prep::Plain, att_, q_dim, nullptr, 0, 0, nullptr};
    stage_ = kWo;
    const bool ffn_folded = run_residual(L.wo, plain, n, wo_in != nullptr, L.ffn_norm, &L.gate_up);
    const ActBuf* ffn_in = ffn_folded ? &folded : nullptr;
    cuda::PrepArgs norm2{cuda::Prep::RmsNorm, x_, c_.dim, L.ffn_norm, c_.norm_eps, 0, nullptr};
    stage_ = kGateUp;
    const bool glu_done = n == 1 && run_gate_up_swiglu(L, norm2, ffn_off, ffn_in);
    if (!glu_done) run_linear(L.gate_up, norm2, n, gu_, gu_ld, gu_ld, false, false, ffn_in);
    cuda::PrepArgs glu{cuda::Prep::SwiGlu, gu_, gu_ld, nullptr, 0, ffn_off, nullptr};
    // The last layer's down product may prepare the head's input (a one-token step wanting its one row; a
    // batched head reads the rows it wants, not the step's tokens).
    const bool to_head = !next && n == 1 && n_out == 1;
    stage_ = kDown;
    const ActBuf* down_in = glu_done ? nullptr : glu_input(L.down, n, ffn_off);
    attn_folded = run_residual(L.down, glu, n, glu_done, next ? next->attn_norm : to_head ? out_norm_ : nullptr,
                               next ? &next->qkv : to_head ? &head_ : nullptr, down_in);
  }
  if (n_out > 0) {
    cuda::PrepArgs fin{cuda::Prep::RmsNorm, x_, c_.dim, out_norm_, c_.norm_eps, 0, rows};
    stage_ = kHead;
    if (fused_argmax(n_out, out)) {
      const Matrix& m = head_.mats[0];
      if (!attn_folded) prepare_inputs(fin, head_, 1, false);
      const ActBuf& x = attn_folded ? folded : act(m.act(), m.k);
      queue(kHead, [&] { return cuda::matvec1_argmax(m, x, logits_, c_.vocab_size, argmax_key(), stream_); });
      MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_ + max_batch_, argmax_key(), sizeof(unsigned long long),
                                        cudaMemcpyDeviceToHost, stream_));
      return;
    }
    run_linear(head_, fin, n_out, logits_, c_.vocab_size, c_.vocab_size, false, false, attn_folded ? &folded : nullptr);
    if (out == Output::GreedyIds) {
      queue(kArgmax, [&] { return cuda::argmax_rows(logits_, c_.vocab_size, n_out, c_.vocab_size, d_ids_, stream_), true; });
      MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_, d_ids_, (size_t)n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    } else if (out == Output::Logits) {
      MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_logits_, logits_, (size_t)n_out * c_.vocab_size * sizeof(float),
                                        cudaMemcpyDeviceToHost, stream_));
    }
  }
}

void CudaBackend::forward(const Batch& batch, float* logits) {
  const int n_out = run_step(batch, Output::Logits);
  if (n_out > 0) std::memcpy(logits, h_logits_, (size_t)n_out * c_.vocab_size * sizeof(float));
}

void CudaBackend::forward_sample(const Batch& batch, int64_t n_vocab, std::span<const RowSampling> rows,
                                 std::span<const LogitAdjust> adjust, int32_t* tokens) {
  MERLIN_CHECK(n_vocab == c_.vocab_size, "forward_sample: vocabulary of ", n_vocab, " tokens, the model has ",
               c_.vocab_size);
  MERLIN_CHECK(rows.size() == batch.n_logits(), "forward_sample: ", rows.size(), " sampling rows for ",
               batch.n_logits(), " logits rows");
  for (const RowSampling& r : rows)
    MERLIN_CHECK(r.first >= 0 && r.n_adjust >= 0 && (size_t)r.first + (size_t)r.n_adjust <= adjust.size(),
                 "forward_sample: a row's adjustments lie outside the list");
  if (adjust.size() > adjust_cap_) {  // between steps: nothing captured refers to these buffers
    const size_t cap = std::max(adjust.size(), 2 * adjust_cap_);
    MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaFreeHost(h_adjust_);
    cuda::dev_free(d_adjust_);
    h_adjust_ = nullptr;
    d_adjust_ = nullptr;
    adjust_cap_ = 0;
    MERLIN_CUDA_CHECK(cudaMallocHost(&h_adjust_, cap * sizeof(LogitAdjust)));
    d_adjust_ = static_cast<LogitAdjust*>(cuda::dev_alloc(cap * sizeof(LogitAdjust)));
    adjust_cap_ = cap;
  }
  if (!rows.empty()) std::memcpy(h_rows_, rows.data(), rows.size() * sizeof(RowSampling));
  if (!adjust.empty()) std::memcpy(h_adjust_, adjust.data(), adjust.size() * sizeof(LogitAdjust));
  n_adjust_ = adjust.size();
  const int n_out = run_step(batch, Output::DeviceLogits);
  std::memcpy(tokens, h_ids_, (size_t)n_out * sizeof(int32_t));
  if (std::find(tokens, tokens + n_out, cuda::kSampleMore) != tokens + n_out) {
    // Rows whose kept set outgrew the merged candidates: radix selects weighted by mass over their logits.
    cuda::sample_rows_more(logits_, c_.vocab_size, n_out, c_.vocab_size, d_rows_, d_ids_, stream_, d_sample_work_);
    MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_, d_ids_, (size_t)n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::memcpy(tokens, h_ids_, (size_t)n_out * sizeof(int32_t));
  }
  // Rows whose filters keep more candidates than the device collects (-1): their adjusted logits row comes
  // back and the host finishes the same draw (the adjustments are already applied).
  for (int r = 0; r < n_out; ++r) {
    if (tokens[r] >= 0) continue;
    cuda::copy_to_host(h_logits_, logits_ + (size_t)r * c_.vocab_size, (size_t)c_.vocab_size * sizeof(float));
    RowSampling plain = rows[(size_t)r];
    plain.n_adjust = 0;
    tokens[r] = sample_row(h_logits_, c_.vocab_size, plain, nullptr, sample_scratch_);
  }
}

// After a DeviceLogits step: the rows' sampling on the device, and only the ids come back.
void CudaBackend::queue_sampling(int n_out) {
  if (n_out <= 0) return;
  MERLIN_CUDA_CHECK(
      cudaMemcpyAsync(d_rows_, h_rows_, (size_t)n_out * sizeof(RowSampling), cudaMemcpyHostToDevice, stream_));
  if (n_adjust_ > 0)
    MERLIN_CUDA_CHECK(
        cudaMemcpyAsync(d_adjust_, h_adjust_, n_adjust_ * sizeof(LogitAdjust), cudaMemcpyHostToDevice, stream_));
  cuda::sample_rows(logits_, c_.vocab_size, n_out, c_.vocab_size, d_rows_, d_adjust_, d_ids_, stream_,
                    d_sample_work_);
  MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_, d_ids_, (size_t)n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
}

void CudaBackend::forward_greedy(const Batch& batch, int64_t n_vocab, int32_t* tokens) {
  MERLIN_CHECK(n_vocab == c_.vocab_size, "forward_greedy: vocabulary of ", n_vocab, " tokens, the model has ",
               c_.vocab_size);
  const int n_out = run_step(batch, Output::GreedyIds);
  std::memcpy(tokens, h_ids_, (size_t)n_out * sizeof(int32_t));
}

// Runs one step (graph replay for decode-sized batches) and waits for it; returns the number of logits rows.
int CudaBackend::run_step(const Batch& batch, Output out) {
  const auto wall0 = std::chrono::steady_clock::now();
  bool captured = false;  // this step captured its graph (not timed)
  validate(batch);
  const int n = (int)batch.size();
  const size_t B = (size_t)max_batch_;
  int n_out = 0;
  for (int i = 0; i < n; ++i) {
    h_in_[i] = batch.tokens[i];
    h_in_[B + i] = batch.pos[i];
    h_in_[2 * B + i] = batch.seq[i];
    if (batch.want_logits[i]) h_in_[3 * B + n_out++] = i;
  }
  const bool graph_step = graphs_ && n <= kGraphMaxTokens;
  cuda::KvArgs kv_probe;
  kv_probe.f16 = kv_elem_ == 2;
  kv_probe.q8 = kv_q8_;
  flash_now_ = !graph_step && flash_min_ > 0 && n >= flash_min_ &&
               cuda::flash_attention_supported((int)c_.head_dim(), kv_probe);
  if (flash_now_) n_tiles_ = cuda::make_attention_tiles(batch.pos.data(), batch.seq.data(), n, h_tiles_);
  attn_short_now_ = attn_scratch_.n_split > 1 &&
                    *std::max_element(batch.pos.begin(), batch.pos.end()) < attn_scratch_.chunk;
  if (graph_step) {
    // A step's graph depends on whether its attention is split (attn_short_now_).
    const auto shape = std::make_tuple(n, n_out, (int)out + (attn_short_now_ ? 16 : 0));
    auto it = graphs_by_shape_.find(shape);
    captured = it == graphs_by_shape_.end();
    if (captured) {
      cudaGraph_t g = nullptr;
      MERLIN_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue(n, n_out, out);
      } catch (...) {
        cudaStreamEndCapture(stream_, &g);
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();  // leave no stale launch error behind for the next call
        throw;
      }
      MERLIN_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
      cudaGraphExec_t exec = nullptr;
      MERLIN_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      cudaGraphDestroy(g);
      it = graphs_by_shape_.emplace(shape, exec).first;
    }
    if (timing_.start) MERLIN_CUDA_CHECK(cudaEventRecord(timing_.start, stream_));
    MERLIN_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
    if (timing_.start) MERLIN_CUDA_CHECK(cudaEventRecord(timing_.end, stream_));
  } else {
    enqueue(n, n_out, out);
  }
  if (out == Output::DeviceLogits) queue_sampling(n_out);
  MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (timing_.start && graph_step && !captured) {
    float ms = 0;
    MERLIN_CUDA_CHECK(cudaEventElapsedTime(&ms, timing_.start, timing_.end));
    timing_.gpu_us += 1e3 * ms;
    timing_.wall_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - wall0).count();
    ++timing_.steps;
  }
  if (fused_argmax(n_out, out)) {
    unsigned long long key;
    std::memcpy(&key, h_ids_ + max_batch_, sizeof key);
    h_ids_[0] = cuda::argmax_key_row(key);
  }
  return n_out;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Model& model, const BackendOptions& opts) {
  return std::make_unique<CudaBackend>(model, opts);
}

}  // namespace merlin
