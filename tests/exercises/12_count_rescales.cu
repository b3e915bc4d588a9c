// The check of chapter 12, exercise 1 ("Count the rescales", chapters/12_lazy_rescale/README.md).
// It fails until the chapter has a counter `rescale_count` (a __device__ unsigned integer in its
// namespace, ch12) that lane 0 of each warp increments whenever `move` is set, and then checks
// what that counter reads after one launch on 2048 queries and keys at d = 128 (16 query blocks
// of 4 warps, 64 key blocks per warp):
//   - every warp moves on its first block (the reference starts at kNoReference), and no warp
//     more than once per block: between 64 and 64 x 64;
//   - with the chapter's threshold of 8: at q_scale 1 only the first blocks move (the NumPy
//     model, scripts/rescale_model.py, finds 1 move per warp), and at q_scale 16 many more do.
// It prints both counts: compare them with the model's (docs/answers/12_lazy_rescale.md).
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.12_count_rescales --output-on-failure
#include "attention.cuh"

#include <cstdint>
#include <type_traits>

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "runner.h"
#include "chapter_main.h"

// This check has to compile before the counter exists, so it declares a stand-in of another type
// in the global namespace. A name looked up from inside the chapter's namespace finds the
// chapter's own `rescale_count` when there is one (an inner scope hides an outer one), and this
// stand-in otherwise; the type of what it found says which.
struct NoRescaleCount {};
__device__ NoRescaleCount rescale_count;

namespace CHAPTER_NAMESPACE::exercise_check {

using Counter = std::remove_cv_t<decltype(rescale_count)>;
constexpr bool kCounterDeclared = std::is_integral_v<Counter>;

template <typename T>
uint64_t as_count(const T& value) {
  if constexpr (std::is_integral_v<T>) return uint64_t(value);
  else return 0;
}

void reset_counter() {
  const Counter zero{};
  CUDA_CHECK(cudaMemcpyToSymbol(rescale_count, &zero, sizeof(Counter)));
}

uint64_t read_counter() {
  Counter value{};
  CUDA_CHECK(cudaMemcpyFromSymbol(&value, rescale_count, sizeof(Counter)));
  return as_count(value);
}

}  // namespace CHAPTER_NAMESPACE::exercise_check

TEST_CASE("rescale_count counts one per warp and moved reference") {
  namespace check = CHAPTER_NAMESPACE::exercise_check;
  if (!check::kCounterDeclared)
    FAIL(
        "declare the counter in namespace ch12, beside kRescaleThreshold: `__device__ unsigned "
        "rescale_count = 0;`, and count each move once per warp, after `move` is known: "
        "`if (move && lane == 0) atomicAdd(&rescale_count, 1u);`");

  constexpr int kSeqlen = 2048, kHeadDim = 128;
  const attn::ForwardChapter chapter = CHAPTER_NAMESPACE::chapter();
  const uint64_t warps = uint64_t(kSeqlen / CHAPTER_NAMESPACE::kBlockM) * CHAPTER_NAMESPACE::kWarps;
  const uint64_t blocks_per_warp = kSeqlen / CHAPTER_NAMESPACE::kBlockNFor<kHeadDim>;
  attn::RunOptions options;
  options.shape = attn::make_shape(1, 1, 1, kSeqlen, kSeqlen, kHeadDim);
  options.bench = false;  // one launch
  auto count_at = [&](float q_scale) {
    options.q_scale = q_scale;
    check::reset_counter();
    const attn::RunReport report = attn::run_forward(chapter, options);
    CHECK_MESSAGE(report.passed, "the chapter with its counter must still be correct");
    return check::read_counter();
  };
  const uint64_t at_1 = count_at(1.0f), at_16 = count_at(16.0f);
  MESSAGE(warps << " warps x " << blocks_per_warp << " key blocks; threshold "
                << CHAPTER_NAMESPACE::kRescaleThreshold << ": " << at_1 << " moves at q_scale 1, "
                << at_16 << " at q_scale 16");
  for (uint64_t count : {at_1, at_16}) {
    CHECK_MESSAGE(count >= warps, "every warp's first block moves the reference");
    CHECK_MESSAGE(count <= warps * blocks_per_warp,
                  "more than one count per warp and block: "
                  "is it counted from one lane per warp?");
  }
  if (CHAPTER_NAMESPACE::kRescaleThreshold == 8.0f) {
    CHECK_MESSAGE(at_1 == warps, "at q_scale 1 only the first block of each warp should move");
    CHECK_MESSAGE(at_16 >= 4 * warps, "at q_scale 16 the maxima grow by more than 8 often");
  }
}
