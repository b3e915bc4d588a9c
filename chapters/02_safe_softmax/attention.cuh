// Chapter 02: safe softmax. The same three kernels as chapter 01; the softmax subtracts the row
// max.
//
//   O = softmax(scale * Q K^T) V, row by row, for every (batch, head):
//
//   kernel 1  S = scale * Q K^T   one thread per element of S      writes S: [B, Hq, Sq, Sk]
//   kernel 2  P = softmax(S)      one warp per row of S, in place  reads S three times, writes P
//   kernel 3  O = P V             one thread per element of O      reads P and V
//
// softmax(s)_j = exp(s_j - m) / sum_k exp(s_k - m) for any m: the factor exp(-m) cancels. With
// m = max_k s_k every exponent is <= 0, so exp() lies in (0, 1] and cannot overflow, and the sum
// is at least 1 (the max itself contributes exp(0)) unless the row sees no key at all (then it is 0,
// and the row outputs 0). The price is one more pass over the row to find m. Chapter 03 folds that
// pass into the sum.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch02 {

using attn::AttentionShape;

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;
constexpr int kRowsPerSoftmaxBlock = kThreadsPerBlock / kWarpSize;  // one warp per row
constexpr unsigned kFullWarp = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------

// Sum over the 32 lanes of a warp: after 5 butterfly steps every lane holds the total.
__device__ float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kFullWarp, value, offset);
  return value;
}

// Max over the 32 lanes of a warp, the same way.
__device__ float warp_max(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(kFullWarp, value, offset));
  return value;
}

// ---------------------------------------------------------------------------------------------
// Kernel 1: S = scale * Q K^T, masked entries set to -inf
// ---------------------------------------------------------------------------------------------

// Thread `idx` computes S[row][key] where row = (batch * heads_q + head) * seqlen_q + query.
__global__ void scores_kernel(const float* q, const float* k, float* s, AttentionShape shape,
                              float scale) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rows = shape.lse_elements();
  if (idx >= rows * shape.seqlen_k) return;
  const int key = int(idx % shape.seqlen_k);
  const int64_t row = idx / shape.seqlen_k;
  const int query = int(row % shape.seqlen_q);
  const int64_t batch_head = row / shape.seqlen_q;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();

  const float* q_row = q + row * shape.head_dim;
  const float* k_row =
      k + ((batch * shape.heads_kv + kv_head) * shape.seqlen_k + key) * shape.head_dim;
  float dot = 0.0f;
  for (int d = 0; d < shape.head_dim; ++d) dot += q_row[d] * k_row[d];

  // Causal, bottom-right aligned: query i sees keys 0 .. i + (seqlen_k - seqlen_q).
  const bool visible = !shape.causal || key <= query + shape.causal_offset();
  s[idx] = visible ? scale * dot : -INFINITY;
}

// ---------------------------------------------------------------------------------------------
// Kernel 2: P = softmax(S), one warp per row, in place
// ---------------------------------------------------------------------------------------------

// Three passes over the row: its max, then sum exp(s - max), then write exp(s - max) / sum. Lanes
// take every 32nd element, so a warp reads 32 neighbouring floats at a time (one 128-byte
// transaction).
__global__ void softmax_kernel(float* s, float* lse, int64_t rows, int seqlen_k) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerSoftmaxBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  float* s_row = s + row * seqlen_k;

  float row_max = -INFINITY;
  for (int j = lane; j < seqlen_k; j += kWarpSize) row_max = fmaxf(row_max, s_row[j]);
  row_max = warp_max(row_max);
  // A row that sees no key has max -inf; shifting by 0 instead keeps exp(-inf - shift) = 0 rather
  // than exp(-inf + inf) = NaN, and the row sums to 0 and outputs 0.
  const float shift = row_max == -INFINITY ? 0.0f : row_max;

  float row_sum = 0.0f;
  for (int j = lane; j < seqlen_k; j += kWarpSize) row_sum += expf(s_row[j] - shift);
  row_sum = warp_sum(row_sum);

  const float inv_sum = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
  for (int j = lane; j < seqlen_k; j += kWarpSize) s_row[j] = expf(s_row[j] - shift) * inv_sum;
  // log sum exp(s) = max + log sum exp(s - max); -inf for a row that sees no key.
  if (lane == 0) lse[row] = shift + logf(row_sum);
}

// ---------------------------------------------------------------------------------------------
// Kernel 3: O = P V
// ---------------------------------------------------------------------------------------------

// Thread `idx` computes O[row][d]. Neighbouring threads take neighbouring d, so they read
// neighbouring elements of each V row, and the same P element (a broadcast).
__global__ void output_kernel(const float* p, const float* v, float* o, AttentionShape shape) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= shape.q_elements()) return;
  const int d = int(idx % shape.head_dim);
  const int64_t row = idx / shape.head_dim;
  const int64_t batch_head = row / shape.seqlen_q;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();

  const float* p_row = p + row * shape.seqlen_k;
  const float* v_col = v + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * shape.head_dim + d;
  float acc = 0.0f;
  for (int j = 0; j < shape.seqlen_k; ++j) acc += p_row[j] * v_col[int64_t(j) * shape.head_dim];
  o[idx] = acc;
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

inline unsigned blocks_for(int64_t threads, int per_block) {
  return unsigned((threads + per_block - 1) / per_block);
}

// The score matrix S (then P, in place): one float per (batch, head, query, key).
inline size_t workspace_bytes(const AttentionShape& shape) {
  return sizeof(float) * size_t(shape.lse_elements()) * shape.seqlen_k;
}

inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  const auto* q = static_cast<const float*>(params.q);
  const auto* k = static_cast<const float*>(params.k);
  const auto* v = static_cast<const float*>(params.v);
  auto* o = static_cast<float*>(params.o);
  auto* s = static_cast<float*>(params.workspace);
  const int64_t rows = shape.lse_elements();

  scores_kernel<<<blocks_for(rows * shape.seqlen_k, kThreadsPerBlock), kThreadsPerBlock, 0,
                  stream>>>(q, k, s, shape, shape.softmax_scale());
  CUDA_CHECK_LAUNCH();
  softmax_kernel<<<blocks_for(rows, kRowsPerSoftmaxBlock), kThreadsPerBlock, 0, stream>>>(
      s, params.lse, rows, shape.seqlen_k);
  CUDA_CHECK_LAUNCH();
  output_kernel<<<blocks_for(shape.q_elements(), kThreadsPerBlock), kThreadsPerBlock, 0, stream>>>(
      s, v, o, shape);
  CUDA_CHECK_LAUNCH();
}

inline attn::ForwardChapter chapter() {
  return {"02_safe_softmax",
          "chapter 01 with the row max subtracted before exp(): no overflow (fp32)",
          attn::DType::kF32,
          {},  // any head_dim: every loop over it is a plain loop
          50,
          /*survives_large_logits=*/true,
          workspace_bytes,
          "the score matrix S",
          launch};
}

}  // namespace ch02
