// Batched decode loops (Backend::decode_greedy_batch): n sequences decoding greedily together run their steps in
// a device-side loop, as one sequence's steps do (cuda_backend.cpp, "decode loops"), so a 32-token step does not
// pay the host's wake-up, the graph launch and the input and id copies every step (docs/GPU.md, "Batched decode
// loops"). The loop graph: [state in] -> while (condition) { loop_unroll_ steps of n rows } -> [state out]; each
// step reads its tokens, positions and sequences from the BatchChainState (ops.h), its head writes the next
// step's tokens there, and the first layer's preparation does the bookkeeping (act.cu, batch_chain_step).
#include <algorithm>
#include <cstddef>

#include "kernels/cuda/cuda_backend.h"

namespace merlin::cuda_backend_detail {

void CudaBackend::decode_greedy_batch(std::span<const int32_t> tokens, std::span<const int32_t> pos,
                                      std::span<const int32_t> seqs, int n_steps, int64_t n_vocab, int32_t* ids) {
  const int n = (int)tokens.size();
  MERLIN_CHECK(pos.size() == tokens.size() && seqs.size() == tokens.size(), "decode_greedy_batch: ", n, " tokens, ",
               pos.size(), " positions, ", seqs.size(), " sequences");
  if (!loops_apply(false) || !h_bchain_ || n < 2 || n > cuda::kBatchChainRows || n > max_batch_ || n_steps < 2)
    return Backend::decode_greedy_batch(tokens, pos, seqs, n_steps, n_vocab, ids);
  MERLIN_CHECK(n_vocab == c_.vocab_size, "decode_greedy_batch: vocabulary of ", n_vocab, " tokens, the model has ",
               c_.vocab_size);
  const int max_pos = *std::max_element(pos.begin(), pos.end());
  std::vector<int32_t> cur(tokens.begin(), tokens.end());
  int done = 0;
  while (done < n_steps) {
    const int k = loop_length(max_pos + done, n_steps - done);  // the longest context's attention class
    int32_t* out = ids + (size_t)done * n;
    if (k > 0 && run_batch_loop(cur, pos, seqs, done, k, out)) {
      done += k;
    } else {  // one plain step
      Batch b;
      for (int r = 0; r < n; ++r) b.add(cur[(size_t)r], pos[(size_t)r] + done, seqs[(size_t)r], true);
      forward_greedy(b, n_vocab, out);
      ++done;
    }
    std::copy(ids + (size_t)(done - 1) * n, ids + (size_t)done * n, cur.begin());
  }
}

cudaGraphExec_t CudaBackend::batch_loop_graph(int n, int attn_class) {
  Loop& l = batch_loops_[{n, attn_class}];
  if (l.exec) return l.exec;
  const auto steps = [&](unsigned long long handle) {
    for (int u = 0; u < loop_unroll_; ++u) {  // k is a multiple of loop_unroll_ (loop_length)
      const cuda::PdlScope pdl;
      StepIo io;
      io.tokens = d_bchain_->tokens;
      io.pos = d_bchain_->pos[u & 1];
      io.seq = d_bchain_->seq;
      io.rows = d_bchain_->rows;
      io.ids = d_bchain_->tokens;  // the head's ids are the next step's tokens
      io.bchain = d_bchain_;
      enqueue_loop_step(n, Output::GreedyIds, io, handle, u, attn_class);
    }
  };
  // In: the state up to the ids (tokens, positions, sequences, rows, the step counters, k); out: all of it.
  const cudaGraphExec_t exec =
      build_loop(l, d_bchain_, h_bchain_, offsetof(cuda::BatchChainState, ids), sizeof(cuda::BatchChainState), steps,
                 "batched decode loops unavailable, one graph launch per step");
  if (!exec) batch_loops_.erase({n, attn_class});
  return exec;
}

bool CudaBackend::run_batch_loop(std::span<const int32_t> tokens, std::span<const int32_t> pos,
                                 std::span<const int32_t> seqs, int from, int k, int32_t* ids) {
  const int n = (int)tokens.size();
  for (int i = 0; i < k; ++i) {  // positions and blocks checked as for k steps of n rows
    Batch check;
    for (int r = 0; r < n; ++r) check.add(tokens[(size_t)r], pos[(size_t)r] + from + i, seqs[(size_t)r], true);
    validate(check);
  }
  const int cls = attn_class(*std::max_element(pos.begin(), pos.end()) + from);
  const bool first = batch_loops_.find({n, cls}) == batch_loops_.end();
  const cudaGraphExec_t exec = batch_loop_graph(n, cls);
  if (!exec) return false;
  cuda::BatchChainState& st = *h_bchain_;
  for (int r = 0; r < n; ++r) {
    st.tokens[r] = tokens[(size_t)r];
    st.pos[0][r] = pos[(size_t)r] + from;
    st.seq[r] = seqs[(size_t)r];
    st.rows[r] = r;
  }
  st.i_[0] = st.i_[1] = 0;
  st.k = k;
  const auto wall0 = std::chrono::steady_clock::now();
  launch_graph(exec);
  MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  // Step j's ids: recorded by step j + 1's preparation; the last step's are still the tokens.
  for (int j = 0; j < k; ++j) {
    const int32_t* step_ids = j + 1 < k ? st.ids[j] : st.tokens;
    std::copy(step_ids, step_ids + n, ids + (size_t)j * n);
  }
  if (!first) add_timing(k, wall0);
  return true;
}

}  // namespace merlin::cuda_backend_detail
