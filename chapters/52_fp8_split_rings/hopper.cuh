// Hopper's instructions for this chapter, each a thin wrapper around its PTX (PTX ISA sections
// named at each), so that attention.cuh reads as the algorithm. Built for sm_90a only: wgmma and
// the tensor-map copies exist on no other target. No CUTLASS, no CuTe.
//
// The pieces, in the order a kernel uses them:
//   a tensor map (host): the shape, strides and box of a tensor, encoded once by the driver, so
//     that one thread can copy a whole box with one instruction (TMA);
//   an mbarrier: a 64-bit counter in shared memory that the TMA unit decrements by the bytes it
//     has written, and that threads wait on;
//   cp.async.bulk.tensor: the copy of one box into shared memory, in the 128- or 64-byte swizzle;
//   wgmma.mma_async: a matrix product of a whole warpgroup (4 warps, 128 threads), its operands
//     read from shared memory through 64-bit descriptors, its accumulators in registers;
//   fence.proxy.async: what makes ordinary stores to shared memory visible to wgmma and TMA.
//   bar.sync / bar.arrive on a named barrier: one warpgroup waits for another's signal.
#pragma once

#include <cstdint>
#include <string>

#include <cuda.h>          // CUtensorMap and its enums (the types only: no libcuda at link time)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_runtime.h>

#include "cuda_check.h"

namespace hopper {

// ---------------------------------------------------------------------------------------------
// Tensor maps (host). CUDA Programming Guide, "Using the Tensor Memory Accelerator".
// ---------------------------------------------------------------------------------------------

// A 3-D tensor of one-byte elements (FP8 e4m3) [outer][rows][cols], cols contiguous, as a
// tensor map whose box is box_rows x box_cols x 1, box_cols 64 or 128: one row of the box is 64 or
// 128 bytes, stored in the swizzle of that width (a swizzle may be no narrower than its rows).
// Coordinates are given innermost first: (column, row, outer). Reads past the end of any dimension
// fill the box with zeros.
inline CUtensorMap make_tensor_map(const void* base, uint64_t cols, uint64_t rows, uint64_t outer,
                                   uint32_t box_rows, uint32_t box_cols) {
  // The driver's encoder, found through the runtime, so that nothing links libcuda directly.
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      throw attn::CudaError(
          cudaErrorNotSupported,
          "the driver has no cuTensorMapEncodeTiled (it needs CUDA 12.0 or newer).");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[3] = {cols, rows, outer};
  const cuuint64_t strides[2] = {cols, rows * cols};  // bytes, of dims 1 and 2
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             box_cols == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw attn::CudaError(cudaErrorInvalidValue,
                          "cuTensorMapEncodeTiled refused a tensor map (error " +
                              std::to_string(int(result)) +
                              "): the base must be 16-byte aligned and every "
                              "row a multiple of 16 bytes.");
  return map;
}

// ---------------------------------------------------------------------------------------------
// mbarriers and TMA copies (device). PTX ISA: "Parallel synchronization and communication
// instructions: mbarrier", "Data movement: cp.async.bulk.tensor".
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier that completes a phase when `count` threads have arrived and every byte they
// announced has landed. The fence makes the initialisation visible to the TMA unit (the async
// proxy); a __syncthreads() must follow before any thread uses the barrier.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// This thread arrives and announces `bytes` more to come from TMA copies that name this barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
               "r"(bytes)
               : "memory");
}

// This thread arrives (a consumer handing a stage back to the producer): with count threads
// arrived, the phase completes.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the barrier has completed the phase of parity `phase` (0, 1, 0, ...: a barrier
// starts in phase 0, and each completion flips it).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(phase)
      : "memory");
}

// One box of a 3-D tensor map into shared memory at `dst` (1024-byte aligned for the 128-byte
// swizzle), at coordinates (column, row, outer); its bytes count down `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int col,
                                         int row, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(outer), "r"(smem_address(bar))
      : "memory");
}

// Ordinary stores to shared memory (by this thread) become visible to wgmma and TMA, which read
// through the async proxy; a barrier must still follow to order the other threads.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Four 8x8 matrices of 16-bit elements between shared memory and the warp's registers, one
// instruction each way: lanes 8 m .. 8 m + 7 give the addresses of matrix m's 8 rows (16 bytes
// each, 16-byte aligned), and lane l holds in r[m] row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1
// (the low half first). ldmatrix's .trans hands out each matrix transposed: lane l then holds
// elements l / 4 of rows 2 (l % 4) and 2 (l % 4) + 1. stmatrix (sm_90) is ldmatrix's store. PTX
// ISA: ldmatrix, stmatrix.
__device__ __forceinline__ void ldmatrix_x4_trans(const void* row, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row))
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4(void* row, const uint32_t (&r)[4]) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_address(row)),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
      : "memory");
}

// The registers of each thread of this warpgroup become kRegisters (a multiple of 8, 24 to 256):
// a producer warpgroup that only issues copies gives most of its registers back, so that the
// consumer warpgroups can take them. Every warp of the warpgroup executes it. PTX ISA: setmaxnreg.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// Named barriers: 16 hardware barriers per block (0 is __syncthreads), each a count of threads,
// in whole warps. bar.sync waits until `threads` threads have arrived at barrier `id`, counting
// itself; bar.arrive adds this thread's arrival and goes on without waiting. PTX ISA: bar, barrier.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma (device). PTX ISA: "Asynchronous warpgroup level matrix multiply-accumulate".
// ---------------------------------------------------------------------------------------------

// The descriptor of an operand tile in shared memory in the 128- or 64-byte swizzle: rows of
// kSwizzle bytes, 8 rows to a swizzle atom (1024 or 512 bytes). `address` is where this k step
// starts: the tile's base plus 32 bytes per k step (32 e4m3 values) within its rows. Fields (PTX
// "Matrix Descriptor Format"): bits 0-13 address >> 4; 16-29 leading-dimension byte offset >> 4;
// 32-45 stride byte offset >> 4 (from one 8-row group to the next: 8 rows); 62-63 swizzle mode
// (1 = 128 bytes, 2 = 64 bytes). The base offset (bits 49-51) is 0: every tile is 1024-byte
// aligned.
template <int kSwizzle>
__device__ __forceinline__ uint64_t smem_descriptor(const void* address, uint32_t leading_bytes) {
  static_assert(kSwizzle == 128 || kSwizzle == 64, "a 128- or 64-byte swizzle");
  const uint64_t a = smem_address(address);
  return ((a & 0x3FFFF) >> 4) | (uint64_t((leading_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t(8 * kSwizzle >> 4) << 32) | (uint64_t(kSwizzle == 128 ? 1 : 2) << 62);
}
// The descriptor of the same tile `offset` bytes further on (a multiple of 16): only the address
// field (bits 0-13, the address >> 4) moves, and it cannot carry into the next field, as
// shared-memory addresses stay below 2^18. One add per k step instead of a descriptor built from
// scratch.
__device__ __forceinline__ uint64_t advance_descriptor(uint64_t descriptor, uint32_t offset) {
  return descriptor + (offset >> 4);
}
// Keeps the compiler from moving the accumulators' reads and writes across the wgmma fence and
// wait (CUTLASS's warpgroup_fence_operand): wgmma reads and writes them behind its back.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A operands in registers: they must be written before the fence and kept until the
// wait that retires the wgmma reading them.
template <int kN>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// Before the first wgmma of a group: the warpgroup's registers and shared memory are ready.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
// Closes the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// D (64 x 128, fp32, 64 registers per thread) = A B (+ D when accumulate), A 64 x 32 and B
// 32 x 128 e4m3, both read from shared memory through their descriptors, both K-major (k
// contiguous): the FP8 forms take no transpose operands (the PTX ISA has them for .f16 and .bf16
// alone).
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
}

// The same with N = 192: D (64 x 192, fp32, 96 registers per thread), B 32 x 192, K-major.
__device__ __forceinline__ void wgmma_m64n192k32(float (&d)[96], uint64_t desc_a, uint64_t desc_b,
                                                 bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "
      "%87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "%96, %97, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
}

// D (64 x 64, fp32, 32 registers per thread) = A B (+ D when accumulate), with A from
// registers (the "RS" form): a[0..3] hold the warp's 16 x 32 slice of the 64 x 32 e4m3 A, four
// values to a register, lowest k in the lowest byte: a0 row g, k 4t .. 4t + 3; a1 row g + 8, the
// same k; a2 and a3 the same rows, k 16 + 4t .. 16 + 4t + 3. B (32 x 64 e4m3) is K-major in
// shared memory.
__device__ __forceinline__ void wgmma_m64n64k32_rs(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));
}

// D (64 x 128, fp32, 64 registers per thread) = A B (+ D when accumulate), with A from
// registers (the "RS" form): a[0..3] hold the warp's 16 x 32 slice of the 64 x 32 e4m3 A, four
// values to a register, lowest k in the lowest byte: a0 row g, k 4t .. 4t + 3; a1 row g + 8, the
// same k; a2 and a3 the same rows, k 16 + 4t .. 16 + 4t + 3. B (32 x 128 e4m3) is K-major in
// shared memory.
__device__ __forceinline__ void wgmma_m64n128k32_rs(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));
}

// D (64 x 256, fp32, 128 registers per thread) = A B (+ D when accumulate), with A from
// registers (the "RS" form): a[0..3] hold the warp's 16 x 32 slice of the 64 x 32 e4m3 A, four
// values to a register, lowest k in the lowest byte: a0 row g, k 4t .. 4t + 3; a1 row g + 8, the
// same k; a2 and a3 the same rows, k 16 + 4t .. 16 + 4t + 3. B (32 x 256 e4m3) is K-major in
// shared memory.
__device__ __forceinline__ void wgmma_m64n256k32_rs(float (&d)[128], const uint32_t (&a)[4],
                                                    uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, "
      "%104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, "
      "%118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));
}

}  // namespace hopper
