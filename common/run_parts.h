// The parts that every run_<kind> of runner.h shares: its memory plan, the fields of its report
// that do not depend on the kind, and its timing. For the runners only; chapters never see them.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include <cuda_runtime_api.h>

#include "runner.h"

namespace attn {

// What one run holds: on the device its tensors and the chapter's workspace; on the host the
// pieces of its inputs, its check and --save.
struct RunFootprint {
  std::string io_what;  // the device tensors, e.g. "Q, K, V, O, LSE"
  size_t io_bytes = 0;
  size_t workspace_bytes = 0;
  std::string timing_what;  // device memory the timing needs besides the L2 flush buffer
  size_t timing_bytes = 0;
  size_t largest_input_elements = 0;  // uploaded in pieces (host_data.h)
  std::string check_what;             // e.g. "check of 5 heads"
  size_t check_bytes = 0;
  size_t save_bytes = 0;
  std::string fewer_checks;  // the advice when the check does not fit
};

// Throws OutOfDeviceMemory or OutOfHostMemory (memory_plan.h) when the run would not fit.
void require_fits(const RunFootprint& footprint, const RunOptions& options);

// A report with the fields every kind fills the same way.
RunReport start_report(const char* chapter, ChapterKind kind, DType dtype,
                       const RunOptions& options, const RunFootprint& footprint,
                       const char* workspace_what);

// Compares one output with its reference, adds it to report.outputs (with the checksum of its
// values), and fails the report when it fails.
void add_output(RunReport& report, const std::string& name, const Tolerance& tolerance,
                const std::vector<float>& out, const std::vector<double>& ref,
                const std::function<std::string(size_t)>& where);

// Times `launch` as options.timing says, into the report, with `flops` per launch.
void time_into(RunReport& report, const std::function<void(cudaStream_t)>& launch,
               const RunOptions& options, double flops);

}  // namespace attn
