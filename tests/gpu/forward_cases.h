// The edge-case matrix every forward chapter is tested over (README.md, "How the checking works").
#pragma once

#include <string>
#include <vector>

#include "chapter_api.h"
#include "edge_cases.h"
#include "runner.h"

namespace attn::test {

struct ForwardCase {
  std::string name;
  RunOptions options;
  bool expect_pass = true;  // false only where the chapter's lesson is the failure (01, overflow)
};

// The shapes of edge_cases.h at every supported head_dim, and for the bf16 chapters a million
// keys; every case draws fresh inputs from its own seed.
std::vector<ForwardCase> forward_cases(const ForwardChapter& chapter);

// Runs the chapter over every case of forward_cases() and CHECKs (doctest) that each one passes:
// the check of an exercise whose edit must leave the chapter correct.
void check_every_case_passes(const ForwardChapter& chapter);

}  // namespace attn::test
