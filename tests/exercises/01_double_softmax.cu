// The check of chapter 01, exercise 3 ("A wider type only moves the threshold",
// chapters/01_naive/README.md). It fails on the chapter as written, whose float softmax turns the
// large-logit cases (q_scale 100, logits of several hundred) into NaN, and passes once the softmax
// kernel computes exp(s), the row sum, its shuffles and 1 / sum in double: exp() in double
// overflows only above ln(DBL_MAX) = 709.78. Every case of the edge-case matrix must then pass,
// the large-logit ones included.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.01_double_softmax --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("with the softmax in double, every case passes, the large logits included") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int large_logit_cases = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    INFO(c.name);
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    if (c.options.q_scale != 1.0f) {
      ++large_logit_cases;
      CHECK_MESSAGE(report.comparison("o").nonfinite == 0,
                    "O still holds NaN or Inf: does every value that holds exp(s) (the sum, its "
                    "shuffles, 1 / sum) live in double?");
    }
    CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
  }
  CHECK(large_logit_cases > 0);
}
