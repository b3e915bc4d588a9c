// The check of chapter 08, exercise 2 ("Eight warps of 16 rows", chapters/08_fragment_reuse/
// README.md). It fails on the chapter as written (4 warps x 2 row tiles), and passes once the
// block is 8 warps of one 16-row tile each (kWarps = 8, kMTiles = 1): the same 128 query rows
// per block, so the same copies of K and V from device memory per query, but every K and V
// fragment loaded from shared memory feeds one MMA again instead of two. Every case of the
// edge-case matrix must still pass. The time is the exercise's question (the answer in
// docs/answers/08_fragment_reuse.md); this check only keeps the edit honest and correct.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.08_eight_warps --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("8 warps x 1 row tile: 128 query rows per block, and still correct") {
  CHECK(CHAPTER_NAMESPACE::kWarps == 8);
  CHECK(CHAPTER_NAMESPACE::kMTiles == 1);
  CHECK(CHAPTER_NAMESPACE::kBlockM == 128);
  for (int head_dim : {64, 128}) {
    cudaFuncAttributes attributes{};
    CUDA_CHECK(cudaFuncGetAttributes(&attributes, head_dim == 64
                                                      ? CHAPTER_NAMESPACE::flash_tc_kernel<64>
                                                      : CHAPTER_NAMESPACE::flash_tc_kernel<128>));
    MESSAGE("d = " << head_dim << ": " << attributes.numRegs << " registers per thread, "
                   << attributes.maxThreadsPerBlock << " threads per block at most");
  }

  attn::test::check_every_case_passes(CHAPTER_NAMESPACE::chapter());
}
