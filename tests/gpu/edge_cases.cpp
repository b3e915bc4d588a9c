#include "edge_cases.h"

#include <sstream>

namespace attn::test {

std::vector<EdgeShape> edge_shapes(const std::vector<int>& head_dims) {
  std::vector<EdgeShape> shapes;
  auto add = [&](AttentionShape shape, float q_scale = 1.0f) {
    std::ostringstream name;
    name << shape.describe();
    if (q_scale != 1.0f) name << ", q_scale " << q_scale;
    shapes.push_back({shape, q_scale, name.str()});
  };
  const int square_lengths[] = {1, 17, 33, 63, 64, 65, 127, 129, 1000};
  const int uneven_lengths[][2] = {{1, 129}, {129, 1}, {17, 63}, {65, 1000}, {1000, 65}, {127, 64}};
  for (int head_dim : head_dims) {
    for (bool causal : {false, true}) {
      AttentionShape shape = make_shape(2, 3, 3, 1, 1, head_dim, causal);
      for (int n : square_lengths) {
        shape.seqlen_q = shape.seqlen_k = n;
        add(shape);
      }
      for (auto [sq, sk] : uneven_lengths) {
        shape.seqlen_q = sq;
        shape.seqlen_k = sk;
        add(shape);
      }
      // Grouped-query attention: 8 query heads over 8, 2 and 1 key/value heads.
      for (int heads_kv : {8, 2, 1}) {
        AttentionShape gqa = shape;
        gqa.heads_q = 8;
        gqa.heads_kv = heads_kv;
        gqa.seqlen_q = 97;
        gqa.seqlen_k = 161;
        add(gqa);
      }
      // Logits of several hundred: exp() overflows float unless the row max is subtracted.
      AttentionShape large = shape;
      large.seqlen_q = large.seqlen_k = 200;
      add(large, 100.0f);
    }
  }
  // More (batch, head) pairs than gridDim.y or gridDim.z can hold.
  add(make_shape(2100, 32, 8, 3, 5, head_dims.front()));
  return shapes;
}

std::string describe_failure(const RunReport& r) {
  std::ostringstream s;
  for (size_t i = 0; i < r.outputs.size(); ++i) {
    const OutputCheck& output = r.outputs[i];
    s << (i ? "; " : "") << output.name << " max abs err " << output.comparison.max_abs_err
      << " rel " << output.comparison.rel_err << " [" << output.tolerance.rule << "]";
  }
  for (const OutputCheck& output : r.outputs)
    for (const auto& m : output.comparison.mismatches) s << "; " << m;
  return s.str();
}

}  // namespace attn::test
