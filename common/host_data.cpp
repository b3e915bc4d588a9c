#include "host_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "cuda_check.h"

namespace attn {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1]: never 0, so the logarithm below is finite.
double uniform_open(uint64_t bits) {
  return (double(bits >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

}  // namespace

void fill_normal(std::vector<float>& values, uint64_t seed, uint64_t stream, float stddev) {
  const uint64_t base = splitmix64(seed * 0x100000001B3ull + stream);
  constexpr double kTwoPi = 6.283185307179586;
  // Pair i depends only on (base, i), so the pairs can be filled by all cores at once.
  const size_t pairs = (values.size() + 1) / 2;
  auto fill_pairs = [&](size_t first, size_t last) {
    for (size_t p = first; p < last; ++p) {
      const size_t i = 2 * p;
      // Box-Muller: two independent uniforms give two independent normals.
      double u1 = uniform_open(splitmix64(base + 2 * i));
      double u2 = uniform_open(splitmix64(base + 2 * i + 1));
      double radius = std::sqrt(-2.0 * std::log(u1));
      values[i] = float(stddev * radius * std::cos(kTwoPi * u2));
      if (i + 1 < values.size()) values[i + 1] = float(stddev * radius * std::sin(kTwoPi * u2));
    }
  };
  const size_t workers =
      std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), pairs / (1 << 16)));
  std::vector<std::thread> pool;
  for (size_t w = 0; w < workers; ++w)
    pool.emplace_back(fill_pairs, pairs * w / workers, pairs * (w + 1) / workers);
  for (auto& t : pool) t.join();
}

uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if (std::isnan(value)) return uint16_t((bits >> 16) | 0x40);  // stay a (quiet) NaN
  uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);              // round half to even
  return uint16_t((bits + rounding) >> 16);
}

float bf16_bits_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

float round_to_bf16(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

void round_to_bf16(std::vector<float>& values) {
  for (float& v : values) v = round_to_bf16(v);
}

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
const char* dtype_name(DType dtype) { return dtype == DType::kF32 ? "fp32" : "bf16"; }

DeviceTensor::DeviceTensor(DType dtype, size_t count)
    : dtype_(dtype), count_(count), bytes_(count * dtype_size(dtype)) {}

void DeviceTensor::upload(const std::vector<float>& values) {
  if (dtype_ == DType::kF32) {
    CUDA_CHECK(cudaMemcpy(data(), values.data(), bytes(), cudaMemcpyHostToDevice));
    return;
  }
  std::vector<uint16_t> bits(count_);
  for (size_t i = 0; i < count_; ++i) bits[i] = float_to_bf16_bits(values[i]);
  CUDA_CHECK(cudaMemcpy(data(), bits.data(), bytes(), cudaMemcpyHostToDevice));
}

std::vector<float> DeviceTensor::download() const {
  std::vector<float> values(count_);
  if (dtype_ == DType::kF32) {
    CUDA_CHECK(cudaMemcpy(values.data(), data(), bytes(), cudaMemcpyDeviceToHost));
    return values;
  }
  std::vector<uint16_t> bits(count_);
  CUDA_CHECK(cudaMemcpy(bits.data(), data(), bytes(), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < count_; ++i) values[i] = bf16_bits_to_float(bits[i]);
  return values;
}

void DeviceTensor::poison() {
  // 0xFF bytes are a NaN in both fp32 and bf16.
  CUDA_CHECK(cudaMemset(data(), 0xFF, bytes()));
}

}  // namespace attn
