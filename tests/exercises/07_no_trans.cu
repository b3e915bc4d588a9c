// The check of chapter 07, exercise 2 ("Without .trans", chapters/07_ldmatrix/README.md).
// It fails on the chapter as written, and passes once load_b_columns loads V with ldmatrix_x4
// instead of ldmatrix_x4_trans. Then lane 4g + t receives V[key g][dims 2t, 2t+1] of each 8x8
// block where the MMA expects V[keys 2t, 2t+1][dim g]: every B fragment of O = P V is the
// transpose of what it should be, so O is wrong (but finite) in every case of the edge-case
// matrix. The log-sum-exp never touches V, so it still passes in every case.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.07_no_trans --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("without .trans, O is wrong in every case and the LSE is right in every case") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int cases = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    if (!c.expect_pass) continue;
    INFO(c.name);
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    const attn::Comparison& o = report.comparison("o");
    const attn::Comparison& lse = report.comparison("lse");
    ++cases;
    CHECK_MESSAGE(!o.passed, "O still matches the reference: is V still loaded with .trans?");
    CHECK_MESSAGE(o.nonfinite == 0, "O has NaN or Inf: only the B fragments should be wrong");
    CHECK_MESSAGE(lse.passed, attn::test::describe_failure(report));
  }
  CHECK(cases > 0);
}
