#include "forward_inputs.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace attn {
namespace {

uint64_t stream_of(ForwardTensor t) {
  return t == ForwardTensor::kQ ? kStreamQ : t == ForwardTensor::kK ? kStreamK : kStreamV;
}

bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Inputs are made in pieces of about kInputPieceElements, in whole rows: a row lies in one group,
// and the rotation needs all of it.
size_t piece_elements(size_t head_dim) {
  return std::max(head_dim, kInputPieceElements / head_dim * head_dim);
}

}  // namespace

std::string validate_inputs(const AttentionShape& shape, const InputOptions& options) {
  if (!(options.outliers > 0.0f) || !std::isfinite(options.outliers))
    return "--outliers must be a positive number.";
  if (!std::isfinite(options.qk_offset)) return "--qk-offset must be a finite number.";
  if (options.hadamard && !power_of_two(shape.head_dim))
    return "--hadamard needs a head_dim that is a power of two.";
  return "";
}

void hadamard_rotate_rows(float* rows, size_t count, int n) {
  const float norm = 1.0f / std::sqrt(float(n));
  for (float* row = rows; row < rows + count; row += n) {
    for (int half = 1; half < n; half *= 2)  // butterflies of distance half
      for (int i = 0; i < n; i += 2 * half)
        for (int j = i; j < i + half; ++j) {
          const float a = row[j], b = row[j + half];
          row[j] = a + b;
          row[j + half] = a - b;
        }
    for (int j = 0; j < n; ++j) row[j] *= norm;
  }
}

ForwardInputs::ForwardInputs(const AttentionShape& shape, const InputOptions& options, DType dtype)
    : shape_(shape), options_(options), dtype_(dtype) {
  if (dtype != DType::kE4M3) return;
  const size_t groups = size_t(shape.batch) * shape.heads_kv, d = shape.head_dim;
  const size_t piece = piece_elements(d);
  std::vector<float> values;
  for (int t = 0; t < 3; ++t) {
    const ForwardTensor tensor = ForwardTensor(t);
    std::vector<float> amax(groups, 0.0f);
    for (size_t first = 0; first < elements(tensor); first += piece) {
      const size_t count = std::min(piece, elements(tensor) - first);
      values.resize(count);
      make_unrounded(tensor, values.data(), count, first);
      for (size_t i = 0; i < count; i += d) {  // a row lies in one group
        float& m = amax[group_of(tensor, first + i)];
        for (size_t c = 0; c < d; ++c) m = std::max(m, std::fabs(values[i + c]));
      }
    }
    if (options.fp8_scaling == Fp8Scaling::kPerTensor)
      std::fill(amax.begin(), amax.end(), *std::max_element(amax.begin(), amax.end()));
    for (float m : amax) {
      // amax maps to 448. A group of zeros keeps the scale 1 (any scale would do).
      descale_[t].push_back(m > 0.0f ? m / kE4M3Max : 1.0f);
      inverse_[t].push_back(m > 0.0f ? kE4M3Max / m : 1.0f);
    }
  }
}

size_t ForwardInputs::elements(ForwardTensor t) const {
  return size_t(t == ForwardTensor::kQ ? shape_.q_elements() : shape_.kv_elements());
}

size_t ForwardInputs::group_of(ForwardTensor t, size_t i) const {
  const size_t d = shape_.head_dim;
  if (t != ForwardTensor::kQ) return i / (size_t(shape_.seqlen_k) * d);
  const size_t q_head = i / (size_t(shape_.seqlen_q) * d);  // batch * heads_q + head
  const size_t batch = q_head / shape_.heads_q, head = q_head % shape_.heads_q;
  return batch * shape_.heads_kv + head / shape_.group_size();
}

void ForwardInputs::make_unrounded(ForwardTensor t, float* out, size_t count, size_t first) const {
  const float stddev = t == ForwardTensor::kQ ? options_.q_scale : 1.0f;
  fill_normal(out, count, options_.seed, stream_of(t), stddev, first);
  if (t == ForwardTensor::kV) return;
  const int d = shape_.head_dim;
  if (options_.qk_offset != 0.0f) {
    const float offset = t == ForwardTensor::kQ ? options_.qk_offset : -options_.qk_offset;
    for (size_t i = 0; i < count; ++i) out[i] += offset;
  }
  if (options_.outliers != 1.0f) {
    const int channels[2] = {7, d / 2 + 7};
    for (size_t row = 0; row < count; row += d) {
      if (group_of(t, first + row) % shape_.heads_kv % 4 != 0) continue;
      for (int c : channels)
        if (c < d) out[row + c] *= options_.outliers;
    }
  }
  if (options_.hadamard) hadamard_rotate_rows(out, count, d);
}

void ForwardInputs::round(ForwardTensor t, float* values, size_t count, size_t first,
                          bool stored) const {
  if (dtype_ == DType::kBF16) {
    for (size_t i = 0; i < count; ++i) values[i] = round_to_bf16(values[i]);
  } else if (dtype_ == DType::kE4M3) {
    const int k = int(t);
    const size_t d = shape_.head_dim;
    for (size_t row = 0; row < count; row += d) {
      const size_t group = group_of(t, first + row);
      const float inverse = inverse_[k][group], descale = stored ? 1.0f : descale_[k][group];
      for (size_t c = row; c < row + d; ++c)
        values[c] = round_to_e4m3(values[c] * inverse) * descale;
    }
  }
}

void ForwardInputs::upload(ForwardTensor t, DeviceTensor& tensor) const {
  const size_t d = shape_.head_dim;
  std::vector<float> piece(std::min(tensor.count(), piece_elements(d)));
  for (size_t first = 0; first < tensor.count(); first += piece.size()) {
    const size_t count = std::min(piece.size(), tensor.count() - first);
    make_unrounded(t, piece.data(), count, first);
    round(t, piece.data(), count, first, /*stored=*/true);
    tensor.upload(piece.data(), count, first);
  }
}

}  // namespace attn
