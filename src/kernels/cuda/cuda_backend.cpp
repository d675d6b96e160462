// CudaBackend (cuda_backend.h): set-up, the step runner with its graphs, greedy and sampled steps.
#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace merlin {
namespace cuda_backend_detail {

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
  glu_stage_ = env_is("MERLIN_CUDA_GLU_STAGE", "0")   ? GluStage::Never
               : env_is("MERLIN_CUDA_GLU_STAGE", "1") ? GluStage::AnyRow
                                                      : GluStage::ShortRows;
  embed_fuse_ = !env_is("MERLIN_CUDA_EMBED_FUSE", "0");
  norm_fold_ = !env_is("MERLIN_CUDA_NORM_FOLD", "0") && c_.dim % 32 == 0;
  norm_fold_mm_ = (int)std::clamp(env_int("MERLIN_CUDA_NORM_FOLD_MM", norm_fold_mm_), 0L, (long)kGraphMaxTokens);
  norm_fold_always_ = env_is("MERLIN_CUDA_NORM_PAYS", "1");
  norm_half_ = !env_is("MERLIN_CUDA_NORM_HALF", "0");
  split_attention_ = !env_is("MERLIN_CUDA_SPLITK", "0");
  twice_ = parse_stages(std::getenv("MERLIN_CUDA_TWICE"));
  if (opts.long_decode) {
    chain_max_ = cuda::kChainMax;
    loop_unroll_ = 8;
  }
  chain_max_ = (int)std::clamp(env_int("MERLIN_CUDA_CHAIN", chain_max_), 0L, (long)cuda::kChainMax);
  loop_unroll_ = (int)env_int("MERLIN_CUDA_LOOP_UNROLL", loop_unroll_);
  MERLIN_CHECK(loop_unroll_ == 2 || loop_unroll_ == 4 || loop_unroll_ == 8 || loop_unroll_ == 16,
               "MERLIN_CUDA_LOOP_UNROLL: 2, 4, 8 or 16");
  if (env_is("MERLIN_CUDA_STEP_TIMING", "1")) {
    MERLIN_CUDA_CHECK(cudaEventCreate(&timing_.start));
    MERLIN_CUDA_CHECK(cudaEventCreate(&timing_.end));
  }
  // Prefill products: from 64 tokens on, dequantizing to halves and cuBLAS beat the batched tensor-core kernel,
  // which reads each weight once per 32 tokens (docs/GPU.md). MERLIN_CUDA_GEMM_MIN=0 keeps every step on it.
  gemm_min_ = (int)env_int("MERLIN_CUDA_GEMM_MIN", 64);
  if (gemm_min_ > 0 && gemm_min_ <= max_batch_ && cuda::gemm_available()) gemm_ = std::make_unique<cuda::GemmRunner>();
  else gemm_min_ = 0;
  // Tiled attention for eager steps only (graph-captured decode steps keep the per-token kernel).
  flash_min_ = (int)env_int("MERLIN_CUDA_FLASH_MIN", 64);
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
    norm_part_ = dev_array<double>((size_t)rows * c_.dim / 16);  // per 32 outputs, or 16 (the half-plane mode)
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
  if (chain_max_ > 1) {
    MERLIN_CUDA_CHECK(cudaMallocHost(&h_chain_, sizeof(cuda::ChainState)));
    std::memset(static_cast<void*>(h_chain_), 0, sizeof(cuda::ChainState));
    d_chain_ = static_cast<cuda::ChainState*>(cuda::dev_alloc(sizeof(cuda::ChainState)));
    MERLIN_CUDA_CHECK(cudaMallocHost(&h_bchain_, sizeof(cuda::BatchChainState)));
    std::memset(static_cast<void*>(h_bchain_), 0, sizeof(cuda::BatchChainState));
    d_bchain_ = static_cast<cuda::BatchChainState*>(cuda::dev_alloc(sizeof(cuda::BatchChainState)));
  }
  d_ids_ = dev_array<int32_t>(B);
  d_keys_ = dev_array<unsigned long long>(B);
  batch_argmax_ = !env_is("MERLIN_CUDA_BATCH_ARGMAX", "0");
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
  // Heads of up to 64 only: H200 tg128 (2026-12-01), on / off: base q4_0 4,758-4,762 / 4,678-4,687 t/s, q8_0
  // 4,458-4,461 / 4,453-4,457; with 128-dim heads iphone q4_0 1,230-1,231 / 1,229-1,230, macbook q4_0 747.5 /
  // 750.6 (the hoisted instance's wider pass pays there).
  const bool one_pass = env_is("MERLIN_CUDA_ATTN_ONE_PASS", "1") ||
                        (!env_is("MERLIN_CUDA_ATTN_ONE_PASS", "0") && c_.head_dim() <= 64);
  if (one_pass) {
    cuda::KvArgs kv;
    kv.q8 = kv_q8_;
    attn_one_pass_ = cuda::attention_one_pass_positions((int)c_.head_dim(), kv);
    // Beyond a split's chunk a token alone would get the unsplit numerics and among longer contexts the
    // split ones: the class must not change a token's bits.
    if (attn_scratch_.n_split > 1) attn_one_pass_ = std::min(attn_one_pass_, attn_scratch_.chunk);
  }
  cuda::sync_device();
}

int CudaBackend::attn_class(int max_pos) const {
  if (max_pos < attn_one_pass_) return kAttnOnePass;
  return attn_scratch_.n_split > 1 && max_pos < attn_scratch_.chunk ? kAttnShort : kAttnSplit;
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
  for (auto& by_kind : loops_)
    for (Loop& l : by_kind) {
      if (l.exec) cudaGraphExecDestroy(l.exec);
      if (l.graph) cudaGraphDestroy(l.graph);
    }
  for (auto& [key, l] : batch_loops_) {
    if (l.exec) cudaGraphExecDestroy(l.exec);
    if (l.graph) cudaGraphDestroy(l.graph);
  }
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
                  (void*)att_, (void*)gu_, (void*)logits_, (void*)d_ids_, (void*)d_keys_})
    cuda::dev_free(p);
  cudaFreeHost(h_in_);
  cudaFreeHost(h_chain_);
  cuda::dev_free(d_chain_);
  cudaFreeHost(h_bchain_);
  cuda::dev_free(d_bchain_);
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

CudaBackend::StepIo CudaBackend::step_io() const {
  const size_t B = (size_t)max_batch_;
  StepIo io;
  io.tokens = d_in_;
  io.pos = d_in_ + B;
  io.seq = d_in_ + 2 * B;
  io.rows = d_in_ + 3 * B;
  io.key = reinterpret_cast<unsigned long long*>(d_in_ + 4 * B);
  return io;
}

cudaGraphExec_t CudaBackend::graph_for(const std::tuple<int, int, int>& shape, const std::function<void()>& queue_step,
                                       bool& captured) {
  auto it = graphs_by_shape_.find(shape);
  captured = it == graphs_by_shape_.end();
  if (!captured) return it->second;
  cudaGraph_t g = nullptr;
  MERLIN_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    const cuda::PdlScope pdl;  // programmatic dependent launch inside graphs only (cuda_api.h)
    queue_step();
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
  graphs_by_shape_.emplace(shape, exec);
  return exec;
}

void CudaBackend::launch_graph(cudaGraphExec_t exec) {
  if (timing_.start) MERLIN_CUDA_CHECK(cudaEventRecord(timing_.start, stream_));
  MERLIN_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  if (timing_.start) MERLIN_CUDA_CHECK(cudaEventRecord(timing_.end, stream_));
}

void CudaBackend::add_timing(int steps, std::chrono::steady_clock::time_point wall0) {
  if (!timing_.start) return;
  float ms = 0;
  MERLIN_CUDA_CHECK(cudaEventElapsedTime(&ms, timing_.start, timing_.end));
  timing_.gpu_us += 1e3 * ms;
  timing_.wall_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - wall0).count();
  timing_.steps += steps;
}

bool CudaBackend::loops_apply(bool sampled) const {
  // The loop's bookkeeping runs in the first layer's preparation, which must read the embedding row itself;
  // sampled steps need the device's draw (its slices).
  const bool embed_in_prep = embed_fuse_ && !fuse_prep_ && !layers_.empty();
  return chain_max_ >= loop_unroll_ && graphs_ && !twice_ && !loops_broken_ && embed_in_prep &&
         (!sampled || d_sample_work_);
}

int CudaBackend::decode_greedy(int32_t token, int32_t pos, int seq, int n_steps, int64_t n_vocab,
                               const std::function<bool(int32_t)>& on_token) {
  if (!loops_apply(false) || n_steps < 2) return Backend::decode_greedy(token, pos, seq, n_steps, n_vocab, on_token);
  MERLIN_CHECK(n_vocab == c_.vocab_size, "decode_greedy: vocabulary of ", n_vocab, " tokens, the model has ",
               c_.vocab_size);
  return decode_looped(token, pos, seq, n_steps, nullptr, on_token);
}

int CudaBackend::decode_sample(int32_t token, int32_t pos, int seq, std::span<const RowSampling> rows,
                               int64_t n_vocab, const std::function<bool(int32_t)>& on_token) {
  if (!loops_apply(true) || rows.size() < 2) return Backend::decode_sample(token, pos, seq, rows, n_vocab, on_token);
  MERLIN_CHECK(n_vocab == c_.vocab_size, "decode_sample: vocabulary of ", n_vocab, " tokens, the model has ",
               c_.vocab_size);
  for (const RowSampling& r : rows) MERLIN_CHECK(r.n_adjust == 0, "decode_sample: rows carry no adjustments");
  return decode_looped(token, pos, seq, (int)rows.size(), rows.data(), on_token);
}

int CudaBackend::decode_looped(int32_t token, int32_t pos, int seq, int n_steps, const RowSampling* rows,
                               const std::function<bool(int32_t)>& on_token) {
  std::vector<int32_t> ids((size_t)chain_max_);
  int done = 0;
  while (done < n_steps) {
    const int p0 = pos + done, k = loop_length(p0, n_steps - done);
    const int got = k == 0 ? 0 : run_loop(token, p0, seq, k, rows ? rows + done : nullptr, ids.data());
    for (int i = 0; i < got; ++i) {
      ++done;
      if (!on_token(ids[(size_t)i])) return done;
      token = ids[(size_t)i];
    }
    if (k > 0 && got == k) continue;
    // A draw the device left to the host (its input was valid, so its K/V row is right: run it again through
    // forward_sample), or no loop at all: one plain step.
    Batch b;
    b.add(token, pos + done, seq, true);
    if (rows) forward_sample(b, c_.vocab_size, std::span<const RowSampling>(rows + done, 1), {}, &token);
    else forward_greedy(b, c_.vocab_size, &token);
    ++done;
    if (!on_token(token)) return done;
  }
  return done;
}

// Steps of the next loop launch from position p0 with `left` steps to go: the loop's steps share one attention
// launch (attn_class), so it stops where the class changes, and it runs whole iterations (the rest one step
// at a time). 0: no loop.
int CudaBackend::loop_length(int p0, int left) const {
  int k = std::min(chain_max_, left);
  while (k > 1 && attn_class(p0 + k - 1) != attn_class(p0)) --k;
  return loops_broken_ ? 0 : k - k % loop_unroll_;
}

// A loop graph: [state in: in_bytes to d_state] -> while (condition) { steps(handle) } -> [state out: out_bytes
// back]. Built from the graph API around the captured body, since stream capture cannot make the while node
// itself. Null (and loops_broken_, with `what` in the warning) where the driver refuses it.
cudaGraphExec_t CudaBackend::build_loop(Loop& l, void* d_state, void* h_state, size_t in_bytes, size_t out_bytes,
                                        const std::function<void(unsigned long long)>& steps, const char* what) {
  cudaGraph_t g = nullptr, body = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool capturing = false;
  try {
    MERLIN_CUDA_CHECK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t in = nullptr, loop = nullptr, out = nullptr;
    MERLIN_CUDA_CHECK(cudaGraphAddMemcpyNode1D(&in, g, nullptr, 0, d_state, h_state, in_bytes, cudaMemcpyHostToDevice));
    cudaGraphConditionalHandle handle{};
    MERLIN_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, g, 1, cudaGraphCondAssignDefault));
    cudaGraphNodeParams cp{};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = handle;
    cp.conditional.type = cudaGraphCondTypeWhile;
    cp.conditional.size = 1;
    MERLIN_CUDA_CHECK(cudaGraphAddNode(&loop, g, &in, nullptr, 1, &cp));
    body = cp.conditional.phGraph_out[0];
    MERLIN_CUDA_CHECK(cudaStreamBeginCaptureToGraph(stream_, body, nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal));
    capturing = true;
    steps((unsigned long long)handle);
    capturing = false;
    MERLIN_CUDA_CHECK(cudaStreamEndCapture(stream_, &body));
    MERLIN_CUDA_CHECK(cudaGraphAddMemcpyNode1D(&out, g, &loop, 1, h_state, d_state, out_bytes, cudaMemcpyDeviceToHost));
    MERLIN_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  } catch (const Error& e) {
    if (capturing) cudaStreamEndCapture(stream_, &body);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    std::fprintf(stderr, "[cuda] %s: %s\n", what, e.what());
    loops_broken_ = true;
    return nullptr;
  }
  l.graph = g;
  l.exec = exec;
  return exec;
}

// The one-row loop graph: loop_unroll_ one-token steps per iteration from the ChainState.
void CudaBackend::enqueue_loop_step(int n, Output out, StepIo io, unsigned long long handle, int u, int attn_class) {
  io.copy_out = false;
  io.chain_handle = handle;
  io.chain_slot = u & 1;
  flash_now_ = false;
  attn_class_now_ = attn_class;
  enqueue(n, n, out, io);
}

cudaGraphExec_t CudaBackend::loop_graph(bool sampled, int attn_class) {
  Loop& l = loops_[sampled][attn_class];
  if (l.exec) return l.exec;
  const auto steps = [&](unsigned long long handle) {
    for (int u = 0; u < loop_unroll_; ++u) {  // k is a multiple of loop_unroll_ (loop_length)
      const cuda::PdlScope pdl;
      StepIo io;
      io.tokens = &d_chain_->token;
      io.pos = &d_chain_->pos[u & 1];
      io.seq = &d_chain_->seq;
      io.rows = &d_chain_->row;
      io.key = &d_chain_->key[u & 1];  // step i's key slot is i & 1 (loop_unroll_ is even)
      io.ids = &d_chain_->token;       // argmax_rows' id is the next step's token
      io.chain = d_chain_;
      enqueue_loop_step(1, sampled ? Output::DeviceLogits : Output::GreedyIds, io, handle, u, attn_class);
      if (sampled)
        cuda::sample_rows(logits_, c_.vocab_size, 1, c_.vocab_size, &d_chain_->cur, d_adjust_, &d_chain_->token,
                          stream_, d_sample_work_);
    }
  };
  return build_loop(l, d_chain_, h_chain_, sizeof(cuda::ChainState), offsetof(cuda::ChainState, cur), steps,
                    "decode loops unavailable, one graph launch per token");
}

int CudaBackend::run_loop(int32_t token, int32_t pos, int seq, int k, const RowSampling* rows, int32_t* ids) {
  for (int i = 0; i < k; ++i) {  // positions and blocks checked as for k one-token steps
    Batch check;
    check.add(token, pos + i, seq, true);
    validate(check);
  }
  const int cls = attn_class(pos);
  const bool first = !loops_[rows != nullptr][cls].exec;
  const cudaGraphExec_t exec = loop_graph(rows != nullptr, cls);
  if (!exec) return 0;
  cuda::ChainState& st = *h_chain_;
  st.token = token;
  st.pos[0] = pos;
  st.seq = seq;
  st.row = 0;
  st.fused = !rows && head_argmax_;
  st.key[0] = 0;
  st.key[1] = cuda::chain_token_key(token);  // what step 0 reads as "the previous step's" key
  st.i = 0;
  st.k = k;
  st.stopped = 0;
  if (rows) std::copy(rows, rows + k, st.rows);
  const auto wall0 = std::chrono::steady_clock::now();
  launch_graph(exec);
  MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  // Step j's id: recorded by step j + 1; the last one is still in its key slot (k is even: key[1]) or token.
  const auto id_of = [&](int j) {
    return j + 1 < k ? st.ids[j] : st.fused ? cuda::argmax_key_row(st.key[1]) : st.token;
  };
  int got = 0;
  while (got < k && id_of(got) >= 0) ids[got] = id_of(got), ++got;
  if (!first) add_timing(got + (got < k), wall0);
  return got;
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
  attn_class_now_ = attn_class(*std::max_element(batch.pos.begin(), batch.pos.end()));
  const auto queue_step = [&] {
    MERLIN_CUDA_CHECK(cudaMemcpyAsync(d_in_, h_in_, in_words() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    enqueue(n, n_out, out, step_io());
  };
  if (graph_step) {
    // A step's graph depends on how its attention launches (attn_class_now_).
    const cudaGraphExec_t exec =
        graph_for(std::make_tuple(n, n_out, (int)out + 16 * attn_class_now_), queue_step, captured);
    launch_graph(exec);
  } else {
    queue_step();
  }
  if (out == Output::DeviceLogits) queue_sampling(n_out);
  MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (graph_step && !captured) add_timing(1, wall0);
  if (fused_argmax(n_out, out)) {
    unsigned long long key;
    std::memcpy(&key, h_ids_ + max_batch_, sizeof key);
    h_ids_[0] = cuda::argmax_key_row(key);
  }
  return n_out;
}

}  // namespace cuda_backend_detail

std::unique_ptr<Backend> make_cuda_backend(const Model& model, const BackendOptions& opts) {
  return std::make_unique<cuda_backend_detail::CudaBackend>(model, opts);
}

}  // namespace merlin
