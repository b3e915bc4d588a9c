// The CPU references are what every kernel is judged by, so they are checked first: the Eigen
// forward against plain loops, the backward against finite differences and plain loops, and the
// decode references against the forward one. Label `cpu`: runs everywhere, CI included.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "host_data.h"
#include "page_allocator.h"
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

namespace {

DecodeShape decode_shape(int heads_q, int heads_kv, int seqlen_q, int head_dim,
                         const std::vector<int>& seqlens_k, int max_seqlen_k) {
  DecodeShape d;
  d.batch = int(seqlens_k.size());
  d.heads_q = heads_q;
  d.heads_kv = heads_kv;
  d.seqlen_q = seqlen_q;
  d.head_dim = head_dim;
  d.seqlens_k = seqlens_k;
  d.max_seqlen_k = max_seqlen_k;
  return d;
}

// A decode problem with a contiguous cache whose slots past each sequence's length hold NaN, so a
// reference that reads one shows it in its output.
struct DecodeProblem {
  DecodeShape shape;
  std::vector<float> q, k, v;

  DecodeProblem(const DecodeShape& s, uint64_t seed) : shape(s) {
    q = random_values(s.q_elements(), seed, 0);
    k = random_values(s.cache_elements(), seed, 1);
    v = random_values(s.cache_elements(), seed, 2);
    for (int b = 0; b < s.batch; ++b)
      for (int h = 0; h < s.heads_kv; ++h)
        for (int t = s.seqlens_k[b]; t < s.max_seqlen_k; ++t)
          for (int c = 0; c < s.head_dim; ++c)
            k[cache_at(b, h, t) + c] = v[cache_at(b, h, t) + c] =
                std::numeric_limits<float>::quiet_NaN();
  }

  // Where token t of sequence b, key/value head h, starts in the contiguous cache.
  size_t cache_at(int b, int h, int t) const {
    return ((size_t(b) * shape.heads_kv + h) * shape.max_seqlen_k + t) * shape.head_dim;
  }
  size_t q_per_sequence() const { return size_t(shape.heads_q) * shape.seqlen_q * shape.head_dim; }

  // Sequence b alone as a forward problem: batch 1, its seqlen_q new tokens against its
  // seqlens_k[b] keys, causal (bottom-right aligned, as decode is), or not when asked.
  ForwardReference forward_of(int b, bool causal = true) const {
    const int len = shape.seqlens_k[b];
    const AttentionShape s =
        make_shape(1, shape.heads_q, shape.heads_kv, shape.seqlen_q, len, shape.head_dim, causal);
    std::vector<float> qb(q.begin() + b * q_per_sequence(), q.begin() + (b + 1) * q_per_sequence());
    std::vector<float> kb, vb;
    for (int h = 0; h < shape.heads_kv; ++h) {
      kb.insert(kb.end(), k.begin() + cache_at(b, h, 0), k.begin() + cache_at(b, h, len));
      vb.insert(vb.end(), v.begin() + cache_at(b, h, 0), v.begin() + cache_at(b, h, len));
    }
    return reference_forward(s, qb, kb, vb, all_heads(s));
  }
};

// The rows of sequence b in a decode result laid out like q.
std::vector<double> sequence_rows(const std::vector<double>& x, int b, size_t per_sequence) {
  return std::vector<double>(x.begin() + b * per_sequence, x.begin() + (b + 1) * per_sequence);
}

// Checks every sequence of a whole-tensor decode result against the forward reference of that
// sequence alone, and that each row that sees no key (new token i of a sequence of length L sees
// none when i + L - seqlen_q < 0) has o = 0 and lse -inf. Returns how many such rows there were.
int check_decode_against_forward(const DecodeProblem& p, const DecodeReference& dec) {
  const DecodeShape& s = p.shape;
  const size_t lse_per_sequence = size_t(s.heads_q) * s.seqlen_q;
  REQUIRE(dec.o.size() == size_t(s.q_elements()));
  REQUIRE(dec.lse.size() == size_t(s.lse_elements()));
  int blind_rows = 0;
  double max_abs_logit = 0;
  for (int b = 0; b < s.batch; ++b) {
    CAPTURE(b);
    const int len = s.seqlens_k[b];
    const std::vector<double> o = sequence_rows(dec.o, b, p.q_per_sequence());
    const std::vector<double> lse = sequence_rows(dec.lse, b, lse_per_sequence);
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seqlen_q; ++i) {
        const size_t row = size_t(h) * s.seqlen_q + i;
        if (i + len - s.seqlen_q >= 0) {
          CHECK(std::isfinite(lse[row]));
          continue;
        }
        ++blind_rows;
        CHECK(lse[row] == kNegInf);
        for (int c = 0; c < s.head_dim; ++c) CHECK(o[row * s.head_dim + c] == 0.0);
      }
    if (len == 0) continue;  // nothing to compare with: a forward problem needs keys
    const ForwardReference f = p.forward_of(b);
    CHECK(max_abs_diff(o, f.o) < 1e-12);
    CHECK(max_abs_diff(lse, f.lse) < 1e-12);
    max_abs_logit = std::max(max_abs_logit, f.max_abs_logit);
  }
  CHECK(dec.max_abs_logit == doctest::Approx(max_abs_logit).epsilon(1e-12));
  return blind_rows;
}

}  // namespace

TEST_CASE("decode with one new token equals the non-causal forward reference with one query row") {
  // One new token sees its whole sequence, so the causal mask has nothing to hide.
  const DecodeProblem p(decode_shape(4, 2, 1, 16, {40, 1, 0, 23}, 40), 8);
  const DecodeReference dec = reference_decode(p.shape, p.q, p.k, p.v);
  for (int b = 0; b < p.shape.batch; ++b) {
    CAPTURE(b);
    const std::vector<double> lse = sequence_rows(dec.lse, b, p.shape.heads_q);
    if (p.shape.seqlens_k[b] == 0) {
      for (double x : lse) CHECK(x == kNegInf);
      for (double x : sequence_rows(dec.o, b, p.q_per_sequence())) CHECK(x == 0.0);
      continue;
    }
    const ForwardReference f = p.forward_of(b, false);
    CHECK(max_abs_diff(sequence_rows(dec.o, b, p.q_per_sequence()), f.o) < 1e-12);
    CHECK(max_abs_diff(lse, f.lse) < 1e-12);
  }
}

TEST_CASE("decode with several new tokens equals the causal forward reference of each sequence") {
  // Sequences of different lengths in one batch, multi-head, GQA and multi-query, 1 to 8 new
  // tokens; the cache has room to spare, and NaN in it past each length.
  const DecodeShape shapes[] = {
      decode_shape(4, 4, 3, 16, {40, 9, 23, 17}, 45), decode_shape(8, 2, 8, 16, {40, 9, 8, 70}, 80),
      decode_shape(6, 1, 2, 8, {5, 33, 2}, 33), decode_shape(4, 2, 1, 32, {100, 3}, 128)};
  uint64_t seed = 30;
  for (const DecodeShape& s : shapes) {
    CAPTURE(s.describe());
    const DecodeProblem p(s, seed++);
    CHECK(check_decode_against_forward(p, reference_decode(s, p.q, p.k, p.v)) == 0);
  }
}

TEST_CASE("decode rows that see no key give o = 0 and lse -inf, and the others match the forward") {
  // Five new tokens: an empty sequence (no row sees a key), two shorter than the new tokens (the
  // first three and the first one see none), one exactly as long and one longer.
  const DecodeProblem p(decode_shape(4, 2, 5, 16, {0, 2, 4, 5, 12}, 12), 40);
  const DecodeReference dec = reference_decode(p.shape, p.q, p.k, p.v);
  CHECK(check_decode_against_forward(p, dec) == p.shape.heads_q * (5 + 3 + 1));
  for (double x : dec.o) CHECK(!std::isnan(x));
}

TEST_CASE("the per-group decode form equals the whole-tensor form") {
  // Some groups, out of order, each from buffers of its own holding only its sequence's keys (the
  // empty sequence's hold nothing at all), as the runner passes a sample.
  const DecodeProblem p(decode_shape(6, 2, 4, 16, {30, 0, 3, 17}, 32), 50);
  const DecodeShape& s = p.shape;
  const DecodeReference whole = reference_decode(s, p.q, p.k, p.v);
  const size_t group_rows = size_t(s.group_size()) * s.seqlen_q;
  const std::vector<size_t> chosen = {5, 0, 2, 3, 6};  // flat (sequence, kv head) indices
  std::vector<std::vector<float>> copies;
  copies.reserve(3 * chosen.size());
  auto copy = [&](const std::vector<float>& from, size_t at, size_t n) {
    copies.emplace_back(from.begin() + at, from.begin() + at + n);
    return copies.back().data();
  };
  std::vector<DecodeGroupInputs> groups;
  for (size_t g : chosen) {
    const int b = int(g / s.heads_kv), h = int(g % s.heads_kv);
    const size_t keys = size_t(s.seqlens_k[b]) * s.head_dim;
    groups.push_back({b, copy(p.q, g * group_rows * s.head_dim, group_rows * s.head_dim),
                      copy(p.k, p.cache_at(b, h, 0), keys), copy(p.v, p.cache_at(b, h, 0), keys)});
  }
  const DecodeReference part = reference_decode(s, groups);
  REQUIRE(part.o.size() == chosen.size() * group_rows * s.head_dim);
  REQUIRE(part.lse.size() == chosen.size() * group_rows);
  for (size_t n = 0; n < chosen.size(); ++n) {
    CAPTURE(chosen[n]);
    const size_t at = chosen[n] * group_rows;
    for (size_t r = 0; r < group_rows; ++r) {
      CHECK(part.lse[n * group_rows + r] == whole.lse[at + r]);
      for (int c = 0; c < s.head_dim; ++c)
        CHECK(part.o[(n * group_rows + r) * s.head_dim + c] == whole.o[(at + r) * s.head_dim + c]);
    }
  }
  CHECK(part.max_abs_logit > 0);
  CHECK(part.max_abs_logit <= whole.max_abs_logit);
}

TEST_CASE("paged decode reference equals the contiguous one, wherever the pages lie") {
  // The pages come from a shuffled pool to sequences that grow a token at a time in turn, so each
  // sequence's pages lie scattered and interleaved with the others'. Every slot that holds no
  // token (past a sequence's length, and the pages nobody took) is NaN: a read of one shows.
  const DecodeProblem p(decode_shape(4, 2, 3, 8, {50, 17, 0, 3, 33}, 50), 60);
  const DecodeShape& s = p.shape;
  const int page_size = 16, num_pages = 14, max_pages = 5;
  PageAllocator pool(num_pages, page_size, 9);
  std::vector<int> seqs;
  for (int b = 0; b < s.batch; ++b) seqs.push_back(pool.add_sequence());
  for (int t = 0; t < s.longest_seqlen_k(); ++t)
    for (int b = 0; b < s.batch; ++b)
      if (t < s.seqlens_k[b]) pool.append(seqs[b], 1);
  REQUIRE(pool.free_pages() > 0);  // some pages stay unused, and NaN
  CHECK(!std::is_sorted(pool.pages(seqs[0]).begin(), pool.pages(seqs[0]).end()));
  const std::vector<int> block_table = pool.block_table(seqs, max_pages);
  const size_t page_elements = size_t(page_size) * s.heads_kv * s.head_dim;
  std::vector<float> k_pages(num_pages * page_elements, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> v_pages = k_pages;
  for (int b = 0; b < s.batch; ++b)
    for (int t = 0; t < s.seqlens_k[b]; ++t)
      for (int h = 0; h < s.heads_kv; ++h) {
        const size_t page = pool.pages(seqs[b])[t / page_size];
        const size_t slot = ((page * page_size + t % page_size) * s.heads_kv + h) * s.head_dim;
        std::copy_n(p.k.begin() + p.cache_at(b, h, t), s.head_dim, k_pages.begin() + slot);
        std::copy_n(p.v.begin() + p.cache_at(b, h, t), s.head_dim, v_pages.begin() + slot);
      }
  for (RefPrecision precision : {RefPrecision::kDouble, RefPrecision::kPlainBf16}) {
    CAPTURE(int(precision));
    const DecodeReference paged = reference_paged_decode(s, p.q, k_pages, v_pages, page_size,
                                                         block_table, max_pages, precision);
    const DecodeReference contiguous = reference_decode(s, p.q, p.k, p.v, precision);
    for (double x : paged.o) CHECK(!std::isnan(x));
    CHECK(same_bits(paged.o, contiguous.o));
    CHECK(same_bits(paged.lse, contiguous.lse));
    CHECK(paged.max_abs_logit == contiguous.max_abs_logit);
  }
  // A block table that names no page for a token the sequence holds is refused.
  std::vector<int> holed = block_table;
  holed[1] = -1;  // sequence 0's second page
  CHECK_THROWS_AS(reference_paged_decode(s, p.q, k_pages, v_pages, page_size, holed, max_pages),
                  std::invalid_argument);
}

TEST_CASE("the plain-bf16 decode reference is close to, but not the same as, the double one") {
  // It sets the bf16 decode chapters' tolerance, so it must be a real bf16 computation: errors of
  // the order of bf16's 2^-8 relative step, not zero and not beyond the 1e-2 floor.
  DecodeProblem p(decode_shape(8, 2, 4, 64, {100, 37, 64}, 100), 70);
  round_to_bf16(p.q);
  round_to_bf16(p.k);
  round_to_bf16(p.v);
  const DecodeReference exact = reference_decode(p.shape, p.q, p.k, p.v);
  const DecodeReference plain = reference_decode(p.shape, p.q, p.k, p.v, RefPrecision::kPlainBf16);
  const double err = relative_error(plain.o, exact.o);
  CHECK(err > 1e-4);
  CHECK(err < 1e-2);
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
