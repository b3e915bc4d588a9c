// The edge-case matrix every decode chapter is tested over: CONVENTIONS.md, "Tests", turned into
// decode problems (a few new tokens per sequence against caches of different lengths).
#pragma once

#include <string>
#include <vector>

#include "chapter_api.h"
#include "edge_cases.h"
#include "runner.h"

namespace attn::test {

struct DecodeCase {
  std::string name;
  RunOptions options;
};

// At every head_dim the chapter supports: 1, 3 and 8 new tokens; GQA group sizes 1, 4 and 8 and
// multi-query (8 and 32 query heads over one key/value head); per-sequence lengths of 0 (output 0,
// lse -inf), 1, fewer than the new tokens (rows that see no key), lengths that fill no tile, page
// or split, one sequence far longer than the others, and a seeded uniform spread; large logits.
// Paged chapters add pages of 1, 16, 64 and 256 tokens in random order and one cache in order.
// Once: more (sequence, head) pairs than gridDim.y or gridDim.z can hold. Every case has its own
// seed and checks every (sequence, key/value head) group, except the last, which checks a sample.
std::vector<DecodeCase> decode_cases(const DecodeChapter& chapter);

}  // namespace attn::test
