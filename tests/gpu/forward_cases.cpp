#include "forward_cases.h"

#include <doctest/doctest.h>

#include <sstream>

#include "edge_cases.h"

namespace attn::test {
namespace {

// The head dims a chapter is tested at: its own list, or two common ones when it takes any.
std::vector<int> tested_head_dims(const ForwardChapter& chapter) {
  return chapter.head_dims.empty() ? std::vector<int>{64, 128} : chapter.head_dims;
}

}  // namespace

std::vector<ForwardCase> forward_cases(const ForwardChapter& chapter) {
  std::vector<ForwardCase> cases;
  uint64_t seed = 1;
  auto add = [&](const EdgeShape& edge) {
    ForwardCase c;
    c.name = edge.name;
    c.options.shape = edge.shape;
    c.options.seed = seed++;
    c.options.q_scale = edge.q_scale;
    c.options.bench = false;
    c.expect_pass = edge.q_scale == 1.0f || chapter.survives_large_logits;
    cases.push_back(c);
  };
  for (const EdgeShape& edge : edge_shapes(tested_head_dims(chapter))) add(edge);
  // A million keys (and 7) for a few queries: an error the kernel makes once per block of keys
  // adds up over 8,000-33,000 blocks and becomes visible, even when it is one rounding per block.
  // The log-sum-exp sees it first, while O's elements are too small (~1e-3) to show it. It found an
  // alpha of 2^r instead of 1 on every block whose max did not move (r: the rounding of m x
  // scale), which O / l cancels and the LSE keeps: in chapter 06 with 32-key blocks (3.8e-3 off at
  // Q x 1, 2.5x the tolerance of 1e-4 + 1e-4 * |LSE|), and in chapter 27, whose 128-key tiles made
  // the sum 4x smaller and hid it at Q x 1; Q x 2.5 (logits up to about 16) makes r 2-4x larger
  // (docs/benchmarks.md, "A drift that only a long sequence shows"). The FP8 chapters 28-29 had it
  // too, and there it cost O as well, at Q x 1 as at Q x 2.5 (chapter 28's README, "Long rows"):
  // they run Q x 1, where the tensor cores' sum of P V, which the plain FP8 implementation models,
  // grows O's error the most. For the bf16 and FP8 chapters, whose per-block bookkeeping in
  // registers is what this case is for; the fp32 chapters were not run on it (their 1e-5
  // tolerance was not set for sums of a million terms).
  if (chapter.dtype != DType::kF32) {
    const AttentionShape long_keys =
        make_shape(1, 8, 1, 33, (1 << 20) + 7, tested_head_dims(chapter).back());
    const float q_scale = chapter.dtype == DType::kE4M3 ? 1.0f : 2.5f;
    std::ostringstream name;
    name << long_keys.describe() << ", Q x " << q_scale;
    add({long_keys, q_scale, name.str()});
  }
  // FP8 chapters, at every head dim: inputs with outlier channels (x6: logits up to about 50),
  // under one scale per tensor, and with the Hadamard rotation, on a shape whose lengths fill no
  // tile, causal with GQA.
  if (chapter.dtype == DType::kE4M3) {
    for (int d : tested_head_dims(chapter))
      for (int variant = 0; variant < 2; ++variant) {
        const AttentionShape shape = make_shape(2, 8, 2, 333, 1000, d, variant == 1);
        add({shape, 1.0f, shape.describe()});
        cases.back().options.outliers = 6.0f;
        cases.back().options.fp8_scaling =
            variant == 0 ? Fp8Scaling::kPerTensor : Fp8Scaling::kPerHead;
        cases.back().options.hadamard = variant == 1;
        cases.back().name += variant == 0 ? ", outliers x6, per-tensor scales"
                                          : ", outliers x6, Hadamard, per-head scales";
      }
  }
  // Logits of about 1e6 and 1e8 (outlier channels x1e3 and x1e4 in every fourth key/value head),
  // causal with lengths that fill no tile, at every head dim: far past any real logits, but a
  // plain softmax gets them right. A kernel whose exponents share the rounding of m c within a row
  // does not beyond some size, and declares it (ForwardChapter::largest_logits): there the case
  // must fail, so that the limit its README states is the one it has. Only sure outcomes are
  // run. Logits of 1e10 (x1e5) only for chapters whose limit is below them: there P overflows
  // (float: 2^r with r up to 512), while for a right kernel float's rounding of the scores (~600)
  // leaves O about 1% from the double reference, at the edge of the bf16 rule. And no case between
  // a limit and 1e10: past the FP8 chapters' 1e7 a row saturates only where m c rounds up by more
  // than 0.8, so at 1e8 one seed failed and another passed. The fp32 chapters are not run on it
  // (their fixed tolerance was not set for logits this large).
  if (chapter.survives_large_logits && chapter.dtype != DType::kF32) {
    for (float outliers : {1e3f, 1e4f, 1e5f}) {
      const float logits = outliers * outliers;
      // 1e10 is never a sure pass: a right kernel's O lands at the edge of the bf16 rule there
      // (chapters 21-26, which declare no limit, read 1.0100x its 1e-2 floor at head_dim 64).
      const bool sure_pass = logits <= chapter.largest_logits && logits < 1e10f;
      const bool sure_failure = logits >= 1e10f && chapter.largest_logits < 1e10f;
      if (!sure_pass && !sure_failure) continue;
      for (int d : tested_head_dims(chapter)) {
        const AttentionShape shape = make_shape(1, 8, 8, 333, 1000, d, true);
        std::ostringstream name;
        name << shape.describe() << ", outlier channels x" << outliers << " (logits ~" << logits
             << ")";
        add({shape, 1.0f, name.str()});
        cases.back().options.outliers = outliers;
        cases.back().expect_pass = sure_pass;
      }
    }
  }
  // The Hopper chapters (21-39, 44-46): lengths that are whole multiples of their key tiles (352 =
  // 2 x 176, chapters 32-35 at head_dim 128 without the mask; 384 = 3 x 128, and 2 x 192 for the
  // FP8 chapters' head_dim 128; 176 one wide tile), so that no tile is partial and the rings' last
  // stages are full, which the matrix's lengths never are; and the matrix's batch x heads above
  // 65535 at every head dim, causal and not: 67,200 tiles of one query row and one key block, so
  // that each persistent block of chapters 34-35, 37-39 and 44-46 walks about 500 of them (at
  // head_dim 128 without the mask, chapter 32's two-stage rings; causal, most handed out by the
  // counter).
  if (chapter.arch_specific == 90) {
    const std::vector<int> head_dims = tested_head_dims(chapter);
    for (int d : head_dims)
      for (bool causal : {false, true}) {
        for (int n : {176, 352, 384}) {
          const AttentionShape shape = make_shape(2, 3, 3, n, n, d, causal);
          add({shape, 1.0f, shape.describe()});
        }
        if (d == head_dims.front() && !causal) continue;  // in the matrix already
        const AttentionShape many_tiles = make_shape(2100, 32, 8, 3, 5, d, causal);
        add({many_tiles, 1.0f, many_tiles.describe()});
      }
    // Shapes whose last round chapters 44 and 45 split along the keys (without the mask, on GPUs
    // of up to 132 SMs; the million keys above are split too): 4 heads of 300 query rows over 9000
    // keys, 12 tiles at head_dim 128 (8 at 64), the last query block of each head partial; and 150
    // tiles of 33 rows over 5300 keys, GQA 5, so that 132 blocks walk a whole round first and
    // share the 18 left (chapter 45 splits it at head_dim 64 only: at 128 its runs would be 3.8 of
    // its 192-key blocks, under its floor of 4). The last, split by both at both head dims on 132
    // SMs: 222 tiles of 33 rows over 1200 keys, GQA 3, a whole round and 90 left, runs of 4-5 key
    // blocks of a tile's 7 at head_dim 128 (6-7 of 10 at 64), the runs of 66 of the 132 blocks (72
    // at 64) crossing from one tile into the next. The pieces' runs start and end inside tiles, and
    // the last key block of each is partial.
    for (int d : head_dims)
      for (const AttentionShape& shape :
           {make_shape(1, 4, 2, 300, 9000, d), make_shape(2, 75, 15, 33, 5300, d),
            make_shape(2, 111, 37, 33, 1200, d)})
        add({shape, 1.0f, shape.describe()});
  }
  // FP8 chapters, at every head dim: scores below zero (Q and K drawn around +1 and -1: at head_dim
  // 128 practically all of them, at 64 all but a few), so that a thread's scores of a row in a
  // block are all negative, where chapter 51's integer row maximum is not exact and its float
  // maximum must take over. Without the mask, so that the unmasked blocks see it. Last, so that the
  // cases before it keep their seeds.
  if (chapter.dtype == DType::kE4M3) {
    for (int d : tested_head_dims(chapter)) {
      const AttentionShape shape = make_shape(2, 8, 2, 333, 1000, d);
      add({shape, 1.0f, shape.describe() + ", scores below zero (--qk-offset 1)"});
      cases.back().options.qk_offset = 1.0f;
    }
  }
  return cases;
}

void check_every_case_passes(const ForwardChapter& chapter) {
  for (const ForwardCase& c : forward_cases(chapter)) {
    if (!c.expect_pass) continue;  // a case the chapter is built to fail (ForwardCase)
    INFO(c.name);
    const RunReport report = run_forward(chapter, c.options);
    CHECK_MESSAGE(report.passed, describe_failure(report));
  }
}

}  // namespace attn::test
