// The check of chapter 03, exercise 1 ("Drop the branches", chapters/03_online_softmax/README.md).
// It fails on the chapter as written, and passes once `fold` is the plain update
//   m' = max(m, s);  l = l * expf(m - m') + expf(s - m');  m = m'
// which computes expf(-inf - (-inf)) = NaN when a lane that has seen nothing yet meets a masked
// logit. Exactly the rows predicted below fail: their sum is NaN, so their LSE is NaN, while O
// stays finite (the kernel's `state.sum > 0` is false for NaN, so 1 / sum becomes 0 and the row of
// O is 0). Every other case still passes.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.03_drop_the_branches --output-on-failure
#include "attention.cuh"

#include <doctest/doctest.h>

#include "forward_cases.h"
#include "chapter_main.h"

namespace {

// Lane L folds keys L, L + 32, ... A lane whose first key is hidden (and exists: L < seqlen_k)
// ends with sum NaN. The first butterfly step merges it with lane L ^ 16: if that lane sees a key,
// the NaN enters a state with a finite max and reaches every lane; if not, both maxima are -inf
// and merge() returns the empty state, which drops the NaN. For a row that sees keys 0 .. e
// (e = query + seqlen_k - seqlen_q) that happens for some L in [16, 31] exactly when
// 0 <= e <= 30, e <= seqlen_k - 2 (some key is hidden) and seqlen_k >= 17.
bool some_row_gets_nan(const attn::AttentionShape& shape) {
  if (!shape.causal || shape.seqlen_k < 17) return false;
  for (int query = 0; query < shape.seqlen_q; ++query) {
    const int last_key_seen = query + shape.causal_offset();
    if (last_key_seen >= 0 && last_key_seen <= 30 && last_key_seen <= shape.seqlen_k - 2)
      return true;
  }
  return false;
}

}  // namespace

TEST_CASE("with the plain update, the predicted causal cases get a NaN LSE, and nothing else") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  int cases_with_nan = 0, causal_cases_that_pass = 0;
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    INFO(c.name);
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    if (some_row_gets_nan(c.options.shape)) {
      ++cases_with_nan;
      CHECK_MESSAGE(!report.passed, "this case still passes: is fold the plain update?");
      CHECK_MESSAGE(report.comparison("lse").nonfinite > 0, "the LSE of the NaN rows is finite");
      CHECK_MESSAGE(report.comparison("o").nonfinite == 0,
                    "O holds NaN: the sum's NaN should become 1 / sum = 0, not reach O");
    } else {
      causal_cases_that_pass += c.options.shape.causal;
      CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
    }
  }
  CHECK(cases_with_nan > 0);
  CHECK(causal_cases_that_pass > 0);
}
