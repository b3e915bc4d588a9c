#include "backward_cases.h"

namespace attn::test {

std::vector<BackwardCase> backward_cases(const BackwardChapter& chapter) {
  std::vector<BackwardCase> cases;
  uint64_t seed = 1;
  std::vector<bool> modes = {false};
  if (chapter.has_deterministic_mode) modes.push_back(true);
  for (bool deterministic : modes) {
    for (const EdgeShape& edge : edge_shapes(chapter.head_dims)) {
      BackwardCase c;
      c.name = edge.name + (deterministic ? ", deterministic" : "");
      c.options.shape = edge.shape;
      c.options.seed = seed++;
      c.options.q_scale = edge.q_scale;
      c.options.deterministic = deterministic;
      c.options.bench = false;
      cases.push_back(c);
    }
  }
  return cases;
}

}  // namespace attn::test
