// CpuBackend's attention (cpu_backend.cpp describes the backend): RoPE and the K/V cache write, then per token
// group and head the scores over the paged cache (the score kernel on strided K rows), the softmax and the V sums.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime/cpu_backend_impl.h"

namespace merlin::cpu_backend_detail {

void CpuBackend::attention_block(int layer, const Batch& batch) {
  const LayerWeights& w = m_.layer(layer);
  const int64_t n = (int64_t)batch.size(), kv_dim = c_.kv_dim(), hd = c_.head_dim();
  matmul_rows([&](int64_t t, float* out) { kt_.rmsnorm(&x_[t * c_.dim], w.attn_norm.data(), c_.dim, c_.norm_eps, out); },
              xn_.data(), n, c_.dim, {{&w.wq, q_.data()}, {&w.wk, k_.data()}, {&w.wv, v_.data()}});
  // Work items: groups of up to kAttnGroup consecutive batch tokens of one sequence, times a range of heads.
  // A group of several tokens (prefill) takes one head per item. A lone token (decode) takes as many heads as
  // leave about eight items per thread: the heads of one position share its cached rows, so a many-sequence
  // step reads each block's rows once, in order, for all its heads instead of one head's slice at a time.
  std::vector<int64_t>& starts = group_starts_;
  starts.clear();
  for (int64_t t = 0; t < n; ++t)
    if (starts.empty() || t - starts.back() == kAttnGroup || batch.seq[t] != batch.seq[starts.back()]) starts.push_back(t);
  const int64_t n_groups = (int64_t)starts.size();
  starts.push_back(n);
  const int64_t per_item = std::clamp<int64_t>(n_groups * c_.n_heads / (8 * pool_.size()), 1, c_.n_heads);
  attn_items_.clear();
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t step = starts[g + 1] - starts[g] == 1 ? per_item : 1;
    for (int64_t h = 0; h < c_.n_heads; h += step)
      attn_items_.push_back({g, h, std::min<int64_t>(c_.n_heads, h + step)});
  }
  // Head-major: a thread's consecutive items share a head, so that head's K/V slice is read from cache by each
  // of its groups in turn. Group-major, every head's slice (all of a layer's K/V: 49 MB for 24 heads of 128 at
  // 4000 positions in F16) was touched between two uses of one slice, which overflows the L3 and made long-
  // context prefill DRAM bound. Items are independent, so the order changes no value.
  std::stable_sort(attn_items_.begin(), attn_items_.end(),
                   [](const AttnItem& a, const AttnItem& b) { return a.h0 < b.h0; });
  // RoPE of q and k and the K/V cache writes, tokens spread over the threads; with an F16 cache k is rotated
  // and converted in one pass.
  const size_t cs_len = rope_cs_.size() / pool_.size();
  auto rope_and_store = [&](int thread, int64_t t0, int64_t t1) {
    float* cs = &rope_cs_[(size_t)thread * cs_len];
    for (int64_t t = t0; t < t1; ++t) {
      float* k = &k_[t * kv_dim];
      uint8_t* k_row = k_at(layer, batch.seq[t], batch.pos[t]);
      // One angle table per position for q and k (the cos/sin cost more than the rotations).
      kernels::rope_angles(c_.rot_dims(), batch.pos[t], c_.rope_theta, cs);
      kt_.rope(&q_[t * q_dim_], c_.n_heads, hd, c_.rot_dims(), cs, nullptr);
      if (kv_type_ == DType::F16) {
        kt_.rope(k, c_.n_kv_heads, hd, c_.rot_dims(), cs, reinterpret_cast<uint16_t*>(k_row));
      } else {
        kt_.rope(k, c_.n_kv_heads, hd, c_.rot_dims(), cs, nullptr);
        store_kv_row(k, k_row);
      }
      store_kv_row(&v_[t * kv_dim], v_at(layer, batch.seq[t], batch.pos[t]));
    }
  };
  pool_.for_chunks(n, std::max<int64_t>(4, (n + 2 * pool_.size() - 1) / (2 * pool_.size())), rope_and_store);
  // One item at a time: an item's cost grows with its tokens' positions, so equal counts are not equal work.
  pool_.for_chunks((int64_t)attn_items_.size(), 1, [&](int thread, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const AttnItem& it = attn_items_[(size_t)i];
      attend(layer, batch, starts[it.group], starts[it.group + 1] - starts[it.group], it.h0, it.h1, thread);
    }
  });
  matmul(att_.data(), n, q_dim_, {{&w.wo, tmp_.data()}});
  kt_.add(x_.data(), tmp_.data(), x_.data(), n * c_.dim);
}

void CpuBackend::store_kv_row(const float* src, uint8_t* dst) {
  const int64_t n = c_.kv_dim();
  switch (kv_type_) {
    case DType::F32: std::memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case DType::F16: kt_.to_f16(src, reinterpret_cast<uint16_t*>(dst), n); break;
    case DType::Q8_0: kt_.quantize_q8_0(src, dst, n); break;
    default: kernels::quant_quantize_row(kv_type_, src, dst, n); break;
  }
}

// Attention of head `head` for batch tokens [t0, t0 + nt), all of one sequence. Their scores come from one
// score-kernel call per K block over the positions up to the last token's (a token's extra scores, past its
// own position, are ignored); each score is its own dot product computed by the batch-invariant kernel, so
// grouping changes no value.
void CpuBackend::attend(int layer, const Batch& batch, int64_t t0, int64_t nt, int64_t h0, int64_t h1, int thread) {
  const int64_t hd = c_.head_dim(), nh = h1 - h0;
  const int seq = batch.seq[t0];
  int n_pos = 0;
  for (int64_t i = 0; i < nt; ++i) n_pos = std::max(n_pos, batch.pos[t0 + i] + 1);
  // Scores of head h0 + j, token i: row j * nt + i.
  float* scores = &scores_[(size_t)thread * attn_slots_ * n_ctx_];
  auto q_of = [&](int64_t j, int64_t i) { return &q_[(t0 + i) * q_dim_ + (h0 + j) * hd]; };

  // The group's q rows of each head in the score kernel's activation format: head j's at x + j * x_head.
  const uint8_t* x = reinterpret_cast<const uint8_t*>(q_of(0, 0));
  size_t x_bytes = (size_t)q_dim_ * sizeof(float), x_head = (size_t)hd * sizeof(float);
  if (kv_type_ == DType::F16) {
    float* qr = &qconv_[(size_t)thread * attn_slots_ * hd];
    for (int64_t j = 0; j < nh; ++j)
      for (int64_t i = 0; i < nt; ++i) kt_.round_f16(q_of(j, i), qr + (j * nt + i) * hd, hd);
    x = reinterpret_cast<const uint8_t*>(qr);
    x_bytes = (size_t)hd * sizeof(float);
    x_head = (size_t)nt * x_bytes;
  } else if (kv_type_ != DType::F32) {
    x_bytes = dtype_row_bytes(score_kernel_->act_type, (uint64_t)hd);
    x_head = (size_t)nt * x_bytes;
    uint8_t* qa = &qact_[(size_t)thread * (qact_.size() / pool_.size())];
    for (int64_t j = 0; j < nh; ++j)
      for (int64_t i = 0; i < nt; ++i) score_kernel_->quantize_act(q_of(j, i), 1, hd, qa + (j * nt + i) * x_bytes);
    x = qa;
  }
  // Block by block through the sequence's table, every head of the item on a block before the next.
  const std::vector<int32_t>& table = tables_[(size_t)seq];
  const size_t block_bytes = (size_t)block_size_ * kv_row_bytes_;
  const uint8_t* k_layer = k_cache_[layer];
  for (int p0 = 0; p0 < n_pos; p0 += block_size_) {
    const int n = std::min(block_size_, n_pos - p0);
    const uint8_t* k0 = k_layer + (size_t)table[(size_t)(p0 / block_size_)] * block_bytes;
    // F16: the same bits through the kernel shaped for a block of positions (scores_f16).
    const auto rows = kv_type_ == DType::F16 ? kt_.scores_f16 : score_kernel_->rows;
    // What the next block of this loop (or, after the last, the value pass's first) reads, one head slice at a
    // time, requested while this block is computed.
    const int p_next = p0 + block_size_;
    const uint8_t* next = p_next < n_pos ? k_layer + (size_t)table[(size_t)(p_next / block_size_)] * block_bytes
                                         : v_cache_[layer] + (size_t)table[0] * block_bytes;
    const int n_next = p_next < n_pos ? std::min(block_size_, n_pos - p_next) : std::min(block_size_, n_pos);
    for (int64_t j = 0; j < nh; ++j) {
      if (prefetch_) prefetch_slice(next + kv_head_offset(h0 + j), n_next);
      rows(k0 + kv_head_offset(h0 + j), kv_row_bytes_, 0, n, x + j * x_head, x_bytes, nt, hd,
           scores + j * nt * n_ctx_ + p0, n_ctx_);
    }
  }
  weigh_values(layer, batch, t0, nt, h0, h1, scores, thread);
}

// For each token i of the group: out_i = softmax(scores_i / sqrt(hd)) · V over its positions [0, pos_i].
// With an F16 or Q8_0 cache the positions all tokens share are summed for the whole group at once (each V row
// is widened or dequantized once), then each token's own positions follow; per output element that is the same
// sequence of multiply-adds in position order as token by token.
void CpuBackend::weigh_values(int layer, const Batch& batch, int64_t t0, int64_t nt, int64_t h0, int64_t h1,
                              float* scores, int thread) {
  const int64_t hd = c_.head_dim(), nh = h1 - h0;
  const float scale = 1.0f / std::sqrt((float)hd);
  int n_shared = n_ctx_, n_all = 0;
  for (int64_t j = 0; j < nh; ++j)
    for (int64_t i = 0; i < nt; ++i) {
      const int n_pos = batch.pos[t0 + i] + 1;
      float* sc = scores + (j * nt + i) * n_ctx_;
      for (int p = 0; p < n_pos; ++p) sc[p] *= scale;
      kt_.softmax(sc, n_pos);
      if (kv_type_ == DType::F16) kt_.round_f16(sc, sc, n_pos);  // the weights llama.cpp applies to F16 V
      float* out = &att_[(t0 + i) * q_dim_ + (h0 + j) * hd];
      std::fill(out, out + hd, 0.0f);
      n_shared = std::min(n_shared, n_pos);
      n_all = std::max(n_all, n_pos);
    }
  const std::vector<int32_t>& table = tables_[(size_t)batch.seq[t0]];
  const size_t block_bytes = (size_t)block_size_ * kv_row_bytes_;
  const uint8_t* v_layer = v_cache_[layer];
  const size_t ldv = kv_row_bytes_ / sizeof(uint16_t);
  // A decode token's heads (one K/V head each) read the same V rows: one call per block sums them all, a row's
  // FMA chains of every head interleaved (per element the same operations in position order as head by head).
  const bool heads_at_once = kv_type_ == DType::F16 && nt == 1 && nh > 1 && c_.n_heads == c_.n_kv_heads;
  for (int p0 = 0; p0 < n_all; p0 += block_size_) {
    const int n = std::min(block_size_, n_all - p0);
    const uint8_t* v_block = v_layer + (size_t)table[(size_t)(p0 / block_size_)] * block_bytes;
    const int p_next = p0 + block_size_;
    const uint8_t* v_next =
        p_next < n_all ? v_layer + (size_t)table[(size_t)(p_next / block_size_)] * block_bytes : nullptr;
    const int n_next = std::min(block_size_, n_all - p_next);
    if (heads_at_once) {
      if (prefetch_ && v_next != nullptr)
        for (int64_t j = 0; j < nh; ++j) prefetch_slice(v_next + kv_head_offset(h0 + j), n_next);
      kt_.axpy_f16_heads(scores + p0, (size_t)n_ctx_, nh,
                         reinterpret_cast<const uint16_t*>(v_block + kv_head_offset(h0)), ldv, n,
                         &att_[t0 * q_dim_ + h0 * hd], hd);
      continue;
    }
    for (int64_t j = 0; j < nh; ++j) {
      const int64_t head = h0 + j;
      if (prefetch_ && v_next != nullptr) prefetch_slice(v_next + kv_head_offset(head), n_next);
      const uint8_t* v0 = v_block + kv_head_offset(head);
      const float* sc = scores + j * nt * n_ctx_;
      int own = 0;  // first row of the block that is not shared by the whole group
      if (kv_type_ == DType::F16) {
        own = std::clamp(n_shared - p0, 0, n);
        kt_.axpy_f16_rows(sc + p0, (size_t)n_ctx_, nt, reinterpret_cast<const uint16_t*>(v0), ldv, own,
                          &att_[t0 * q_dim_ + head * hd], (size_t)q_dim_, hd);
      } else if (kv_type_ == DType::Q8_0) {
        own = std::clamp(n_shared - p0, 0, n);
        kt_.axpy_q8_0_rows(sc + p0, (size_t)n_ctx_, nt, v0, kv_row_bytes_, own, &att_[t0 * q_dim_ + head * hd],
                           (size_t)q_dim_, hd);
      }
      for (int64_t i = 0; i < nt; ++i) {
        const int end = std::min(n, batch.pos[t0 + i] + 1 - p0);
        if (end > own)
          accumulate_values(v0 + (size_t)own * kv_row_bytes_, sc + i * n_ctx_ + p0 + own, end - own,
                            &att_[(t0 + i) * q_dim_ + head * hd], thread);
      }
    }
  }
}

// out += sum_p w[p] * V row p, for n consecutive rows of one block (in position order).
void CpuBackend::accumulate_values(const uint8_t* v0, const float* w, int n, float* out, int thread) {
  const int64_t hd = c_.head_dim();
  if (kv_type_ == DType::F16) {  // w is already rounded to f16 values
    kt_.axpy_f16_rows(w, 0, 1, reinterpret_cast<const uint16_t*>(v0), kv_row_bytes_ / sizeof(uint16_t), n, out, 0, hd);
    return;
  }
  if (kv_type_ == DType::Q8_0) {
    kt_.axpy_q8_0_rows(w, 0, 1, v0, kv_row_bytes_, n, out, 0, hd);
    return;
  }
  for (int p = 0; p < n; ++p) {
    const uint8_t* v = v0 + (size_t)p * kv_row_bytes_;
    switch (kv_type_) {
      case DType::F32: kt_.axpy(w[p], reinterpret_cast<const float*>(v), out, hd); break;
      default: {
        float* row = &vrow_[(size_t)thread * hd];
        kernels::dequantize_row(kv_type_, v, row, hd);
        kt_.axpy(w[p], row, out, hd);
      }
    }
  }
}

}  // namespace merlin::cpu_backend_detail
