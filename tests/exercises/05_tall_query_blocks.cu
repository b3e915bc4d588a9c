// The check of chapter 05, exercise 3 ("Taller query blocks",
// chapters/05_flash2_loop_order/README.md). It fails on the chapter as written (Br = 32 at
// d = 64), and passes once Tile<64> has Br = kBlockM = 64 query rows and Bc = kBlockN = 32 keys,
// the kernel's static shared memory is the 42112 bytes the exercise works out, o_acc (now 32
// floats per thread) still fits in registers (no local memory: no spills), and every case of the
// edge-case matrix still passes.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.05_tall_query_blocks --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("at d = 64, Br = 64 and Bc = 32, in 42112 bytes, without spills, and still correct") {
  CHECK(CHAPTER_NAMESPACE::Tile<64>::kBlockM == 64);
  CHECK(CHAPTER_NAMESPACE::Tile<64>::kBlockN == 32);
  cudaFuncAttributes attributes{};
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, CHAPTER_NAMESPACE::flash2_kernel<64>));
  CHECK(attributes.sharedSizeBytes == 42112);
  CHECK_MESSAGE(attributes.localSizeBytes == 0, "the kernel spills to local memory");
  INFO("registers per thread: " << attributes.numRegs);

  attn::test::check_every_case_passes(CHAPTER_NAMESPACE::chapter());
}
