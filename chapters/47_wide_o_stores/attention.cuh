// Chapter 47: O stored 16 bytes at a time. Every chapter since 21 writes O straight from the
// accumulator registers, where lane 4 g + t holds columns 8 j + 2 t and + 1 of its rows: a
// 4-byte store per pair, 16 of them per lane and row half at head_dim 128, and each store of a
// warp touches 8 rows, 16 bytes in each. Timed inside chapter 44 with clock64 stamps, a
// consumer's stores of a tile take 3,300 cycles at head_dim 128, about 4% of a tile at 4096 keys,
// and its next tile waits for them (the README has the table). The idea in one
// sentence: the four lanes of a quad first trade their pairs with two shuffles, so that each lane
// holds 8 contiguous columns of its row and writes them with one 16-byte store.
//
//   before:  16 x st.global.b32 per lane and row half (head_dim 128), 8 rows x 16 bytes each
//   now:     quad_transpose (4 shuffles per 4 chunks), 4 x st.global.v4 per lane and row half,
//            8 rows x 64 bytes each
//
// Only a whole tile's O changes; a piece of the split tail still stores O / l as float pairs for
// the merge (a few tiles' worth), and the merge kernel already reads and writes 16 bytes.
//
// Chapter 44's own summary: the last round split along the keys (stream-K). Without the mask
// chapter 35's blocks walk the tiles with a fixed stride, and the tiles rarely divide evenly among
// the SMs: at head_dim 128 the benchmark grid has 2048 tiles for 132 SMs, 15 full rounds and a last
// one of 68 tiles, in which 64 SMs wait. The idea in one sentence: walk the whole rounds as before,
// but share out the last round's tiles by key blocks, every block taking an equal run of them, so
// that the last round ends when 68/132 of a tile is done rather than a whole one; a tile whose key
// blocks went to several blocks is finished by a small merge kernel, with chapter 03's rule, from
// the partial O and log-sum-exp each piece left in the workspace.
//
//   tiles 0 .. whole - 1:     block b takes b, b + blocks, ... (chapter 34's stride)
//   the tail's key blocks:    tail x kv_blocks of them, in tile order, cut into one run per block:
//                             block b takes [start(b), start(b + 1)), one or two pieces
//   a piece:                  O / l (fp32) and its lse to its slot in the workspace
//   the merge, per tile:      O = sum_p w_p O_p / sum_p w_p, w_p = 2^(lse_p - max lse)
//
// Stream-K (Osama et al., 2023) does the same for the last wave of a matrix product. The split is
// for runs without the mask only (causal tiles come from chapter 35's counter, longest first) and
// only where it pays: the rule is in plan(), at the launch.
//
// The rest is chapter 35's. Its own summary: a dynamic tile schedule for causal runs, each block
// taking its next tile from a counter in device memory whenever its producer is ready for one (a
// signal after a tile's last turn given whether or not a tile follows, and taken before the block
// leaves).
//
// And chapter 34's, under both: a persistent block per SM; Q freed by q_empty; the K/V rings
// and the turns running on across tiles; descriptors in uniform registers; at head_dim 128 without
// the causal mask, 176 keys per tile in two stages with K and V in rings of their own; at head_dim
// 64, and causal, 128 keys in three stages and one ring. A producer warpgroup fills the ring by
// TMA; two consumer warpgroups (three at head_dim 64) take turns issuing S_{j+1} = Q K_{j+1}^T with
// P_j V_j and take the softmax of S_{j+1} while P_j V_j runs; O rescaled only when a row's maximum
// outgrows its reference by more than 8 (log2), voted per warp. Accumulator layout: warp w of a
// consumer owns rows 16 w .. 16 w + 15 of its 64, and lane 4 g + t holds columns 8 j + 2 t, + 1 of
// its rows 16 w + g and 16 w + g + 8.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"
#include "hopper.cuh"

namespace ch47 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

constexpr int kConsumerRows = 64;  // query rows per consumer: wgmma's M
constexpr int kProducerRegisters = 24;
// The block by head dim and tile width: consumer warpgroups, threads (one producer warpgroup
// more), query rows, and each consumer's registers from setmaxnreg with the static schedule:
// 128 x 24 + 384 x 160 = 64,512 at d 64, 128 x 24 + 256 x 240 = 64,512 at d 128, of the SM's
// 65,536 (the dynamic schedule's split is in the kernel: 32 / 160 and 40 / 232).
template <int kHeadDim, bool kWide>
struct Block {
  static_assert(!kWide || kHeadDim == 128, "wide tiles at head_dim 128 only");
  static constexpr int kConsumers = kHeadDim == 64 ? 3 : 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kRows = kConsumers * kConsumerRows;
  static constexpr int kConsumerRegisters = kConsumers == 3 ? 160 : 240;
  // Keys per tile and K/V buffers in the ring: wide, 176 keys in 2 stages (Q 32 KB + 2 x (44 +
  // 44) KB = 214,016 bytes with the alignment, of the 232,448 a block may have); otherwise 128 keys
  // in 3, as in chapter 31. launch() takes wide tiles at d 128 without the causal mask (chapter
  // 32's README).
  static constexpr int kBlockN = kWide ? 176 : 128;
  static constexpr int kStages = kWide ? 2 : 3;
  // Two stages need K and V in rings of their own (chapter 32's header says why); with three, one
  // barrier pair per stage as in chapter 31 (separate rings cost 0-3% at d 64: chapter 32's
  // README).
  static constexpr bool kSplitRings = kStages == 2;
};
constexpr int kPanelCols = 64;                    // bf16 columns per 128-byte swizzled row
constexpr int kPanelBytes = kConsumerRows * 128;  // a panel of Q: 64 rows of 128 bytes
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;

// Shared memory, each tile 1024-byte aligned (head_dim / 64 panels each): each consumer's Q, and
// kStages K and V tiles (d 64: 3 x 8 KB + 3 x 32 KB + 1 KB = 123,904 bytes). The kernel rounds the
// dynamic shared memory's start up to 1024 bytes, hence the extra 1024 asked for.
template <int kHeadDim, bool kWide>
struct Smem {
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kBlockN = Block<kHeadDim, kWide>::kBlockN;
  static constexpr int kStages = Block<kHeadDim, kWide>::kStages;
  static constexpr int kKVPanelBytes = kBlockN * 128;           // a panel of K or V: kBlockN rows
  static constexpr int kTileBytes = kPanels * kPanelBytes;      // Q of one consumer
  static constexpr int kKVTileBytes = kPanels * kKVPanelBytes;  // K or V of one stage
  static constexpr int kQ = 0, kK = Block<kHeadDim, kWide>::kConsumers * kTileBytes,
                       kV = kK + kStages * kKVTileBytes;
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
// each k step of 16 columns is 32 bytes further along the 128-byte rows, and every 4 steps the
// next panel begins: each step's descriptors are the first ones advanced by that many bytes. The
// caller waits (wgmma_wait) before reading s.
template <int kHeadDim, int kBlockN>
__device__ void issue_qk(float (&s)[kBlockN / 2], const unsigned char* q_tile,
                         const unsigned char* k_tile) {
  hopper::fence_operands(s);
  hopper::wgmma_fence();
  const uint64_t a0 = hopper::smem_descriptor(q_tile, 16), b0 = hopper::smem_descriptor(k_tile, 16);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const int column = ks % 4 * 32;  // bytes into the 128-byte rows; every 4 steps a new panel
    const uint64_t a = hopper::advance_descriptor(a0, ks / 4 * kPanelBytes + column);
    const uint64_t b = hopper::advance_descriptor(b0, ks / 4 * kBlockN * 128 + column);
    if constexpr (kBlockN == 176) hopper::wgmma_m64n176k16<0>(s, a, b, ks > 0);
    else hopper::wgmma_m64n128k16<0>(s, a, b, ks > 0);
  }
  hopper::wgmma_commit();
}

// Issues O (64 x head_dim) += P V_j without waiting, P from registers (p[kk]: the A fragment of
// keys 16 kk .. 16 kk + 15). V is stored as it came, keys down the rows and head_dim along them:
// for B = V that is N-major (trans-b = 1), each k step of 16 keys 16 rows = 2048 bytes further,
// and the leading-dimension offset the distance to the next panel of 64 columns of head_dim. p and
// o must not be touched until a wgmma_wait has retired it.
template <int kHeadDim, int kBlockN>
__device__ void issue_pv(float (&o)[kHeadDim / 2], uint32_t (&p)[kBlockN / 16][4],
                         const unsigned char* v_tile) {
  hopper::fence_operands(o);
  hopper::fence_operands(p);
  hopper::wgmma_fence();
  const uint64_t b0 = hopper::smem_descriptor(v_tile, kBlockN * 128);
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    const uint64_t b = hopper::advance_descriptor(b0, ks * 16 * 128);
    if constexpr (kHeadDim == 64) hopper::wgmma_m64n64k16_rs(o, p[ks], b, true);
    else hopper::wgmma_m64n128k16_rs(o, p[ks], b, true);
  }
  hopper::wgmma_commit();
}

// How far (log2 units) a row's max may grow past the reference its P is taken against before
// the warp rescales O (chapter 12's threshold): P then stays under 2^8, far inside bf16's range.
constexpr float kRescaleThreshold = 8.0f;

// One step of the online softmax (chapter 05) in log2 units, on S_j (keys kv_start ..) in place,
// the scale applied inside the exponent's FFMA (row_max is of the unscaled scores):
// in blocks that reach past the first row's diagonal or past the end (chapter 10, kMasked) the keys
// a row cannot see are set to -inf. If a row of the warp grew past its reference maximum by more
// than kRescaleThreshold, every row of the warp moves its reference to its new maximum, alpha gets
// the factors O and the sum must be rescaled by, and it returns true; otherwise the references,
// the sums and alpha stay as they are and it returns false. Leaves P = exp2(s c - base) in s
// (base: the reference times c) and adds it to the row's sum.
//
// Two versions, masked and not, chosen by a branch at the call. Besides sparing unmasked blocks
// the compares, the branch puts the softmax in basic blocks of its own, and that keeps the
// overlap: ptxas schedules within a basic block, and with the softmax and the wgmma wait in one,
// it moved the wait up above the exponentials (the SASS: WARPGROUP.DEPBAR before MUFU.EX2), so
// the softmax waited for P V after all.
template <bool kMasked, int kBlockN>
__device__ bool softmax_step(float (&s)[kBlockN / 2], float (&alpha)[2], float (&row_max)[2],
                             float (&row_sum)[2], const int (&row_end)[2], int kv_start,
                             float scale_log2, int t) {
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // i = 2 * half + column
      float& score = s[4 * j + i];
      if (kMasked && kv_start + 8 * j + 2 * t + i % 2 >= row_end[i / 2]) score = -INFINITY;
      tile_max[i / 2] = fmaxf(tile_max[i / 2], score);
    }
  float new_max[2];
  bool grow = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    new_max[half] = fmaxf(row_max[half], quad_max(tile_max[half]));
    // From -inf to a number: inf > threshold, a rescale (of zeros); -inf to -inf: NaN, none.
    grow |= (new_max[half] - row_max[half]) * scale_log2 > kRescaleThreshold;
  }
  grow = __any_sync(kFullWarp, grow);
  float base[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (grow) {
      // Both products rounded (__fmul_rn is never fused into an FFMA): a row whose max did not
      // grow gets alpha = exp2(0) = 1 exactly, as in chapter 27.
      const float b = new_max[half] == -INFINITY ? 0.0f : __fmul_rn(new_max[half], scale_log2);
      alpha[half] = exp2_fast(__fmul_rn(row_max[half], scale_log2) - b);
      row_max[half] = new_max[half];
      row_sum[half] *= alpha[half];
    }
    base[half] = row_max[half] == -INFINITY ? 0.0f : row_max[half] * scale_log2;
  }
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    s[i] = exp2_fast(fmaf(s[i], scale_log2, -base[i % 4 / 2]));
    row_sum[i % 4 / 2] += s[i];
  }
  return grow;
}

// P packed as bf16 pairs into the A fragments of P V: S registers 8 kk .. 8 kk + 7 are the 16 keys
// of k step kk, in the order a0, a1, a2, a3 wants.
template <int kBlockN>
__device__ void pack_p(const float (&s)[kBlockN / 2], uint32_t (&p)[kBlockN / 16][4]) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const __nv_bfloat162 pair =
          __floats2bfloat162_rn(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]);
      p[j / 2][2 * (j % 2) + half] = *reinterpret_cast<const uint32_t*>(&pair);
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

// The work is a list of tiles, one per (query block, batch x head): tile i is query block
// num_q_blocks - 1 - i % num_q_blocks of (batch, head) i / num_q_blocks (chapter 10's order, the
// order of chapter 33's blocks). What a tile needs of its place in the list:
template <int kHeadDim, bool kWide>
struct Tile {
  int batch_head, kv_head, q_start;
  int num_kv_blocks, num_unmasked_blocks;  // the key blocks it sees; those that need no mask
  __device__ Tile(const AttentionShape& shape, int tile, int num_q_blocks) {
    using B = Block<kHeadDim, kWide>;
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

// A unit of work, as the producer hands it to the consumers: key blocks [kv_begin, kv_end) of a
// tile, and the workspace slot its piece goes to (-1: a whole tile, written to O and lse).
struct Unit {
  int tile, kv_begin, kv_end, slot;
};

// A grid of a block per SM (at most one per tile); block b takes tile b first. Then, statically
// (no mask), tiles b + gridDim.x, b + 2 gridDim.x, ... below split.whole, and its pieces of the
// tail; dynamically (causal), whatever tile the counter in device memory hands out next:
// gridDim.x, gridDim.x + 1, ... in the order blocks ask, as the hardware hands out the blocks of
// an ordinary grid. The producer asks, and tells the consumers through shared memory. A piece's
// O / l and log-sum-exp (log2 units) go to piece_o and piece_lse, [slot][row of the tile][...].
template <int kHeadDim, bool kWide, bool kDynamic>
__global__ void __launch_bounds__(Block<kHeadDim, kWide>::kThreads, 1)
    persistent_kernel(const __grid_constant__ CUtensorMap q_map,
                      const __grid_constant__ CUtensorMap k_map,
                      const __grid_constant__ CUtensorMap v_map, bf16* o, float* lse,
                      int* tile_counter, float* piece_o, float* piece_lse, Split split,
                      AttentionShape shape, float scale_log2) {
  using S = Smem<kHeadDim, kWide>;
  using B = Block<kHeadDim, kWide>;
  constexpr int kBlockN = B::kBlockN, kStages = B::kStages;
  constexpr int kOTiles = kHeadDim / 8;  // 8-column chunks of O
  // The registers setmaxnreg gives the producer and each consumer. With the dynamic schedule the
  // producer also holds the counter's address and the next tile, and spilled at 24 registers: it
  // gets 40 at d 128, whose consumers (128-key tiles: causal) then get 232, and 32 at d 64.
  // setmaxnreg moves registers within the block's own allocation (384 x 168 at d 128, 512 x 128 at
  // d 64): a consumer asking for more than is left would wait forever.
  static_assert(!kDynamic || !kWide, "the dynamic schedule is for causal runs: 128-key tiles");
  constexpr int kProducerRegs = !kDynamic ? kProducerRegisters : B::kConsumers == 3 ? 32 : 40;
  constexpr int kConsumerRegs = kDynamic && B::kConsumers == 2 ? 232 : B::kConsumerRegisters;
  static_assert(128 * kProducerRegs + B::kConsumers * 128 * kConsumerRegs <=
                    65536 / B::kThreads / 8 * 8 * B::kThreads,
                "setmaxnreg asks for more registers than the block has");
  extern __shared__ unsigned char smem_raw[];
  // Rounded up to 1024 bytes by an offset from smem_raw, not through an integer: the compiler then
  // still knows the pointer is to shared memory (chapter 21).
  unsigned char* smem = smem_raw + ((1024 - hopper::smem_address(smem_raw) % 1024) % 1024);
  auto k_tile = [&](int stage) { return smem + S::kK + stage * S::kKVTileBytes; };
  auto v_tile = [&](int stage) { return smem + S::kV + stage * S::kKVTileBytes; };
  // mbarriers. q_full: Q landed; q_empty: every consumer thread has retired its last S = Q K^T of
  // the tile, so the next tile's Q may overwrite it. full and empty: K's ring, and V's too when the
  // ring is one (three stages); v_full and v_empty: V's ring when split (wide tiles, two stages).
  __shared__ uint64_t q_full, q_empty, full[kStages], empty[kStages], v_full[kStages],
      v_empty[kStages];
  // The unit the consumers work on next, written by the producer before its arrive on q_full.
  __shared__ Unit unit_slot;

  // The warpgroup, through a shuffle from lane 0 (CUTLASS does the same): threadIdx.x / 128 is
  // the same in all of a warp's threads, but the compiler cannot tell, and would keep everything
  // computed from it (this consumer's Q tile, so Q's wgmma descriptors) in per-thread registers.
  // The shuffle's result it knows is one value per warp.
  const int warpgroup = __shfl_sync(kFullWarp, threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    hopper::mbarrier_init(&q_full, 1);
    hopper::mbarrier_init(&q_empty, B::kConsumers * 128);
    for (int stage = 0; stage < kStages; ++stage) {
      hopper::mbarrier_init(&full[stage], 1);
      hopper::mbarrier_init(&empty[stage], B::kConsumers * 128);
      if constexpr (B::kSplitRings) {
        hopper::mbarrier_init(&v_full[stage], 1);
        hopper::mbarrier_init(&v_empty[stage], B::kConsumers * 128);
      }
    }
  }
  __syncthreads();
  // The merge kernel after this one may be launched now: it waits for this whole grid to finish
  // before it reads anything (chapter 19's programmatic dependent launch).
  allow_next_grid();

  if (warpgroup == 0) {
    // The producer: one thread copies each tile's Q, then its K and V up to kStages tiles ahead of
    // the consumers. The ring does not restart with a tile: fill counts every K/V tile this block
    // has copied, and the next tile's copies take the next stages, Q's once the current tile's last
    // Q K^T has retired, K's and V's once their buffers are free.
    hopper::release_registers<kProducerRegs>();
    if (threadIdx.x == 0) {
      const int num_q_blocks = (shape.seqlen_q + B::kRows - 1) / B::kRows;
      const int num_tiles = num_q_blocks * shape.batch * shape.heads_q;
      // This block's run of the tail's key blocks, [position, run_end), and its next piece's slot.
      int position = split.start(blockIdx.x), slot = 2 * blockIdx.x;
      const int run_end = split.start(blockIdx.x + 1);
      unsigned fill = 0, round = 0;  // unsigned: % and / by kStages cost less
      for (int tile = blockIdx.x;; ++round) {
        // Q's buffer is free once every consumer thread has retired the last tile's Q K^T (and so
        // has read unit_slot).
        if (round > 0) hopper::mbarrier_wait(&q_empty, (round - 1) % 2);
        // The next unit: a whole tile, else the next piece of the run (the tile its position is in,
        // up to that tile's end or the run's), else the end of the list.
        Unit unit = {num_tiles, 0, 0, -1};
        if (tile < split.whole) {
          unit.tile = tile;
        } else if (position < run_end) {
          const int i = position / split.kv_blocks;  // the tail tile
          unit = {split.whole + i, position - i * split.kv_blocks,
                  min(run_end - i * split.kv_blocks, split.kv_blocks), slot++};
          position += unit.kv_end - unit.kv_begin;
        }
        const Tile<kHeadDim, kWide> w(shape, min(unit.tile, num_tiles - 1), num_q_blocks);
        if (unit.slot < 0) unit.kv_end = w.num_kv_blocks;  // a whole tile: all its key blocks
        // The unit for the consumers: q_full's arrive releases it to them. Past the last tile the
        // index says so, and q_full completes without a copy.
        unit_slot = unit;
        if (unit.tile >= num_tiles) {
          hopper::mbarrier_arrive(&q_full);
          break;
        }
        hopper::mbarrier_arrive_expect_tx(&q_full, B::kConsumers * S::kTileBytes);
        for (int c = 0; c < B::kConsumers; ++c)
          for (int p = 0; p < S::kPanels; ++p)
            hopper::tma_load(smem + S::kQ + c * S::kTileBytes + p * kPanelBytes, &q_map, &q_full,
                             p * kPanelCols, w.q_start + c * kConsumerRows, w.batch_head);
        for (int kv_block = unit.kv_begin; kv_block < unit.kv_end; ++kv_block, ++fill) {
          const unsigned stage = fill % kStages, use = fill / kStages;
          // A buffer's previous fill must have been read by every consumer thread. K's copy goes
          // out before the wait for V's buffer: that one frees a turn later, and K_j is needed a
          // turn earlier than V_j (waiting for both first was 17-26% slower at d 128: chapter 32's
          // README).
          if (use > 0) hopper::mbarrier_wait(&empty[stage], (use - 1) % 2);
          hopper::mbarrier_arrive_expect_tx(&full[stage],
                                            (B::kSplitRings ? 1 : 2) * S::kKVTileBytes);
          for (int p = 0; p < S::kPanels; ++p)
            hopper::tma_load(k_tile(stage) + p * S::kKVPanelBytes, &k_map, &full[stage],
                             p * kPanelCols, kv_block * kBlockN, w.kv_head);
          uint64_t* v_bar = &full[stage];
          if constexpr (B::kSplitRings) {
            if (use > 0) hopper::mbarrier_wait(&v_empty[stage], (use - 1) % 2);
            hopper::mbarrier_arrive_expect_tx(&v_full[stage], S::kKVTileBytes);
            v_bar = &v_full[stage];
          }
          for (int p = 0; p < S::kPanels; ++p)
            hopper::tma_load(v_tile(stage) + p * S::kKVPanelBytes, &v_map, v_bar, p * kPanelCols,
                             kv_block * kBlockN, w.kv_head);
        }
        // The next tile, asked for once this one's copies are all issued, well before the
        // consumers need it. Past split.whole the tile stays there and the run's pieces follow.
        if (tile < split.whole)
          tile = kDynamic ? int(gridDim.x) + atomicAdd(tile_counter, 1) : tile + int(gridDim.x);
      }
    }
    // The producer's work ends with its last copy issued. Its copies complete on mbarriers that
    // the consumers wait on, in shared memory that lives until the block's last thread exits.
    return;
  }

  // A consumer: 64 query rows of every tile, its own Q buffer; warp w of it owns rows
  // 16 w .. 16 w + 15.
  hopper::claim_registers<kConsumerRegs>();
  const int num_q_blocks = (shape.seqlen_q + B::kRows - 1) / B::kRows;
  const int num_tiles = num_q_blocks * shape.batch * shape.heads_q;
  const int consumer = warpgroup - 1;
  const unsigned char* q_tile = smem + S::kQ + consumer * S::kTileBytes;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // The turns go round: this consumer waits on barrier 1 + consumer and signals the next one's
  // (0 is __syncthreads); each barrier completes when 256 threads have come, 128 of the consumer
  // that waits and 128 of the one before it. In every tile consumer 0 goes first. The last
  // consumer gives consumer 0 its first signal after its own last turn of the tile before, so that
  // consumer 0 may start the next tile while the others finish this one; in the block's first tile
  // with keys, before the tile's first turn. A signal after the block's last turn, which no turn
  // takes, consumer 0 takes before it exits: every arrival on a named barrier is waited for.
  const bool last = consumer == B::kConsumers - 1;
  const int own_barrier = 1 + consumer, other_barrier = 1 + (consumer + 1) % B::kConsumers;
  constexpr int kTurnThreads = 2 * 128;

  // K/V tiles of the ring this block's consumers have read before this tile, and tiles done
  // (unsigned: % and / by kStages cost less).
  unsigned read = 0, round = 0;
  // Whether a signal from the last consumer waits on consumer 0's barrier. Every consumer keeps it
  // alike (it follows from the tiles' key counts): the last one to skip its signal before a tile's
  // first turn, consumer 0 to take a pending one before it leaves.
  bool signalled = false;
  for (;; ++round) {
    // Q landed, and with it the tile's index, through a shuffle so that the compiler knows it is
    // the same in the whole warp (chapter 33).
    hopper::mbarrier_wait(&q_full, round % 2);
    const int tile = __shfl_sync(kFullWarp, unit_slot.tile, 0);
    if (tile >= num_tiles) break;
    const Tile<kHeadDim, kWide> w(shape, tile, num_q_blocks);
    // The unit's key blocks, kv_begin + 0 .. kv_begin + num_kv_blocks - 1, and its piece's slot.
    const int kv_begin = __shfl_sync(kFullWarp, unit_slot.kv_begin, 0);
    const int num_kv_blocks = __shfl_sync(kFullWarp, unit_slot.kv_end, 0) - kv_begin;
    const int slot = __shfl_sync(kFullWarp, unit_slot.slot, 0);
    const int row0 =
        w.q_start + consumer * kConsumerRows + 16 * warp + g;  // this thread's first row

    float row_max[2] = {-INFINITY, -INFINITY};  // of the unscaled scores
    float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only, until the end
    float o_acc[kHeadDim / 2] = {};
    int row_end[2];  // the first key each row cannot see
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int query = row0 + 8 * half;
      row_end[half] =
          shape.causal ? min(shape.seqlen_k, query + shape.causal_offset() + 1) : shape.seqlen_k;
    }
    // A tile that sees no key frees Q's buffer at once.
    if (num_kv_blocks == 0) hopper::mbarrier_arrive(&q_empty);
    if (num_kv_blocks > 0) {
      if (last && !signalled) hopper::named_barrier_arrive(other_barrier, kTurnThreads);
      signalled = false;  // consumer 0's first turn below takes it
    }

    float s[kBlockN / 2];
    uint32_t p[kBlockN / 16][4];
    // The first turn issues S_0 = Q K_0^T alone; its softmax gives P_0 (O is still 0).
    if (num_kv_blocks > 0) {
      const unsigned stage = read % kStages;
      hopper::mbarrier_wait(&full[stage], read / kStages % 2);
      hopper::named_barrier_sync(own_barrier, kTurnThreads);
      issue_qk<kHeadDim, kBlockN>(s, q_tile, k_tile(stage));
      hopper::named_barrier_arrive(other_barrier, kTurnThreads);
      hopper::wgmma_wait<0>();
      hopper::fence_operands(s);
      if constexpr (B::kSplitRings) hopper::mbarrier_arrive(&empty[stage]);  // K_0 read
      if (num_kv_blocks == 1) hopper::mbarrier_arrive(&q_empty);  // the tile's last Q K^T
      float alpha[2];
      softmax_step<true, kBlockN>(s, alpha, row_max, row_sum, row_end, kv_begin * kBlockN,
                                  scale_log2, t);
      pack_p<kBlockN>(s, p);
    }
    for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
      const unsigned index = read + kv_block, stage = index % kStages;  // in the ring's sequence
      // A turn: S_{j+1} = Q K_{j+1}^T, then O += P_j V_j, issued back to back between this
      // consumer's wait and its signal to the next (the last turn has no S_{j+1}, and the last
      // consumer's signal after it is for the next tile).
      if (kv_block + 1 < num_kv_blocks) {
        const unsigned next = index + 1, next_stage = next % kStages;
        hopper::mbarrier_wait(&full[next_stage], next / kStages % 2);
        if constexpr (B::kSplitRings) hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
        hopper::named_barrier_sync(own_barrier, kTurnThreads);
        issue_qk<kHeadDim, kBlockN>(s, q_tile, k_tile(next_stage));
        issue_pv<kHeadDim, kBlockN>(o_acc, p, v_tile(stage));
        hopper::named_barrier_arrive(other_barrier, kTurnThreads);
        // The overlap: wait for S_{j+1} alone (the older of the two groups) and take its softmax
        // while P_j V_j still runs; then wait for P_j V_j, and only then rescale O and overwrite P.
        hopper::wgmma_wait<1>();
        hopper::fence_operands(s);
        // K_{j+1} read: released here rather than at the end of the turn (1-2% faster: chapter 32's
        // README).
        if constexpr (B::kSplitRings) hopper::mbarrier_arrive(&empty[next_stage]);
        // The tile's last Q K^T has retired: the producer may copy the next tile's Q.
        if (kv_block + 2 == num_kv_blocks) hopper::mbarrier_arrive(&q_empty);
        float alpha[2];
        const int kv_start = (kv_begin + kv_block + 1) * kBlockN;
        const bool rescaled = kv_begin + kv_block + 1 >= w.num_unmasked_blocks
                                  ? softmax_step<true, kBlockN>(s, alpha, row_max, row_sum, row_end,
                                                                kv_start, scale_log2, t)
                                  : softmax_step<false, kBlockN>(s, alpha, row_max, row_sum,
                                                                 row_end, kv_start, scale_log2, t);
        // Without this fence the compiler may move the exponentials below the wait, into the
        // time the overlap was to save: the fence pins them before it.
        hopper::fence_operands(s);
        hopper::wgmma_wait<0>();
        hopper::fence_operands(o_acc);
        hopper::fence_operands(p);
        if (rescaled) rescale(o_acc, alpha);
        pack_p<kBlockN>(s, p);
      } else {
        if constexpr (B::kSplitRings) hopper::mbarrier_wait(&v_full[stage], index / kStages % 2);
        hopper::named_barrier_sync(own_barrier, kTurnThreads);
        issue_pv<kHeadDim, kBlockN>(o_acc, p, v_tile(stage));
        // To the next consumer; from the last, consumer 0's first signal of the next tile.
        hopper::named_barrier_arrive(other_barrier, kTurnThreads);
        signalled = true;
        hopper::wgmma_wait<0>();
        hopper::fence_operands(o_acc);
        hopper::fence_operands(p);
      }
      // This thread has read V_j (the wgmma that read it has retired; K_j was read a turn
      // earlier): V_j's buffer (with one ring, the stage) may be filled again once every consumer
      // thread says so.
      hopper::mbarrier_arrive(B::kSplitRings ? &v_empty[stage] : &empty[stage]);
    }
    read += num_kv_blocks;

    // O = o_acc / l and lse = (m c + log2 l) / log2 e, straight from the registers; a piece
    // keeps O / l in fp32 and lse in log2 units, in its slot, for the merge.
    const int64_t head_row0 = int64_t(w.batch_head) * shape.seqlen_q;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int query = row0 + 8 * half;
      const float l = quad_sum(row_sum[half]);
      const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key outputs 0
      const float lse2 = l > 0.0f ? __fmul_rn(row_max[half], scale_log2) + log2f(l) : -INFINITY;
      if (slot < 0) {
        // A whole tile: O's row in bf16, 16 bytes per store (quad_transpose), lane t of the quad
        // writing columns 32 k + 8 t .. + 7.
        uint32_t words[kOTiles];
#pragma unroll
        for (int j = 0; j < kOTiles; ++j) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(o_acc[4 * j + 2 * half] * inv_l,
                                                            o_acc[4 * j + 2 * half + 1] * inv_l);
          words[j] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        uint4 chunks[kOTiles / 4];
        quad_transpose(words, chunks, t);
        if (query >= shape.seqlen_q) continue;
        bf16* o_row = o + (head_row0 + query) * kHeadDim;
#pragma unroll
        for (int k = 0; k < kOTiles / 4; ++k)
          *reinterpret_cast<uint4*>(o_row + 32 * k + 8 * t) = chunks[k];
        if (t == 0) lse[head_row0 + query] = lse2 / kLog2e;
        continue;
      }
      // A piece of the split tail: O / l in fp32 and lse in log2 units, for the merge.
      if (query >= shape.seqlen_q) continue;
      const int64_t piece_row = int64_t(slot) * B::kRows + (query - w.q_start);
      float* o_row = piece_o + piece_row * kHeadDim;
#pragma unroll
      for (int j = 0; j < kOTiles; ++j)
        *reinterpret_cast<float2*>(o_row + 8 * j + 2 * t) =
            make_float2(o_acc[4 * j + 2 * half] * inv_l, o_acc[4 * j + 2 * half + 1] * inv_l);
      if (t == 0) piece_lse[piece_row] = lse2;
    }
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
// at all gets O = 0 and lse -inf). The pieces were just written, so they come from the L2, and
// what costs is the latency of each round of reads: the loads of kPass pieces are issued before
// any is used, and merged against a running max (chapter 19's combine does the same).
constexpr int kMergeThreads = 128;
template <int kHeadDim, bool kWide>
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(const float* piece_o, const float* piece_lse, bf16* o, float* lse, Split split,
                 AttentionShape shape) {
  using B = Block<kHeadDim, kWide>;
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
  const Tile<kHeadDim, kWide> w(shape, split.whole + i, num_q_blocks);
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
// price of each piece's fixed costs (its Q, its first S alone, its stores to the slot) and of the
// merge. So it is split only when that round leaves at least a quarter of the SMs idle (tail <=
// 3/4 of them) and every block's run is at least kMinRunBlocks key blocks, long beside those
// costs; and when the run arithmetic fits in 32 bits.
constexpr int kMinRunBlocks = 4;
template <int kHeadDim, bool kWide>
Split plan(const AttentionShape& shape) {
  using B = Block<kHeadDim, kWide>;
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

// The workspace: the dynamic schedule's tile counter (causal runs), zeroed by launch() before the
// kernel; or, when the tail is split, each block's two slots of O / l (fp32) and lse, for every
// row of a tile: [2 blocks][kRows][head_dim] floats, then [2 blocks][kRows].
template <int kHeadDim, bool kWide>
size_t piece_floats(const Split& split) {
  return split.tail == 0 ? 0 : size_t(2) * split.blocks * Block<kHeadDim, kWide>::kRows * kHeadDim;
}
template <int kHeadDim, bool kWide>
size_t split_bytes(const AttentionShape& shape) {
  const size_t floats = piece_floats<kHeadDim, kWide>(plan<kHeadDim, kWide>(shape));
  return (floats + floats / kHeadDim) * sizeof(float);  // O / l, then lse
}
inline size_t workspace_bytes(const AttentionShape& shape) {
  if (shape.causal) return sizeof(int);
  if (shape.head_dim == 64) return split_bytes<64, false>(shape);
  return shape.head_dim == 128 ? split_bytes<128, true>(shape) : 0;
}

// The merge, launched so that it may start while the attention kernel's last blocks still run.
template <int kHeadDim, bool kWide>
void launch_merge(const float* piece_o, const float* piece_lse, const attn::ForwardParams& params,
                  const Split& split, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kMergeThreads / (kHeadDim / 4);
  const int64_t rows = int64_t(split.tail) * Block<kHeadDim, kWide>::kRows;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  config.blockDim = dim3(kMergeThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, merge_kernel<kHeadDim, kWide>, piece_o, piece_lse,
                                static_cast<bf16*>(params.o), params.lse, split, params.shape));
}

template <int kHeadDim, bool kWide, bool kDynamic>
void launch_tiles(const attn::ForwardParams& params, cudaStream_t stream) {
  using S = Smem<kHeadDim, kWide>;
  using B = Block<kHeadDim, kWide>;
  const AttentionShape& shape = params.shape;
  auto kernel = persistent_kernel<kHeadDim, kWide, kDynamic>;
  static const bool smem_configured = [&] {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kBytes)));
    return true;
  }();
  (void)smem_configured;
  // Q as [batch * heads_q][seqlen_q][head_dim], K and V as [batch * heads_kv][seqlen_k][head_dim]:
  // a box is 64 rows (Q) or kBlockN rows (K, V) of one head, so rows past a head's end read as
  // zeros, not as the next head.
  const uint64_t d = kHeadDim;
  const CUtensorMap q_map = hopper::make_tensor_map(
      params.q, d, shape.seqlen_q, uint64_t(shape.batch) * shape.heads_q, kConsumerRows);
  const CUtensorMap k_map = hopper::make_tensor_map(
      params.k, d, shape.seqlen_k, uint64_t(shape.batch) * shape.heads_kv, B::kBlockN);
  const CUtensorMap v_map = hopper::make_tensor_map(
      params.v, d, shape.seqlen_k, uint64_t(shape.batch) * shape.heads_kv, B::kBlockN);
  const Split split = plan<kHeadDim, kWide>(shape);
  int* tile_counter = static_cast<int*>(params.workspace);
  float* piece_o = static_cast<float*>(params.workspace);
  float* piece_lse = piece_o + piece_floats<kHeadDim, kWide>(split);
  if (kDynamic) CUDA_CHECK(cudaMemsetAsync(tile_counter, 0, sizeof(int), stream));
  kernel<<<unsigned(split.blocks), B::kThreads, S::kBytes, stream>>>(
      q_map, k_map, v_map, static_cast<bf16*>(params.o), params.lse, tile_counter, piece_o,
      piece_lse, split, shape, shape.softmax_scale() * kLog2e);
  CUDA_CHECK_LAUNCH();
  if constexpr (!kDynamic)
    if (split.tail > 0) launch_merge<kHeadDim, kWide>(piece_o, piece_lse, params, split, stream);
}

// Wide tiles at head_dim 128 without the causal mask. Causal runs keep 128 keys: a wider tile
// skips less above the diagonal and masks more on it, and measured 2-8% slower from 512 to 8192
// in one grid run, 0.93-1.03x at 4096 back to back (chapter 32's README); FlashAttention-3 makes
// the same choice. The static schedule without the mask: there every tile is the same work, and
// the blocks walking every gridDim.x-th tile stay in step. Causal tiles differ in length (chapter
// 10), and a fixed assignment leaves blocks idle at the end (0.64x at 16384 keys by count,
// chapter 34's answers): the dynamic schedule hands them out as blocks free.
inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  const bool causal = params.shape.causal;
  if (params.shape.head_dim == 64 && causal) launch_tiles<64, false, true>(params, stream);
  else if (params.shape.head_dim == 64) launch_tiles<64, false, false>(params, stream);
  else if (causal) launch_tiles<128, false, true>(params, stream);
  else launch_tiles<128, true, false>(params, stream);
}

inline attn::ForwardChapter chapter() {
  attn::ForwardChapter c{"47_wide_o_stores",
                         "O stored 16 bytes at a time: two shuffles inside each quad give a lane "
                         "8 contiguous columns of its row, one 16-byte store instead of four",
                         attn::DType::kBF16,
                         {64, 128},
                         90,
                         /*survives_large_logits=*/true,
                         workspace_bytes,
                         "the tile counter (causal), or the split tail's partial O and lse",
                         launch};
  c.arch_specific = 90;     // built for sm_90a: wgmma and TMA run on compute capability 9.0 only
  c.largest_logits = 1e9f;  // the exponent's FMA shares m c's rounding (chapter 31's README)
  return c;
}

}  // namespace ch47
