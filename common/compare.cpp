#include "compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

namespace attn {

Comparison compare(const std::vector<float>& out, const std::vector<double>& ref,
                   const Tolerance& tolerance, const std::function<std::string(size_t)>& where) {
  constexpr size_t kMismatchesShown = 5;
  Comparison c;
  c.count = ref.size();
  double err_sq = 0, ref_sq = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = out[i], r = ref[i];
    double err;
    bool ok;
    if (std::isinf(r) && r < 0) {  // a row that sees no key: log-sum-exp must be -inf
      err = (std::isinf(o) && o < 0) ? 0.0 : INFINITY;
      ok = err == 0.0;
      if (std::isnan(o)) ++c.nonfinite;
    } else {
      err = std::abs(o - r);
      if (!std::isfinite(o)) ++c.nonfinite;
      ok = std::isfinite(o) && err <= tolerance.atol + tolerance.rtol * std::abs(r);
      err_sq += err * err;
      ref_sq += r * r;
    }
    if (!std::isfinite(err)) err = INFINITY;
    c.max_abs_err = std::max(c.max_abs_err, err);
    if (!ok) {
      ++c.failed;
      if (c.mismatches.size() < kMismatchesShown) {
        std::ostringstream s;
        s << where(i) << " = " << o << ", expected " << r;
        c.mismatches.push_back(s.str());
      }
    }
  }
  const double ref_norm = std::max(std::sqrt(ref_sq), tolerance.norm_floor);
  c.rel_err =
      c.nonfinite ? INFINITY : (ref_norm > 0 ? std::sqrt(err_sq) / ref_norm : std::sqrt(err_sq));
  c.passed = c.failed == 0 && c.rel_err <= tolerance.max_rel_norm;
  return c;
}

namespace {
double logit_factor(double max_abs_logit) { return std::max(1.0, max_abs_logit / 16.0); }
std::string format_rule(const char* prefix, const Tolerance& t) {
  std::ostringstream s;
  s.precision(2);
  s << prefix << " rel <= " << t.max_rel_norm << ", |err| <= " << t.atol << " + " << t.rtol
    << "*|ref|";
  return s.str();
}
}  // namespace

Tolerance fp32_output_tolerance(double max_abs_logit) {
  const double f = logit_factor(max_abs_logit);
  Tolerance t{1e-5 * f, 1e-5 * f, 1e-4 * f, ""};
  t.rule = format_rule("fp32:", t);
  return t;
}

Tolerance fp32_gradient_tolerance(double max_abs_logit, const GradientScale& scale,
                                  size_t elements) {
  const double f = logit_factor(max_abs_logit);
  Tolerance t{1e-5 * f, 1e-5 * f * scale.max_abs, 1e-4 * f, ""};
  t.norm_floor = scale.rms * std::sqrt(double(elements));
  std::ostringstream s;
  s.precision(2);
  s << "fp32: rel <= " << t.max_rel_norm << ", |err| <= " << 1e-5 * f << "*max|grad| + " << t.rtol
    << "*|ref|";
  t.rule = s.str();
  return t;
}

Tolerance bf16_gradient_tolerance(double plain_bf16_max_abs_err, const GradientScale& scale,
                                  size_t elements) {
  Tolerance t = bf16_output_tolerance(plain_bf16_max_abs_err);
  t.norm_floor = scale.rms * std::sqrt(double(elements));
  return t;
}

double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double err_sq = 0, ref_sq = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::isfinite(b[i])) err_sq += (a[i] - b[i]) * (a[i] - b[i]), ref_sq += b[i] * b[i];
  return ref_sq > 0 ? std::sqrt(err_sq / ref_sq) : std::sqrt(err_sq);
}

uint64_t checksum(const std::vector<float>& values) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (float value : values) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    for (int byte = 0; byte < 4; ++byte) {
      hash ^= (bits >> (8 * byte)) & 0xFF;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}

Tolerance bf16_output_tolerance(double plain_bf16_max_abs_err) {
  Tolerance t{1e-2, 2.0 * plain_bf16_max_abs_err + 1e-5, 0.0, ""};
  std::ostringstream s;
  s.precision(2);
  s << "bf16: |err| <= 2 x plain bf16 (" << plain_bf16_max_abs_err << ") + 1e-5, rel <= 1e-2";
  t.rule = s.str();
  return t;
}

Tolerance twice_plain_tolerance(const char* plain, double plain_max_abs_err, double plain_rel_err,
                                const char* against) {
  Tolerance t{2.0 * plain_rel_err + 1e-3, 2.0 * plain_max_abs_err + 1e-5, 0.0, ""};
  std::ostringstream s;
  s.precision(2);
  s << "vs " << against << ": |err| <= 2 x plain " << plain << " (" << plain_max_abs_err
    << ") + 1e-5, rel <= 2 x plain (" << plain_rel_err << ") + 1e-3";
  t.rule = s.str();
  return t;
}

Tolerance widened_lse_tolerance(const Tolerance& own, double plain_max_abs_err,
                                double plain_rel_err) {
  Tolerance t = own;
  t.atol += 2.0 * plain_max_abs_err;
  t.max_rel_norm += 2.0 * plain_rel_err;
  std::ostringstream s;
  s.precision(2);
  s << "lse: |err| <= " << own.atol << " + 2 x plain (" << plain_max_abs_err << ") + " << t.rtol
    << "*|ref|, rel <= " << own.max_rel_norm << " + 2 x plain (" << plain_rel_err << ")";
  t.rule = s.str();
  return t;
}

Tolerance lse_tolerance(DType dtype, double max_abs_logit) {
  const double f = logit_factor(max_abs_logit) * (dtype == DType::kF32 ? 1.0 : 10.0);
  Tolerance t{1e-5 * f, 1e-5 * f, 1e-5 * f, ""};
  t.rule = format_rule("lse:", t);
  return t;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::isfinite(b[i])) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace attn
