// Running one chapter: make inputs, run the chapter's launch function, check the outputs against
// the CPU reference, time it, and fill a report. One run_<kind> per kind of chapter (forward,
// backward, decode), sharing the options and the report. A chapter binary (program.h) and a chapter
// test call the same function. Printing a report: report.h.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "chapter_api.h"
#include "compare.h"
#include "dtype.h"
#include "timing.h"

namespace attn {

struct RunOptions {
  AttentionShape shape;
  uint64_t seed = 1234;
  float q_scale = 1.0f;  // Q ~ Normal(0, q_scale): large values make exp() overflow without the max
  // Forward runs (forward_inputs.h): outlier channels of Q and K (1: none), a Hadamard rotation of
  // Q and K, the scales of FP8 inputs, and a second check against the reference from the
  // unrounded inputs (always made for FP8 chapters).
  float outliers = 1.0f;
  bool hadamard = false;
  float qk_offset = 0.0f;  // forward: Q drawn around +qk_offset and K around -qk_offset
  Fp8Scaling fp8_scaling = Fp8Scaling::kPerHead;
  bool check_unrounded = false;
  bool check = true;
  bool check_all = false;         // check every (batch, head) pair, however long it takes
  double check_mac_budget = 4e9;  // otherwise sample pairs up to about this much reference work
  int check_max_heads = 0;        // and at most this many pairs (0: no limit)
  bool bench = true;
  TimingOptions timing;
  std::string save_dir;        // if set, write every input and output there as .npy
  bool deterministic = false;  // backward chapters with a deterministic mode: use it
  // Decode chapters. shape.seqlen_q is the new tokens per sequence and shape.seqlen_k the cache
  // length of every sequence, unless seqlens_k says otherwise: "" (all shape.seqlen_k), a list
  // "100,7,3000" (one per sequence), or "uniform:LO:HI" (drawn from the seed). The contiguous
  // cache has room for the longest (decode_shape below).
  std::string seqlens_k;
  int page_size = 16;             // paged chapters: tokens per page, a power of two
  bool random_page_order = true;  // paged: the pool's free list starts shuffled (seeded)
};

// Bad options or a shape the chapter does not support; the message is one sentence.
struct InvalidInput : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// One output of a chapter held against the reference: "o", "lse" (later kinds: "dq", "dk", ...).
struct OutputCheck {
  std::string name;
  Tolerance tolerance;
  Comparison comparison;
  uint64_t checksum = 0;  // of the compared values' bits: equal checksums, equal outputs
};

enum class ChapterKind { kForward, kBackward, kDecode };

// What a decode run read and how fast: K and V bytes per second, beside the device-to-device copy
// bandwidth of this GPU measured in the same process (bytes read + written per second).
struct DecodeFacts {
  DecodeShape shape;
  int page_size = 0;                  // 0: contiguous cache
  double kv_bytes = 0;                // K and V bytes a step reads (shape.h, decode_kv_bytes)
  double kv_gbps = 0;                 // kv_bytes / median time, in GB/s
  double copy_gbps = 0;               // cudaMemcpy device to device, read + written, GB/s
  size_t cache_bytes = 0;             // the K and V cache as allocated (paged: the pool)
  size_t contiguous_cache_bytes = 0;  // a contiguous cache with room for the longest sequence
};

struct RunReport {
  std::string chapter;
  ChapterKind kind = ChapterKind::kForward;
  bool deterministic = false;  // backward: ran in its deterministic mode
  DType dtype = DType::kF32;         // of the inputs
  DType output_dtype = DType::kF32;  // of O
  std::string inputs_what;           // forward: outliers, rotation, FP8 scales ("" if plain)
  AttentionShape shape;
  std::string device;          // e.g. "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, CUDA 13.0)"
  std::string io_what;         // the tensors io_bytes counts, e.g. "Q, K, V, O, LSE"
  size_t io_bytes = 0;         // the inputs and outputs on the device
  size_t workspace_bytes = 0;  // the chapter's scratch
  std::string workspace_what;
  // Check.
  bool checked = false;
  // Forward: (batch, query head) pairs. Backward and decode: (batch, key/value head) groups, each
  // with the query heads that read it.
  size_t heads_checked = 0, heads_total = 0;
  double max_abs_logit = 0;
  std::vector<OutputCheck> outputs;  // in the order they are printed
  bool passed = true;                // true when not checked
  // Time.
  bool timed = false;
  Timing timing;
  std::string prepass_what;  // the chapter's pre-pass, timed alone as well (ForwardChapter)
  double prepass_median_ms = 0;
  double tflops = 0;   // backward: 2.5x the forward FLOPs; decode: 0 (see decode)
  DecodeFacts decode;  // decode runs only

  // The output called `name`; a default (empty, passed) one when it was not checked.
  const Comparison& comparison(const std::string& name) const;
};

// Throws OutOfDeviceMemory or OutOfHostMemory (memory_plan.h) when the run would not fit: the
// device memory of its tensors, and the host memory of its input pieces, its check and --save.
// run_forward asks first; the program asks before it prints anything.
void require_forward_fits(const ForwardChapter& chapter, const RunOptions& options);

// Throws InvalidInput for a shape the chapter rejects, OutOfDeviceMemory or OutOfHostMemory for a
// problem that does not fit, or CudaError.
RunReport run_forward(const ForwardChapter& chapter, const RunOptions& options);

}  // namespace attn

namespace attn {

// The backward kind: makes q, k, v and dO, runs the harness's forward kernel (plain_forward.h) for
// o and lse, poisons dq, dk, dv, launches the chapter, and checks o, lse, dq, dk and dv against the
// Eigen reference on a sample of (batch, key/value head) groups. Throws like run_forward, and
// InvalidInput for --deterministic on a chapter without that mode.
void require_backward_fits(const BackwardChapter& chapter, const RunOptions& options);
RunReport run_backward(const BackwardChapter& chapter, const RunOptions& options);

}  // namespace attn

namespace attn {

// Page sizes are powers of two, as vLLM's and FlashInfer's usually are: a kernel then finds a
// token's page and slot with a shift and a mask.
inline bool page_size_valid(int page_size) {
  return page_size >= 1 && (page_size & (page_size - 1)) == 0;
}
constexpr const char* kPageSizeRule = "--page-size must be a power of two (1, 2, 4, 8, ...).";

// The decode kind: the lengths of options.seqlens_k resolved (throws InvalidInput with one
// sentence for a bad list or a bad spread), and the cache's room.
DecodeShape decode_shape(const RunOptions& options);
// Makes q and the cache (contiguous, or paged through a PageAllocator with options.page_size:
// page_allocator.h), fills every cache slot past a sequence's length with NaN, poisons o and lse,
// launches, checks o and lse against the Eigen reference on a sample of (sequence, key/value head)
// groups, and times with the L2 flushed (as options.timing says) beside the copy bandwidth.
void require_decode_fits(const DecodeChapter& chapter, const RunOptions& options);
RunReport run_decode(const DecodeChapter& chapter, const RunOptions& options);

}  // namespace attn
