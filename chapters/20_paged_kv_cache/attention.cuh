// Chapter 20: the KV cache in pages. Chapter 19 reads each sequence's keys and values from one
// contiguous slab with room for the longest sequence the server might see. A server does not know
// the lengths in advance, and a slab per sequence at the maximum length wastes most of the memory
// that could hold other sequences. Instead the cache is a pool of fixed-size pages, and each
// sequence keeps a list of its pages, a row of the block table (vLLM's PagedAttention): the
// virtual memory of an operating system, with the block table as the page table. The idea: the
// kernel finds each key's row through the block table; everything else is chapter 19's.
//
//   block table [batch, max_pages_per_seq]     pool [num_pages, page_size, heads_kv, head_dim]
//   sequence 0: 7  2  9                        page 0: ...
//   sequence 1: 4  0                           page 2: tokens 16-31 of sequence 0, every kv head
//                                              ...
//   token t of sequence b: page block_table[b][t / page_size], slot t % page_size
//
// Page sizes are powers of two, so the page and the slot of a key are a shift and a mask. A page
// holds every kv head of its tokens (the layout of vLLM and FlashInfer), so one 16-byte copy
// still reads 8 consecutive head_dim elements of one key of one head; what changes is the
// address of each row of a K or V tile, one block-table entry per page the tile touches. Those
// entries are read one tile ahead, so that no copy waits for its address.
//
// Everything below the cache's addressing is chapter 19's: the splits and their merge, the query
// rows of a group and its new tokens packed into one tile, the warps splitting the keys, the
// combine kernel and its early launch. One consequence of the pages is in plan(): a grid that
// would leave at least half of the SMs without a block splits its caches further.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "chapter_api.h"
#include "cuda_check.h"

namespace ch20 {

using attn::DecodeShape;
using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;  // mma.sync.m16n8k16
constexpr int kBlockN = 64;                       // keys per tile
constexpr int kMaxRowTiles = 4;                   // at most 64 query rows per block
constexpr int kMaxSplits = 256;                   // splits of one cache, at most
// K and V tiles in flight: one in use, two being copied. At d = 128 a stage is 32 KB, so a block
// takes 100-112 KiB of shared memory and two blocks fit on an H100 SM: about 128 KB of copies in
// flight per SM, several times what its share of the bandwidth needs (about 23 GB/s per SM x 1-2
// us).
constexpr int kStages = 3;
// Shared-memory rows are not padded (chapter 07 padded them by 16 bytes): 16-byte chunk c of row r
// is stored at chunk c ^ (r % 8) of the row, so the 8 rows an ldmatrix phase reads (one chunk
// each) still fall in 8 different groups of 4 banks, and the 8 copies that write 128 bytes of a
// row fill one 128-byte line of shared memory, where padded rows made them straddle two. Padded,
// the copies streamed 3.6% slower (chapter 19's README, "Swizzled rows").
__device__ int swizzle(int row, int col) { return col ^ (row & 7) << 3; }
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullWarp = 0xffffffffu;

template <int kHeadDim, int kRowTiles>
struct Smem {
  static constexpr int kStride = kHeadDim;  // bf16 per row of a Q, K or V tile
  static constexpr int kRows = kRowTiles * kMmaM;
  static constexpr size_t kTiles = size_t(kRows + kStages * 2 * kBlockN) * kStride * sizeof(bf16);
  // The warps' partial results, merged at the end in the same memory: per key slice, O (fp32,
  // rows padded by 4 floats) and each row's max and sum.
  static constexpr int kKeySlices = kWarps / kRowTiles;
  static constexpr int kMergeStride = kHeadDim + 4;
  static constexpr size_t kMerge = size_t(kKeySlices) * kRows * (kMergeStride + 2) * sizeof(float);
  static constexpr size_t kBytes = kTiles > kMerge ? kTiles : kMerge;
};

// ---------------------------------------------------------------------------------------------
// Device helpers (chapter 14's)
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

// A fragment: rows [row0, row0 + 16), columns [col0, col0 + 16) of a row-major tile.
__device__ void load_a(uint32_t (&a)[4], const bf16* tile, int stride, int row0, int col0,
                       int lane) {
  const int quarter = lane / 8, r = lane % 8;
  const int row = row0 + r + 8 * (quarter % 2);
  ldmatrix_x4(a, tile + row * stride + swizzle(row, col0 + 8 * (quarter / 2)));
}

// B fragments of two n-tiles whose column n is row row0 + n of the tile (K for S = Q K^T).
__device__ void load_b_rows(uint32_t (&b)[2][2], const bf16* tile, int stride, int row0, int col0,
                            int lane) {
  const int quarter = lane / 8, r = lane % 8;
  uint32_t regs[4];
  const int row = row0 + r + 8 * (quarter / 2);
  ldmatrix_x4(regs, tile + row * stride + swizzle(row, col0 + 8 * (quarter % 2)));
  b[0][0] = regs[0], b[0][1] = regs[1], b[1][0] = regs[2], b[1][1] = regs[3];
}

// B fragments of two n-tiles whose k runs down the rows of the tile (V for O = P V).
__device__ void load_b_columns(uint32_t (&b)[2][2], const bf16* tile, int stride, int row0,
                               int col0, int lane) {
  const int quarter = lane / 8, r = lane % 8;
  uint32_t regs[4];
  const int row = row0 + r + 8 * (quarter % 2);
  ldmatrix_x4_trans(regs, tile + row * stride + swizzle(row, col0 + 8 * (quarter / 2)));
  b[0][0] = regs[0], b[0][1] = regs[1], b[1][0] = regs[2], b[1][1] = regs[3];
}

// 2^x in one instruction (MUFU.EX2, flush to zero below 2^-126; 2^-inf = 0).
__device__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A 16-byte copy from device to shared memory; with `valid` false it reads nothing and writes 16
// zero bytes (the address must still be a real one). The .L2::128B hint lets L2 fetch the whole
// 128-byte line the copy falls in at once: the block reads every byte of it anyway, so its
// neighbours' copies find it there (measured +1.5-2% on the H100; README, "Measured").
__device__ void cp_async_16(bf16* shared_dst, const bf16* global_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(global_src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullWarp, x, 2));
}
__device__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullWarp, x, 1);
  return x + __shfl_xor_sync(kFullWarp, x, 2);
}

// Programmatic dependent launch (Hopper, PTX griddepcontrol): a kernel launched with the
// attribute of launch_combine below may start before the previous kernel in the stream has
// finished, once every block of that kernel has called allow_next_grid() or exited; it must call
// wait_for_previous_grid() before it reads what the previous kernel wrote. Its launch and its
// blocks' start then overlap the previous kernel's last blocks. Older GPUs launch it in order and
// neither instruction exists there (nor is needed).
__device__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Starts copying rows [row0, row0 + kRows) of a [rows][kHeadDim] matrix into a swizzled shared
// tile; rows at or past row_end are not read and become zeros.
template <int kRows, int kHeadDim>
__device__ void load_tile_async(bf16* tile, const bf16* src, int row0, int row_end) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kStride = kHeadDim;
  const int r = threadIdx.x / kChunksPerRow, c = threadIdx.x % kChunksPerRow * 8;
  // A pass moves on by kRowsPerPass rows, a multiple of 8: every row this thread copies has the
  // swizzle of its first.
  static_assert(kRowsPerPass % 8 == 0, "the same swizzle on every pass");
  bf16* dst = tile + r * kStride + swizzle(r, c);
#pragma unroll
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + r;
    if (kRows % kRowsPerPass != 0 && row >= kRows) break;
    const bool valid = row0 + row < row_end;
    cp_async_16(dst + pass * kRowsPerPass * kStride,
                valid ? src + (int64_t(row0) + row) * kHeadDim + c : src, valid);
  }
}

// Rows of a K or V tile per thread: the copies of a tile cover kRowsPerPass rows per pass.
template <int kHeadDim>
constexpr int kLoadPasses = kBlockN / (kThreads / (kHeadDim / 8));

// The pages that hold this thread's rows of the tile of keys [key0, key0 + kBlockN) of a
// sequence whose pages are `pages` (its row of the block table): page = pages[key >> page_shift].
// Keys at or past key_end have no page to look up (their entry may not exist) and get 0.
template <int kHeadDim>
__device__ void find_pages(int (&page)[kLoadPasses<kHeadDim>], const int* pages, int page_shift,
                           int key0, int key_end) {
  constexpr int kRowsPerPass = kThreads / (kHeadDim / 8);
  const int r = threadIdx.x / (kHeadDim / 8);
#pragma unroll
  for (int pass = 0; pass < kLoadPasses<kHeadDim>; ++pass) {
    const int key = key0 + pass * kRowsPerPass + r;
    page[pass] = key < key_end ? __ldg(pages + (key >> page_shift)) : 0;
  }
}

// Starts copying the tile of keys [key0, key0 + kBlockN) of one kv head from a pool of pages:
// key `key` is row ((page * page_size + slot) * heads_kv + kv_head) of the pool, with its page
// from find_pages and slot = key & (page_size - 1). Keys at or past key_end are not read and
// become zeros.
template <int kHeadDim>
__device__ void load_paged_tile_async(bf16* tile, const bf16* pool,
                                      const int (&page)[kLoadPasses<kHeadDim>], int page_shift,
                                      int heads_kv, int kv_head, int key0, int key_end) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kStride = kHeadDim;
  static_assert(kBlockN % kRowsPerPass == 0, "a tile divides evenly among the threads");
  const int r = threadIdx.x / kChunksPerRow, c = threadIdx.x % kChunksPerRow * 8;
  // A pass moves on by kRowsPerPass rows, a multiple of 8: every row this thread copies has the
  // swizzle of its first.
  static_assert(kRowsPerPass % 8 == 0, "the same swizzle on every pass");
  bf16* dst = tile + r * kStride + swizzle(r, c);
  const int slot_mask = (1 << page_shift) - 1;
#pragma unroll
  for (int pass = 0; pass < kLoadPasses<kHeadDim>; ++pass) {
    const int row = pass * kRowsPerPass + r, key = key0 + row;
    const int64_t pool_row = (int64_t(page[pass]) << page_shift) + (key & slot_mask);
    cp_async_16(dst + pass * kRowsPerPass * kStride,
                pool + (pool_row * heads_kv + kv_head) * kHeadDim + c, key < key_end);
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

struct DecodeArgs {
  const bf16* q;
  const bf16* k;  // pool of pages [num_pages, page_size, heads_kv, head_dim]
  const bf16* v;
  const int* seqlens_k;
  const int* block_table;  // [batch, max_pages_per_seq]
  int page_shift;          // page_size = 1 << page_shift
  int max_pages_per_seq;
  bf16* o;
  float* lse;
  float* o_partial;    // [num_splits, batch * heads_q * seqlen_q, head_dim], if num_splits > 1
  float* lse_partial;  // [num_splits, batch * heads_q * seqlen_q]
  int heads_q, heads_kv, seqlen_q;
  int group_rows;  // group_size * seqlen_q
  int row_blocks;  // blocks per group: ceil(group_rows / (16 * kRowTiles))
  int num_splits;
  int split_keys;      // keys per split, a multiple of kBlockN
  int64_t total_rows;  // batch * heads_q * seqlen_q
  float scale_log2;    // softmax scale * log2(e)
};

// One block per (sequence, kv head, split, row block), in that order from slowest to fastest, so
// the row blocks that read the same keys run side by side.
// (The bound's one block per SM is a floor, not the aim: two fit. Without it ptxas held
// chapter 20's head_dim 64 kernel to 128 registers and spilled.)
template <int kHeadDim, int kRowTiles>
__global__ void __launch_bounds__(kThreads, 1) split_kv_kernel(const DecodeArgs args) {
  using S = Smem<kHeadDim, kRowTiles>;
  constexpr int kStride = S::kStride;
  constexpr int kRows = S::kRows;                      // query rows of the block
  constexpr int kSliceKeys = kBlockN / S::kKeySlices;  // keys of a tile per warp
  constexpr int kSTiles = kSliceKeys / kMmaN;          // S: tiles of 8 keys
  constexpr int kPSteps = kSliceKeys / kMmaK;          // P V: k steps of 16 keys
  constexpr int kOTiles = kHeadDim / kMmaN;
  constexpr int kQSteps = kHeadDim / kMmaK;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_tile = reinterpret_cast<bf16*>(smem);  // [kRows][kStride]
  bf16* kv_tiles = q_tile + kRows * kStride;     // stage s: K at 2s, V at 2s + 1

  // The combine may be launched now: it waits for this whole grid before reading anything.
  allow_next_grid();
  int64_t block = blockIdx.x;
  const int row_block = int(block % args.row_blocks);
  block /= args.row_blocks;
  const int split = int(block % args.num_splits);
  block /= args.num_splits;
  const int kv_head = int(block % args.heads_kv);
  const int batch = int(block / args.heads_kv);

  const int seqlen_k = args.seqlens_k[batch];
  const int split_start = split * args.split_keys;
  const int split_end = min(seqlen_k, split_start + args.split_keys);
  // A split past the end of a shorter sequence has nothing to do; the combine skips it. With one
  // split the block itself writes the output, so it stays (a sequence of length 0 gets O = 0).
  if (split_start >= seqlen_k && args.num_splits > 1) return;
  const int num_tiles = max(0, split_end - split_start + kBlockN - 1) / kBlockN;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp % kRowTiles * kMmaM;        // within the block's rows
  const int slice_key0 = warp / kRowTiles * kSliceKeys;  // within a tile
  const int block_row0 = row_block * kRows;              // within the group's rows
  // Row 0 of the group in Q, O and LSE: head kv_head * group_size, token 0.
  const int64_t group_row0 =
      (int64_t(batch) * args.heads_q + int64_t(kv_head) * (args.heads_q / args.heads_kv)) *
      args.seqlen_q;
  const int* pages = args.block_table + int64_t(batch) * args.max_pages_per_seq;

  auto k_tile = [&](int tile) { return kv_tiles + (2 * (tile % kStages)) * kBlockN * kStride; };
  auto v_tile = [&](int tile) { return kv_tiles + (2 * (tile % kStages) + 1) * kBlockN * kStride; };
  // The pages of this thread's rows of the next tile to copy. They are looked up one tile before
  // its copies start: a copy's address depends on its page, and a lookup that had to finish
  // first would hold up the copy by a trip to memory on every tile.
  int next_pages[kLoadPasses<kHeadDim>];
  auto tile_key0 = [&](int tile) { return split_start + tile * kBlockN; };
  auto find_next_pages = [&](int tile) {
    find_pages<kHeadDim>(next_pages, pages, args.page_shift, tile_key0(tile), split_end);
  };
  auto load_kv = [&](int tile) {
    load_paged_tile_async<kHeadDim>(k_tile(tile), args.k, next_pages, args.page_shift,
                                    args.heads_kv, kv_head, tile_key0(tile), split_end);
    load_paged_tile_async<kHeadDim>(v_tile(tile), args.v, next_pages, args.page_shift,
                                    args.heads_kv, kv_head, tile_key0(tile), split_end);
  };

  // Prologue: Q, then the first kStages - 1 tiles, one commit group each (empty groups past the
  // end keep the count of groups in flight the same on every iteration).
  load_tile_async<kRows, kHeadDim>(q_tile, args.q + group_row0 * kHeadDim, block_row0,
                                   args.group_rows);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    find_next_pages(s);
    if (s < num_tiles) load_kv(s);
    cp_async_commit();
  }
  find_next_pages(kStages - 1);

  // The last key each of this thread's two rows (g and g + 8) may see: causal among the new
  // tokens, bottom-right aligned. Rows past the group's are padding; they see the whole split.
  int row_key_end[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = block_row0 + warp_row0 + g + 8 * half;
    const int token = row % args.seqlen_q;
    row_key_end[half] =
        row < args.group_rows ? min(split_end, seqlen_k - args.seqlen_q + 1 + token) : split_end;
  }

  float o_acc[kOTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};  // times scale_log2
  float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only, until the end
  uint32_t q_frag[kQSteps][4];

  for (int tile = 0; tile < num_tiles; ++tile) {
    // Tile `tile` has landed once at most kStages - 2 younger groups are in flight; after the
    // barrier every warp is done with tile - 1, whose buffers the next copy overwrites.
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (tile + kStages - 1 < num_tiles) load_kv(tile + kStages - 1);
    cp_async_commit();
    find_next_pages(tile + kStages);
    if (tile == 0) {
#pragma unroll
      for (int ks = 0; ks < kQSteps; ++ks)
        load_a(q_frag[ks], q_tile, kStride, warp_row0, ks * kMmaK, lane);
    }

    // S = Q K^T for this warp's rows and keys.
    float s[kSTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < kQSteps; ++ks)
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        uint32_t b[2][2];
        load_b_rows(b, k_tile(tile), kStride, slice_key0 + nt * kMmaN, ks * kMmaK, lane);
        mma_16816(s[nt], q_frag[ks], b[0]);
        mma_16816(s[nt + 1], q_frag[ks], b[1]);
      }

    // Online softmax (chapter 05), in log2 units. Keys past a row's end are -inf.
    const int key0 = split_start + tile * kBlockN + slice_key0 + 2 * t;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // i = 2 * half + column
        float& score = s[nt][i];
        score =
            key0 + nt * kMmaN + i % 2 < row_key_end[i / 2] ? score * args.scale_log2 : -INFINITY;
        tile_max[i / 2] = fmaxf(tile_max[i / 2], score);
      }
    float base[2];  // what the exponents are taken against: the new max, or 0 while it is -inf
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float new_max = fmaxf(row_max[half], quad_max(tile_max[half]));
      base[half] = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2_fast(row_max[half] - base[half]);  // 0 while nothing was seen
      row_max[half] = new_max;
      row_sum[half] *= alpha;
#pragma unroll
      for (int dt = 0; dt < kOTiles; ++dt) {
        o_acc[dt][2 * half] *= alpha;
        o_acc[dt][2 * half + 1] *= alpha;
      }
    }
    uint32_t p[kPSteps][4];
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
      float e[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        e[i] = exp2_fast(s[nt][i] - base[i / 2]);
        row_sum[i / 2] += e[i];
      }
      p[nt / 2][2 * (nt % 2)] = pack(e[0], e[1]);
      p[nt / 2][2 * (nt % 2) + 1] = pack(e[2], e[3]);
    }

    // O += P V over this warp's keys.
#pragma unroll
    for (int ks = 0; ks < kPSteps; ++ks)
#pragma unroll
      for (int dt = 0; dt < kOTiles; dt += 2) {
        uint32_t b[2][2];
        load_b_columns(b, v_tile(tile), kStride, slice_key0 + ks * kMmaK, dt * kMmaN, lane);
        mma_16816(o_acc[dt], p[ks], b[0]);
        mma_16816(o_acc[dt + 1], p[ks], b[1]);
      }
  }

  // Merge the warps that share rows. Every copy has landed and every warp is done with the tiles
  // once the barrier is passed, so the tiles' memory holds the partial results now: per key
  // slice, O unnormalised and each row's max (log2 units) and sum.
  cp_async_wait<0>();
  __syncthreads();
  float* merge_o = reinterpret_cast<float*>(smem);  // [kKeySlices][kRows][kMergeStride]
  float* merge_max = merge_o + S::kKeySlices * kRows * S::kMergeStride;  // [kKeySlices][kRows]
  float* merge_sum = merge_max + S::kKeySlices * kRows;
  const int slice = warp / kRowTiles;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp_row0 + g + 8 * half;
    float* o_row = merge_o + (slice * kRows + row) * S::kMergeStride;
#pragma unroll
    for (int dt = 0; dt < kOTiles; ++dt)
      *reinterpret_cast<float2*>(o_row + dt * kMmaN + 2 * t) =
          make_float2(o_acc[dt][2 * half], o_acc[dt][2 * half + 1]);
    const float sum = quad_sum(row_sum[half]);
    if (t == 0) {
      merge_max[slice * kRows + row] = row_max[half];
      merge_sum[slice * kRows + row] = sum;
    }
  }
  __syncthreads();

  // Each thread finishes 8 columns of a row at a time: O = sum_s 2^(m_s - m) O_s / l with
  // l = sum_s 2^(m_s - m) l_s, and lse = (m + log2 l) / log2 e. With one split that is the
  // output (bf16, 16-byte stores); otherwise it is this split's partial result (fp32).
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
    const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow * 8;
    if (block_row0 + row >= args.group_rows) break;  // rows only grow with chunk
    float m = -INFINITY;
#pragma unroll
    for (int s = 0; s < S::kKeySlices; ++s) m = fmaxf(m, merge_max[s * kRows + row]);
    const float m_base = m == -INFINITY ? 0.0f : m;
    float l = 0.0f, out[8] = {};
#pragma unroll
    for (int s = 0; s < S::kKeySlices; ++s) {
      const float w = exp2_fast(merge_max[s * kRows + row] - m_base);
      l += w * merge_sum[s * kRows + row];
      const float* o_s = merge_o + (s * kRows + row) * S::kMergeStride + col;
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] += w * o_s[j];
    }
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key: O = 0
    const float row_lse = l > 0.0f ? (m + log2f(l)) / kLog2e : -INFINITY;
    const int64_t out_row = group_row0 + block_row0 + row;
    if (args.num_splits == 1) {
      uint4 packed;
      uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) words[j] = pack(out[2 * j] * inv_l, out[2 * j + 1] * inv_l);
      *reinterpret_cast<uint4*>(args.o + out_row * kHeadDim + col) = packed;
      if (col == 0) args.lse[out_row] = row_lse;
    } else {
      float* dst = args.o_partial + (split * args.total_rows + out_row) * kHeadDim + col;
      *reinterpret_cast<float4*>(dst) =
          make_float4(out[0] * inv_l, out[1] * inv_l, out[2] * inv_l, out[3] * inv_l);
      *reinterpret_cast<float4*>(dst + 4) =
          make_float4(out[4] * inv_l, out[5] * inv_l, out[6] * inv_l, out[7] * inv_l);
      if (col == 0) args.lse_partial[split * args.total_rows + out_row] = row_lse;
    }
  }
}

// The merge of the splits: one block per query row. The splits that started past the end of the
// row's sequence wrote nothing and are not read; a split in which the row saw no key has lse
// -inf and weight 0; a row that saw no key at all gets O = 0 and lse -inf. The partial results
// were just written, so they come from L2, and what costs is the latency of each round of reads,
// not the bytes. There is one round: each thread reads 8 columns of O_s (two 16-byte loads) and
// lse_s together, kPass x kSplitLanes splits at once per block, and merges its splits by chapter
// 03's rule against a running max of their lse_s; the lanes' results are merged by the same rule.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) combine_kernel(const DecodeArgs args) {
  constexpr int kChunks = kHeadDim / 8;            // 8 columns per thread
  constexpr int kSplitLanes = kThreads / kChunks;  // splits read at once: 8 (d 128) or 16 (d 64)
  __shared__ float partial[kSplitLanes][kHeadDim];
  __shared__ float lane_max[kSplitLanes], lane_sum[kSplitLanes];
  // seqlens_k is an input, which the split kernel does not write: it is read before the wait.
  const int64_t row = blockIdx.x;
  const int batch = int(row / (int64_t(args.heads_q) * args.seqlen_q));
  const int used =
      min(args.num_splits, (args.seqlens_k[batch] + args.split_keys - 1) / args.split_keys);
  // Launched while the split kernel still runs (programmatic dependent launch, see the launch):
  // wait here until all of its blocks have finished and their writes are visible.
  wait_for_previous_grid();

  // Lane lane_split takes splits lane_split, lane_split + kSplitLanes, ...: with m the largest
  // lse_s so far, sum = sum_s e^(lse_s - m) and out = sum_s e^(lse_s - m) O_s. Each pass issues
  // the loads of kPass splits before it uses any (one round trip), then merges them.
  constexpr int kPass = 4;  // splits per lane per pass: 32 (d 128) or 64 (d 64) per block
  const int chunk = threadIdx.x % kChunks, lane_split = threadIdx.x / kChunks;
  float m = -INFINITY, sum = 0.0f, out[8] = {};
  for (int s0 = lane_split; s0 < used; s0 += kPass * kSplitLanes) {
    float lse_s[kPass];
    float4 low[kPass], high[kPass];  // columns chunk * 8 .. + 3 and + 4 .. + 7 of O_s
#pragma unroll
    for (int p = 0; p < kPass; ++p) {
      const int s = s0 + p * kSplitLanes;
      lse_s[p] = -INFINITY, low[p] = high[p] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (s < used) {
        const float4* o_s = reinterpret_cast<const float4*>(
            args.o_partial + (s * args.total_rows + row) * kHeadDim + chunk * 8);
        lse_s[p] = args.lse_partial[s * args.total_rows + row], low[p] = o_s[0], high[p] = o_s[1];
      }
    }
    float m_new = m;
#pragma unroll
    for (int p = 0; p < kPass; ++p) m_new = fmaxf(m_new, lse_s[p]);
    const float m_base = m_new == -INFINITY ? 0.0f : m_new;  // all -inf so far: every weight 0
    const float alpha = __expf(m - m_base);
    sum *= alpha;
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] *= alpha;
#pragma unroll
    for (int p = 0; p < kPass; ++p) {
      const float w = __expf(lse_s[p] - m_base);
      sum += w;
      out[0] += w * low[p].x, out[1] += w * low[p].y, out[2] += w * low[p].z;
      out[3] += w * low[p].w, out[4] += w * high[p].x, out[5] += w * high[p].y;
      out[6] += w * high[p].z, out[7] += w * high[p].w;
    }
    m = m_new;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) partial[lane_split][chunk * 8 + j] = out[j];
  if (chunk == 0) lane_max[lane_split] = m, lane_sum[lane_split] = sum;
  __syncthreads();
  // The lanes' merge: lse = M + ln sum_l e^(m_l - M) sum_l, O = its weighted outs / that sum.
  for (int col = threadIdx.x; col < kHeadDim; col += kThreads) {
    float m_all = -INFINITY;
#pragma unroll
    for (int l = 0; l < kSplitLanes; ++l) m_all = fmaxf(m_all, lane_max[l]);
    const float m_base = m_all == -INFINITY ? 0.0f : m_all;
    float total_sum = 0.0f, total = 0.0f;
#pragma unroll
    for (int l = 0; l < kSplitLanes; ++l) {
      const float w = __expf(lane_max[l] - m_base);
      total_sum += w * lane_sum[l];
      total += w * partial[l][col];
    }
    args.o[row * kHeadDim + col] = __float2bfloat16_rn(total_sum > 0.0f ? total / total_sum : 0.0f);
    if (col == 0) args.lse[row] = total_sum > 0.0f ? m_base + __logf(total_sum) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

// The rule for the number of splits. Without splitting there are batch * heads_kv * row_blocks
// blocks; an H100 holds 2 of them per SM at once (shared memory), 264 in all. Split until there
// are about kWaves times as many blocks as fit at once, so that the last blocks to finish leave
// few SMs idle, but give each split at least kMinSplitKeys keys (32 tiles), and no more than
// kMaxSplits. Each block pays once for its start (Q and the first tiles, with nothing to overlap
// them in the block) and its merge, and each split adds a partial result for the combine to read:
// on the H100 512 keys per split measured 2-9% slower than 2048 where it made more splits
// (chapter 19's README, "How many splits"). One change here: where that rule leaves at least half
// of the SMs without a block, it allows one split per kMinSplitKeysFewBlocks keys. A paged block
// most likely waits longer for each tile (the block table, then rows in 256-byte pieces), and with
// few blocks no other block hides it; twice the blocks keep twice the bytes in flight (README,
// "Splits for a small grid").
constexpr int kBlocksPerSm = 2;
constexpr int kWaves = 4;
constexpr int kMinSplitKeys = 2048;
constexpr int kMinSplitKeysFewBlocks = 1024;

inline int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

inline int row_tiles_for(const DecodeShape& shape) {
  const int rows = shape.group_size() * shape.seqlen_q;
  return rows <= kMmaM ? 1 : rows <= 2 * kMmaM ? 2 : kMaxRowTiles;
}

struct Plan {
  int row_tiles, row_blocks, num_splits, split_keys;
};

inline Plan plan(const DecodeShape& shape) {
  Plan p;
  p.row_tiles = row_tiles_for(shape);
  const int rows = shape.group_size() * shape.seqlen_q;
  p.row_blocks = (rows + p.row_tiles * kMmaM - 1) / (p.row_tiles * kMmaM);
  const int64_t blocks = int64_t(shape.batch) * shape.heads_kv * p.row_blocks;
  const int64_t wanted = (int64_t(kWaves) * kBlocksPerSm * sm_count() + blocks - 1) / blocks;
  const int longest = shape.longest_seqlen_k();
  const auto splits_of = [&](int min_keys) {
    const int by_length = std::max(1, (longest + min_keys - 1) / min_keys);
    return int(std::max<int64_t>(1, std::min<int64_t>({wanted, by_length, kMaxSplits})));
  };
  p.num_splits = splits_of(kMinSplitKeys);
  if (blocks * p.num_splits <= sm_count() / 2) p.num_splits = splits_of(kMinSplitKeysFewBlocks);
  // Split boundaries on tile boundaries; then drop the splits that rounding left empty.
  const int tiles = std::max(1, (longest + kBlockN - 1) / kBlockN);
  p.split_keys = (tiles + p.num_splits - 1) / p.num_splits * kBlockN;
  p.num_splits = std::max(1, (longest + p.split_keys - 1) / p.split_keys);
  return p;
}

inline size_t workspace_bytes(const DecodeShape& shape) {
  const Plan p = plan(shape);
  if (p.num_splits == 1) return 0;
  return size_t(p.num_splits) * shape.lse_elements() * (shape.head_dim + 1) * sizeof(float);
}

template <int kHeadDim, int kRowTiles>
void launch_split_kv(const DecodeArgs& args, int64_t blocks, cudaStream_t stream) {
  auto kernel = split_kv_kernel<kHeadDim, kRowTiles>;
  constexpr size_t kSmem = Smem<kHeadDim, kRowTiles>::kBytes;
  static const bool smem_configured = [&] {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    return true;
  }();
  (void)smem_configured;
  kernel<<<unsigned(blocks), kThreads, kSmem, stream>>>(args);
  CUDA_CHECK_LAUNCH();
}

// The combine, launched so that it may start while the split kernel's last blocks still run (on
// Hopper and later; elsewhere the attribute is not set and the launch waits as usual).
template <int kHeadDim>
void launch_combine(const DecodeArgs& args, cudaStream_t stream) {
  static const bool overlap = [] {
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major >= 9;
  }();
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(args.total_rows));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, combine_kernel<kHeadDim>, args));
}

// log2 of the page size (the harness allows powers of two only).
inline int page_shift(int page_size) {
  int shift = 0;
  while ((1 << shift) < page_size) ++shift;
  return shift;
}

template <int kHeadDim>
void launch_for_head_dim(const attn::DecodeParams& params, cudaStream_t stream) {
  const DecodeShape& shape = params.shape;
  const Plan p = plan(shape);
  DecodeArgs args;
  args.q = static_cast<const bf16*>(params.q);
  args.k = static_cast<const bf16*>(params.k);
  args.v = static_cast<const bf16*>(params.v);
  args.seqlens_k = params.seqlens_k;
  args.block_table = params.block_table;
  args.page_shift = page_shift(params.page_size);
  args.max_pages_per_seq = params.max_pages_per_seq;
  args.o = static_cast<bf16*>(params.o);
  args.lse = params.lse;
  args.total_rows = shape.lse_elements();
  args.o_partial = static_cast<float*>(params.workspace);
  args.lse_partial =
      args.o_partial + (p.num_splits > 1 ? p.num_splits * args.total_rows * kHeadDim : 0);
  args.heads_q = shape.heads_q;
  args.heads_kv = shape.heads_kv;
  args.seqlen_q = shape.seqlen_q;
  args.group_rows = shape.group_size() * shape.seqlen_q;
  args.row_blocks = p.row_blocks;
  args.num_splits = p.num_splits;
  args.split_keys = p.split_keys;
  args.scale_log2 = shape.softmax_scale() * kLog2e;
  const int64_t blocks = int64_t(shape.batch) * shape.heads_kv * p.num_splits * p.row_blocks;
  if (p.row_tiles == 1) launch_split_kv<kHeadDim, 1>(args, blocks, stream);
  else if (p.row_tiles == 2) launch_split_kv<kHeadDim, 2>(args, blocks, stream);
  else launch_split_kv<kHeadDim, kMaxRowTiles>(args, blocks, stream);
  if (p.num_splits > 1) launch_combine<kHeadDim>(args, stream);
}

inline void launch(const attn::DecodeParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) launch_for_head_dim<64>(params, stream);
  else launch_for_head_dim<128>(params, stream);
}

inline attn::DecodeChapter chapter() {
  return {"20_paged_kv_cache",
          "chapter 19 with the KV cache in fixed-size pages found through a block table, as "
          "vLLM and FlashInfer keep it",
          attn::DType::kBF16,
          {64, 128},
          80,
          /*paged=*/true,
          workspace_bytes,
          "each split's partial O and LSE (fp32)",
          launch};
}

}  // namespace ch20
