// The forward pass that the harness runs on the GPU to make the inputs of a backward chapter: O and
// the row log-sum-exp for every head. The Eigen reference is far too slow for that at benchmark
// shapes (16 heads at seqlen 16384 is about a teraflop in double), so this plain kernel makes them,
// and the runner checks its output against the Eigen forward on the heads it samples. Nothing in
// here is a lesson: it is chapter 05's algorithm, reading and writing either element type.
#pragma once

#include <cuda_runtime_api.h>

#include "dtype.h"
#include "shape.h"

namespace attn {

// The head dims plain_forward supports.
bool plain_forward_supports(int head_dim);

// q, k, v, o in `dtype` and the layout of shape.h; o is rounded to `dtype`, lse is float (natural
// log, -inf for a row that sees no key, whose o is 0). Throws std::invalid_argument for a head dim
// it does not support.
void plain_forward(const AttentionShape& shape, DType dtype, const void* q, const void* k,
                   const void* v, void* o, float* lse, cudaStream_t stream);

}  // namespace attn
