// The check of chapter 05, exercise 1 ("A 2-D grid", chapters/05_flash2_loop_order/README.md).
// It fails on the chapter as written, and passes once the query block comes from blockIdx.x and
// (batch, head) from blockIdx.y: then the case with more (batch, head) pairs than gridDim.y can
// hold (65535) is refused at launch (cudaErrorInvalidConfiguration, thrown as attn::CudaError by
// CUDA_CHECK_LAUNCH), and every other case of the edge-case matrix still passes.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.05_two_d_grid --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "forward_cases.h"
#include "chapter_main.h"

namespace {
constexpr int64_t kMaxGridY = 65535;
}  // namespace

TEST_CASE("with (batch, head) in gridDim.y, only the case above 65535 pairs fails, at launch") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int cases_above_the_limit = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    INFO(c.name);
    const attn::AttentionShape& shape = c.options.shape;
    if (int64_t(shape.batch) * shape.heads_q > kMaxGridY) {
      ++cases_above_the_limit;
      CHECK_THROWS_AS_MESSAGE(attn::run_forward(chapter, c.options), attn::CudaError,
                              "launched with more than 65535 (batch, head) pairs: is (batch, "
                              "head) in blockIdx.y?");
    } else {
      const attn::RunReport report = attn::run_forward(chapter, c.options);
      CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
    }
  }
  CHECK(cases_above_the_limit > 0);
}
