#include "reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>

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
  const bool plain_fp8 =
      precision == RefPrecision::kPlainFp8 || precision == RefPrecision::kPlainFp8FloatPv;
  double max_abs_logit = 0;
  for (int row0 = first_row; row0 < last_row; row0 += kRowsPerBlock) {
    const int rows = std::min(kRowsPerBlock, last_row - row0);
    MatrixD s;
    if (precision == RefPrecision::kDouble) {
      s = (q_f.middleRows(row0, rows).cast<double>() * k_d.transpose()) * scale;
    } else if (plain_fp8) {
      s.resize(rows, sk);
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < sk; ++j)
          s(i, j) =
              float(fp8_mma_dot(q + size_t(row0 + i) * d, k + size_t(j) * d, d)) * float(scale);
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
      } else if (plain_fp8) {
        // exp in float scaled by 2^8, rounded to e4m3 for P V; the sum of the unrounded values.
        float sum_f = 0;
        for (int j = 0; j < visible; ++j) {
          const float e = 256.0f * std::exp(float(seen(j) - row_max));
          sum_f += e;
          p(i, j) = round_to_e4m3(e);
        }
        row_sum[i] = sum_f;
      } else {
        // Softmax in float, then the probabilities rounded to bf16 before P V.
        float sum_f = 0;
        for (int j = 0; j < visible; ++j) sum_f += std::exp(float(seen(j) - row_max));
        for (int j = 0; j < visible; ++j)
          p(i, j) = round_to_bf16(std::exp(float(seen(j) - row_max)) / sum_f);
        row_sum[i] = 1.0;                                   // P is already normalised
        lse[row0 + i] = row_max + std::log(double(sum_f));  // the float sum's
        continue;
      }
      lse[row0 + i] = row_max + std::log(row_sum[i]) - (plain_fp8 ? std::log(256.0) : 0.0);
    }
    MatrixD o_block;
    if (precision == RefPrecision::kDouble) {
      o_block = p * v_d;
    } else if (plain_fp8) {
      // O = (P V) / l in float, rounded to bf16 once; P V summed as the tensor cores sum it,
      // each channel's products along the keys, or in float.
      MatrixF o_f;
      if (precision == RefPrecision::kPlainFp8) {
        const MatrixF v_t = v_f.transpose();  // row c: channel c along the keys
        const MatrixF p_f = p.cast<float>();
        o_f.resize(rows, d);
        for (int i = 0; i < rows; ++i)
          for (int c = 0; c < d; ++c) o_f(i, c) = float(fp8_mma_dot(&p_f(i, 0), &v_t(c, 0), sk));
      } else {
        o_f = p.cast<float>() * v_f;
      }
      for (int i = 0; i < rows; ++i) {
        const float inv = row_sum[i] > 0 ? 1.0f / float(row_sum[i]) : 0.0f;
        for (int c = 0; c < d; ++c) o[size_t(row0 + i) * d + c] = round_to_bf16(o_f(i, c) * inv);
      }
      continue;
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

// How Hopper's FP8 tensor cores add a dot product, modelled: for each instruction's 32 products,
// the products and the running sum are aligned to the largest of them, each cut (toward zero) to
// 13 bits below that one's leading bit, added exactly, and the sum cut to 14 significant bits.
// Of 72 such models compared with cuBLASLt's FP8 GEMM (fast accumulation) on an H100, this one
// reproduced the most outputs bit for bit, 65-90%, and stayed within 8e-4 of the largest product
// elsewhere (docs/measurements/accuracy-28-*, part 1; DeepSeek-V3's report, section 3.3.2, found
// "around 14 bits" of accumulation). What the tolerance needs is the error's size, which grows with
// the largest product rather than with the sum: a few outlier channels make every score coarse.
double fp8_mma_dot(const float* a, const float* b, int n) {
  constexpr int kGroup = 32, kFractionBits = 13;
  double acc = 0;
  for (int c0 = 0; c0 < n; c0 += kGroup) {
    const int count = std::min(kGroup, n - c0);
    double product[kGroup], largest = std::abs(acc);
    for (int c = 0; c < count; ++c) {
      product[c] = double(a[c0 + c]) * b[c0 + c];  // exact in double
      largest = std::max(largest, std::abs(product[c]));
    }
    if (largest == 0) continue;
    int exponent;  // largest in [2^(exponent - 1), 2^exponent)
    std::frexp(largest, &exponent);
    const double step = std::ldexp(1.0, exponent - 1 - kFractionBits), inv = 1.0 / step;
    double sum = std::trunc(acc * inv) * step;
    for (int c = 0; c < count; ++c) sum += std::trunc(product[c] * inv) * step;
    if (sum != 0) {
      std::frexp(sum, &exponent);
      const double unit = std::ldexp(1.0, exponent - 1 - kFractionBits);
      sum = std::trunc(sum / unit) * unit;
    }
    acc = sum;
  }
  return acc;
}

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

namespace {

// The backward in tiles of kRowsPerBlock query rows by kKeysPerBlock keys, in two passes:
//   rows pass, one task per (group, query head, block of rows): the softmax statistics, O, lse,
//     D = rowsum(dO * O) and dQ of those rows, sweeping the key tiles three times;
//   keys pass, one task per (group, tile of keys): dK and dV of those keys, summed over every
//     query row of every head of the group, from the statistics and D the rows pass kept.
// Each output element is summed by one task in a fixed order, so the result is the same bits
// whatever the threads do, and no task needs partial sums of dK and dV from the others (which
// would cost seqlen_k x head_dim doubles per task). A tile's S, P, dP and dS are recomputed in
// both passes from the same operands of the same sizes, so the two passes agree on them exactly.
constexpr int kKeysPerBlock = 128;

// T = double: the reference, rounded() does nothing. T = float: the plain-bf16 definition of
// RefPrecision, where rounded() stores a result in bf16 as a plain implementation would.
template <typename T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <typename T>
Matrix<T> rounded(Matrix<T> m) {
  if constexpr (std::is_same_v<T, float>) m = m.unaryExpr([](float x) { return round_to_bf16(x); });
  return m;
}

template <typename T>
class TiledBackward {
 public:
  TiledBackward(const AttentionShape& shape, const std::vector<BackwardGroupInputs>& groups,
                BackwardReference& out)
      : sq_(shape.seqlen_q),
        sk_(shape.seqlen_k),
        d_(shape.head_dim),
        group_size_(shape.group_size()),
        causal_(shape.causal),
        causal_offset_(shape.causal_offset()),
        scale_(T(shape.softmax_scale())),
        groups_(groups),
        out_(out),
        row_max_(groups.size() * group_size_ * sq_),
        row_sum_(row_max_.size()),
        delta_(row_max_.size()) {}

  static size_t row_tasks_per_group(const AttentionShape& shape) {
    return shape.group_size() * size_t((shape.seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock);
  }
  static size_t key_tasks_per_group(const AttentionShape& shape) {
    return (shape.seqlen_k + kKeysPerBlock - 1) / kKeysPerBlock;
  }

  // Rows [row0, row0 + kRowsPerBlock) of query head `head` of group `group`. Returns the largest
  // |logit| they see.
  double rows_pass(size_t group, int head, int row0) {
    const int rows = std::min(kRowsPerBlock, sq_ - row0);
    const BackwardGroupInputs& in = groups_[group];
    const size_t first = (group * group_size_ + head) * sq_ + row0;  // the block's first row
    double max_abs_logit = 0;
    // Softmax statistics, online over the key tiles: a row's maximum and its sum of exp(S - max).
    std::vector<T> row_max(rows, T(kNegInf)), row_sum(rows, T(0));
    for (int key0 = 0; key0 < keys_seen(row0 + rows - 1); key0 += kKeysPerBlock) {
      const Matrix<T> s = logits(in.q[head], in.k, row0, rows, key0);
      for (int i = 0; i < rows; ++i) {
        const int seen = seen_in_tile(row0 + i, key0);
        if (seen == 0) continue;
        auto s_seen = s.row(i).head(seen).array();
        max_abs_logit = std::max(max_abs_logit, double(s_seen.abs().maxCoeff()));
        const T new_max = std::max(row_max[i], s_seen.maxCoeff());
        row_sum[i] = row_sum[i] * std::exp(row_max[i] - new_max) + (s_seen - new_max).exp().sum();
        row_max[i] = new_max;
      }
    }
    for (int i = 0; i < rows; ++i) {
      row_max_[first + i] = row_max[i];
      row_sum_[first + i] = row_sum[i];
      out_.lse[first + i] =
          row_sum[i] > 0 ? double(row_max[i]) + std::log(double(row_sum[i])) : kNegInf;
    }
    Matrix<T> o_sum = Matrix<T>::Zero(rows, d_);
    for (int key0 = 0; key0 < keys_seen(row0 + rows - 1); key0 += kKeysPerBlock) {
      o_sum += probabilities(logits(in.q[head], in.k, row0, rows, key0), first, row0, key0) *
               key_rows(in.v, key0);
    }
    const Matrix<T> o = rounded<T>(o_sum);
    const Matrix<T> dout = query_rows(in.dout[head], row0, rows);
    const Eigen::Matrix<T, Eigen::Dynamic, 1> delta = (dout.array() * o.array()).rowwise().sum();
    Matrix<T> dq_sum = Matrix<T>::Zero(rows, d_);
    for (int key0 = 0; key0 < keys_seen(row0 + rows - 1); key0 += kKeysPerBlock) {
      const Matrix<T> p =
          probabilities(logits(in.q[head], in.k, row0, rows, key0), first, row0, key0);
      dq_sum += score_gradient(p, dout, delta, in.v, key0) * key_rows(in.k, key0);
    }
    const Matrix<T> dq = rounded<T>(dq_sum * scale_);
    for (int i = 0; i < rows; ++i) {
      delta_[first + i] = delta(i);
      for (int c = 0; c < d_; ++c) {
        out_.o[(first + i) * d_ + c] = o(i, c);
        out_.dq[(first + i) * d_ + c] = dq(i, c);
      }
    }
    return max_abs_logit;
  }

  // Keys [key0, key0 + kKeysPerBlock) of group `group`; needs the rows pass done.
  void keys_pass(size_t group, int key0) {
    const int keys = std::min(kKeysPerBlock, sk_ - key0);
    const BackwardGroupInputs& in = groups_[group];
    Matrix<T> dk_sum = Matrix<T>::Zero(keys, d_), dv_sum = Matrix<T>::Zero(keys, d_);
    // Rows before the first that sees key0 see none of the tile (the causal mask's staircase).
    const int first_seeing_row = causal_ ? std::max(0, key0 - causal_offset_) : 0;
    for (int head = 0; head < group_size_; ++head) {
      for (int row0 = first_seeing_row / kRowsPerBlock * kRowsPerBlock; row0 < sq_;
           row0 += kRowsPerBlock) {
        const int rows = std::min(kRowsPerBlock, sq_ - row0);
        const size_t first = (group * group_size_ + head) * sq_ + row0;
        const Matrix<T> p =
            probabilities(logits(in.q[head], in.k, row0, rows, key0), first, row0, key0);
        const Matrix<T> dout = query_rows(in.dout[head], row0, rows);
        const Eigen::Matrix<T, Eigen::Dynamic, 1> delta =
            Eigen::Map<const Eigen::VectorXd>(delta_.data() + first, rows).cast<T>();
        dv_sum += p.transpose() * dout;
        dk_sum += score_gradient(p, dout, delta, in.v, key0).transpose() *
                  query_rows(in.q[head], row0, rows);
      }
    }
    const Matrix<T> dk = rounded<T>(dk_sum * scale_), dv = rounded<T>(dv_sum);
    const size_t first_key = group * sk_ + key0;
    for (int j = 0; j < keys; ++j)
      for (int c = 0; c < d_; ++c) {
        out_.dk[(first_key + j) * d_ + c] = dk(j, c);
        out_.dv[(first_key + j) * d_ + c] = dv(j, c);
      }
  }

 private:
  int keys_seen(int row) const { return visible_keys(row, sk_, causal_, causal_offset_); }
  // How many keys of the tile that starts at key0 query row `row` sees.
  int seen_in_tile(int row, int key0) const {
    return std::clamp(keys_seen(row) - key0, 0, std::min(kKeysPerBlock, sk_ - key0));
  }

  Matrix<T> query_rows(const float* x, int row0, int rows) const {
    return ConstMapF(x + size_t(row0) * d_, rows, d_).cast<T>();
  }
  Matrix<T> key_rows(const float* x, int key0) const {
    return ConstMapF(x + size_t(key0) * d_, std::min(kKeysPerBlock, sk_ - key0), d_).cast<T>();
  }

  // S of a tile, every key of it whether the rows see it or not.
  Matrix<T> logits(const float* q, const float* k, int row0, int rows, int key0) const {
    return rounded<T>((query_rows(q, row0, rows) * key_rows(k, key0).transpose()) * scale_);
  }

  // P of a tile from the rows' statistics (first: the flat index of row0's statistics); 0 where a
  // row cannot see the key.
  Matrix<T> probabilities(const Matrix<T>& s, size_t first, int row0, int key0) const {
    Matrix<T> p = Matrix<T>::Zero(s.rows(), s.cols());
    for (int i = 0; i < s.rows(); ++i) {
      const T row_max = T(row_max_[first + i]), row_sum = T(row_sum_[first + i]);
      const int seen = seen_in_tile(row0 + i, key0);
      for (int j = 0; j < seen; ++j) p(i, j) = std::exp(s(i, j) - row_max) / row_sum;
    }
    return rounded<T>(p);
  }

  // dS = P * (dP - D), with dP = dO V^T: the softmax's Jacobian applied row by row.
  Matrix<T> score_gradient(const Matrix<T>& p, const Matrix<T>& dout,
                           const Eigen::Matrix<T, Eigen::Dynamic, 1>& delta, const float* v,
                           int key0) const {
    const Matrix<T> dp = rounded<T>(dout * key_rows(v, key0).transpose());
    return rounded<T>((p.array() * (dp.colwise() - delta).array()).matrix());
  }

  const int sq_, sk_, d_, group_size_;
  const bool causal_;
  const int causal_offset_;
  const T scale_;
  const std::vector<BackwardGroupInputs>& groups_;
  BackwardReference& out_;
  // Per query row, [groups, group_size, seqlen_q]: what the keys pass needs of the rows pass.
  std::vector<double> row_max_, row_sum_, delta_;
};

template <typename T>
void tiled_backward(const AttentionShape& shape, const std::vector<BackwardGroupInputs>& groups,
                    BackwardReference& out) {
  TiledBackward<T> backward(shape, groups, out);
  const size_t row_tasks = TiledBackward<T>::row_tasks_per_group(shape);
  const size_t blocks_per_head = row_tasks / shape.group_size();
  std::vector<double> max_abs(groups.size() * row_tasks, 0.0);
  parallel_for(max_abs.size(), [&](size_t task) {
    const size_t head_task = task % row_tasks;
    max_abs[task] = backward.rows_pass(task / row_tasks, int(head_task / blocks_per_head),
                                       int(head_task % blocks_per_head) * kRowsPerBlock);
  });
  for (double m : max_abs) out.max_abs_logit = std::max(out.max_abs_logit, m);
  const size_t key_tasks = TiledBackward<T>::key_tasks_per_group(shape);
  parallel_for(groups.size() * key_tasks, [&](size_t task) {
    backward.keys_pass(task / key_tasks, int(task % key_tasks) * kKeysPerBlock);
  });
}

}  // namespace

BackwardReference reference_backward(const AttentionShape& shape,
                                     const std::vector<BackwardGroupInputs>& groups,
                                     RefPrecision precision) {
  const size_t heads = groups.size() * shape.group_size();
  const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  BackwardReference out;
  out.dq.assign(heads * sq * d, 0.0);
  out.o.assign(heads * sq * d, 0.0);
  out.lse.assign(heads * sq, 0.0);
  out.dk.assign(groups.size() * sk * d, 0.0);
  out.dv.assign(groups.size() * sk * d, 0.0);
  if (precision == RefPrecision::kDouble) {
    tiled_backward<double>(shape, groups, out);
  } else {
    tiled_backward<float>(shape, groups, out);
  }
  return out;
}

BackwardReference reference_backward(const AttentionShape& shape, const std::vector<float>& q,
                                     const std::vector<float>& k, const std::vector<float>& v,
                                     const std::vector<float>& dout, RefPrecision precision) {
  const size_t q_head = size_t(shape.seqlen_q) * shape.head_dim;
  const size_t kv_head = size_t(shape.seqlen_k) * shape.head_dim;
  std::vector<BackwardGroupInputs> groups;
  for (size_t kv = 0; kv < size_t(shape.batch) * shape.heads_kv; ++kv) {
    BackwardGroupInputs group{k.data() + kv * kv_head, v.data() + kv * kv_head, {}, {}};
    for (size_t h = kv * shape.group_size(); h < (kv + 1) * shape.group_size(); ++h) {
      group.q.push_back(q.data() + h * q_head);
      group.dout.push_back(dout.data() + h * q_head);
    }
    groups.push_back(group);
  }
  return reference_backward(shape, groups, precision);
}

size_t reference_backward_worker_bytes(const AttentionShape& shape, size_t groups) {
  const size_t tasks = groups * std::max(TiledBackward<double>::row_tasks_per_group(shape),
                                         TiledBackward<double>::key_tasks_per_group(shape));
  const size_t workers = std::min<size_t>(tasks, std::max(1u, std::thread::hardware_concurrency()));
  const size_t rows = kRowsPerBlock, keys = kKeysPerBlock, d = shape.head_dim;
  // A worker's tiles, counted in double: S, P, dP, dS and the temporaries of dP - D and dS^T
  // (rows x keys); Q, dO, O and the sums of O and dQ (rows x d); K or V converted and the sums of
  // dK and dV (keys x d, two at a time).
  const size_t per_worker = 8 * (6 * rows * keys + 5 * rows * d + 4 * keys * d);
  const size_t per_row = 3 * 8;  // row maximum, row sum, D
  return workers * per_worker + groups * shape.group_size() * shape.seqlen_q * per_row;
}

DecodeReference reference_decode(const DecodeShape& shape,
                                 const std::vector<DecodeGroupInputs>& groups,
                                 RefPrecision precision) {
  const int sq = shape.seqlen_q, d = shape.head_dim, group_size = shape.group_size();
  const size_t group_rows = size_t(group_size) * sq;
  DecodeReference ref;
  ref.o.assign(groups.size() * group_rows * d, 0.0);
  ref.lse.assign(groups.size() * group_rows, 0.0);
  std::vector<double> max_abs(groups.size(), 0.0);
  parallel_for(groups.size(), [&](size_t g) {
    const DecodeGroupInputs& in = groups[g];
    const int sk = shape.seqlens_k[in.batch];
    for (int head = 0; head < group_size; ++head) {
      const size_t first_row = g * group_rows + size_t(head) * sq;
      // The new tokens are the last seqlen_q of the sequence's sk keys: causal, bottom-right
      // aligned, so that token i sees keys j <= i + sk - sq (none at all when sk = 0).
      const double head_max = attend_rows(in.q + size_t(head) * sq * d, in.k, in.v, sq, sk, d, 0,
                                          sq, true, sk - sq, shape.softmax_scale(), precision,
                                          ref.o.data() + first_row * d, ref.lse.data() + first_row);
      max_abs[g] = std::max(max_abs[g], head_max);
    }
  });
  for (double m : max_abs) ref.max_abs_logit = std::max(ref.max_abs_logit, m);
  return ref;
}

DecodeReference reference_decode(const DecodeShape& shape, const std::vector<float>& q,
                                 const std::vector<float>& k_cache,
                                 const std::vector<float>& v_cache, RefPrecision precision) {
  // Groups in (sequence, key/value head) order: a group's query rows are contiguous in q and its
  // keys in the cache, so nothing needs copying, and the per-group result is in q's layout.
  const size_t q_group = size_t(shape.group_size()) * shape.seqlen_q * shape.head_dim;
  const size_t kv_group = size_t(shape.max_seqlen_k) * shape.head_dim;
  std::vector<DecodeGroupInputs> groups;
  for (int b = 0; b < shape.batch; ++b)
    for (int kv_head = 0; kv_head < shape.heads_kv; ++kv_head) {
      const size_t g = size_t(b) * shape.heads_kv + kv_head;
      groups.push_back({b, q.data() + g * q_group, k_cache.data() + g * kv_group,
                        v_cache.data() + g * kv_group});
    }
  return reference_decode(shape, groups, precision);
}

DecodeReference reference_paged_decode(const DecodeShape& shape, const std::vector<float>& q,
                                       const std::vector<float>& k_pages,
                                       const std::vector<float>& v_pages, int page_size,
                                       const std::vector<int>& block_table, int max_pages_per_seq,
                                       RefPrecision precision) {
  const size_t d = shape.head_dim;
  const size_t q_group = size_t(shape.group_size()) * shape.seqlen_q * d;
  const size_t num_pages = k_pages.size() / (size_t(page_size) * shape.heads_kv * d);
  const size_t num_groups = size_t(shape.batch) * shape.heads_kv;
  // Each group's keys and values gathered out of their pages into rows, as a contiguous cache
  // would hold them; only slots that hold a token are read.
  std::vector<std::vector<float>> k_rows(num_groups), v_rows(num_groups);
  std::vector<DecodeGroupInputs> groups;
  for (int b = 0; b < shape.batch; ++b) {
    const int len = shape.seqlens_k[b];
    for (int kv_head = 0; kv_head < shape.heads_kv; ++kv_head) {
      const size_t g = size_t(b) * shape.heads_kv + kv_head;
      k_rows[g].resize(size_t(len) * d);
      v_rows[g].resize(size_t(len) * d);
      for (int t = 0; t < len; ++t) {
        const int slot = t / page_size;
        const int page =
            slot < max_pages_per_seq ? block_table[size_t(b) * max_pages_per_seq + slot] : -1;
        if (page < 0 || size_t(page) >= num_pages) {
          throw std::invalid_argument("the block table names no page of the pool for token " +
                                      std::to_string(t) + " of sequence " + std::to_string(b) +
                                      ".");
        }
        const size_t src =
            ((size_t(page) * page_size + t % page_size) * shape.heads_kv + kv_head) * d;
        std::copy_n(k_pages.begin() + src, d, k_rows[g].begin() + size_t(t) * d);
        std::copy_n(v_pages.begin() + src, d, v_rows[g].begin() + size_t(t) * d);
      }
      groups.push_back({b, q.data() + g * q_group, k_rows[g].data(), v_rows[g].data()});
    }
  }
  return reference_decode(shape, groups, precision);
}

}  // namespace attn
