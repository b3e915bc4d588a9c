// Chapter 21: the Hopper arc begins. Chapter 14 feeds the tensor cores with instructions every
// GPU since Ampere has: each warp loads its fragments with ldmatrix and multiplies 16 x 8 x 16
// pieces with mma.sync, and every thread of the block copies 16 bytes at a time with cp.async.
// The H100 has two units that do this work for a whole block at once (hopper.cuh):
//
// - TMA, the tensor memory accelerator: one thread hands it a tensor map (the tensor's shape and
//   strides, encoded on the host) and the coordinates of a box; it copies the whole box into
//   shared memory, in the 128-byte swizzle the tensor cores read without bank conflicts, fills
//   what lies past the tensor's end with zeros, and counts the bytes down on an mbarrier that the
//   other threads wait on.
// - wgmma: a matrix product of a warpgroup (4 warps, 128 threads) with M = 64 rows, its operands
//   read straight from shared memory through 64-bit descriptors, its fp32 accumulators in the
//   registers of the 128 threads. No ldmatrix; one instruction does 64 x N x 16.
//
// The idea in one sentence: load Q, K and V with TMA and compute S = Q K^T and O += P V with
// wgmma, one warpgroup per 64 query rows, P going through shared memory. Everything is
// synchronous: each K, V tile is waited for before its products, each product before the softmax.
// The next chapters overlap these.
//
//   block = 1 warpgroup, 64 query rows                K_j, V_j: 64 keys, TMA, 128-byte swizzle
//   Q tile (TMA, once)  --wgmma-->  S = Q K_j^T (64 x 64 fp32, 32 registers per thread)
//                                   online softmax on the registers (chapter 05)
//   P (bf16) --st.shared, swizzled--> P tile  --wgmma-->  O += P V_j (64 x d fp32)
//
// The accumulator layout of wgmma m64nNk16 (PTX ISA, "Register fragments"): warp w of the
// warpgroup owns rows 16 w .. 16 w + 15; lane 4 g + t holds, for each 8-column chunk j, the
// pair of columns 8 j + 2 t, 8 j + 2 t + 1 of row 16 w + g (registers 4 j, 4 j + 1) and of row
// 16 w + g + 8 (registers 4 j + 2, 4 j + 3): chapter 06's mma.sync layout, stacked 4 warps high
// and N / 8 chunks wide. So a row is spread over the 4 lanes of a quad, as before.
//
// Shared memory in the 128-byte swizzle: a tile is stored in panels of 64 columns (128 bytes of
// bf16 per row); within a panel, the 16-byte chunk c of row r sits at chunk c ^ (r % 8). TMA
// writes that layout, wgmma reads it (the descriptor's swizzle mode), and this kernel writes P
// into it by hand. Every tile starts on a 1024-byte boundary, where the pattern starts.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"
#include "hopper.cuh"

namespace ch21 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;          // one warpgroup
constexpr int kBlockM = 64;            // query rows per block: wgmma's M
constexpr int kBlockN = 64;            // keys per tile
constexpr int kPanelCols = 64;         // bf16 columns per 128-byte swizzled row
constexpr int kPanelBytes = 64 * 128;  // a panel of 64 rows (kBlockM = kBlockN = 64)
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;

// Shared memory, each tile 1024-byte aligned: Q, K_j, V_j (head_dim / 64 panels each), P (one
// panel). The kernel rounds the dynamic shared memory's start up to 1024 bytes, hence the extra
// 1024 asked for.
template <int kHeadDim>
struct Smem {
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kTileBytes = kPanels * kPanelBytes;
  static constexpr int kQ = 0, kK = kTileBytes, kV = 2 * kTileBytes, kP = 3 * kTileBytes;
  static constexpr size_t kBytes = 3 * kTileBytes + kPanelBytes + 1024;
  // A tile off a 1024-byte boundary is read with its k order permuted, and when Q and K are both
  // off by the same amount the permutation cancels in Q K^T: no output check would see it
  // (tests/gpu/test_hopper_probes.cu, the misaligned tile). So alignment holds by construction.
  static_assert(kTileBytes % 1024 == 0 && kPanelBytes % 1024 == 0, "tiles on 1024-byte boundaries");
};

// ---------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------

// 2^x in one instruction (MUFU.EX2; flush to zero, 2^-inf = 0).
__device__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullWarp, x, 2));
}
__device__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullWarp, x, 1);
  return x + __shfl_xor_sync(kFullWarp, x, 2);
}

// The byte offset of element (row, col) of a tile of 64-column panels in the 128-byte swizzle.
__device__ int swizzled_offset(int row, int col, int rows) {
  const int panel = col / kPanelCols, chunk = col % kPanelCols / 8;
  return panel * rows * 128 + row * 128 + ((chunk ^ (row % 8)) * 16) + col % 8 * 2;
}

// S (64 x 64) = Q K_j^T, both operands K-major (head_dim contiguous). Each k step of 16 columns
// is 32 bytes further along the 128-byte rows, and every 4 steps the next panel begins.
template <int kHeadDim>
__device__ void gemm_qk(float (&s)[32], const unsigned char* q_tile, const unsigned char* k_tile) {
  hopper::fence_operands(s);
  hopper::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const int offset = ks / 4 * kPanelBytes + ks % 4 * 32;
    hopper::wgmma_m64n64k16<0>(s, hopper::smem_descriptor(q_tile + offset, 16),
                               hopper::smem_descriptor(k_tile + offset, 16), ks > 0);
  }
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(s);
}

// O (64 x head_dim) += P V_j. P is K-major (keys contiguous, one panel). V is stored as it came,
// keys down the rows and head_dim along them: for B = V that is N-major ("transposed", the
// instruction's trans-b = 1), each k step of 16 keys 16 rows = 2048 bytes further, and the
// leading-dimension offset the distance to the next panel of 64 columns of head_dim.
template <int kHeadDim>
__device__ void gemm_pv(float (&o)[kHeadDim / 2], const unsigned char* p_tile,
                        const unsigned char* v_tile) {
  hopper::fence_operands(o);
  hopper::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    const uint64_t a = hopper::smem_descriptor(p_tile + ks * 32, 16);
    const uint64_t b = hopper::smem_descriptor(v_tile + ks * 16 * 128, kPanelBytes);
    if constexpr (kHeadDim == 64) hopper::wgmma_m64n64k16<1>(o, a, b, true);
    else hopper::wgmma_m64n128k16<1>(o, a, b, true);
  }
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(o);
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

// Block b handles (batch, head) = b / num_q_blocks and its query blocks from the last (chapter
// 10's order: the longest causal blocks first).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    tma_wgmma_kernel(const __grid_constant__ CUtensorMap q_map,
                     const __grid_constant__ CUtensorMap k_map,
                     const __grid_constant__ CUtensorMap v_map, bf16* o, float* lse,
                     AttentionShape shape, float scale_log2) {
  using S = Smem<kHeadDim>;
  constexpr int kOTiles = kHeadDim / 8;  // 8-column chunks of O
  extern __shared__ unsigned char smem_raw[];
  // Rounded up to 1024 bytes by an offset from smem_raw, not through an integer: the compiler then
  // still knows the pointer is to shared memory and stores P with st.shared, not generic stores.
  unsigned char* smem = smem_raw + ((1024 - hopper::smem_address(smem_raw) % 1024) % 1024);
  unsigned char* q_tile = smem + S::kQ;
  unsigned char* k_tile = smem + S::kK;
  unsigned char* v_tile = smem + S::kV;
  unsigned char* p_tile = smem + S::kP;
  __shared__ uint64_t q_ready, kv_ready;  // mbarriers

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const int q_block = num_q_blocks - 1 - int(blockIdx.x % num_q_blocks);
  const int batch_head = int(blockIdx.x / num_q_blocks);
  const int batch = batch_head / shape.heads_q;
  const int kv_head = batch * shape.heads_kv + batch_head % shape.heads_q / shape.group_size();
  const int q_start = q_block * kBlockM;

  if (threadIdx.x == 0) {
    hopper::mbarrier_init(&q_ready, 1);
    hopper::mbarrier_init(&kv_ready, 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    hopper::mbarrier_arrive_expect_tx(&q_ready, S::kTileBytes);
    for (int p = 0; p < S::kPanels; ++p)
      hopper::tma_load(q_tile + p * kPanelBytes, &q_map, &q_ready, p * kPanelCols, q_start,
                       batch_head);
  }

  // The key blocks this query block sees (causal: up to its bottom row's diagonal, bottom-right
  // aligned, the rest skipped); only blocks that reach past the first row's diagonal, or past
  // the end, need a mask.
  const int q_last = min(q_start + kBlockM, shape.seqlen_q) - 1;
  const int kv_end = shape.causal ? max(0, min(shape.seqlen_k, q_last + shape.causal_offset() + 1))
                                  : shape.seqlen_k;
  const int num_kv_blocks = (kv_end + kBlockN - 1) / kBlockN;
  const int unmasked_end =
      shape.causal ? min(shape.seqlen_k, q_start + shape.causal_offset() + 1) : shape.seqlen_k;
  const int num_unmasked_blocks = max(0, unmasked_end) / kBlockN;

  // This thread's rows: 16 warp + g and + 8.
  float row_max[2] = {-INFINITY, -INFINITY};  // times scale_log2
  float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only, until the end
  float o_acc[kHeadDim / 2] = {};
  int row_end[2];  // the first key each row cannot see
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int query = q_start + 16 * warp + g + 8 * half;
    row_end[half] =
        shape.causal ? min(shape.seqlen_k, query + shape.causal_offset() + 1) : shape.seqlen_k;
  }

  for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
    const int kv_start = kv_block * kBlockN;
    if (threadIdx.x == 0) {
      hopper::mbarrier_arrive_expect_tx(&kv_ready, 2 * S::kTileBytes);
      for (int p = 0; p < S::kPanels; ++p) {
        hopper::tma_load(k_tile + p * kPanelBytes, &k_map, &kv_ready, p * kPanelCols, kv_start,
                         kv_head);
        hopper::tma_load(v_tile + p * kPanelBytes, &v_map, &kv_ready, p * kPanelCols, kv_start,
                         kv_head);
      }
    }
    hopper::mbarrier_wait(&q_ready, 0);
    hopper::mbarrier_wait(&kv_ready, kv_block % 2);

    float s[32];
    gemm_qk<kHeadDim>(s, q_tile, k_tile);

    // Online softmax (chapter 05) in log2 units. Only the blocks that reach past the first
    // row's diagonal or past the end (chapter 10) set the keys a row cannot see to -inf.
    const bool masked = kv_block >= num_unmasked_blocks;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // i = 2 * half + column
        float& score = s[4 * j + i];
        score *= scale_log2;
        if (masked && kv_start + 8 * j + 2 * t + i % 2 >= row_end[i / 2]) score = -INFINITY;
        tile_max[i / 2] = fmaxf(tile_max[i / 2], score);
      }
    float base[2];  // what the exponents are taken against: the new max, or 0 while it is -inf
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float new_max = fmaxf(row_max[half], quad_max(tile_max[half]));
      base[half] = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2_fast(row_max[half] - base[half]);
      row_max[half] = new_max;
      row_sum[half] *= alpha;
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        o_acc[4 * j + 2 * half] *= alpha;
        o_acc[4 * j + 2 * half + 1] *= alpha;
      }
    }
    // P = exp2(s - base) as bf16 pairs into the swizzled P tile: row 16 warp + g (+ 8), columns
    // 8 j + 2 t and + 1, 4 bytes at a time.
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float e0 = exp2_fast(s[4 * j + 2 * half] - base[half]);
        const float e1 = exp2_fast(s[4 * j + 2 * half + 1] - base[half]);
        row_sum[half] += e0 + e1;
        const int row = 16 * warp + g + 8 * half;
        *reinterpret_cast<__nv_bfloat162*>(p_tile + swizzled_offset(row, 8 * j + 2 * t, kBlockM)) =
            __floats2bfloat162_rn(e0, e1);
      }
    // wgmma reads P through the async proxy: each thread's stores must reach it, and then every
    // thread's (the barrier).
    hopper::fence_proxy_async();
    __syncthreads();

    gemm_pv<kHeadDim>(o_acc, p_tile, v_tile);
    // Every thread is done with K_j, V_j and P before thread 0 copies the next tiles over them.
    __syncthreads();
  }
  // A block that saw no key still started the copy of Q: it must land before the block exits.
  hopper::mbarrier_wait(&q_ready, 0);

  // O = o_acc / l and lse = (m + log2 l) / log2 e, straight from the registers.
  const int64_t row0 = int64_t(batch_head) * shape.seqlen_q;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int query = q_start + 16 * warp + g + 8 * half;
    const float l = quad_sum(row_sum[half]);
    if (query >= shape.seqlen_q) continue;
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key outputs 0
    bf16* o_row = o + (row0 + query) * kHeadDim;
#pragma unroll
    for (int j = 0; j < kOTiles; ++j)
      *reinterpret_cast<__nv_bfloat162*>(o_row + 8 * j + 2 * t) = __floats2bfloat162_rn(
          o_acc[4 * j + 2 * half] * inv_l, o_acc[4 * j + 2 * half + 1] * inv_l);
    if (t == 0) lse[row0 + query] = l > 0.0f ? (row_max[half] + log2f(l)) / kLog2e : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

inline size_t workspace_bytes(const AttentionShape&) { return 0; }

template <int kHeadDim>
void launch_for_head_dim(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  auto kernel = tma_wgmma_kernel<kHeadDim>;
  static const bool smem_configured = [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(Smem<kHeadDim>::kBytes)));
    return true;
  }();
  (void)smem_configured;
  // Q as [batch * heads_q][seqlen_q][head_dim], K and V as [batch * heads_kv][seqlen_k][head_dim]:
  // a box is 64 rows of one head, so rows past a head's end read as zeros, not as the next head.
  const uint64_t d = kHeadDim;
  const CUtensorMap q_map = hopper::make_tensor_map(params.q, d, shape.seqlen_q,
                                                    uint64_t(shape.batch) * shape.heads_q, kBlockM);
  const CUtensorMap k_map = hopper::make_tensor_map(
      params.k, d, shape.seqlen_k, uint64_t(shape.batch) * shape.heads_kv, kBlockN);
  const CUtensorMap v_map = hopper::make_tensor_map(
      params.v, d, shape.seqlen_k, uint64_t(shape.batch) * shape.heads_kv, kBlockN);
  const int64_t num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const unsigned blocks = unsigned(num_q_blocks * shape.batch * shape.heads_q);
  kernel<<<blocks, kThreads, Smem<kHeadDim>::kBytes, stream>>>(
      q_map, k_map, v_map, static_cast<bf16*>(params.o), params.lse, shape,
      shape.softmax_scale() * kLog2e);
  CUDA_CHECK_LAUNCH();
}

inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::ForwardChapter chapter() {
  attn::ForwardChapter c{"21_tma_wgmma",
                         "Hopper: Q, K, V copied by TMA into swizzled shared memory, both "
                         "products on wgmma (one warpgroup per 64 rows), P through shared memory",
                         attn::DType::kBF16,
                         {64, 128},
                         90,
                         /*survives_large_logits=*/true,
                         workspace_bytes,
                         "",
                         launch};
  c.arch_specific = 90;  // built for sm_90a: wgmma and TMA run on compute capability 9.0 only
  return c;
}

}  // namespace ch21
