// Chapter 12: rescale only when the max has grown. Chapter 11's kernel, with O rescaled only on
// the rare block where a row's max outgrows the reference its exponents are taken against.
//
// Chapter 11 rescales O by alpha = exp2(m_old - m_new) on every block of keys, even when alpha
// is exactly 1: kHeadDim multiplies per row and block (128 per thread per iteration at
// d = 128, a fifth of the loop's instructions). But the exponents need not be taken against the
// true max. Any reference m' works as long as exp2(s - m') cannot overflow: O and l are both
// relative to the same m', so O / l and the LSE (m' + log2 l) come out the same. So a row's
// reference moves only when its max has grown past it by more than kRescaleThreshold = 8 (log2
// units, after the scale):
//
//   row max so far    3.0   5.0   9.5   11.5  12.5   (scaled, log2 units)
//   reference m'      3.0   3.0   3.0   11.5  11.5   moves when max - m' > 8: rescale
//   largest p         1     4     90.5  1     2      always <= 2^8 = 256
//
// p <= 256 is harmless: fp32 sums and bf16 P have the same relative precision at 256 as at 1.
// After the first few blocks the max rarely grows that much, so O is almost never rescaled. The
// decision is taken for the whole warp (__any_sync), so the rescale is one branch that a warp
// takes or skips as a unit. This is the conditional rescaling of FlashAttention-4 (see the
// README). Two consequences shape the loop:
// - P no longer waits for the block's max. The max only decides whether the reference moves, so
//   P is computed against the reference the row has, while the max and its shuffles are still on
//   their way, and computed a second time on the rare block that moves it.
// - Nothing is rescaled on the other blocks, not even by an alpha that came out as 1 plus a
//   rounding error: l and O stay relative to the same reference exactly. The reference is kept
//   multiplied by scale_log2 (m_ref), as chapter 11 keeps its max, so the exponent is one fused
//   multiply-add and alpha, when it is needed, exp2 of a plain difference of two floats.
//
// Chapter 05's algorithm, with both matrix products on mma.sync.m16n8k16 and everything between
// them in registers. Each warp owns 32 query rows of the block, two MMA tiles (FlashAttention-2's
// split of Q across warps: no warp needs another's results):
//
//   block of 128 query rows               K_j, V_j: 64 (d = 64) or 32 (d = 128) keys, in smem
//   +--------------------+
//   | warp 0: rows 0-31  |  S = Q K^T  (32 x keys, fp32 accumulators in registers)
//   | warp 1: rows 32-63 |  online softmax on those registers (quad shuffles for max and sum)
//   | warp 2: rows 64-95 |  P -> bf16, packed straight into A fragments
//   | warp 3: rows 96-127|  O += P V   (32 x head_dim, fp32 accumulators in registers)
//   +--------------------+
//
// Fragments of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"). Lane = 4 g + t
// (g = lane / 4 picks a row, t = lane % 4 a pair of columns); each register holds two bf16.
//
//   A 16x16 (row-major)             B 16x8 (k x n)              C/D 16x8 (fp32)
//   a0: row g,   cols 2t, 2t+1      b0: k 2t, 2t+1,   col g     c0, c1: row g,   cols 2t, 2t+1
//   a1: row g+8, cols 2t, 2t+1      b1: k 2t+8, 2t+9, col g     c2, c3: row g+8, cols 2t, 2t+1
//   a2: row g,   cols 2t+8, 2t+9
//   a3: row g+8, cols 2t+8, 2t+9
//
//   S = Q K^T:  A = Q rows, k = head_dim.  B column n = key n, so b0 is two neighbouring head_dim
//               elements of one K row.
//   O = P V:    A = P. The C layout of two neighbouring S tiles (keys 0-7 and 8-15) is exactly
//               the A layout for keys 0-15: a0 = (c0, c1) of the first, a1 = (c2, c3), a2, a3 the
//               same of the second. P never leaves the registers.
//               B = V with k = key: b0 is (V[2t][g], V[2t+1][g]), two rows apart.
//
// ldmatrix.x4 loads four 8x8 bf16 matrices for the whole warp in one instruction: lanes 8i..8i+7
// each give the address of one 16-byte row of matrix i, and afterwards register i of lane 4g + t
// holds row g, columns 2t and 2t+1 of matrix i: the fragment layout above. So one ldmatrix.x4 is
// one whole A fragment (its four 8x8 quarters), or the B fragments of two neighbouring n-tiles.
// With .trans each 8x8 matrix arrives transposed: lane 4g + t gets rows 2t, 2t+1 of column g,
// exactly V's b0 without any 16-bit loads. Per 16x16 fragment that is 1 instruction instead of 4
// (A, K) or 8 (V), and each moves 512 bytes instead of 128 or 64.
//
// So a thread holds two rows (g and g + 8) of each 16-row tile, and every row is spread over the
// 4 lanes of a quad: the row max and row sum need two shuffles (xor 1, xor 2).
//
// Loads: cp.async, double-buffered (chapter 09). Rows past the end of Q or K/V are zero-filled by
// the copy itself: a cp.async with a source size of 0 writes 16 zero bytes.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch12 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;   // mma.sync.m16n8k16
constexpr int kMTiles = 2;                         // 16-row MMA tiles per warp
constexpr int kBlockM = kWarps * kMTiles * kMmaM;  // 128 query rows per block
// Keys per iteration, per head_dim. More keys per iteration spread its fixed costs (the
// barriers, the loop's bookkeeping) over more math, as long as the S
// accumulators still fit in registers beside O's. Once a warp owns 32 rows (chapter 08), a thread
// holds kBlockN floats of S and kHeadDim floats of O: 64 + 64 at d = 64, 32 + 128 at d = 128.
// (64 keys at d = 128 made the compiler spill registers; that spilling version measured about 2%
// faster than 32 keys, but no spills is the rule here.)
// Chapters 09 and 10 gave d = 64 128 keys: 128 floats of S and 64 of O. Since chapter 11, P of
// the previous block stays in registers beside them (the loop is skewed by one block), and with
// 128 keys ptxas spills. So d = 64 stays at 64 keys.
template <int kHeadDim>
constexpr int kBlockNFor = kHeadDim == 64 ? 64 : 32;
// Shared-memory rows are padded by 8 bf16 (16 bytes). Each ldmatrix phase reads 8 rows of 16
// bytes at the same column: with rows of 64 or 128 bf16 (a multiple of 128 bytes) all 8 would
// start in the same bank and be served one after another. 16 more bytes per row move row r by
// 4 r banks, so the 8 rows of 4 banks each cover all 32 banks. The rows must stay 16-byte
// aligned for ldmatrix, so 16 is also the smallest padding that works.
constexpr int kPad = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;
// The reference max of a row moves only when the row's max has grown past it by more than this
// (log2 units, after the scale): every P that is kept has exp2 arguments <= 8, every p <= 256
// (see the top).
constexpr float kRescaleThreshold = 8.0f;
// The reference of a row that has seen no finite score yet: finite (so that exp2(s - m_ref) and
// m_old - m_new never meet inf - inf) and far below any score times scale_log2.
constexpr float kNoReference = -1.0e30f;

constexpr int kStages = 2;  // shared-memory buffers for K, and for V: one in use, one being filled

template <int kHeadDim>
struct Smem {
  static constexpr int kStride = kHeadDim + kPad;  // bf16 per shared-memory row
  static constexpr size_t kBytes =
      size_t(kBlockM + kStages * 2 * kBlockNFor<kHeadDim>) * kStride * sizeof(bf16);
};

// ---------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------

// D += A B on the tensor cores: one warp, a 16x16 bf16 A, a 16x8 bf16 B, a 16x8 fp32 D.
__device__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two bf16 as one register, `low` in the low half (the lower k index).
__device__ uint32_t pack(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Four 8x8 bf16 matrices from shared memory; `row` is this lane's row address (see the top).
__device__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* row) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* row) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// A fragment: rows [row0, row0 + 16), columns [col0, col0 + 16) of a row-major tile. Lane
// 8i + r points at row r of quarter i: quarters 0, 1 are rows 0-7, 8-15 at columns 0-7; quarters
// 2, 3 the same at columns 8-15 (the order of a0..a3).
__device__ void load_a(uint32_t (&a)[4], const bf16* tile, int stride, int row0, int col0,
                       int lane) {
  const int quarter = lane / 8, r = lane % 8;
  ldmatrix_x4(a, tile + (row0 + r + 8 * (quarter % 2)) * stride + col0 + 8 * (quarter / 2));
}

// B fragments of two n-tiles whose column n is row row0 + n of the tile (K for S = Q K^T), k =
// columns col0 .. col0 + 15: b[0] = (b0, b1) for rows row0..row0 + 7, b[1] for the next 8 rows.
__device__ void load_b_rows(uint32_t (&b)[2][2], const bf16* tile, int stride, int row0, int col0,
                            int lane) {
  const int quarter = lane / 8, r = lane % 8;
  uint32_t regs[4];
  ldmatrix_x4(regs, tile + (row0 + r + 8 * (quarter / 2)) * stride + col0 + 8 * (quarter % 2));
  b[0][0] = regs[0], b[0][1] = regs[1], b[1][0] = regs[2], b[1][1] = regs[3];
}

// B fragments of two n-tiles whose k runs down the rows of the tile (V for O = P V): k = rows
// row0 .. row0 + 15, columns col0 .. col0 + 7 for b[0] and the next 8 for b[1]. The transposing
// load turns each 8x8 block of V into the k-pairs the fragment wants.
__device__ void load_b_columns(uint32_t (&b)[2][2], const bf16* tile, int stride, int row0,
                               int col0, int lane) {
  const int quarter = lane / 8, r = lane % 8;
  uint32_t regs[4];
  ldmatrix_x4_trans(regs,
                    tile + (row0 + r + 8 * (quarter % 2)) * stride + col0 + 8 * (quarter / 2));
  b[0][0] = regs[0], b[0][1] = regs[1], b[1][0] = regs[2], b[1][1] = regs[3];
}

// 2^x in one instruction (MUFU.EX2). exp2f() wraps it in a range check so that results below
// 2^-126 come out exact; a probability that small cannot change a row sum that holds a 1, so the
// flush-to-zero form is enough (PTX ISA: ex2.approx.ftz.f32, at most 2 ulp of error).
__device__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Starts a 16-byte copy from device to shared memory. With `valid` false it reads nothing and
// writes 16 zero bytes (the source size operand is 0); the address must still be a real one.
__device__ void cp_async_16(bf16* shared_dst, const bf16* global_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// Closes the group of copies started since the last commit.
__device__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Max and sum over the 4 lanes of a quad, which share a row of every fragment.
__device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullWarp, x, 2));
}
__device__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullWarp, x, 1);
  return x + __shfl_xor_sync(kFullWarp, x, 2);
}

// Starts copying rows [row0, row0 + kRows) of a [rows_total][kHeadDim] bf16 matrix into a padded
// shared tile, 16 bytes (8 bf16) per copy; rows past the end become zeros. Each pass of the block
// covers kRowsPerPass whole rows, so a thread's copies sit at constant offsets from its first.
template <int kRows, int kHeadDim>
__device__ void load_tile_async(bf16* tile, const bf16* src, int row0, int rows_total) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kRows % kRowsPerPass == 0, "tile must divide evenly among threads");
  const int r = threadIdx.x / kChunksPerRow, c = threadIdx.x % kChunksPerRow * 8;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = r + pass * kRowsPerPass;
    const bool valid = row0 + row < rows_total;
    const int src_row = valid ? row0 + row : rows_total - 1;  // a real address even when unused
    cp_async_16(tile + row * Smem<kHeadDim>::kStride + c, src + int64_t(src_row) * kHeadDim + c,
                valid);
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

// Block b handles (batch, head) = b / num_q_blocks, as in chapter 05, but its query block counts
// from the last one (longest first, below).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    flash_tc_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                    AttentionShape shape, float scale_log2) {
  constexpr int kStride = Smem<kHeadDim>::kStride;
  constexpr int kBlockN = kBlockNFor<kHeadDim>;  // keys per iteration
  constexpr int kSTiles = kBlockN / kMmaN;       // S: tiles of 8 keys
  constexpr int kOTiles = kHeadDim / kMmaN;      // O: 8 or 16 tiles of 8 columns
  constexpr int kSSteps = kHeadDim / kMmaK;      // S = Q K^T: k runs over head_dim
  constexpr int kOSteps = kBlockN / kMmaK;       // O = P V: k runs over the block's keys
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_tile = reinterpret_cast<bf16*>(smem);  // [kBlockM][kStride]
  // K buffers 0 and 1, then V buffers 0 and 1, each [kBlockN][kStride]. Block j uses buffer j % 2.
  bf16* kv_tiles = q_tile + kBlockM * kStride;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  // Causal query blocks differ in work: the last sees every key, the first only its diagonal.
  // Blocks start roughly in index order, so the grid hands out the longest first: the short ones
  // then fill the gaps at the end, instead of one long block starting when the rest are done.
  const int q_block = num_q_blocks - 1 - int(blockIdx.x % num_q_blocks);
  const int64_t batch_head = blockIdx.x / num_q_blocks;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();
  // First row of this (batch, head) in Q, O and LSE, as an int: it saves the register that ptxas
  // would otherwise spill. 2^31 rows do not fit in a GPU (Q alone would be 256 GiB at d = 64), so
  // the runner's allocation fails long before this could overflow.
  const int q_row0 = int(batch_head * shape.seqlen_q);
  const bf16* k_head = k + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  const bf16* v_head = v + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  const int q_start = q_block * kBlockM;
  const int warp_row0 = warp * kMTiles * kMmaM;  // this warp's first row within the block

  auto k_tile = [&](int kv_block) { return kv_tiles + kv_block % kStages * kBlockN * kStride; };
  auto v_tile = [&](int kv_block) {
    return kv_tiles + (kStages + kv_block % kStages) * kBlockN * kStride;
  };
  auto load_k = [&](int kv_block) {
    load_tile_async<kBlockN, kHeadDim>(k_tile(kv_block), k_head, kv_block * kBlockN,
                                       shape.seqlen_k);
  };
  auto load_v = [&](int kv_block) {
    load_tile_async<kBlockN, kHeadDim>(v_tile(kv_block), v_head, kv_block * kBlockN,
                                       shape.seqlen_k);
  };

  // The key loop ends after the last key the block's bottom row sees (its diagonal, bottom-right
  // aligned); blocks of keys that every row sees completely need no mask.
  const int q_last = min(q_start + kBlockM, shape.seqlen_q) - 1;
  const int kv_end = shape.causal ? max(0, min(shape.seqlen_k, q_last + shape.causal_offset() + 1))
                                  : shape.seqlen_k;
  const int num_kv_blocks = (kv_end + kBlockN - 1) / kBlockN;
  const int unmasked_end =
      shape.causal ? min(shape.seqlen_k, q_start + shape.causal_offset() + 1) : shape.seqlen_k;
  const int num_unmasked_blocks = max(0, unmasked_end) / kBlockN;

  // Prologue: Q and the first K in one group (V_0 is copied during iteration 0).
  load_tile_async<kBlockM, kHeadDim>(q_tile, q + int64_t(q_row0) * kHeadDim, q_start,
                                     shape.seqlen_q);
  if (num_kv_blocks > 0) load_k(0);
  cp_async_commit();

  // Per thread: rows g and g + 8 of each of its kMTiles tiles ([mt][half]).
  float o_acc[kMTiles][kOTiles][4] = {};
  // m_ref is the reference the exponents are taken against, already times scale_log2: the row's
  // max so far, or at most kRescaleThreshold below it (see the top).
  float m_ref[kMTiles][2], row_sum[kMTiles][2];
  // Carried from one iteration to the next: the last block's P, already packed as the A
  // fragments of P V.
  uint32_t p[kOSteps][kMTiles][4];
  for (int mt = 0; mt < kMTiles; ++mt)
    for (int half = 0; half < 2; ++half) m_ref[mt][half] = kNoReference, row_sum[mt][half] = 0.0f;

  // O += P V for the P held in registers and block kv_block's V.
  auto accumulate_pv = [&](int kv_block) {
#pragma unroll
    for (int ks = 0; ks < kOSteps; ++ks) {
#pragma unroll
      for (int dt = 0; dt < kOTiles; dt += 2) {
        uint32_t b[2][2];
        load_b_columns(b, v_tile(kv_block), kStride, ks * kMmaK, dt * kMmaN, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816(o_acc[mt][dt], p[ks][mt], b[0]);
          mma_16816(o_acc[mt][dt + 1], p[ks][mt], b[1]);
        }
      }
    }
  };

  // One iteration: S_j and its softmax, and the P V of block j - 1 (kPrevious: there is one).
  // Written once and compiled three times (the first block, full blocks, masked blocks).
  auto process_block = [&](int kv_block, auto masked_tag, auto previous_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    constexpr bool kPrevious = decltype(previous_tag)::value;
    const int kv_start = kv_block * kBlockN;
    // Wait for this iteration's group (K_j, V_{j-1}); after the barrier every warp is also done
    // with iteration j - 1, so the buffers of K_{j-1} and V_{j-2} may be overwritten.
    cp_async_wait<0>();
    __syncthreads();
    if (kv_block + 1 < num_kv_blocks) load_k(kv_block + 1);
    load_v(kv_block);
    cp_async_commit();

    // S = Q K^T.
    float s[kMTiles][kSTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < kSSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        load_a(a[mt], q_tile, kStride, warp_row0 + mt * kMmaM, ks * kMmaK, lane);
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        uint32_t b[2][2];
        load_b_rows(b, k_tile(kv_block), kStride, nt * kMmaN, ks * kMmaK, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816(s[mt][nt], a[mt], b[0]);
          mma_16816(s[mt][nt + 1], a[mt], b[1]);
        }
      }
    }
    // O += P_{j-1} V_{j-1}. Only the rare rescale below depends on it: the softmax of S_j
    // interleaves with these MMAs.
    if (kPrevious) accumulate_pv(kv_block - 1);

    // Online softmax of S_j with a lazy reference (see the top); P goes straight into bf16 A
    // fragments.
    // 1. Mask, then the row max of the block.
    int limit[kMTiles][2];
    float block_max[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int query = q_start + warp_row0 + mt * kMmaM + g + 8 * half;
        const int row_end =
            shape.causal ? min(shape.seqlen_k, query + shape.causal_offset() + 1) : shape.seqlen_k;
        limit[mt][half] = row_end - kv_start - 2 * t;
        block_max[mt][half] = -INFINITY;
      }
    }
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // i = 2 * half + e
          float& score = s[mt][nt][i];
          if (kMasked && nt * kMmaN + i % 2 >= limit[mt][i / 2]) score = -INFINITY;
          block_max[mt][i / 2] = fmaxf(block_max[mt][i / 2], score);
        }

    // 2. The check: does this block's max lie more than kRescaleThreshold above the reference,
    //    in some row of the warp? (A row whose scores so far were all -inf holds kNoReference,
    //    which any finite score is far above.)
    float block_max_scaled[kMTiles][2];
    bool grew = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        block_max_scaled[mt][half] = quad_max(block_max[mt][half]) * scale_log2;
        grew |= block_max_scaled[mt][half] - m_ref[mt][half] > kRescaleThreshold;
      }
    const bool move = __any_sync(kFullWarp, grew);

    // 3. P = exp2(s * scale_log2 - m_ref) against the reference the row already has, its partial
    //    row sums, and P packed to bf16 (what the next iteration multiplies by V). This does not
    //    wait for the check: the reference almost never moves, so P is computed as if it did
    //    not, and computed again on the rare block where it did (step 4). Against kNoReference a
    //    finite score gives inf here, but such a block always moves; -inf scores give 0.
    float block_sum[kMTiles][2];
    auto exponentiate = [&] {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) block_sum[mt][half] = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          float e[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            e[i] = exp2_fast(s[mt][nt][i] * scale_log2 - m_ref[mt][i / 2]);
            block_sum[mt][i / 2] += e[i];
          }
          // Keys nt * 8 .. nt * 8 + 7 are the low (even nt) or high (odd nt) half of the 16 keys
          // of A fragment nt / 2: a0, a1 or a2, a3 (chapter 06's fragment note).
          p[nt / 2][mt][2 * (nt % 2)] = pack(e[0], e[1]);
          p[nt / 2][mt][2 * (nt % 2) + 1] = pack(e[2], e[3]);
        }
    };
    exponentiate();

    // 4. The rare block: every row of the warp moves its reference to max(reference, block max),
    //    l and O are rescaled by alpha = exp2(m_old - m_new) <= 1 right here, and P is computed
    //    again. On every other block nothing is rescaled at all: l and O stay relative to the
    //    same reference exactly. O holds P_{j-1} V_{j-1} by now (the MMAs above), which is
    //    relative to the old reference too: the rescale waits for them, on the rare block only.
    if (move) {
      float alpha[kMTiles][2];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float m_new = fmaxf(m_ref[mt][half], block_max_scaled[mt][half]);
          alpha[mt][half] = exp2_fast(m_ref[mt][half] - m_new);
          m_ref[mt][half] = m_new;
          row_sum[mt][half] *= alpha[mt][half];
        }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < kOTiles; ++dt)
#pragma unroll
          for (int i = 0; i < 4; ++i) o_acc[mt][dt][i] *= alpha[mt][i / 2];
      exponentiate();
    }
    // 5. l += this block's share.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) row_sum[mt][half] += block_sum[mt][half];
  };

  if (num_kv_blocks > 0) {
    // The first block has no P before it; it is compiled with the mask, which is correct for
    // any block (and costs one iteration's compares).
    process_block(0, std::true_type(), std::false_type());
    int kv_block = 1;
    for (; kv_block < num_unmasked_blocks; ++kv_block)
      process_block(kv_block, std::false_type(), std::true_type());
    for (; kv_block < num_kv_blocks; ++kv_block)
      process_block(kv_block, std::true_type(), std::true_type());
    // The last block's P V: its V was copied during the last iteration.
    cp_async_wait<0>();
    __syncthreads();
    accumulate_pv(num_kv_blocks - 1);
  }
  cp_async_wait<0>();  // a block that saw no key skipped the loop: let its Q copy finish

  // O = o_acc / l and LSE = (m_ref + log2 l) / log2 e, for the rows that exist.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = quad_sum(row_sum[mt][half]);
      const int query = q_start + warp_row0 + mt * kMmaM + g + 8 * half;
      if (query >= shape.seqlen_q) continue;
      const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key outputs 0
      bf16* o_row = o + int64_t(q_row0 + query) * kHeadDim;
#pragma unroll
      for (int dt = 0; dt < kOTiles; ++dt) {
        *reinterpret_cast<__nv_bfloat162*>(o_row + dt * kMmaN + 2 * t) = __floats2bfloat162_rn(
            o_acc[mt][dt][2 * half] * inv_l, o_acc[mt][dt][2 * half + 1] * inv_l);
      }
      if (t == 0)
        lse[q_row0 + query] = l > 0.0f ? (m_ref[mt][half] + log2f(l)) / kLog2e : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

inline size_t workspace_bytes(const AttentionShape&) { return 0; }

template <int kHeadDim>
void launch_for_head_dim(const attn::ForwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  auto kernel = flash_tc_kernel<kHeadDim>;
  // More than 48 KB of shared memory per block has to be asked for, once per kernel.
  static const bool smem_configured = [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(Smem<kHeadDim>::kBytes)));
    return true;
  }();
  (void)smem_configured;
  const int64_t num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const unsigned blocks = unsigned(num_q_blocks * shape.batch * shape.heads_q);
  kernel<<<blocks, kThreads, Smem<kHeadDim>::kBytes, stream>>>(
      static_cast<const bf16*>(params.q), static_cast<const bf16*>(params.k),
      static_cast<const bf16*>(params.v), static_cast<bf16*>(params.o), params.lse, shape,
      shape.softmax_scale() * kLog2e);
  CUDA_CHECK_LAUNCH();
}

inline void launch(const attn::ForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::ForwardChapter chapter() {
  attn::ForwardChapter c{
      "12_lazy_rescale",
      "chapter 11 with O rescaled only when a row max outgrows its reference by more than 8 "
      "(log2), P computed before that check",
      attn::DType::kBF16,
      {64, 128},
      80,
      /*survives_large_logits=*/true,
      workspace_bytes,
      "",
      launch};
  c.largest_logits = 1e9f;  // the exponent's FMA shares m c's rounding (chapter 06's README)
  return c;
}

}  // namespace ch12
