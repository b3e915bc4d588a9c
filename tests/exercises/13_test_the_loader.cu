// The check of chapter 13, exercise 2 ("Test the loader", chapters/13_tile_loader/README.md): a
// test for the learner to write, of the chapter's own device code. load_tile_on_gpu below runs
// CHAPTER_NAMESPACE::load_tile_async once, as the kernel runs it (one block of kThreads threads,
// then commit, wait and a barrier), and returns the whole padded shared tile; the test case fails
// until its FAIL(...) is replaced by the checks it describes. A worked solution:
// docs/answers/13_tile_loader.md.
//
//   cmake --preset default -DCOURSE_EXERCISES=ON && cmake --build --preset default -j "$(nproc)"
//   ctest --test-dir build -R exercise.13_test_the_loader --output-on-failure
#include "attention.cuh"

#include <vector>

#include <doctest/doctest.h>

#include "cuda_check.h"
#include "device_buffer.h"
#include "chapter_main.h"

namespace {

using bf16 = __nv_bfloat16;

// What every element of the shared tile holds before the copy: what the loader leaves alone
// still reads as this afterwards.
[[maybe_unused]] constexpr float kUntouched = -1000.0f;

template <int kRows, int kHeadDim>
__global__ void load_tile_kernel(const bf16* src, int row0, int rows_total, bf16* out) {
  constexpr int kStride = CHAPTER_NAMESPACE::Smem<kHeadDim>::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* tile = reinterpret_cast<bf16*>(smem);
  for (int i = threadIdx.x; i < kRows * kStride; i += blockDim.x)
    tile[i] = __float2bfloat16(kUntouched);
  __syncthreads();
  CHAPTER_NAMESPACE::load_tile_async<kRows, kHeadDim>(tile, src, row0, rows_total);
  CHAPTER_NAMESPACE::cp_async_commit();
  CHAPTER_NAMESPACE::cp_async_wait<0>();
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * kStride; i += blockDim.x) out[i] = tile[i];
}

// Copies rows [row0, row0 + kRows) of `matrix` ([rows_total][kHeadDim], row-major, values exact
// in bf16) with the chapter's loader and returns the shared tile as floats: kRows rows of
// Smem<kHeadDim>::kStride elements, the last kStride - kHeadDim of each row being the padding.
// The matrix is copied to a device buffer of exactly rows_total rows.
template <int kRows, int kHeadDim>
[[maybe_unused]] std::vector<float> load_tile_on_gpu(const std::vector<float>& matrix, int row0) {
  constexpr int kStride = CHAPTER_NAMESPACE::Smem<kHeadDim>::kStride;
  REQUIRE(matrix.size() % kHeadDim == 0);
  const int rows_total = int(matrix.size() / kHeadDim);
  std::vector<bf16> host(matrix.size());
  for (size_t i = 0; i < matrix.size(); ++i) host[i] = __float2bfloat16(matrix[i]);
  attn::DeviceBuffer<bf16> src(host.size()), out(size_t(kRows) * kStride);
  CUDA_CHECK(
      cudaMemcpy(src.get(), host.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  load_tile_kernel<kRows, kHeadDim>
      <<<1, CHAPTER_NAMESPACE::kThreads, size_t(kRows) * kStride * sizeof(bf16)>>>(
          src.get(), row0, rows_total, out.get());
  CUDA_CHECK_LAUNCH();
  std::vector<bf16> tile(out.size());
  CUDA_CHECK(
      cudaMemcpy(tile.data(), out.get(), tile.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> result(tile.size());
  for (size_t i = 0; i < tile.size(); ++i) result[i] = __bfloat162float(tile[i]);
  return result;
}

}  // namespace

TEST_CASE("load_tile_async copies the rows that exist, zero-fills the others, spares the padding") {
  FAIL(
      "write this test. Fill a matrix of rows_total x d with small integers that differ from "
      "element to element (exact in bf16, e.g. (37 r + 11 c) % 199 - 99). For d = 64 and 128, "
      "call load_tile_on_gpu<kRows, d> with kRows = kBlockNFor<d> (a K or V tile) and with "
      "kRows = kBlockM (a Q tile), in three positions: (1) a tile well inside the matrix "
      "(row0 + kRows < rows_total, the fast path); (2) a tile that ends exactly at the last row "
      "(row0 + kRows == rows_total, still the fast path); (3) a tile that runs past the end "
      "(rows_total - row0 between 1 and kRows - 1, the checked path), including a Q tile of a "
      "single row (rows_total = 1, row0 = 0). CHECK for every row r of the tile and column c < d: "
      "the element equals matrix[(row0 + r) * d + c] when row0 + r < rows_total and 0 otherwise; "
      "and that every padding element (columns d to kStride - 1) still reads kUntouched.");
}
