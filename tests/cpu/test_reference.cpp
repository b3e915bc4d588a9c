// The CPU references are what every kernel is judged by, so they are checked first: the Eigen
// forward against plain loops, the backward against finite differences, and the decode references
// against the forward one. Label `cpu`: runs everywhere, CI included.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
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
