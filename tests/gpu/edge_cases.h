// What the GPU tests of every kind of chapter share: the shapes of the edge-case matrix
// (CONVENTIONS.md, "Tests"), which each kind turns into its own cases (forward_cases.h,
// backward_cases.h), and the line that describes a failed run.
#pragma once

#include <string>
#include <vector>

#include "runner.h"
#include "shape.h"

namespace attn::test {

struct EdgeShape {
  AttentionShape shape;
  float q_scale = 1.0f;  // 100: logits of several hundred, exp() overflows without the max
  std::string name;
};

// Sequence lengths that are not multiples of any tile (and some that are, and their neighbours),
// seqlen_q != seqlen_k both ways (with causal, rows that see no key), causal and not, every
// head_dim given, GQA group sizes 1, 4 and 8, large logits, and batch * heads above 65535 (the
// limit of gridDim.y and gridDim.z).
std::vector<EdgeShape> edge_shapes(const std::vector<int>& head_dims);

// One line for a failed case: each output's errors and tolerance, then the first mismatches.
std::string describe_failure(const RunReport& report);

}  // namespace attn::test
