// The harness around the kernels: the online-softmax merge rule, the comparison (it must be able
// to fail), the tolerance rules, shape validation, the command line, bf16 rounding, random inputs
// and .npy output. Label `cpu`.
#include <doctest/doctest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "compare.h"
#include "host_data.h"
#include "memory_plan.h"
#include "npy.h"
#include "online_softmax.h"
#include "runner.h"
#include "shape.h"

using namespace attn;

namespace {
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::string where(size_t i) { return "x[" + std::to_string(i) + "]"; }
}  // namespace

TEST_CASE("merging partial softmax states in any grouping equals the direct softmax") {
  // Logits spread over a wide range (the merge must rescale), values of dimension 3.
  std::vector<double> logits = {3.0, -40.0, 95.0, 0.5, 95.0, -1e3, 12.0, 60.0, 7.0};
  std::vector<std::vector<double>> values;
  for (size_t j = 0; j < logits.size(); ++j) values.push_back({double(j), 1.0 - j, 0.25 * j * j});

  const double m = 95.0;
  double sum = 0;
  std::vector<double> direct(3, 0.0);
  for (size_t j = 0; j < logits.size(); ++j) sum += std::exp(logits[j] - m);
  for (size_t j = 0; j < logits.size(); ++j)
    for (int c = 0; c < 3; ++c) direct[c] += std::exp(logits[j] - m) / sum * values[j][c];

  for (size_t chunk : {size_t(1), size_t(2), size_t(4), size_t(9)}) {
    CAPTURE(chunk);
    // Left to right in chunks of `chunk` keys, each chunk merged key by key first.
    SoftmaxPartial total;
    for (size_t start = 0; start < logits.size(); start += chunk) {
      SoftmaxPartial part;
      for (size_t j = start; j < std::min(logits.size(), start + chunk); ++j)
        part = merge(part, single_key(logits[j], values[j]));
      total = merge(total, part);
    }
    CHECK(total.max == m);
    CHECK(total.sum == doctest::Approx(sum).epsilon(1e-14));
    CHECK(log_sum_exp(total) == doctest::Approx(m + std::log(sum)).epsilon(1e-14));
    const auto out = finish(total);
    for (int c = 0; c < 3; ++c) CHECK(out[c] == doctest::Approx(direct[c]).epsilon(1e-13));
  }
  // Merging is symmetric.
  const SoftmaxPartial a = merge(single_key(1.0, {1, 2, 3}), single_key(-2.0, {4, 5, 6}));
  const SoftmaxPartial b = single_key(5.0, {7, 8, 9});
  const SoftmaxPartial ab = merge(a, b), ba = merge(b, a);
  CHECK(ab.max == ba.max);
  CHECK(ab.sum == doctest::Approx(ba.sum).epsilon(1e-15));
}

TEST_CASE("a state that has seen no key is the identity of the merge, never NaN") {
  const SoftmaxPartial empty;
  const SoftmaxPartial one = single_key(-3.0, {2.0});
  const SoftmaxPartial merged = merge(empty, one);
  CHECK(merged.max == -3.0);
  CHECK(merged.sum == 1.0);
  CHECK(finish(merged)[0] == 2.0);
  const SoftmaxPartial nothing = merge(empty, empty);
  CHECK(nothing.max == kNegInf);
  CHECK(nothing.sum == 0.0);
  CHECK(log_sum_exp(nothing) == kNegInf);
  CHECK(finish(SoftmaxPartial{kNegInf, 0.0, {0.0, 0.0}}) == std::vector<double>{0.0, 0.0});
  // A masked key is empty too: alone it finishes to zeros, merged it changes nothing.
  const SoftmaxPartial masked = single_key(kNegInf, {7.0});
  CHECK(masked.sum == 0.0);
  CHECK(finish(masked) == std::vector<double>{0.0});
  CHECK(log_sum_exp(masked) == kNegInf);
  const SoftmaxPartial with_masked = merge(one, masked);
  CHECK(with_masked.sum == 1.0);
  CHECK(finish(with_masked)[0] == 2.0);
}

TEST_CASE("the comparison passes an exact answer and fails a wrong one") {
  const std::vector<double> ref = {0.5, -1.25, 3.0, kNegInf};
  std::vector<float> out = {0.5f, -1.25f, 3.0f, -INFINITY};
  const Tolerance tol = fp32_output_tolerance(1.0);
  CHECK(compare(out, ref, tol, where).passed);

  SUBCASE("one element off by 100 x the tolerance") {
    out[2] += 100 * float(tol.atol + tol.rtol * 3.0);
    const Comparison c = compare(out, ref, tol, where);
    CHECK_FALSE(c.passed);
    CHECK(c.failed == 1);
    REQUIRE(c.mismatches.size() == 1);
    CHECK(c.mismatches[0].rfind("x[2]", 0) == 0);
  }
  SUBCASE("a NaN, as an element the kernel never wrote would be") {
    out[1] = NAN;
    const Comparison c = compare(out, ref, tol, where);
    CHECK_FALSE(c.passed);
    CHECK(c.nonfinite == 1);
    CHECK(std::isinf(c.rel_err));
  }
  SUBCASE("a finite log-sum-exp where the row sees no key") {
    out[3] = 0.0f;
    CHECK_FALSE(compare(out, ref, tol, where).passed);
  }
  SUBCASE("a NaN where the row sees no key counts as a NaN, not only as a mismatch") {
    out[3] = NAN;
    const Comparison c = compare(out, ref, tol, where);
    CHECK_FALSE(c.passed);
    CHECK(c.nonfinite == 1);
  }
  SUBCASE("a small error everywhere, inside each element's bound but not the norm-wise one") {
    Tolerance strict = tol;
    strict.max_rel_norm = 1e-9;
    for (float& x : out)
      if (std::isfinite(x)) x *= 1.0f + 1e-6f;
    CHECK_FALSE(compare(out, ref, strict, where).passed);
  }
}

TEST_CASE("tolerance rules") {
  CHECK(fp32_output_tolerance(1.0).max_rel_norm == doctest::Approx(1e-5));
  // Large logits widen the fp32 bound in proportion (see compare.h for why).
  CHECK(fp32_output_tolerance(320.0).max_rel_norm == doctest::Approx(2e-4));
  const Tolerance b = bf16_output_tolerance(0.004);
  CHECK(b.atol == doctest::Approx(0.008 + 1e-5));
  CHECK(b.max_rel_norm == doctest::Approx(1e-2));
  CHECK(lse_tolerance(DType::kBF16, 1.0).atol > lse_tolerance(DType::kF32, 1.0).atol);
  // A gradient's bounds follow the size of the run's gradients, not the element's own size.
  const GradientScale scale{50.0, 2.0};
  const Tolerance g = fp32_gradient_tolerance(1.0, scale, 100);
  CHECK(g.atol == doctest::Approx(5e-4));
  CHECK(g.max_rel_norm == doctest::Approx(1e-5));
  CHECK(g.norm_floor == doctest::Approx(20.0));
  CHECK(fp32_gradient_tolerance(320.0, scale, 100).atol == doctest::Approx(1e-2));
  CHECK(bf16_gradient_tolerance(0.004, scale, 100).atol == doctest::Approx(0.008 + 1e-5));
}

TEST_CASE("a gradient that is 0 by cancellation is judged against the run's gradient scale") {
  // With one key dQ = 0 exactly; float leaves residues of ~1e-7 of the terms' size (~1).
  const std::vector<double> ref(64, 0.0);
  std::vector<float> out(64);
  for (size_t i = 0; i < out.size(); ++i) out[i] = (i % 2 ? 1e-7f : -1e-7f);
  const GradientScale scale{3.0, 1.0};  // dV, say, is of order 1
  CHECK(compare(out, ref, fp32_gradient_tolerance(1.0, scale, ref.size()), where).passed);
  // A real error of the same gradient still fails.
  out[5] = 1e-3f;
  CHECK_FALSE(compare(out, ref, fp32_gradient_tolerance(1.0, scale, ref.size()), where).passed);
}

TEST_CASE("checksums tell equal outputs from outputs that differ in one bit") {
  std::vector<float> a = {1.0f, -2.5f, 0.0f, 3e-8f}, b = a;
  CHECK(checksum(a) == checksum(b));
  b[3] = std::nextafter(b[3], 1.0f);
  CHECK(checksum(a) != checksum(b));
  b = a;
  b[2] = -0.0f;  // equal as numbers, other bits
  CHECK(checksum(a) != checksum(b));
  CHECK(checksum(a) != checksum(std::vector<float>{-2.5f, 1.0f, 0.0f, 3e-8f}));  // order counts
}

TEST_CASE("shape validation says what is wrong in one sentence") {
  AttentionShape s;
  s.head_dim = 64;
  CHECK(validate(s, {64, 128}) == "");
  s.heads_q = 6;
  s.heads_kv = 4;
  CHECK(validate(s, {64}).find("multiple of heads_kv") != std::string::npos);
  s.heads_kv = 3;
  s.head_dim = 96;
  CHECK(validate(s, {64, 128}) ==
        "head_dim 96 is not supported by this chapter (supported: 64, 128).");
  CHECK(validate(s, {}) == "");
  s.head_dim = 257;
  CHECK(validate(s, {}).find("not supported") != std::string::npos);
  s.head_dim = 64;
  s.seqlen_k = 0;
  CHECK(validate(s, {}) == "seqlen_k must be at least 1 (got 0).");
  s.seqlen_k = 5;
  s.scale = -1.0f;
  CHECK(validate(s, {}).find("scale") != std::string::npos);
}

TEST_CASE("flops: 4 B H Sq Sk D, halved for causal") {
  AttentionShape s = make_shape(2, 3, 1, 5, 7, 11);
  CHECK(forward_flops(s) == 4.0 * 2 * 3 * 5 * 7 * 11);
  s.causal = true;
  CHECK(forward_flops(s) == 2.0 * 2 * 3 * 5 * 7 * 11);
  CHECK(backward_flops(s) == 2.5 * forward_flops(s));
}

TEST_CASE("command line") {
  CliOptions c = parse_cli({});
  CHECK(c.run.shape.batch == default_shape().batch);
  CHECK(c.run.check);
  CHECK(c.run.bench);
  c = parse_cli({"--heads", "8", "--seqlen=100", "--seqlen-k", "300", "--causal", "--csv"});
  CHECK(c.run.shape.heads_q == 8);
  CHECK(c.run.shape.heads_kv == 8);  // follows --heads unless given
  CHECK(c.run.shape.seqlen_q == 100);
  CHECK(c.run.shape.seqlen_k == 300);
  CHECK(c.run.shape.causal);
  CHECK(c.format == OutputFormat::kCsv);
  c = parse_cli({"--heads", "8", "--heads-kv", "2", "--no-check", "--iters", "7"});
  CHECK(c.run.shape.heads_kv == 2);
  CHECK_FALSE(c.run.check);
  CHECK(c.run.timing.iters == 7);
  CHECK_THROWS_AS(parse_cli({"--batch", "0"}), InvalidInput);
  CHECK_THROWS_AS(parse_cli({"--batch", "two"}), InvalidInput);
  CHECK_THROWS_AS(parse_cli({"--seqlen"}), InvalidInput);
  CHECK_THROWS_AS(parse_cli({"--frobnicate"}), InvalidInput);
  CHECK_THROWS_AS(parse_cli({"--q-scale", "0"}), InvalidInput);
  CHECK_FALSE(parse_cli({}).run.deterministic);
  CHECK(parse_cli({"--deterministic"}).run.deterministic);
}

TEST_CASE("decode command line: its defaults, the lengths, the pages and the L2 flush") {
  CliOptions c = parse_cli({}, ChapterKind::kDecode);
  CHECK(c.run.shape.batch == default_decode_shape().batch);
  CHECK(c.run.shape.heads_kv == default_decode_shape().heads_kv);  // GQA by default
  CHECK(c.run.shape.heads_kv < c.run.shape.heads_q);
  CHECK(c.run.timing.flush_l2);  // decode is timed with a cold L2, forward without a flush
  CHECK_FALSE(parse_cli({}).run.timing.flush_l2);
  CHECK_FALSE(parse_cli({"--no-flush-l2"}, ChapterKind::kDecode).run.timing.flush_l2);
  c = parse_cli(
      {"--heads", "16", "--seqlens-k", "5,7", "--page-size", "64", "--page-order", "in-order"},
      ChapterKind::kDecode);
  CHECK(c.run.shape.heads_kv == 16);  // --heads alone: multi-head
  CHECK(c.run.seqlens_k == "5,7");
  CHECK(c.run.page_size == 64);
  CHECK_FALSE(c.run.random_page_order);
  CHECK(parse_cli({}, ChapterKind::kDecode).run.random_page_order);
  CHECK_THROWS_AS(parse_cli({"--page-order", "sorted"}, ChapterKind::kDecode), InvalidInput);
  CHECK_THROWS_AS(parse_cli({"--page-size", "0"}, ChapterKind::kDecode), InvalidInput);
  CHECK_THROWS_AS(parse_cli({"--page-size", "24"}, ChapterKind::kDecode), InvalidInput);
  CHECK(parse_cli({"--page-size", "1"}, ChapterKind::kDecode).run.page_size == 1);
}

TEST_CASE("decode lengths: every sequence the same, a list, or a seeded spread") {
  RunOptions options;
  options.shape = make_shape(3, 8, 2, 2, 100, 128);
  DecodeShape d = decode_shape(options);
  CHECK(d.seqlens_k == std::vector<int>{100, 100, 100});
  CHECK(d.max_seqlen_k == 100);
  options.seqlens_k = "0,70000,33";
  d = decode_shape(options);
  CHECK(d.seqlens_k == std::vector<int>{0, 70000, 33});
  CHECK(d.max_seqlen_k == 70000);  // the contiguous cache has room for the longest
  CHECK(d.total_seqlen_k() == 70033);
  CHECK(decode_kv_bytes(d, 2) == 2.0 * 70033 * 2 * 128 * 2);
  CHECK(validate(d, {64, 128}).empty());
  for (const char* bad : {"1,2", "1,2,3,4", "1,-2,3", "1,x,3", "uniform:5:2", "uniform:1", ""}) {
    INFO(bad);
    options.seqlens_k = bad;
    if (std::string(bad).empty()) continue;  // "" means every sequence shape.seqlen_k
    CHECK_THROWS_AS(decode_shape(options), InvalidInput);
  }
  options.shape.batch = 1000;
  options.seqlens_k = "uniform:10:20";
  const DecodeShape spread = decode_shape(options);
  CHECK(*std::min_element(spread.seqlens_k.begin(), spread.seqlens_k.end()) == 10);
  CHECK(*std::max_element(spread.seqlens_k.begin(), spread.seqlens_k.end()) == 20);
  CHECK(decode_shape(options).seqlens_k == spread.seqlens_k);  // the same for the same seed
  options.seed += 1;
  CHECK(decode_shape(options).seqlens_k != spread.seqlens_k);
}

TEST_CASE("decode shapes the chapters cannot run are refused with a sentence") {
  RunOptions options;
  options.shape = make_shape(2, 8, 2, 1, 100, 128);
  DecodeShape d = decode_shape(options);
  CHECK(validate(d, {64, 128}).empty());
  d.seqlen_q = kMaxDecodeQueries + 1;
  CHECK(validate(d, {64, 128}).find("new tokens") != std::string::npos);
  d = decode_shape(options);
  d.seqlens_k[1] = 101;  // past the cache's room
  CHECK(validate(d, {64, 128}).find("room") != std::string::npos);
  d = decode_shape(options);
  d.seqlens_k.pop_back();
  CHECK(validate(d, {64, 128}).find("one cache length per sequence") != std::string::npos);
  d = decode_shape(options);
  d.heads_kv = 3;
  CHECK(validate(d, {64, 128}).find("multiple") != std::string::npos);
  d = decode_shape(options);
  CHECK(validate(d, {64}).find("head_dim 128") != std::string::npos);
}

TEST_CASE("--help of each kind lists its own options") {
  const std::vector<int> dims = {64, 128};
  ForwardChapter forward{"99_forward", "a forward step", DType::kBF16, dims,   80,
                         true,         nullptr,          "",           nullptr};
  BackwardChapter backward{"99_backward", "a backward step", DType::kBF16, dims,   80,
                           false,         nullptr,           "",           nullptr};
  const std::string forward_help = usage(forward), atomic_help = usage(backward);
  backward.has_deterministic_mode = true;
  const std::string deterministic_help = usage(backward);
  CHECK(forward_help.find("forward pass") != std::string::npos);
  CHECK(forward_help.find("--deterministic") == std::string::npos);
  CHECK(atomic_help.find("backward pass") != std::string::npos);
  CHECK(atomic_help.find("(batch, key/value head) group") != std::string::npos);
  CHECK(atomic_help.find("--deterministic") == std::string::npos);
  CHECK(deterministic_help.find("--deterministic") != std::string::npos);
  CHECK(deterministic_help.find("dq, dk, dv") != std::string::npos);
  DecodeChapter decode{"99_decode", "a decode step", DType::kBF16, dims,   80,
                       false,       nullptr,         "",           nullptr};
  const std::string contiguous_help = usage(decode);
  decode.paged = true;
  const std::string paged_help = usage(decode);
  CHECK(contiguous_help.find("--seqlens-k") != std::string::npos);
  CHECK(contiguous_help.find("--no-flush-l2") != std::string::npos);
  CHECK(contiguous_help.find("--causal") == std::string::npos);  // decode is always causal
  CHECK(contiguous_help.find("--page-size") == std::string::npos);
  CHECK(paged_help.find("--page-size") != std::string::npos);
  CHECK(paged_help.find("--page-order") != std::string::npos);
}

TEST_CASE("bf16 rounding is round-to-nearest-even on the 8th mantissa bit") {
  CHECK(round_to_bf16(1.0f) == 1.0f);
  CHECK(round_to_bf16(1.0f + 1.0f / 256) == 1.0f);               // tie, rounds to even
  CHECK(round_to_bf16(1.0f + 3.0f / 256) == 1.0f + 4.0f / 256);  // tie, rounds to even
  CHECK(round_to_bf16(1.0f + 1.0f / 256 + 1.0f / 4096) == 1.0f + 2.0f / 256);  // above the tie
  CHECK(round_to_bf16(-2.5f) == -2.5f);
  CHECK(std::isnan(round_to_bf16(NAN)));
  CHECK(std::isinf(round_to_bf16(INFINITY)));
}

TEST_CASE("e4m3: every code decodes to its value, and rounding is to the nearest, ties to even") {
  CHECK(e4m3_bits_to_float(0x7E) == 448.0f);        // largest finite
  CHECK(e4m3_bits_to_float(0x08) == 0.015625f);     // smallest normal, 2^-6
  CHECK(e4m3_bits_to_float(0x01) == 0.001953125f);  // smallest subnormal, 2^-9
  CHECK(e4m3_bits_to_float(0x38) == 1.0f);
  CHECK(std::isnan(e4m3_bits_to_float(0x7F)));
  CHECK(std::isnan(e4m3_bits_to_float(0xFF)));
  // Every finite code survives the round trip, both signs (the two zeros included).
  std::vector<float> finite;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    const float v = e4m3_bits_to_float(uint8_t(code));
    CHECK(float_to_e4m3_bits(v) == code);
    if (code < 0x80) finite.push_back(v);
  }
  REQUIRE(finite.size() == 127);
  // Between neighbours: a quarter of the way rounds down, three quarters up, the midpoint to the
  // even code (the one whose last mantissa bit is 0).
  for (size_t i = 0; i + 1 < finite.size(); ++i) {
    const float lo = finite[i], hi = finite[i + 1], step = hi - lo;
    CHECK(round_to_e4m3(lo + step / 4) == lo);
    CHECK(round_to_e4m3(hi - step / 4) == hi);
    CHECK(round_to_e4m3(-(lo + step / 4)) == -lo);
    const float even = (float_to_e4m3_bits(lo) & 1) == 0 ? lo : hi;
    CHECK(round_to_e4m3(lo + step / 2) == even);
  }
  // Saturation and specials.
  CHECK(round_to_e4m3(460.0f) == 448.0f);
  CHECK(round_to_e4m3(1e9f) == 448.0f);
  CHECK(round_to_e4m3(-INFINITY) == -448.0f);
  CHECK(std::isnan(round_to_e4m3(NAN)));
  CHECK(round_to_e4m3(0.0009765625f) == 0.0f);  // half the smallest subnormal: a tie, to even 0
}

TEST_CASE("random inputs are reproducible, differ by seed and stream, and are not zeros") {
  std::vector<float> a(10001), b(10001), c(10001), d(10001);
  fill_normal(a, 42, 0, 1.0f);
  fill_normal(b, 42, 0, 1.0f);
  fill_normal(c, 43, 0, 1.0f);
  fill_normal(d, 42, 1, 1.0f);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a != d);
  double mean = 0, sq = 0;
  int zeros = 0;
  for (float x : a) mean += x, sq += double(x) * x, zeros += x == 0.0f;
  mean /= a.size();
  CHECK(std::abs(mean) < 0.05);
  CHECK(std::sqrt(sq / a.size()) == doctest::Approx(1.0).epsilon(0.05));
  CHECK(zeros == 0);
}

TEST_CASE("random inputs made piece by piece are the same numbers as made at once") {
  // The runner makes each input in pieces and regenerates only the checked heads, so any range
  // must give exactly the elements of the whole stream, from odd starts as well as even ones.
  std::vector<float> whole(2 * 65536 * 3 + 7);  // large enough to be filled by several threads
  fill_normal(whole, 7, 2, 0.5f);
  for (size_t first : {size_t(0), size_t(1), size_t(2), size_t(999), size_t(131071)}) {
    for (size_t count : {size_t(1), size_t(2), size_t(5), size_t(65536 * 2 + 3)}) {
      CAPTURE(first);
      CAPTURE(count);
      if (first + count > whole.size()) continue;
      std::vector<float> piece(count);
      fill_normal(piece.data(), count, 7, 2, 0.5f, first);
      CHECK(std::equal(piece.begin(), piece.end(), whole.begin() + first));
    }
  }
}

TEST_CASE("a run too large for the GPU or the host is refused with the bytes and a remedy") {
  MemoryNeed need;
  need.add("Q, K, V, O, LSE", 4'000'000'000);
  need.add("workspace", 0);  // an empty part is left out of the sentence
  need.add("L2 flush buffer", 100'000'000);
  CHECK(need.total() == 4'100'000'000);
  CHECK(need.describe() == "4.10 GB (Q, K, V, O, LSE 4.00 GB, L2 flush buffer 0.10 GB)");
  CHECK(device_memory_problem(need, 4'100'000'000, 80'000'000'000) == "");
  const std::string device = device_memory_problem(need, 3'000'000'000, 80'000'000'000);
  CHECK(device.find("needs 4.10 GB") != std::string::npos);
  CHECK(device.find("3.00 GB free of 80.00 GB") != std::string::npos);
  CHECK(device.find("smaller batch") != std::string::npos);
  CHECK(host_memory_problem(need, 5'000'000'000, "use --no-check.") == "");
  const std::string host = host_memory_problem(need, 1'000'000'000, "use --no-check.");
  CHECK(host.find("1.00 GB available") != std::string::npos);
  CHECK(host.substr(host.size() - 15) == "use --no-check.");
  // This machine's own figure is a positive number (whatever it is).
  CHECK(host_available_bytes() > 0);
}

TEST_CASE(".npy files carry a 64-byte aligned header, the shape and the data") {
  const std::string path = "test_harness_out.npy";
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f, 5.0f, 6.0f};
  save_npy(path, values, {2, 3});
  std::ifstream file(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() > 10);
  CHECK(bytes.substr(1, 5) == "NUMPY");
  const size_t header_len = size_t((unsigned char)bytes[8]) | size_t((unsigned char)bytes[9]) << 8;
  CHECK((10 + header_len) % 64 == 0);
  const std::string header = bytes.substr(10, header_len);
  CHECK(header.find("'descr': '<f4'") != std::string::npos);
  CHECK(header.find("'shape': (2,3)") != std::string::npos);
  CHECK(bytes.size() == 10 + header_len + values.size() * 4);
  float last;
  std::memcpy(&last, bytes.data() + bytes.size() - 4, 4);
  CHECK(last == 6.0f);
  std::remove(path.c_str());
}
