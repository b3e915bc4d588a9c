// The merge rule of the online softmax, as a small host function in double. Chapter 03 derives it
// and every later chapter runs the same rule in its own device code; here it is the host's
// statement of the rule, which tests/cpu checks against a direct softmax.
//
// A partial state summarises a row's softmax over some subset of its keys:
//   max = m = max_j s_j,   sum = l = sum_j exp(s_j - m),   acc = sum_j exp(s_j - m) * v_j
// Two states over disjoint subsets merge into the state over their union:
//   m = max(m_a, m_b),  l = l_a exp(m_a - m) + l_b exp(m_b - m),  acc likewise.
// The finished row is acc / l, and its log-sum-exp is m + log(l).
#pragma once

#include <cmath>
#include <limits>
#include <vector>

namespace attn {

struct SoftmaxPartial {
  double max = -std::numeric_limits<double>::infinity();  // no key seen yet
  double sum = 0;
  std::vector<double> acc;  // unnormalised output row (may stay empty for a softmax alone)
};

// exp(a - m) where m = max(a, b): 0 for a side that has seen no key, instead of exp(-inf + inf).
inline double merge_factor(double side_max, double merged_max) {
  return side_max == -std::numeric_limits<double>::infinity() ? 0.0
                                                              : std::exp(side_max - merged_max);
}

inline SoftmaxPartial merge(const SoftmaxPartial& a, const SoftmaxPartial& b) {
  SoftmaxPartial out;
  out.max = std::max(a.max, b.max);
  const double fa = merge_factor(a.max, out.max), fb = merge_factor(b.max, out.max);
  out.sum = a.sum * fa + b.sum * fb;
  out.acc.resize(std::max(a.acc.size(), b.acc.size()), 0.0);
  for (size_t i = 0; i < out.acc.size(); ++i)
    out.acc[i] =
        (i < a.acc.size() ? a.acc[i] * fa : 0.0) + (i < b.acc.size() ? b.acc[i] * fb : 0.0);
  return out;
}

// The state of one key with logit s and value row v. A masked key (s = -inf) adds nothing: its
// state is the empty one, with a zero accumulator.
inline SoftmaxPartial single_key(double s, const std::vector<double>& v) {
  if (s == -std::numeric_limits<double>::infinity())
    return SoftmaxPartial{s, 0.0, std::vector<double>(v.size(), 0.0)};
  return SoftmaxPartial{s, 1.0, v};
}

// Log-sum-exp of the merged row: -inf when it saw no key.
inline double log_sum_exp(const SoftmaxPartial& state) {
  return state.sum > 0 ? state.max + std::log(state.sum) : -std::numeric_limits<double>::infinity();
}

// The output row acc / l, or zeros for a row that saw no key.
inline std::vector<double> finish(const SoftmaxPartial& state) {
  std::vector<double> out(state.acc.size(), 0.0);
  if (state.sum > 0)
    for (size_t i = 0; i < out.size(); ++i) out[i] = state.acc[i] / state.sum;
  return out;
}

}  // namespace attn
