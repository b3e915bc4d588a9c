// Chapter 52: K and V^T in rings of their own. A stage of chapter 51's ring holds a key block's K
// and its V^T together, with one barrier that says both are there (K's copy and the producer's
// transpose of V) and one that says both were read. But they are read at different times: K by
// S_j = Q K_j^T, which retires early (its softmax waits for it), V^T by P_j V_j a turn later. So a
// K slot stayed taken about a turn and a half after its last read, and a consumer's S_j waited for
// V_j's transpose, which it does not read. Here K and V^T keep their stages (the same count, the
// same shared memory) but each has its own pair of barriers: k_full (K's copy) and k_empty (every
// consumer thread retired the S that read it), v_full (the transpose) and v_empty (the P V
// retired). A turn waits for K_{j+1} and V_j, each on its own barrier; a consumer frees K_{j+1} as
// soon as S_{j+1} has retired, before the softmax; and the producer copies a K as soon as its slot
// is free, before it waits for the V^T slot that its transpose will write.
//
// Chapter 51's own summary: the row maximum two scores an instruction. A key block's softmax starts
// with each row's largest score, and at head_dim 128 a consumer thread holds 96 scores (48 of each
// of its two rows): 96 FMNMX, at half the FP32 rate (2 cycles a warp instruction on a
// sub-partition), before the first exponential. The ALU pipe also has a three-input integer max,
// VIMNMX3 (CUDA's __vimax3_s32, one of Hopper's DPX instructions), at the same rate: two new scores
// an instruction, if scores can be compared as integers. Read as signed 32-bit integers, the floats
// whose sign bit is clear (+0.0 and up) keep their order, and every float with the sign bit set is
// a negative integer, below all of them. So the integer maximum of a thread's scores is their float
// maximum whenever that maximum has its sign bit clear. The unmasked softmax takes the maximum that
// way, 48 VIMNMX3 where there were 96 FMNMX, and where any thread of the warp finds all of its
// scores of a row in the block below zero (48 of the block's 192 at head_dim 128; the tests make
// such scores with --qk-offset 1) the warp takes the float maximum as before: a vote, so the branch
// is uniform. For finite scores the maximum is the same float either way, and so are the outputs.
// The masked blocks keep the float maximum.
//
// Chapter 50's own summary: a tile's first key block without the mask where it needs none. A key
// block that reaches past the end of the keys, or past the first row's diagonal, takes the softmax
// with the mask (chapter 10: a compare and a select per score, 670 instructions per consumer warp
// at head_dim 128 against the unmasked form's 416); the others take it without. In chapter 49 the
// key loop chose between the two, but a tile's first block, S_0, whose softmax comes either in
// the tile's first turn or in the merged last turn of the tile before, always took the masked
// form: on most tiles one masked softmax too many. Here both places choose as the loop does.
//
// FlashAttention-3, run beside chapter 49 on the same H100, pays about as much around a tile's
// key blocks and less in them (docs/benchmarks.md, "FlashAttention-3 on the same GPU"); its loop
// walks a tile's key blocks from the last, so that the masked ones come first and its first
// block's softmax is the one that needs the mask. Taking chapter 49's blocks in that order, or
// keeping the order and choosing the form for S_0, measured the same at head_dim 128 (about +1-3%
// at 512 and 1024 keys, under 1% from 2048): this chapter keeps the order, which also helps where
// no block needs the mask (head_dim 64 at lengths that are multiples of 128, where the reversed
// order gained nothing).
//
// Chapter 49's own summary: the tiles overlapped, in FP8. Inside a tile every turn of a consumer
// issues S_{j+1} = Q K_{j+1}^T beside P_j V_j, and takes S_{j+1}'s softmax while P_j V_j runs
// (chapter 24); at a tile's edges chapter 48 leaves that pipeline: the last turn issues P V alone,
// the consumer waits for it and stores O, then issues the next tile's S_0 alone and waits for it
// before its first softmax. Chapter 49 lets the last turn of a tile issue the next tile's S_0
// beside the last P V, as any other turn issues S_{j+1} beside P_j V_j: the next tile's first
// softmax runs while this tile's last P V does, and then the consumer stores this tile's O, from
// the row maximum and sum it set aside. The next tile's Q must have landed by that turn, a turn
// after this tile's last Q K^T: so Q has two buffers, taken by the tiles in turn, and the producer
// copies a tile's Q while the tile before it still runs.
//
//   chapter 48, a consumer:  ... | S_n-1 + PV_n-2 | PV_n-1 | wait, store O | S'_0 | wait, softmax
//   chapter 49:              ... | S_n-1 + PV_n-2 | S'_0 + PV_n-1 | softmax of S'_0, store O | ...
//
// Both consumers see the same tiles, so the ring of turns still alternates: the merged turn is the
// last of one tile and the first of the next. The merge is for head_dim 128: at 64, with three
// consumers, it measured 4-6% slower than chapter 48, and the tiles keep chapter 48's edges there
// (with Q in two buffers); so do tiles next to one with a consumer that sits out (chapter 46), and
// a unit before one that sees no key. The merged turn must not wait on anything but the ring:
// the producer posts the tile's numbers with the unit, and the descales are loaded after the issue.
//
// Chapter 48's own summary: O stored 16 bytes at a time. Chapter 47's change, the same lines, in
// the FP8 kernel of chapter 46: the four lanes of a quad trade their bf16 pairs with two shuffles
// (quad_transpose), and each lane writes 8 contiguous columns of its row with one 16-byte store,
// where chapter 46 wrote 4 bytes per store. An FP8 tile takes less time than a bf16 one and its
// stores are the same, so their share of it is larger; the gain is largest where rows are short.
//
// Chapter 46's own summary: a consumer without rows sits the tile out. A tile has 64 query rows per
// consumer warpgroup (192 rows in three at head_dim 64, 128 in two at 128), and where a sequence's
// length is not a multiple of that, its last tile runs past the end: at head_dim 64 and 512 queries
// the third tile of each head has 128 rows, at 1024 the sixth has 64. The consumers whose 64 rows
// all lie past the end still do all their work in chapter 45 (Q K^T on the zeros TMA filled in, the
// softmax, P V), and share the tensor cores and the exponential unit with those that have rows;
// only their stores are skipped. The idea in one sentence: such a consumer takes its turns and
// frees each stage and Q as before, so that the others see no difference in the barriers, but
// issues no wgmma and takes no softmax.
//
// It is a branch at the tile, not inside the key loop: a wgmma issued on one path and not on
// another would leave ptxas to serialize every wgmma of the kernel (warning C7515).
//
// Chapter 45's own summary: the FP8 kernel's last round split along the keys (stream-K). Without
// the mask the blocks walk the tiles with a fixed stride, and the tiles rarely divide evenly among
// the SMs; so the whole rounds are walked as before, and the last round's tiles shared out by key
// blocks, every block taking an equal run of them; a tile whose key blocks went to several blocks
// is finished by a small merge kernel, with chapter 03's rule, from the partial O and log-sum-exp
// each piece left in the workspace.
//
//   tiles 0 .. whole - 1:     block b takes b, b + blocks, ... (chapter 37's stride)
//   the tail's key blocks:    tail x kv_blocks of them, in tile order, cut into one run per block:
//                             block b takes [start(b), start(b + 1)), one or two pieces
//   a piece:                  O / l, descaled (fp32), and its lse to its slot in the workspace
//   the merge, per tile:      O = sum_p w_p O_p / sum_p w_p, w_p = 2^(lse_p - max lse)
//
// Stream-K (Osama et al., 2023) does the same for the last wave of a matrix product; chapter 44
// did it for the bf16 kernel (chapter 35). The split is for runs without the mask only (causal
// tiles come from the counter, longest first) and only where it pays: the rule is in plan(), at
// the launch. A piece leaves its results descaled (the descales belong to its tile's head group),
// so the merge needs none.
//
// The rest is chapter 39's. Its own summary: one vote per warp (__any_sync) on whether any of its
// 16 rows has alpha != 1, and O's rescale only when one has (alpha is exactly 1 where a row's
// maximum did not grow: m_old c rounded by __fmul_rn as m_new c was, the same float on both
// sides; chapter 06's README); the outputs are bit for bit chapter 38's.
//
// And chapter 38's, under it: the softmax's maximum and sum in two chains each; a persistent
// block per SM walking the tiles (stride without the mask, a counter with it); the producer
// warpgroup copying K by TMA and V in K's layout and transposing V (ldmatrix .trans, byte
// permutes, stmatrix, keys in pack_p's order); e4m3 operands with their descales, P scaled by 2^8
// and packed without shuffles, 192-key tiles at head_dim 128; a ring of 3 stages, two consumer
// warpgroups (three at head_dim 64) taking turns issuing S_{j+1} = Q K_{j+1}^T with P_j V_j and
// taking the softmax of S_{j+1} while P_j V_j runs; head_dim 64 and 128. Accumulator layout: warp
// w of a consumer owns rows 16 w .. 16 w + 15 of its 64, and lane 4 g + t holds columns 8 j + 2 t,
// + 1 of its rows 16 w + g and 16 w + g + 8.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"
#include "hopper.cuh"

namespace ch52 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

constexpr int kConsumerRows = 64;    // query rows per consumer: wgmma's M
constexpr int kRawStages = 2;        // buffers of V as it lands, before the producer transposes it
constexpr int kProducerBarrier = 4;  // the producer warpgroup's named barrier (consumers: 1-3)
// The block by head dim: consumer warpgroups, threads (one producer warpgroup more), query rows
// (the registers from setmaxnreg are in the kernel: kProducerRegs, kConsumerRegs).
template <int kHeadDim>
struct Block {
  static constexpr int kConsumers = kHeadDim == 64 ? 3 : 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kRows = kConsumers * kConsumerRows;
  // K/V buffers in the ring: 3, as in chapter 27, but 2 at d 256, where the two raw V buffers
  // take the third one's room (Q 32 KB + 2 x 64 KB of K and V^T + 2 x 32 KB of raw V, 230,400
  // bytes with the alignment, of the 232,448 a block may have).
  static constexpr int kStages = kHeadDim == 256 ? 2 : 3;
  // Keys per tile: 192 at head_dim 128, 128 otherwise (chapter 29's header says why).
  static constexpr int kBlockN = kHeadDim == 128 ? 192 : 128;
  // Whether a tile's last turn issues the next tile's S_0: at head_dim 128 only. At 64 it was
  // 4-6% slower than chapter 48 at the four lengths measured without the mask (the README), and
  // its tiles keep chapter 48's edges, with Q in two buffers.
  static constexpr bool kOverlap = kHeadDim == 128;
};
constexpr int kKeyGroup = 16;  // V^T's keys are permuted within groups of 16 (pack_p)
// P is exp2(s c - m c + kPScaleLog2): its largest value 2^8 = 256, under e4m3's 448.
constexpr float kPScaleLog2 = 8.0f;
// Independent partial chains of the row maximum and the row sum in the softmax (a power of two):
// 2 measured best at d 128 (4 and 8 gained less, and lost 2% at d 64).
constexpr int kChains = 2;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;

// Shared memory, each tile 1024-byte aligned. Q and K rows are head_dim bytes: in panels of
// kPanelWidth bytes per row (64 at d 64, in the 64-byte swizzle; 128 otherwise, in the 128-byte
// one), head_dim / kPanelWidth panels. A V^T tile is head_dim rows of kBlockN bytes, in panels
// of kVPanelWidth keys: one 128-byte panel for 128 keys, three 64-byte ones (64-byte swizzle) for
// 192. Two buffers of Q, each with every consumer's Q (tile i takes buffer i % 2), then kStages K
// and V^T tiles, then kRawStages raw V tiles in K's layout (d 128: 2 x 2 x 8 KB + 3 x 48 KB + 2 x
// 24 KB + 1 KB = 230,400 bytes, of the 232,448 a block may have). The kernel rounds the dynamic
// shared memory's start up to 1024 bytes, hence the extra 1024 asked for.
template <int kHeadDim>
struct Smem {
  static constexpr int kBlockN = Block<kHeadDim>::kBlockN;
  static constexpr int kPanelWidth = kHeadDim < 128 ? kHeadDim : 128;  // bytes, = the swizzle
  static constexpr int kPanels = kHeadDim / kPanelWidth;
  static constexpr int kQPanelBytes = kConsumerRows * kPanelWidth;
  static constexpr int kKPanelBytes = kBlockN * kPanelWidth;
  static constexpr int kTileBytes = kPanels * kQPanelBytes;           // Q of one consumer
  static constexpr int kKTileBytes = kPanels * kKPanelBytes;          // K of one stage
  static constexpr int kVPanelWidth = kBlockN % 128 == 0 ? 128 : 64;  // keys, = the swizzle
  static constexpr int kVPanels = kBlockN / kVPanelWidth;
  static constexpr int kVPanelBytes = kHeadDim * kVPanelWidth;
  static constexpr int kVTileBytes = kVPanels * kVPanelBytes;  // V^T of one stage
  static constexpr int kStages = Block<kHeadDim>::kStages;
  static constexpr int kQBufferBytes = Block<kHeadDim>::kConsumers * kTileBytes;  // every Q
  static constexpr int kQ = 0, kK = 2 * kQBufferBytes, kV = kK + kStages * kKTileBytes,
                       kRawV = kV + kStages * kVTileBytes;
  // A raw V tile has K's layout (keys x head_dim bytes, in panels).
  static constexpr size_t kBytes = kRawV + kRawStages * kKTileBytes + 1024;
  // A tile off a 1024-byte boundary is read with its k order permuted, and when Q and K are both
  // off by the same amount the permutation cancels in Q K^T: no output check would see it
  // (tests/gpu/test_hopper_probes.cu, the misaligned tile). So alignment holds by construction.
  static_assert(kTileBytes % 1024 == 0 && kKTileBytes % 1024 == 0 && kVTileBytes % 1024 == 0 &&
                    kQPanelBytes % 1024 == 0 && kKPanelBytes % 1024 == 0 &&
                    kVPanelBytes % 1024 == 0,
                "tiles on 1024-byte boundaries");
  static_assert(kBytes <= 232448, "more shared memory than a block may have");
  // Whole panels of V^T, and whole 32-key k steps (pack_p, issue_pv).
  static_assert(kBlockN % kVPanelWidth == 0 && kBlockN % 32 == 0, "a tile of whole panels");
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

// Programmatic dependent launch (chapter 19): the merge kernel, launched with the attribute of
// launch_merge, may start once every block of this kernel has called allow_next_grid() or exited;
// it calls wait_for_previous_grid() before reading what this kernel wrote.
__device__ void allow_next_grid() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullWarp, x, 2));
}
__device__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullWarp, x, 1);
  return x + __shfl_xor_sync(kFullWarp, x, 2);
}

// Issues S (64 x kBlockN) = Q K_j^T, both operands K-major (head_dim contiguous), without waiting:
// each k step of 32 e4m3 columns is 32 bytes further along the rows, and at every panel's end the
// next panel begins. The caller waits (wgmma_wait) before reading s.
template <int kHeadDim>
__device__ void issue_qk(float (&s)[Block<kHeadDim>::kBlockN / 2], const unsigned char* q_tile,
                         const unsigned char* k_tile) {
  using S = Smem<kHeadDim>;
  hopper::fence_operands(s);
  hopper::wgmma_fence();
  const uint64_t a0 = hopper::smem_descriptor<S::kPanelWidth>(q_tile, 16);
  const uint64_t b0 = hopper::smem_descriptor<S::kPanelWidth>(k_tile, 16);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 32; ++ks) {
    const int panel = ks * 32 / S::kPanelWidth, column = ks * 32 % S::kPanelWidth;
    const uint64_t a = hopper::advance_descriptor(a0, panel * S::kQPanelBytes + column);
    const uint64_t b = hopper::advance_descriptor(b0, panel * S::kKPanelBytes + column);
    if constexpr (S::kBlockN == 192) hopper::wgmma_m64n192k32(s, a, b, ks > 0);
    else hopper::wgmma_m64n128k32(s, a, b, ks > 0);
  }
  hopper::wgmma_commit();
}

// Issues O (64 x head_dim) += P V_j without waiting, P from registers (p[kk]: the A fragment of
// keys 32 kk .. 32 kk + 31). V^T is K-major, keys along its rows and head_dim down them, so B = V
// reads like K in Q K^T: each k step of 32 keys is 32 bytes further along the rows, and at every
// panel's end the next panel begins. p and o must not be touched until a wgmma_wait has retired
// it.
template <int kHeadDim>
__device__ void issue_pv(float (&o)[kHeadDim / 2], uint32_t (&p)[Block<kHeadDim>::kBlockN / 32][4],
                         const unsigned char* v_tile) {
  using S = Smem<kHeadDim>;
  hopper::fence_operands(o);
  hopper::fence_operands(p);
  hopper::wgmma_fence();
  const uint64_t b0 = hopper::smem_descriptor<S::kVPanelWidth>(v_tile, 16);
#pragma unroll
  for (int ks = 0; ks < S::kBlockN / 32; ++ks) {
    const int panel = ks * 32 / S::kVPanelWidth, column = ks * 32 % S::kVPanelWidth;
    const uint64_t b = hopper::advance_descriptor(b0, panel * S::kVPanelBytes + column);
    if constexpr (kHeadDim == 64) hopper::wgmma_m64n64k32_rs(o, p[ks], b, true);
    else if constexpr (kHeadDim == 128) hopper::wgmma_m64n128k32_rs(o, p[ks], b, true);
    else hopper::wgmma_m64n256k32_rs(o, p[ks], b, true);
  }
  hopper::wgmma_commit();
}

// One step of the online softmax (chapter 05) in log2 units, on S_j (keys kv_start ..) in place,
// the scale applied inside the exponent's FFMA (row_max is of the unscaled scores):
// in blocks that reach past the first row's diagonal or past the end (chapter 10, kMasked) the keys
// a row cannot see are set to -inf. Updates the row's max and sum, leaves P = exp2(s c - base) in s
// and returns in alpha the factor O must be rescaled by.
//
// Two versions, masked and not, chosen by a branch at the call. Besides sparing unmasked blocks
// the compares, the branch puts the softmax in basic blocks of its own, and that keeps the
// overlap: ptxas schedules within a basic block, and with the softmax and the wgmma wait in one,
// it moved the wait up above the exponentials (the SASS: WARPGROUP.DEPBAR before MUFU.EX2), so
// the softmax waited for P V after all.
template <bool kMasked, int kBlockN>
__device__ void softmax_step(float (&s)[kBlockN / 2], float (&alpha)[2], float (&row_max)[2],
                             float (&row_sum)[2], const int (&row_end)[2], int kv_start,
                             float scale_log2, int t) {
  // Chain c takes the 8-key chunks j with j % kChains == c (the compiler keeps the order fmaxf
  // and + are written in, so one accumulator would be one chain); then a tree joins the chains.
  float tile_max[2];
  // Unmasked: the maximum on the scores' bits, two scores a VIMNMX3, exact where it is >= 0 (the
  // chapter's header); the warp goes on only if that holds for all of its threads' rows.
  bool found = false;
  if constexpr (!kMasked) {
    int part_max[2][kChains];
#pragma unroll
    for (int c = 0; c < kChains; ++c) part_max[0][c] = part_max[1][c] = INT_MIN;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        int& chain = part_max[half][j % kChains];
        chain = __vimax3_s32(chain, __float_as_int(s[4 * j + 2 * half]),
                             __float_as_int(s[4 * j + 2 * half + 1]));
      }
    bool exact = true;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int step = 1; step < kChains; step *= 2)
#pragma unroll
        for (int c = 0; c + step < kChains; c += 2 * step)
          part_max[half][c] = max(part_max[half][c], part_max[half][c + step]);
      tile_max[half] = __int_as_float(part_max[half][0]);
      exact = exact && part_max[half][0] >= 0;
    }
    found = __all_sync(kFullWarp, exact);
  }
  // Masked, or a row of the warp whose scores here are all below zero: the float maximum.
  if (!found) {
    float part_max[2][kChains];
#pragma unroll
    for (int c = 0; c < kChains; ++c) part_max[0][c] = part_max[1][c] = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // i = 2 * half + column
        float& score = s[4 * j + i];
        if (kMasked && kv_start + 8 * j + 2 * t + i % 2 >= row_end[i / 2]) score = -INFINITY;
        part_max[i / 2][j % kChains] = fmaxf(part_max[i / 2][j % kChains], score);
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int step = 1; step < kChains; step *= 2)
#pragma unroll
        for (int c = 0; c + step < kChains; c += 2 * step)
          part_max[half][c] = fmaxf(part_max[half][c], part_max[half][c + step]);
      tile_max[half] = part_max[half][0];
    }
  }
  float base[2];   // what the exponents are taken against: the new max times scale_log2, or 0
                   // while it is -inf
  float shift[2];  // added in the exponent: kPScaleLog2 - base, so that P reaches 2^8
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float new_max = fmaxf(row_max[half], quad_max(tile_max[half]));
    base[half] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
    shift[half] = kPScaleLog2 - base[half];
    // m_old c rounded as base was: when the max did not move, the same float, and alpha exactly
    // 1. Written as row_max * scale_log2 - base, the compiler fuses it into an FFMA whose product
    // is exact: alpha = 2^(the rounding of m c), on every tile (chapter 06's README).
    alpha[half] = exp2_fast(__fmul_rn(row_max[half], scale_log2) - base[half]);
    row_max[half] = new_max;
    row_sum[half] *= alpha[half];
  }
  float part_sum[2][kChains] = {};
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    s[i] = exp2_fast(fmaf(s[i], scale_log2, shift[i % 4 / 2]));
    part_sum[i % 4 / 2][i / 4 % kChains] += s[i];
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int step = 1; step < kChains; step *= 2)
#pragma unroll
      for (int c = 0; c + step < kChains; c += 2 * step)
        part_sum[half][c] += part_sum[half][c + step];
    row_sum[half] += part_sum[half][0];
  }
}

// Four floats as four e4m3 bytes of one register, the first in the lowest byte (cvt with
// satfinite: a value past 448 would become 448, though P never exceeds 256).
__device__ uint32_t pack_e4m3(float x0, float x1, float x2, float x3) {
  const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return low | high << 16;
}

// P packed as e4m3 into the A fragments of P V. The 32 keys of k step kk are S registers
// 16 kk .. 16 kk + 15 (r0 .. r15 below): four 8-key chunks, each holding keys 2t, 2t + 1 of rows
// g (r0, r1) and g + 8 (r2, r3). An e4m3 A fragment wants in a0 four consecutive k of row g,
// 4t .. 4t + 3. Rather than shuffle bytes between lanes, a0 takes this thread's own keys 2t, 2t + 1
// (r0, r1) and 8 + 2t, 9 + 2t (r4, r5): so k 4t .. 4t + 3 of the product stand for keys
// 2t, 2t + 1, 8 + 2t, 9 + 2t, and the producer stores V^T's keys in that order (transpose_tile).
template <int kBlockN>
__device__ void pack_p(const float (&s)[kBlockN / 2], uint32_t (&p)[kBlockN / 32][4]) {
#pragma unroll
  for (int kk = 0; kk < kBlockN / 32; ++kk) {
    const float* r = s + 16 * kk;
    p[kk][0] = pack_e4m3(r[0], r[1], r[4], r[5]);      // row g, keys 0 .. 15 of the 32
    p[kk][1] = pack_e4m3(r[2], r[3], r[6], r[7]);      // row g + 8
    p[kk][2] = pack_e4m3(r[8], r[9], r[12], r[13]);    // row g, keys 16 .. 31
    p[kk][3] = pack_e4m3(r[10], r[11], r[14], r[15]);  // row g + 8
  }
}

// O's bf16 row in 16-byte stores. Lane t of a quad holds word t (columns 2t and 2t + 1, a bf16
// pair) of each 8-column chunk of its row; two exchanges inside the quad give lane t all four
// words of chunk 4k + t of every group k of four chunks, one 16-byte store each:
//
//   before:               lane 0: c0.w0 c1.w0 c2.w0 c3.w0    (cN.wM: word M of chunk N)
//                         lane 1: c0.w1 c1.w1 c2.w1 c3.w1    ... lanes 2 and 3 alike
//   with lane t ^ 1:      even lanes keep chunks 0 and 2, odd lanes 1 and 3, two words of each
//   with lane t ^ 2:      lanes 0, 1 keep their chunk of 0, 1; lanes 2, 3 theirs of 2, 3
//   after:                lane t: ct.w0 ct.w1 ct.w2 ct.w3 (16 contiguous bytes)
//
// Every lane of the warp must come here (the shuffles name the whole warp); rows past the end
// are left out at the store, not before.
template <int kChunks>
__device__ void quad_transpose(const uint32_t (&w)[kChunks], uint4 (&out)[kChunks / 4], int t) {
  const bool odd = t & 1, high = t & 2;
#pragma unroll
  for (int k = 0; k < kChunks / 4; ++k) {
    const uint32_t* c = &w[4 * k];
    uint32_t lo[2], hi[2];  // words t & ~1 and t | 1 of chunks t & 1 and 2 + (t & 1)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t got = __shfl_xor_sync(kFullWarp, odd ? c[2 * p] : c[2 * p + 1], 1);
      lo[p] = odd ? got : c[2 * p];
      hi[p] = odd ? c[2 * p + 1] : got;
    }
    const uint32_t got_lo = __shfl_xor_sync(kFullWarp, high ? lo[0] : lo[1], 2);
    const uint32_t got_hi = __shfl_xor_sync(kFullWarp, high ? hi[0] : hi[1], 2);
    out[k] =
        high ? make_uint4(got_lo, got_hi, lo[1], hi[1]) : make_uint4(lo[0], hi[0], got_lo, got_hi);
  }
}

// O *= alpha, row by row (columns 8 j + 2 t, + 1 of rows g and g + 8: alpha[0] and alpha[1]).
template <int kN>
__device__ void rescale(float (&o)[kN], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < kN / 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[4 * j + i] *= alpha[i / 2];
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

// The 16-byte chunk of a row that the 128- or 64-byte swizzle swaps chunk 0 with: a row of 128
// bytes is one 16-byte chunk per row of an 8-row atom; two 64-byte rows share one.
template <int kWidth>
__device__ int swizzle_of_row(int row) {
  return kWidth == 128 ? row & 7 : (row >> 1) & 3;
}

// The producer's transpose of one tile: raw V (kBlockN keys x head_dim bytes, as TMA left it, in
// K's panels and swizzle) to V^T (head_dim rows of kBlockN keys in pack_p's order within each 16,
// in V^T's panels and swizzle), by the 4 producer warps. A warp's unit is 16 keys x 32 columns
// (512 bytes): one ldmatrix .trans of four 8-key x 16-column matrices (keys 0-7 and 8-15 of
// columns 0-15, then of 16-31), byte permutes, one stmatrix of four 8-row x 16-key matrices. The
// 16-bit elements are pairs of bytes: ldmatrix .trans leaves lane l (q = l % 4, c = l / 4) in r[0]
// the bytes (key 2q, column 2c), (2q, 2c + 1), (2q + 1, 2c), (2q + 1, 2c + 1), in r[1] the same for
// keys 8 + 2q, 9 + 2q. V^T row 2c wants at positions 4q .. 4q + 3 keys 2q, 2q + 1, 8 + 2q, 9 + 2q
// (pack_p's order): bytes 0 and 2 of r[0], then of r[1]; row 2c + 1 bytes 1 and 3. Each lane thus
// holds in out[m] four consecutive bytes of row 2c + m % 2 (+ 16 for m >= 2): lanes 4c .. 4c + 3
// (c = 0 .. 7) hold stmatrix's row c of matrix m, V^T's row 2c (or 2c + 1), as stmatrix wants.
template <int kHeadDim>
__device__ void transpose_tile(const unsigned char* raw, unsigned char* vt, int thread) {
  using S = Smem<kHeadDim>;
  constexpr int kColBlocks = kHeadDim / 32, kGroups = S::kBlockN / kKeyGroup;
  // Warp w takes column blocks w, w + 4, .. and all groups of 16 keys; at d 64, with two column
  // blocks, warps w and w + 2 share column block w, each taking half of the groups.
  constexpr int kColWarps = kColBlocks < 4 ? kColBlocks : 4;
  constexpr int kWarpGroups = kGroups / (4 / kColWarps);  // groups per warp
  // A V^T panel row holds kChunks groups; 4 groups at a time are unrolled (a multiple of 4 in
  // every tile). At d 128 their chunks are then constants and only the row's swizzle is not.
  constexpr int kChunks = S::kVPanelWidth / kKeyGroup, kUnroll = 4;
  const int warp = thread % 128 / 32, lane = thread % 32;
  const int m = lane / 8, i = lane % 8;  // the matrix and row whose address this lane gives
  const int first_group = warp / kColWarps * kWarpGroups;
#pragma unroll
  for (int c = 0; c < kColBlocks / kColWarps; ++c) {
    const int col32 = 32 * (warp % kColWarps + kColWarps * c);
    const int col = col32 + 16 * (m / 2);  // of raw V: this lane's row's first column
    const int key0 = first_group * kKeyGroup + 8 * (m % 2) + i;
    // Keys 16 apart share their swizzle: one address, then a step per group.
    const unsigned char* src =
        raw + col / S::kPanelWidth * S::kKPanelBytes + key0 * S::kPanelWidth +
        16 * ((col % S::kPanelWidth / 16) ^ swizzle_of_row<S::kPanelWidth>(key0));
    const int row = col32 + 16 * (m / 2) + 2 * i + m % 2;  // of V^T (a column of V)
    const int row_swizzle = swizzle_of_row<S::kVPanelWidth>(row);
#pragma unroll 1
    for (int g0 = 0; g0 < kWarpGroups; g0 += kUnroll) {
      const int group0 = first_group + g0;  // a multiple of kUnroll
      unsigned char* dst = vt + group0 / kChunks * S::kVPanelBytes + row * S::kVPanelWidth;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        uint32_t r[4];
        hopper::ldmatrix_x4_trans(src + (g0 + u) * kKeyGroup * S::kPanelWidth, r);
        const uint32_t out[4] = {__byte_perm(r[0], r[1], 0x6420), __byte_perm(r[0], r[1], 0x7531),
                                 __byte_perm(r[2], r[3], 0x6420), __byte_perm(r[2], r[3], 0x7531)};
        hopper::stmatrix_x4(dst + 16 * ((group0 % kChunks + u) ^ row_swizzle), out);
      }
    }
  }
}

// A tile: one block of query rows of one (batch, head), and the key blocks it sees. Tiles are
// numbered as chapter 36's blocks were: tile / num_q_blocks is the (batch, head), and its query
// blocks go from the last (chapter 10's order: the longest causal blocks first).
template <int kHeadDim>
struct Tile {
  int batch_head, kv_head, q_start;
  int num_kv_blocks, num_unmasked_blocks;  // the key blocks it sees; those that need no mask
  __device__ Tile(const AttentionShape& shape, int tile, int num_q_blocks) {
    using B = Block<kHeadDim>;
    batch_head = tile / num_q_blocks;
    const int batch = batch_head / shape.heads_q;
    kv_head = batch * shape.heads_kv + batch_head % shape.heads_q / shape.group_size();
    q_start = (num_q_blocks - 1 - tile % num_q_blocks) * B::kRows;
    // The key blocks this query block sees (causal: up to its bottom row's diagonal, bottom-right
    // aligned, the rest skipped); only blocks that reach past the first row's diagonal, or past
    // the end, need a mask. All consumers walk the same blocks: they share every tile.
    const int q_last = min(q_start + B::kRows, shape.seqlen_q) - 1;
    const int kv_end = shape.causal
                           ? max(0, min(shape.seqlen_k, q_last + shape.causal_offset() + 1))
                           : shape.seqlen_k;
    num_kv_blocks = (kv_end + B::kBlockN - 1) / B::kBlockN;
    const int unmasked_end =
        shape.causal ? min(shape.seqlen_k, q_start + shape.causal_offset() + 1) : shape.seqlen_k;
    num_unmasked_blocks = max(0, unmasked_end) / B::kBlockN;
  }
};

// The static schedule's plan, made by plan(). Tiles 0 .. whole - 1 are walked whole, block b
// taking b, b + blocks, ...; the tail tiles after them, whole .. whole + tail - 1, are shared out
// by key blocks. Counted tile by tile, the tail has tail x kv_blocks key blocks (no mask: every
// tile sees all the keys), cut into blocks runs as equal as integers allow: block b takes key
// blocks [start(b), start(b + 1)), inside one tile or across the end of one into the next. Each
// tile its run touches is a piece of work for the block, as a whole tile is, over some of that
// tile's key blocks; the block's first piece writes to workspace slot 2 b, its second to 2 b + 1.
// Without a split, whole is every tile and tail 0 (and the causal schedule uses only whole).
struct Split {
  int whole = 0, tail = 0;
  int kv_blocks = 1;  // of each tail tile
  int blocks = 1;     // the grid
  __host__ __device__ int span() const { return tail * kv_blocks; }
  // Unsigned 32-bit products: plan() splits only when blocks x span() < 2^31.
  __host__ __device__ int start(int block) const {
    return int(unsigned(block) * unsigned(span()) / unsigned(blocks));
  }
  // The block whose run holds key block `position` of the tail: the last b with start(b) <=
  // position, that is b < (position + 1) blocks / span().
  __device__ int block_of(int position) const {
    return int((unsigned(position + 1) * unsigned(blocks) + unsigned(span()) - 1) /
               unsigned(span())) -
           1;
  }
};

// A unit of work, as producer thread 0 hands it to the other producer threads: key blocks
// [kv_begin, kv_end) of a tile, and the workspace slot its piece goes to; or, with slot -1, a
// whole tile (all its key blocks, counted by its Tile where it is used; kv_begin 0, kv_end
// unused), written to O and lse.
struct Unit {
  int tile, kv_begin, kv_end, slot;
};
// A unit as the consumers get it: kv_end set for a whole tile too, and the numbers of its Tile
// worked out by the producer, so that a consumer has all it needs to issue the unit's S_0 and take
// its softmax without integer divisions of its own (the last turn of the unit before does that).
struct PostedUnit {
  int tile, kv_begin, kv_end, slot;
  int batch_head, kv_head, q_start, num_unmasked_blocks;
};

// A grid of a block per SM (at most one per tile); block b takes tile b first. Then, statically
// (no mask), tiles b + gridDim.x, b + 2 gridDim.x, ... below split.whole, and its pieces of the
// tail; dynamically (causal), whatever tile the counter in device memory hands out next (chapter
// 35). Producer thread 0 asks, and tells the consumers through unit_slot and the other producer
// threads through next_slot. A piece's O / l and log-sum-exp (log2 units) go to piece_o and
// piece_lse, [slot][row of the tile][...]. kSplit: compiled for a split plan; without it (causal
// runs, and a plan that splits nothing) the kernel does chapter 39's arithmetic, every unit a
// whole tile (some of the units' bookkeeping remains: the README's "What is left"). kSitOut:
// compiled with the path of a consumer without rows, launched only where some tile has one.
template <int kHeadDim, bool kDynamic, bool kSplit, bool kSitOut>
__global__ void __launch_bounds__(Block<kHeadDim>::kThreads, 1)
    fp8_persistent_kernel(const __grid_constant__ CUtensorMap q_map,
                          const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, bf16* o, float* lse,
                          int* tile_counter, float* piece_o, float* piece_lse, Split split,
                          AttentionShape shape, float scale_log2, const float* q_descale,
                          const float* k_descale, const float* v_descale) {
  using S = Smem<kHeadDim>;
  using B = Block<kHeadDim>;
  constexpr int kBlockN = B::kBlockN;
  constexpr int kStages = B::kStages;
  constexpr int kOTiles = kHeadDim / 8;  // 8-column chunks of O
  // Registers from setmaxnreg. The producer now keeps the tile loop's state beside the
  // transpose's: at 24 registers (chapter 36) ptxas spills it, at 32 too with three consumers. It
  // gets 40; the consumers 232 at d 128 (two of them; 240 before) and 152 at d 64 (three; 160
  // before), what is left of the block's allocation (384 x 168, or 512 x 128), as setmaxnreg only
  // moves registers within it: a consumer asking for more than is left would wait forever. At
  // d 256 no split fits without a spill (the consumers need 240 there), so this chapter leaves
  // head_dim 256 to chapter 36.
  static_assert(kHeadDim != 256, "head_dim 256 stays with chapter 36's block per tile");
  constexpr int kProducerRegs = 40;
  constexpr int kConsumerRegs = B::kConsumers == 3 ? 152 : 232;
  static_assert(128 * kProducerRegs + B::kConsumers * 128 * kConsumerRegs <=
                    65536 / B::kThreads / 8 * 8 * B::kThreads,
                "setmaxnreg asks for more registers than the block has");
  extern __shared__ unsigned char smem_raw[];
  // Rounded up to 1024 bytes by an offset from smem_raw, not through an integer: the compiler then
  // still knows the pointer is to shared memory (chapter 21).
  unsigned char* smem = smem_raw + ((1024 - hopper::smem_address(smem_raw) % 1024) % 1024);
  auto k_tile = [&](int stage) { return smem + S::kK + stage * S::kKTileBytes; };
  auto v_tile = [&](int stage) { return smem + S::kV + stage * S::kVTileBytes; };
  auto raw_tile = [&](int buffer) { return smem + S::kRawV + buffer * S::kKTileBytes; };
  // mbarriers, Q's per buffer (round r, the block's r-th unit, takes buffer r % 2). q_full: Q
  // landed; q_empty: every consumer thread has retired its last S = Q K^T of the unit, so the unit
  // two rounds later may overwrite it; k_full, k_empty: K's ring (K landed; every consumer thread
  // retired the S that read it); v_full, v_empty: V^T's (transposed; the P V that read it
  // retired), stage by stage beside K's; raw_full: a raw V landed.
  __shared__ uint64_t q_full[2], q_empty[2], k_full[kStages], k_empty[kStages], v_full[kStages],
      v_empty[kStages], raw_full[kRawStages];
  // The unit of round r for the consumers, in unit_slot[r % 2], written by producer thread 0
  // before its arrive on q_full[r % 2] (and read by every consumer thread before its arrive on
  // q_empty[r % 2]); and the unit after the current one for the other producer threads, one slot
  // per parity of the round (a slot is written again two rounds later, after every producer
  // thread has read it).
  __shared__ PostedUnit unit_slot[2];
  __shared__ Unit next_slot[2];

  // Warp-uniform to the compiler (lane 0's value), so that the descriptors built from this
  // consumer's Q tile stay in uniform registers (chapter 33).
  const int warpgroup = __shfl_sync(kFullWarp, threadIdx.x / 128, 0);
  const int num_q_blocks = (shape.seqlen_q + B::kRows - 1) / B::kRows;
  const int num_tiles = num_q_blocks * shape.batch * shape.heads_q;

  if (threadIdx.x == 0) {
    for (int buffer = 0; buffer < 2; ++buffer) {
      hopper::mbarrier_init(&q_full[buffer], 1);
      hopper::mbarrier_init(&q_empty[buffer], B::kConsumers * 128);
    }
    for (int stage = 0; stage < kStages; ++stage) {
      // K's copy (one thread announces its bytes) and V^T's transpose (128 producer threads).
      hopper::mbarrier_init(&k_full[stage], 1);
      hopper::mbarrier_init(&v_full[stage], 128);
      hopper::mbarrier_init(&k_empty[stage], B::kConsumers * 128);
      hopper::mbarrier_init(&v_empty[stage], B::kConsumers * 128);
    }
    for (int buffer = 0; buffer < kRawStages; ++buffer) hopper::mbarrier_init(&raw_full[buffer], 1);
  }
  __syncthreads();
  // The merge kernel after this one may be launched now: it waits for this whole grid to finish
  // before it reads anything (chapter 19's programmatic dependent launch).
  if (kSplit) allow_next_grid();

  if (warpgroup == 0) {
    // The producer: thread 0 copies each tile's Q, then K and raw V by TMA; all 128 transpose each
    // raw V tile into its stage's V^T, up to kStages tiles ahead of the consumers. The ring does
    // not restart with a tile: fill counts every K/V tile this block has copied (and the raw
    // buffers alternate with it), so the next tile's copies take the next stages, and its first
    // raw V is copied while the current tile's last one is transposed.
    hopper::release_registers<kProducerRegs>();
    const int thread = threadIdx.x;
    auto load_raw_v = [&](int kv_head, int kv_block, unsigned fill) {
      const unsigned buffer = fill % kRawStages;
      hopper::mbarrier_arrive_expect_tx(&raw_full[buffer], S::kKTileBytes);
      for (int p = 0; p < S::kPanels; ++p)
        hopper::tma_load(raw_tile(buffer) + p * S::kKPanelBytes, &v_map, &raw_full[buffer],
                         p * S::kPanelWidth, kv_block * kBlockN, kv_head);
    };
    // This block's run of the tail's key blocks, [position, run_end), and its next piece's slot:
    // thread 0's move on, the other threads learn each unit after the first from next_slot.
    int position = split.start(blockIdx.x), slot = 2 * blockIdx.x;
    const int run_end = split.start(blockIdx.x + 1);
    // The unit of a tile below split.whole: the whole tile. Past it, the next piece of the run
    // (the tail tile its position is in, up to that tile's end or the run's), else the end of the
    // list. Without kSplit every unit is a whole tile, as in chapter 39.
    auto unit_of = [&](int tile) {
      Unit unit = {tile, 0, 0, -1};
      if (kSplit && tile >= split.whole) {
        unit.tile = num_tiles;
        if (position < run_end) {
          const int i = position / split.kv_blocks;  // the tail tile
          unit = {split.whole + i, position - i * split.kv_blocks,
                  min(run_end - i * split.kv_blocks, split.kv_blocks), slot++};
          position += unit.kv_end - unit.kv_begin;
        }
      }
      return unit;
    };
    // A unit's key blocks: a piece's own, a whole tile's all of its Tile's (the constant 0 lets
    // the compiler drop what a kernel without kSplit does not need).
    auto begin_of = [&](const Unit& unit) { return kSplit ? unit.kv_begin : 0; };
    auto end_of = [&](const Unit& unit, const Tile<kHeadDim>& w) {
      return kSplit && unit.slot >= 0 ? unit.kv_end : w.num_kv_blocks;
    };
    // The unit after one of tile `tile`: the next whole tile, by stride or from the counter; past
    // split.whole the tile stays there and the run's pieces follow.
    auto next_unit = [&](int tile) {
      if (!kSplit || tile < split.whole)
        tile = kDynamic ? int(gridDim.x) + atomicAdd(tile_counter, 1) : tile + int(gridDim.x);
      return unit_of(tile);
    };
    unsigned fill = 0;       // unsigned: % and / by kStages cost less
    bool preloaded = false;  // thread 0: this unit's first raw V went out during the last unit
    Unit unit = unit_of(blockIdx.x);  // every producer thread's copy
    for (unsigned round = 0;; ++round) {
      if (thread == 0) {
        // Round r's unit goes to the consumers in unit_slot[r % 2], its Q to buffer r % 2, both
        // released by q_full[r % 2]. The buffer is free once every consumer thread has retired
        // the Q K^T of the unit two rounds back (and so has read its unit_slot): the consumers
        // are then at most a few key blocks behind the producer, in the last unit, and this
        // unit's Q lands while they finish it. Past the last tile the index says so, and q_full
        // completes without a copy.
        const unsigned q_buffer = round % 2;
        if (round >= 2) hopper::mbarrier_wait(&q_empty[q_buffer], (round / 2 - 1) % 2);
        if (unit.tile >= num_tiles) {
          unit_slot[q_buffer].tile = unit.tile;
          hopper::mbarrier_arrive(&q_full[q_buffer]);
        } else {
          const Tile<kHeadDim> w(shape, unit.tile, num_q_blocks);
          unit_slot[q_buffer] = {unit.tile, begin_of(unit),       end_of(unit, w),
                                 unit.slot, w.batch_head,         w.kv_head,
                                 w.q_start, w.num_unmasked_blocks};
          hopper::mbarrier_arrive_expect_tx(&q_full[q_buffer], B::kConsumers * S::kTileBytes);
          for (int c = 0; c < B::kConsumers; ++c)
            for (int p = 0; p < S::kPanels; ++p)
              hopper::tma_load(smem + S::kQ + q_buffer * S::kQBufferBytes + c * S::kTileBytes +
                                   p * S::kQPanelBytes,
                               &q_map, &q_full[q_buffer], p * S::kPanelWidth,
                               w.q_start + c * kConsumerRows, w.batch_head);
          if (!preloaded && end_of(unit, w) > begin_of(unit))
            load_raw_v(w.kv_head, begin_of(unit), fill);
        }
      }
      if (unit.tile >= num_tiles) break;
      const Tile<kHeadDim> w(shape, unit.tile, num_q_blocks);
      const int kv_begin = begin_of(unit), kv_end = end_of(unit, w);
      preloaded = false;
      for (int kv_block = kv_begin; kv_block < kv_end; ++kv_block, ++fill) {
        const unsigned stage = fill % kStages, use = fill / kStages, buffer = fill % kRawStages;
        const unsigned raw_phase = fill / kRawStages % 2;
        // Thread 0 waits for the stage's previous K to have been read by every consumer thread,
        // copies K, then waits for the previous V^T to have been read and for this raw V; the
        // other producer threads sleep on the named barrier meanwhile, which also tells thread 0
        // that all of them finished the previous transpose.
        if (thread == 0) {
          if (use > 0) hopper::mbarrier_wait(&k_empty[stage], (use - 1) % 2);
          hopper::mbarrier_arrive_expect_tx(&k_full[stage], S::kKTileBytes);
          for (int p = 0; p < S::kPanels; ++p)
            hopper::tma_load(k_tile(stage) + p * S::kKPanelBytes, &k_map, &k_full[stage],
                             p * S::kPanelWidth, kv_block * kBlockN, w.kv_head);
          if (use > 0) hopper::mbarrier_wait(&v_empty[stage], (use - 1) % 2);
          hopper::mbarrier_wait(&raw_full[buffer], raw_phase);
        }
        hopper::named_barrier_sync(kProducerBarrier, 128);
        // Both phases are complete now; each thread's own wait (at once) orders its accesses
        // after the consumers' reads of the stage's V^T and TMA's writes of the raw V.
        if (use > 0) hopper::mbarrier_wait(&v_empty[stage], (use - 1) % 2);
        hopper::mbarrier_wait(&raw_full[buffer], raw_phase);
        // The next raw V goes to the other buffer, whose transpose every producer thread
        // finished: this unit's next, or after its last, the next unit's first.
        if (thread == 0) {
          if (kv_block + 1 < kv_end) {
            load_raw_v(w.kv_head, kv_block + 1, fill + 1);
          } else {
            const Unit next = next_unit(unit.tile);
            next_slot[round % 2] = next;
            if (next.tile < num_tiles) {
              const Tile<kHeadDim> n(shape, next.tile, num_q_blocks);
              if (end_of(next, n) > begin_of(next)) load_raw_v(n.kv_head, begin_of(next), fill + 1);
              preloaded = true;
            }
          }
        }
        transpose_tile<kHeadDim>(raw_tile(buffer), v_tile(stage), thread);
        // The stores become visible to wgmma (the async proxy); then this thread's arrival.
        hopper::fence_proxy_async();
        hopper::mbarrier_arrive(&v_full[stage]);
      }
      if (thread == 0 && kv_end == kv_begin) next_slot[round % 2] = next_unit(unit.tile);
      // Every producer thread learns the next unit.
      hopper::named_barrier_sync(kProducerBarrier, 128);
      unit = next_slot[round % 2];
    }
    // The producer's work ends with its last transpose handed over. Its copies complete on
    // mbarriers that the consumers wait on, in shared memory that lives until the block's last
    // thread exits.
    return;
  }

  // A consumer: 64 query rows of every tile, its own Q in each buffer; warp w of it owns rows
  // 16 w .. 16 w + 15.
  hopper::claim_registers<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const unsigned char* own_q = smem + S::kQ + consumer * S::kTileBytes;
  auto q_tile = [&](unsigned r) { return own_q + r % 2 * S::kQBufferBytes; };  // round r's
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int tile_row0 =
      consumer * kConsumerRows + 16 * warp + g;  // this thread's first row, in a tile
  // The turns go round: this consumer waits on barrier 1 + consumer and signals the next one's
  // (0 is __syncthreads, kProducerBarrier the producer's); each barrier completes when 256 threads
  // have come, 128 of the consumer that waits and 128 of the one before it. In every tile consumer
  // 0 goes first. The last consumer gives consumer 0 its first signal after its own last turn of
  // the tile before, so that consumer 0 may start the next tile while the others finish this one;
  // in the block's first tile with keys, before the tile's first turn. A merged turn (below) is the
  // last turn of one unit and the first of the next, so its signal is that first signal, and the
  // next unit sends no other. A signal after the block's last turn, which no turn takes, consumer 0
  // takes before it exits (chapter 35).
  const bool last = consumer == B::kConsumers - 1;
  const int own_barrier = 1 + consumer, other_barrier = 1 + (consumer + 1) % B::kConsumers;
  constexpr int kTurnThreads = 2 * 128;
  // Round r's unit: wait_unit waits until its Q has landed, read_unit then reads it from
  // unit_slot[r % 2] (which stays until every consumer thread has arrived on q_empty[r % 2])
  // through shuffles, so that the compiler knows it is the same in the whole warp. A unit is read
  // twice when merged: in the last turn of the unit before, to decide and issue its S_0, and at the
  // top of its own round; so no consumer arrives on its q_empty before that second read.
  auto wait_unit = [&](unsigned r) { hopper::mbarrier_wait(&q_full[r % 2], r / 2 % 2); };
  auto read_unit = [&](unsigned r) {
    const PostedUnit& posted = unit_slot[r % 2];
    PostedUnit unit;
    unit.tile = __shfl_sync(kFullWarp, posted.tile, 0);
    unit.slot = kSplit ? __shfl_sync(kFullWarp, posted.slot, 0) : -1;
    unit.kv_begin = kSplit ? __shfl_sync(kFullWarp, posted.kv_begin, 0) : 0;
    unit.kv_end = __shfl_sync(kFullWarp, posted.kv_end, 0);
    unit.batch_head = __shfl_sync(kFullWarp, posted.batch_head, 0);
    unit.kv_head = __shfl_sync(kFullWarp, posted.kv_head, 0);
    unit.q_start = __shfl_sync(kFullWarp, posted.q_start, 0);
    unit.num_unmasked_blocks = __shfl_sync(kFullWarp, posted.num_unmasked_blocks, 0);
    return unit;
  };
  // Whether a consumer of the tile sits it out (the last one has the fewest rows), and the first
  // key each of this thread's rows (row0, row0 + 8) cannot see.
  auto has_idle_consumer = [&](const PostedUnit& w) {
    return kSitOut && w.q_start + (B::kConsumers - 1) * kConsumerRows >= shape.seqlen_q;
  };
  auto row_ends = [&](int row0, int(&row_end)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int query = row0 + 8 * half;
      row_end[half] =
          shape.causal ? min(shape.seqlen_k, query + shape.causal_offset() + 1) : shape.seqlen_k;
    }
  };

  // Key blocks of the rings this block's consumers have read before this unit (unsigned: % and /
  // by kStages cost less).
  unsigned read = 0;
  // Whether a signal from the last consumer waits on consumer 0's barrier: every consumer keeps it
  // alike (it follows from the tiles' key counts).
  bool signalled = false;
  // Whether this unit's S_0 was issued in the last turn of the unit before, its softmax taken into
  // row_max and row_sum, and P_0 packed into p: every consumer keeps it alike too.
  bool started = false;
  float row_max[2], row_sum[2];  // of the unscaled scores; this thread's columns only
  float o_acc[kHeadDim / 2] = {};
  float s[kBlockN / 2];
  uint32_t p[kBlockN / 32][4];
  wait_unit(0);
  for (unsigned round = 0;; ++round) {
    const PostedUnit w = read_unit(round);
    if (w.tile >= num_tiles) break;
    // The unit's key blocks, kv_begin + 0 .. kv_begin + num_kv_blocks - 1, and its piece's slot.
    const int slot = w.slot, kv_begin = w.kv_begin, num_kv_blocks = w.kv_end - kv_begin;
    const int row0 = w.q_start + tile_row0;  // this thread's first row
    const unsigned char* q = q_tile(round);

    // The descales of this tile's head group: Q's and K's join the softmax's scale (the scores
    // are of the stored e4m3 numbers), V's the final 1 / l.
    const float tile_scale_log2 = scale_log2 * q_descale[w.kv_head] * k_descale[w.kv_head];
    const float v_scale = v_descale[w.kv_head];
    if (!started) {
      row_max[0] = row_max[1] = -INFINITY;
      row_sum[0] = row_sum[1] = 0.0f;
    }
    int row_end[2];
    row_ends(row0, row_end);
    // A unit that sees no key frees Q's buffer at once, and so does one of a single key block
    // whose S_0 the last turn of the unit before issued: only now, with the unit read, for the
    // producer may then write unit_slot[round % 2] again.
    if (num_kv_blocks == 0 || (started && num_kv_blocks == 1))
      hopper::mbarrier_arrive(&q_empty[round % 2]);
    if (num_kv_blocks > 0) {
      // (after a merged turn signalled is true: that turn's signal is consumer 0's next)
      if (last && !signalled) hopper::named_barrier_arrive(other_barrier, kTurnThreads);
      signalled = false;  // consumer 0's next turn takes it
    }
    const bool idle_consumer = has_idle_consumer(w);

    // A consumer whose rows all lie past the end of the queries (the last consumers of a tile at
    // the end of a sequence whose length is not a multiple of the tile's rows) sits the tile out.
    // It takes its turns, so that the ring of named barriers goes round as before, and tells the
    // producer when it is done with each K, each V^T and Q, as the others do; but it issues no
    // wgmma, takes no softmax and writes nothing, and leaves the tensor cores and the exponential
    // unit to the consumers that have rows. Its arrivals on k_empty[stage] and v_empty[stage] must
    // count for this fill, not the one before: its turn comes after consumer 0's (which always has
    // rows) and so after consumer 0's waits for the stage, and it waits on k_full[stage] and
    // v_full[stage] itself too, so that the order does not rest on the ring alone. The test is the
    // same for the whole warpgroup, so the branch is uniform, and the path for a consumer with rows
    // is untouched. Compiled only where launched for a length that leaves consumers idle: a branch
    // never taken still changed the kernel's SASS, and the kernel ran 2% slower where tiles are
    // short (the README).
    if (kSitOut && w.q_start + consumer * kConsumerRows >= shape.seqlen_q) {
      for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
        const unsigned index = read + kv_block, stage = index % kStages;
        if (kv_block == 0) {  // the first turn, S_0's
          hopper::mbarrier_wait(&k_full[stage], index / kStages % 2);
          hopper::named_barrier_sync(own_barrier, kTurnThreads);
          hopper::named_barrier_arrive(other_barrier, kTurnThreads);
          if (num_kv_blocks == 1) hopper::mbarrier_arrive(&q_empty[round % 2]);
        }
        if (kv_block + 1 < num_kv_blocks) {
          const unsigned next = index + 1, next_stage = next % kStages;
          hopper::mbarrier_wait(&k_full[next_stage], next / kStages % 2);
          hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
          hopper::named_barrier_sync(own_barrier, kTurnThreads);
          hopper::named_barrier_arrive(other_barrier, kTurnThreads);
          if (kv_block + 2 == num_kv_blocks) hopper::mbarrier_arrive(&q_empty[round % 2]);
        } else {
          hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
          hopper::named_barrier_sync(own_barrier, kTurnThreads);
          hopper::named_barrier_arrive(other_barrier, kTurnThreads);
          signalled = true;
        }
        hopper::mbarrier_arrive(&k_empty[stage]);
        hopper::mbarrier_arrive(&v_empty[stage]);
      }
      read += num_kv_blocks;
      wait_unit(round + 1);  // a unit beside one with an idle consumer is never merged
      continue;
    }

    // The first turn issues S_0 = Q K_0^T alone, once K_0 has landed (V_0's transpose may still
    // run); its softmax gives P_0 (O is still 0), with the mask only where block kv_begin needs
    // it, as in the loop below. Not when the last turn of the unit before did.
    if (num_kv_blocks > 0 && !started) {
      const unsigned stage = read % kStages;
      hopper::mbarrier_wait(&k_full[stage], read / kStages % 2);
      hopper::named_barrier_sync(own_barrier, kTurnThreads);
      issue_qk<kHeadDim>(s, q, k_tile(stage));
      hopper::named_barrier_arrive(other_barrier, kTurnThreads);
      hopper::wgmma_wait<0>();
      hopper::fence_operands(s);
      hopper::mbarrier_arrive(&k_empty[stage]);
      if (num_kv_blocks == 1) hopper::mbarrier_arrive(&q_empty[round % 2]);  // the last Q K^T
      float alpha[2];
      if (kv_begin >= w.num_unmasked_blocks)
        softmax_step<true, kBlockN>(s, alpha, row_max, row_sum, row_end, kv_begin * kBlockN,
                                    tile_scale_log2, t);
      else
        softmax_step<false, kBlockN>(s, alpha, row_max, row_sum, row_end, kv_begin * kBlockN,
                                     tile_scale_log2, t);
      pack_p<kBlockN>(s, p);
    }
    // Whether the next unit's Q was waited for in this one's last turn (not for a unit without
    // keys, nor at head_dim 64), and merged: whether that turn issued its S_0.
    bool next_waited = false, merged = false;
    // This unit's 1 / l with V's descale, and lse in log2 units, per row half: O = o_acc * inv_l
    // and lse = (m c + log2 l - 8) / log2 e (l and o_acc both carry P's 2^8). Taken from row_max
    // and row_sum when the unit's keys are done; in a merged turn before the next unit's softmax
    // overwrites them.
    float inv_l[2], lse2[2];
    auto finish_rows = [&] {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float l = quad_sum(row_sum[half]);
        inv_l[half] = l > 0.0f ? v_scale / l : 0.0f;  // a row that saw no key outputs 0
        lse2[half] = l > 0.0f ? __fmul_rn(row_max[half], tile_scale_log2) + log2f(l) - kPScaleLog2
                              : -INFINITY;
      }
    };
    // A last turn with P V alone, as in chapter 48 (where the merge is compiled, after the wait
    // for the next unit, which decided against it).
    auto last_turn = [&](unsigned index) {
      const unsigned stage = index % kStages;
      hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
      hopper::named_barrier_sync(own_barrier, kTurnThreads);
      issue_pv<kHeadDim>(o_acc, p, v_tile(stage));
      // To the next consumer; from the last, consumer 0's first signal of the next unit.
      hopper::named_barrier_arrive(other_barrier, kTurnThreads);
      signalled = true;
      hopper::wgmma_wait<0>();
      hopper::fence_operands(o_acc);
      hopper::fence_operands(p);
    };
    for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
      const unsigned index = read + kv_block, stage = index % kStages;  // in the ring's sequence
      // A turn: S_{j+1} = Q K_{j+1}^T, then O += P_j V_j, issued back to back between this
      // consumer's waits (K_{j+1}, V_j) and its signal to the next (the last turn's S is the next
      // unit's S_0, or none, and the last consumer's signal after it is for the next unit).
      if (kv_block + 1 < num_kv_blocks) {
        const unsigned next_index = index + 1, next_stage = next_index % kStages;
        hopper::mbarrier_wait(&k_full[next_stage], next_index / kStages % 2);
        hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
        hopper::named_barrier_sync(own_barrier, kTurnThreads);
        issue_qk<kHeadDim>(s, q, k_tile(next_stage));
        issue_pv<kHeadDim>(o_acc, p, v_tile(stage));
        hopper::named_barrier_arrive(other_barrier, kTurnThreads);
        // The overlap: wait for S_{j+1} alone (the older of the two groups) and take its softmax
        // while P_j V_j still runs; then wait for P_j V_j, and only then rescale O and overwrite P.
        hopper::wgmma_wait<1>();
        hopper::fence_operands(s);
        // K_{j+1} is read: its slot may take a K again, while V_{j+1} still waits for its turn.
        hopper::mbarrier_arrive(&k_empty[next_stage]);
        // The unit's last Q K^T has retired: its Q's buffer may take the unit after next.
        if (kv_block + 2 == num_kv_blocks) hopper::mbarrier_arrive(&q_empty[round % 2]);
        float alpha[2];
        const int kv_start = (kv_begin + kv_block + 1) * kBlockN;
        if (kv_begin + kv_block + 1 >= w.num_unmasked_blocks)
          softmax_step<true, kBlockN>(s, alpha, row_max, row_sum, row_end, kv_start,
                                      tile_scale_log2, t);
        else
          softmax_step<false, kBlockN>(s, alpha, row_max, row_sum, row_end, kv_start,
                                       tile_scale_log2, t);
        // Without this fence the compiler may move the exponentials below the wait, into the
        // time the overlap was to save: the fence pins them before it.
        hopper::fence_operands(s);
        hopper::wgmma_wait<0>();
        hopper::fence_operands(o_acc);
        hopper::fence_operands(p);
        // alpha is exactly 1 where a row's maximum did not grow: the warp skips the multiplies
        // when that holds for all its rows (a vote, so the branch is uniform).
        if (__any_sync(kFullWarp, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale(o_acc, alpha);
        pack_p<kBlockN>(s, p);
      } else if (B::kOverlap) {
        // The last turn. The next unit's Q has usually landed by now (the producer copied it once
        // it was through this unit's copies, some key blocks ahead; a unit of one or two blocks may
        // wait here), and with it the unit, which every consumer reads alike: merged only where it
        // has keys and neither unit has an idle consumer. What the next unit's softmax needs (its
        // descales, row ends) is worked out after the issue, while S_0 runs.
        wait_unit(round + 1);
        next_waited = true;
        const PostedUnit next = read_unit(round + 1);
        merged = next.tile < num_tiles && next.kv_end > next.kv_begin && !idle_consumer &&
                 !has_idle_consumer(next);
        if (merged) {
          // The merged turn, in order: (1) the next unit's S_0 with this unit's last P V, issued as
          // a turn of the loop issues them; (2) while S_0 runs, the next unit's descales and row
          // ends, and this unit's rows finished (finish_rows) before its maximum and sum are reset;
          // (3) S_0's softmax while P V runs; (4) P V waited for. After the loop: (5) P_0 packed,
          // (6) this unit's O stored, and the next round starts at its second turn.
          const unsigned next_index = index + 1, next_stage = next_index % kStages;
          hopper::mbarrier_wait(&k_full[next_stage], next_index / kStages % 2);
          hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
          hopper::named_barrier_sync(own_barrier, kTurnThreads);
          issue_qk<kHeadDim>(s, q_tile(round + 1), k_tile(next_stage));
          issue_pv<kHeadDim>(o_acc, p, v_tile(stage));
          hopper::named_barrier_arrive(other_barrier, kTurnThreads);
          signalled = true;
          const float next_scale_log2 =
              scale_log2 * q_descale[next.kv_head] * k_descale[next.kv_head];
          int next_row_end[2];
          row_ends(next.q_start + tile_row0, next_row_end);
          // This unit's rows finished; the next unit's maximum and sum start from nothing, with
          // S_0.
          finish_rows();
#pragma unroll
          for (int half = 0; half < 2; ++half) row_max[half] = -INFINITY, row_sum[half] = 0.0f;
          hopper::wgmma_wait<1>();
          hopper::fence_operands(s);
          hopper::mbarrier_arrive(&k_empty[next_stage]);
          float alpha[2];
          // With the mask only where the next unit's first block needs it.
          if (next.kv_begin >= next.num_unmasked_blocks)
            softmax_step<true, kBlockN>(s, alpha, row_max, row_sum, next_row_end,
                                        next.kv_begin * kBlockN, next_scale_log2, t);
          else
            softmax_step<false, kBlockN>(s, alpha, row_max, row_sum, next_row_end,
                                         next.kv_begin * kBlockN, next_scale_log2, t);
          hopper::fence_operands(s);
          hopper::wgmma_wait<0>();
          hopper::fence_operands(o_acc);
          hopper::fence_operands(p);
        } else {
          last_turn(index);
        }
      } else {
        last_turn(index);
      }
      // This thread has read V_j (the P V that read it has retired): its V^T slot may be filled
      // again once every consumer thread says so. (K_j's slot was freed when S_j retired.)
      hopper::mbarrier_arrive(&v_empty[stage]);
    }
    read += num_kv_blocks;
    if (!next_waited) wait_unit(round + 1);
    if (merged) {
      pack_p<kBlockN>(s, p);  // the next unit's P_0: this unit's last P V has retired
    } else {
      finish_rows();
    }

    // O and lse straight from the registers; a piece keeps O in fp32 and lse in log2 units, in its
    // slot, for the merge: both descaled already, as the tile's own would be.
    const int64_t head_row0 = int64_t(w.batch_head) * shape.seqlen_q;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int query = row0 + 8 * half;
      if (!kSplit || slot < 0) {
        // A whole tile: O's row in bf16, 16 bytes per store (quad_transpose), lane t of the quad
        // writing columns 32 k + 8 t .. + 7.
        uint32_t words[kOTiles];
#pragma unroll
        for (int j = 0; j < kOTiles; ++j) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(
              o_acc[4 * j + 2 * half] * inv_l[half], o_acc[4 * j + 2 * half + 1] * inv_l[half]);
          words[j] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        uint4 chunks[kOTiles / 4];
        quad_transpose(words, chunks, t);
        if (query >= shape.seqlen_q) continue;
        bf16* o_row = o + (head_row0 + query) * kHeadDim;
#pragma unroll
        for (int k = 0; k < kOTiles / 4; ++k)
          *reinterpret_cast<uint4*>(o_row + 32 * k + 8 * t) = chunks[k];
        if (t == 0) lse[head_row0 + query] = lse2[half] / kLog2e;
        continue;
      }
      // A piece of the split tail: O / l in fp32 and lse in log2 units, for the merge.
      if (query >= shape.seqlen_q) continue;
      const int64_t piece_row = int64_t(slot) * B::kRows + tile_row0 + 8 * half;
      float* o_row = piece_o + piece_row * kHeadDim;
#pragma unroll
      for (int j = 0; j < kOTiles; ++j)
        *reinterpret_cast<float2*>(o_row + 8 * j + 2 * t) = make_float2(
            o_acc[4 * j + 2 * half] * inv_l[half], o_acc[4 * j + 2 * half + 1] * inv_l[half]);
      if (t == 0) piece_lse[piece_row] = lse2[half];
    }
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o_acc[i] = 0.0f;
    started = merged;
  }
  // The last consumer's signal after its last turn: no tile is left to take it.
  if (consumer == 0 && signalled) hopper::named_barrier_sync(own_barrier, kTurnThreads);
}

// The merge: a tail tile's pieces into its O and lse, by chapter 03's rule. A thread takes 4
// columns of one row (a warp per row at head_dim 128, half a warp at 64); the row's pieces are
// those of the blocks whose runs touch its tile, block_of(its first key block) to
// block_of(its last), merged in that order, so the result does not depend on timing:
//   m = max_p lse_p,  w_p = 2^(lse_p - m),  O = sum_p w_p O_p / sum_p w_p,  lse = m + log2 sum w_p
// (log2 units; a piece whose rows saw no key has lse -inf and weight 0, and a row with no weight
// at all gets O = 0 and lse -inf). The pieces carry their descales already: the merge is chapter
// 44's, in floats, with bf16 O at the end. They were just written, so they come from the L2, and
// what costs is the latency of each round of reads: the loads of kPass pieces are issued before
// any is used, and merged against a running max (chapter 19's combine does the same).
constexpr int kMergeThreads = 128;
template <int kHeadDim>
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(const float* piece_o, const float* piece_lse, bf16* o, float* lse, Split split,
                 AttentionShape shape) {
  using B = Block<kHeadDim>;
  constexpr int kLanes = kHeadDim / 4;  // threads per row
  constexpr int kPass = 4;              // pieces read at once
  const int row = blockIdx.x * (kMergeThreads / kLanes) + threadIdx.x / kLanes;
  const int column = threadIdx.x % kLanes * 4;
  const int i = row / B::kRows, tile_row = row % B::kRows;  // tail tile, and its row
  // Launched while the attention kernel may still run: wait until it has finished and its writes
  // are visible.
  wait_for_previous_grid();
  if (i >= split.tail) return;
  const int num_q_blocks = (shape.seqlen_q + B::kRows - 1) / B::kRows;
  const Tile<kHeadDim> w(shape, split.whole + i, num_q_blocks);
  const int query = w.q_start + tile_row;
  if (query >= shape.seqlen_q) return;
  // Blocks first .. last hold the tile's pieces. Every one after the first starts its run inside
  // this tile: its piece is its first (slot 2 b). The first block's run may start in an earlier
  // tile: then this is its second piece (slot 2 b + 1).
  const int tile_start = i * split.kv_blocks;
  const int first = split.block_of(tile_start);
  const int last = split.block_of(tile_start + split.kv_blocks - 1);
  const int first_slot = 2 * first + (split.start(first) < tile_start ? 1 : 0);
  float m = -INFINITY, sum = 0.0f;
  float4 out = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int b0 = first; b0 <= last; b0 += kPass) {
    float piece_m[kPass];
    float4 x[kPass];
#pragma unroll
    for (int p = 0; p < kPass; ++p) {
      piece_m[p] = -INFINITY, x[p] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (b0 + p > last) continue;
      const int slot = b0 + p == first ? first_slot : 2 * (b0 + p);
      const int64_t r = int64_t(slot) * B::kRows + tile_row;
      piece_m[p] = piece_lse[r];
      x[p] = *reinterpret_cast<const float4*>(piece_o + r * kHeadDim + column);
    }
    float m_new = m;
#pragma unroll
    for (int p = 0; p < kPass; ++p) m_new = fmaxf(m_new, piece_m[p]);
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // all -inf so far: every weight 0
    const float alpha = exp2_fast(m - base);
    sum *= alpha;
    out.x *= alpha, out.y *= alpha, out.z *= alpha, out.w *= alpha;
#pragma unroll
    for (int p = 0; p < kPass; ++p) {
      const float weight = exp2_fast(piece_m[p] - base);
      sum += weight;
      out.x += weight * x[p].x, out.y += weight * x[p].y;
      out.z += weight * x[p].z, out.w += weight * x[p].w;
    }
    m = m_new;
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const int64_t out_row = int64_t(w.batch_head) * shape.seqlen_q + query;
  const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(out.x * inv, out.y * inv),
                                  __floats2bfloat162_rn(out.z * inv, out.w * inv)};
  *reinterpret_cast<uint2*>(o + out_row * kHeadDim + column) =
      *reinterpret_cast<const uint2*>(pair);
  if (column == 0) lse[out_row] = sum > 0.0f ? (m + log2f(sum)) / kLog2e : -INFINITY;
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

inline int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

// The plan, and when to split (without the mask only). The tiles make tiles / sms whole rounds
// and a last one of tiles % sms (all of them, if fewer than the SMs): the tail. Shared out by key
// blocks, the tail ends after about tail / sms of a tile's time instead of a whole one, for the
// price of each piece's fixed costs (its Q, its first S, its stores to the slot) and of the
// merge. So it is split only when that round leaves at least a quarter of the SMs idle (tail <=
// 3/4 of them) and every block's run is at least kMinRunBlocks key blocks, long beside those
// costs; and when the run arithmetic fits in 32 bits.
constexpr int kMinRunBlocks = 4;
template <int kHeadDim>
Split plan(const AttentionShape& shape) {
  using B = Block<kHeadDim>;
  const int64_t num_q_blocks = (shape.seqlen_q + B::kRows - 1) / B::kRows;
  const int64_t tiles = num_q_blocks * shape.batch * shape.heads_q;
  const int64_t sms = sm_count();
  Split split;
  split.whole = int(tiles);
  split.blocks = int(std::min(tiles, sms));
  const int64_t tail = tiles % sms;
  const int64_t kv_blocks = (shape.seqlen_k + B::kBlockN - 1) / B::kBlockN;
  if (shape.causal || tail == 0 || 4 * tail > 3 * sms || tail * kv_blocks < kMinRunBlocks * sms ||
      tail * kv_blocks * sms >= (int64_t(1) << 31))
    return split;
  split.whole = int(tiles - tail);
  split.tail = int(tail);
  split.kv_blocks = int(kv_blocks);
  split.blocks = int(sms);
  return split;
}

// The workspace: the dynamic schedule's tile counter (causal runs), zeroed by launch_tiles()
// before the kernel; or, when the tail is split, each block's two slots of O / l (fp32, with V's
// descale) and lse, for every row of a tile: [2 blocks][kRows][head_dim] floats, then
// [2 blocks][kRows].
template <int kHeadDim>
size_t piece_floats(const Split& split) {
  return split.tail == 0 ? 0 : size_t(2) * split.blocks * Block<kHeadDim>::kRows * kHeadDim;
}
template <int kHeadDim>
size_t split_bytes(const AttentionShape& shape) {
  const size_t floats = piece_floats<kHeadDim>(plan<kHeadDim>(shape));
  return (floats + floats / kHeadDim) * sizeof(float);  // O / l, then lse
}
inline size_t workspace_bytes(const AttentionShape& shape) {
  if (shape.causal) return sizeof(int);
  if (shape.head_dim == 64) return split_bytes<64>(shape);
  return shape.head_dim == 128 ? split_bytes<128>(shape) : 0;
}

// The merge, launched so that it may start while the attention kernel's last blocks still run.
template <int kHeadDim>
void launch_merge(const float* piece_o, const float* piece_lse, const attn::ForwardParams& params,
                  const Split& split, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kMergeThreads / (kHeadDim / 4);
  const int64_t rows = int64_t(split.tail) * Block<kHeadDim>::kRows;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  config.blockDim = dim3(kMergeThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, merge_kernel<kHeadDim>, piece_o, piece_lse,
                                static_cast<bf16*>(params.o), params.lse, split, params.shape));
}

template <int kHeadDim, bool kDynamic>
void launch_tiles(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  // The split kernel only where the plan splits: elsewhere the one without its unit bookkeeping.
  // Each with the path of a consumer without rows only where the last tile of a sequence leaves
  // at least one consumer's 64 rows wholly past its end.
  const int last_rows = shape.seqlen_q % Block<kHeadDim>::kRows;
  const bool sit_out = last_rows > 0 && last_rows <= Block<kHeadDim>::kRows - kConsumerRows;
  auto kernel = sit_out ? fp8_persistent_kernel<kHeadDim, kDynamic, false, true>
                        : fp8_persistent_kernel<kHeadDim, kDynamic, false, false>;
  auto split_kernel = sit_out ? fp8_persistent_kernel<kHeadDim, false, true, true>
                              : fp8_persistent_kernel<kHeadDim, false, true, false>;
  static const bool smem_configured = [&] {
    for (auto f : {fp8_persistent_kernel<kHeadDim, kDynamic, false, true>,
                   fp8_persistent_kernel<kHeadDim, kDynamic, false, false>,
                   fp8_persistent_kernel<kHeadDim, false, true, true>,
                   fp8_persistent_kernel<kHeadDim, false, true, false>})
      CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(Smem<kHeadDim>::kBytes)));
    return true;
  }();
  (void)smem_configured;
  // Q as [batch * heads_q][seqlen_q][head_dim], K and V as [batch * heads_kv][seqlen_k][head_dim]:
  // a box is one head's, so rows past a head's end read as zeros, not as the next head.
  using S = Smem<kHeadDim>;
  using B = Block<kHeadDim>;
  const uint64_t d = kHeadDim;
  const CUtensorMap q_map =
      hopper::make_tensor_map(params.q, d, shape.seqlen_q, uint64_t(shape.batch) * shape.heads_q,
                              kConsumerRows, S::kPanelWidth);
  const CUtensorMap k_map =
      hopper::make_tensor_map(params.k, d, shape.seqlen_k, uint64_t(shape.batch) * shape.heads_kv,
                              B::kBlockN, S::kPanelWidth);
  const CUtensorMap v_map =
      hopper::make_tensor_map(params.v, d, shape.seqlen_k, uint64_t(shape.batch) * shape.heads_kv,
                              B::kBlockN, S::kPanelWidth);
  const Split split = plan<kHeadDim>(shape);
  if (split.tail > 0) kernel = split_kernel;
  int* tile_counter = static_cast<int*>(params.workspace);
  float* piece_o = static_cast<float*>(params.workspace);
  float* piece_lse = piece_o + piece_floats<kHeadDim>(split);
  if (kDynamic) CUDA_CHECK(cudaMemsetAsync(tile_counter, 0, sizeof(int), stream));
  kernel<<<unsigned(split.blocks), B::kThreads, Smem<kHeadDim>::kBytes, stream>>>(
      q_map, k_map, v_map, static_cast<bf16*>(params.o), params.lse, tile_counter, piece_o,
      piece_lse, split, shape, shape.softmax_scale() * kLog2e, params.q_descale, params.k_descale,
      params.v_descale);
  CUDA_CHECK_LAUNCH();
  if constexpr (!kDynamic)
    if (split.tail > 0) launch_merge<kHeadDim>(piece_o, piece_lse, params, split, stream);
}

// Without the mask every tile is the same work and a fixed stride keeps the blocks in step (chapter
// 34); causal tiles differ in length, and a counter hands them out as blocks free (chapter 35).
template <int kHeadDim>
void launch_for_head_dim(const attn::ForwardParams& params, cudaStream_t stream) {
  if (params.shape.causal) launch_tiles<kHeadDim, true>(params, stream);
  else launch_tiles<kHeadDim, false>(params, stream);
}

inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::ForwardChapter chapter() {
  attn::ForwardChapter c{"52_fp8_split_rings",
                         "chapter 51 with K and V^T in rings of their own: K freed when its S "
                         "retires, S issued without waiting for V's transpose",
                         attn::DType::kE4M3,
                         {64, 128},
                         90,
                         /*survives_large_logits=*/true,
                         workspace_bytes,
                         "the tile counter (causal), or the split tail's partial O and lse",
                         launch};
  c.arch_specific = 90;  // built for sm_90a: wgmma and TMA run on compute capability 9.0 only
  c.output_dtype = attn::DType::kBF16;
  c.largest_logits = 1e7f;  // beyond, m c's rounding saturates P (chapter 28's README)
  return c;
}

}  // namespace ch52
