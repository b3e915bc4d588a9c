// Element types of the tensors a chapter reads and writes in device memory. The log-sum-exp is
// always float. Used by every kind of chapter, so it lives apart from any one interface.
#pragma once

#include <cstddef>

namespace attn {

// kE4M3: FP8 with 4 exponent and 3 mantissa bits (host_data.h), for inputs only: a chapter that
// reads it writes bf16 (ForwardChapter::output_dtype), and its inputs come with scales.
enum class DType { kF32, kBF16, kE4M3 };

inline size_t dtype_size(DType dtype) {
  return dtype == DType::kF32 ? 4 : dtype == DType::kBF16 ? 2 : 1;
}
inline const char* dtype_name(DType dtype) {
  return dtype == DType::kF32 ? "fp32" : dtype == DType::kBF16 ? "bf16" : "e4m3";
}

// How an FP8 input's scale is chosen: one for the whole tensor, or one per (batch, key/value
// head) group (FlashAttention-3's descale granularity; a query head takes its group's). Either way
// a scale maps the largest magnitude it covers to e4m3's largest, 448.
enum class Fp8Scaling { kPerTensor, kPerHead };
inline const char* fp8_scaling_name(Fp8Scaling s) {
  return s == Fp8Scaling::kPerTensor ? "per-tensor" : "per-head";
}

}  // namespace attn
