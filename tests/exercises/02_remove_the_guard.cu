// The check of chapter 02, exercise 1 ("Remove the guard", chapters/02_safe_softmax/README.md).
// It fails on the chapter as written, and passes once `shift` is the plain row max: then exactly
// the rows that see no key (causal, seqlen_q > seqlen_k) come out NaN, and every other case of
// the edge-case matrix still passes.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.02_remove_the_guard --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("without the guard, the rows that see no key are NaN, and nothing else fails") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int cases_with_empty_rows = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    if (!c.expect_pass) continue;
    INFO(c.name);
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    const attn::AttentionShape& shape = c.options.shape;
    if (shape.causal && shape.seqlen_q > shape.seqlen_k) {
      ++cases_with_empty_rows;
      CHECK_MESSAGE(report.comparison("o").nonfinite > 0,
                    "a row that sees no key still comes out finite: is the guard still there?");
      CHECK_MESSAGE(report.comparison("lse").nonfinite > 0, "the LSE of such a row is not NaN");
    } else {
      CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
    }
  }
  CHECK(cases_with_empty_rows > 0);
}
