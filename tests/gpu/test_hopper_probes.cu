// Probes of the Hopper instructions of chapter 21 (hopper.cuh), each against an exact host answer:
// the tensor map and TMA's 128-byte swizzle, one wgmma of each form the chapter issues (Q K^T with
// both operands K-major, P V with V MN-major), the accumulator register layout that the chapter's
// softmax and epilogue assume, and what a tile that is not 1024-byte aligned does. When the
// chapter's test fails, these say which instruction's assumption broke.
//
// Inputs are small integers (or selectors of 0 and 1), exact in bf16, and every dot product of
// them is exact in fp32 whatever the order of its sums: every comparison here is equality.
#include "hopper.cuh"

#include <doctest/doctest.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <cuda_bf16.h>

#include "cuda_check.h"
#include "device_buffer.h"
#include "gpu_main.h"
#include "host_data.h"

namespace {

using bf16 = __nv_bfloat16;
using attn::DeviceBuffer;

constexpr int kThreads = 128;          // one warpgroup
constexpr int kTileRows = 64;          // wgmma's M, and the rows of every box here
constexpr int kPanelCols = 64;         // bf16 columns per 128-byte swizzled row
constexpr int kPanelBytes = 64 * 128;  // one box: 64 rows of 128 bytes
constexpr int kSwizzleAtom = 1024;     // 8 rows of 128 bytes: where the swizzle pattern repeats

// ---------------------------------------------------------------------------------------------
// Device helpers: the chapter's patterns, written out again so that a change to the chapter's
// copy cannot change what is probed.
// ---------------------------------------------------------------------------------------------

__device__ unsigned char* align_to_atom(unsigned char* p) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(p) + kSwizzleAtom - 1) &
                                          ~uintptr_t(kSwizzleAtom - 1));
}

// Byte offset of (row, col) in one 64-column panel: 16-byte chunk c of row r sits at c ^ (r % 8).
__device__ int swizzled_offset(int row, int col) {
  return row * 128 + ((col / 8) ^ (row % 8)) * 16 + col % 8 * 2;
}

// Threads copy a 64 x 64 row-major matrix into a tile in the swizzle, as the chapter writes P;
// the fence hands the stores to the async proxy that wgmma reads through, the barrier the others'.
__device__ void write_swizzled(unsigned char* tile, const bf16* matrix) {
  for (int e = threadIdx.x; e < kTileRows * kPanelCols; e += kThreads)
    *reinterpret_cast<bf16*>(tile + swizzled_offset(e / kPanelCols, e % kPanelCols)) = matrix[e];
  hopper::fence_proxy_async();
  __syncthreads();
}

// Thread 0 copies `panels` boxes of 64 rows x 64 columns, side by side from (col, row, outer),
// to consecutive panels of `tile`; every thread waits until all their bytes have landed (boxes
// that run past the tensor's end count their zeros too).
__device__ void tma_load_panels(unsigned char* tile, const CUtensorMap* map, uint64_t* bar,
                                int panels, int col, int row, int outer) {
  if (threadIdx.x == 0) {
    hopper::mbarrier_init(bar, 1);
    hopper::mbarrier_arrive_expect_tx(bar, panels * kPanelBytes);
    for (int p = 0; p < panels; ++p)
      hopper::tma_load(tile + p * kPanelBytes, map, bar, col + p * kPanelCols, row, outer);
  }
  __syncthreads();  // no thread waits on the barrier before it is initialised
  hopper::mbarrier_wait(bar, 0);
}

// The accumulator layout (HOPPER.md section 2, the chapter's header comment): register i of lane
// 4 g + t in warp w holds row 16 w + g (+ 8 when i % 4 >= 2), column 8 (i / 4) + 2 t + i % 2.
template <int kN>
__device__ void store_accumulators(const float (&d)[kN / 2], float* out) {
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    const int row = 16 * warp + g + 8 * (i % 4 / 2), col = 8 * (i / 4) + 2 * t + i % 2;
    out[row * kN + col] = d[i];
  }
}

// S (64 x 64) = A B^T over k = 64, both K-major in one panel each: gemm_qk's 4 k steps of 32 bytes.
__device__ void gemm_qk(float (&s)[32], const unsigned char* a_tile, const unsigned char* b_tile) {
  hopper::fence_operands(s);
  hopper::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    hopper::wgmma_m64n64k16<0>(s, hopper::smem_descriptor(a_tile + ks * 32, 16),
                               hopper::smem_descriptor(b_tile + ks * 32, 16), ks > 0);
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(s);
}

// ---------------------------------------------------------------------------------------------
// Kernels, one block each
// ---------------------------------------------------------------------------------------------

struct Box {
  int col, row, outer;
};
constexpr int kBoxes = 5;
struct Boxes {
  Box box[kBoxes];
};

// Block b copies box b into shared memory and writes it back un-swizzled, 64 x 64, as raw bits.
__global__ void round_trip_kernel(const __grid_constant__ CUtensorMap map, Boxes boxes,
                                  uint16_t* out) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* tile = align_to_atom(smem_raw);
  __shared__ uint64_t bar;
  const Box box = boxes.box[blockIdx.x];
  tma_load_panels(tile, &map, &bar, 1, box.col, box.row, box.outer);
  for (int e = threadIdx.x; e < kTileRows * kPanelCols; e += kThreads)
    out[blockIdx.x * kTileRows * kPanelCols + e] =
        *reinterpret_cast<const uint16_t*>(tile + swizzled_offset(e / kPanelCols, e % kPanelCols));
}

// S = A B^T with A and B (64 x 64) copied by TMA to 1024-aligned tiles: the chapter's Q K^T.
__global__ void qk_tma_kernel(const __grid_constant__ CUtensorMap a_map,
                              const __grid_constant__ CUtensorMap b_map, float* s_out) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* a_tile = align_to_atom(smem_raw);
  unsigned char* b_tile = a_tile + kPanelBytes;
  __shared__ uint64_t bars[2];
  tma_load_panels(a_tile, &a_map, &bars[0], 1, 0, 0, 0);
  tma_load_panels(b_tile, &b_map, &bars[1], 1, 0, 0, 0);
  float s[32];
  gemm_qk(s, a_tile, b_tile);
  store_accumulators<64>(s, s_out);
}

// The same product with A and B written by the threads, each tile `a_offset` / `b_offset` bytes
// past a 1024-byte boundary, and swizzled relative to the tile's own start as the chapter swizzles
// P. The descriptors are built as the chapter builds them, base offset 0.
constexpr int kSlotBytes = kPanelBytes + kSwizzleAtom;  // room for a tile and its displacement
__global__ void qk_by_hand_kernel(const bf16* a, const bf16* b, int a_offset, int b_offset,
                                  float* s_out) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* a_tile = align_to_atom(smem_raw) + a_offset;
  unsigned char* b_tile = align_to_atom(smem_raw) + kSlotBytes + b_offset;
  write_swizzled(a_tile, a);
  write_swizzled(b_tile, b);
  float s[32];
  gemm_qk(s, a_tile, b_tile);
  store_accumulators<64>(s, s_out);
}

// O (64 x 128) = P V, the chapter's gemm_pv at head_dim 128: P (64 x 64, K-major) written by the
// threads, V (64 keys x 128) copied by TMA in two panels of 64 columns and read MN-major
// (trans-b = 1): each k step 16 rows = 2048 bytes on, the next panel of n one panel further on
// (the leading-dimension byte offset).
__global__ void pv_kernel(const bf16* p, const __grid_constant__ CUtensorMap v_map, float* o_out) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* p_tile = align_to_atom(smem_raw);
  unsigned char* v_tile = p_tile + kPanelBytes;
  __shared__ uint64_t bar;
  write_swizzled(p_tile, p);
  tma_load_panels(v_tile, &v_map, &bar, 2, 0, 0, 0);
  float o[64] = {};
  hopper::fence_operands(o);
  hopper::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    hopper::wgmma_m64n128k16<1>(o, hopper::smem_descriptor(p_tile + ks * 32, 16),
                                hopper::smem_descriptor(v_tile + ks * 16 * 128, kPanelBytes), true);
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(o);
  store_accumulators<128>(o, o_out);
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// A row-major matrix of bf16-exact values, its device copy, and a tensor map of it as
// [1][rows][cols] with boxes of 64 rows, as the chapter maps Q, K and V.
struct Matrix {
  int rows, cols;
  std::vector<float> values;
  DeviceBuffer<uint16_t> device;
  CUtensorMap map;
  Matrix(int r, int c, std::vector<float> v)
      : rows(r), cols(c), values(std::move(v)), device(values.size()) {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = attn::float_to_bf16_bits(values[i]);
    CUDA_CHECK(cudaMemcpy(device.get(), bits.data(), device.bytes(), cudaMemcpyHostToDevice));
    map = hopper::make_tensor_map(device.get(), cols, rows, 1, kTileRows);
  }
  float at(int r, int c) const { return values[size_t(r) * cols + c]; }
  const bf16* data() const { return reinterpret_cast<const bf16*>(device.get()); }
};

// Integers in {-4..-1, 1..4} (never 0), the same on every machine for a seed.
std::vector<float> small_integers(size_t count, uint64_t seed) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) {
    const int k = int(attn::splitmix64(seed * 0x100000000ull + i) % 8);
    v[i] = float(k < 4 ? k - 4 : k - 3);
  }
  return v;
}

// A selector that makes the product encode positions: A[m][0] = m, A[m][1] = 1, 0 elsewhere.
std::vector<float> row_selector() {
  std::vector<float> a(kTileRows * kPanelCols, 0.0f);
  for (int m = 0; m < kTileRows; ++m) a[m * kPanelCols] = float(m), a[m * kPanelCols + 1] = 1.0f;
  return a;
}

// An output buffer poisoned with NaN (all bits set), so an element nobody wrote cannot match.
DeviceBuffer<float> poisoned_floats(size_t count) {
  DeviceBuffer<float> buffer(count);
  CUDA_CHECK(cudaMemset(buffer.get(), 0xFF, buffer.bytes()));
  return buffer;
}

std::vector<float> download(const DeviceBuffer<float>& buffer) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> host(buffer.size());
  CUDA_CHECK(cudaMemcpy(host.data(), buffer.get(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

// Elements of a rows x cols result that differ from want(r, c); the first one goes in `first`.
template <typename Want>
int count_mismatches(const std::vector<float>& got, int cols, Want want, std::string& first) {
  int count = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int r = int(i / cols), c = int(i % cols);
    const double expected = want(r, c);
    if (double(got[i]) == expected) continue;
    if (count++ == 0) {
      std::ostringstream line;
      line << "first mismatch at (" << r << ", " << c << "): " << got[i] << ", expected "
           << expected;
      first = line.str();
    }
  }
  return count;
}

// S = A B^T (both K-major, 64 x 64) run by hand-written tiles at the given displacements.
std::vector<float> qk_by_hand(const Matrix& a, const Matrix& b, int a_offset, int b_offset) {
  DeviceBuffer<float> s = poisoned_floats(64 * 64);
  qk_by_hand_kernel<<<1, kThreads, 2 * kSlotBytes + kSwizzleAtom>>>(a.data(), b.data(), a_offset,
                                                                    b_offset, s.get());
  CUDA_CHECK_LAUNCH();
  return download(s);
}

double dot_abt(const Matrix& a, const Matrix& b, int m, int n) {  // (A B^T)[m][n] in double
  double sum = 0;
  for (int k = 0; k < a.cols; ++k) sum += double(a.at(m, k)) * b.at(n, k);
  return sum;
}

}  // namespace

TEST_CASE(
    "a tensor map's boxes come back whole, swizzled as the chapter assumes, zero past the end") {
  // [outer = 3][rows = 100][cols = 128], every element a different bit pattern, none of them 0
  // (which the rows past the end read as) and none a bf16 infinity or NaN.
  constexpr int kOuter = 3, kRows = 100, kCols = 128;
  std::vector<uint16_t> tensor(size_t(kOuter) * kRows * kCols);
  for (size_t i = 0; i < tensor.size(); ++i)
    tensor[i] = uint16_t(i + 1 < 0x7F80 ? i + 1 : i + 1 + 0x100);
  DeviceBuffer<uint16_t> device(tensor.size());
  CUDA_CHECK(cudaMemcpy(device.get(), tensor.data(), device.bytes(), cudaMemcpyHostToDevice));
  const CUtensorMap map = hopper::make_tensor_map(device.get(), kCols, kRows, kOuter, kTileRows);
  // Both 64-column panels, every outer index, a box that ends on the last row, and two that run
  // 28 rows past it.
  const Boxes boxes{{{0, 0, 0}, {64, 0, 1}, {0, 36, 1}, {0, 64, 2}, {64, 64, 0}}};
  DeviceBuffer<uint16_t> out(size_t(kBoxes) * kTileRows * kPanelCols);
  CUDA_CHECK(cudaMemset(out.get(), 0xFF, out.bytes()));  // 0xFFFF: no element of the tensor
  round_trip_kernel<<<kBoxes, kThreads, kPanelBytes + kSwizzleAtom>>>(map, boxes, out.get());
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(out.size());
  CUDA_CHECK(cudaMemcpy(got.data(), out.get(), out.bytes(), cudaMemcpyDeviceToHost));
  for (int b = 0; b < kBoxes; ++b) {
    const Box box = boxes.box[b];
    int wrong = 0;
    for (int r = 0; r < kTileRows; ++r)
      for (int c = 0; c < kPanelCols; ++c) {
        const int row = box.row + r;
        const uint16_t want =
            row < kRows ? tensor[(size_t(box.outer) * kRows + row) * kCols + box.col + c] : 0;
        wrong += got[(size_t(b) * kTileRows + r) * kPanelCols + c] != want;
      }
    INFO("box at column " << box.col << ", row " << box.row << ", outer " << box.outer);
    CHECK(wrong == 0);
  }
}

TEST_CASE("wgmma computes Q K^T (both K-major) and P V (V MN-major) exactly") {
  SUBCASE("S = A B^T, 64 x 64 x 64, A and B copied by TMA: the chapter's gemm_qk") {
    const Matrix a(64, 64, small_integers(64 * 64, 1)), b(64, 64, small_integers(64 * 64, 2));
    DeviceBuffer<float> s = poisoned_floats(64 * 64);
    qk_tma_kernel<<<1, kThreads, 2 * kPanelBytes + kSwizzleAtom>>>(a.map, b.map, s.get());
    CUDA_CHECK_LAUNCH();
    std::string first;
    const int wrong = count_mismatches(
        download(s), 64, [&](int m, int n) { return dot_abt(a, b, m, n); }, first);
    INFO(first);
    CHECK(wrong == 0);
  }
  SUBCASE("O = P V, 64 x 128 x 64, P written by the threads, V by TMA: the chapter's gemm_pv") {
    const Matrix p(64, 64, small_integers(64 * 64, 3)), v(64, 128, small_integers(64 * 128, 4));
    DeviceBuffer<float> o = poisoned_floats(64 * 128);
    pv_kernel<<<1, kThreads, 3 * kPanelBytes + kSwizzleAtom>>>(p.data(), v.map, o.get());
    CUDA_CHECK_LAUNCH();
    std::string first;
    const int wrong = count_mismatches(
        download(o), 128,
        [&](int m, int n) {
          double sum = 0;
          for (int k = 0; k < 64; ++k) sum += double(p.at(m, k)) * v.at(k, n);
          return sum;
        },
        first);
    INFO(first);
    CHECK(wrong == 0);
  }
}

TEST_CASE("the accumulator registers hold the rows and columns the chapter's layout formula says") {
  // Each product's element (m, n) is its own position, N m + n: A selects m and 1, B holds N and
  // n. The kernels store register i of each thread where the formula says it belongs, so a wrong
  // formula leaves there the value of another position (decoded in the message), or a NaN.
  SUBCASE("m64n64k16, the layout of S") {
    std::vector<float> b(64 * 64, 0.0f);  // B[n][0] = 64, B[n][1] = n: K-major
    for (int n = 0; n < 64; ++n) b[n * 64] = 64.0f, b[n * 64 + 1] = float(n);
    const Matrix a_sel(64, 64, row_selector()), b_pos(64, 64, b);
    DeviceBuffer<float> s = poisoned_floats(64 * 64);
    qk_tma_kernel<<<1, kThreads, 2 * kPanelBytes + kSwizzleAtom>>>(a_sel.map, b_pos.map, s.get());
    CUDA_CHECK_LAUNCH();
    std::string first;
    const int wrong = count_mismatches(
        download(s), 64, [](int m, int n) { return 64.0 * m + n; }, first);
    INFO(first << " (a value v is the element at (v / 64, v % 64))");
    CHECK(wrong == 0);
  }
  SUBCASE("m64n128k16 with trans-b = 1, the layout of O") {
    std::vector<float> v(64 * 128, 0.0f);  // V[0][n] = 128, V[1][n] = n: MN-major
    for (int n = 0; n < 128; ++n) v[n] = 128.0f, v[128 + n] = float(n);
    const Matrix p_sel(64, 64, row_selector()), v_pos(64, 128, v);
    DeviceBuffer<float> o = poisoned_floats(64 * 128);
    pv_kernel<<<1, kThreads, 3 * kPanelBytes + kSwizzleAtom>>>(p_sel.data(), v_pos.map, o.get());
    CUDA_CHECK_LAUNCH();
    std::string first;
    const int wrong = count_mismatches(
        download(o), 128, [](int m, int n) { return 128.0 * m + n; }, first);
    INFO(first << " (a value v is the element at (v / 128, v % 128))");
    CHECK(wrong == 0);
  }
}

TEST_CASE("a tile 512 bytes off a 1024-byte boundary gives a wrong product, or one that hides") {
  // wgmma with base offset 0 takes the swizzle from the address bits 7-9 of each row, so rows of
  // a tile at +512 are read with the pattern of row r + 4, where the threads wrote row r's: every
  // row's chunk c is read from chunk c ^ 4, i.e. k is read as k ^ 32 (HOPPER.md section 1b).
  const Matrix a(64, 64, small_integers(64 * 64, 5)), b(64, 64, small_integers(64 * 64, 6));
  const auto reference = [&](int m, int n) { return dot_abt(a, b, m, n); };
  std::string first;

  // The control: the same hand-written tiles, aligned, give the exact product, so every
  // mismatch below comes from the displacement alone.
  const int aligned_wrong = count_mismatches(qk_by_hand(a, b, 0, 0), 64, reference, first);
  CHECK_MESSAGE(aligned_wrong == 0, "aligned: " << first);

  // B alone at +512: the check against the reference catches it (almost every element is wrong;
  // a few match by chance). The result is exactly A B'^T with B'[n][k] = B[n][k ^ 32], which pins
  // the explanation above.
  const std::vector<float> b_shifted = qk_by_hand(a, b, 0, 512);
  const int wrong = count_mismatches(b_shifted, 64, reference, first);
  MESSAGE("B at +512: " << wrong << " of 4096 elements differ from the reference");
  CHECK(wrong > 0);
  const auto k_xor_32 = [&](int m, int n) {
    double sum = 0;
    for (int k = 0; k < 64; ++k) sum += double(a.at(m, k)) * b.at(n, k ^ 32);
    return sum;
  };
  const int unexplained = count_mismatches(b_shifted, 64, k_xor_32, first);
  CHECK_MESSAGE(unexplained == 0, "B at +512, against A B'^T: " << first);

  // A and B both at +512: both are read with k as k ^ 32, the same permutation of the dot
  // product's terms, so the result is exact and no comparison with a reference can catch it.
  // A kernel's test passing does not prove its tiles aligned: the chapter aligns them by
  // construction (dynamic shared memory rounded up to 1024 bytes, tiles a multiple of 1024 apart).
  const int both_wrong = count_mismatches(qk_by_hand(a, b, 512, 512), 64, reference, first);
  CHECK_MESSAGE(both_wrong == 0, "A and B at +512: " << first);
}

int main(int argc, char** argv) { return attn::test::gpu_test_main(argc, argv, 90, 90); }
