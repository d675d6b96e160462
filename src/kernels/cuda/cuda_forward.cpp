// CudaBackend (cuda_backend.h): the layers of one forward step, queued on the stream by enqueue(): which
// kernels run, which steps fold into their neighbours, and where each product reads its input.
#include "kernels/cuda/cuda_backend.h"

#include <algorithm>

namespace merlin::cuda_backend_detail {
// A 2-4-token step whose products all take the single-token kernels' multi-token instances (matvec_few_pays,
// the choice matmul() makes for them too).
bool CudaBackend::few(const Linear& l, int n) const {
  if (n < 2 || use_gemm(l, n)) return false;
  for (const Matrix& m : l.mats)
    if (!cuda::matvec_few_pays(m, n)) return false;
  return true;
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
      out.fh = nullptr;
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
// product's epilogue (matmul_rope_kv: one kernel less per layer, same bits). True when the product also asked
// the context's K/V rows into L2 for the attention kernel.
bool CudaBackend::run_qkv(const Layer& L, const cuda::PrepArgs& norm, int n, const int32_t* pos, const int32_t* seq,
                          const cuda::KvArgs& kv, const ActBuf* in) {
  const int hd = (int)c_.head_dim();
  const int64_t q_dim = c_.n_heads * hd, kv_dim = c_.kv_dim(), qkv_ld = L.qkv.rows;
  const int64_t k_off = cuda::padded_rows(q_dim), v_off = k_off + cuda::padded_rows(kv_dim);
  if (rope_fuse_ && L.qkv.mats.size() == 1 && !use_gemm(L.qkv, n)) {
    if (!in) prepare_inputs(norm, L.qkv, n, false);
    const Matrix& m = L.qkv.mats[0];
    const ActBuf& x = in ? *in : act(m.act(), m.k);
    const cuda::RopeKvArgs r = rope_args(pos, seq, kv);
    bool context_l2 = false;
    if (queue(stage_, [&] { return cuda::matmul_rope_kv(m, x, n, qkv_, qkv_ld, r, stream_, &context_l2); }))
      return context_l2;
    queue(stage_, [&] { return cuda::matmul(m, x, n, qkv_, qkv_ld, qkv_ld, false, stream_), true; });
  } else {
    run_linear(L.qkv, norm, n, qkv_, qkv_ld, qkv_ld, false, false, in);
  }
  queue(stage_, [&] {
    cuda::rope_kv(qkv_, qkv_ld, k_off, v_off, n, pos, seq, cos_sin_, (int)c_.n_heads, (int)c_.n_kv_heads, hd,
                  (int)c_.rot_dims(), kv, stream_);
    return true;
  });
  return false;
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
  r.l2_positions = kv_l2_positions(kv, r.kv_dim);
  return r;
}

// MERLIN_CUDA_KV_L2_MB=N (read once, default 8; 0 = off): how much of the context's K/V a single-token QKV
// product asks into L2 for the attention after it (prefetch_kv_context): the newest positions' rows.
int CudaBackend::kv_l2_positions(const cuda::KvArgs& kv, int64_t kv_dim) {
  static const long mb = std::clamp(env_int("MERLIN_CUDA_KV_L2_MB", 8), 0L, 40L);
  const int64_t row = kv_dim * (kv.f16 ? 2 : 4);
  if (kv.q8 || row % 16 != 0) return 0;  // whole 16-byte units only (Q8_0 rows take rope_kv's path anyway)
  return (int)std::min<int64_t>(mb * (1 << 20) / (2 * row), 1 << 30);
}

// The gate/up product writes silu(gate) * up straight into the down product's input: one-token steps through
// matvec1_swiglu (same bits), decode-sized batches through matmul_swiglu where it pays (the product's sums
// at 2 warps per tile). One kernel less per layer. False where it does not apply (nothing queued); never
// where cuBLAS would run either product (its inputs are prepared from the gate/up rows, which are then not
// written).
bool CudaBackend::run_gate_up_swiglu(const Layer& L, const cuda::PrepArgs& norm, int n, int64_t ffn_off,
                                     const ActBuf* in) {
  if (!glu_fuse_ || L.gate_up.mats.size() != 1) return false;
  if (n > 1 && (use_gemm(L.gate_up, n) || use_gemm(L.down, n) || few(L.gate_up, n))) return false;
  const ActKind kind = L.down.mats[0].act();
  for (const Matrix& m : L.down.mats)
    if (m.act() != kind || m.k != c_.ffn_dim) return false;
  const Matrix& m = L.gate_up.mats[0];
  const bool fits = n == 1 ? cuda::swiglu_fuses(m, c_.ffn_dim, ffn_off, kind)
                           : cuda::matmul_swiglu_fits(m, n, c_.ffn_dim, ffn_off, kind) && cuda::matmul_swiglu_pays(m, n);
  if (!fits) return false;
  if (!in) prepare_inputs(norm, L.gate_up, n, false);
  ActBuf out = act(kind, c_.ffn_dim);  // copies: act() may grow acts_
  const ActBuf x = in ? *in : act(m.act(), m.k);
  return queue(stage_, [&] {
    return n == 1 ? cuda::matvec1_swiglu(m, x, c_.ffn_dim, ffn_off, out, stream_)
                  : cuda::matmul_swiglu(m, x, n, c_.ffn_dim, ffn_off, out, stream_);
  });
}

// Whether `producer` (Wo or down, which add to x_) can also write the RMSNorm input of `reader` (gate/up, or
// the next layer's QKV), so that no RMSNorm kernel runs between them (matvec1_norm for one token,
// matmul_norm for decode-sized steps: the reader's staged scales get 1 / rms(x) from per-block sums of
// squares; within rounding of the separate kernel's result, not bit-identical). The reader must take Q8_0
// rows through the single-token kernels, or through batched ones that stage them (reads_deferred_norm).
// Where the caller allows it (half_ok: a reader whose kernel choice reads_half_norm sees, i.e. not the
// gate/up product's Glu epilogue) and every reader part takes the half plane at n tokens, the producer
// writes only that plane (Fold::Half): its product keeps its own warps per tile, where the Q8_0 rows' blocks
// of 32 would cap them at 4.
CudaBackend::Fold CudaBackend::folds_norm(const Linear& producer, const Linear& reader, int n, bool half_ok) const {
  if (!norm_fold_ || fuse_prep_ || producer.mats.size() != 1 || use_gemm(producer, n) || use_gemm(reader, n))
    return Fold::None;
  if (n > 1 && n > std::min(norm_fold_mm_, norm_act_.n_cap)) return Fold::None;
  if (few(reader, n)) {  // the reader stages row planes: only a 2-4-token producer writes them
    for (const Matrix& m : reader.mats)
      if (m.act() != ActKind::Q8_0 || m.k != c_.dim) return Fold::None;
    const Matrix& m = producer.mats[0];
    return few(producer, n) && cuda::norm_fold_fits(m, c_.dim) ? Fold::Few : Fold::None;
  }
  bool half = n > 1 && half_ok && norm_half_;
  for (const Matrix& m : reader.mats) {
    if (m.act() != ActKind::Q8_0 || m.k != c_.dim) return Fold::None;
    half = half && cuda::reads_half_norm(m, n);
  }
  const Matrix& m = producer.mats[0];
  if (half && cuda::matmul_norm_half_fits(m, c_.dim, n) && (norm_fold_always_ || cuda::matmul_norm_half_pays(m, n)))
    return Fold::Half;
  for (const Matrix& r : reader.mats)
    if (n > 1 && !cuda::reads_deferred_norm(r, n)) return Fold::None;
  const bool rows = n == 1 ? cuda::norm_fold_fits(m, c_.dim)
                           : cuda::matmul_norm_fits(m, c_.dim, n) && (norm_fold_always_ || cuda::matmul_norm_pays(m, n));
  return rows ? Fold::Rows : Fold::None;
}

ActBuf CudaBackend::folded_input(int n, Fold f) const {
  ActBuf a = norm_act_;
  a.rms_part = norm_part_;
  a.rms_eps = c_.norm_eps;
  a.rms_rows = n;
  a.rms_block = f == Fold::Half ? 16 : 32;
  a.rms_in_rows = n == 1 || f == Fold::Few;
  return a;
}

// x_ += act(p) · l. With a reader (folds_norm), the product also writes the reader's input, RMSNorm(x_) with
// weights next_norm, into norm_act_ and returns how: the reader takes folded_input().
CudaBackend::Fold CudaBackend::run_residual(const Linear& l, const cuda::PrepArgs& p, int n, bool prepared,
                                            const float* next_norm, const Linear* reader, bool half_ok,
                                            const ActBuf* in) {
  const Fold f = reader ? folds_norm(l, *reader, n, half_ok) : Fold::None;
  if (f != Fold::None) {
    if (!prepared && !in) prepare_inputs(p, l, n, false);
    const Matrix& m = l.mats[0];
    const ActBuf& x = in ? *in : act(m.act(), m.k);
    if (queue(stage_, [&] {
          if (n == 1) return cuda::matvec1_norm(m, x, x_, c_.dim, true, next_norm, norm_act_, norm_part_, stream_);
          if (f == Fold::Few)
            return cuda::matvec_few_norm(m, x, n, x_, c_.dim, c_.dim, true, next_norm, norm_act_, norm_part_, stream_);
          return cuda::matmul_norm(m, x, n, x_, c_.dim, c_.dim, true, next_norm, norm_act_, norm_part_, stream_,
                                   f == Fold::Half);
        }))
      return f;
    prepared = true;
  }
  run_linear(l, p, n, x_, c_.dim, c_.dim, true, prepared, in);
  return Fold::None;
}

// One-token steps whose SwiGLU did not go into the gate/up product: the down product computes it while it
// stages its input (ActBuf::glu_src, matvec1_glu_fits), so no SwiGLU kernel runs. Null where it does not
// apply (then prep_act runs it). Every CTA of the down product repeats that work, 8 bytes of gate/up values
// per element: it pays for short rows, not for long ones. Measured on the H200 (tg128, 2026-11-30, two runs
// each, staged / separate kernel): base (ffn 2,048) q4_0 4,532-4,584 / 4,401-4,410 t/s (twelfth session);
// iphone (ffn 12,288) q4_0 1,058-1,059 / 1,165-1,166, q8_0 761-762 / 820, mxfp4 847 / 917 (seventeenth;
// two or three times as many blocks in flight per warp in the staging did not close the gap: 1,066 / 1,057).
constexpr int64_t kGluStageMaxK = 4096;

// Steps of 2-4 tokens whose down product takes the 2-4-token kernels stage each token's SwiGLU row the same
// way (gu_ld apart).
const ActBuf* CudaBackend::glu_input(const Linear& down, int n, int64_t ffn_off, int64_t gu_ld) {
  if ((n != 1 && !few(down, n)) || glu_stage_ == GluStage::Never || down.mats.size() != 1 || use_gemm(down, n))
    return nullptr;
  const Matrix& m = down.mats[0];
  if (m.act() != ActKind::Q8_0 || m.k != c_.ffn_dim || !cuda::matvec1_glu_fits(m)) return nullptr;
  if (glu_stage_ == GluStage::ShortRows && m.k > kGluStageMaxK) return nullptr;
  glu_in_ = act(m.act(), m.k);
  glu_in_.glu_src = gu_;
  glu_in_.glu_offset = ffn_off;
  glu_in_.glu_ld = gu_ld;
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

// Queues one forward step of n tokens (n_out logits rows) on the stream, inputs read where io says (already
// on the device when the stream gets there); with io.copy_out the output (logits rows or their argmax ids)
// lands in pinned host memory when the stream reaches the end.
void CudaBackend::enqueue(int n, int n_out, Output out, const StepIo& io) {
  if (flash_now_)
    MERLIN_CUDA_CHECK(cudaMemcpyAsync(d_tiles_, h_tiles_, (size_t)n_tiles_ * sizeof(cuda::AttnTile),
                                      cudaMemcpyHostToDevice, stream_));
  const int32_t *tokens = io.tokens, *pos = io.pos, *seq = io.seq, *rows = io.rows;
  const Weight& e = m_.token_embd();
  // The first layer's RMSNorm reads the embedding rows itself (PrepArgs::d_tokens) where its input goes through
  // prep_act (not with products that prepare their own input, MERLIN_CUDA_FUSE=1).
  const bool embed_in_prep = embed_fuse_ && !fuse_prep_ && !layers_.empty();
  MERLIN_CHECK(!io.chain || (embed_in_prep && n == 1), "internal: a decode loop's step needs the fused embedding");
  MERLIN_CHECK(!io.bchain || (embed_in_prep && n <= cuda::kBatchChainRows && n_out == n && out == Output::GreedyIds),
               "internal: a batched decode loop's step needs the fused embedding and greedy ids of every row");
  if (!embed_in_prep)
    queue(kEmbed, [&] { return cuda::embed(e.type, embd_, e.row_bytes, c_.dim, tokens, n, x_, stream_), true; });
  const int hd = (int)c_.head_dim();
  const int64_t q_dim = c_.n_heads * hd, k_off = cuda::padded_rows(q_dim);
  const int64_t ffn_off = cuda::padded_rows(c_.ffn_dim);
  Fold attn_folded = Fold::None;  // how the previous layer's down product wrote this layer's QKV input
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
      norm.embd_rows = e.rows;
      norm.chain = io.chain;
      norm.chain_handle = io.chain_handle;
      norm.chain_slot = io.chain_slot;
      norm.bchain = io.bchain;
    }
    const cuda::KvArgs kv{L.k, L.v, kv_elem_ == 2, block_size_, max_blocks_, table_, kv_q8_, L.ks, L.vs};
    stage_ = kQkv;
    ActBuf* wo_in = attention_output_act(L.wo, n);  // null for tiled attention
    const ActBuf attn_in = folded_input(n, attn_folded);
    const bool context_l2 = run_qkv(L, norm, n, pos, seq, kv, attn_folded != Fold::None ? &attn_in : nullptr);
    queue(kAttn, [&] {
      if (flash_now_)
        cuda::flash_attention(qkv_, qkv_ld, d_tiles_, n_tiles_, (int)c_.n_heads, (int)c_.n_kv_heads, hd, kv, att_,
                              stream_);
      else
        cuda::attention(qkv_, qkv_ld, k_off, n, pos, seq, (int)c_.n_heads, (int)c_.n_kv_heads, hd, n_ctx_, kv, att_,
                        stream_, split_attention_ && attn_class_now_ == kAttnSplit ? &attn_scratch_ : nullptr, wo_in,
                        context_l2, attn_class_now_ == kAttnOnePass);
      return true;
    });
    cuda::PrepArgs plain{cuda::Prep::Plain, att_, q_dim, nullptr, 0, 0, nullptr};
    stage_ = kWo;
    const Fold ffn_folded = run_residual(L.wo, plain, n, wo_in != nullptr, L.ffn_norm, &L.gate_up, false);
    const ActBuf ffn_act = folded_input(n, ffn_folded);
    const ActBuf* ffn_in = ffn_folded != Fold::None ? &ffn_act : nullptr;
    cuda::PrepArgs norm2{cuda::Prep::RmsNorm, x_, c_.dim, L.ffn_norm, c_.norm_eps, 0, nullptr};
    stage_ = kGateUp;
    const bool glu_done = run_gate_up_swiglu(L, norm2, n, ffn_off, ffn_in);
    if (!glu_done) run_linear(L.gate_up, norm2, n, gu_, gu_ld, gu_ld, false, false, ffn_in);
    cuda::PrepArgs glu{cuda::Prep::SwiGlu, gu_, gu_ld, nullptr, 0, ffn_off, nullptr};
    // The last layer's down product may prepare the head's input (a one-token step wanting its one row; a
    // batched head reads the rows it wants, not the step's tokens).
    const bool to_head = !next && n == 1 && n_out == 1;
    stage_ = kDown;
    const ActBuf* down_in = glu_done ? nullptr : glu_input(L.down, n, ffn_off, gu_ld);
    attn_folded = run_residual(L.down, glu, n, glu_done, next ? next->attn_norm : to_head ? out_norm_ : nullptr,
                               next ? &next->qkv : to_head ? &head_ : nullptr, next != nullptr, down_in);
  }
  if (n_out > 0) {
    cuda::PrepArgs fin{cuda::Prep::RmsNorm, x_, c_.dim, out_norm_, c_.norm_eps, 0, rows};
    stage_ = kHead;
    if (fused_argmax(n_out, out)) {
      const Matrix& m = head_.mats[0];
      const ActBuf folded = folded_input(n, attn_folded);
      if (attn_folded == Fold::None) prepare_inputs(fin, head_, 1, false);
      const ActBuf& x = attn_folded != Fold::None ? folded : act(m.act(), m.k);
      queue(kHead, [&] { return cuda::matvec1_argmax(m, x, logits_, c_.vocab_size, io.key, stream_); });
      if (io.copy_out)
        MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_ + max_batch_, io.key, sizeof(unsigned long long),
                                          cudaMemcpyDeviceToHost, stream_));
      return;
    }
    if (batched_argmax(n_out, out)) {  // the head's product keeps each row's argmax, not the logits
      const Matrix& m = head_.mats[0];
      const ActBuf folded = folded_input(n, attn_folded);
      if (attn_folded == Fold::None) prepare_inputs(fin, head_, n_out, false);
      const ActBuf& x = attn_folded != Fold::None ? folded : act(m.act(), m.k);
      int32_t* ids = io.ids ? io.ids : d_ids_;
      queue(kHead, [&] { return cuda::matmul_argmax(m, x, n_out, c_.vocab_size, d_keys_, stream_), true; });
      queue(kArgmax, [&] { return cuda::argmax_keys_to_ids(d_keys_, n_out, ids, stream_), true; });
      if (io.copy_out)
        MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_, ids, (size_t)n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
      return;
    }
    const ActBuf folded = folded_input(n, attn_folded);
    run_linear(head_, fin, n_out, logits_, c_.vocab_size, c_.vocab_size, false, false,
               attn_folded != Fold::None ? &folded : nullptr);
    MERLIN_CHECK(io.copy_out || out != Output::Logits, "internal: logits rows always go to the host");
    if (out == Output::GreedyIds) {
      int32_t* ids = io.ids ? io.ids : d_ids_;
      queue(kArgmax, [&] { return cuda::argmax_rows(logits_, c_.vocab_size, n_out, c_.vocab_size, ids, stream_), true; });
      if (io.copy_out)
        MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_ids_, ids, (size_t)n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    } else if (out == Output::Logits) {
      MERLIN_CUDA_CHECK(cudaMemcpyAsync(h_logits_, logits_, (size_t)n_out * c_.vocab_size * sizeof(float),
                                        cudaMemcpyDeviceToHost, stream_));
    }
  }
}

}  // namespace merlin::cuda_backend_detail
