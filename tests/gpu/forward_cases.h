// The edge-case matrix every forward chapter is tested over (README.md, "How the checking works").
#pragma once

#include <string>
#include <vector>

#include "chapter_api.h"
#include "runner.h"

namespace attn::test {

struct ForwardCase {
  std::string name;
  RunOptions options;
  bool expect_pass = true;  // false only where the chapter's lesson is the failure (01, overflow)
};

// Sequence lengths that are not multiples of any tile (and some that are, and their neighbours),
// seqlen_q != seqlen_k both ways, causal and not, every supported head_dim, GQA group sizes
// 1, 4 and 8, logits large enough to overflow exp() without the max trick, and batch * heads above
// 65535 (the limit of gridDim.y and gridDim.z). Every case draws fresh inputs from its own seed.
std::vector<ForwardCase> forward_cases(const ForwardChapter& chapter);

// One line for a failed case: shape, errors, first mismatches.
std::string describe_failure(const RunReport& report);

// Runs the chapter over every case of forward_cases() and CHECKs (doctest) that each one passes:
// the check of an exercise whose edit must leave the chapter correct.
void check_every_case_passes(const ForwardChapter& chapter);

}  // namespace attn::test
