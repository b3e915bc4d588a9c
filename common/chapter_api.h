// The interface between a chapter and the harness: what a chapter's attention.cuh provides, and
// what the runner hands to its launch function, one pair per kind of chapter (forward, backward,
// decode).
// Nothing in here is part of the lesson.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtype.h"
#include "shape.h"

namespace attn {

struct ForwardParams {
  AttentionShape shape;
  const void* q = nullptr;    // [batch, heads_q, seqlen_q, head_dim]
  const void* k = nullptr;    // [batch, heads_kv, seqlen_k, head_dim]
  const void* v = nullptr;    // [batch, heads_kv, seqlen_k, head_dim]
  void* o = nullptr;          // [batch, heads_q, seqlen_q, head_dim]
  float* lse = nullptr;       // [batch, heads_q, seqlen_q], natural log of each row's softmax sum
  void* workspace = nullptr;  // ForwardChapter::workspace_bytes(shape) bytes, uninitialised
  // FP8 chapters only (dtype kE4M3): on the device, one float per (batch, key/value head) each,
  // batch * heads_kv + kv head. An element's value is its stored e4m3 number times the descale
  // of its group (for Q: of the key/value head its query head reads). Null for other chapters.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
};

struct ForwardChapter {
  const char* name;            // the folder, e.g. "01_naive"
  const char* summary;         // one line: what this step does
  DType dtype;                 // of Q, K, V (and of O, unless output_dtype says otherwise)
  std::vector<int> head_dims;  // the head dimensions its kernels support
  int min_compute_capability;  // e.g. 80 for mma.sync with bf16
  // False only for the chapter whose lesson is the overflow (01): the tests then expect failure.
  bool survives_large_logits;
  size_t (*workspace_bytes)(const AttentionShape& shape);  // device scratch the launch needs
  const char* workspace_what;  // what the scratch holds, for the report ("" if none)
  void (*launch)(const ForwardParams& params, cudaStream_t stream);
  // 90: built for sm_90a (wgmma, TMA): runs on compute capability 9.0 only, and everywhere else
  // the binary says so and its tests skip. 0: runs on min_compute_capability and newer.
  int arch_specific = 0;
  DType output_dtype = dtype;  // of O: bf16 for an FP8 chapter
  // A kernel that launch runs before the attention and that the report times apart as well (FP8:
  // V transposed into the workspace); null if none. launch runs it itself: the total is timed.
  void (*prepass)(const ForwardParams& params, cudaStream_t stream) = nullptr;
  const char* prepass_what = "";
  // The largest |logit| (scale x q.k) its softmax is built for. A kernel that takes each exponent
  // as one FMA, s c - m c with m c rounded to float, shares that rounding r between the scores of
  // a row: every P carries 2^r, which O / l cancels until it leaves P's range. In float (chapters
  // 06-14 and 27) that happens past logits of ~1.5e9, in e4m3 with P scaled to 2^8 (28-29) past
  // ~1.2e7: chapter 06's README, "How far the fold holds", and chapter 28's. The GPU tests of the
  // bf16 and e4m3 chapters run logits of 1e6 and 1e8 where they are within this limit (to pass),
  // and 1e10 where the limit is below it (to fail); tests/gpu/forward_cases.cpp.
  float largest_logits = INFINITY;
};

// The backward pass: the gradients of a loss L with respect to q, k and v, given dO = dL/dO. O and
// LSE come from the forward pass (the harness runs its own plain forward kernel to make them).
struct BackwardParams {
  AttentionShape shape;
  const void* q = nullptr;     // [batch, heads_q, seqlen_q, head_dim]
  const void* k = nullptr;     // [batch, heads_kv, seqlen_k, head_dim]
  const void* v = nullptr;     // [batch, heads_kv, seqlen_k, head_dim]
  const void* o = nullptr;     // [batch, heads_q, seqlen_q, head_dim], the forward output
  const float* lse = nullptr;  // [batch, heads_q, seqlen_q], -inf for a row that sees no key
  const void* dout = nullptr;  // [batch, heads_q, seqlen_q, head_dim], dL/dO
  void* dq = nullptr;          // like q
  void* dk = nullptr;          // like k: summed over the query heads of each group
  void* dv = nullptr;          // like v: summed over the query heads of each group
  // Only for chapters with has_deterministic_mode: the same bits on every run of the same inputs.
  bool deterministic = false;
  void* workspace = nullptr;  // BackwardChapter::workspace_bytes(shape) bytes, uninitialised
};

struct BackwardChapter {
  const char* name;     // the folder, e.g. "15_backward_recompute"
  const char* summary;  // one line: what this step does
  DType dtype;          // of Q, K, V, O, dO and the gradients
  std::vector<int> head_dims;
  int min_compute_capability;
  bool has_deterministic_mode;                             // accepts --deterministic
  size_t (*workspace_bytes)(const AttentionShape& shape);  // enough for either mode
  const char* workspace_what;
  void (*launch)(const BackwardParams& params, cudaStream_t stream);
  // 90: built for sm_90a (wgmma, TMA): runs on compute capability 9.0 only, and everywhere else
  // the binary says so and its tests skip. 0: runs on min_compute_capability and newer.
  int arch_specific = 0;
};

// Decoding: a few new query tokens per sequence against a KV cache (shape.h, DecodeShape). The
// cache holds the new tokens' own keys and values already, and every slot past a sequence's length
// is NaN: a kernel that reads one fails the check.
struct DecodeParams {
  DecodeShape shape;        // on the host: the launch may read the lengths to plan its grid
  const void* q = nullptr;  // [batch, heads_q, seqlen_q, head_dim]
  // Contiguous chapters: [batch, heads_kv, shape.max_seqlen_k, head_dim].
  // Paged chapters: a pool of pages [num_pages, page_size, heads_kv, head_dim]; token t of
  // sequence b is slot t % page_size of page block_table[b * max_pages_per_seq + t / page_size].
  const void* k = nullptr;
  const void* v = nullptr;
  const int* seqlens_k = nullptr;    // on the device: [batch], shape.seqlens_k
  const int* block_table = nullptr;  // paged only, on the device: [batch, max_pages_per_seq]
  int page_size = 0;                 // paged only
  int max_pages_per_seq = 0;         // paged only
  int num_pages = 0;                 // paged only
  void* o = nullptr;                 // [batch, heads_q, seqlen_q, head_dim]
  float* lse = nullptr;       // [batch, heads_q, seqlen_q], natural log; -inf for a row with no key
  void* workspace = nullptr;  // DecodeChapter::workspace_bytes(shape) bytes, uninitialised
};

struct DecodeChapter {
  const char* name;     // the folder, e.g. "19_flash_decoding"
  const char* summary;  // one line: what this step does
  DType dtype;          // of Q, the cache and O
  std::vector<int> head_dims;
  int min_compute_capability;
  bool paged;  // reads the cache through a block table (otherwise contiguous)
  size_t (*workspace_bytes)(const DecodeShape& shape);
  const char* workspace_what;
  void (*launch)(const DecodeParams& params, cudaStream_t stream);
  // 90: built for sm_90a (wgmma, TMA): runs on compute capability 9.0 only, and everywhere else
  // the binary says so and its tests skip. 0: runs on min_compute_capability and newer.
  int arch_specific = 0;
};

}  // namespace attn
