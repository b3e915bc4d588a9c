// The shape of one attention problem, and the checks that reject what the chapters cannot run.
//
// Layout everywhere: Q, O are [batch, heads_q, seqlen_q, head_dim]; K, V are
// [batch, heads_kv, seqlen_k, head_dim], contiguous; LSE is [batch, heads_q, seqlen_q].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// Small accessors are usable in kernels as well as on the host.
#ifdef __CUDACC__
#define ATTN_HOST_DEVICE __host__ __device__
#else
#define ATTN_HOST_DEVICE
#endif

namespace attn {

struct AttentionShape {
  int batch = 1;
  int heads_q = 1;
  int heads_kv = 1;
  int seqlen_q = 1;
  int seqlen_k = 1;
  int head_dim = 64;
  bool causal = false;
  float scale = 0.0f;  // softmax scale; 0 means the usual 1/sqrt(head_dim)

  float softmax_scale() const;
  // Query heads that share one key/value head (1 = multi-head, heads_q = multi-query).
  ATTN_HOST_DEVICE int group_size() const { return heads_q / heads_kv; }
  ATTN_HOST_DEVICE int64_t q_elements() const {
    return int64_t(batch) * heads_q * seqlen_q * head_dim;
  }
  ATTN_HOST_DEVICE int64_t kv_elements() const {
    return int64_t(batch) * heads_kv * seqlen_k * head_dim;
  }
  ATTN_HOST_DEVICE int64_t lse_elements() const { return int64_t(batch) * heads_q * seqlen_q; }
  // The first key that query row i cannot see is i + causal_offset() + 1 (bottom-right aligned).
  ATTN_HOST_DEVICE int causal_offset() const { return seqlen_k - seqlen_q; }
  std::string describe() const;
};

AttentionShape make_shape(int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_k,
                          int head_dim, bool causal = false);

// Floating-point operations of the forward pass: 4 * B * Hq * Sq * Sk * D (two matrix products),
// halved for causal, the convention of the FlashAttention papers.
double forward_flops(const AttentionShape& shape);
// The backward pass: 2.5 times the forward (five matrix products of the same size against two).
double backward_flops(const AttentionShape& shape);

// Returns an empty string when the shape is valid, otherwise one sentence that says what is wrong.
// supported_head_dims lists what the chapter's kernels were written for (empty: any in 1..256).
std::string validate(const AttentionShape& shape, const std::vector<int>& supported_head_dims);

}  // namespace attn
