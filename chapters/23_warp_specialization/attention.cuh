// Chapter 23: warp specialisation. In chapter 22 every warp of the block does everything in turn:
// thread 0 starts the copy of K_j and V_j, then all wait for it, compute, and pass a barrier before
// the next copy may start. Nothing copies while the block computes, and nothing computes while it
// waits. The idea in one sentence: give the copies to a warpgroup of their own (the producer),
// which fills a ring of kStages K/V buffers ahead of two consumer warpgroups that compute, the
// ring's slots handed back and forth on mbarriers.
//
//   warpgroup 0, producer (one thread issues TMA)   warpgroups 1, 2, consumers (64 query rows each)
//   for j: wait empty[j % kStages]                  for j: wait full[j % kStages]
//          copy K_j, V_j -> stage j % kStages  -->         S = Q_c K_j^T, softmax, O += P V_j
//          (full[...] counts the bytes down)   <--         arrive on empty[j % kStages]
//
// Each stage has two mbarriers: full (the producer announces the bytes and TMA counts them down)
// and empty (the 256 consumer threads arrive once they are done reading it). Use u of a stage
// waits for phase parity u % 2 of full; the producer's fill u waits for empty's parity
// (u - 1) % 2, the consumers' release of fill u - 1.
//
// A block now has 128 query rows (two consumers) sharing each K and V tile: half the copies per
// row of chapter 22. The producer needs few registers, the consumers many: setmaxnreg moves them
// (the producer drops to kProducerRegisters, the consumers rise to kConsumerRegisters), within the
// 64K registers of the SM that the block's 384 threads share.
//
// Everything else is chapter 22's: TMA copies of Q, K, V into 128-byte-swizzled, 1024-aligned
// tiles; S = Q K^T on wgmma from shared memory; P packed from S's accumulators into the A
// registers of the P V wgmma. Accumulator layout: warp w of a consumer owns rows 16 w .. 16 w + 15
// of its 64, and lane 4 g + t holds columns 8 j + 2 t, + 1 of rows 16 w + g and + 8.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"
#include "hopper.cuh"

namespace ch23 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

constexpr int kConsumers = 2;                        // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);     // and one producer warpgroup
constexpr int kConsumerRows = 64;                    // query rows per consumer: wgmma's M
constexpr int kBlockM = kConsumers * kConsumerRows;  // 128 query rows per block
constexpr int kStages = 2;                           // K/V buffers in the ring
// setmaxnreg: 128 x 24 + 256 x 240 = 64,512 of the SM's 65,536 registers.
constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
// Keys per tile: 128. A consumer's registers (kConsumerRegisters, from setmaxnreg) hold a 64 x 128
// S tile (64 floats per thread) beside O, and the ring's barriers are paid once per 128 keys.
constexpr int kBlockN = 128;
constexpr int kPanelCols = 64;                    // bf16 columns per 128-byte swizzled row
constexpr int kPanelBytes = kConsumerRows * 128;  // a panel of Q: 64 rows of 128 bytes
constexpr int kKVPanelBytes = kBlockN * 128;      // a panel of K or V: 128 rows
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;

// Shared memory, each tile 1024-byte aligned (head_dim / 64 panels each): each consumer's Q, and
// kStages K and V tiles. The kernel rounds the dynamic shared memory's start up to 1024 bytes,
// hence the extra 1024 asked for.
template <int kHeadDim>
struct Smem {
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kTileBytes = kPanels * kPanelBytes;      // Q of one consumer
  static constexpr int kKVTileBytes = kPanels * kKVPanelBytes;  // K or V of one stage
  static constexpr int kQ = 0, kK = kConsumers * kTileBytes, kV = kK + kStages * kKVTileBytes;
  static constexpr size_t kBytes = kV + kStages * kKVTileBytes + 1024;
  // A tile off a 1024-byte boundary is read with its k order permuted, and when Q and K are both
  // off by the same amount the permutation cancels in Q K^T: no output check would see it
  // (tests/gpu/test_hopper_probes.cu, the misaligned tile). So alignment holds by construction.
  static_assert(kTileBytes % 1024 == 0 && kKVTileBytes % 1024 == 0 && kPanelBytes % 1024 == 0 &&
                    kKVPanelBytes % 1024 == 0,
                "tiles on 1024-byte boundaries");
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

// S (64 x 64) = Q K_j^T, both operands K-major (head_dim contiguous). Each k step of 16 columns
// is 32 bytes further along the 128-byte rows, and every 4 steps the next panel begins.
template <int kHeadDim>
__device__ void gemm_qk(float (&s)[kBlockN / 2], const unsigned char* q_tile,
                        const unsigned char* k_tile) {
  hopper::fence_operands(s);
  hopper::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const int column = ks % 4 * 32;  // bytes into the 128-byte rows; every 4 steps a new panel
    hopper::wgmma_m64n128k16<0>(
        s, hopper::smem_descriptor(q_tile + ks / 4 * kPanelBytes + column, 16),
        hopper::smem_descriptor(k_tile + ks / 4 * kKVPanelBytes + column, 16), ks > 0);
  }
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(s);
}

// O (64 x head_dim) += P V_j, P from registers (p[kk]: the A fragment of keys 16 kk .. 16 kk + 15).
// V is stored as it came, keys down the rows and head_dim along them: for B = V that is N-major
// (trans-b = 1), each k step of 16 keys 16 rows = 2048 bytes further, and the leading-dimension
// offset the distance to the next panel of 64 columns of head_dim.
template <int kHeadDim>
__device__ void gemm_pv(float (&o)[kHeadDim / 2], uint32_t (&p)[kBlockN / 16][4],
                        const unsigned char* v_tile) {
  hopper::fence_operands(o);
  hopper::fence_operands(p);
  hopper::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    const uint64_t b = hopper::smem_descriptor(v_tile + ks * 16 * 128, kKVPanelBytes);
    if constexpr (kHeadDim == 64) hopper::wgmma_m64n64k16_rs(o, p[ks], b, true);
    else hopper::wgmma_m64n128k16_rs(o, p[ks], b, true);
  }
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(o);
  hopper::fence_operands(p);
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

// Block b handles (batch, head) = b / num_q_blocks and its query blocks from the last (chapter
// 10's order: the longest causal blocks first).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1)
    warp_specialized_kernel(const __grid_constant__ CUtensorMap q_map,
                            const __grid_constant__ CUtensorMap k_map,
                            const __grid_constant__ CUtensorMap v_map, bf16* o, float* lse,
                            AttentionShape shape, float scale_log2) {
  using S = Smem<kHeadDim>;
  constexpr int kOTiles = kHeadDim / 8;  // 8-column chunks of O
  extern __shared__ unsigned char smem_raw[];
  // Rounded up to 1024 bytes by an offset from smem_raw, not through an integer: the compiler then
  // still knows the pointer is to shared memory (chapter 21).
  unsigned char* smem = smem_raw + ((1024 - hopper::smem_address(smem_raw) % 1024) % 1024);
  auto k_tile = [&](int stage) { return smem + S::kK + stage * S::kKVTileBytes; };
  auto v_tile = [&](int stage) { return smem + S::kV + stage * S::kKVTileBytes; };
  __shared__ uint64_t q_full, full[kStages], empty[kStages];  // mbarriers

  const int warpgroup = threadIdx.x / 128;
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const int q_block = num_q_blocks - 1 - int(blockIdx.x % num_q_blocks);
  const int batch_head = int(blockIdx.x / num_q_blocks);
  const int batch = batch_head / shape.heads_q;
  const int kv_head = batch * shape.heads_kv + batch_head % shape.heads_q / shape.group_size();
  const int q_start = q_block * kBlockM;

  if (threadIdx.x == 0) {
    hopper::mbarrier_init(&q_full, 1);
    for (int stage = 0; stage < kStages; ++stage) {
      hopper::mbarrier_init(&full[stage], 1);
      hopper::mbarrier_init(&empty[stage], kConsumers * 128);
    }
  }
  __syncthreads();

  // The key blocks this query block sees (causal: up to its bottom row's diagonal, bottom-right
  // aligned, the rest skipped); only blocks that reach past the first row's diagonal, or past
  // the end, need a mask. Both consumers walk the same blocks: they share every tile.
  const int q_last = min(q_start + kBlockM, shape.seqlen_q) - 1;
  const int kv_end = shape.causal ? max(0, min(shape.seqlen_k, q_last + shape.causal_offset() + 1))
                                  : shape.seqlen_k;
  const int num_kv_blocks = (kv_end + kBlockN - 1) / kBlockN;
  const int unmasked_end =
      shape.causal ? min(shape.seqlen_k, q_start + shape.causal_offset() + 1) : shape.seqlen_k;
  const int num_unmasked_blocks = max(0, unmasked_end) / kBlockN;

  if (warpgroup == 0) {
    // The producer: one thread copies Q once, then K and V a stage ahead of the consumers.
    hopper::release_registers<kProducerRegisters>();
    if (threadIdx.x == 0) {
      hopper::mbarrier_arrive_expect_tx(&q_full, kConsumers * S::kTileBytes);
      for (int c = 0; c < kConsumers; ++c)
        for (int p = 0; p < S::kPanels; ++p)
          hopper::tma_load(smem + S::kQ + c * S::kTileBytes + p * kPanelBytes, &q_map, &q_full,
                           p * kPanelCols, q_start + c * kConsumerRows, batch_head);
      for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
        const int stage = kv_block % kStages, use = kv_block / kStages;
        // The stage's previous fill must have been read by every consumer thread.
        if (use > 0) hopper::mbarrier_wait(&empty[stage], (use - 1) % 2);
        hopper::mbarrier_arrive_expect_tx(&full[stage], 2 * S::kKVTileBytes);
        for (int p = 0; p < S::kPanels; ++p) {
          hopper::tma_load(k_tile(stage) + p * kKVPanelBytes, &k_map, &full[stage], p * kPanelCols,
                           kv_block * kBlockN, kv_head);
          hopper::tma_load(v_tile(stage) + p * kKVPanelBytes, &v_map, &full[stage], p * kPanelCols,
                           kv_block * kBlockN, kv_head);
        }
      }
    }
    // The producer's work ends with its last copy issued. Its copies complete on mbarriers that
    // the consumers wait on, in shared memory that lives until the block's last thread exits.
    return;
  }

  // A consumer: 64 query rows, its own Q tile; warp w of it owns rows 16 w .. 16 w + 15.
  hopper::claim_registers<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const unsigned char* q_tile = smem + S::kQ + consumer * S::kTileBytes;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = q_start + consumer * kConsumerRows + 16 * warp + g;  // this thread's first row

  float row_max[2] = {-INFINITY, -INFINITY};  // times scale_log2
  float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only, until the end
  float o_acc[kHeadDim / 2] = {};
  int row_end[2];  // the first key each row cannot see
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int query = row0 + 8 * half;
    row_end[half] =
        shape.causal ? min(shape.seqlen_k, query + shape.causal_offset() + 1) : shape.seqlen_k;
  }
  // Q must land even in a block that sees no key, before the block may exit.
  hopper::mbarrier_wait(&q_full, 0);

  for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
    const int kv_start = kv_block * kBlockN;
    const int stage = kv_block % kStages, use = kv_block / kStages;
    hopper::mbarrier_wait(&full[stage], use % 2);

    float s[kBlockN / 2];
    gemm_qk<kHeadDim>(s, q_tile, k_tile(stage));
    // Online softmax (chapter 05) in log2 units. Only the blocks that reach past the first
    // row's diagonal or past the end (chapter 10) set the keys a row cannot see to -inf.
    const bool masked = kv_block >= num_unmasked_blocks;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
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
    // P = exp2(s - base), packed as bf16 pairs into the A fragments of P V: S registers
    // 8 kk .. 8 kk + 7 are the 16 keys of k step kk, in the order a0, a1, a2, a3 wants.
    uint32_t p[kBlockN / 16][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float e0 = exp2_fast(s[4 * j + 2 * half] - base[half]);
        const float e1 = exp2_fast(s[4 * j + 2 * half + 1] - base[half]);
        row_sum[half] += e0 + e1;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(e0, e1);
        p[j / 2][2 * (j % 2) + half] = *reinterpret_cast<const uint32_t*>(&pair);
      }

    gemm_pv<kHeadDim>(o_acc, p, v_tile(stage));
    // This thread has read K_j and V_j (the wgmma that read them have retired): the stage may be
    // filled again once every consumer thread says so.
    hopper::mbarrier_arrive(&empty[stage]);
  }

  // O = o_acc / l and lse = (m + log2 l) / log2 e, straight from the registers.
  const int64_t head_row0 = int64_t(batch_head) * shape.seqlen_q;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int query = row0 + 8 * half;
    const float l = quad_sum(row_sum[half]);
    if (query >= shape.seqlen_q) continue;
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key outputs 0
    bf16* o_row = o + (head_row0 + query) * kHeadDim;
#pragma unroll
    for (int j = 0; j < kOTiles; ++j)
      *reinterpret_cast<__nv_bfloat162*>(o_row + 8 * j + 2 * t) = __floats2bfloat162_rn(
          o_acc[4 * j + 2 * half] * inv_l, o_acc[4 * j + 2 * half + 1] * inv_l);
    if (t == 0) lse[head_row0 + query] = l > 0.0f ? (row_max[half] + log2f(l)) / kLog2e : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

inline size_t workspace_bytes(const AttentionShape&) { return 0; }

template <int kHeadDim>
void launch_for_head_dim(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  auto kernel = warp_specialized_kernel<kHeadDim>;
  static const bool smem_configured = [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(Smem<kHeadDim>::kBytes)));
    return true;
  }();
  (void)smem_configured;
  // Q as [batch * heads_q][seqlen_q][head_dim], K and V as [batch * heads_kv][seqlen_k][head_dim]:
  // a box is 64 rows of one head, so rows past a head's end read as zeros, not as the next head.
  const uint64_t d = kHeadDim;
  const CUtensorMap q_map = hopper::make_tensor_map(
      params.q, d, shape.seqlen_q, uint64_t(shape.batch) * shape.heads_q, kConsumerRows);
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
  attn::ForwardChapter c{"23_warp_specialization",
                         "a producer warpgroup fills a 2-stage K/V ring by TMA for two consumer "
                         "warpgroups (128 query rows), on full and empty mbarriers; setmaxnreg",
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

}  // namespace ch23
