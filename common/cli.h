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
// Decode: one new token for each of 8 sequences of 8192 cached tokens, 32 query heads over 8
// key/value heads, head_dim 128 (a Llama-3-8B layer).
AttentionShape default_decode_shape();

// Throws InvalidInput with one sentence on an unknown option or a bad value. The kind picks the
// defaults: decode runs flush the L2 cache before every timed launch unless --no-flush-l2.
CliOptions parse_cli(const std::vector<std::string>& args,
                     ChapterKind kind = ChapterKind::kForward);
// --help of a chapter binary of each kind.
std::string usage(const ForwardChapter& chapter);
std::string usage(const BackwardChapter& chapter);
std::string usage(const DecodeChapter& chapter);

}  // namespace attn
