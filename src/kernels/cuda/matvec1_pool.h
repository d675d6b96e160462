// The pooled twins of the lean one-token RoPE instance (mv1_kernel's Run = kRunPool, pooled_walk in
// matvec1_kernel.cuh), built in their own translation unit (matvec1_pool.cu); matvec1.cu launches them.
#pragma once
#include <cstdint>

namespace merlin::cuda {

// Kernel attributes and occupancy of the twins; called by init_matvec1_kernels.
void init_matvec1_pool_kernels();
// The twin for weights of format f with exact rounds or not (its host stub, a mv1_kernel of the same
// parameter type as matvec1.cu's), or nullptr where there is none (TQ2_0).
const void* matvec1_pool_kernel(int f, bool exact);
// Its resident CTAs per SM for rows of length k.
int matvec1_pool_resident(int f, bool exact, int64_t k);

}  // namespace merlin::cuda
