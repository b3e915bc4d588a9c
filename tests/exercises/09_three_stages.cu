// The check of chapter 09, exercise 1 ("Three stages", chapters/09_cp_async_pipeline/README.md).
// It fails on the chapter as written (kStages = 2), and passes once kStages = 3 and every case of
// the edge-case matrix still passes: the prologue commits two blocks (the second group empty when
// there is only one block), each iteration starts the copy two blocks ahead and waits with
// cp_async_wait<kStages - 1>. The shared memory is the exercise's arithmetic: Q and three stages
// of K and V, rows of d + 8 bf16. (A check cannot see how far ahead the copies run: keeping the
// copy one block ahead with three buffers is also correct, and passes too.)
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.09_three_stages --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("three stages of K and V, in 129024 (d = 64) and 87040 (d = 128) bytes, still correct") {
  CHECK(CHAPTER_NAMESPACE::kStages == 3);
  CHECK(CHAPTER_NAMESPACE::Smem<64>::kBytes == 129024);  // (128 + 3 x 2 x 128) x 72 x 2
  CHECK(CHAPTER_NAMESPACE::Smem<128>::kBytes == 87040);  // (128 + 3 x 2 x 32) x 136 x 2

  attn::test::check_every_case_passes(CHAPTER_NAMESPACE::chapter());
}
