// Comparing a kernel's output with the reference, and the tolerance rules per element type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "chapter_api.h"

namespace attn {

struct Tolerance {
  double max_rel_norm = 0;  // ||out - ref||_2 / max(||ref||_2, norm_floor) may not exceed this
  double atol = 0;          // and every element: |out - ref| <= atol + rtol * |ref|
  double rtol = 0;
  std::string rule;  // the rule in words, for the report
  double norm_floor = 0;
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
// The size of a backward run's gradients: the largest element and the largest root-mean-square
// of dQ, dK and dV (of the reference, over the checked groups).
struct GradientScale {
  double max_abs = 0;
  double rms = 0;
};
// A gradient can be 0 by cancellation: with one key, P = 1 and dS = P (dP - D) = dP - D, which is 0
// in exact arithmetic, while float computes dP and D = rowsum(dO * O) in different orders and
// leaves a residue of about 1e-7 of each. Against an exact 0 any residue is an infinite relative
// error, so a gradient's errors are measured against the size of the run's gradients as well as
// its own: element-wise against the largest element of the three, norm-wise against
// max(||ref||, scale.rms * sqrt(elements)), the norm the gradient would have at the largest RMS.
// fp32: float's rule as for O (1e-5, widened for large logits).
Tolerance fp32_gradient_tolerance(double max_abs_logit, const GradientScale& scale,
                                  size_t elements);
// bf16: the FlashAttention test rule, as for O, on the same norm floor.
Tolerance bf16_gradient_tolerance(double plain_bf16_max_abs_err, const GradientScale& scale,
                                  size_t elements);
// O of a bf16 chapter: at most twice the largest error that a plain bf16 implementation makes on
// the same rounded inputs (plus 1e-5), the rule of the FlashAttention tests; and whatever that
// gives, a norm-wise relative error under 1e-2.
Tolerance bf16_output_tolerance(double plain_bf16_max_abs_err);
// Twice a plain implementation's error: |err| <= 2 x its largest error + 1e-5, and norm-wise at
// most 2 x its norm-wise error + 1e-3. O of an FP8 chapter against the reference from the
// dequantised inputs, with the plain FP8 implementation of RefPrecision::kPlainFp8 (its error is
// P's rounding to e4m3 and the tensor cores' short accumulation of S and of P V): the chapter's own
// error. And O of a bf16 or FP8 chapter against the reference from the unrounded inputs, where the
// plain implementation's error includes the inputs' rounding: what a user sees. `plain` and
// `against` name the two for the report.
Tolerance twice_plain_tolerance(const char* plain, double plain_max_abs_err, double plain_rel_err,
                                const char* against);
// The LSE the same way: a chapter's own LSE tolerance widened by twice the plain implementation's
// largest and norm-wise errors.
Tolerance widened_lse_tolerance(const Tolerance& own, double plain_max_abs_err,
                                double plain_rel_err);
// The largest |a[i] - b[i]| where b[i] is finite (a row's lse of -inf is matched exactly
// elsewhere): a plain bf16 implementation's error against the reference, which sets the bf16
// tolerances.
double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b);
// ||a - b|| / ||b|| over the elements where b is finite: the norm-wise error of a against b.
double relative_difference(const std::vector<double>& a, const std::vector<double>& b);

// FNV-1a over the bits of the values: equal checksums mean (all but surely) equal outputs, so a
// test can ask that two runs gave the same bits without keeping both.
uint64_t checksum(const std::vector<float>& values);

// The log-sum-exp is computed in float in every chapter (from bf16 inputs the products are exact),
// so it gets float's rule whatever the element type; bf16 and FP8 chapters get 10x the room for
// their faster exp2 approximation (FP8's scores carry the tensor cores' accumulation error too:
// the runner widens this by the plain FP8 implementation's, widened_lse_tolerance).
Tolerance lse_tolerance(DType dtype, double max_abs_logit);

}  // namespace attn
