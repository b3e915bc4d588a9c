// The forward runner's inputs. Q ~ Normal(0, q_scale), K and V ~ Normal(0, 1), each drawn from
// its own stream of the seed (host_data.h), optionally with an offset, outlier channels and a
// Hadamard rotation of Q and K, then rounded to what the chapter reads: bf16, or FP8 e4m3 with a
// scale per tensor or per (batch, key/value head). The check makes any piece again, rounded as
// uploaded or not rounded at all (the reference of what a user of the unrounded inputs would
// expect).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "host_data.h"
#include "shape.h"

namespace attn {

enum class ForwardTensor { kQ = 0, kK = 1, kV = 2 };

struct InputOptions {
  uint64_t seed = 1234;
  float q_scale = 1.0f;
  // Outlier channels, as activations of trained models have (a few channels of Q and K far
  // larger than the rest): channels 7 and head_dim / 2 + 7 of every fourth key/value head (0, 4,
  // ...), and of the query heads that read it, multiplied by this. 1: none.
  float outliers = 1.0f;
  // Each row of Q and K multiplied by the normalised Hadamard matrix H / sqrt(head_dim) (head_dim a
  // power of two): H H^T / head_dim = I, so Q K^T is unchanged, while an outlier channel is spread
  // over all of them (QuaRot's and FlashAttention-3's "incoherent processing").
  bool hadamard = false;
  // Q's elements drawn around +qk_offset and K's around -qk_offset (before the outliers and the
  // rotation): a score q . k then lies near -qk_offset^2 head_dim, with a spread of about
  // sqrt(2 head_dim) at 1. At 1 and head_dim 128 practically every score is below zero (at 64 a few
  // in a million are not): rows whose maximum is negative. 0: none.
  float qk_offset = 0.0f;
  Fp8Scaling fp8_scaling = Fp8Scaling::kPerHead;
};

// One sentence if the options do not fit the shape (the rotation needs a power-of-two head_dim,
// the outlier factor must be positive and finite, the offset finite), else "".
std::string validate_inputs(const AttentionShape& shape, const InputOptions& options);

// Rotates each row of `rows` (count / n rows of n values, n a power of two) by H / sqrt(n), H the
// Sylvester-Hadamard matrix (H[i][j] = (-1)^popcount(i & j)), with the fast Walsh-Hadamard
// transform: n log2(n) additions per row.
void hadamard_rotate_rows(float* rows, size_t count, int n);

class ForwardInputs {
 public:
  // For FP8 this measures every input's largest magnitude per group: a pass over all of Q, K, V.
  ForwardInputs(const AttentionShape& shape, const InputOptions& options, DType dtype);

  size_t elements(ForwardTensor t) const;
  // The flat group (batch * heads_kv + key/value head) that element i of tensor t belongs to.
  size_t group_of(ForwardTensor t, size_t i) const;
  // Elements [first, first + count) as drawn, outliers and rotation included, before any
  // rounding. first and count are multiples of head_dim (whole rows).
  void make_unrounded(ForwardTensor t, float* out, size_t count, size_t first) const;
  // Rounds made values in place to what the chapter reads: for bf16 the bf16 value; for FP8 the
  // stored e4m3 number (stored = true, what is uploaded) or that number times its descale (the
  // value the chapter computes with).
  void round(ForwardTensor t, float* values, size_t count, size_t first, bool stored) const;
  // The whole tensor, made, rounded and uploaded in pieces of whole rows.
  void upload(ForwardTensor t, DeviceTensor& tensor) const;
  // FP8: the descale of every group (batch * heads_kv), equal for per-tensor scaling. Empty else.
  const std::vector<float>& descales(ForwardTensor t) const { return descale_[int(t)]; }

 private:
  AttentionShape shape_;
  InputOptions options_;
  DType dtype_;
  std::vector<float> descale_[3],
      inverse_[3];  // inverse: 448 / amax, what quantising multiplies by
};

}  // namespace attn
