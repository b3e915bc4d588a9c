// The GPU test of one backward chapter. CMake compiles this file once per backward chapter, with
// the chapter's folder on the include path and its namespace in CHAPTER_NAMESPACE. Without a usable
// GPU the program exits with 77, which CTest reports as skipped (never as passed): chapter_main.h.
#include "attention.cuh"

#include <doctest/doctest.h>

#include "backward_cases.h"
#include "device_buffer.h"
#include "chapter_main.h"

namespace {

attn::RunOptions small_problem(const attn::BackwardChapter& chapter) {
  attn::RunOptions options;
  options.shape = attn::make_shape(2, 8, 2, 300, 257, chapter.head_dims.back(), true);
  options.bench = false;
  return options;
}

}  // namespace

TEST_CASE("gradients match the Eigen reference over the edge-case matrix") {
  const attn::BackwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  for (const attn::test::BackwardCase& c : attn::test::backward_cases(chapter)) {
    INFO(chapter.name << ": " << c.name);
    // The same runner as the chapter binary, with the check on and the timing off. It checks the
    // harness's own O and LSE as well: a failure there is the harness's, not the chapter's.
    const attn::RunReport report = attn::run_backward(chapter, c.options);
    CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
  }
}

TEST_CASE("a head_dim the chapter does not support is refused with a sentence") {
  const attn::BackwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  options.shape.head_dim = 96;
  CHECK_THROWS_AS(attn::run_backward(chapter, options), attn::InvalidInput);
}

TEST_CASE("a problem larger than the GPU is refused before anything is allocated") {
  const attn::BackwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  options.shape = attn::make_shape(100000, 64, 64, 65536, 65536, chapter.head_dims.front());
  CHECK_THROWS_WITH_AS(attn::run_backward(chapter, options),
                       doctest::Contains("of device memory, and the GPU has"),
                       attn::OutOfDeviceMemory);
}

TEST_CASE("--deterministic gives the same bits on every run; without the mode it is refused") {
  const attn::BackwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  options.deterministic = true;
  if (!chapter.has_deterministic_mode) {
    CHECK_THROWS_WITH_AS(attn::run_backward(chapter, options),
                         doctest::Contains("has no deterministic mode"), attn::InvalidInput);
    return;
  }
  // Two runs of the same inputs: the checksums of every gradient's bits agree. (The atomic mode
  // may differ in the last bits from run to run: the order of its additions is the scheduler's.)
  // With the mask and without it: chapter 43 splits key blocks into pieces only without it.
  for (bool causal : {true, false}) {
    options.shape.causal = causal;
    INFO("causal " << causal);
    const attn::RunReport first = attn::run_backward(chapter, options);
    const attn::RunReport second = attn::run_backward(chapter, options);
    REQUIRE(first.passed);
    REQUIRE(second.passed);
    for (size_t i = 0; i < first.outputs.size(); ++i) {
      INFO(first.outputs[i].name);
      CHECK(first.outputs[i].checksum == second.outputs[i].checksum);
    }
  }
}

TEST_CASE("another seed gives other gradients, and each run passes") {
  // Catches results that do not depend on the inputs (a kernel that writes a constant).
  const attn::BackwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  const attn::RunReport first = attn::run_backward(chapter, options);
  options.seed += 1;
  const attn::RunReport other = attn::run_backward(chapter, options);
  CHECK(first.passed);
  CHECK(other.passed);
  CHECK(first.comparison("dq").rel_err != other.comparison("dq").rel_err);
}
