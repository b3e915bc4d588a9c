#include "host_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "cuda_check.h"

namespace attn {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

namespace {

// Uniform in (0, 1]: never 0, so the logarithm below is finite.
double uniform_open(uint64_t bits) {
  return (double(bits >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

}  // namespace

void fill_normal(float* values, size_t count, uint64_t seed, uint64_t stream, float stddev,
                 size_t first_index) {
  const uint64_t base = splitmix64(seed * 0x100000001B3ull + stream);
  constexpr double kTwoPi = 6.283185307179586;
  // Elements come in pairs (2 p, 2 p + 1) that share their two uniforms; pair p depends only on
  // (base, p), so any range of elements can be made, by all cores at once.
  const size_t first_pair = first_index / 2, end_pair = (first_index + count + 1) / 2;
  auto fill_pairs = [&](size_t first, size_t last) {
    for (size_t p = first; p < last; ++p) {
      // Box-Muller: two independent uniforms give two independent normals.
      const double u1 = uniform_open(splitmix64(base + 4 * p));
      const double u2 = uniform_open(splitmix64(base + 4 * p + 1));
      const double radius = std::sqrt(-2.0 * std::log(u1));
      const size_t even = 2 * p, odd = 2 * p + 1;  // element indices of the stream
      if (even >= first_index && even < first_index + count)
        values[even - first_index] = float(stddev * radius * std::cos(kTwoPi * u2));
      if (odd >= first_index && odd < first_index + count)
        values[odd - first_index] = float(stddev * radius * std::sin(kTwoPi * u2));
    }
  };
  const size_t pairs = end_pair - first_pair;
  const size_t workers =
      std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), pairs / (1 << 16)));
  if (workers == 1) return fill_pairs(first_pair, end_pair);
  std::vector<std::thread> pool;
  for (size_t w = 0; w < workers; ++w)
    pool.emplace_back(fill_pairs, first_pair + pairs * w / workers,
                      first_pair + pairs * (w + 1) / workers);
  for (auto& t : pool) t.join();
}

void fill_normal(std::vector<float>& values, uint64_t seed, uint64_t stream, float stddev) {
  fill_normal(values.data(), values.size(), seed, stream, stddev, 0);
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

uint8_t float_to_e4m3_bits(float value) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return uint8_t(sign | 0x7F);
  const float magnitude = std::fabs(value);
  if (magnitude >= kE4M3Max) return uint8_t(sign | 0x7E);  // saturate (also +-inf)
  // Below 2^-6 the step is 2^-9 everywhere (subnormals, code = multiple of 2^-9; a result of 8 is
  // the smallest normal, whose code is 8 too). nearbyint rounds half to even.
  if (magnitude < 0.015625f) return uint8_t(sign | int(std::nearbyint(magnitude * 512.0f)));
  int exponent;  // magnitude = fraction * 2^exponent, fraction in [0.5, 1)
  const float fraction = std::frexp(magnitude, &exponent);
  int biased = exponent - 1 + 7;                                        // of 1.m x 2^(exponent - 1)
  int mantissa = int(std::nearbyint((fraction * 2.0f - 1.0f) * 8.0f));  // 0..8, halves to even
  if (mantissa == 8) mantissa = 0, ++biased;                            // rounded up to 2^(e + 1)
  if (biased > 15 || (biased == 15 && mantissa == 7)) return uint8_t(sign | 0x7E);  // past 448
  return uint8_t(sign | (biased << 3) | mantissa);
}

float e4m3_bits_to_float(uint8_t bits) {
  const int biased = (bits >> 3) & 0xF, mantissa = bits & 7;
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (biased == 15 && mantissa == 7) return NAN;
  if (biased == 0) return sign * std::ldexp(float(mantissa), -9);
  return sign * std::ldexp(1.0f + mantissa / 8.0f, biased - 7);
}

float round_to_e4m3(float value) { return e4m3_bits_to_float(float_to_e4m3_bits(value)); }

void make_input(float* out, size_t count, size_t first, DType dtype, uint64_t seed, uint64_t stream,
                float stddev) {
  fill_normal(out, count, seed, stream, stddev, first);
  if (dtype == DType::kBF16)
    for (size_t i = 0; i < count; ++i) out[i] = round_to_bf16(out[i]);
}

void upload_input(DeviceTensor& tensor, DType dtype, uint64_t seed, uint64_t stream, float stddev) {
  std::vector<float> piece(std::min(kInputPieceElements, tensor.count()));
  for (size_t first = 0; first < tensor.count(); first += piece.size()) {
    const size_t count = std::min(piece.size(), tensor.count() - first);
    make_input(piece.data(), count, first, dtype, seed, stream, stddev);
    tensor.upload(piece.data(), count, first);
  }
}

DeviceTensor::DeviceTensor(DType dtype, size_t count)
    : dtype_(dtype), count_(count), bytes_(count * dtype_size(dtype)) {}

void DeviceTensor::upload(const float* values, size_t count, size_t offset) {
  unsigned char* dst = static_cast<unsigned char*>(data()) + offset * dtype_size(dtype_);
  if (dtype_ == DType::kF32) {
    CUDA_CHECK(cudaMemcpy(dst, values, count * sizeof(float), cudaMemcpyHostToDevice));
    return;
  }
  if (dtype_ == DType::kE4M3) {
    std::vector<uint8_t> bits(count);
    for (size_t i = 0; i < count; ++i) bits[i] = float_to_e4m3_bits(values[i]);
    CUDA_CHECK(cudaMemcpy(dst, bits.data(), count, cudaMemcpyHostToDevice));
    return;
  }
  std::vector<uint16_t> bits(count);
  for (size_t i = 0; i < count; ++i) bits[i] = float_to_bf16_bits(values[i]);
  CUDA_CHECK(cudaMemcpy(dst, bits.data(), count * sizeof(uint16_t), cudaMemcpyHostToDevice));
}

std::vector<float> DeviceTensor::download(size_t offset, size_t count) const {
  const unsigned char* src =
      static_cast<const unsigned char*>(data()) + offset * dtype_size(dtype_);
  std::vector<float> values(count);
  if (dtype_ == DType::kF32) {
    CUDA_CHECK(cudaMemcpy(values.data(), src, count * sizeof(float), cudaMemcpyDeviceToHost));
    return values;
  }
  if (dtype_ == DType::kE4M3) {
    std::vector<uint8_t> bits(count);
    CUDA_CHECK(cudaMemcpy(bits.data(), src, count, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; ++i) values[i] = e4m3_bits_to_float(bits[i]);
    return values;
  }
  std::vector<uint16_t> bits(count);
  CUDA_CHECK(cudaMemcpy(bits.data(), src, count * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < count; ++i) values[i] = bf16_bits_to_float(bits[i]);
  return values;
}

void DeviceTensor::poison() {
  // 0xFF bytes are a NaN in fp32, bf16 and e4m3 alike.
  CUDA_CHECK(cudaMemset(data(), 0xFF, bytes()));
}

}  // namespace attn
