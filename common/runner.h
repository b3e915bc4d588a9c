// Running one forward chapter: make inputs, run the chapter's launch function, check the outputs
// against the CPU reference, time it, and fill a report. A chapter binary (program.h) and a
// chapter test call the same function. Printing a report: report.h.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "chapter_api.h"
#include "compare.h"
#include "timing.h"

namespace attn {

struct RunOptions {
  AttentionShape shape;
  uint64_t seed = 1234;
  float q_scale = 1.0f;  // Q ~ Normal(0, q_scale): large values make exp() overflow without the max
  bool check = true;
  bool check_all = false;         // check every (batch, head) pair, however long it takes
  double check_mac_budget = 4e9;  // otherwise sample pairs up to about this much reference work
  int check_max_heads = 0;        // and at most this many pairs (0: no limit)
  bool bench = true;
  TimingOptions timing;
  std::string save_dir;  // if set, write q, k, v, o, lse there as .npy
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
};

struct RunReport {
  std::string chapter;
  DType dtype = DType::kF32;
  AttentionShape shape;
  std::string device;          // e.g. "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, CUDA 13.0)"
  size_t io_bytes = 0;         // Q, K, V, O, LSE on the device
  size_t workspace_bytes = 0;  // the chapter's scratch
  std::string workspace_what;
  // Check.
  bool checked = false;
  size_t heads_checked = 0, heads_total = 0;
  double max_abs_logit = 0;
  std::vector<OutputCheck> outputs;  // in the order they are printed
  bool passed = true;                // true when not checked
  // Time.
  bool timed = false;
  Timing timing;
  double tflops = 0;

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
