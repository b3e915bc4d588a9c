#include "decode_cases.h"

#include <algorithm>
#include <sstream>

namespace attn::test {
namespace {

// The head dims a chapter is tested at: its own list, or two common ones when it takes any.
std::vector<int> tested_head_dims(const DecodeChapter& chapter) {
  return chapter.head_dims.empty() ? std::vector<int>{64, 128} : chapter.head_dims;
}

// Lengths that fill no tile, page or split, beside ones that fill exactly one: 0 (no key at all),
// 1 and 5 (fewer keys than 8 new tokens, so some rows see none), 16/17, 63/64/65, 255/256/257
// around the page sizes and common tile widths, and 1000 and 4097 (several splits, a ragged last).
const std::vector<int> kRaggedLengths = {0, 1, 5, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 4097};

// A cache-length spec of the runner (runner.h, RunOptions::seqlens_k): "5,70000,33".
std::string length_list(const std::vector<int>& lengths) {
  std::ostringstream s;
  for (size_t i = 0; i < lengths.size(); ++i) s << (i ? "," : "") << lengths[i];
  return s.str();
}

// One sequence per length of the list.
RunOptions with_lengths(int heads_q, int heads_kv, int seqlen_q, int head_dim,
                        const std::vector<int>& lengths) {
  RunOptions options;
  const int longest = *std::max_element(lengths.begin(), lengths.end());
  options.shape =
      make_shape(int(lengths.size()), heads_q, heads_kv, seqlen_q, std::max(1, longest), head_dim);
  options.seqlens_k = length_list(lengths);
  return options;
}

// `batch` sequences with lengths given by a spec ("" for shape.seqlen_k each, or "uniform:LO:HI").
RunOptions with_spec(int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_k, int head_dim,
                     const std::string& spec) {
  RunOptions options;
  options.shape = make_shape(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim);
  options.seqlens_k = spec;
  return options;
}

// "batch 3, heads 8 (kv 2), new tokens 8, lengths 5,70000,33, d 128, pages of 16, random order"
std::string describe(const RunOptions& options, bool paged) {
  const AttentionShape& s = options.shape;
  std::ostringstream name;
  name << "batch " << s.batch << ", heads " << s.heads_q << " (kv " << s.heads_kv
       << "), new tokens " << s.seqlen_q << ", lengths ";
  if (options.seqlens_k.empty()) {
    name << "all " << s.seqlen_k;
  } else {
    name << options.seqlens_k;
  }
  name << ", d " << s.head_dim;
  if (paged)
    name << ", pages of " << options.page_size << ", "
         << (options.random_page_order ? "random" : "in") << " order";
  if (options.q_scale != 1.0f) name << ", q_scale " << options.q_scale;
  return name.str();
}

}  // namespace

std::vector<DecodeCase> decode_cases(const DecodeChapter& chapter) {
  std::vector<DecodeCase> cases;
  uint64_t seed = 1;
  // Checks every group unless told how many to sample: then the sequences of length 0 and the
  // rows that see no key are always among the compared ones. No case costs the reference more
  // than about 1.2e9 multiply-adds (the 70000-key sequence with 8 new tokens at d 128, with 4
  // query heads per group), and most cost under 1e8.
  auto add = [&](RunOptions options, int sampled_groups = 0) {
    options.seed = seed++;
    options.bench = false;
    options.check_all = sampled_groups == 0;
    options.check_max_heads = sampled_groups;
    cases.push_back({describe(options, chapter.paged), options});
  };

  for (int d : tested_head_dims(chapter)) {
    // Every ragged length at once, at 1 new token (plain decoding), an odd count and the most.
    for (int new_tokens : {1, 3, kMaxDecodeQueries})
      add(with_lengths(8, 2, new_tokens, d, kRaggedLengths));

    // Group sizes 1, 4 and 8, and multi-query with 8 and 32 query heads: a kernel that packs a
    // group's query rows into one tile has 1 to 32 * 8 = 256 of them. With 8 new tokens the
    // 3-key sequence leaves rows without a key inside a packed tile; with 1, every sequence has
    // the same length (the runner's default, spec "").
    const int head_pairs[][2] = {{8, 8}, {8, 2}, {16, 2}, {8, 1}, {32, 1}};
    for (auto [heads_q, heads_kv] : head_pairs) {
      add(with_lengths(heads_q, heads_kv, kMaxDecodeQueries, d, {3, 129, 1000}));
      add(with_spec(2, heads_q, heads_kv, 1, 1000, d, ""));
    }

    // One sequence far longer than its neighbours: split-KV has to give it many blocks while the
    // short ones have one, and the combine sums over splits of very different sizes.
    for (int new_tokens : {1, kMaxDecodeQueries})
      add(with_lengths(8, 2, new_tokens, d, {5, 70000, 33}));

    // A seeded uniform spread of lengths, 0 included: as a serving batch looks.
    add(with_spec(32, 16, 2, 1, 4000, d, "uniform:0:4000"));
    add(with_spec(16, 8, 1, 5, 600, d, "uniform:0:600"));

    // Logits of several hundred: exp() overflows unless every split subtracts its maximum, and
    // the combine rescales splits whose maxima differ by hundreds.
    for (int new_tokens : {1, kMaxDecodeQueries}) {
      RunOptions large = with_lengths(8, 2, new_tokens, d, {1, 65, 5000});
      large.q_scale = 100.0f;
      add(large);
    }

    if (chapter.paged) {
      // Pages of one token (every key on its own page), 16 (vLLM's default), 64 and 256 (larger
      // than a typical split), drawn from a shuffled pool; and once in order, where a kernel that
      // ignores the block table and reads the pool as contiguous memory could still pass.
      for (int page_size : {1, 16, 64, 256}) {
        for (int new_tokens : {1, kMaxDecodeQueries}) {
          RunOptions paged = with_lengths(8, 2, new_tokens, d, kRaggedLengths);
          paged.page_size = page_size;
          paged.random_page_order = true;
          add(paged);
        }
      }
      RunOptions in_order = with_lengths(8, 2, kMaxDecodeQueries, d, kRaggedLengths);
      in_order.page_size = 16;
      in_order.random_page_order = false;
      add(in_order);
    }
  }

  // 2100 sequences x 32 heads: 67200 (sequence, head) pairs, with group size 1 as many
  // (sequence, key/value head) groups, more than gridDim.y or gridDim.z can hold (65535). Each is
  // tiny, so the check is a sample: the first and last group and 1022 drawn at random, enough to
  // catch a fault in the 2.5% of groups past 65535 (1 - 0.975^1022 is 1 to 11 digits).
  add(with_spec(2100, 32, 32, 3, 5, tested_head_dims(chapter).front(), "uniform:0:5"), 1024);
  return cases;
}

}  // namespace attn::test
