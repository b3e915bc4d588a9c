// Chapter 15: the backward pass. P is recomputed from the saved log-sum-exp; it is never stored.
//
// FlashAttention-2 (Dao 2023), Algorithm 2. The forward pass (chapter 05) wrote O and one number
// per query row, LSE_i = m_i + log(l_i). That is all the backward pass needs to rebuild any block
// of P = softmax(scale Q K^T) exactly, with one exp per score, so the seqlen_q x seqlen_k matrix
// never goes to device memory:
//
//   pre-pass, per query row i:  D_i = rowsum(dO_i * O_i)  (dQ = 0 by a memset)  device memory
//   block (j, batch, kv head):  K_j, V_j -> shared memory, once
//     dK_j = 0, dV_j = 0                                       registers, for the whole loop
//     for each query head of the group, for each query block i that sees a key of block j:
//       Q_i, dO_i, LSE_i, D_i -> shared memory
//       S     = scale * Q_i K_j^T                              recomputed, as in the forward pass
//       P     = exp(S - LSE_i)                                 final softmax values; 0 where masked
//       dP    = dO_i V_j^T
//       dS    = P * (dP - D_i)                                 elementwise
//       dV_j += P^T dO_i
//       dK_j += scale * dS^T Q_i
//       dQ_i += scale * dS K_j                                 atomicAdd into device memory
//     dK_j, dV_j -> device memory, once
//
// The loop order is chapter 05's turned around: the grid runs over key blocks and the loop over
// query blocks, because dK_j and dV_j are sums over every query (and every query head of a GQA
// group), so one block can own them on chip and write them once. dQ_i is a sum over every key
// block, which lives in other thread blocks: those add their shares into device memory, and the
// adds have to be atomic.
//
// What stays on chip: K_j, V_j (shared memory) and dK_j, dV_j (registers), for the whole loop.
// What is recomputed: S and P, one block at a time (one exp per score; no max and no sum, LSE
// holds both). What is saved from the forward pass: O and LSE; the pre-pass adds D, one float per
// row, in the workspace.
//
// Shared memory of one block (floats), kBlockM = Br query rows, kBlockN = Bc keys, d = head_dim:
//
//   k_tile     [Bc][d + 1]   the key block j, loaded once         (padded: see kPad)
//   v_tile     [Bc][d + 1]   the value block j, loaded once
//   q_tile     [Br][d + 1]   the query block i
//   dout_tile  [Br][d + 1]   dO_i
//   p_tile     [Br][Bc]      P of this pair of blocks
//   ds_tile    [Br][Bc]      dS of this pair of blocks
//   2 x [Br]                 LSE_i and D_i
//
// Thread mapping (kThreads = 128). Every tile a thread computes, [rows][width], is split the same
// way: thread t owns column t % width in rows t / width, t / width + 128 / width, ...; a warp
// covers 32 neighbouring columns of one row (two rows of 16 for S at d = 128). The tiles are
// S and dP ([Br][Bc], width Bc), dK_j and dV_j ([Bc][d], width d, kept in registers for the whole
// loop) and this block's share of dQ_i ([Br][d], width d). A thread's elements share their
// column, so an operand that belongs to the column is loaded from shared memory once for all.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch15 {

using attn::AttentionShape;

constexpr int kThreads = 128;
constexpr int kWarpSize = 32;
// Chapter 05's block sizes (32 at d = 64, 16 at d = 128). The backward pass keeps four [rows][d]
// tiles where the forward kept three (dO_i joins Q_i, K_j, V_j), and they still fit the 48 KB of
// static shared memory that every GPU gives a block:
//   d =  64: 4*32*65 + 2*32*32 + 2*32 floats = 41728 bytes
//   d = 128: 4*16*129 + 2*16*16 + 2*16 floats = 35200 bytes
// Bc = 32 at d = 128 would take 53760 bytes with Br = 16.
template <int kHeadDim>
struct Tile {
  static constexpr int kBlockN = kHeadDim == 64 ? 32 : 16;  // Bc: keys per block
  static constexpr int kBlockM = kBlockN;                   // Br: query rows per block
};
// Shared memory has 32 banks of 4 bytes. For S and dP, the threads of a warp read k_tile[key][c]
// (and v_tile) for 32 different keys at the same c; with rows of d floats (a multiple of 32) all 32
// reads would hit one bank and run one after another. One float of padding per row shifts each row
// by one bank: 32 banks, 1 pass. q_tile and dout_tile are padded for the same reason at d = 128,
// where a warp reads two rows of them at once. Reads along a row (the dK, dV and dQ products) are
// consecutive either way.
constexpr int kPad = 1;

// ---------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------

// Copies rows [row0, row0 + kRows) of a [rows_total][kHeadDim] matrix into a shared tile with
// rows of kHeadDim + kPad floats; rows past the end become zeros (partial last block).
template <int kRows, int kHeadDim>
__device__ void load_tile(float* tile, const float* src, int row0, int rows_total) {
  for (int e = threadIdx.x; e < kRows * kHeadDim; e += kThreads) {
    const int r = e / kHeadDim, c = e % kHeadDim;
    tile[r * (kHeadDim + kPad) + c] =
        row0 + r < rows_total ? src[int64_t(row0 + r) * kHeadDim + c] : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

// The pre-pass: D_i = dO_i . O_i, one warp per query row (lanes stride over the head dimension,
// then a butterfly of shuffles sums the 32 partial sums).
constexpr int kRowsPerDeltaBlock = kThreads / kWarpSize;

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    delta_kernel(const float* o, const float* dout, float* delta, int64_t rows) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerDeltaBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;  // the whole warp leaves: its shuffles below stay complete
  const int lane = threadIdx.x % kWarpSize;
  float sum = 0.0f;
  for (int c = lane; c < kHeadDim; c += kWarpSize)
    sum += dout[row * kHeadDim + c] * o[row * kHeadDim + c];
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[row] = sum;
}

// Block b handles key block b % num_kv_blocks of (batch, kv head) = b / num_kv_blocks. Neighbouring
// blocks share a kv head, so they read the same Q_i and dO_i at about the same time (L2 hits). A
// 1-D grid holds up to 2^31 - 1 blocks: batch * heads may exceed gridDim.y's 65535.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const float* q, const float* k, const float* v, const float* dout,
                    const float* lse, const float* delta, float* dq, float* dk, float* dv,
                    AttentionShape shape, float scale) {
  constexpr int kBlockM = Tile<kHeadDim>::kBlockM, kBlockN = Tile<kHeadDim>::kBlockN;
  constexpr int kStride = kHeadDim + kPad;  // floats per row of the four [rows][d] tiles
  // The shared thread mapping: thread t owns column t % width of rows t / width + i * kRowStep.
  constexpr int kScoreRowStep = kThreads / kBlockN;  // S, dP: [Br][Bc]
  constexpr int kScoresPerThread = kBlockM / kScoreRowStep;
  constexpr int kDimRowStep = kThreads / kHeadDim;  // dK, dV: [Bc][d]; dQ: [Br][d]
  constexpr int kKvPerThread = kBlockN / kDimRowStep;
  constexpr int kDqPerThread = kBlockM / kDimRowStep;
  static_assert(kThreads % kBlockN == 0 && kBlockM % kScoreRowStep == 0,
                "S tile must divide evenly among threads, a whole column each");
  static_assert(
      kThreads % kHeadDim == 0 && kBlockN % kDimRowStep == 0 && kBlockM % kDimRowStep == 0,
      "dK, dV and dQ tiles must divide evenly among threads, a whole column each");
  __shared__ float k_tile[kBlockN * kStride];
  __shared__ float v_tile[kBlockN * kStride];
  __shared__ float q_tile[kBlockM * kStride];
  __shared__ float dout_tile[kBlockM * kStride];
  __shared__ float p_tile[kBlockM * kBlockN];
  __shared__ float ds_tile[kBlockM * kBlockN];
  __shared__ float lse_tile[kBlockM];
  __shared__ float delta_tile[kBlockM];

  const int num_kv_blocks = (shape.seqlen_k + kBlockN - 1) / kBlockN;
  const int kv_block = int(blockIdx.x % num_kv_blocks);
  const int64_t batch_kv_head = blockIdx.x / num_kv_blocks;
  const int64_t batch = batch_kv_head / shape.heads_kv;
  const int kv_head = int(batch_kv_head % shape.heads_kv);
  const int64_t kv_row0 = batch_kv_head * shape.seqlen_k;  // first row of this head in K, V
  const int kv_start = kv_block * kBlockN;
  load_tile<kBlockN, kHeadDim>(k_tile, k + kv_row0 * kHeadDim, kv_start, shape.seqlen_k);
  load_tile<kBlockN, kHeadDim>(v_tile, v + kv_row0 * kHeadDim, kv_start, shape.seqlen_k);

  const int score_col = threadIdx.x % kBlockN, score_row0 = threadIdx.x / kBlockN;
  const int dim_col = threadIdx.x % kHeadDim, dim_row0 = threadIdx.x / kHeadDim;
  float dk_acc[kKvPerThread] = {};  // dK_j / scale, rows dim_row0 + i * kDimRowStep
  float dv_acc[kKvPerThread] = {};

  // Causal: the first query that sees key kv_start is kv_start - causal_offset (bottom-right
  // aligned), and it sees every later key of the block too. Query blocks before the one that holds
  // it see none of this block's keys: the loop starts there.
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const int first_q_block = shape.causal ? max(0, kv_start - shape.causal_offset()) / kBlockM : 0;
  const int group = shape.group_size();
  for (int g = 0; g < group; ++g) {
    const int64_t q_row0 = (batch * shape.heads_q + kv_head * group + g) * shape.seqlen_q;
    const float* q_head = q + q_row0 * kHeadDim;
    const float* dout_head = dout + q_row0 * kHeadDim;
    float* dq_head = dq + q_row0 * kHeadDim;

    for (int q_block = first_q_block; q_block < num_q_blocks; ++q_block) {
      const int q_start = q_block * kBlockM;
      load_tile<kBlockM, kHeadDim>(q_tile, q_head, q_start, shape.seqlen_q);
      load_tile<kBlockM, kHeadDim>(dout_tile, dout_head, q_start, shape.seqlen_q);
      if (threadIdx.x < kBlockM) {
        const int query = q_start + threadIdx.x;
        // Rows past the end get LSE = -inf, which makes their P and dS 0 below.
        lse_tile[threadIdx.x] = query < shape.seqlen_q ? lse[q_row0 + query] : -INFINITY;
        delta_tile[threadIdx.x] = query < shape.seqlen_q ? delta[q_row0 + query] : 0.0f;
      }
      __syncthreads();

      // S = Q_i K_j^T and dP = dO_i V_j^T in one pass over d: this thread's key is one column of
      // both, so its K and V elements are loaded once for all of its rows.
      float s[kScoresPerThread] = {}, dp[kScoresPerThread] = {};
      for (int c = 0; c < kHeadDim; ++c) {
        const float k_elem = k_tile[score_col * kStride + c];
        const float v_elem = v_tile[score_col * kStride + c];
#pragma unroll
        for (int i = 0; i < kScoresPerThread; ++i) {
          const int r = score_row0 + i * kScoreRowStep;
          s[i] += q_tile[r * kStride + c] * k_elem;
          dp[i] += dout_tile[r * kStride + c] * v_elem;
        }
      }
      // P = exp(scale * s - LSE), with s the unscaled Q K^T, is already the softmax (no max, no
      // sum). Masked scores, keys past the end, and rows that see no key (LSE = -inf: exp would be
      // of +inf) get P = 0, so dS = 0.
#pragma unroll
      for (int i = 0; i < kScoresPerThread; ++i) {
        const int r = score_row0 + i * kScoreRowStep;
        const int query = q_start + r, key = kv_start + score_col;
        const float row_lse = lse_tile[r];
        const bool visible = key < shape.seqlen_k && row_lse != -INFINITY &&
                             (!shape.causal || key <= query + shape.causal_offset());
        const float p = visible ? expf(scale * s[i] - row_lse) : 0.0f;
        p_tile[r * kBlockN + score_col] = p;
        ds_tile[r * kBlockN + score_col] = p * (dp[i] - delta_tile[r]);
      }
      __syncthreads();

      // dV_j += P^T dO_i and dK_j += dS^T Q_i (scale applied once, at the end), in registers. The
      // thread's elements share column dim_col: one dO and one Q element per query row serve all.
      for (int r = 0; r < kBlockM; ++r) {
        const float dout_elem = dout_tile[r * kStride + dim_col];
        const float q_elem = q_tile[r * kStride + dim_col];
#pragma unroll
        for (int i = 0; i < kKvPerThread; ++i) {
          const int key = dim_row0 + i * kDimRowStep;
          dv_acc[i] += p_tile[r * kBlockN + key] * dout_elem;
          dk_acc[i] += ds_tile[r * kBlockN + key] * q_elem;
        }
      }

      // This key block's share of dQ_i = scale dS K_j. Other blocks add the shares of the other key
      // blocks to the same rows at the same time: the add into device memory is atomic.
      float dq_part[kDqPerThread] = {};
      for (int key = 0; key < kBlockN; ++key) {
        const float k_elem = k_tile[key * kStride + dim_col];
#pragma unroll
        for (int i = 0; i < kDqPerThread; ++i)
          dq_part[i] += ds_tile[(dim_row0 + i * kDimRowStep) * kBlockN + key] * k_elem;
      }
#pragma unroll
      for (int i = 0; i < kDqPerThread; ++i) {
        const int query = q_start + dim_row0 + i * kDimRowStep;
        if (query < shape.seqlen_q)
          atomicAdd(dq_head + int64_t(query) * kHeadDim + dim_col, scale * dq_part[i]);
      }
      __syncthreads();  // the tiles are overwritten by the next query block
    }
  }

  // dK_j and dV_j, once. A key block that no query sees writes zeros.
  float* dk_head = dk + kv_row0 * kHeadDim;
  float* dv_head = dv + kv_row0 * kHeadDim;
#pragma unroll
  for (int i = 0; i < kKvPerThread; ++i) {
    const int key = kv_start + dim_row0 + i * kDimRowStep;
    if (key >= shape.seqlen_k) continue;
    dk_head[int64_t(key) * kHeadDim + dim_col] = scale * dk_acc[i];
    dv_head[int64_t(key) * kHeadDim + dim_col] = dv_acc[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

// D: one float per query row.
inline size_t workspace_bytes(const AttentionShape& shape) {
  return size_t(shape.lse_elements()) * sizeof(float);
}

template <int kHeadDim>
void launch_for_head_dim(const attn::BackwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  float* delta = static_cast<float*>(params.workspace);
  float* dq = static_cast<float*>(params.dq);
  // dQ is a sum of atomic adds from every key block: it starts at 0 (all-zero bits are 0.0f).
  CUDA_CHECK(cudaMemsetAsync(dq, 0, size_t(shape.q_elements()) * sizeof(float), stream));
  const int64_t rows = shape.lse_elements();
  const unsigned delta_blocks = unsigned((rows + kRowsPerDeltaBlock - 1) / kRowsPerDeltaBlock);
  delta_kernel<kHeadDim><<<delta_blocks, kThreads, 0, stream>>>(
      static_cast<const float*>(params.o), static_cast<const float*>(params.dout), delta, rows);
  CUDA_CHECK_LAUNCH();

  const int64_t num_kv_blocks =
      (shape.seqlen_k + Tile<kHeadDim>::kBlockN - 1) / Tile<kHeadDim>::kBlockN;
  const unsigned blocks = unsigned(num_kv_blocks * shape.batch * shape.heads_kv);
  backward_kernel<kHeadDim><<<blocks, kThreads, 0, stream>>>(
      static_cast<const float*>(params.q), static_cast<const float*>(params.k),
      static_cast<const float*>(params.v), static_cast<const float*>(params.dout), params.lse,
      delta, dq, static_cast<float*>(params.dk), static_cast<float*>(params.dv), shape,
      shape.softmax_scale());
  CUDA_CHECK_LAUNCH();
}

inline void launch(const attn::BackwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::BackwardChapter chapter() {
  return {"15_backward_recompute",
          "backward pass with recomputation: one block per key block, P rebuilt from the saved "
          "LSE, dK and dV on chip, dQ by atomic adds (fp32)",
          attn::DType::kF32,
          {64, 128},
          50,
          /*has_deterministic_mode=*/false,
          workspace_bytes,
          "D = rowsum(dO * O), one float per query row",
          launch};
}

}  // namespace ch15
