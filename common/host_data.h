// Host-side data: deterministic random inputs, bf16 rounding, NaN poisoning, and the copies
// between host float vectors and device buffers of either element type.
#pragma once

#include <cstdint>
#include <vector>

#include "dtype.h"
#include "device_buffer.h"

namespace attn {

// A counter-based generator's step (Steele, Lea and Flood's SplitMix64): well-mixed 64 bits from
// any 64-bit counter, the same on every machine.
uint64_t splitmix64(uint64_t x);

// Normal(0, stddev) samples from a counter-based generator: the same numbers on every machine and
// standard library for a given seed and stream (std::normal_distribution differs between them).
// Element i of a stream depends on (seed, stream, i) alone, so a tensor can be made piece by
// piece: values[j] gets element first_index + j.
void fill_normal(float* values, size_t count, uint64_t seed, uint64_t stream, float stddev,
                 size_t first_index = 0);
void fill_normal(std::vector<float>& values, uint64_t seed, uint64_t stream, float stddev);

// bf16 keeps float's 8 exponent bits and 7 of its 23 mantissa bits; round to nearest even.
uint16_t float_to_bf16_bits(float value);
float bf16_bits_to_float(uint16_t bits);
float round_to_bf16(float value);
void round_to_bf16(std::vector<float>& values);

// FP8 e4m3 (the OCP "E4M3FN" format of Hopper's FP8 tensor cores): 1 sign bit, 4 exponent bits
// (bias 7), 3 mantissa bits; no infinities, NaN only as S.1111.111. The largest finite magnitude
// is 448 (S.1111.110), the smallest normal 2^-6, the smallest subnormal 2^-9. Conversion rounds to
// nearest even and saturates to +-448, as cvt.rn.satfinite does; NaN stays NaN.
constexpr float kE4M3Max = 448.0f;
uint8_t float_to_e4m3_bits(float value);
float e4m3_bits_to_float(uint8_t bits);
float round_to_e4m3(float value);

// The random inputs of every kind of run. Each tensor draws from its own stream of the seed, so a
// run can make any piece of any input again (the check does, for the heads it compares).
enum InputStream : uint64_t {
  kStreamQ = 0,
  kStreamK = 1,
  kStreamV = 2,
  kStreamDOut = 3,
  kStreamLengths = 4,  // decode: the lengths of a seeded spread
  kStreamPages = 5,    // decode: the shuffled order of a paged cache's pool
};
// Inputs are made and uploaded this many elements at a time (32 MB of float), so the host never
// holds a whole tensor: a problem that fits the GPU does not need the same again in host memory.
constexpr size_t kInputPieceElements = size_t(1) << 23;

class DeviceTensor;
// Elements [first, first + count) of an input stream, Normal(0, stddev), rounded to `dtype`.
void make_input(float* out, size_t count, size_t first, DType dtype, uint64_t seed, uint64_t stream,
                float stddev);
// The whole tensor, made and uploaded piece by piece.
void upload_input(DeviceTensor& tensor, DType dtype, uint64_t seed, uint64_t stream, float stddev);
// Host bytes upload_input holds at once for a tensor of `elements` (the float piece and its bf16
// copy), with room for either element type.
inline size_t input_piece_host_bytes(size_t elements) {
  return 6 * (elements < kInputPieceElements ? elements : kInputPieceElements);
}

// A device tensor stored in `dtype`, built from exactly the host values given (which must already
// be representable: call round_to_bf16 or round_to_e4m3 first), or read back as float.
class DeviceTensor {
 public:
  DeviceTensor(DType dtype, size_t count);
  void upload(const std::vector<float>& values) { upload(values.data(), values.size(), 0); }
  // Elements [offset, offset + count).
  void upload(const float* values, size_t count, size_t offset);
  std::vector<float> download() const { return download(0, count_); }
  std::vector<float> download(size_t offset, size_t count) const;
  void poison();  // fill with NaN, so an element the kernel never writes fails the check
  void* data() const { return bytes_.get(); }
  size_t count() const { return count_; }
  size_t bytes() const { return bytes_.bytes(); }

 private:
  DType dtype_;
  size_t count_;
  DeviceBuffer<unsigned char> bytes_;
};

}  // namespace attn
