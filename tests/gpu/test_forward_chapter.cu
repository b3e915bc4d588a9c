// The GPU test of one forward chapter. CMake compiles this file once per chapter, with the
// chapter's folder on the include path and its namespace in CHAPTER_NAMESPACE. Without a usable GPU
// the program exits with 77, which CTest reports as skipped (never as passed): chapter_main.h.
#include "attention.cuh"

#include <doctest/doctest.h>

#include "device_buffer.h"
#include "forward_cases.h"
#include "chapter_main.h"

TEST_CASE("forward pass matches the Eigen reference over the edge-case matrix") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  for (const attn::test::ForwardCase& c : attn::test::forward_cases(chapter)) {
    INFO(chapter.name << ": " << c.name);
    // The same runner as the chapter binary, with the check on and the timing off.
    const attn::RunReport report = attn::run_forward(chapter, c.options);
    if (c.expect_pass) {
      CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
    } else {
      // Chapter 01's softmax overflows without the max (its lesson); other chapters fail past
      // their largest_logits. A pass here means the case or the limit is no longer true.
      CHECK_MESSAGE(!report.passed, "expected P to overflow: no max trick, or past largest_logits");
    }
  }
}

TEST_CASE("a head_dim the chapter does not support is refused with a sentence") {
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options;
  options.shape.head_dim = chapter.head_dims.empty() ? 300 : 96;
  options.bench = false;
  CHECK_THROWS_AS(attn::run_forward(chapter, options), attn::InvalidInput);
}

TEST_CASE("a problem larger than the GPU is refused before anything is allocated") {
  // 100000 x 64 heads at seqlen 65536 is petabytes: the plan refuses it in one sentence (exit
  // status 3 in the binary) instead of a failed allocation or a host std::bad_alloc halfway.
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options;
  options.shape = attn::make_shape(100000, 64, 64, 65536, 65536,
                                   chapter.head_dims.empty() ? 64 : chapter.head_dims.front());
  options.bench = false;
  CHECK_THROWS_WITH_AS(attn::run_forward(chapter, options),
                       doctest::Contains("of device memory, and the GPU has"),
                       attn::OutOfDeviceMemory);
}

TEST_CASE("two runs with the same seed give the same answer, another seed another answer") {
  // Catches results that depend on leftovers in device memory or on scheduling (races).
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options;
  options.shape.batch = 2;
  options.shape.heads_q = options.shape.heads_kv = 4;
  options.shape.seqlen_q = options.shape.seqlen_k = 300;
  options.shape.head_dim = chapter.head_dims.empty() ? 64 : chapter.head_dims.back();
  options.bench = false;
  const attn::RunReport first = attn::run_forward(chapter, options);
  const attn::RunReport second = attn::run_forward(chapter, options);
  options.seed += 1;
  const attn::RunReport other = attn::run_forward(chapter, options);
  CHECK(first.passed);
  CHECK(first.comparison("o").max_abs_err == second.comparison("o").max_abs_err);
  CHECK(first.comparison("o").rel_err == second.comparison("o").rel_err);
  CHECK(other.passed);
  CHECK(first.comparison("o").rel_err != other.comparison("o").rel_err);
}
