// The check of chapter 04, exercise 1 ("Traffic follows Bc", chapters/04_flash1_tiling/README.md).
// It fails on the chapter as written (Br = Bc = 32 at d = 64), and passes once Tile<64> has
// Bc = kBlockN = 64 keys and Br = kBlockM = 16 query rows, the kernel's static shared memory is
// the 41408 bytes the exercise works out, and every case of the edge-case matrix still passes.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.04_wide_key_blocks --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("at d = 64, Bc = 64 and Br = 16, in 41408 bytes of shared memory, and still correct") {
  CHECK(CHAPTER_NAMESPACE::Tile<64>::kBlockN == 64);
  CHECK(CHAPTER_NAMESPACE::Tile<64>::kBlockM == 16);
  cudaFuncAttributes attributes{};
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, CHAPTER_NAMESPACE::flash1_kernel<64>));
  CHECK(attributes.sharedSizeBytes == 41408);

  attn::test::check_every_case_passes(CHAPTER_NAMESPACE::chapter());
}
