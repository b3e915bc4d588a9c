// Chapter 09: the memory pipeline. Chapter 08's kernel, with the copy of the next K and V blocks
// from device memory running in the background while the warps compute on the current ones.
//
//   chapter 08:   load K0 V0 | wait | math 0 | load K1 V1 | wait | math 1 | ...
//   chapter 09:   load K0 V0 | load K1 V1 | wait K0 V0 | math 0 | load K2 V2 | wait K1 V1 | math 1
//   ...
//
// cp.async (Ampere and later) copies 16 bytes from device memory straight into shared memory,
// without passing through registers, and does not block the thread: the copies of one block are
// committed as a group, and cp.async.wait_group N waits until at most N groups are still in
// flight. K and V get two shared-memory buffers each: while the warps read buffer j % 2, the
// copy of block j + 1 fills the other one. Shared memory per block (bf16, rows of d + 8):
//
//   Q [128][d+8] | K buf 0 [N][d+8] | V buf 0 [N][d+8] | K buf 1 [N][d+8] | V buf 1 [N][d+8]
//   d = 64, N = 128 keys: 92160 bytes;  d = 128, N = 32 keys: 69632 bytes
//
// Two blocks per SM: at d = 64 that is what both the 228 KB of shared memory and the registers
// allow (2 x 128 threads x 255 of the 64K registers); at d = 128 shared memory would take three,
// and the registers (228 per thread) limit it to two.
//
// With the copies no longer staged through registers, d = 64 takes 128 keys per iteration: twice
// the keys over which to spread what each iteration costs besides its math (the README measures
// what that gains). Chapter 08 compiles with 128 keys too, at 255 registers.
//
// Chapter 05's algorithm, with both matrix products on mma.sync.m16n8k16 and everything between
// them in registers. Each warp owns 32 query rows of the block, two MMA tiles (FlashAttention-2's
// split of Q across warps: no warp needs another's results):
//
//   block of 128 query rows               K_j, V_j: 128 (d = 64) or 32 (d = 128) keys, in smem
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
// Loads: cp.async, double-buffered (above). Rows past the end of Q or K/V are zero-filled by the
// copy itself: a cp.async with a source size of 0 writes 16 zero bytes.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch09 {

using attn::AttentionShape;
using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;   // mma.sync.m16n8k16
constexpr int kMTiles = 2;                         // 16-row MMA tiles per warp
constexpr int kBlockM = kWarps * kMTiles * kMmaM;  // 128 query rows per block
// Keys per iteration, per head_dim. More keys per iteration spread its fixed costs (two
// barriers, the rescale of O, the loop's bookkeeping) over more math, as long as the S
// accumulators still fit in registers beside O's. Once a warp owns 32 rows (chapter 08), a thread
// holds kBlockN floats of S and kHeadDim floats of O: 64 + 64 at d = 64, 32 + 128 at d = 128.
// (64 keys at d = 128 made the compiler spill registers; that spilling version measured about 2%
// faster than 32 keys, but no spills is the rule here.)
// From chapter 09 on, d = 64 takes 128 keys: 128 floats of S and 64 of O, 192 accumulators of
// the 255 registers (see chapter 09's top comment).
template <int kHeadDim>
constexpr int kBlockNFor = kHeadDim == 64 ? 128 : 32;
// Shared-memory rows are padded by 8 bf16 (16 bytes). Each ldmatrix phase reads 8 rows of 16
// bytes at the same column: with rows of 64 or 128 bf16 (a multiple of 128 bytes) all 8 would
// start in the same bank and be served one after another. 16 more bytes per row move row r by
// 4 r banks, so the 8 rows of 4 banks each cover all 32 banks. The rows must stay 16-byte
// aligned for ldmatrix, so 16 is also the smallest padding that works.
constexpr int kPad = 8;
constexpr float kLog2e = 1.4426950408889634f;
// The running max (times scale_log2) of a row that has seen no finite score yet: finite, and far
// below any score times scale_log2. Masked scores give exp2(-inf - kNoMax) = 0, and the first
// finite max gives alpha = exp2(kNoMax - m_new) = 0 on an l and O that are still 0.
constexpr float kNoMax = -1.0e30f;
constexpr unsigned kFullWarp = 0xffffffffu;

constexpr int kStages = 2;  // shared-memory buffers for K and V: one in use, one being filled

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

// Block b handles query block b % num_q_blocks of (batch, head) = b / num_q_blocks (as chapter 05).
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
  // Stage i: K at kv_tiles + i * 2 * kBlockN * kStride, its V right after it.
  bf16* kv_tiles = q_tile + kBlockM * kStride;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int num_q_blocks = (shape.seqlen_q + kBlockM - 1) / kBlockM;
  const int q_block = int(blockIdx.x % num_q_blocks);
  const int64_t batch_head = blockIdx.x / num_q_blocks;
  const int64_t batch = batch_head / shape.heads_q;
  const int kv_head = int(batch_head % shape.heads_q) / shape.group_size();
  const int64_t q_row0 = batch_head * shape.seqlen_q;
  const bf16* k_head = k + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  const bf16* v_head = v + (batch * shape.heads_kv + kv_head) * shape.seqlen_k * kHeadDim;
  const int q_start = q_block * kBlockM;
  const int warp_row0 = warp * kMTiles * kMmaM;  // this warp's first row within the block

  auto k_tile = [&](int stage) { return kv_tiles + stage * 2 * kBlockN * kStride; };
  auto v_tile = [&](int stage) { return k_tile(stage) + kBlockN * kStride; };
  auto load_kv = [&](int kv_block, int stage) {
    load_tile_async<kBlockN, kHeadDim>(k_tile(stage), k_head, kv_block * kBlockN, shape.seqlen_k);
    load_tile_async<kBlockN, kHeadDim>(v_tile(stage), v_head, kv_block * kBlockN, shape.seqlen_k);
  };

  // Prologue: Q and the first K, V in one group.
  load_tile_async<kBlockM, kHeadDim>(q_tile, q + q_row0 * kHeadDim, q_start, shape.seqlen_q);
  load_kv(0, 0);
  cp_async_commit();

  // Per thread: rows g and g + 8 of each of its kMTiles tiles ([mt][half]).
  float o_acc[kMTiles][kOTiles][4] = {};
  // m_scaled: the row's running max times scale_log2 (the exponents' units); row_sum: l.
  float m_scaled[kMTiles][2], row_sum[kMTiles][2];
  for (int mt = 0; mt < kMTiles; ++mt)
    for (int half = 0; half < 2; ++half) m_scaled[mt][half] = kNoMax, row_sum[mt][half] = 0.0f;

  const int num_kv_blocks = (shape.seqlen_k + kBlockN - 1) / kBlockN;
  for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
    const int kv_start = kv_block * kBlockN;
    const int stage = kv_block % kStages;
    // Start the copy of the next block into the other buffer, then wait for this block's copy:
    // at most one group (the one just started) may still be in flight. The last iteration
    // commits an empty group so that the count stays the same.
    if (kv_block + 1 < num_kv_blocks) load_kv(kv_block + 1, (kv_block + 1) % kStages);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // every thread's copies of this block have landed

    // S = Q K^T for this warp's 32 rows and the block's keys. Every K fragment feeds both row
    // tiles: loading it once for two MMAs halves the shared-memory traffic per MMA.
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
        load_b_rows(b, k_tile(stage), kStride, nt * kMmaN, ks * kMmaK, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816(s[mt][nt], a[mt], b[0]);
          mma_16816(s[mt][nt + 1], a[mt], b[1]);
        }
      }
    }

    // Online softmax on the accumulators, in the base-2 domain: exp(x) = exp2(x * log2 e), with
    // the scale folded into the same multiply: p = exp2(s * scale_log2 - m * scale_log2). Each
    // step runs over all of the thread's rows before the next one starts, so the rows' chains of
    // dependent instructions (a max or a sum over 16 values) overlap instead of waiting in turn.
    //
    // 1. Mask, then the row max of the block. This thread's scores sit at keys
    //    kv_start + 2t + (nt * 8 + e); those at or past the row's end (the last key, or the causal
    //    diagonal) become -inf: one compare against a compile-time constant each. Without the
    //    causal mask only the last block, if partial, has such keys.
    const bool masked = shape.causal || kv_start + kBlockN > shape.seqlen_k;
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
          if (masked && nt * kMmaN + i % 2 >= limit[mt][i / 2]) score = -INFINITY;
          block_max[mt][i / 2] = fmaxf(block_max[mt][i / 2], score);
        }

    // 2. The new running max, and alpha = exp2(m_old - m_new), which rescales everything
    //    accumulated under the old max: the running sum and the output.
    //    The max is kept times scale_log2 (rounding never reverses the order of two numbers, so
    //    the max of the products is the product of the max): when it did not move, m_old and
    //    m_new are the same float and alpha is exactly 1. It must be: 1 plus a rounding error on
    //    every block would multiply l and O, and O / l cancels it but the LSE (m + log2 l) does
    //    not (after a million keys it was 4e-3 off). A row that has seen no finite score holds
    //    kNoMax instead of -inf, so m_old - m_new is never inf - inf (NaN).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float m_new = fmaxf(m_scaled[mt][half], quad_max(block_max[mt][half]) * scale_log2);
        const float alpha = exp2_fast(m_scaled[mt][half] - m_new);
        m_scaled[mt][half] = m_new;
        row_sum[mt][half] *= alpha;
#pragma unroll
        for (int dt = 0; dt < kOTiles; ++dt) {
          o_acc[mt][dt][2 * half] *= alpha;
          o_acc[mt][dt][2 * half + 1] *= alpha;
        }
      }
    }

    // 3. P = exp2(s * scale_log2 - m_scaled), in place, and its row sums over this thread's
    //    columns only: the quad's partial sums are added once, at the end.
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float& score = s[mt][nt][i];
          score = exp2_fast(score * scale_log2 - m_scaled[mt][i / 2]);
          row_sum[mt][i / 2] += score;
        }

        // O += P V: P from the S registers, V fragments from shared memory.
#pragma unroll
    for (int ks = 0; ks < kOSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = pack(s[mt][2 * ks][0], s[mt][2 * ks][1]);
        a[mt][1] = pack(s[mt][2 * ks][2], s[mt][2 * ks][3]);
        a[mt][2] = pack(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
        a[mt][3] = pack(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
      }
#pragma unroll
      for (int dt = 0; dt < kOTiles; dt += 2) {
        uint32_t b[2][2];
        load_b_columns(b, v_tile(stage), kStride, ks * kMmaK, dt * kMmaN, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816(o_acc[mt][dt], a[mt], b[0]);
          mma_16816(o_acc[mt][dt + 1], a[mt], b[1]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before the next copy refills it
  }

  // O = o_acc / l and LSE = (m * scale_log2 + log2 l) / log2 e, for the rows that exist.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = quad_sum(row_sum[mt][half]);
      const int query = q_start + warp_row0 + mt * kMmaM + g + 8 * half;
      if (query >= shape.seqlen_q) continue;
      const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key outputs 0
      bf16* o_row = o + (q_row0 + query) * kHeadDim;
#pragma unroll
      for (int dt = 0; dt < kOTiles; ++dt) {
        *reinterpret_cast<__nv_bfloat162*>(o_row + dt * kMmaN + 2 * t) = __floats2bfloat162_rn(
            o_acc[mt][dt][2 * half] * inv_l, o_acc[mt][dt][2 * half + 1] * inv_l);
      }
      if (t == 0)
        lse[q_row0 + query] = l > 0.0f ? (m_scaled[mt][half] + log2f(l)) / kLog2e : -INFINITY;
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
      "09_cp_async_pipeline",
      "chapter 08 with K and V copied by cp.async into two buffers, the next block loading "
      "while the current one computes",
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

}  // namespace ch09
