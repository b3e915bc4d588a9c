#include "shape.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

namespace attn {

float AttentionShape::softmax_scale() const {
  return scale != 0.0f ? scale : 1.0f / std::sqrt(float(head_dim));
}

std::string AttentionShape::describe() const {
  std::ostringstream s;
  s << "batch " << batch << ", heads " << heads_q << " (kv " << heads_kv << "), seqlen_q "
    << seqlen_q << ", seqlen_k " << seqlen_k << ", head_dim " << head_dim << ", causal "
    << (causal ? "yes" : "no") << ", scale " << softmax_scale();
  return s.str();
}

AttentionShape make_shape(int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_k,
                          int head_dim, bool causal) {
  AttentionShape shape;
  shape.batch = batch;
  shape.heads_q = heads_q;
  shape.heads_kv = heads_kv;
  shape.seqlen_q = seqlen_q;
  shape.seqlen_k = seqlen_k;
  shape.head_dim = head_dim;
  shape.causal = causal;
  return shape;
}

double forward_flops(const AttentionShape& shape) {
  double flops =
      4.0 * shape.batch * shape.heads_q * double(shape.seqlen_q) * shape.seqlen_k * shape.head_dim;
  return shape.causal ? flops / 2 : flops;
}

double backward_flops(const AttentionShape& shape) { return 2.5 * forward_flops(shape); }

std::string validate(const AttentionShape& shape, const std::vector<int>& supported_head_dims) {
  std::ostringstream why;
  auto positive = [&](const char* name, int value) {
    if (value < 1 && why.str().empty()) why << name << " must be at least 1 (got " << value << ").";
  };
  positive("batch", shape.batch);
  positive("heads_q", shape.heads_q);
  positive("heads_kv", shape.heads_kv);
  positive("seqlen_q", shape.seqlen_q);
  positive("seqlen_k", shape.seqlen_k);
  positive("head_dim", shape.head_dim);
  if (!why.str().empty()) return why.str();

  if (shape.heads_q % shape.heads_kv != 0) {
    why << "heads_q (" << shape.heads_q << ") must be a multiple of heads_kv (" << shape.heads_kv
        << "): each key/value head serves a whole group of query heads.";
    return why.str();
  }
  bool supported = supported_head_dims.empty() ? shape.head_dim <= 256 : false;
  for (int d : supported_head_dims) supported = supported || d == shape.head_dim;
  if (!supported) {
    why << "head_dim " << shape.head_dim << " is not supported by this chapter (supported:";
    if (supported_head_dims.empty()) why << " 1 to 256";
    for (size_t i = 0; i < supported_head_dims.size(); ++i)
      why << (i ? ", " : " ") << supported_head_dims[i];
    why << ").";
    return why.str();
  }
  if (!std::isfinite(shape.scale) || shape.scale < 0.0f) {
    why << "scale must be a positive finite number, or 0 for 1/sqrt(head_dim) (got " << shape.scale
        << ").";
    return why.str();
  }
  return "";
}

float DecodeShape::softmax_scale() const {
  return scale != 0.0f ? scale : 1.0f / std::sqrt(float(head_dim));
}

int DecodeShape::longest_seqlen_k() const {
  return seqlens_k.empty() ? 0 : *std::max_element(seqlens_k.begin(), seqlens_k.end());
}

int64_t DecodeShape::total_seqlen_k() const {
  return std::accumulate(seqlens_k.begin(), seqlens_k.end(), int64_t(0));
}

std::string DecodeShape::describe() const {
  std::ostringstream s;
  s << "batch " << batch << ", heads " << heads_q << " (kv " << heads_kv << "), new tokens "
    << seqlen_q << ", cached keys ";
  const int shortest =
      seqlens_k.empty() ? 0 : *std::min_element(seqlens_k.begin(), seqlens_k.end());
  if (shortest == longest_seqlen_k()) s << shortest;
  else
    s << shortest << " to " << longest_seqlen_k() << " (mean "
      << total_seqlen_k() / std::max(1, batch) << ")";
  s << ", head_dim " << head_dim << ", scale " << softmax_scale();
  return s.str();
}

double decode_kv_bytes(const DecodeShape& shape, int element_bytes) {
  return 2.0 * double(shape.total_seqlen_k()) * shape.heads_kv * shape.head_dim * element_bytes;
}

std::string validate(const DecodeShape& shape, const std::vector<int>& supported_head_dims) {
  AttentionShape as_attention =
      make_shape(shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q,
                 std::max(1, shape.max_seqlen_k), shape.head_dim);
  as_attention.scale = shape.scale;
  if (std::string why = validate(as_attention, supported_head_dims); !why.empty()) return why;
  std::ostringstream why;
  if (shape.seqlen_q > kMaxDecodeQueries) {
    why << "a decode step takes 1 to " << kMaxDecodeQueries << " new tokens per sequence (got "
        << shape.seqlen_q << ").";
  } else if (int(shape.seqlens_k.size()) != shape.batch) {
    why << "there must be one cache length per sequence (" << shape.batch << "), got "
        << shape.seqlens_k.size() << ".";
  } else {
    for (int b = 0; b < shape.batch && why.str().empty(); ++b)
      if (shape.seqlens_k[b] < 0 || shape.seqlens_k[b] > shape.max_seqlen_k)
        why << "sequence " << b << " has " << shape.seqlens_k[b]
            << " cached keys, outside 0 to the cache's room of " << shape.max_seqlen_k << ".";
  }
  return why.str();
}

}  // namespace attn
