#include "plain_forward.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "cuda_check.h"

namespace attn {
namespace {

constexpr int kThreads = 128;
constexpr int kPad = 1;  // one float per key row: the 32 keys a warp reads sit in 32 banks

// Query rows and keys per block: Q, K, V and S tiles of float in 48 KB of static shared memory.
template <int kHeadDim>
struct Tile {
  static constexpr int kBlock = kHeadDim == 64 ? 32 : 16;
};

__device__ float to_float(float x) { return x; }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ T from_float(float x);
template <>
__device__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// exp(from - to), or 0 when `from` is -inf.
__device__ float rescale(float from, float to) {
  return from == -INFINITY ? 0.0f : expf(from - to);
}

// Rows [row0, row0 + kRows) of a [rows_total][kHeadDim] matrix as float, zeros past the end.
template <int kRows, int kHeadDim, int kRowPad, typename T>
__device__ void load_tile(float* tile, const T* src, int row0, int rows_total) {
  for (int e = threadIdx.x; e < kRows * kHeadDim; e += kThreads) {
    const int r = e / kHeadDim, c = e % kHeadDim;
    tile[r * (kHeadDim + kRowPad) + c] =
        row0 + r < rows_total ? to_float(src[int64_t(row0 + r) * kHeadDim + c]) : 0.0f;
  }
}

// One block per (query block, batch, head), the key loop inside, O, m and l on chip.
template <int kHeadDim, typename T>
__global__ void __launch_bounds__(kThreads)
    plain_forward_kernel(const T* q, const T* k, const T* v, T* o, float* lse, AttentionShape shape,
                         float scale) {
  constexpr int kBlock = Tile<kHeadDim>::kBlock;
  constexpr int kOPerThread = kBlock * kHeadDim / kThreads;
  __shared__ float q_tile[kBlock * kHeadDim];
  __shared__ float k_tile[kBlock * (kHeadDim + kPad)];
  __shared__ float v_tile[kBlock * kHeadDim];
  __shared__ float s_tile[kBlock * (kBlock + kPad)];
  __shared__ float row_max[kBlock], row_sum[kBlock], old_weight[kBlock];

  const int num_q_blocks = (shape.seqlen_q + kBlock - 1) / kBlock;
  const int q_start = int(blockIdx.x % num_q_blocks) * kBlock;
  const int64_t batch_head = blockIdx.x / num_q_blocks;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();
  const int64_t q_row0 = batch_head * shape.seqlen_q;
  const int64_t kv_row0 = (batch * shape.heads_kv + kv_head) * shape.seqlen_k;

  load_tile<kBlock, kHeadDim, 0>(q_tile, q + q_row0 * kHeadDim, q_start, shape.seqlen_q);
  if (threadIdx.x < kBlock) {
    row_max[threadIdx.x] = -INFINITY;
    row_sum[threadIdx.x] = 0.0f;
  }
  // The statistics are read by other threads at the end even when the key loop below is empty (a
  // block whose rows see no key), so they must be visible before it.
  __syncthreads();
  float o_acc[kOPerThread] = {};
  // Keys past the last one the block's last row sees are never needed.
  const int last_row = min(q_start + kBlock, shape.seqlen_q) - 1;
  const int keys = shape.causal ? max(0, min(shape.seqlen_k, last_row + shape.causal_offset() + 1))
                                : shape.seqlen_k;
  for (int kv_start = 0; kv_start < keys; kv_start += kBlock) {
    load_tile<kBlock, kHeadDim, kPad>(k_tile, k + kv_row0 * kHeadDim, kv_start, shape.seqlen_k);
    load_tile<kBlock, kHeadDim, 0>(v_tile, v + kv_row0 * kHeadDim, kv_start, shape.seqlen_k);
    __syncthreads();
    for (int e = threadIdx.x; e < kBlock * kBlock; e += kThreads) {
      const int r = e / kBlock, c = e % kBlock;
      float dot = 0.0f;
      for (int d = 0; d < kHeadDim; ++d)
        dot += q_tile[r * kHeadDim + d] * k_tile[c * (kHeadDim + kPad) + d];
      const int query = q_start + r, key = kv_start + c;
      const bool visible =
          key < shape.seqlen_k && (!shape.causal || key <= query + shape.causal_offset());
      s_tile[r * (kBlock + kPad) + c] = visible ? scale * dot : -INFINITY;
    }
    __syncthreads();
    if (threadIdx.x < kBlock) {
      const int r = threadIdx.x;
      float* s_row = s_tile + r * (kBlock + kPad);
      float block_max = -INFINITY;
      for (int c = 0; c < kBlock; ++c) block_max = fmaxf(block_max, s_row[c]);
      const float m_new = fmaxf(row_max[r], block_max);
      float block_sum = 0.0f;
      for (int c = 0; c < kBlock; ++c) {
        s_row[c] = rescale(s_row[c], m_new);
        block_sum += s_row[c];
      }
      old_weight[r] = rescale(row_max[r], m_new);
      row_max[r] = m_new;
      row_sum[r] = row_sum[r] * old_weight[r] + block_sum;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kOPerThread; ++i) {
      const int e = threadIdx.x + i * kThreads;
      const int r = e / kHeadDim, c = e % kHeadDim;
      float pv = 0.0f;
      for (int j = 0; j < kBlock; ++j)
        pv += s_tile[r * (kBlock + kPad) + j] * v_tile[j * kHeadDim + c];
      o_acc[i] = old_weight[r] * o_acc[i] + pv;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kOPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int r = e / kHeadDim, c = e % kHeadDim;
    if (q_start + r >= shape.seqlen_q) continue;
    const float l = row_sum[r];
    o[(q_row0 + q_start + r) * kHeadDim + c] = from_float<T>(l > 0.0f ? o_acc[i] / l : 0.0f);
    if (c == 0) lse[q_row0 + q_start + r] = l > 0.0f ? row_max[r] + logf(l) : -INFINITY;
  }
}

template <int kHeadDim, typename T>
void launch(const AttentionShape& shape, const void* q, const void* k, const void* v, void* o,
            float* lse, cudaStream_t stream) {
  constexpr int kBlock = Tile<kHeadDim>::kBlock;
  const int64_t blocks =
      int64_t((shape.seqlen_q + kBlock - 1) / kBlock) * shape.batch * shape.heads_q;
  plain_forward_kernel<kHeadDim, T><<<unsigned(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
      static_cast<T*>(o), lse, shape, shape.softmax_scale());
  CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_for_type(const AttentionShape& shape, const void* q, const void* k, const void* v,
                     void* o, float* lse, cudaStream_t stream) {
  if (shape.head_dim == 64) launch<64, T>(shape, q, k, v, o, lse, stream);
  else launch<128, T>(shape, q, k, v, o, lse, stream);
}

}  // namespace

bool plain_forward_supports(int head_dim) { return head_dim == 64 || head_dim == 128; }

void plain_forward(const AttentionShape& shape, DType dtype, const void* q, const void* k,
                   const void* v, void* o, float* lse, cudaStream_t stream) {
  if (!plain_forward_supports(shape.head_dim))
    throw std::invalid_argument("the harness's forward kernel supports head_dim 64 and 128, not " +
                                std::to_string(shape.head_dim) + ".");
  if (dtype == DType::kF32) launch_for_type<float>(shape, q, k, v, o, lse, stream);
  else launch_for_type<__nv_bfloat16>(shape, q, k, v, o, lse, stream);
}

}  // namespace attn
