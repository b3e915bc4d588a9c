// The interface between a chapter and the harness: what a chapter's attention.cuh provides, and
// what the runner hands to its launch function. Nothing in here is part of the lesson.
#pragma once

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
};

struct ForwardChapter {
  const char* name;     // the folder, e.g. "01_naive"
  const char* summary;  // one line: what this step does
  DType dtype;  // of Q, K, V and O
  std::vector<int> head_dims;  // the head dimensions its kernels support
  int min_compute_capability;  // e.g. 80 for mma.sync with bf16
  // False only for the chapter whose lesson is the overflow (01): the tests then expect failure.
  bool survives_large_logits;
  size_t (*workspace_bytes)(const AttentionShape& shape);  // device scratch the launch needs
  const char* workspace_what;  // what the scratch holds, for the report ("" if none)
  void (*launch)(const ForwardParams& params, cudaStream_t stream);
};

}  // namespace attn
