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

// Decoding: seqlen_q new tokens per sequence (1, or up to kMaxDecodeQueries for speculative
// decoding) against a cache of keys and values of a different length per sequence. seqlens_k[b]
// counts every key of sequence b, its new tokens' own included (they are appended to the cache
// before attention runs), so new token i sees keys j <= i + seqlens_k[b] - seqlen_q: causal,
// bottom-right aligned. A row that sees no key (a sequence of length 0) outputs 0 and lse -inf.
// Layouts: q, o [batch, heads_q, seqlen_q, head_dim]; lse [batch, heads_q, seqlen_q]; the cache
// either contiguous [batch, heads_kv, max_seqlen_k, head_dim] or paged (chapter_api.h).
constexpr int kMaxDecodeQueries = 8;

struct DecodeShape {
  int batch = 1;
  int heads_q = 1;
  int heads_kv = 1;
  int seqlen_q = 1;  // new tokens per sequence
  int head_dim = 128;
  int max_seqlen_k = 1;        // the contiguous cache's room per sequence, >= every seqlens_k
  std::vector<int> seqlens_k;  // [batch], each >= 0
  float scale = 0.0f;          // softmax scale; 0 means 1/sqrt(head_dim)

  float softmax_scale() const;
  int group_size() const { return heads_q / heads_kv; }
  int longest_seqlen_k() const;
  int64_t total_seqlen_k() const;  // the sum of seqlens_k
  int64_t q_elements() const { return int64_t(batch) * heads_q * seqlen_q * head_dim; }
  int64_t lse_elements() const { return int64_t(batch) * heads_q * seqlen_q; }
  // Elements of the contiguous K (or V) cache.
  int64_t cache_elements() const { return int64_t(batch) * heads_kv * max_seqlen_k * head_dim; }
  std::string describe() const;  // with the lengths summarised (min, mean, max) when they differ
};

// Bytes of K and V a decode step must read: every cached key and value once, in `element_bytes`.
double decode_kv_bytes(const DecodeShape& shape, int element_bytes);

std::string validate(const DecodeShape& shape, const std::vector<int>& supported_head_dims);

}  // namespace attn
