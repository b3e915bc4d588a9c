// The check of chapter 14, exercise 3 ("Forget to set the reference", chapters/14_fixed_costs/
// README.md). It fails on the chapter as written, and passes once the first block no longer sets
// the reference (the `if (!kPrevious)` loop that takes fmaxf(m_ref, block_max_scaled) is deleted)
// while `move` stays false on the first block. Then the first block computes P against
// kNoReference = -1e30: exp2(s * scale_log2 + 1e30) is inf for every finite score, and l, O and
// everything after them are inf or NaN. Every row that sees a key sees key 0, which is in the
// first block (the causal diagonal is bottom-right aligned), so every case of the edge-case
// matrix has rows whose O is not finite.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.14_first_block --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("without the first block's reference, every case has rows whose O is not finite") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int cases = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    if (!c.expect_pass) continue;
    INFO(c.name);
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    ++cases;
    CHECK_MESSAGE(report.comparison("o").nonfinite > 0,
                  "O is finite: does the first block still set the reference?");
  }
  CHECK(cases > 0);
}
