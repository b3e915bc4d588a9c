// Chapter 43: the last wave. Chapter 42's backward pass (swizzled tiles, stmatrix stores of the
// score tiles at d = 64, FlashAttention-2's warp tiling, dQ by atomics or a separate deterministic
// kernel) runs one thread block per (block of 128 keys, key/value head, sequence), one block per
// SM (its shared memory). Without the mask every block does the same work, so a launch takes as
// long as its number of waves rounded up: at head_dim 64 the benchmark grid has 4096 blocks, 31.03
// waves of 132 SMs, and the 32nd wave runs 4 blocks while 128 SMs wait, about 3% of the time. The
// idea: split the blocks of a nearly empty last wave. Without the mask, when the last wave is at
// most half full, its key blocks run as `pieces` thread blocks each, in a second launch, each
// walking a contiguous share of the block's steps and summing its own dK and dV; the last piece to
// finish adds up all the pieces' sums and writes dK and dV as before:
//
//   launch 1: key blocks 0 .. first_split - 1, whole: chapter 42's kernel (kPieces = false, the
//     same SASS), a whole number of waves (4092 blocks = 31 waves on the grid above)
//   launch 2: thread block b is piece p = b % pieces of key block first_split + b / pieces, and
//     walks steps [n p / pieces, n (p + 1) / pieces) of that block's n; on the grid above 4 key
//     blocks x 33 pieces = 132 thread blocks, one wave about 1/33 as long
//
// Each piece writes its sums (fp32, each thread its own fragments) to a slot of the workspace
// and counts itself in with an atomic add; the one that counts last reads the slots in piece
// order, so the sum is the same bits whichever piece finishes last, and the deterministic mode
// stays deterministic. dQ needs nothing new: in atomic mode each step adds its share anyway.
// Everything else is chapter 42's.
//
// One step (kBlockM queries of one query head) of the main kernel, with Q_i, dO_i, LSE_i and D_i
// in shared memory (double-buffered) and K_j, V_j (128 keys) there for the whole kernel:
//
//   Phase 1: S = Q_i K_j^T, P = exp2(S c - LSE log2 e); dP = dO_i V_j^T, dS = P (dP - D).
//   [kBlockM queries x 128 keys], 2 warps along queries x 4 along keys, kBlockM/2 x 32 each
//   (32 x 32 at d = 128, 64 x 32 at d = 64; at d = 64 read the rows below as 0-63 and 64-127):
//
//                  keys 0-31   32-63   64-95   96-127
//     queries  0-31  warp 0   warp 2  warp 4  warp 6
//     queries 32-63  warp 1   warp 3  warp 5  warp 7
//
//     P and dS go to shared memory as bf16 (the P and dS tiles, [kBlockM][128 + 8 keys]).
//     __syncthreads
//
//   Phase 2: dV += P^T dO_i, dK += dS^T Q_i, reduced over the step's kBlockM queries.
//   [128 keys x d], 4 warps along keys x 2 along head_dim, 32 x d/2 each, held in registers all
//   kernel long (2 x 32 x d/2 / 32 = d floats per thread: 128 at d = 128):
//
//                  columns 0 .. d/2-1   d/2 .. d-1
//     keys   0-31       warp 0            warp 4
//     keys  32-63       warp 1            warp 5
//     keys  64-95       warp 2            warp 6
//     keys 96-127       warp 3            warp 7
//
//     A = P^T or dS^T from their tiles with ldmatrix.trans; B = dO_i or Q_i.
//
//   Phase 3 (atomic mode only): dQ_i += dS K_j, reduced over the 128 keys.
//   [kBlockM queries x d], kBlockM/32 warps along queries x the rest along head_dim, 32 x 32 each:
//
//     d = 128       columns 0-31   32-63    64-95    96-127     d = 64    columns 0-31   32-63
//     queries  0-31     warp 0     warp 2   warp 4   warp 6     queries  0-31   warp 0  warp 4
//     queries 32-63     warp 1     warp 3   warp 5   warp 7     queries 32-63   warp 1  warp 5
//                                                               queries 64-95   warp 2  warp 6
//                                                               queries 96-127  warp 3  warp 7
//
//     A = dS from its tile (ldmatrix), B = K_j; added into the fp32 accumulator with 16-byte
//     red.global.add, as in chapter 16.
//
// Shared-memory bytes per step, counted as ldmatrix.x4 (512 bytes each) plus the stores of P and
// dS; one m16n8k16 MMA is 4096 FLOP. A warp tile of m x n rows needs m/16 A and n/16 B loads per
// k step of 16 for (m/16)(n/8) MMAs, so square tiles read the least per MMA:
//
//                         chapter 16 (4 warps)            chapter 17 (8 warps)
//   d = 128               32 queries x 64 keys            64 queries x 128 keys
//     S, dP               2 x 48 KiB (384 B/MMA)          2 x 128 KiB (256 B/MMA)
//     dV, dK              2 x 32 KiB (256 B/MMA)          2 x 96 KiB (192 B/MMA)
//     dQ                  40 KiB (320 B/MMA) + 4 KiB      128 KiB (256 B/MMA)
//     P, dS stores        (dS^T above)                    32 KiB
//     per step            204 KiB, 640 MMAs               608 KiB, 2560 MMAs
//     per MMA             326 bytes (12.5 FLOP/byte)      243 bytes (16.8 FLOP/byte)
//   d = 64                64 queries x 64 keys            128 queries x 128 keys
//     S, dP               2 x 40 KiB (320 B/MMA)          2 x 96 KiB (192 B/MMA)
//     dV, dK              2 x 32 KiB (256 B/MMA)          2 x 128 KiB (256 B/MMA)
//     dQ                  40 KiB (320 B/MMA) + 8 KiB      128 KiB (256 B/MMA)
//     P, dS stores        (dS^T above)                    64 KiB
//     per step            192 KiB, 640 MMAs               640 KiB, 2560 MMAs
//     per MMA             307 bytes (13.3 FLOP/byte)      256 bytes (16.0 FLOP/byte)
//
// (LSE and D, a few broadcast floats per thread and step, are left out.) At d = 128 the main
// kernel moves 25% fewer bytes of shared memory per FLOP; if shared memory stays what limits it
// (chapter 16: 76% busy, 35% SM compute), that is up to 1.3x. At d = 64, 128 queries per step
// is what makes the tiles square: with 64 (32 x 16 warp tiles of dQ, 384 B/MMA) the count was
// 307 bytes per MMA, no better than chapter 16's; with 128 it is 256 (230 for the loads alone,
// 17.8 FLOP/byte, about FlashAttention-2's), 17% fewer bytes per FLOP, and the fixed costs of a
// step (two barriers, the LSE/D copies, the cp.async bookkeeping) are paid once per 2560 MMAs
// instead of 1280. Of the layouts of 8 warps, phase 1's [128 x 128] could be 64 x 32 or 32 x 64
// per warp (both 192 B/MMA; 64 x 32 keeps d = 128's grid), phases 2 and 3 ([128 x 64] each) 32 x
// 32 (256 B/MMA; 16 x 64 or 64 x 16 would be 320).
//
// Registers at d = 64: a thread holds S (P) and dP of a 64 x 32 tile, 64 floats each, and dK, dV
// of a 32 x 32 tile, 32 each: 192 floats. With the fragments and addresses that is 250-254 of the
// 255 registers (-Xptxas -v, CUDA 13.0, sm_80 and sm_90) and nothing spills, so P stays in fp32
// registers until dS = P (dP - D) as at d = 128; had it spilled, the fallback was to keep P
// packed as bf16 (32 registers) once it is stored. Shared memory at d = 64: 166.25 KiB per block.
//
// Barriers of a step, and why each buffer is free when it is written (the same at both head
// dims; only kBlockM, and with it the sizes of the buffers, differs):
//   1. cp.async.wait_group 0, __syncthreads: this step's Q_i, dO_i, LSE_i, D_i have landed and
//      are visible; every warp has finished the previous step, so its Q/dO/LSE/D buffers (the
//      ones the next step's copies now go into) and the P and dS tiles (phase 1 writes them) are
//      no longer read.
//   2. __syncthreads after phase 1: every warp's P and dS are in shared memory before phases 2
//      and 3 read them. Phases 2 and 3 write no shared memory.
//   Epilogue: cp.async.wait_group 0, __syncthreads (every warp is done with K_j and V_j, and a
//   block with no step has its copies of them landed); each warp writes its dK and dV tiles,
//   as bf16, over K_j and V_j; __syncthreads; the block copies both to device memory.
//
// dQ, two ways (as in chapter 16):
//   atomic (default): the main kernel adds each step's dQ_i into an fp32 buffer in the workspace
//     (red.global.add.f32; the pre-pass zeroes it), and a small kernel converts it to bf16. The
//     order of the additions depends on the timing of the thread blocks: the sum is not the same
//     bits on every run.
//   deterministic: the main kernel skips phase 3. A separate kernel, chapter 16's unchanged (one
//     thread block per (query block, batch, query head), 4 warps of 16 query rows), walks the key
//     blocks and recomputes S = Q K^T, P, dP = dO V^T and dS, and keeps dQ in registers: dQ +=
//     dS K_j with A = dS straight from its accumulators. 7 matrix products instead of 5, and every
//     dQ is written once.
//
// Fragments of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"). Lane = 4 g + t;
// each register holds two bf16.
//
//   A 16x16 (row-major)             B 16x8 (k x n)              C/D 16x8 (fp32)
//   a0: row g,   cols 2t, 2t+1      b0: k 2t, 2t+1,   col g     c0, c1: row g,   cols 2t, 2t+1
//   a1: row g+8, cols 2t, 2t+1      b1: k 2t+8, 2t+9, col g     c2, c3: row g+8, cols 2t, 2t+1
//   a2: row g,   cols 2t+8, 2t+9
//   a3: row g+8, cols 2t+8, 2t+9
//
// The five products and where each operand comes from (ldmatrix.x4: lanes 8 i .. 8 i + 7 give
// the row addresses of 8x8 matrix i; without .trans lane 4 g + t receives row g, columns 2t, 2t+1
// of it; with .trans, rows 2t, 2t+1 of column g):
//
//   product           A (m x k)                     B (k x n)
//   S    = Q K^T      Q rows, load_a                K rows are B's columns, load_b_rows
//   dP   = dO V^T     dO rows, load_a               V rows, load_b_rows
//   dV  += P^T dO     P tile, load_a_transposed     dO, k = queries down its rows, load_b_columns
//   dK  += dS^T Q     dS tile, load_a_transposed    Q, k = queries down its rows, load_b_columns
//   dQ  += dS K       dS tile, load_a               K, k = keys down its rows, load_b_columns
//   (deterministic kernel: S = Q K^T and dP = dO V^T with load_a / load_b_rows, dQ += dS K with
//   A = dS from its accumulators and K through load_b_columns.)
//
// Rows past the end of Q, dO, K or V are zero-filled by cp.async; a step that touches them, or
// the causal diagonal, is compiled with the mask (P = 0 where a query does not see a key or either
// lies past the end), every other step without it. A query that sees no key has LSE = -inf; it
// only ever meets keys it does not see, so its P is always masked to 0 (the masked exp2 is +inf,
// replaced by 0, never multiplied).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch43 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

// The pre-pass, the dQ kernel and the convert kernel: 4 warps.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;  // mma.sync.m16n8k16
// The main kernel: 8 warps, kMainBlockN keys per thread block, kMainBlockMFor queries per step.
// Its warps are tiled 2D over a different matrix in each phase of a step (the diagrams at the
// top); a tile of 32 x 32, 64 x 32 or 32 x d/2 per warp reads fewer bytes of shared memory per MMA
// than chapter 16's 16 rows by everything. At d = 64 a step takes 128 queries (FlashAttention-2's
// kBlockM there): twice the FLOPs of 64 for the same barriers and LSE/D bookkeeping, and 64 x 32
// tiles of S and dP; at d = 128 the 64 x 32 accumulators of S and dP do not fit beside dK and dV.
constexpr int kMainWarps = 8;
constexpr int kMainThreads = kMainWarps * 32;
constexpr int kMainBlockN = 128;
template <int kHeadDim>
constexpr int kMainBlockMFor = kHeadDim == 64 ? 128 : 64;
// Phase 1, S and dP [kBlockM x kMainBlockN]: 2 warps along the queries x 4 along the keys.
constexpr int kSdpWarpsM = 2, kSdpWarpsN = 4;
// Phase 2, dK and dV [kMainBlockN x head_dim]: 4 warps along the keys x 2 along head_dim. A thread
// holds 32 x (head_dim / 2) / 32 floats of dK and as many of dV: 64 + 64 at d = 128.
constexpr int kDkvWarpsN = 4, kDkvWarpsD = 2;
// Phase 3, dQ_i [kBlockM x head_dim]: kBlockM / 32 warps along the queries, the rest along
// head_dim, 32 x 32 each at both head dims (2 x 4 at d = 128, 4 x 2 at d = 64).
template <int kHeadDim>
constexpr int kDqWarpsMFor = kMainBlockMFor<kHeadDim> / 32;
static_assert(kSdpWarpsM * kSdpWarpsN == kMainWarps && kDkvWarpsN * kDkvWarpsD == kMainWarps,
              "every phase uses every warp once");
// Keys per iteration of the dQ kernel, and its query rows per thread block: one 16-row MMA tile
// per warp.
constexpr int kBlockN = kWarps * kMmaM;
constexpr int kDqBlockM = kWarps * kMmaM;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kStages = 2;  // buffers for the tiles of the loop: one in use, one being filled

// Shared-memory rows are not padded (chapter 18 padded them by 16 bytes): 16-byte chunk c of row
// r of a Q, dO, K or V tile is stored at chunk c ^ (r % 8) of the row. The 8 rows an
// ldmatrix phase reads (one chunk each) still fall in 8 different groups of 4 banks, and the 8
// copies that write 128 bytes of a row fill one 128-byte line of shared memory, where padded rows
// made them straddle two (chapter 19).
__device__ int swizzle(int row, int col) { return col ^ (row & 7) << 3; }
template <int kHeadDim>
constexpr int kStride = kHeadDim;  // bf16 per shared-memory row of Q, dO, K, V
// bf16 per row (a query) of the P and dS tiles [kBlockM][kScoreStride]: padded by 8 bf16 (16
// bytes), as in chapter 18: nothing copies into them, and swizzled they cost registers (the
// addresses of phase 2's ldmatrix.trans stop being a base plus constants; ptxas then spills 44
// bytes at d = 128) and save no bank conflict.
constexpr int kScoreStride = kMainBlockN + 8;

// The main kernel's shared memory, in this order: K_j and V_j [kMainBlockN][kStride]; Q_i and
// dO_i, kStages buffers each [kBlockM][kStride]; LSE_i and D_i, kStages buffers each
// [kBlockM] floats; the P and dS tiles [kBlockM][kScoreStride]. Both modes need P and dS
// (dV and dK read them), so the size does not depend on the mode.
template <int kHeadDim>
struct KvSmem {
  static constexpr int kBlockM = kMainBlockMFor<kHeadDim>;
  static constexpr size_t kBytes =
      size_t(2 * kMainBlockN + 2 * kStages * kBlockM) * kStride<kHeadDim> * sizeof(bf16) +
      2 * kStages * kBlockM * sizeof(float) + size_t(2 * kBlockM) * kScoreStride * sizeof(bf16) +
      256;  // see the rounding of smem_raw in backward_kernel
};
// The dQ kernel's: Q and dO [kDqBlockM][kStride]; K_j, kStages buffers, then V_j, kStages
// buffers, each [kBlockN][kStride].
template <int kHeadDim>
struct DqSmem {
  static constexpr size_t kBytes =
      size_t(2 * kDqBlockM + 2 * kStages * kBlockN) * kStride<kHeadDim> * sizeof(bf16);
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

// The A fragment of a 16x16 tile from the accumulators of two neighbouring 16x8 tiles, the left
// (columns 0-7) and the right (columns 8-15): the C layout of each is the A layout of its half.
__device__ void pack_a(uint32_t (&a)[4], const float (&left)[4], const float (&right)[4]) {
  a[0] = pack(left[0], left[1]), a[1] = pack(left[2], left[3]);
  a[2] = pack(right[0], right[1]), a[3] = pack(right[2], right[3]);
}

// Four 8x8 bf16 matrices from shared memory; `row` is this lane's row address (see the top).
__device__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* row) {
  ldmatrix_x4(r, static_cast<uint32_t>(__cvta_generic_to_shared(row)));
}
// Four 8x8 bf16 matrices to shared memory (sm_90): `address` is this lane's row address (lane
// 8 i + j: row j of matrix i); r_i holds this lane's two elements of matrix i.
__device__ void stmatrix_x4(uint32_t address, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ uint32_t shared_address(const bf16* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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
template <bool kSwizzled = true>
__device__ void load_a(uint32_t (&a)[4], const bf16* tile, int stride, int row0, int col0,
                       int lane) {
  const int quarter = lane / 8, r = lane % 8;
  const int row = row0 + r + 8 * (quarter % 2), col = col0 + 8 * (quarter / 2);
  ldmatrix_x4(a, tile + row * stride + (kSwizzled ? swizzle(row, col) : col));
}

// A fragment of rows [m0, m0 + 16), columns [k0, k0 + 16) of a matrix whose transpose the tile
// holds (tile row = A's column): P^T and dS^T from the P and dS tiles. a0 wants (A[g][2t],
// A[g][2t+1]) = (T[2t][g], T[2t+1][g]), which is what .trans delivers from the 8x8 block of T at
// rows k0..k0+7, columns m0..m0+7. Quarter i: a1 is A's rows 8-15 = T's columns m0+8.., a2 is A's
// columns 8-15 = T's rows k0+8.., so T's row offset is 8 (i / 2) and its column offset 8 (i % 2).
__device__ void load_a_transposed(uint32_t (&a)[4], const bf16* tile, int stride, int m0, int k0,
                                  int lane) {
  const int quarter = lane / 8, r = lane % 8;
  ldmatrix_x4_trans(a, tile + (k0 + r + 8 * (quarter / 2)) * stride + m0 + 8 * (quarter % 2));
}

// B fragments of two n-tiles whose column n is row row0 + n of the tile (K for S = Q K^T, V for
// dP = dO V^T), k = columns col0 .. col0 + 15: b[0] = (b0, b1) for rows row0..row0 + 7, b[1] for
// the next 8 rows.
__device__ void load_b_rows(uint32_t (&b)[2][2], const bf16* tile, int stride, int row0, int col0,
                            int lane) {
  const int quarter = lane / 8, r = lane % 8;
  uint32_t regs[4];
  const int row = row0 + r + 8 * (quarter / 2);
  ldmatrix_x4(regs, tile + row * stride + swizzle(row, col0 + 8 * (quarter % 2)));
  b[0][0] = regs[0], b[0][1] = regs[1], b[1][0] = regs[2], b[1][1] = regs[3];
}

// B fragments of two n-tiles whose k runs down the rows of the tile (dO for dV = P^T dO, Q for
// dK = dS^T Q, K for dQ = dS K): k = rows row0 .. row0 + 15, columns col0 .. col0 + 7 for b[0]
// and the next 8 for b[1].
__device__ void load_b_columns(uint32_t (&b)[2][2], const bf16* tile, int stride, int row0,
                               int col0, int lane) {
  const int quarter = lane / 8, r = lane % 8;
  uint32_t regs[4];
  const int row = row0 + r + 8 * (quarter % 2);
  ldmatrix_x4_trans(regs, tile + row * stride + swizzle(row, col0 + 8 * (quarter / 2)));
  b[0][0] = regs[0], b[0][1] = regs[1], b[1][0] = regs[2], b[1][1] = regs[3];
}

// 2^x in one instruction (MUFU.EX2), flushing results below 2^-126 to zero (chapter 06).
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
// The same for one float: a row of LSE or D starts at any float, so 16-byte copies would not be
// aligned. (.cg takes only 16 bytes; .ca takes 4, 8 or 16.)
__device__ void cp_async_4(float* shared_dst, const float* global_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(global_src),
               "r"(valid ? 4 : 0)
               : "memory");
}
// dst[0..3] += x in device memory, atomically, without asking for the old values: a reduction
// (PTX red). The thread sends the additions on their way and does not wait for an answer. Hopper
// has a 16-byte form (dst 16-byte aligned): one request to the L2 cache instead of four, and the
// L2's rate of atomic requests is what limits the dQ sums (README, "What atomics cost").
__device__ void red_add4(float* dst, float4 x) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(x.x), "f"(x.y),
               "f"(x.z), "f"(x.w)
               : "memory");
#else
  const float parts[4] = {x.x, x.y, x.z, x.w};
  for (int i = 0; i < 4; ++i)
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst + i), "f"(parts[i]) : "memory");
#endif
}

// Closes the group of copies started since the last commit.
__device__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Starts copying rows [row0, row0 + kRows) of a [rows_total][kHeadDim] bf16 matrix into a swizzled
// shared tile, 16 bytes (8 bf16) per copy; rows past the end become zeros (chapter 13's loader).
// kBlockThreads threads share the copies.
template <int kRows, int kHeadDim, int kBlockThreads = kThreads>
__device__ void load_tile_async(bf16* tile, const bf16* src, int row0, int rows_total) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kBlockThreads / kChunksPerRow;
  constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kRows % kRowsPerPass == 0, "tile must divide evenly among threads");
  static_assert(kRowsPerPass % 8 == 0, "the same swizzle on every pass");
  const int r = threadIdx.x / kChunksPerRow, c = threadIdx.x % kChunksPerRow * 8;
  bf16* dst = tile + r * kStride<kHeadDim> + swizzle(r, c);
  const bf16* first = src + (int64_t(row0) + r) * kHeadDim + c;
  if (row0 + kRows <= rows_total) {  // the whole tile exists
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass)
      cp_async_16(dst + pass * kRowsPerPass * kStride<kHeadDim>,
                  first + pass * kRowsPerPass * kHeadDim, true);
  } else {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const bool valid = row0 + r + pass * kRowsPerPass < rows_total;
      // A skipped copy still gets a real address: row 0 of the matrix.
      cp_async_16(dst + pass * kRowsPerPass * kStride<kHeadDim>,
                  valid ? first + pass * kRowsPerPass * kHeadDim : src, valid);
    }
  }
}

// Each warp writes its 16 rows x kHeadDim of an fp32 accumulator, times `factor`, as bf16 into
// rows row0 .. row0 + 15 of a shared tile (conflict-free: lane (g, t) writes word t of chunk
// (column / 8) ^ g, 8 different chunks of 4 banks for the 8 rows g), then copies
// those rows to dst in 16-byte stores, kHeadDim / 8 lanes per row (chapter 14's epilogue). Rows
// with dst_row0 + row >= rows_total are not written.
template <int kHeadDim>
__device__ void store_rows(const float (&acc)[kHeadDim / kMmaN][4], float factor, bf16* tile,
                           int row0, bf16* dst, int64_t dst_row0, int rows_total, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int rr = row0 + g + 8 * half;
    bf16* row = tile + rr * kStride<kHeadDim>;
#pragma unroll
    for (int dt = 0; dt < kHeadDim / kMmaN; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(row + swizzle(rr, dt * kMmaN + 2 * t)) =
          __floats2bfloat162_rn(acc[dt][2 * half] * factor, acc[dt][2 * half + 1] * factor);
  }
  __syncwarp();
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = 32 / kChunksPerRow;
  const int r = lane / kChunksPerRow, c = lane % kChunksPerRow * 8;
#pragma unroll
  for (int pass = 0; pass < kMmaM / kRowsPerPass; ++pass) {
    const int row = row0 + pass * kRowsPerPass + r;
    if (dst_row0 + row < rows_total)
      *reinterpret_cast<uint4*>(dst + (dst_row0 + row) * kHeadDim + c) =
          *reinterpret_cast<const uint4*>(tile + row * kStride<kHeadDim> + swizzle(row, c));
  }
}

// The main kernel's epilogue, in two halves with a barrier between them. First each warp writes
// its kMTiles x 16 rows by kNTiles x 8 columns of an fp32 accumulator, times `factor`, as bf16
// into a shared tile at (row0, col0) (conflict-free as in store_rows); then every thread of the
// block copies rows of the whole [kRows][kHeadDim] tile to dst in 16-byte stores, rows with
// dst_row0 + row >= rows_total left out.
template <int kHeadDim, int kMTiles, int kNTiles>
__device__ void write_warp_tile(const float (&acc)[kMTiles][kNTiles][4], float factor, bf16* tile,
                                int row0, int col0, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rr = row0 + mt * kMmaM + g + 8 * half;
      bf16* row = tile + rr * kStride<kHeadDim>;
#pragma unroll
      for (int dt = 0; dt < kNTiles; ++dt)
        *reinterpret_cast<__nv_bfloat162*>(row + swizzle(rr, col0 + dt * kMmaN + 2 * t)) =
            __floats2bfloat162_rn(acc[mt][dt][2 * half] * factor,
                                  acc[mt][dt][2 * half + 1] * factor);
    }
}
template <int kRows, int kHeadDim>
__device__ void copy_tile_out(const bf16* tile, bf16* dst, int64_t dst_row0, int rows_total) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kMainThreads / kChunksPerRow;
  static_assert(kRows % kRowsPerPass == 0, "tile must divide evenly among threads");
  const int r = threadIdx.x / kChunksPerRow, c = threadIdx.x % kChunksPerRow * 8;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + r;
    if (dst_row0 + row < rows_total)
      *reinterpret_cast<uint4*>(dst + (dst_row0 + row) * kHeadDim + c) =
          *reinterpret_cast<const uint4*>(tile + row * kStride<kHeadDim> + swizzle(row, c));
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

// The pre-pass: D = rowsum(dO * O) per query row, in fp32 from the bf16 inputs; in atomic mode
// (dq_accum not null) it also zeroes that row of the dQ accumulator. kHeadDim / 8 lanes per row,
// 16 bytes each.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    delta_kernel(const bf16* o, const bf16* dout, float* delta, float* dq_accum, int64_t rows) {
  constexpr int kLanesPerRow = kHeadDim / 8;
  constexpr int kRowsPerBlock = kThreads / kLanesPerRow;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int c = threadIdx.x % kLanesPerRow * 8;
  float sum = 0.0f;
  if (row < rows) {
    const int64_t offset = row * kHeadDim + c;
    const uint4 o_chunk = *reinterpret_cast<const uint4*>(o + offset);
    const uint4 do_chunk = *reinterpret_cast<const uint4*>(dout + offset);
    const __nv_bfloat162* o_pairs = reinterpret_cast<const __nv_bfloat162*>(&o_chunk);
    const __nv_bfloat162* do_pairs = reinterpret_cast<const __nv_bfloat162*>(&do_chunk);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 o_pair = __bfloat1622float2(o_pairs[i]);
      const float2 do_pair = __bfloat1622float2(do_pairs[i]);
      sum += o_pair.x * do_pair.x + o_pair.y * do_pair.y;
    }
    if (dq_accum != nullptr) {
      float4* accum = reinterpret_cast<float4*>(dq_accum + offset);
      accum[0] = accum[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  // The lanes of a row are neighbours in the warp; every lane takes part, in a row or not.
#pragma unroll
  for (int width = kLanesPerRow / 2; width > 0; width /= 2)
    sum += __shfl_xor_sync(kFullWarp, sum, width);
  if (row < rows && threadIdx.x % kLanesPerRow == 0) delta[row] = sum;
}

// The main kernel: dK_j and dV_j of one block of keys, and in atomic mode (kComputeDq) each
// step's share of dQ. Block b handles key block b % num_kv_blocks of (batch, kv head) =
// b / num_kv_blocks: under the causal mask the first key blocks see the most queries, and they
// start first.
template <int kHeadDim, bool kComputeDq, bool kPieces>
__global__ void __launch_bounds__(kMainThreads, 1)
    backward_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                    const float* delta, float* dq_accum, bf16* dk, bf16* dv, AttentionShape shape,
                    float scale, float scale_log2, float4* partials, unsigned* arrivals,
                    unsigned first_split, int pieces) {
  constexpr int kStr = kStride<kHeadDim>;
  constexpr int kBlockM = kMainBlockMFor<kHeadDim>;
  constexpr int kHeadSteps = kHeadDim / kMmaK;  // S, dP: k runs over head_dim
  // Phase 1: this warp's tile of S and dP, kSdpRows queries x kSdpCols keys.
  constexpr int kSdpRows = kBlockM / kSdpWarpsM, kSdpCols = kMainBlockN / kSdpWarpsN;
  constexpr int kSdpMTiles = kSdpRows / kMmaM, kSdpNTiles = kSdpCols / kMmaN;
  // Phase 2: this warp's tile of dK and dV, kDkvRows keys x kDkvCols columns.
  constexpr int kDkvRows = kMainBlockN / kDkvWarpsN, kDkvCols = kHeadDim / kDkvWarpsD;
  constexpr int kDkvMTiles = kDkvRows / kMmaM, kDkvNTiles = kDkvCols / kMmaN;
  constexpr int kQuerySteps = kBlockM / kMmaK;  // dV, dK: k runs over the step's queries
  // Phase 3: this warp's tile of dQ_i, kDqRows queries x kDqCols columns.
  constexpr int kDqWarpsM = kDqWarpsMFor<kHeadDim>, kDqWarpsD = kMainWarps / kDqWarpsM;
  static_assert(kDqWarpsM * kDqWarpsD == kMainWarps, "phase 3 uses every warp once");
  constexpr int kDqRows = kBlockM / kDqWarpsM, kDqCols = kHeadDim / kDqWarpsD;
  constexpr int kDqMTiles = kDqRows / kMmaM, kDqNTiles = kDqCols / kMmaN;
  constexpr int kKeySteps = kMainBlockN / kMmaK;  // dQ: k runs over the block's keys
  static_assert(kSdpNTiles % 2 == 0 && kDkvNTiles % 2 == 0 && kDqNTiles % 2 == 0,
                "B fragments come in pairs of 8-column tiles");
  static_assert(2 * kBlockM <= kMainThreads, "one thread per copy of LSE_i and of D_i");

  // The tiles must start on 256-byte boundaries (the XOR of `scores`): the start of the dynamic
  // shared memory is rounded up, hence the 256 bytes more KvSmem asks for.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem =
      smem_raw + (0u - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 255u);
  bf16* k_tile = reinterpret_cast<bf16*>(smem);  // [kMainBlockN][kStr]
  bf16* v_tile = k_tile + kMainBlockN * kStr;    // [kMainBlockN][kStr]
  bf16* q_tiles = v_tile + kMainBlockN * kStr;   // [kStages][kBlockM][kStr]
  bf16* dout_tiles = q_tiles + kStages * kBlockM * kStr;
  // LSE_i and D_i, [kStages][kBlockM] floats each, then the P and dS tiles, [kBlockM][kScoreStride]
  // bf16 each (a row is a query, a column a key of the block).
  float* lse_tiles = reinterpret_cast<float*>(dout_tiles + kStages * kBlockM * kStr);
  float* delta_tiles = lse_tiles + kStages * kBlockM;
  bf16* p_tile = reinterpret_cast<bf16*>(delta_tiles + kStages * kBlockM);
  bf16* ds_tile = p_tile + kBlockM * kScoreStride;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Which key block, and which piece of it: the launch of whole blocks is chapter 42's (thread
  // block b is key block b); in the launch of pieces, thread block b is piece b % pieces of key
  // block first_split + b / pieces.
  const unsigned item = kPieces ? first_split + blockIdx.x / pieces : blockIdx.x;
  const int piece = kPieces ? int(blockIdx.x % pieces) : 0;
  const int num_kv_blocks = (shape.seqlen_k + kMainBlockN - 1) / kMainBlockN;
  const int kv_block = int(item % num_kv_blocks);
  const int64_t batch_kv_head = item / num_kv_blocks;
  const int64_t batch = batch_kv_head / shape.heads_kv;
  const int kv_head = int(batch_kv_head % shape.heads_kv);
  const int group = shape.group_size();
  const int kv_start = kv_block * kMainBlockN;
  const int64_t kv_row0 = batch_kv_head * shape.seqlen_k;  // first row of this head in K, V
  // First row of the group's first query head in Q, dO, LSE and D; query head kv_head * group + h
  // starts seqlen_q rows further per h. Row numbers are ints, as in chapter 14: 2^31 rows of Q do
  // not fit in a GPU, and at d = 128 the int64 versions cost the registers that ptxas then spills.
  const int group_row0 = int((batch * shape.heads_q + int64_t(kv_head) * group) * shape.seqlen_q);
  // This warp's tile in each phase (queries within the step, keys within the block, columns).
  const int sdp_row0 = warp % kSdpWarpsM * kSdpRows, sdp_col0 = warp / kSdpWarpsM * kSdpCols;
  const int dkv_row0 = warp % kDkvWarpsN * kDkvRows, dkv_col0 = warp / kDkvWarpsN * kDkvCols;
  const int dq_row0 = warp % kDqWarpsM * kDqRows, dq_col0 = warp / kDqWarpsM * kDqCols;

  // The query blocks that see a key of this block: from the one holding the first query that
  // sees key kv_start (bottom-right aligned) to the last. A step needs no mask when every query
  // of it sees every key of the block (it starts at or after kv_start + kMainBlockN - 1 - offset)
  // and neither runs past the end.
  const int offset = shape.causal_offset();
  const int first_query = shape.causal ? max(0, kv_start - offset) : 0;
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const int first_q_block = first_query / kBlockM;
  const int steps_per_head = first_query < shape.seqlen_q ? num_q_blocks - first_q_block : 0;
  const int all_steps = group * steps_per_head;  // every query head of the group, in turn
  // This thread block's share of them: all, or piece `piece` of `pieces`. The loop counts its
  // own steps from 0 (the buffers only need step % kStages to alternate).
  const int step_begin = kPieces ? all_steps * piece / pieces : 0;
  const int num_steps = kPieces ? all_steps * (piece + 1) / pieces - step_begin : all_steps;
  const bool kv_tail = kv_start + kMainBlockN > shape.seqlen_k;

  // Step s is query block first_q_block + s % steps_per_head of query head s / steps_per_head of
  // the group; the loop walks them with counters instead of dividing.
  struct StepPos {
    int row0, q_start;  // first row of the head in Q, dO, LSE, D; first query of the block
  };
  auto next_pos = [&](StepPos p) {
    p.q_start += kBlockM;
    if (p.q_start >= shape.seqlen_q) p.q_start = first_q_block * kBlockM, p.row0 += shape.seqlen_q;
    return p;
  };
  auto q_tile = [&](int step) { return q_tiles + step % kStages * kBlockM * kStr; };
  auto dout_tile = [&](int step) { return dout_tiles + step % kStages * kBlockM * kStr; };
  auto lse_tile = [&](int step) { return lse_tiles + step % kStages * kBlockM; };
  auto delta_tile = [&](int step) { return delta_tiles + step % kStages * kBlockM; };
  auto load_step = [&](int step, StepPos pos) {
    const int row0 = pos.row0;
    const int q_start = pos.q_start;
    load_tile_async<kBlockM, kHeadDim, kMainThreads>(q_tile(step), q + int64_t(row0) * kHeadDim,
                                                     q_start, shape.seqlen_q);
    load_tile_async<kBlockM, kHeadDim, kMainThreads>(
        dout_tile(step), dout + int64_t(row0) * kHeadDim, q_start, shape.seqlen_q);
    // Rows past the end get LSE = 0 and D = 0; they are masked (and Q, dO are 0 there).
    const int i = threadIdx.x % kBlockM;
    const bool valid = q_start + i < shape.seqlen_q;
    if (threadIdx.x < kBlockM)
      cp_async_4(lse_tile(step) + i, valid ? lse + row0 + q_start + i : lse, valid);
    else if (threadIdx.x < 2 * kBlockM)
      cp_async_4(delta_tile(step) + i, valid ? delta + row0 + q_start + i : delta, valid);
  };

  // Prologue: K_j, V_j and the first step's tiles in one group.
  load_tile_async<kMainBlockN, kHeadDim, kMainThreads>(k_tile, k + kv_row0 * kHeadDim, kv_start,
                                                       shape.seqlen_k);
  load_tile_async<kMainBlockN, kHeadDim, kMainThreads>(v_tile, v + kv_row0 * kHeadDim, kv_start,
                                                       shape.seqlen_k);
  // Step s is query block first_q_block + s % steps_per_head of the group's query head
  // s / steps_per_head (one division, for a piece that starts inside a head).
  const int begin_head = step_begin > 0 ? step_begin / steps_per_head : 0;
  const StepPos begin_pos{group_row0 + begin_head * shape.seqlen_q,
                          (first_q_block + step_begin - begin_head * steps_per_head) * kBlockM};
  if (num_steps > 0) load_step(0, begin_pos);
  cp_async_commit();

  // Keys dkv_row0 + 16 mt + g (+ 8) of the block, columns dkv_col0 + 8 dt + 2t, 2t + 1.
  float dk_acc[kDkvMTiles][kDkvNTiles][4] = {}, dv_acc[kDkvMTiles][kDkvNTiles][4] = {};

  // S or dP of this warp's tile: (Q or dO rows) x (K or V rows)^T. Per k step the warp loads
  // kSdpMTiles A fragments and kSdpNTiles / 2 pairs of B fragments for kSdpMTiles x kSdpNTiles
  // MMAs. (Fully unrolled, ptxas (CUDA 13.0) issues the loads of many k steps ahead, and at
  // d = 128 in atomic mode it then spills; the pipeline below holds exactly two steps.)
  auto scores = [&](float(&acc)[kSdpMTiles][kSdpNTiles][4], const bf16* q_rows,
                    const bf16* kv_rows) {
    // Software-pipelined in registers: the fragments of k step ks + 1 are loaded before the MMAs
    // of step ks, into the other of two buffers, so that the ldmatrix latency hides behind the
    // MMAs. Two buffers are as many registers as the unroll by 2 held.
    static_assert(kHeadSteps % 2 == 0 && kHeadSteps >= 4, "k steps come in pairs");
    uint32_t a[2][kSdpMTiles][4], b[2][kSdpNTiles / 2][2][2];
    // This lane's ldmatrix addresses at k step 0 (load_a's and load_b_rows' rows and columns).
    // Rows start on 256-byte (d = 128) or 128-byte (d = 64) boundaries and the swizzle moves
    // 16-byte chunks only within a row, so the address of k step ks, columns 16 ks further on, is
    // the step-0 address XOR 32 ks: one instruction per step instead of the swizzle's arithmetic.
    const int quarter = lane / 8, r = lane % 8;
    const int a_row = sdp_row0 + r + 8 * (quarter % 2), b_row = sdp_col0 + r + 8 * (quarter / 2);
    const uint32_t a_base =
        shared_address(q_rows + a_row * kStr + swizzle(a_row, 8 * (quarter / 2)));
    const uint32_t b_base =
        shared_address(kv_rows + b_row * kStr + swizzle(b_row, 8 * (quarter % 2)));
    constexpr uint32_t kTileRowsBytes = kMmaM * kStr * sizeof(bf16);  // 16 rows further on
    auto load = [&](int buf, int ks) {
      const uint32_t step = ks * kMmaK * sizeof(bf16);
#pragma unroll
      for (int mt = 0; mt < kSdpMTiles; ++mt)
        ldmatrix_x4(a[buf][mt], (a_base ^ step) + mt * kTileRowsBytes);
#pragma unroll
      for (int nt = 0; nt < kSdpNTiles; nt += 2) {
        uint32_t regs[4];
        ldmatrix_x4(regs, (b_base ^ step) + nt / 2 * kTileRowsBytes);
        b[buf][nt / 2][0][0] = regs[0], b[buf][nt / 2][0][1] = regs[1];
        b[buf][nt / 2][1][0] = regs[2], b[buf][nt / 2][1][1] = regs[3];
      }
    };
    auto mma = [&](int buf) {
#pragma unroll
      for (int nt = 0; nt < kSdpNTiles; nt += 2)
#pragma unroll
        for (int mt = 0; mt < kSdpMTiles; ++mt) {
          mma_16816(acc[mt][nt], a[buf][mt], b[buf][nt / 2][0]);
          mma_16816(acc[mt][nt + 1], a[buf][mt], b[buf][nt / 2][1]);
        }
    };
    load(0, 0);
#pragma unroll 1
    for (int ks = 0; ks < kHeadSteps - 2; ks += 2) {
      load(1, ks + 1);
      mma(0);
      load(0, ks + 2);
      mma(1);
    }
    load(1, kHeadSteps - 1);
    mma(0);
    mma(1);
  };
  // Stores this warp's tile of P or dS as bf16 into rows (queries) and columns (keys) of a score
  // tile. At d = 64 with stmatrix.x4: one instruction stores four 8x8 matrices, lane 8 i + j
  // giving the address of row j of matrix i, and register i holding lane (g, t)'s two elements of
  // matrix i (row g, columns 2t, 2t + 1): exactly a packed half of an accumulator tile. The four
  // matrices of one store are the four n-tiles (32 keys) of 8 rows. At d = 128, 4-byte stores as
  // in chapter 41: lane (g, t) writes row 16 mt + g (+ 8), column 8 nt + 2t; a row is 68 words,
  // 4 g + t modulo 32 banks, so the 32 lanes hit 32 different banks. (stmatrix measured slower
  // there in the atomic mode, with the dQ reductions: the README's "Why not at head_dim 128".)
  static_assert(kSdpNTiles == 4, "one stmatrix.x4 per 8 rows of a warp's tile");
  const uint32_t score_lane_offset =
      ((sdp_row0 + lane % 8) * kScoreStride + sdp_col0 + 8 * (lane / 8)) * sizeof(bf16);
  auto store_scores = [&](bf16* tile, const float(&acc)[kSdpMTiles][kSdpNTiles][4]) {
    if constexpr (kHeadDim == 64) {
      const uint32_t base = shared_address(tile) + score_lane_offset;
#pragma unroll
      for (int mt = 0; mt < kSdpMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          stmatrix_x4(base + (mt * kMmaM + 8 * half) * kScoreStride * sizeof(bf16),
                      pack(acc[mt][0][2 * half], acc[mt][0][2 * half + 1]),
                      pack(acc[mt][1][2 * half], acc[mt][1][2 * half + 1]),
                      pack(acc[mt][2][2 * half], acc[mt][2][2 * half + 1]),
                      pack(acc[mt][3][2 * half], acc[mt][3][2 * half + 1]));
    } else {
#pragma unroll
      for (int mt = 0; mt < kSdpMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSdpNTiles; ++nt)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            *reinterpret_cast<uint32_t*>(
                tile + (sdp_row0 + mt * kMmaM + g + 8 * half) * kScoreStride + sdp_col0 +
                nt * kMmaN + 2 * t) = pack(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
    }
  };
  // acc += X^T Y over the step's queries for this warp's tile of dK or dV: X^T = P^T or dS^T from
  // the P or dS tile (which holds X, queries x keys: ldmatrix.trans) and Y = dO_i or Q_i.
  auto accumulate_over_queries = [&](float(&acc)[kDkvMTiles][kDkvNTiles][4], const bf16* x_tile,
                                     const bf16* y_rows) {
#pragma unroll
    for (int ks = 0; ks < kQuerySteps; ++ks) {
      uint32_t a[kDkvMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kDkvMTiles; ++mt)
        load_a_transposed(a[mt], x_tile, kScoreStride, dkv_row0 + mt * kMmaM, ks * kMmaK, lane);
#pragma unroll
      for (int dt = 0; dt < kDkvNTiles; dt += 2) {
        uint32_t b[2][2];
        load_b_columns(b, y_rows, kStr, ks * kMmaK, dkv_col0 + dt * kMmaN, lane);
#pragma unroll
        for (int mt = 0; mt < kDkvMTiles; ++mt) {
          mma_16816(acc[mt][dt], a[mt], b[0]);
          mma_16816(acc[mt][dt + 1], a[mt], b[1]);
        }
      }
    }
  };

  // One step: query block q_start of the head that starts at row0. Written once, compiled twice
  // (with and without the mask).
  auto process_step = [&](int step, int row0, int q_start, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    // Barrier 1. Wait for this step's tiles; after the barrier every warp is also done with the
    // previous step (its Q, dO, LSE and D buffers, the P and dS tiles), so those may be
    // overwritten: the next step's copies go into the other buffers, phase 1 writes P and dS.
    cp_async_wait<0>();
    __syncthreads();
    if (step + 1 < num_steps) load_step(step + 1, next_pos(StepPos{row0, q_start}));
    cp_async_commit();
    const bf16* q_rows = q_tile(step);
    const bf16* dout_rows = dout_tile(step);
    const float* lse_row = lse_tile(step);
    const float* delta_row = delta_tile(step);

    // Phase 1. S = Q_i K_j^T, then P = exp2(S c - LSE log2 e) in place. Element i of tile
    // (mt, nt): query sdp_row0 + 16 mt + g + 8 (i / 2), key sdp_col0 + 8 nt + 2 t + i % 2.
    float p[kSdpMTiles][kSdpNTiles][4] = {};
    scores(p, q_rows, k_tile);
#pragma unroll
    for (int mt = 0; mt < kSdpMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = sdp_row0 + mt * kMmaM + g + 8 * half;
        const float lse_log2 = lse_row[row] * kLog2e;
#pragma unroll
        for (int nt = 0; nt < kSdpNTiles; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& x = p[mt][nt][2 * half + j];
            x = exp2_fast(x * scale_log2 - lse_log2);
            if (kMasked) {
              const int key = kv_start + sdp_col0 + nt * kMmaN + 2 * t + j;
              const int query = q_start + row;
              if (key >= shape.seqlen_k || query >= shape.seqlen_q ||
                  (shape.causal && key > query + offset))
                x = 0.0f;
            }
          }
      }
    store_scores(p_tile, p);
    // dP = dO_i V_j^T, then dS = P (dP - D) in place.
    float ds[kSdpMTiles][kSdpNTiles][4] = {};
    scores(ds, dout_rows, v_tile);
#pragma unroll
    for (int mt = 0; mt < kSdpMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float row_delta = delta_row[sdp_row0 + mt * kMmaM + g + 8 * half];
#pragma unroll
        for (int nt = 0; nt < kSdpNTiles; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& x = ds[mt][nt][2 * half + j];
            x = p[mt][nt][2 * half + j] * (x - row_delta);
          }
      }
    store_scores(ds_tile, ds);
    // Barrier 2: every warp's P and dS are in shared memory.
    __syncthreads();

    // Phase 2. dV += P^T dO_i, dK += dS^T Q_i (the scale is applied once, at the end).
    accumulate_over_queries(dv_acc, p_tile, dout_rows);
    accumulate_over_queries(dk_acc, ds_tile, q_rows);

    // Phase 3. dQ_i += dS K_j, reduced over the block's keys, A = dS straight from its tile.
    if constexpr (kComputeDq) {
      float dq[kDqMTiles][kDqNTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < kKeySteps; ++ks) {
        uint32_t a[kDqMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kDqMTiles; ++mt)
          load_a<false>(a[mt], ds_tile, kScoreStride, dq_row0 + mt * kMmaM, ks * kMmaK, lane);
#pragma unroll
        for (int dt = 0; dt < kDqNTiles; dt += 2) {
          uint32_t b[2][2];
          load_b_columns(b, k_tile, kStr, ks * kMmaK, dq_col0 + dt * kMmaN, lane);
#pragma unroll
          for (int mt = 0; mt < kDqMTiles; ++mt) {
            mma_16816(dq[mt][dt], a[mt], b[0]);
            mma_16816(dq[mt][dt + 1], a[mt], b[1]);
          }
        }
      }
      // Lane (g, t) holds columns 2t, 2t + 1 of both 8-column tiles of a pair. Lanes t and t ^ 1
      // swap one pair, so that the even lane holds columns 2t..2t + 3 of the first tile and the
      // odd lane four neighbours of the second: one 16-byte red each instead of four 4-byte ones.
      const bool even = t % 2 == 0;
      // This lane's first element: row g of the warp's first tile, its four columns; every other
      // one is a constant further on (16 or 8 rows, 16 columns), so one pointer serves all.
      float* dq_lane = dq_accum + int64_t(row0 + q_start + dq_row0 + g) * kHeadDim + dq_col0 +
                       (even ? 2 * t : kMmaN + 2 * (t - 1));
#pragma unroll
      for (int mt = 0; mt < kDqMTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < kDqNTiles; dt += 2)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float2 first = {dq[mt][dt][2 * half], dq[mt][dt][2 * half + 1]};
            const float2 second = {dq[mt][dt + 1][2 * half], dq[mt][dt + 1][2 * half + 1]};
            const float2 give = even ? second : first;
            const float2 got = {__shfl_xor_sync(kFullWarp, give.x, 1),
                                __shfl_xor_sync(kFullWarp, give.y, 1)};
            const float4 four = even ? make_float4(first.x, first.y, got.x, got.y)
                                     : make_float4(got.x, got.y, second.x, second.y);
            const int row = mt * kMmaM + 8 * half;  // past this lane's first row
            // Unmasked steps lie wholly inside the sequence: no row to leave out.
            if (!kMasked || q_start + dq_row0 + g + row < shape.seqlen_q)
              red_add4(dq_lane + row * kHeadDim + dt * kMmaN, four);
          }
    }
  };

  StepPos pos = begin_pos;
  for (int step = 0; step < num_steps; ++step, pos = next_pos(pos)) {
    const int row0 = pos.row0;
    const int q_start = pos.q_start;
    // (Chapter 18 kept kv_start + kMainBlockN - 1 - offset in a register; with the swizzled
    // addresses that register is one too many at d = 64, and ptxas spilled 4 bytes. Recomputed
    // here from kernel parameters, it costs a few instructions a step and spills nothing.)
    const bool masked =
        kv_tail || q_start + kBlockM > shape.seqlen_q ||
        (shape.causal && q_start < kv_start + kMainBlockN - 1 - shape.causal_offset());
    if (masked) process_step(step, row0, q_start, std::true_type());
    else process_step(step, row0, q_start, std::false_type());
  }

  // The epilogue: dK (times the scale) and dV leave through the K and V tiles. Every warp reads
  // K_j and V_j until its last step is done, and a block with no step still has its copies of
  // K_j and V_j in flight: wait for both (barrier 3). Each warp writes its tile of dK and dV;
  // after barrier 4 the whole block copies the two tiles out.
  cp_async_wait<0>();
  __syncthreads();
  if constexpr (kPieces) {
    // (Which piece of which split key block, worked out again: kept from the top of the kernel,
    // the values would hold registers through the loop, which at d = 128 has none to spare.)
    const unsigned split_item = blockIdx.x / pieces;
    const int piece = int(blockIdx.x % pieces);
    // A piece: its sums to its slot, [2][kChunks][kMainThreads] float4 (dK's chunks, then dV's;
    // thread-major, so that neighbouring threads write neighbouring 16 bytes). The fence makes
    // them visible to the whole GPU before the count says so; the barrier, before thread 0 counts
    // the block in. No piece waits for another: the last to count does the sum.
    constexpr int kChunks = kDkvMTiles * kDkvNTiles;  // float4 per accumulator and thread
    float4* slot = partials + (int64_t(split_item) * pieces + piece) * (2 * kChunks * kMainThreads);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const float* dk4 = dk_acc[i / kDkvNTiles][i % kDkvNTiles];
      const float* dv4 = dv_acc[i / kDkvNTiles][i % kDkvNTiles];
      slot[i * kMainThreads + threadIdx.x] = make_float4(dk4[0], dk4[1], dk4[2], dk4[3]);
      slot[(kChunks + i) * kMainThreads + threadIdx.x] =
          make_float4(dv4[0], dv4[1], dv4[2], dv4[3]);
    }
    __threadfence();
    __syncthreads();
    __shared__ bool last_piece;
    if (threadIdx.x == 0) last_piece = atomicAdd(arrivals + split_item, 1u) == unsigned(pieces - 1);
    __syncthreads();
    if (!last_piece) return;
    // The last piece: every slot, in piece order (ld.global.cg: from L2, where the other SMs'
    // stores are; this SM's L1 may hold nothing of them, but it is not asked). Its fence orders
    // the reads after the count it saw, so that they see what the pieces counted before it wrote.
    __threadfence();
    const float4* first = partials + int64_t(split_item) * pieces * (2 * kChunks * kMainThreads);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      float* dk4 = dk_acc[i / kDkvNTiles][i % kDkvNTiles];
      float* dv4 = dv_acc[i / kDkvNTiles][i % kDkvNTiles];
      float4 dk_sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f), dv_sum = dk_sum;
      for (int p = 0; p < pieces; ++p) {
        const float4* from = first + p * (2 * kChunks * kMainThreads) + threadIdx.x;
        const float4 a = __ldcg(from + i * kMainThreads),
                     b = __ldcg(from + (kChunks + i) * kMainThreads);
        dk_sum.x += a.x, dk_sum.y += a.y, dk_sum.z += a.z, dk_sum.w += a.w;
        dv_sum.x += b.x, dv_sum.y += b.y, dv_sum.z += b.z, dv_sum.w += b.w;
      }
      dk4[0] = dk_sum.x, dk4[1] = dk_sum.y, dk4[2] = dk_sum.z, dk4[3] = dk_sum.w;
      dv4[0] = dv_sum.x, dv4[1] = dv_sum.y, dv4[2] = dv_sum.z, dv4[3] = dv_sum.w;
    }
  }
  write_warp_tile<kHeadDim>(dk_acc, scale, k_tile, dkv_row0, dkv_col0, lane);
  write_warp_tile<kHeadDim>(dv_acc, 1.0f, v_tile, dkv_row0, dkv_col0, lane);
  __syncthreads();
  copy_tile_out<kMainBlockN, kHeadDim>(k_tile, dk + kv_row0 * kHeadDim, kv_start, shape.seqlen_k);
  copy_tile_out<kMainBlockN, kHeadDim>(v_tile, dv + kv_row0 * kHeadDim, kv_start, shape.seqlen_k);
}

// Deterministic mode's dQ: one thread block per (query block, batch, query head), 4 warps of 16
// query rows, walking the key blocks the block sees as the forward kernel does. Block b handles
// (batch, head) = b / num_q_blocks and counts its query block from the last (longest first).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
              const float* delta, bf16* dq, AttentionShape shape, float scale, float scale_log2) {
  constexpr int kStr = kStride<kHeadDim>;
  constexpr int kSTiles = kBlockN / kMmaN;      // S, dP: tiles of 8 keys
  constexpr int kDTiles = kHeadDim / kMmaN;     // dQ: tiles of 8 columns
  constexpr int kHeadSteps = kHeadDim / kMmaK;  // S, dP: k runs over head_dim
  constexpr int kKeySteps = kBlockN / kMmaK;    // dQ: k runs over the block's keys
  static_assert(kDqBlockM == kWarps * kMmaM, "one 16-row tile per warp");

  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_tile = reinterpret_cast<bf16*>(smem);  // [kDqBlockM][kStr]
  bf16* dout_tile = q_tile + kDqBlockM * kStr;   // [kDqBlockM][kStr]
  // K buffers 0 and 1, then V buffers 0 and 1, each [kBlockN][kStr]. Block j uses buffer j % 2.
  bf16* kv_tiles = dout_tile + kDqBlockM * kStr;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int num_q_blocks = (shape.seqlen_q + kDqBlockM - 1) / kDqBlockM;
  const int q_block = num_q_blocks - 1 - int(blockIdx.x % num_q_blocks);
  const int64_t batch_head = blockIdx.x / num_q_blocks;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();
  const int64_t q_row0 = batch_head * shape.seqlen_q;
  const int64_t kv_row0 = (batch * shape.heads_kv + kv_head) * shape.seqlen_k;
  const bf16* k_head = k + kv_row0 * kHeadDim;
  const bf16* v_head = v + kv_row0 * kHeadDim;
  const int q_start = q_block * kDqBlockM;
  const int warp_row0 = warp * kMmaM;  // this warp's first row within the block
  const int offset = shape.causal_offset();

  auto k_tile = [&](int kv_block) { return kv_tiles + kv_block % kStages * kBlockN * kStr; };
  auto v_tile = [&](int kv_block) {
    return kv_tiles + (kStages + kv_block % kStages) * kBlockN * kStr;
  };
  auto load_kv = [&](int kv_block) {
    load_tile_async<kBlockN, kHeadDim>(k_tile(kv_block), k_head, kv_block * kBlockN,
                                       shape.seqlen_k);
    load_tile_async<kBlockN, kHeadDim>(v_tile(kv_block), v_head, kv_block * kBlockN,
                                       shape.seqlen_k);
  };

  // The key blocks the block's last row sees, and those that every row sees whole (chapter 10).
  const int q_last = min(q_start + kDqBlockM, shape.seqlen_q) - 1;
  const int kv_end =
      shape.causal ? max(0, min(shape.seqlen_k, q_last + offset + 1)) : shape.seqlen_k;
  const int num_kv_blocks = (kv_end + kBlockN - 1) / kBlockN;
  const int unmasked_end =
      shape.causal ? min(shape.seqlen_k, q_start + offset + 1) : shape.seqlen_k;
  const int num_unmasked_blocks = max(0, unmasked_end) / kBlockN;

  load_tile_async<kDqBlockM, kHeadDim>(q_tile, q + q_row0 * kHeadDim, q_start, shape.seqlen_q);
  load_tile_async<kDqBlockM, kHeadDim>(dout_tile, dout + q_row0 * kHeadDim, q_start,
                                       shape.seqlen_q);
  if (num_kv_blocks > 0) load_kv(0);
  cp_async_commit();

  // LSE (times log2 e) and D of rows g and g + 8 of this warp's tile. A row past the end, or one
  // that sees no key (LSE = -inf), gets +inf: exp2(s c - inf) = 0, so its P and dS are 0.
  float lse_log2[2], delta_rows[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int query = q_start + warp_row0 + g + 8 * half;
    const float row_lse = query < shape.seqlen_q ? lse[q_row0 + query] : -INFINITY;
    lse_log2[half] = row_lse == -INFINITY ? INFINITY : row_lse * kLog2e;
    delta_rows[half] = query < shape.seqlen_q ? delta[q_row0 + query] : 0.0f;
  }

  float dq_acc[kDTiles][4] = {};

  // S or dP of this warp's 16 rows and the block's keys: (Q or dO rows) x (K or V rows)^T.
  auto scores = [&](float(&acc)[kSTiles][4], const bf16* q_rows, const bf16* kv_rows) {
#pragma unroll
    for (int ks = 0; ks < kHeadSteps; ++ks) {
      uint32_t a[4];
      load_a(a, q_rows, kStr, warp_row0, ks * kMmaK, lane);
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        uint32_t b[2][2];
        load_b_rows(b, kv_rows, kStr, nt * kMmaN, ks * kMmaK, lane);
        mma_16816(acc[nt], a, b[0]);
        mma_16816(acc[nt + 1], a, b[1]);
      }
    }
  };

  auto process_block = [&](int kv_block, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    const int kv_start = kv_block * kBlockN;
    cp_async_wait<0>();
    __syncthreads();
    if (kv_block + 1 < num_kv_blocks) load_kv(kv_block + 1);
    cp_async_commit();

    // 1. S = Q K_j^T, P = exp2(S c - LSE log2 e). Element i of tile nt: row warp_row0 + g +
    //    8 (i / 2), key 8 nt + 2 t + i % 2.
    float p[kSTiles][4] = {};
    scores(p, q_tile, k_tile(kv_block));
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        p[nt][i] = exp2_fast(p[nt][i] * scale_log2 - lse_log2[i / 2]);
        if (kMasked) {
          const int key = kv_start + nt * kMmaN + 2 * t + i % 2;
          const int query = q_start + warp_row0 + g + 8 * (i / 2);
          if (key >= shape.seqlen_k || (shape.causal && key > query + offset)) p[nt][i] = 0.0f;
        }
      }
    // 2. dP = dO V_j^T, dS = P (dP - D) in place.
    float ds[kSTiles][4] = {};
    scores(ds, dout_tile, v_tile(kv_block));
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) ds[nt][i] = p[nt][i] * (ds[nt][i] - delta_rows[i / 2]);
    }
    // 3. dQ += dS K_j, A = dS from the registers.
#pragma unroll
    for (int ks = 0; ks < kKeySteps; ++ks) {
      uint32_t a[4];
      pack_a(a, ds[2 * ks], ds[2 * ks + 1]);
#pragma unroll
      for (int dt = 0; dt < kDTiles; dt += 2) {
        uint32_t b[2][2];
        load_b_columns(b, k_tile(kv_block), kStr, ks * kMmaK, dt * kMmaN, lane);
        mma_16816(dq_acc[dt], a, b[0]);
        mma_16816(dq_acc[dt + 1], a, b[1]);
      }
    }
  };

  int kv_block = 0;
  for (; kv_block < num_unmasked_blocks; ++kv_block) process_block(kv_block, std::false_type());
  for (; kv_block < num_kv_blocks; ++kv_block) process_block(kv_block, std::true_type());

  // dQ (times the scale) leaves through this warp's own rows of the Q tile, which only this warp
  // ever read; a block with no key block still has the copies of Q in flight (chapter 14).
  cp_async_wait<0>();
  __syncthreads();
  store_rows<kHeadDim>(dq_acc, scale, q_tile, warp_row0, dq + q_row0 * kHeadDim, q_start,
                       shape.seqlen_q, lane);
}

// Atomic mode's last step: dQ = scale * the fp32 accumulator, as bf16, 8 elements per thread.
__global__ void __launch_bounds__(kThreads)
    convert_dq_kernel(const float* dq_accum, bf16* dq, int64_t chunks, float scale) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= chunks) return;
  const float4 lo = reinterpret_cast<const float4*>(dq_accum)[2 * i];
  const float4 hi = reinterpret_cast<const float4*>(dq_accum)[2 * i + 1];
  reinterpret_cast<uint4*>(dq)[i] =
      make_uint4(pack(lo.x * scale, lo.y * scale), pack(lo.z * scale, lo.w * scale),
                 pack(hi.x * scale, hi.y * scale), pack(hi.z * scale, hi.w * scale));
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

// The last wave. The main kernel's blocks run one per SM (KvSmem: more than half of the 227 KiB
// an SM has), so a wave is sm_count() blocks. Without the mask, when the last wave holds at most
// half as many blocks as there are SMs, its `last` blocks run as `pieces` thread blocks each, as
// many as fill one wave (and no more than a block has steps). With the mask the blocks differ in
// length (the first key blocks see the most queries), the waves do not line up, and nothing is
// split.
struct SplitPlan {
  int64_t first_split;  // thread blocks below it run whole
  int64_t last;         // key blocks split, from first_split on
  int pieces;           // thread blocks per split key block
};
static_assert(2 * KvSmem<64>::kBytes > 227 * 1024 && 2 * KvSmem<128>::kBytes > 227 * 1024,
              "one main block per SM");
template <int kHeadDim>
SplitPlan split_plan(const AttentionShape& shape, int sms) {
  const int64_t blocks =
      (shape.seqlen_k + kMainBlockN - 1) / kMainBlockN * shape.batch * shape.heads_kv;
  const int64_t block_m = kMainBlockMFor<kHeadDim>;
  const int64_t steps = shape.group_size() * ((shape.seqlen_q + block_m - 1) / block_m);
  const int64_t last = blocks % sms;
  if (shape.causal || last == 0 || 2 * last > sms || steps < 2) return {blocks, 0, 1};
  return {blocks - last, last, int(std::min<int64_t>(sms / last, steps))};
}
template <int kHeadDim>
constexpr size_t kSlotBytes =  // one piece's dK and dV sums: 64 (d = 64) or 128 floats a thread
    size_t(2) * (kMainBlockN / kDkvWarpsN) * (kHeadDim / kDkvWarpsD) / 32 * kMainThreads *
    sizeof(float);

// The fp32 dQ accumulator (q_elements floats; only atomic mode uses it), then D (lse_elements
// floats), then the last wave's piece sums (rounded up to 16 bytes) and one arrival count per
// split key block. The accumulator comes first so that it stays 16-byte aligned: q_elements is
// a multiple of head_dim.
inline size_t partials_offset(const AttentionShape& shape) {
  return (size_t(shape.q_elements() + shape.lse_elements()) * sizeof(float) + 15) / 16 * 16;
}
template <int kHeadDim>
size_t split_bytes(const AttentionShape& shape) {
  const SplitPlan plan = split_plan<kHeadDim>(shape, sm_count());
  return size_t(plan.last) * plan.pieces * kSlotBytes<kHeadDim> +
         size_t(plan.last) * sizeof(unsigned);
}
inline size_t workspace_bytes(const AttentionShape& shape) {
  return partials_offset(shape) +
         (shape.head_dim == 64 ? split_bytes<64>(shape) : split_bytes<128>(shape));
}

// More than 48 KB of shared memory per block has to be asked for, once per kernel (a template
// argument, so that each kernel has its own flag: kernels of one signature share a type).
template <auto kernel>
void allow_shared_memory(size_t bytes) {
  static const bool configured = [&] {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    return true;
  }();
  (void)configured;
}

// The main kernel in up to two launches: the whole key blocks (chapter 42's kernel, its waves
// all full), then the pieces of the last wave's key blocks. The second starts when the first has
// finished: its slowest block, a wait the README counts among the split's costs.
template <int kHeadDim, bool kComputeDq>
void launch_backward(const attn::BackwardParams& params, const float* delta, float* dq_accum,
                     cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  constexpr size_t kSmemBytes = KvSmem<kHeadDim>::kBytes;
  const SplitPlan plan = split_plan<kHeadDim>(shape, sm_count());
  unsigned char* split_space =
      static_cast<unsigned char*>(params.workspace) + partials_offset(shape);
  float4* partials = reinterpret_cast<float4*>(split_space);
  unsigned* arrivals = reinterpret_cast<unsigned*>(split_space + size_t(plan.last) * plan.pieces *
                                                                     kSlotBytes<kHeadDim>);
  const float scale = shape.softmax_scale();
  auto run = [&](auto pieces_tag, int64_t blocks) {
    constexpr auto kernel = backward_kernel<kHeadDim, kComputeDq, decltype(pieces_tag)::value>;
    allow_shared_memory<kernel>(kSmemBytes);
    kernel<<<unsigned(blocks), kMainThreads, kSmemBytes, stream>>>(
        static_cast<const bf16*>(params.q), static_cast<const bf16*>(params.k),
        static_cast<const bf16*>(params.v), static_cast<const bf16*>(params.dout), params.lse,
        delta, dq_accum, static_cast<bf16*>(params.dk), static_cast<bf16*>(params.dv), shape, scale,
        scale * kLog2e, partials, arrivals, unsigned(plan.first_split), plan.pieces);
    CUDA_CHECK_LAUNCH();
  };
  if (plan.first_split > 0) run(std::false_type(), plan.first_split);
  if (plan.last > 0) {
    CUDA_CHECK(cudaMemsetAsync(arrivals, 0, size_t(plan.last) * sizeof(unsigned), stream));
    run(std::true_type(), plan.last * plan.pieces);
  }
}

template <int kHeadDim>
void launch_for_head_dim(const attn::BackwardParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  const float scale = shape.softmax_scale();
  float* dq_accum = static_cast<float*>(params.workspace);
  float* delta = dq_accum + shape.q_elements();

  // 1. D, and in atomic mode a zeroed accumulator.
  constexpr int kRowsPerBlock = kThreads / (kHeadDim / 8);
  const int64_t rows = shape.lse_elements();
  delta_kernel<kHeadDim>
      <<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream>>>(
          static_cast<const bf16*>(params.o), static_cast<const bf16*>(params.dout), delta,
          params.deterministic ? nullptr : dq_accum, rows);
  CUDA_CHECK_LAUNCH();

  if (!params.deterministic) {
    // 2. dK, dV and the dQ accumulator; 3. dQ to bf16.
    launch_backward<kHeadDim, true>(params, delta, dq_accum, stream);
    const int64_t chunks = shape.q_elements() / 8;
    convert_dq_kernel<<<unsigned((chunks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        dq_accum, static_cast<bf16*>(params.dq), chunks, scale);
    CUDA_CHECK_LAUNCH();
  } else {
    // 2. dK, dV; 3. dQ on its own.
    launch_backward<kHeadDim, false>(params, delta, nullptr, stream);
    constexpr auto kernel = dq_kernel<kHeadDim>;
    constexpr size_t kSmemBytes = DqSmem<kHeadDim>::kBytes;
    allow_shared_memory<kernel>(kSmemBytes);
    const int64_t num_q_blocks = (shape.seqlen_q + kDqBlockM - 1) / kDqBlockM;
    const unsigned blocks = unsigned(num_q_blocks * shape.batch * shape.heads_q);
    kernel<<<blocks, kThreads, kSmemBytes, stream>>>(
        static_cast<const bf16*>(params.q), static_cast<const bf16*>(params.k),
        static_cast<const bf16*>(params.v), static_cast<const bf16*>(params.dout), params.lse,
        delta, static_cast<bf16*>(params.dq), shape, scale, scale * kLog2e);
    CUDA_CHECK_LAUNCH();
  }
}

inline void launch(const attn::BackwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::BackwardChapter chapter() {
  return {"43_last_wave",
          "chapter 42's backward with the blocks of a nearly empty last wave split into pieces "
          "that fill it",
          attn::DType::kBF16,
          {64, 128},
          // The main kernel takes 166.25 KiB of shared memory per block at d = 64 and 163.25 at
          // d = 128, which only Hopper offers (227 KiB; an A100 gives 163, 166,912 bytes): an
          // Ampere GPU is refused with a sentence instead of failing at launch.
          90,
          /*has_deterministic_mode=*/true,
          workspace_bytes,
          "D (rowsum dO*O), the fp32 dQ accumulator and the last wave's piece sums",
          launch};
}

}  // namespace ch43
