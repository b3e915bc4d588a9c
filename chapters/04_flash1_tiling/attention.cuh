// Chapter 04: FlashAttention-1 tiling. One kernel, and the score matrix never leaves the chip.
//
// Algorithm 1 of the FlashAttention paper (Dao et al. 2022), one thread block per (batch, head):
//
//   O = 0, l = 0, m = -inf                                   in device memory (O is the output)
//   for each block of keys j:             K_j, V_j -> shared memory      (outer loop)
//     for each block of queries i:        Q_i -> shared memory           (inner loop)
//       S_ij = scale * Q_i K_j^T                                          shared memory
//       m~ = rowmax(S_ij), P~ = exp(S_ij - m~), l~ = rowsum(P~)           chapter 03's state
//       m_new = max(m_i, m~),  l_new = exp(m_i - m_new) l_i + exp(m~ - m_new) l~   the merge rule
//       O_i = (l_i exp(m_i - m_new) O_i + exp(m~ - m_new) P~ V_j) / l_new  read, update, write
//       m_i = m_new, l_i = l_new                                          device memory
//
// Device-memory traffic per head: K and V once, but Q_i, O_i, m_i, l_i once per key block, i.e.
// about seqlen_k / kBlockN times: N^2 d / Bc = O(N^2 d^2 / M) elements for shared memory M (since
// Bc = M / 4d), instead of chapter 03's O(N^2) score matrix. The README measures both.
//
// Shared memory of one block (floats), kBlockM = Br query rows, kBlockN = Bc keys, d = head_dim:
//
//   q_tile  [Br][d]        the query block i
//   k_tile  [Bc][d + 1]    the key block j, padded (see kPad)
//   v_tile  [Bc][d]        the value block j
//   s_tile  [Br][Bc + 1]   scores, then probabilities, padded
//   2 x [Br] row weights for the update of O
//
// Thread mapping (kThreads = 128): for S, thread t computes elements t, t + 128, ... of the Br x Bc
// tile in row-major order; for the row statistics, thread r < Br owns row r; for O, thread t owns
// elements t, t + 128, ... of the Br x d tile of O_i.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch04 {

using attn::AttentionShape;

constexpr int kThreads = 128;
// FlashAttention-1 sizes its blocks from the shared memory M (in floats): Bc = M / (4 d) so that
// Q_i, K_j, V_j and O_i fit, Br = min(Bc, d). With M = 48 KB = 12288 floats that is 48 for d = 64
// and 24 for d = 128; we take the power of two below (32 and 16), which divides evenly among 128
// threads, and spend the leftover room on keeping S_ij in shared memory as well:
//   d =  64: 32*64 + 32*65 + 32*64 + 32*33 + 2*32 floats = 29184 bytes
//   d = 128: 16*128 + 16*129 + 16*128 + 16*17 + 2*16 floats = 25856 bytes
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

// Block b handles (batch, head) = (b / heads_q, b % heads_q): all of its queries and keys.
// row_max, row_sum: [batch * heads_q * seqlen_q] in device memory, like O.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    flash1_kernel(const float* q, const float* k, const float* v, float* o, float* lse,
                  float* row_max, float* row_sum, AttentionShape shape, float scale) {
  constexpr int kBlockM = Tile<kHeadDim>::kBlockM, kBlockN = Tile<kHeadDim>::kBlockN;
  __shared__ float q_tile[kBlockM * kHeadDim];
  __shared__ float k_tile[kBlockN * (kHeadDim + kPad)];
  __shared__ float v_tile[kBlockN * kHeadDim];
  __shared__ float s_tile[kBlockM * (kBlockN + kPad)];
  __shared__ float old_weight[kBlockM];  // l_i exp(m_i - m_new) / l_new
  __shared__ float new_weight[kBlockM];  // exp(m~ - m_new) / l_new

  const int64_t batch_head = blockIdx.x;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();
  const int64_t q_row0 = batch_head * shape.seqlen_q;  // first row of this head in O, LSE, m, l
  const float* q_head = q + q_row0 * kHeadDim;
  const float* k_head = k + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  const float* v_head = v + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  float* o_head = o + q_row0 * kHeadDim;

  // Line 2 of Algorithm 1: O = 0, l = 0, m = -inf in device memory.
  for (int64_t e = threadIdx.x; e < int64_t(shape.seqlen_q) * kHeadDim; e += kThreads)
    o_head[e] = 0.0f;
  for (int r = threadIdx.x; r < shape.seqlen_q; r += kThreads) {
    row_max[q_row0 + r] = -INFINITY;
    row_sum[q_row0 + r] = 0.0f;
  }
  __syncthreads();  // makes those writes visible to every thread of the block

  const int num_kv_blocks = (shape.seqlen_k + kBlockN - 1) / kBlockN;
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
    const int kv_start = kv_block * kBlockN;
    load_tile<kBlockN, kHeadDim, kPad>(k_tile, k_head, kv_start, shape.seqlen_k);
    load_tile<kBlockN, kHeadDim, 0>(v_tile, v_head, kv_start, shape.seqlen_k);

    for (int q_block = 0; q_block < num_q_blocks; ++q_block) {
      const int q_start = q_block * kBlockM;
      load_tile<kBlockM, kHeadDim, 0>(q_tile, q_head, q_start, shape.seqlen_q);
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

      // Row statistics of this block, merged into the running ones in device memory.
      if (threadIdx.x < kBlockM && q_start + int(threadIdx.x) < shape.seqlen_q) {
        const int r = threadIdx.x;
        float* s_row = s_tile + r * (kBlockN + kPad);
        float block_max = -INFINITY;
        for (int c = 0; c < kBlockN; ++c) block_max = fmaxf(block_max, s_row[c]);
        float block_sum = 0.0f;
        for (int c = 0; c < kBlockN; ++c) {
          s_row[c] = rescale(s_row[c], block_max);  // P~ = exp(S - m~); 0 where masked
          block_sum += s_row[c];
        }
        const int64_t row = q_row0 + q_start + r;
        const float m_old = row_max[row], l_old = row_sum[row];
        const float m_new = fmaxf(m_old, block_max);
        const float old_scale = rescale(m_old, m_new), new_scale = rescale(block_max, m_new);
        const float l_new = l_old * old_scale + block_sum * new_scale;
        const float inv_l = l_new > 0.0f ? 1.0f / l_new : 0.0f;  // 0: row has seen no key yet
        old_weight[r] = l_old * old_scale * inv_l;
        new_weight[r] = new_scale * inv_l;
        row_max[row] = m_new;
        row_sum[row] = l_new;
        if (kv_block == num_kv_blocks - 1)
          lse[row] = l_new > 0.0f ? m_new + logf(l_new) : -INFINITY;
      }
      __syncthreads();

      // O_i = old_weight * O_i + new_weight * P~ V_j, read from and written to device memory.
      for (int e = threadIdx.x; e < kBlockM * kHeadDim; e += kThreads) {
        const int r = e / kHeadDim, c = e % kHeadDim;
        if (q_start + r >= shape.seqlen_q) continue;
        float pv = 0.0f;
        for (int j = 0; j < kBlockN; ++j)
          pv += s_tile[r * (kBlockN + kPad) + j] * v_tile[j * kHeadDim + c];
        float* o_elem = o_head + int64_t(q_start + r) * kHeadDim + c;
        *o_elem = old_weight[r] * *o_elem + new_weight[r] * pv;
      }
      __syncthreads();  // q_tile and s_tile are overwritten by the next query block
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

// The running row max m and row sum l of Algorithm 1, one float each per query row.
inline size_t workspace_bytes(const AttentionShape& shape) {
  return 2 * sizeof(float) * size_t(shape.lse_elements());
}

template <int kHeadDim>
void launch_for_head_dim(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  float* row_max = static_cast<float*>(params.workspace);
  float* row_sum = row_max + shape.lse_elements();
  const unsigned blocks = unsigned(int64_t(shape.batch) * shape.heads_q);
  flash1_kernel<kHeadDim><<<blocks, kThreads, 0, stream>>>(
      static_cast<const float*>(params.q), static_cast<const float*>(params.k),
      static_cast<const float*>(params.v), static_cast<float*>(params.o), params.lse, row_max,
      row_sum, shape, shape.softmax_scale());
  CUDA_CHECK_LAUNCH();
}

inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::ForwardChapter chapter() {
  return {"04_flash1_tiling",
          "one fused kernel, FlashAttention-1 loop order: key blocks outside, query blocks inside, "
          "O, m, l updated in device memory (fp32)",
          attn::DType::kF32,
          {64, 128},
          50,
          /*survives_large_logits=*/true,
          workspace_bytes,
          "running row max m and row sum l",
          launch};
}

}  // namespace ch04
