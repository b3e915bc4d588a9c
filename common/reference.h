// CPU references computed with Eigen, accumulating in double. Every chapter is checked against
// these; the tests check them against plain loops and finite differences first.
//
// Conventions (see docs/README.md): softmax scale `scale`; causal masks are bottom-right aligned,
// so query row i sees key j when j <= i + seqlen_k - seqlen_q; a row that sees no key has output 0
// and log-sum-exp -inf.
#pragma once

#include <cstdint>
#include <vector>

#include "shape.h"

namespace attn {

struct HeadIndex {
  int batch;
  int head;  // query head
  bool operator==(const HeadIndex& other) const {
    return batch == other.batch && head == other.head;
  }
};

// The flat index (batch * heads_kv + kv head) of the key/value head that query head h reads.
size_t kv_head_of(const AttentionShape& shape, const HeadIndex& h);

// Every (batch, query head) pair, in layout order.
std::vector<HeadIndex> all_heads(const AttentionShape& shape);
// Pairs to check on a large problem: the first and the last pair, plus pairs drawn at random
// (seeded) until the reference would do about `mac_budget` multiply-adds, and no more than
// max_heads pairs if that is not 0 (1 means the first pair alone). All pairs if they fit.
std::vector<HeadIndex> sample_heads(const AttentionShape& shape, double mac_budget, uint64_t seed,
                                    size_t max_heads = 0);

// How the reference computes.
enum class RefPrecision {
  kDouble,     // every product and sum in double: the reference
  kPlainBf16,  // what a plain bf16 implementation gets (PyTorch's math in bf16: matrix products
               // accumulate in float and store bf16), from inputs that are already bf16 values.
               // Forward: S = scale q k^T in float, rounded to bf16; P = softmax of that S in
               // float, rounded to bf16; O = P V in float, rounded to bf16.
               // Backward, with S, P and O as above: dV = P^T dO; dP = dO V^T; D = rowsum(dO * O)
               // in float; dS = P * (dP - D) in float; dQ = scale dS K; dK = scale dS^T Q; each
               // product in float and each result rounded to bf16 (dK and dV summed over a group's
               // query heads in float and rounded once).
  kPlainFp8,   // forward only: what a plain FP8 attention on Hopper gets from inputs that are
               // already the dequantised e4m3 values, both products on the FP8 tensor cores: S =
               // scale q k^T with q k^T summed as the tensor cores sum it (fp8_mma_dot in
               // reference.cpp, a model with 13 fraction bits), in float; each row's exp(S - max)
               // in float, times 2^8, rounded to e4m3 for P V; l the float sum of the unrounded
               // values; P V summed as the tensor cores sum it too (fp8_mma_dot along the keys,
               // the running sum carried from one group of 32 to the next, as FlashAttention-3
               // keeps O in the accumulator from one key block to the next); O = (P V) / l in
               // float, rounded to bf16.
  kPlainFp8FloatPv,  // kPlainFp8 with P V summed in float: near what a kernel would get that
                     // kept O's running sum in float registers and let the tensor cores sum one
                     // block at a time (which would still cut each block's sum). Not a
                     // tolerance: the experiment of chapter 28's "Long rows"
                     // (tests/cpu/test_fp8_inputs.cpp).
};

// A dot product of n FP8 values (given as floats, e.g. dequantised e4m3) as Hopper's FP8 tensor
// cores sum it, modelled (reference.cpp: fitted to an H100); the plain FP8 implementation's
// scores.
double fp8_mma_dot(const float* a, const float* b, int n);

struct ForwardReference {
  std::vector<HeadIndex> heads;  // the pairs computed, in this order
  std::vector<double> o;         // [heads.size(), seqlen_q, head_dim]
  std::vector<double> lse;       // [heads.size(), seqlen_q]
  double max_abs_logit = 0;      // largest |scale * q.k| over the keys a row sees
};

// q, k, v in the layout of shape.h, as float values (already rounded to bf16 for bf16 chapters).
ForwardReference reference_forward(const AttentionShape& shape, const std::vector<float>& q,
                                   const std::vector<float>& k, const std::vector<float>& v,
                                   const std::vector<HeadIndex>& heads,
                                   RefPrecision precision = RefPrecision::kDouble);

// The host memory that reference_forward's worker threads hold at once for `heads` heads of this
// shape: each task converts its head's K and V to double and keeps S and P for 64 rows.
size_t reference_forward_worker_bytes(const AttentionShape& shape, size_t heads);

// The inputs of one head: q [seqlen_q x head_dim], k and v [seqlen_k x head_dim], row-major.
struct HeadInputs {
  const float* q;
  const float* k;
  const float* v;
};
// The same for heads given by their inputs alone (the sizes, mask and scale come from shape); the
// result's `heads` is left empty. The runner uses it to check a sample of heads without holding a
// whole tensor on the host.
ForwardReference reference_forward(const AttentionShape& shape,
                                   const std::vector<HeadInputs>& heads,
                                   RefPrecision precision = RefPrecision::kDouble);

// Gradients, and the forward pass recomputed on the way, so that a check can judge the forward
// output a backward run starts from. Query-head tensors are [groups, group_size, seqlen_q, ...],
// key/value ones [groups, seqlen_k, head_dim]; for the full-layout form, whose groups are every
// (batch, key/value head) in order, those are the layouts of q and k (shape.h).
struct BackwardReference {
  std::vector<double> dq;    // like q
  std::vector<double> dk;    // like k: summed over the query heads of each group
  std::vector<double> dv;    // like v
  std::vector<double> o;     // like q
  std::vector<double> lse;   // [groups, group_size, seqlen_q]; -inf for a row that sees no key
  double max_abs_logit = 0;  // largest |scale * q.k| over the keys a row sees
};

// The inputs of one key/value head and of the query heads that read it (its group, in order).
struct BackwardGroupInputs {
  const float* k;                  // [seqlen_k x head_dim], row-major
  const float* v;                  // [seqlen_k x head_dim]
  std::vector<const float*> q;     // group_size() pointers to [seqlen_q x head_dim]
  std::vector<const float*> dout;  // group_size() pointers to [seqlen_q x head_dim]
};

// Gradients of sum(dout * O) with respect to q, k, v for the groups given by their inputs alone
// (the sizes, mask and scale come from shape), recomputing P from the inputs. It never holds a
// seqlen_q x seqlen_k matrix, only tiles of 64 query rows by 128 keys, and does about five forward
// passes' work: for each block of rows S three times (softmax statistics, then O, then dQ), P V,
// dP and dQ; for each tile of keys S, dP, dV and dK again. The result is bit-reproducible: each
// output element is summed by one task in a fixed order, whatever the number of threads.
BackwardReference reference_backward(const AttentionShape& shape,
                                     const std::vector<BackwardGroupInputs>& groups,
                                     RefPrecision precision = RefPrecision::kDouble);

// The same for the whole problem: q, k, v, dout in the layout of shape.h.
BackwardReference reference_backward(const AttentionShape& shape, const std::vector<float>& q,
                                     const std::vector<float>& k, const std::vector<float>& v,
                                     const std::vector<float>& dout,
                                     RefPrecision precision = RefPrecision::kDouble);

// Host bytes reference_backward holds at once for `groups` groups of this shape, besides its
// result: each worker thread's tiles, which do not depend on the sequence lengths, and three
// doubles per query row (softmax maximum and sum, D) that its two passes share.
size_t reference_backward_worker_bytes(const AttentionShape& shape, size_t groups);

// Decoding (shape.h, DecodeShape): seqlen_q new tokens per sequence, causal among themselves and
// against the cache (bottom-right aligned), against seqlens_k[b] cached keys. Rows that see no key
// have output 0 and lse -inf.
struct DecodeReference {
  std::vector<double>
      o;  // [groups, group_size * seqlen_q, head_dim] or [batch, heads_q, seqlen_q, head_dim]
  std::vector<double> lse;   // [groups, group_size * seqlen_q] or [batch, heads_q, seqlen_q]
  double max_abs_logit = 0;  // largest |scale * q.k| over the keys a row sees
};

// The inputs of one (sequence, key/value head) group.
struct DecodeGroupInputs {
  int batch;       // the sequence: it has shape.seqlens_k[batch] keys
  const float* q;  // [group_size * seqlen_q, head_dim]: the group's query heads in order, each
                   // seqlen_q rows (so row r is new token r % seqlen_q of query head r / seqlen_q)
  const float* k;  // [seqlens_k[batch], head_dim]
  const float* v;  // [seqlens_k[batch], head_dim]
};

// The groups given by their inputs alone; the runner checks a sample of groups this way.
DecodeReference reference_decode(const DecodeShape& shape,
                                 const std::vector<DecodeGroupInputs>& groups,
                                 RefPrecision precision = RefPrecision::kDouble);

// The whole problem: q [batch, heads_q, seqlen_q, head_dim]; k, v [batch, heads_kv, max_seqlen_k,
// head_dim]. Entries at or past seqlens_k[b] are never read. Results in the layout of q and lse.
DecodeReference reference_decode(const DecodeShape& shape, const std::vector<float>& q,
                                 const std::vector<float>& k_cache,
                                 const std::vector<float>& v_cache,
                                 RefPrecision precision = RefPrecision::kDouble);

// The same, with keys and values in a pool of pages: k_pages, v_pages are
// [num_pages, page_size, heads_kv, head_dim]; block_table is [batch, max_pages_per_seq] and names
// the page that holds tokens [p * page_size, (p + 1) * page_size) of each sequence.
DecodeReference reference_paged_decode(const DecodeShape& shape, const std::vector<float>& q,
                                       const std::vector<float>& k_pages,
                                       const std::vector<float>& v_pages, int page_size,
                                       const std::vector<int>& block_table, int max_pages_per_seq,
                                       RefPrecision precision = RefPrecision::kDouble);

}  // namespace attn
