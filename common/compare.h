// Comparing a kernel's output with the reference, and the tolerance rules per element type.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "chapter_api.h"

namespace attn {

struct Tolerance {
  double max_rel_norm = 0;  // ||out - ref||_2 / ||ref||_2 may not exceed this
  double atol = 0;          // and every element: |out - ref| <= atol + rtol * |ref|
  double rtol = 0;
  std::string rule;  // the rule in words, for the report
};

struct Comparison {
  size_t count = 0;
  size_t failed = 0;     // elements outside atol + rtol * |ref| (NaN and Inf included)
  size_t nonfinite = 0;  // NaN anywhere, or Inf where the reference is finite
  double max_abs_err = 0;
  double rel_err = 0;                   // norm-wise
  std::vector<std::string> mismatches;  // the first few failures, with their position
  bool passed = false;
};

// `where(i)` names element i for the mismatch list (e.g. "o[b=0 h=3 i=17 d=5]"). A reference
// value of -inf (the log-sum-exp of a row that sees no key) must be matched exactly.
Comparison compare(const std::vector<float>& out, const std::vector<double>& ref,
                   const Tolerance& tolerance, const std::function<std::string(size_t)>& where);

// O of an fp32 chapter. float rounds each step to about 6e-8 relative; over a dot product of
// head_dim terms and a softmax over seqlen_k terms that stays well under 1e-6 for logits of order
// one, hence 1e-5 with margin. A logit error becomes a relative error of the same size in exp(),
// and the logits' rounding error grows with their size, so the bound grows with max|logit| / 16.
Tolerance fp32_output_tolerance(double max_abs_logit);
// O of a bf16 chapter: at most twice the largest error that a plain bf16 implementation makes on
// the same rounded inputs (plus 1e-5), the rule of the FlashAttention tests; and whatever that
// gives, a norm-wise relative error under 1e-2.
Tolerance bf16_output_tolerance(double plain_bf16_max_abs_err);
// The log-sum-exp is computed in float in every chapter (from bf16 inputs the products are exact),
// so it gets float's rule whatever the element type; bf16 chapters get 10x the room for their
// faster exp2 approximation.
Tolerance lse_tolerance(DType dtype, double max_abs_logit);

}  // namespace attn
