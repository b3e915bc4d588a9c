// The check of chapter 12, exercise 2 ("A threshold of 200", chapters/12_lazy_rescale/README.md).
// It fails on the chapter as written (kRescaleThreshold = 8), and passes once kRescaleThreshold
// is 200 and exactly what the exercise predicts happens: on inputs with logits of order one no
// row's max grows by more than a few log2 units after the first block, so every such case still
// passes; the large-logit cases (q_scale 100: scores with a standard deviation of about 144 in
// log2 units) have rows whose max grows by more than 128 without the warp moving its reference,
// so p = exp2(s - m_ref) or the sums built from it overflow, and their O is not finite.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.12_threshold_200 --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("with a threshold of 200, the large-logit cases overflow and nothing else fails") {
  REQUIRE_MESSAGE(CHAPTER_NAMESPACE::kRescaleThreshold >= 200.0f,
                  "set kRescaleThreshold = 200.0f in the chapter first");
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int large_logit_cases = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    // The outlier cases' row maxima jump by millions from block to block: they rescale at any
    // threshold, and overflow or not by chance.
    if (!c.expect_pass || c.options.outliers != 1.0f) continue;
    INFO(c.name);
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    if (c.options.q_scale >= 100.0f) {
      ++large_logit_cases;
      CHECK_MESSAGE(report.comparison("o").nonfinite > 0,
                    "O is finite: did no row's max outgrow its reference by more than 128?");
    } else {
      CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
    }
  }
  CHECK(large_logit_cases > 0);
}
