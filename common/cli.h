// The command line shared by every chapter binary. `--help` lists every option.
#pragma once

#include <string>
#include <vector>

#include "report.h"
#include "runner.h"

namespace attn {

struct CliOptions {
  RunOptions run;
  OutputFormat format = OutputFormat::kText;
  bool help = false;
};

// The default problem: big enough to fill an H100 and be timed, small enough that the fp32
// chapters and the CPU check finish in a few seconds.
AttentionShape default_shape();

// Throws InvalidInput with one sentence on an unknown option or a bad value.
CliOptions parse_cli(const std::vector<std::string>& args);
// --help of a chapter binary of either kind.
std::string usage(const ForwardChapter& chapter);
std::string usage(const BackwardChapter& chapter);

}  // namespace attn
