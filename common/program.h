// The whole program of a chapter binary, of any kind: parse the command line, run, print
// the report, and turn what happened into an exit status.
#pragma once

#include "chapter_api.h"

namespace attn {

// Exit codes of a chapter binary.
enum ExitCode : int {
  kExitPass = 0,
  kExitCheckFailed = 1,
  kExitBadInput = 2,   // bad option, unsupported shape or head_dim, or too large for host memory
  kExitNoDevice = 3,   // no GPU, too old a GPU, or too large for the GPU's memory
  kExitCudaError = 4,  // a CUDA call or a kernel failed
};

int forward_main(int argc, char** argv, const ForwardChapter& chapter);
int backward_main(int argc, char** argv, const BackwardChapter& chapter);
int decode_main(int argc, char** argv, const DecodeChapter& chapter);

}  // namespace attn
