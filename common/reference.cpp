#include "reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <thread>

#include <Eigen/Dense>

#include "host_data.h"

namespace attn {
namespace {

using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMapF = Eigen::Map<const MatrixF>;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Runs body(i) for i in [0, n) on all cores. Each i must touch disjoint outputs.
template <typename Body>
void parallel_for(size_t n, Body&& body) {
  size_t workers = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) body(i);
  };
  std::vector<std::thread> pool;
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

// How many keys query row `row` sees.
int visible_keys(int row, int seqlen_k, bool causal, int causal_offset) {
  if (!causal) return seqlen_k;
  return std::clamp(row + causal_offset + 1, 0, seqlen_k);
}

constexpr int kRowsPerBlock = 64;  // query rows per piece of work: S never needs sq x sk doubles

// Attention for query rows [first_row, last_row) of one head: q [sq x d], k and v [sk x d], all
// row-major float; writes those rows of o [sq x d] and lse [sq]. Returns the largest |logit| the
// rows see.
double attend_rows(const float* q, const float* k, const float* v, int sq, int sk, int d,
                   int first_row, int last_row, bool causal, int causal_offset, double scale,
                   RefPrecision precision, double* o, double* lse) {
  ConstMapF q_f(q, sq, d), k_f(k, sk, d), v_f(v, sk, d);
  const MatrixD k_d = k_f.cast<double>(), v_d = v_f.cast<double>();
  double max_abs_logit = 0;
  for (int row0 = first_row; row0 < last_row; row0 += kRowsPerBlock) {
    const int rows = std::min(kRowsPerBlock, last_row - row0);
    MatrixD s;
    if (precision == RefPrecision::kDouble) {
      s = (q_f.middleRows(row0, rows).cast<double>() * k_d.transpose()) * scale;
    } else {
      // Products of bf16 values are exact in float; Eigen sums them in float, like a GPU would.
      MatrixF s_f = (q_f.middleRows(row0, rows) * k_f.transpose()) * float(scale);
      s = s_f.unaryExpr([](float x) { return round_to_bf16(x); }).cast<double>();
    }
    MatrixD p = MatrixD::Zero(rows, sk);
    std::vector<double> row_sum(rows, 0.0);
    for (int i = 0; i < rows; ++i) {
      const int visible = visible_keys(row0 + i, sk, causal, causal_offset);
      if (visible == 0) {
        lse[row0 + i] = kNegInf;
        continue;
      }
      auto seen = s.row(i).head(visible);
      const double row_max = seen.maxCoeff();
      max_abs_logit = std::max(max_abs_logit, seen.cwiseAbs().maxCoeff());
      if (precision == RefPrecision::kDouble) {
        p.row(i).head(visible) = (seen.array() - row_max).exp().matrix();
        row_sum[i] = p.row(i).sum();
      } else {
        // Softmax in float, then the probabilities rounded to bf16 before P V.
        float sum_f = 0;
        for (int j = 0; j < visible; ++j) sum_f += std::exp(float(seen(j) - row_max));
        for (int j = 0; j < visible; ++j)
          p(i, j) = round_to_bf16(std::exp(float(seen(j) - row_max)) / sum_f);
        row_sum[i] = 1.0;  // P is already normalised
      }
      lse[row0 + i] = row_max + std::log(row_sum[i]);
    }
    MatrixD o_block;
    if (precision == RefPrecision::kDouble) {
      o_block = p * v_d;
    } else {
      MatrixF o_f = p.cast<float>() * v_f;
      o_block = o_f.unaryExpr([](float x) { return round_to_bf16(x); }).cast<double>();
    }
    for (int i = 0; i < rows; ++i) {
      const double inv = row_sum[i] > 0 ? 1.0 / row_sum[i] : 0.0;
      for (int c = 0; c < d; ++c) o[size_t(row0 + i) * d + c] = o_block(i, c) * inv;
    }
  }
  return max_abs_logit;
}

}  // namespace

size_t kv_head_of(const AttentionShape& shape, const HeadIndex& h) {
  return size_t(h.batch) * shape.heads_kv + h.head / shape.group_size();
}

std::vector<HeadIndex> all_heads(const AttentionShape& shape) {
  std::vector<HeadIndex> heads;
  for (int b = 0; b < shape.batch; ++b)
    for (int h = 0; h < shape.heads_q; ++h) heads.push_back({b, h});
  return heads;
}

std::vector<HeadIndex> sample_heads(const AttentionShape& shape, double mac_budget, uint64_t seed,
                                    size_t max_heads) {
  std::vector<HeadIndex> every = all_heads(shape);
  const double macs_per_head = 2.0 * shape.seqlen_q * double(shape.seqlen_k) * shape.head_dim;
  double affordable = std::max(2.0, std::floor(mac_budget / macs_per_head));
  if (max_heads > 0) affordable = std::min(affordable, double(max_heads));
  if (affordable >= double(every.size())) return every;
  if (affordable < 2) return {every.front()};
  const size_t wanted = size_t(affordable);
  // Keep the first and last pair (edges of the grid), then a seeded shuffle of the middle.
  std::vector<size_t> middle(every.size() - 2);
  std::iota(middle.begin(), middle.end(), size_t(1));
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = middle.size(); i > 1; --i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(middle[i - 1], middle[(state >> 33) % i]);
  }
  std::vector<size_t> chosen = {0, every.size() - 1};
  chosen.insert(chosen.end(), middle.begin(), middle.begin() + (wanted - 2));
  std::sort(chosen.begin(), chosen.end());
  std::vector<HeadIndex> heads;
  for (size_t i : chosen) heads.push_back(every[i]);
  return heads;
}

ForwardReference reference_forward(const AttentionShape& shape, const std::vector<float>& q,
                                   const std::vector<float>& k, const std::vector<float>& v,
                                   const std::vector<HeadIndex>& heads, RefPrecision precision) {
  const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  std::vector<HeadInputs> inputs;
  for (const HeadIndex& h : heads) {
    const size_t kv_head = kv_head_of(shape, h);
    const size_t q_offset = (size_t(h.batch) * shape.heads_q + h.head) * sq * d;
    inputs.push_back(
        {q.data() + q_offset, k.data() + kv_head * sk * d, v.data() + kv_head * sk * d});
  }
  ForwardReference ref = reference_forward(shape, inputs, precision);
  ref.heads = heads;
  return ref;
}

namespace {
// One task per (head, group of row blocks), so that a few long heads still use every core.
size_t rows_per_task(int seqlen_q) {
  const size_t blocks_per_head = (seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock;
  return kRowsPerBlock * std::max<size_t>(1, blocks_per_head / 16);
}
}  // namespace

size_t reference_forward_worker_bytes(const AttentionShape& shape, size_t heads) {
  const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  const size_t task_rows = rows_per_task(shape.seqlen_q);
  const size_t tasks = heads * ((sq + task_rows - 1) / task_rows);
  const size_t workers = std::min<size_t>(tasks, std::max(1u, std::thread::hardware_concurrency()));
  // K and V in double, S and P (and S in float for the plain-bf16 form) for 64 rows, O's rows.
  return workers * 8 * (2 * sk * d + 3 * kRowsPerBlock * sk + kRowsPerBlock * d);
}

ForwardReference reference_forward(const AttentionShape& shape,
                                   const std::vector<HeadInputs>& heads, RefPrecision precision) {
  const int sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  ForwardReference ref;
  ref.o.assign(heads.size() * size_t(sq) * d, 0.0);
  ref.lse.assign(heads.size() * size_t(sq), 0.0);
  const size_t task_rows = rows_per_task(sq);
  const size_t tasks_per_head = (sq + task_rows - 1) / task_rows;
  std::vector<double> max_abs(heads.size() * tasks_per_head, 0.0);
  parallel_for(max_abs.size(), [&](size_t task) {
    const size_t i = task / tasks_per_head;
    const int first_row = int(task % tasks_per_head * task_rows);
    const int last_row = int(std::min<size_t>(sq, first_row + task_rows));
    max_abs[task] =
        attend_rows(heads[i].q, heads[i].k, heads[i].v, sq, sk, d, first_row, last_row,
                    shape.causal, shape.causal_offset(), shape.softmax_scale(), precision,
                    ref.o.data() + i * size_t(sq) * d, ref.lse.data() + i * size_t(sq));
  });
  for (double m : max_abs) ref.max_abs_logit = std::max(ref.max_abs_logit, m);
  return ref;
}

BackwardReference reference_backward(const AttentionShape& shape, const std::vector<float>& q,
                                     const std::vector<float>& k, const std::vector<float>& v,
                                     const std::vector<float>& dout) {
  const int sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  const double scale = shape.softmax_scale();
  BackwardReference grad;
  grad.dq.assign(q.size(), 0.0);
  grad.dk.assign(k.size(), 0.0);
  grad.dv.assign(v.size(), 0.0);
  // One task per key/value head, so that the query heads of its group add into dk, dv in turn.
  const size_t kv_heads = size_t(shape.batch) * shape.heads_kv;
  parallel_for(kv_heads, [&](size_t task) {
    const int b = int(task / shape.heads_kv), kv_head = int(task % shape.heads_kv);
    const size_t kv_offset = task * sk * d;
    const MatrixD k_d = ConstMapF(k.data() + kv_offset, sk, d).cast<double>();
    const MatrixD v_d = ConstMapF(v.data() + kv_offset, sk, d).cast<double>();
    Eigen::Map<MatrixD> dk(grad.dk.data() + kv_offset, sk, d),
        dv(grad.dv.data() + kv_offset, sk, d);
    for (int g = 0; g < shape.group_size(); ++g) {
      const int head = kv_head * shape.group_size() + g;
      const size_t q_offset = (size_t(b) * shape.heads_q + head) * sq * d;
      const MatrixD q_d = ConstMapF(q.data() + q_offset, sq, d).cast<double>();
      const MatrixD do_d = ConstMapF(dout.data() + q_offset, sq, d).cast<double>();
      // Recompute P exactly as the forward pass does.
      MatrixD p = MatrixD::Zero(sq, sk);
      const MatrixD s = (q_d * k_d.transpose()) * scale;
      for (int i = 0; i < sq; ++i) {
        const int visible = visible_keys(i, sk, shape.causal, shape.causal_offset());
        if (visible == 0) continue;
        auto seen = s.row(i).head(visible);
        p.row(i).head(visible) = (seen.array() - seen.maxCoeff()).exp().matrix();
        p.row(i) /= p.row(i).sum();
      }
      const MatrixD o = p * v_d;
      dv += p.transpose() * do_d;
      const MatrixD dp = do_d * v_d.transpose();
      // dS = P * (dP - rowsum(dO * O)): the softmax Jacobian applied row by row.
      const Eigen::VectorXd delta = (do_d.array() * o.array()).rowwise().sum();
      const MatrixD ds = (p.array() * (dp.colwise() - delta).array()).matrix();
      Eigen::Map<MatrixD>(grad.dq.data() + q_offset, sq, d) = scale * ds * k_d;
      dk += scale * ds.transpose() * q_d;
    }
  });
  return grad;
}

namespace {

// Shared by the two decode references: `gather(b, kv_head, k_rows, v_rows)` fills the first
// seqlens_k[b] rows of one sequence's keys and values.
template <typename Gather>
DecodeReference decode_with(const DecodeShape& shape, const std::vector<float>& q,
                            Gather&& gather) {
  const int d = shape.head_dim, group = shape.heads_q / shape.heads_kv;
  const double scale = shape.scale != 0.0f ? shape.scale : 1.0 / std::sqrt(double(d));
  DecodeReference ref;
  ref.o.assign(size_t(shape.batch) * shape.heads_q * d, 0.0);
  ref.lse.assign(size_t(shape.batch) * shape.heads_q, 0.0);
  parallel_for(size_t(shape.batch) * shape.heads_kv, [&](size_t task) {
    const int b = int(task / shape.heads_kv), kv_head = int(task % shape.heads_kv);
    const int len = shape.seqlens_k[b];
    std::vector<float> k_rows(size_t(len) * d), v_rows(size_t(len) * d);
    gather(b, kv_head, k_rows.data(), v_rows.data());
    for (int g = 0; g < group; ++g) {
      const size_t row = size_t(b) * shape.heads_q + kv_head * group + g;
      attend_rows(q.data() + row * d, k_rows.data(), v_rows.data(), 1, len, d, 0, 1, false, 0,
                  scale, RefPrecision::kDouble, ref.o.data() + row * d, ref.lse.data() + row);
    }
  });
  return ref;
}

}  // namespace

DecodeReference reference_decode(const DecodeShape& shape, const std::vector<float>& q,
                                 const std::vector<float>& k_cache,
                                 const std::vector<float>& v_cache) {
  const size_t d = shape.head_dim;
  return decode_with(shape, q, [&](int b, int kv_head, float* k_rows, float* v_rows) {
    const size_t base = (size_t(b) * shape.heads_kv + kv_head) * shape.max_seqlen_k * d;
    std::copy_n(k_cache.begin() + base, shape.seqlens_k[b] * d, k_rows);
    std::copy_n(v_cache.begin() + base, shape.seqlens_k[b] * d, v_rows);
  });
}

DecodeReference reference_paged_decode(const DecodeShape& shape, const std::vector<float>& q,
                                       const std::vector<float>& k_pages,
                                       const std::vector<float>& v_pages, int page_size,
                                       const std::vector<int>& block_table, int max_pages_per_seq) {
  const size_t d = shape.head_dim;
  return decode_with(shape, q, [&](int b, int kv_head, float* k_rows, float* v_rows) {
    for (int t = 0; t < shape.seqlens_k[b]; ++t) {
      const size_t page = block_table[size_t(b) * max_pages_per_seq + t / page_size];
      const size_t src = ((page * page_size + t % page_size) * shape.heads_kv + kv_head) * d;
      std::copy_n(k_pages.begin() + src, d, k_rows + t * d);
      std::copy_n(v_pages.begin() + src, d, v_rows + t * d);
    }
  });
}

}  // namespace attn
