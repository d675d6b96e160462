// chain_advance (ops.h): the bookkeeping between the one-token steps of a decode loop, on the device.
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

__global__ void chain_advance_kernel(ChainState* st, int32_t* ids, cudaGraphConditionalHandle handle) {
  pdl_wait();  // the step's id is written by its last kernel
  const int32_t id = st->fused ? argmax_key_row(st->key) : st->token;
  const int i = st->i;
  ids[i] = id;
  st->i = i + 1;
  st->pos += 1;
  st->token = id < 0 ? 0 : id;
  st->key = 0ull;
  const bool more = i + 1 < st->k && id >= 0;
  if (more) st->cur = st->rows[i + 1];
  cudaGraphSetConditional(handle, more ? 1u : 0u);
}

}  // namespace

void chain_advance(ChainState* d_state, int32_t* d_ids, unsigned long long handle, Stream stream) {
  launch_pdl(chain_advance_kernel, dim3(1), dim3(1), 0, stream, d_state, d_ids,
             static_cast<cudaGraphConditionalHandle>(handle));
  check_launch("chain_advance");
}

}  // namespace merlin::cuda
