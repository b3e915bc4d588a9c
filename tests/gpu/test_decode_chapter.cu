// The GPU test of one decode chapter. CMake compiles this file once per decode chapter, with the
// chapter's folder on the include path and its namespace in CHAPTER_NAMESPACE. Without a usable GPU
// the program exits with 77, which CTest reports as skipped (never as passed): chapter_main.h.
#include "attention.cuh"

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "decode_cases.h"
#include "device_buffer.h"
#include "chapter_main.h"

namespace {

// Three sequences of different lengths, one of them split over several blocks, with 2 new tokens
// and 4 query heads per key/value head: small enough to check in full in well under a second.
attn::RunOptions small_problem(const attn::DecodeChapter& chapter) {
  attn::RunOptions options;
  options.shape = attn::make_shape(3, 8, 2, 2, 3000, chapter.head_dims.back());
  options.seqlens_k = "5,3000,1000";
  options.bench = false;
  return options;
}

// A head_dim the chapter was not written for.
int unsupported_head_dim(const attn::DecodeChapter& chapter) {
  for (int d : {96, 80, 160, 48})
    if (std::find(chapter.head_dims.begin(), chapter.head_dims.end(), d) == chapter.head_dims.end())
      return d;
  return 300;  // beyond any chapter's 256
}

}  // namespace

TEST_CASE("decoding matches the Eigen reference over the edge-case matrix") {
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  for (const attn::test::DecodeCase& c : attn::test::decode_cases(chapter)) {
    INFO(chapter.name << ": " << c.name);
    // The same runner as the chapter binary, with the check on and the timing off. The cache past
    // each sequence's length (and every page no sequence owns) is NaN, and o and lse are poisoned,
    // so a key read too many or a row left unwritten fails the comparison.
    const attn::RunReport report = attn::run_decode(chapter, c.options);
    CHECK(report.checked);
    CHECK(report.comparison("o").count > 0);
    CHECK(report.comparison("lse").count > 0);
    CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
  }
}

TEST_CASE("a head_dim the chapter does not support is refused with a sentence") {
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  options.shape.head_dim = unsupported_head_dim(chapter);
  CHECK_THROWS_AS(attn::run_decode(chapter, options), attn::InvalidInput);
}

TEST_CASE("more new tokens than a decode step takes are refused with a sentence") {
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  options.shape.seqlen_q = attn::kMaxDecodeQueries + 1;
  CHECK_THROWS_AS(attn::run_decode(chapter, options), attn::InvalidInput);
}

TEST_CASE("a bad --seqlens-k is refused with a sentence") {
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);  // batch 3
  for (const char* spec : {"5,3000", "5,3000,1000,7", "5,-1,1000", "uniform:5:2", "5,x,1000"}) {
    INFO("--seqlens-k " << spec);
    options.seqlens_k = spec;
    CHECK_THROWS_AS(attn::decode_shape(options), attn::InvalidInput);
    CHECK_THROWS_AS(attn::run_decode(chapter, options), attn::InvalidInput);
  }
}

TEST_CASE("a problem larger than the GPU is refused before anything is allocated") {
  // 16 sequences of 2^26 keys with 8 key/value heads is terabytes of cache: the plan refuses it in
  // one sentence (exit status 3 in the binary) instead of a failed allocation halfway. Pages of
  // 256 keep a paged chapter's block table (4 million entries) small on the host.
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options;
  options.shape = attn::make_shape(16, 8, 8, 1, 1 << 26, chapter.head_dims.front());
  options.page_size = 256;
  options.bench = false;
  CHECK_THROWS_WITH_AS(attn::run_decode(chapter, options),
                       doctest::Contains("of device memory, and the GPU has"),
                       attn::OutOfDeviceMemory);
}

TEST_CASE("two runs with the same seed give the same answer, another seed another answer") {
  // The same bits from the same inputs catch results that depend on leftovers in device memory
  // (an uninitialised workspace) or on scheduling (races in the combine of the splits); other
  // inputs giving other outputs catch a kernel that does not read them.
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  const attn::RunReport first = attn::run_decode(chapter, options);
  const attn::RunReport second = attn::run_decode(chapter, options);
  options.seed += 1;
  const attn::RunReport other = attn::run_decode(chapter, options);
  CHECK_MESSAGE(first.passed, attn::test::describe_failure(first));
  CHECK_MESSAGE(other.passed, attn::test::describe_failure(other));
  REQUIRE(first.outputs.size() == other.outputs.size());
  REQUIRE(first.outputs.size() == second.outputs.size());
  for (size_t i = 0; i < first.outputs.size(); ++i) {
    INFO(first.outputs[i].name);
    CHECK(first.outputs[i].checksum == second.outputs[i].checksum);
    CHECK(first.outputs[i].checksum != other.outputs[i].checksum);
  }
}

TEST_CASE("the report's bytes and bandwidths agree with the problem") {
  const attn::DecodeChapter chapter = CHAPTER_NAMESPACE::chapter();
  attn::RunOptions options = small_problem(chapter);
  options.bench = true;
  options.timing.warmup = 1;
  options.timing.iters = 3;
  const attn::RunReport report = attn::run_decode(chapter, options);
  CHECK_MESSAGE(report.passed, attn::test::describe_failure(report));
  const attn::DecodeFacts& facts = report.decode;

  // The lengths as given, and K and V read once each: every cached key of every key/value head.
  const std::vector<int> lengths = {5, 3000, 1000};
  CHECK(facts.shape.seqlens_k == lengths);
  CHECK(facts.shape.batch == options.shape.batch);
  CHECK(facts.shape.heads_kv == options.shape.heads_kv);
  const double element_bytes = double(attn::dtype_size(chapter.dtype));
  const double keys = 5 + 3000 + 1000;
  const int heads_kv = options.shape.heads_kv, d = options.shape.head_dim;
  CHECK(facts.kv_bytes == 2 * keys * heads_kv * d * element_bytes);

  // A contiguous cache has room for the longest sequence in every slot of the batch; a pool of
  // pages holds at least each sequence's keys rounded up to whole pages.
  CHECK(facts.shape.max_seqlen_k >= 3000);
  CHECK(facts.contiguous_cache_bytes == size_t(2 * double(options.shape.batch) * heads_kv *
                                               facts.shape.max_seqlen_k * d * element_bytes));
  if (chapter.paged) {
    CHECK(facts.page_size == options.page_size);
    double pages = 0;
    for (int length : lengths) pages += (length + options.page_size - 1) / options.page_size;
    CHECK(double(facts.cache_bytes) >=
          2 * pages * options.page_size * heads_kv * d * element_bytes);
  } else {
    CHECK(facts.page_size == 0);
    CHECK(facts.cache_bytes == facts.contiguous_cache_bytes);
  }

  // Timed as asked, and the bandwidth is those bytes over the median time.
  REQUIRE(report.timed);
  CHECK(report.timing.iters == options.timing.iters);
  REQUIRE(report.timing.median_ms > 0);
  CHECK(facts.kv_gbps > 0);
  CHECK(facts.copy_gbps > 0);
  CHECK(facts.kv_gbps ==
        doctest::Approx(facts.kv_bytes / (report.timing.median_ms * 1e-3) / 1e9).epsilon(1e-6));
}
