// run_backward (runner.h): the backward kind of chapter.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

#include "cuda_check.h"
#include "device_buffer.h"
#include "host_data.h"
#include "npy.h"
#include "plain_forward.h"
#include "reference.h"
#include "run_parts.h"
#include "runner.h"

namespace attn {
namespace {

// The (batch, key/value head) groups the check compares: the sample of forward pairs drawn over a
// shape with one query head per group, with the budget shared by the group's query heads and the
// backward's larger work (the reference does about 5x a forward pass: it recomputes S in three
// sweeps over the keys for the row statistics, O and dQ, and once more for dK and dV).
std::vector<HeadIndex> checked_groups(const RunOptions& options) {
  if (!options.check) return {};
  AttentionShape groups = options.shape;
  groups.heads_q = groups.heads_kv;
  if (options.check_all) return all_heads(groups);
  const double budget = options.check_mac_budget / (5.0 * options.shape.group_size());
  return sample_heads(groups, budget, options.seed, size_t(options.check_max_heads));
}

// Host bytes of the check of `groups` groups: per query head its Q, dO, O and dQ (float) and LSE,
// per group its K, V, dK and dV; the references' results in double (a second, plain-bf16 one for
// bf16 chapters); and what the reference's workers hold at once.
size_t check_host_bytes(const AttentionShape& shape, DType dtype, size_t groups) {
  const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  const size_t heads = groups * shape.group_size();
  const size_t references = dtype == DType::kBF16 ? 2 : 1;
  const size_t per_head = 4 * (4 * sq * d + sq) + references * 8 * (2 * sq * d + sq);
  const size_t per_group = 4 * 4 * sk * d + references * 8 * 2 * sk * d;
  return heads * per_head + groups * per_group +
         (groups ? reference_backward_worker_bytes(shape, groups) : 0);
}

// What the check needs of the checked groups, and no more: the inputs made again exactly as
// uploaded, and the outputs downloaded. Query-head tensors are [groups, group_size, Sq, D] (the
// layout order of those heads), key/value ones [groups, Sk, D].
struct CheckedGroups {
  std::vector<float> q, dout, o, lse, dq;
  std::vector<float> k, v, dk, dv;
  std::vector<BackwardGroupInputs> inputs;
};

CheckedGroups gather_checked_groups(const AttentionShape& shape, DType dtype,
                                    const std::vector<HeadIndex>& groups, const RunOptions& options,
                                    const DeviceTensor& o, const DeviceTensor& lse,
                                    const DeviceTensor& dq, const DeviceTensor& dk,
                                    const DeviceTensor& dv) {
  const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  const size_t group = shape.group_size(), n = groups.size();
  const size_t q_size = group * sq * d, kv_size = sk * d;  // per group
  CheckedGroups c;
  for (auto* t : {&c.q, &c.dout, &c.o, &c.dq}) t->resize(n * q_size);
  c.lse.resize(n * group * sq);
  for (auto* t : {&c.k, &c.v, &c.dk, &c.dv}) t->resize(n * kv_size);
  auto copy_into = [](std::vector<float>& to, size_t at, const std::vector<float>& from) {
    std::copy(from.begin(), from.end(), to.begin() + at);
  };
  for (size_t i = 0; i < n; ++i) {
    // The group's query heads are neighbours in the layout: one range of each query tensor.
    const size_t kv_flat = size_t(groups[i].batch) * shape.heads_kv + groups[i].head;
    const size_t q_first = kv_flat * q_size, kv_first = kv_flat * kv_size;
    make_input(c.q.data() + i * q_size, q_size, q_first, dtype, options.seed, kStreamQ,
               options.q_scale);
    make_input(c.dout.data() + i * q_size, q_size, q_first, dtype, options.seed, kStreamDOut, 1.0f);
    make_input(c.k.data() + i * kv_size, kv_size, kv_first, dtype, options.seed, kStreamK, 1.0f);
    make_input(c.v.data() + i * kv_size, kv_size, kv_first, dtype, options.seed, kStreamV, 1.0f);
    copy_into(c.o, i * q_size, o.download(q_first, q_size));
    copy_into(c.dq, i * q_size, dq.download(q_first, q_size));
    copy_into(c.lse, i * group * sq, lse.download(kv_flat * group * sq, group * sq));
    copy_into(c.dk, i * kv_size, dk.download(kv_first, kv_size));
    copy_into(c.dv, i * kv_size, dv.download(kv_first, kv_size));
  }
  for (size_t i = 0; i < n; ++i) {
    BackwardGroupInputs in{c.k.data() + i * kv_size, c.v.data() + i * kv_size, {}, {}};
    for (size_t g = 0; g < group; ++g) {
      in.q.push_back(c.q.data() + i * q_size + g * sq * d);
      in.dout.push_back(c.dout.data() + i * q_size + g * sq * d);
    }
    c.inputs.push_back(in);
  }
  return c;
}

GradientScale gradient_scale(const BackwardReference& ref) {
  GradientScale scale;
  for (const std::vector<double>* gradient : {&ref.dq, &ref.dk, &ref.dv}) {
    double sum_sq = 0;
    for (double x : *gradient) {
      scale.max_abs = std::max(scale.max_abs, std::abs(x));
      sum_sq += x * x;
    }
    if (!gradient->empty()) scale.rms = std::max(scale.rms, std::sqrt(sum_sq / gradient->size()));
  }
  return scale;
}

// Names element i of a checked tensor: group i / per_group of `groups`, then its query head (for
// query-head tensors), row and column.
std::function<std::string(size_t)> where(const AttentionShape& shape,
                                         const std::vector<HeadIndex>& groups, const char* what,
                                         bool per_query_head, size_t rows, size_t row_len) {
  return [&shape, &groups, what, per_query_head, rows, row_len](size_t i) {
    const size_t heads = per_query_head ? size_t(shape.group_size()) : 1;
    const size_t per_head = rows * row_len;
    const HeadIndex& g = groups[i / (heads * per_head)];
    std::ostringstream s;
    s << what << "[b=" << g.batch << " h";
    if (per_query_head) {
      s << "=" << g.head * shape.group_size() + i / per_head % heads;
    } else {
      s << "_kv=" << g.head;
    }
    s << " i=" << i / row_len % rows;
    if (row_len > 1) s << " d=" << i % row_len;
    s << "]";
    return s.str();
  };
}

// Q, K, V, O, dO, dQ, dK, dV in the chapter's dtype and LSE in float.
RunFootprint backward_footprint(const BackwardChapter& chapter, const RunOptions& options) {
  const AttentionShape& shape = options.shape;
  const size_t groups = checked_groups(options).size();
  RunFootprint f;
  f.io_what = "Q, K, V, O, LSE, dO, dQ, dK, dV";
  f.io_bytes = (4 * shape.q_elements() + 4 * shape.kv_elements()) * dtype_size(chapter.dtype) +
               shape.lse_elements() * sizeof(float);
  f.workspace_bytes = chapter.workspace_bytes(shape);
  f.largest_input_elements = shape.q_elements();
  f.check_what = "check of " + std::to_string(groups) + " groups";
  f.check_bytes = check_host_bytes(shape, chapter.dtype, groups);
  f.save_bytes =
      4 * size_t(4 * shape.q_elements() + 4 * shape.kv_elements() + shape.lse_elements());
  f.fewer_checks =
      "check fewer (batch, key/value head) groups with --check-heads N, or none with --no-check.";
  return f;
}

}  // namespace

void require_backward_fits(const BackwardChapter& chapter, const RunOptions& options) {
  require_fits(backward_footprint(chapter, options), options);
}

RunReport run_backward(const BackwardChapter& chapter, const RunOptions& options) {
  const AttentionShape& shape = options.shape;
  if (std::string why = validate(shape, chapter.head_dims); !why.empty()) throw InvalidInput(why);
  if (options.deterministic && !chapter.has_deterministic_mode)
    throw InvalidInput(std::string(chapter.name) +
                       " has no deterministic mode: its dQ is summed with atomics only.");
  const DType dtype = chapter.dtype;
  const RunFootprint footprint = backward_footprint(chapter, options);
  require_fits(footprint, options);

  RunReport report = start_report(chapter.name, ChapterKind::kBackward, dtype, options, footprint,
                                  chapter.workspace_what);
  const std::vector<HeadIndex> groups = checked_groups(options);

  DeviceTensor q_dev(dtype, shape.q_elements()), k_dev(dtype, shape.kv_elements()),
      v_dev(dtype, shape.kv_elements()), o_dev(dtype, shape.q_elements()),
      lse_dev(DType::kF32, shape.lse_elements()), dout_dev(dtype, shape.q_elements()),
      dq_dev(dtype, shape.q_elements()), dk_dev(dtype, shape.kv_elements()),
      dv_dev(dtype, shape.kv_elements());
  DeviceBuffer<unsigned char> workspace(report.workspace_bytes);
  upload_input(q_dev, dtype, options.seed, kStreamQ, options.q_scale);
  upload_input(k_dev, dtype, options.seed, kStreamK, 1.0f);
  upload_input(v_dev, dtype, options.seed, kStreamV, 1.0f);
  upload_input(dout_dev, dtype, options.seed, kStreamDOut, 1.0f);
  // O and LSE of every head from the harness's forward kernel; poisoned first, so that a row it
  // missed fails the check of o and lse below.
  o_dev.poison();
  lse_dev.poison();
  plain_forward(shape, dtype, q_dev.data(), k_dev.data(), v_dev.data(), o_dev.data(),
                static_cast<float*>(lse_dev.data()), nullptr);
  for (DeviceTensor* gradient : {&dq_dev, &dk_dev, &dv_dev}) gradient->poison();

  BackwardParams params;
  params.shape = shape;
  params.q = q_dev.data();
  params.k = k_dev.data();
  params.v = v_dev.data();
  params.o = o_dev.data();
  params.lse = static_cast<const float*>(lse_dev.data());
  params.dout = dout_dev.data();
  params.dq = dq_dev.data();
  params.dk = dk_dev.data();
  params.dv = dv_dev.data();
  params.deterministic = options.deterministic;
  params.workspace = workspace.get();
  chapter.launch(params, nullptr);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaDeviceSynchronize());

  if (!options.save_dir.empty()) {
    std::filesystem::create_directories(options.save_dir);
    const size_t b = shape.batch, hq = shape.heads_q, hkv = shape.heads_kv;
    const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
    const std::vector<size_t> q_dims{b, hq, sq, d}, kv_dims{b, hkv, sk, d};
    const std::pair<const char*, const DeviceTensor*> query_like[] = {
        {"q", &q_dev}, {"o", &o_dev}, {"dout", &dout_dev}, {"dq", &dq_dev}};
    const std::pair<const char*, const DeviceTensor*> key_like[] = {
        {"k", &k_dev}, {"v", &v_dev}, {"dk", &dk_dev}, {"dv", &dv_dev}};
    for (auto [name, t] : query_like)
      save_npy(options.save_dir + "/" + name + ".npy", t->download(), q_dims);
    for (auto [name, t] : key_like)
      save_npy(options.save_dir + "/" + name + ".npy", t->download(), kv_dims);
    save_npy(options.save_dir + "/lse.npy", lse_dev.download(), {b, hq, sq});
  }

  if (options.check) {
    const CheckedGroups c = gather_checked_groups(shape, dtype, groups, options, o_dev, lse_dev,
                                                  dq_dev, dk_dev, dv_dev);
    const BackwardReference ref = reference_backward(shape, c.inputs);
    report.checked = true;
    report.heads_checked = groups.size();
    report.heads_total = size_t(shape.batch) * shape.heads_kv;
    report.max_abs_logit = ref.max_abs_logit;
    // Each gradient's tolerance, measured against the size of the run's gradients as well as its
    // own (compare.h says why). fp32: float's rule. bf16: the FlashAttention test rule, twice the
    // error of a plain bf16 implementation of the same backward on the same rounded inputs, which
    // the reference computes.
    const GradientScale scale = gradient_scale(ref);
    Tolerance o_tol, dq_tol, dk_tol, dv_tol;
    if (dtype == DType::kF32) {
      o_tol = fp32_output_tolerance(ref.max_abs_logit);
      dq_tol = fp32_gradient_tolerance(ref.max_abs_logit, scale, ref.dq.size());
      dk_tol = fp32_gradient_tolerance(ref.max_abs_logit, scale, ref.dk.size());
      dv_tol = fp32_gradient_tolerance(ref.max_abs_logit, scale, ref.dv.size());
    } else {
      const BackwardReference plain = reference_backward(shape, c.inputs, RefPrecision::kPlainBf16);
      o_tol = bf16_output_tolerance(max_abs_difference(plain.o, ref.o));
      dq_tol = bf16_gradient_tolerance(max_abs_difference(plain.dq, ref.dq), scale, ref.dq.size());
      dk_tol = bf16_gradient_tolerance(max_abs_difference(plain.dk, ref.dk), scale, ref.dk.size());
      dv_tol = bf16_gradient_tolerance(max_abs_difference(plain.dv, ref.dv), scale, ref.dv.size());
    }
    // The harness's forward kernel computes the LSE in float from the rounded inputs, whatever the
    // chapter's element type: float's rule.
    const Tolerance lse_tol = lse_tolerance(DType::kF32, ref.max_abs_logit);
    const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
    auto check = [&](const char* name, const std::vector<float>& out,
                     const std::vector<double>& expected, const Tolerance& tol, bool per_query_head,
                     size_t rows, size_t row_len) {
      add_output(report, name, tol, out, expected,
                 where(shape, groups, name, per_query_head, rows, row_len));
    };
    check("o", c.o, ref.o, o_tol, true, sq, d);
    check("lse", c.lse, ref.lse, lse_tol, true, sq, 1);
    check("dq", c.dq, ref.dq, dq_tol, true, sq, d);
    check("dk", c.dk, ref.dk, dk_tol, false, sk, d);
    check("dv", c.dv, ref.dv, dv_tol, false, sk, d);
  }

  time_into(
      report, [&](cudaStream_t stream) { chapter.launch(params, stream); }, options,
      backward_flops(shape));
  return report;
}

}  // namespace attn
