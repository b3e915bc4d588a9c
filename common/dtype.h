// Element types of the tensors a chapter reads and writes in device memory. The log-sum-exp is
// always float. Used by every kind of chapter, so it lives apart from any one interface.
#pragma once

#include <cstddef>

namespace attn {

enum class DType { kF32, kBF16 };

inline size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
inline const char* dtype_name(DType dtype) { return dtype == DType::kF32 ? "fp32" : "bf16"; }

}  // namespace attn
