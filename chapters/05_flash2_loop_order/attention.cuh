// Chapter 05: FlashAttention-2 loop order. The query loop moves to the grid; O stays on chip.
//
// FlashAttention-2 (Dao 2023), section 3.1-3.2: one thread block per (query block i, batch, head),
// and the loop over key blocks inside it:
//
//   Q_i -> shared memory, once
//   o_acc = 0, l = 0, m = -inf                                on chip, for the whole loop
//   for each block of keys j:             K_j, V_j -> shared memory
//     S_ij = scale * Q_i K_j^T                                shared memory
//     m_new = max(m, rowmax(S_ij)),  P = exp(S_ij - m_new)    one exp per score
//     l = exp(m - m_new) l + rowsum(P)
//     o_acc = exp(m - m_new) o_acc + P V_j                    registers; no division yet
//     m = m_new
//   O_i = o_acc / l, LSE_i = m + log(l)                       written once
//
// Against chapter 04: Q_i and O_i cross device memory once instead of once per key block; the
// division by l happens once at the end instead of at every step; and there are
// batch * heads * seqlen_q / kBlockM independent blocks instead of batch * heads, enough to fill
// the GPU even at batch 1.
//
// Shared memory of one block (floats), kBlockM = Br query rows, kBlockN = Bc keys, d = head_dim:
//
//   q_tile  [Br][d]        the query block i
//   k_tile  [Bc][d + 1]    the key block j, padded (see kPad)
//   v_tile  [Bc][d]        the value block j
//   s_tile  [Br][Bc + 1]   scores, then probabilities, padded
//   3 x [Br] running max, running sum, and rescale factor of each row
//
// Thread mapping (kThreads = 128): for S, thread t computes elements t, t + 128, ... of the Br x Bc
// tile in row-major order; for the row statistics, thread r < Br owns row r; for O, thread t owns
// elements t, t + 128, ... of the Br x d tile of O_i, and keeps them in registers (o_acc).
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch05 {

using attn::AttentionShape;

constexpr int kThreads = 128;
// FlashAttention-1 sizes its blocks from the shared memory M (in floats): Bc = M / (4 d) so that
// Q_i, K_j, V_j and O_i fit, Br = min(Bc, d). With M = 48 KB = 12288 floats that is 48 for d = 64
// and 24 for d = 128; we take the power of two below (32 and 16), which divides evenly among 128
// threads, and spend the leftover room on keeping S_ij in shared memory as well:
//   d =  64: 32*64 + 32*65 + 32*64 + 32*33 + 3*32 floats = 29312 bytes
//   d = 128: 16*128 + 16*129 + 16*128 + 16*17 + 3*16 floats = 25920 bytes
template <int kHeadDim>
struct Tile {
  static constexpr int kBlockN = kHeadDim == 64 ? 32 : 16;  // Bc: keys per block
  static constexpr int kBlockM = kBlockN;                   // Br = min(Bc, d) = Bc here
};
// Shared memory has 32 banks of 4 bytes. Threads of a warp read k_tile[key][c] for 32 different
// keys at the same c; with rows of d floats (a multiple of 32) all 32 reads hit one bank and run
// one after another. One float of padding per row shifts each row by one bank: 32 banks, 1 pass.
constexpr int kPad = 1;

// ---------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------

// exp(from - to), or 0 when `from` is -inf (a row that has seen no key yet): never exp(NaN).
__device__ float rescale(float from, float to) {
  return from == -INFINITY ? 0.0f : expf(from - to);
}

// Copies rows [row0, row0 + kRows) of a [rows_total][kHeadDim] matrix into a shared tile with
// rows of kHeadDim + pad floats; rows past the end become zeros (partial last block).
template <int kRows, int kHeadDim, int kRowPad>
__device__ void load_tile(float* tile, const float* src, int row0, int rows_total) {
  for (int e = threadIdx.x; e < kRows * kHeadDim; e += kThreads) {
    const int r = e / kHeadDim, c = e % kHeadDim;
    tile[r * (kHeadDim + kRowPad) + c] =
        row0 + r < rows_total ? src[int64_t(row0 + r) * kHeadDim + c] : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

// Block b handles query block b % num_q_blocks of (batch, head) = b / num_q_blocks. Neighbouring
// blocks share a head, so they read the same K and V at about the same time (L2 hits). A 1-D grid
// holds up to 2^31 - 1 blocks: batch * heads may exceed gridDim.y's 65535.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    flash2_kernel(const float* q, const float* k, const float* v, float* o, float* lse,
                  AttentionShape shape, float scale) {
  constexpr int kBlockM = Tile<kHeadDim>::kBlockM, kBlockN = Tile<kHeadDim>::kBlockN;
  constexpr int kOPerThread = kBlockM * kHeadDim / kThreads;
  static_assert(kBlockM * kHeadDim % kThreads == 0, "O tile must divide evenly among threads");
  __shared__ float q_tile[kBlockM * kHeadDim];
  __shared__ float k_tile[kBlockN * (kHeadDim + kPad)];
  __shared__ float v_tile[kBlockN * kHeadDim];
  __shared__ float s_tile[kBlockM * (kBlockN + kPad)];
  __shared__ float row_max[kBlockM];     // m
  __shared__ float row_sum[kBlockM];     // l
  __shared__ float old_weight[kBlockM];  // exp(m - m_new): rescales o_acc

  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const int q_block = int(blockIdx.x % num_q_blocks);
  const int64_t batch_head = blockIdx.x / num_q_blocks;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();
  const int64_t q_row0 = batch_head * shape.seqlen_q;  // first row of this head in O, LSE
  const float* q_head = q + q_row0 * kHeadDim;
  const float* k_head = k + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  const float* v_head = v + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  float* o_head = o + q_row0 * kHeadDim;

  const int q_start = q_block * kBlockM;
  load_tile<kBlockM, kHeadDim, 0>(q_tile, q_head, q_start, shape.seqlen_q);
  if (threadIdx.x < kBlockM) {
    row_max[threadIdx.x] = -INFINITY;
    row_sum[threadIdx.x] = 0.0f;
  }
  float o_acc[kOPerThread] = {};

  const int num_kv_blocks = (shape.seqlen_k + kBlockN - 1) / kBlockN;
  for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
    const int kv_start = kv_block * kBlockN;
    load_tile<kBlockN, kHeadDim, kPad>(k_tile, k_head, kv_start, shape.seqlen_k);
    load_tile<kBlockN, kHeadDim, 0>(v_tile, v_head, kv_start, shape.seqlen_k);
    __syncthreads();

    // S_ij = scale * Q_i K_j^T, with keys past the end and keys the causal mask hides at -inf.
    for (int e = threadIdx.x; e < kBlockM * kBlockN; e += kThreads) {
      const int r = e / kBlockN, c = e % kBlockN;
      float dot = 0.0f;
      for (int d = 0; d < kHeadDim; ++d)
        dot += q_tile[r * kHeadDim + d] * k_tile[c * (kHeadDim + kPad) + d];
      const int query = q_start + r, key = kv_start + c;
      const bool visible =
          key < shape.seqlen_k && (!shape.causal || key <= query + shape.causal_offset());
      s_tile[r * (kBlockN + kPad) + c] = visible ? scale * dot : -INFINITY;
    }
    __syncthreads();

    // Row statistics of this block, merged into the running ones on chip.
    if (threadIdx.x < kBlockM) {
      const int r = threadIdx.x;
      float* s_row = s_tile + r * (kBlockN + kPad);
      float block_max = -INFINITY;
      for (int c = 0; c < kBlockN; ++c) block_max = fmaxf(block_max, s_row[c]);
      const float m_old = row_max[r];
      const float m_new = fmaxf(m_old, block_max);
      float block_sum = 0.0f;
      for (int c = 0; c < kBlockN; ++c) {
        s_row[c] = rescale(s_row[c], m_new);  // P = exp(S - m_new); 0 where masked
        block_sum += s_row[c];
      }
      old_weight[r] = rescale(m_old, m_new);
      row_max[r] = m_new;
      row_sum[r] = row_sum[r] * old_weight[r] + block_sum;
    }
    __syncthreads();

    // o_acc = old_weight * o_acc + P V_j, in registers (the unrolled loop keeps o_acc there).
#pragma unroll
    for (int i = 0; i < kOPerThread; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int r = e / kHeadDim, c = e % kHeadDim;
      float pv = 0.0f;
      for (int j = 0; j < kBlockN; ++j)
        pv += s_tile[r * (kBlockN + kPad) + j] * v_tile[j * kHeadDim + c];
      o_acc[i] = old_weight[r] * o_acc[i] + pv;
    }
    __syncthreads();  // the tiles are overwritten by the next key block
  }

  // The deferred division: O_i = o_acc / l, once. A row that saw no key has l = 0 and outputs 0.
#pragma unroll
  for (int i = 0; i < kOPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int r = e / kHeadDim, c = e % kHeadDim;
    if (q_start + r >= shape.seqlen_q) continue;
    const float l = row_sum[r];
    o_head[int64_t(q_start + r) * kHeadDim + c] = l > 0.0f ? o_acc[i] / l : 0.0f;
    if (c == 0) lse[q_row0 + q_start + r] = l > 0.0f ? row_max[r] + logf(l) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

// Nothing: m and l now live in shared memory for the whole loop.
inline size_t workspace_bytes(const AttentionShape&) { return 0; }

template <int kHeadDim>
void launch_for_head_dim(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  const int64_t num_q_blocks =
      (shape.seqlen_q + Tile<kHeadDim>::kBlockM - 1) / Tile<kHeadDim>::kBlockM;
  const unsigned blocks = unsigned(num_q_blocks * shape.batch * shape.heads_q);
  flash2_kernel<kHeadDim><<<blocks, kThreads, 0, stream>>>(
      static_cast<const float*>(params.q), static_cast<const float*>(params.k),
      static_cast<const float*>(params.v), static_cast<float*>(params.o), params.lse, shape,
      shape.softmax_scale());
  CUDA_CHECK_LAUNCH();
}

inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::ForwardChapter chapter() {
  return {"05_flash2_loop_order",
          "FlashAttention-2 loop order: one block per query block, key loop inside, O, m, l on "
          "chip, one division at the end (fp32)",
          attn::DType::kF32,
          {64, 128},
          50,
          /*survives_large_logits=*/true,
          workspace_bytes,
          "",
          launch};
}

}  // namespace ch05
