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
  // False where the chapter is built to fail the case: 01 at large logits (its lesson: exp()
  // overflows without the max), and any chapter past its ForwardChapter::largest_logits.
  bool expect_pass = true;
};

// The shapes of edge_cases.h at every supported head_dim; for the bf16 and e4m3 chapters a million
// keys, logits of 1e6 and 1e8 within the chapter's largest_logits, and 1e10 where it must fail (past
// largest_logits); for the e4m3 chapters outlier channels with and without the Hadamard rotation.
// Every case draws fresh inputs from its own seed.
std::vector<ForwardCase> forward_cases(const ForwardChapter& chapter);

// Runs the chapter over every case of forward_cases() it is built to pass and CHECKs (doctest)
// that each one passes: the check of an exercise whose edit must leave the chapter correct.
void check_every_case_passes(const ForwardChapter& chapter);

}  // namespace attn::test
