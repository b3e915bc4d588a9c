// The check of chapter 03, exercise 3 ("Test the butterfly", chapters/03_online_softmax/README.md):
// a test for the learner to write, of the chapter's own device code. The two helpers below run
// CHAPTER_NAMESPACE::fold and CHAPTER_NAMESPACE::warp_merge (and through it merge) on the GPU, one
// warp; the test case fails until its FAIL(...) is replaced by the checks it describes. A worked
// solution: docs/answers/03_online_softmax.md.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.03_warp_merge --output-on-failure
#include "attention.cuh"

#include <cmath>
#include <vector>

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "device_buffer.h"
#include "chapter_main.h"

namespace {

using State = CHAPTER_NAMESPACE::SoftmaxState;
constexpr int kLanes = 32;

// Lane L folds logits[L], logits[L + 32], ... into its own state, as softmax_kernel's first pass.
__global__ void fold_kernel(const float* logits, int count, State* lane_states) {
  State state;
  for (int j = threadIdx.x; j < count; j += kLanes) CHAPTER_NAMESPACE::fold(state, logits[j]);
  lane_states[threadIdx.x] = state;
}

// Lane L starts from lane_states[L]; all 32 run warp_merge and write what each ends with.
__global__ void warp_merge_kernel(State* lane_states) {
  lane_states[threadIdx.x] = CHAPTER_NAMESPACE::warp_merge(lane_states[threadIdx.x]);
}

// The 32 lanes' states after fold_kernel over `logits` (any length; -inf is a masked logit).
[[maybe_unused]] std::vector<State> fold_on_gpu(const std::vector<float>& logits) {
  attn::DeviceBuffer<float> logits_dev(logits.size() + 1);  // + 1: an empty row still allocates
  attn::DeviceBuffer<State> states_dev(kLanes);
  CUDA_CHECK(cudaMemcpy(logits_dev.get(), logits.data(), logits.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  fold_kernel<<<1, kLanes>>>(logits_dev.get(), int(logits.size()), states_dev.get());
  CUDA_CHECK_LAUNCH();
  std::vector<State> states(kLanes);
  CUDA_CHECK(
      cudaMemcpy(states.data(), states_dev.get(), kLanes * sizeof(State), cudaMemcpyDeviceToHost));
  return states;
}

// What each of the 32 lanes holds after warp_merge, lane L having started from lanes[L].
[[maybe_unused]] std::vector<State> warp_merge_on_gpu(const std::vector<State>& lanes) {
  REQUIRE(lanes.size() == size_t(kLanes));
  attn::DeviceBuffer<State> states_dev(kLanes);
  CUDA_CHECK(
      cudaMemcpy(states_dev.get(), lanes.data(), kLanes * sizeof(State), cudaMemcpyHostToDevice));
  warp_merge_kernel<<<1, kLanes>>>(states_dev.get());
  CUDA_CHECK_LAUNCH();
  std::vector<State> merged(kLanes);
  CUDA_CHECK(
      cudaMemcpy(merged.data(), states_dev.get(), kLanes * sizeof(State), cudaMemcpyDeviceToHost));
  return merged;
}

}  // namespace

TEST_CASE("fold and warp_merge give every lane the max and the sum of the whole row") {
  FAIL(
      "write this test: (1) a row of 200 logits spread from -1000 to 95, with logits[j] = "
      "-INFINITY for every j % 32 == 5 or 6 (two lanes see only masked logits); states = "
      "fold_on_gpu(row), merged = warp_merge_on_gpu(states); compute the row's max m and "
      "sum exp(s - m) in double on the host; CHECK that every lane's max equals m and its sum is "
      "within a relative 1e-6 of the host sum. (2) A row of 5 logits (lanes 5-31 see nothing): "
      "the same checks. (3) A row of 64 -INFINITY: every lane ends with max -inf and sum 0, not "
      "NaN. (4) States made by hand: lane L starts from (max -30 L, sum 1); every lane must end "
      "with max 0 and the sum over L of exp(-30 L) computed in double.");
}
