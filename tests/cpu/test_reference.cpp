// The CPU references are what every kernel is judged by, so they are checked first: the Eigen
// forward against plain loops, the backward against finite differences and plain loops, and the
// decode references against the forward one. Label `cpu`: runs everywhere, CI included.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "host_data.h"
#include "reference.h"

using namespace attn;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::vector<float> random_values(size_t n, uint64_t seed, uint64_t stream, float stddev = 1.0f) {
  std::vector<float> v(n);
  fill_normal(v, seed, stream, stddev);
  return v;
}

// The definition, one row at a time, with no Eigen and no blocking.
void loop_forward(const AttentionShape& s, const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v, std::vector<double>& o, std::vector<double>& lse) {
  const int d = s.head_dim;
  o.assign(q.size(), 0.0);
  lse.assign(s.lse_elements(), 0.0);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seqlen_q; ++i) {
        const size_t row = (size_t(b) * s.heads_q + h) * s.seqlen_q + i;
        const size_t kv = (size_t(b) * s.heads_kv + h / s.group_size()) * s.seqlen_k;
        std::vector<double> logits;
        for (int j = 0; j < s.seqlen_k; ++j) {
          if (s.causal && j > i + s.seqlen_k - s.seqlen_q) break;
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += double(q[row * d + c]) * k[(kv + j) * d + c];
          logits.push_back(dot * s.softmax_scale());
        }
        if (logits.empty()) {
          lse[row] = kNegInf;
          continue;
        }
        const double m = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double x : logits) sum += std::exp(x - m);
        lse[row] = m + std::log(sum);
        for (size_t j = 0; j < logits.size(); ++j)
          for (int c = 0; c < d; ++c)
            o[row * d + c] += std::exp(logits[j] - m) / sum * v[(kv + j) * d + c];
      }
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

// The backward by its definition, one query row at a time: P from the row's logits, then
// dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK += scale dS^T Q.
BackwardReference loop_backward(const AttentionShape& s, const std::vector<float>& q,
                                const std::vector<float>& k, const std::vector<float>& v,
                                const std::vector<float>& dout) {
  const int d = s.head_dim;
  const double scale = s.softmax_scale();
  BackwardReference g;
  loop_forward(s, q, k, v, g.o, g.lse);
  g.dq.assign(q.size(), 0.0);
  g.dk.assign(k.size(), 0.0);
  g.dv.assign(v.size(), 0.0);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seqlen_q; ++i) {
        const size_t row = (size_t(b) * s.heads_q + h) * s.seqlen_q + i;
        const size_t kv = (size_t(b) * s.heads_kv + h / s.group_size()) * s.seqlen_k;
        double delta = 0;
        for (int c = 0; c < d; ++c) delta += double(dout[row * d + c]) * g.o[row * d + c];
        for (int j = 0; j < s.seqlen_k; ++j) {
          if (s.causal && j > i + s.seqlen_k - s.seqlen_q) break;
          double dot = 0, dp = 0;
          for (int c = 0; c < d; ++c) {
            dot += double(q[row * d + c]) * k[(kv + j) * d + c];
            dp += double(dout[row * d + c]) * v[(kv + j) * d + c];
          }
          const double p = std::exp(dot * scale - g.lse[row]);
          const double ds = p * (dp - delta);
          for (int c = 0; c < d; ++c) {
            g.dv[(kv + j) * d + c] += p * dout[row * d + c];
            g.dq[row * d + c] += scale * ds * k[(kv + j) * d + c];
            g.dk[(kv + j) * d + c] += scale * ds * q[row * d + c];
          }
        }
      }
  return g;
}

// ||a - b|| / ||b||, the norm-wise relative error of the tolerance rule.
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / norm);
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// Every result of two backward references, bit for bit.
void check_same_bits(const BackwardReference& a, const BackwardReference& b) {
  CHECK(same_bits(a.dq, b.dq));
  CHECK(same_bits(a.dk, b.dk));
  CHECK(same_bits(a.dv, b.dv));
  CHECK(same_bits(a.o, b.o));
  CHECK(same_bits(a.lse, b.lse));
  CHECK(a.max_abs_logit == b.max_abs_logit);
}

// The inputs of a whole problem, and copies of some of its (batch, key/value head) groups in
// buffers of their own, as the runner holds them: nothing ties a group to its place in the layout.
struct BackwardProblem {
  AttentionShape shape;
  std::vector<float> q, k, v, dout;
  std::vector<std::vector<float>> copies;

  BackwardProblem(const AttentionShape& s, uint64_t seed) : shape(s) {
    q = random_values(s.q_elements(), seed, 0);
    k = random_values(s.kv_elements(), seed, 1);
    v = random_values(s.kv_elements(), seed, 2);
    dout = random_values(s.q_elements(), seed, 3);
  }

  std::vector<BackwardGroupInputs> groups(const std::vector<size_t>& flat_kv_heads) {
    const size_t q_head = size_t(shape.seqlen_q) * shape.head_dim;
    const size_t kv_head = size_t(shape.seqlen_k) * shape.head_dim;
    auto copy = [&](const std::vector<float>& from, size_t at, size_t n) {
      copies.emplace_back(from.begin() + at, from.begin() + at + n);
      return copies.back().data();
    };
    copies.reserve(copies.size() + flat_kv_heads.size() * (2 + 2 * shape.group_size()));
    std::vector<BackwardGroupInputs> inputs;
    for (size_t kv : flat_kv_heads) {
      BackwardGroupInputs in{
          copy(k, kv * kv_head, kv_head), copy(v, kv * kv_head, kv_head), {}, {}};
      for (size_t h = kv * shape.group_size(); h < (kv + 1) * shape.group_size(); ++h) {
        in.q.push_back(copy(q, h * q_head, q_head));
        in.dout.push_back(copy(dout, h * q_head, q_head));
      }
      inputs.push_back(in);
    }
    return inputs;
  }
};

}  // namespace

TEST_CASE("Eigen forward reference equals the loop definition") {
  // Square, seqlen_q > seqlen_k (rows that see no key when causal), seqlen_q < seqlen_k, GQA, and
  // more query rows than one Eigen row block (64) so the blocking is exercised.
  const AttentionShape shapes[] = {
      make_shape(2, 4, 2, 7, 11, 5, false),    make_shape(2, 4, 2, 7, 11, 5, true),
      make_shape(1, 3, 1, 11, 7, 8, true),     make_shape(1, 2, 2, 130, 90, 16, true),
      make_shape(1, 2, 1, 90, 130, 16, false), make_shape(3, 1, 1, 1, 1, 3, true)};
  uint64_t seed = 10;
  for (const AttentionShape& s : shapes) {
    CAPTURE(s.describe());
    auto q = random_values(s.q_elements(), seed, 0), k = random_values(s.kv_elements(), seed, 1),
         v = random_values(s.kv_elements(), seed, 2);
    ++seed;
    std::vector<double> o, lse;
    loop_forward(s, q, k, v, o, lse);
    const ForwardReference ref = reference_forward(s, q, k, v, all_heads(s));
    CHECK(max_abs_diff(ref.o, o) < 1e-12);
    CHECK(max_abs_diff(ref.lse, lse) < 1e-12);
    if (s.causal && s.seqlen_q > s.seqlen_k) {
      // Bottom-right alignment: the first seqlen_q - seqlen_k rows see nothing.
      CHECK(ref.lse[0] == kNegInf);
      CHECK(ref.o[0] == 0.0);
    }
  }
}

TEST_CASE("a sample of heads gives exactly those heads' rows") {
  const AttentionShape s = make_shape(3, 4, 2, 9, 13, 8, true);
  auto q = random_values(s.q_elements(), 3, 0), k = random_values(s.kv_elements(), 3, 1),
       v = random_values(s.kv_elements(), 3, 2);
  const ForwardReference full = reference_forward(s, q, k, v, all_heads(s));
  const std::vector<HeadIndex> some = {{0, 1}, {2, 3}};
  const ForwardReference part = reference_forward(s, q, k, v, some);
  const size_t per_head = size_t(s.seqlen_q) * s.head_dim;
  for (size_t n = 0; n < some.size(); ++n) {
    const size_t at = (size_t(some[n].batch) * s.heads_q + some[n].head) * per_head;
    for (size_t i = 0; i < per_head; ++i) CHECK(part.o[n * per_head + i] == full.o[at + i]);
  }
}

TEST_CASE("sample_heads keeps the first and last pair and stays within budget") {
  const AttentionShape s = make_shape(8, 16, 16, 512, 512, 64, false);
  const double per_head = 2.0 * 512 * 512 * 64;
  const auto heads = sample_heads(s, 10 * per_head, 7);
  CHECK(heads.size() == 10);
  CHECK(heads.front() == HeadIndex{0, 0});
  CHECK(heads.back() == HeadIndex{7, 15});
  for (size_t i = 1; i < heads.size(); ++i)
    CHECK(heads[i - 1].batch * 16 + heads[i - 1].head < heads[i].batch * 16 + heads[i].head);
  CHECK(sample_heads(s, 1e30, 7).size() == 128);
  CHECK(sample_heads(s, 0, 7).size() == 2);
  CHECK(sample_heads(s, 1e30, 7, 5).size() == 5);
  const auto first_only = sample_heads(s, 1e30, 7, 1);
  REQUIRE(first_only.size() == 1);
  CHECK(first_only[0] == HeadIndex{0, 0});
}

TEST_CASE("the plain-bf16 reference is close to, but not the same as, the double one") {
  // It sets the bf16 chapters' tolerance, so it must be a real bf16 computation: errors of the
  // order of bf16's 2^-8 relative step, not zero and not large.
  const AttentionShape s = make_shape(1, 2, 2, 100, 100, 64, false);
  auto q = random_values(s.q_elements(), 5, 0), k = random_values(s.kv_elements(), 5, 1),
       v = random_values(s.kv_elements(), 5, 2);
  round_to_bf16(q);
  round_to_bf16(k);
  round_to_bf16(v);
  const ForwardReference exact = reference_forward(s, q, k, v, all_heads(s));
  const ForwardReference plain =
      reference_forward(s, q, k, v, all_heads(s), RefPrecision::kPlainBf16);
  const double err = max_abs_diff(exact.o, plain.o);
  CHECK(err > 1e-4);
  CHECK(err < 2e-2);
}

TEST_CASE("backward reference matches finite differences of sum(dout * O)") {
  for (bool causal : {false, true}) {
    // seqlen_q > seqlen_k with causal leaves one row that sees no key: its gradients are zero.
    const AttentionShape s = make_shape(1, 2, 1, 5, 4, 3, causal);
    CAPTURE(causal);
    auto q = random_values(s.q_elements(), 21, 0), k = random_values(s.kv_elements(), 21, 1),
         v = random_values(s.kv_elements(), 21, 2), dout = random_values(s.q_elements(), 21, 3);
    const BackwardReference grad = reference_backward(s, q, k, v, dout);
    auto loss = [&]() {
      const ForwardReference f = reference_forward(s, q, k, v, all_heads(s));
      double l = 0;
      for (size_t i = 0; i < f.o.size(); ++i) l += f.o[i] * dout[i];
      return l;
    };
    auto check_gradient = [&](std::vector<float>& x, const std::vector<double>& analytic) {
      for (size_t i = 0; i < x.size(); ++i) {
        const float saved = x[i], h = 1e-2f;
        x[i] = saved + h;
        const double up = loss();
        x[i] = saved - h;
        const double down = loss();
        x[i] = saved;
        const double numeric = (up - down) / (double(saved + h) - double(saved - h));
        CHECK(std::abs(numeric - analytic[i]) < 1e-3 * (1 + std::abs(numeric)));
      }
    };
    check_gradient(q, grad.dq);
    check_gradient(k, grad.dk);
    check_gradient(v, grad.dv);
  }
}

TEST_CASE("tiled backward reference equals the loop definition") {
  // GQA 4 with odd lengths; seqlen_q > seqlen_k under causal (rows that see no key); more rows and
  // keys than one tile (64 x 128) so several row blocks and key tiles meet, causal and not.
  const AttentionShape shapes[] = {
      make_shape(2, 8, 2, 37, 70, 16, false), make_shape(2, 8, 2, 37, 70, 16, true),
      make_shape(1, 4, 1, 70, 37, 16, true), make_shape(1, 2, 2, 150, 300, 8, true),
      make_shape(1, 1, 1, 300, 150, 8, false)};
  uint64_t seed = 30;
  for (const AttentionShape& s : shapes) {
    CAPTURE(s.describe());
    BackwardProblem p(s, seed++);
    const BackwardReference loop = loop_backward(s, p.q, p.k, p.v, p.dout);
    const BackwardReference tiled = reference_backward(s, p.q, p.k, p.v, p.dout);
    CHECK(max_abs_diff(tiled.dq, loop.dq) < 1e-12);
    CHECK(max_abs_diff(tiled.dk, loop.dk) < 1e-12);
    CHECK(max_abs_diff(tiled.dv, loop.dv) < 1e-12);
    CHECK(max_abs_diff(tiled.o, loop.o) < 1e-12);
    CHECK(max_abs_diff(tiled.lse, loop.lse) < 1e-12);
  }
}

TEST_CASE("the per-group backward form equals the full-layout form") {
  // GQA 4, causal with seqlen_q > seqlen_k, odd lengths; every group from a copy of its own.
  const AttentionShape s = make_shape(2, 8, 2, 70, 37, 16, true);
  BackwardProblem p(s, 40);
  for (RefPrecision precision : {RefPrecision::kDouble, RefPrecision::kPlainBf16}) {
    CAPTURE(int(precision));
    const BackwardReference full = reference_backward(s, p.q, p.k, p.v, p.dout, precision);
    check_same_bits(reference_backward(s, p.groups({0, 1, 2, 3}), precision), full);
  }
}

TEST_CASE("a sample of backward groups gives exactly those groups' results") {
  const AttentionShape s = make_shape(2, 8, 2, 70, 37, 16, true);
  BackwardProblem p(s, 41);
  const BackwardReference full = reference_backward(s, p.q, p.k, p.v, p.dout);
  const std::vector<size_t> sample = {3, 0};  // out of layout order on purpose
  const BackwardReference part = reference_backward(s, p.groups(sample));
  const size_t q_group = size_t(s.group_size()) * s.seqlen_q * s.head_dim;
  const size_t lse_group = size_t(s.group_size()) * s.seqlen_q;
  const size_t kv_group = size_t(s.seqlen_k) * s.head_dim;
  auto slice = [](const std::vector<double>& x, size_t at, size_t n) {
    return std::vector<double>(x.begin() + at, x.begin() + at + n);
  };
  for (size_t n = 0; n < sample.size(); ++n) {
    CAPTURE(sample[n]);
    const size_t g = sample[n];
    CHECK(same_bits(slice(part.dq, n * q_group, q_group), slice(full.dq, g * q_group, q_group)));
    CHECK(same_bits(slice(part.o, n * q_group, q_group), slice(full.o, g * q_group, q_group)));
    CHECK(same_bits(slice(part.lse, n * lse_group, lse_group),
                    slice(full.lse, g * lse_group, lse_group)));
    CHECK(
        same_bits(slice(part.dk, n * kv_group, kv_group), slice(full.dk, g * kv_group, kv_group)));
    CHECK(
        same_bits(slice(part.dv, n * kv_group, kv_group), slice(full.dv, g * kv_group, kv_group)));
  }
  CHECK(part.dq.size() == sample.size() * q_group);
  CHECK(part.dk.size() == sample.size() * kv_group);
}

TEST_CASE("the backward reference's o and lse are the forward reference's") {
  // The runner checks a backward run's forward output against these, so they must be the forward
  // reference's up to rounding (the backward sums the softmax over key tiles, the forward in one).
  const AttentionShape shapes[] = {make_shape(1, 4, 2, 150, 300, 16, true),
                                   make_shape(2, 4, 1, 70, 37, 16, true)};
  uint64_t seed = 50;
  for (const AttentionShape& s : shapes) {
    CAPTURE(s.describe());
    BackwardProblem p(s, seed++);
    const BackwardReference grad = reference_backward(s, p.q, p.k, p.v, p.dout);
    const ForwardReference fwd = reference_forward(s, p.q, p.k, p.v, all_heads(s));
    CHECK(max_abs_diff(grad.o, fwd.o) < 1e-12);
    CHECK(max_abs_diff(grad.lse, fwd.lse) < 1e-12);
    CHECK(grad.max_abs_logit == doctest::Approx(fwd.max_abs_logit).epsilon(1e-12));
    CHECK(grad.max_abs_logit > 0);
  }
}

TEST_CASE("backward rows that see no key get zero gradients and lse -inf, and nothing is NaN") {
  // Causal, 70 queries over 37 keys: the first 33 rows of each head see nothing.
  const AttentionShape s = make_shape(1, 4, 2, 70, 37, 16, true);
  BackwardProblem p(s, 60);
  round_to_bf16(p.q);
  round_to_bf16(p.k);
  round_to_bf16(p.v);
  round_to_bf16(p.dout);
  const int blind_rows = s.seqlen_q - s.seqlen_k, d = s.head_dim;
  for (RefPrecision precision : {RefPrecision::kDouble, RefPrecision::kPlainBf16}) {
    CAPTURE(int(precision));
    const BackwardReference g = reference_backward(s, p.q, p.k, p.v, p.dout, precision);
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seqlen_q; ++i) {
        const size_t row = size_t(h) * s.seqlen_q + i;
        if (i < blind_rows) {
          CHECK(g.lse[row] == kNegInf);
        } else {
          CHECK(std::isfinite(g.lse[row]));
        }
        for (int c = 0; c < d; ++c) {
          if (i < blind_rows) {
            CHECK(g.dq[row * d + c] == 0.0);
            CHECK(g.o[row * d + c] == 0.0);
          }
          CHECK(std::isfinite(g.dq[row * d + c]));
          CHECK(std::isfinite(g.o[row * d + c]));
        }
      }
    for (double x : g.dk) CHECK(std::isfinite(x));
    for (double x : g.dv) CHECK(std::isfinite(x));
  }
}

TEST_CASE("the plain-bf16 backward reference is close to, but not the same as, the double one") {
  // It sets the bf16 chapters' gradient tolerances, so it must be a real bf16 computation: errors
  // of the order of bf16's 2^-8 relative step, not zero and not beyond the 1e-2 floor.
  const AttentionShape s = make_shape(1, 4, 2, 100, 150, 64, true);
  BackwardProblem p(s, 70);
  round_to_bf16(p.q);
  round_to_bf16(p.k);
  round_to_bf16(p.v);
  round_to_bf16(p.dout);
  const BackwardReference exact = reference_backward(s, p.q, p.k, p.v, p.dout);
  const BackwardReference plain =
      reference_backward(s, p.q, p.k, p.v, p.dout, RefPrecision::kPlainBf16);
  struct Compared {
    std::string name;
    const std::vector<double>& plain;
    const std::vector<double>& exact;
  };
  for (const Compared& c :
       {Compared{"o", plain.o, exact.o}, Compared{"dq", plain.dq, exact.dq},
        Compared{"dk", plain.dk, exact.dk}, Compared{"dv", plain.dv, exact.dv}}) {
    CAPTURE(c.name);
    const double err = relative_error(c.plain, c.exact);
    CHECK(err > 1e-4);
    CHECK(err < 1e-2);
  }
}

TEST_CASE("the backward reference gives the same bits on every run") {
  // One group and a long causal sequence: many tasks in both passes, taken by whichever thread is
  // free, so each run schedules them differently.
  const AttentionShape s = make_shape(1, 2, 1, 700, 650, 32, true);
  BackwardProblem p(s, 80);
  for (RefPrecision precision : {RefPrecision::kDouble, RefPrecision::kPlainBf16}) {
    CAPTURE(int(precision));
    check_same_bits(reference_backward(s, p.q, p.k, p.v, p.dout, precision),
                    reference_backward(s, p.q, p.k, p.v, p.dout, precision));
  }
}

TEST_CASE("the backward reference's memory follows its workers, not seqlen_q x seqlen_k") {
  // One group at seqlen 16384, head_dim 128: a whole S in double alone would be 2 GiB.
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t per_row = 3 * sizeof(double);  // softmax maximum, sum and D, per query row
  const AttentionShape one_tile = make_shape(1, 1, 1, 64, 128, 128);  // one task per pass
  const size_t one_worker = reference_backward_worker_bytes(one_tile, 1) - 64 * per_row;
  const AttentionShape long_seq = make_shape(1, 1, 1, 16384, 16384, 128, true);
  const size_t long_bytes = reference_backward_worker_bytes(long_seq, 1);
  CHECK(long_bytes < size_t(200) << 20);
  // 256 blocks of rows: as many workers as cores, each with tiles of the same size as above.
  CHECK(long_bytes == std::min<size_t>(cores, 256) * one_worker + 16384 * per_row);
  // Twice the sequence: the same workers, and only the per-row statistics grow.
  const AttentionShape longer_seq = make_shape(1, 1, 1, 32768, 32768, 128, true);
  CHECK(reference_backward_worker_bytes(longer_seq, 1) == long_bytes + 16384 * per_row);
  CHECK(reference_backward_worker_bytes(long_seq, 0) == 0);
}

TEST_CASE("decode reference equals the forward reference with one query row") {
  DecodeShape d;
  d.batch = 4;
  d.heads_q = 4;
  d.heads_kv = 2;
  d.head_dim = 16;
  d.max_seqlen_k = 40;
  d.seqlens_k = {40, 1, 0, 23};  // full, one token, empty, partial
  auto q = random_values(size_t(d.batch) * d.heads_q * d.head_dim, 8, 0);
  const size_t cache = size_t(d.batch) * d.heads_kv * d.max_seqlen_k * d.head_dim;
  auto k = random_values(cache, 8, 1), v = random_values(cache, 8, 2);
  // Poison what lies past each sequence's length: a read of it would make NaN.
  for (int b = 0; b < d.batch; ++b)
    for (int h = 0; h < d.heads_kv; ++h)
      for (int t = d.seqlens_k[b]; t < d.max_seqlen_k; ++t)
        for (int c = 0; c < d.head_dim; ++c) {
          const size_t at = ((size_t(b) * d.heads_kv + h) * d.max_seqlen_k + t) * d.head_dim + c;
          k[at] = v[at] = std::numeric_limits<float>::quiet_NaN();
        }
  const DecodeReference dec = reference_decode(d, q, k, v);
  for (int b = 0; b < d.batch; ++b) {
    CAPTURE(b);
    const int len = d.seqlens_k[b];
    if (len == 0) {
      for (int h = 0; h < d.heads_q; ++h) CHECK(dec.lse[size_t(b) * d.heads_q + h] == kNegInf);
      continue;
    }
    // The same sequence as a forward problem of batch 1 with seqlen_q = 1.
    AttentionShape s = make_shape(1, d.heads_q, d.heads_kv, 1, len, d.head_dim, false);
    std::vector<float> qb(q.begin() + size_t(b) * d.heads_q * d.head_dim,
                          q.begin() + size_t(b + 1) * d.heads_q * d.head_dim);
    std::vector<float> kb, vb;
    for (int h = 0; h < d.heads_kv; ++h) {
      const size_t at = (size_t(b) * d.heads_kv + h) * d.max_seqlen_k * d.head_dim;
      kb.insert(kb.end(), k.begin() + at, k.begin() + at + size_t(len) * d.head_dim);
      vb.insert(vb.end(), v.begin() + at, v.begin() + at + size_t(len) * d.head_dim);
    }
    const ForwardReference f = reference_forward(s, qb, kb, vb, all_heads(s));
    for (int i = 0; i < d.heads_q * d.head_dim; ++i)
      CHECK(dec.o[size_t(b) * d.heads_q * d.head_dim + i] ==
            doctest::Approx(f.o[i]).epsilon(1e-12));
    for (int h = 0; h < d.heads_q; ++h)
      CHECK(dec.lse[size_t(b) * d.heads_q + h] == doctest::Approx(f.lse[h]).epsilon(1e-12));
  }
}

TEST_CASE("paged decode reference equals decode on the same tokens, and ignores unused slots") {
  DecodeShape d;
  d.batch = 3;
  d.heads_q = 4;
  d.heads_kv = 1;
  d.head_dim = 8;
  d.max_seqlen_k = 50;
  d.seqlens_k = {50, 17, 3};
  const int page_size = 16, max_pages = 4, num_pages = 12;
  auto q = random_values(size_t(d.batch) * d.heads_q * d.head_dim, 9, 0);
  const size_t cache = size_t(d.batch) * d.heads_kv * d.max_seqlen_k * d.head_dim;
  auto k = random_values(cache, 9, 1), v = random_values(cache, 9, 2);
  // Pages handed out in a scrambled order; every slot that holds no token stays NaN.
  const size_t page_elems = size_t(page_size) * d.heads_kv * d.head_dim;
  std::vector<float> k_pages(num_pages * page_elems, NAN), v_pages(num_pages * page_elems, NAN);
  std::vector<int> block_table(size_t(d.batch) * max_pages, -1);
  std::vector<int> free_pages(num_pages);
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::reverse(free_pages.begin(), free_pages.end());
  std::swap(free_pages[1], free_pages[5]);
  size_t next_page = 0;
  for (int b = 0; b < d.batch; ++b)
    for (int t = 0; t < d.seqlens_k[b]; ++t) {
      int& page = block_table[size_t(b) * max_pages + t / page_size];
      if (page < 0) page = free_pages[next_page++];
      for (int h = 0; h < d.heads_kv; ++h)
        for (int c = 0; c < d.head_dim; ++c) {
          const size_t dst =
              ((size_t(page) * page_size + t % page_size) * d.heads_kv + h) * d.head_dim + c;
          const size_t src = ((size_t(b) * d.heads_kv + h) * d.max_seqlen_k + t) * d.head_dim + c;
          k_pages[dst] = k[src];
          v_pages[dst] = v[src];
        }
    }
  const DecodeReference paged =
      reference_paged_decode(d, q, k_pages, v_pages, page_size, block_table, max_pages);
  const DecodeReference plain = reference_decode(d, q, k, v);
  for (size_t i = 0; i < plain.o.size(); ++i) {
    REQUIRE(std::isfinite(paged.o[i]));
    CHECK(paged.o[i] == plain.o[i]);
  }
  for (size_t i = 0; i < plain.lse.size(); ++i) CHECK(paged.lse[i] == plain.lse[i]);
}

TEST_CASE("the reference's worker memory follows its tasks, not the size of the whole problem") {
  // 33 queries over a million keys, 2 heads: two tasks, so at most two workers, each with K and V
  // in double (2 x 2^20 x 128 x 8 bytes) and S, P for 64 rows.
  const AttentionShape s = make_shape(1, 8, 1, 33, 1 << 20, 128);
  const size_t per_worker = 8 * (2 * size_t(1 << 20) * 128 + 3 * 64 * size_t(1 << 20) + 64 * 128);
  const size_t two_heads = reference_forward_worker_bytes(s, 2);
  CHECK(two_heads <= 2 * per_worker);
  CHECK(two_heads >= per_worker);
  CHECK(reference_forward_worker_bytes(s, 0) == 0);
}
