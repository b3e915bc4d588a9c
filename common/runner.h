// The runner every chapter binary and every chapter test goes through: make inputs, run the
// chapter's launch function, check against the CPU reference, time it, report.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "chapter_api.h"
#include "compare.h"
#include "reference.h"
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
  Tolerance o_tolerance, lse_tolerance;
  Comparison o, lse;
  bool passed = true;  // true when not checked
  // Time.
  bool timed = false;
  Timing timing;
  double tflops = 0;
};

// "" if this machine can run a chapter that needs compute capability min_cc (e.g. 80), otherwise
// one sentence saying why not (no GPU, or too old a GPU).
std::string device_problem(int min_cc);
std::string device_description();

// Throws InvalidInput for a shape the chapter rejects, OutOfDeviceMemory, or CudaError.
RunReport run_forward(const ForwardChapter& chapter, const RunOptions& options);

enum class OutputFormat { kText, kCsv, kJson };
void print_report(const RunReport& report, OutputFormat format);

// Exit codes of a chapter binary.
enum ExitCode : int {
  kExitPass = 0,
  kExitCheckFailed = 1,
  kExitBadInput = 2,   // bad option, unsupported shape or head_dim
  kExitNoDevice = 3,   // no GPU, too old a GPU, or not enough device memory
  kExitCudaError = 4,  // a CUDA call or a kernel failed
};

// The whole program of a chapter binary: parse argv, run, print, return the exit code.
int forward_main(int argc, char** argv, const ForwardChapter& chapter);

}  // namespace attn
