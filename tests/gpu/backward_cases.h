// The edge-case matrix every backward chapter is tested over: the shapes of edge_cases.h at each
// head dim the chapter supports, in each of its modes (atomic dQ, and deterministic where it has
// that mode).
#pragma once

#include <string>
#include <vector>

#include "chapter_api.h"
#include "edge_cases.h"
#include "runner.h"

namespace attn::test {

struct BackwardCase {
  std::string name;
  RunOptions options;
};

std::vector<BackwardCase> backward_cases(const BackwardChapter& chapter);

}  // namespace attn::test
