#include "runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <unordered_map>

#include "cuda_check.h"
#include "device.h"
#include "device_buffer.h"
#include "forward_inputs.h"
#include "host_data.h"
#include "memory_plan.h"
#include "npy.h"
#include "reference.h"
#include "run_parts.h"

namespace attn {

const Comparison& RunReport::comparison(const std::string& name) const {
  static const Comparison kUnchecked{};
  for (const OutputCheck& output : outputs)
    if (output.name == name) return output.comparison;
  return kUnchecked;
}

void require_fits(const RunFootprint& footprint, const RunOptions& options) {
  MemoryNeed device_need;
  device_need.add(footprint.io_what, footprint.io_bytes);
  device_need.add("workspace", footprint.workspace_bytes);
  if (options.bench && options.timing.flush_l2)
    device_need.add("L2 flush buffer", l2_flush_bytes());
  if (options.bench) device_need.add(footprint.timing_what, footprint.timing_bytes);
  require_device_memory(device_need);
  MemoryNeed host_need;
  host_need.add("input pieces", input_piece_host_bytes(footprint.largest_input_elements));
  host_need.add(footprint.check_what, footprint.check_bytes);
  if (!options.save_dir.empty()) host_need.add("--save", footprint.save_bytes);
  require_host_memory(host_need, options.save_dir.empty()
                                     ? footprint.fewer_checks
                                     : "--save holds every tensor on the host: leave it out, or "
                                       "save a smaller problem.");
}

RunReport start_report(const char* chapter, ChapterKind kind, DType dtype,
                       const RunOptions& options, const RunFootprint& footprint,
                       const char* workspace_what) {
  RunReport report;
  report.chapter = chapter;
  report.kind = kind;
  report.deterministic = options.deterministic;
  report.dtype = dtype;
  report.output_dtype = dtype;
  report.shape = options.shape;
  report.device = device_description();
  report.io_what = footprint.io_what;
  report.io_bytes = footprint.io_bytes;
  report.workspace_what = workspace_what;
  report.workspace_bytes = footprint.workspace_bytes;
  return report;
}

void add_output(RunReport& report, const std::string& name, const Tolerance& tolerance,
                const std::vector<float>& out, const std::vector<double>& ref,
                const std::function<std::string(size_t)>& where) {
  report.outputs.push_back({name, tolerance, compare(out, ref, tolerance, where), checksum(out)});
  report.passed &= report.outputs.back().comparison.passed;
}

void time_into(RunReport& report, const std::function<void(cudaStream_t)>& launch,
               const RunOptions& options, double flops) {
  if (!options.bench) return;
  report.timing = time_launches(launch, options.timing);
  CUDA_CHECK_LAUNCH();
  report.timed = true;
  report.tflops = flops / (report.timing.median_ms * 1e-3) / 1e12;
}

namespace {

size_t distinct_kv_heads(const AttentionShape& shape, const std::vector<HeadIndex>& heads) {
  std::vector<size_t> kv;
  for (const HeadIndex& h : heads) kv.push_back(kv_head_of(shape, h));
  std::sort(kv.begin(), kv.end());
  return size_t(std::unique(kv.begin(), kv.end()) - kv.begin());
}

// What the check needs of the checked heads, and no more: their Q (made again, exactly as
// uploaded, and for FP8 times its descale), the K and V of the key/value heads they read (each
// once), and their O and LSE downloaded from the device; with `unrounded`, the same inputs before
// any rounding as well. inputs[i] points at head i's Q, K and V, unrounded_inputs[i] likewise.
struct CheckedHeads {
  std::vector<float> q, k, v;  // q: [heads, Sq, D]; k, v: [distinct kv heads, Sk, D]
  std::vector<float> q_unrounded, k_unrounded, v_unrounded;
  std::vector<float> o, lse;  // [heads, Sq, D] and [heads, Sq]
  std::vector<HeadInputs> inputs, unrounded_inputs;
};

CheckedHeads gather_checked_heads(const AttentionShape& shape, const std::vector<HeadIndex>& heads,
                                  const ForwardInputs& made, bool unrounded, const DeviceTensor& o,
                                  const DeviceTensor& lse) {
  const size_t n = heads.size(), sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
  CheckedHeads c;
  c.q.resize(n * sq * d);
  c.o.resize(n * sq * d);
  c.lse.resize(n * sq);
  if (unrounded) c.q_unrounded.resize(n * sq * d);
  // Makes elements [first, first + count) of tensor t at `at` (and its unrounded copy).
  auto make = [&](ForwardTensor t, std::vector<float>& values, std::vector<float>& copy, size_t at,
                  size_t count, size_t first) {
    made.make_unrounded(t, values.data() + at, count, first);
    if (unrounded) std::copy_n(values.data() + at, count, copy.data() + at);
    made.round(t, values.data() + at, count, first, /*stored=*/false);
  };
  auto flat = [&](size_t j) { return size_t(heads[j].batch) * shape.heads_q + heads[j].head; };
  for (size_t i = 0; i < n;) {
    // A run of heads that are neighbours in the layout is one range of Q, O and LSE.
    size_t run = 1;
    while (i + run < n && flat(i + run) == flat(i) + run) ++run;
    make(ForwardTensor::kQ, c.q, c.q_unrounded, i * sq * d, run * sq * d, flat(i) * sq * d);
    const std::vector<float> o_run = o.download(flat(i) * sq * d, run * sq * d);
    const std::vector<float> lse_run = lse.download(flat(i) * sq, run * sq);
    std::copy(o_run.begin(), o_run.end(), c.o.begin() + i * sq * d);
    std::copy(lse_run.begin(), lse_run.end(), c.lse.begin() + i * sq);
    i += run;
  }
  // Each key/value head once, in the order the checked heads first need them.
  std::vector<size_t> kv_heads, slot(n);
  std::unordered_map<size_t, size_t> slot_of;
  for (size_t i = 0; i < n; ++i) {
    const size_t kv = kv_head_of(shape, heads[i]);
    const auto [at, added] = slot_of.emplace(kv, kv_heads.size());
    if (added) kv_heads.push_back(kv);
    slot[i] = at->second;
  }
  c.k.resize(kv_heads.size() * sk * d);
  c.v.resize(kv_heads.size() * sk * d);
  if (unrounded) c.k_unrounded.resize(c.k.size()), c.v_unrounded.resize(c.v.size());
  for (size_t j = 0; j < kv_heads.size(); ++j) {
    make(ForwardTensor::kK, c.k, c.k_unrounded, j * sk * d, sk * d, kv_heads[j] * sk * d);
    make(ForwardTensor::kV, c.v, c.v_unrounded, j * sk * d, sk * d, kv_heads[j] * sk * d);
  }
  for (size_t i = 0; i < n; ++i) {
    c.inputs.push_back(
        {c.q.data() + i * sq * d, c.k.data() + slot[i] * sk * d, c.v.data() + slot[i] * sk * d});
    if (unrounded)
      c.unrounded_inputs.push_back({c.q_unrounded.data() + i * sq * d,
                                    c.k_unrounded.data() + slot[i] * sk * d,
                                    c.v_unrounded.data() + slot[i] * sk * d});
  }
  return c;
}

// Host bytes of the check of `heads`: their Q, O and LSE (float), the K and V of the key/value
// heads they read, the references' results (double; bf16 and FP8 chapters compute a second, plain
// one, and a check against the unrounded inputs one more from a copy of those), and what the
// reference's worker threads hold at once.
size_t check_host_bytes(const AttentionShape& shape, DType dtype, bool unrounded,
                        const std::vector<HeadIndex>& heads) {
  const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim, n = heads.size();
  const size_t references = (dtype == DType::kF32 ? 1 : 2) + (unrounded ? 1 : 0);
  const size_t copies = unrounded ? 2 : 1;
  const size_t per_head = 4 * (copies * sq * d + sq * d + sq) + references * 8 * (sq * d + sq);
  const size_t per_kv_head = copies * 4 * 2 * sk * d;
  return n * per_head + distinct_kv_heads(shape, heads) * per_kv_head +
         (n ? reference_forward_worker_bytes(shape, n) : 0);
}

// FP8 chapters are always checked against the unrounded inputs as well; others when asked.
bool check_unrounded(const ForwardChapter& chapter, const RunOptions& options) {
  return chapter.dtype == DType::kE4M3 || options.check_unrounded;
}

// The (batch, head) pairs the check will compare (none when it is off).
std::vector<HeadIndex> checked_heads(const RunOptions& options) {
  if (!options.check) return {};
  if (options.check_all) return all_heads(options.shape);
  return sample_heads(options.shape, options.check_mac_budget, options.seed,
                      size_t(options.check_max_heads));
}

// Q, K, V, O in the chapter's dtype and LSE in float.
RunFootprint forward_footprint(const ForwardChapter& chapter, const RunOptions& options) {
  const AttentionShape& shape = options.shape;
  const std::vector<HeadIndex> heads = checked_heads(options);
  RunFootprint f;
  f.io_what = "Q, K, V, O, LSE";
  f.io_bytes = (shape.q_elements() + 2 * shape.kv_elements()) * dtype_size(chapter.dtype) +
               shape.q_elements() * dtype_size(chapter.output_dtype) +
               shape.lse_elements() * sizeof(float);
  f.workspace_bytes = chapter.workspace_bytes(shape);
  f.largest_input_elements = shape.q_elements();
  f.check_what = "check of " + std::to_string(heads.size()) + " heads";
  f.check_bytes = check_host_bytes(shape, chapter.dtype, check_unrounded(chapter, options), heads);
  f.save_bytes =
      4 * size_t(2 * shape.q_elements() + 2 * shape.kv_elements() + shape.lse_elements());
  f.fewer_checks = "check fewer (batch, head) pairs with --check-heads N, or none with --no-check.";
  return f;
}

InputOptions forward_input_options(const RunOptions& options) {
  InputOptions o;
  o.seed = options.seed;
  o.q_scale = options.q_scale;
  o.outliers = options.outliers;
  o.hadamard = options.hadamard;
  o.qk_offset = options.qk_offset;
  o.fp8_scaling = options.fp8_scaling;
  return o;
}

// "" for plain normal inputs, else e.g. "outlier channels x20 in every fourth key/value head, Q and
// K rotated by a Hadamard matrix, e4m3 with per-head scales".
std::string describe_inputs(const InputOptions& o, bool fp8) {
  std::vector<std::string> parts;
  if (o.outliers != 1.0f) {
    std::ostringstream s;
    s << "outlier channels x" << o.outliers << " in every fourth key/value head";
    parts.push_back(s.str());
  }
  if (o.qk_offset != 0.0f) {
    std::ostringstream s;
    s << "Q and K drawn around " << o.qk_offset << " and " << -o.qk_offset;
    parts.push_back(s.str());
  }
  if (o.hadamard) parts.push_back("Q and K rotated by a Hadamard matrix");
  if (fp8) parts.push_back(std::string("e4m3 with ") + fp8_scaling_name(o.fp8_scaling) + " scales");
  std::string text;
  for (const std::string& part : parts) text += (text.empty() ? "" : ", ") + part;
  return text;
}

}  // namespace

void require_forward_fits(const ForwardChapter& chapter, const RunOptions& options) {
  require_fits(forward_footprint(chapter, options), options);
}

RunReport run_forward(const ForwardChapter& chapter, const RunOptions& options) {
  const AttentionShape& shape = options.shape;
  if (std::string why = validate(shape, chapter.head_dims); !why.empty()) throw InvalidInput(why);
  const InputOptions input_options = forward_input_options(options);
  if (std::string why = validate_inputs(shape, input_options); !why.empty())
    throw InvalidInput(why);
  const DType dtype = chapter.dtype;
  const bool fp8 = dtype == DType::kE4M3;
  // Everything this run will hold, before any of it is allocated.
  const RunFootprint footprint = forward_footprint(chapter, options);
  require_fits(footprint, options);

  RunReport report = start_report(chapter.name, ChapterKind::kForward, dtype, options, footprint,
                                  chapter.workspace_what);
  report.output_dtype = chapter.output_dtype;
  report.inputs_what = describe_inputs(input_options, fp8);
  const std::vector<HeadIndex> heads = checked_heads(options);

  DeviceTensor q_dev(dtype, shape.q_elements()), k_dev(dtype, shape.kv_elements()),
      v_dev(dtype, shape.kv_elements()), o_dev(chapter.output_dtype, shape.q_elements()),
      lse_dev(DType::kF32, shape.lse_elements());
  DeviceBuffer<unsigned char> workspace(report.workspace_bytes);
  // Fresh values per seed, rounded to what the device holds (FP8: scaled, with their descales).
  const ForwardInputs made(shape, input_options, dtype);
  made.upload(ForwardTensor::kQ, q_dev);
  made.upload(ForwardTensor::kK, k_dev);
  made.upload(ForwardTensor::kV, v_dev);
  const size_t groups = size_t(shape.batch) * shape.heads_kv;
  DeviceTensor q_descale(DType::kF32, fp8 ? groups : 0), k_descale(DType::kF32, fp8 ? groups : 0),
      v_descale(DType::kF32, fp8 ? groups : 0);
  if (fp8) {
    q_descale.upload(made.descales(ForwardTensor::kQ));
    k_descale.upload(made.descales(ForwardTensor::kK));
    v_descale.upload(made.descales(ForwardTensor::kV));
  }
  o_dev.poison();
  lse_dev.poison();
  // The workspace is the chapter's to fill: NaN in whatever it reads without writing first.
  if (report.workspace_bytes) CUDA_CHECK(cudaMemset(workspace.get(), 0xFF, report.workspace_bytes));

  ForwardParams params;
  params.shape = shape;
  params.q = q_dev.data();
  params.k = k_dev.data();
  params.v = v_dev.data();
  params.o = o_dev.data();
  params.lse = static_cast<float*>(lse_dev.data());
  params.workspace = workspace.get();
  if (fp8) {
    params.q_descale = static_cast<const float*>(q_descale.data());
    params.k_descale = static_cast<const float*>(k_descale.data());
    params.v_descale = static_cast<const float*>(v_descale.data());
  }
  chapter.launch(params, nullptr);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaDeviceSynchronize());

  if (!options.save_dir.empty()) {
    std::filesystem::create_directories(options.save_dir);
    const size_t b = shape.batch, hq = shape.heads_q, hkv = shape.heads_kv;
    const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
    // FP8: the stored e4m3 numbers, and their descales per (batch, key/value head).
    save_npy(options.save_dir + "/q.npy", q_dev.download(), {b, hq, sq, d});
    save_npy(options.save_dir + "/k.npy", k_dev.download(), {b, hkv, sk, d});
    save_npy(options.save_dir + "/v.npy", v_dev.download(), {b, hkv, sk, d});
    save_npy(options.save_dir + "/o.npy", o_dev.download(), {b, hq, sq, d});
    save_npy(options.save_dir + "/lse.npy", lse_dev.download(), {b, hq, sq});
    if (fp8) {
      save_npy(options.save_dir + "/q_descale.npy", made.descales(ForwardTensor::kQ), {b, hkv});
      save_npy(options.save_dir + "/k_descale.npy", made.descales(ForwardTensor::kK), {b, hkv});
      save_npy(options.save_dir + "/v_descale.npy", made.descales(ForwardTensor::kV), {b, hkv});
    }
  }

  if (options.check) {
    const bool unrounded = check_unrounded(chapter, options);
    const CheckedHeads c = gather_checked_heads(shape, heads, made, unrounded, o_dev, lse_dev);
    const ForwardReference ref = reference_forward(shape, c.inputs);
    report.checked = true;
    report.heads_checked = heads.size();
    report.heads_total = size_t(shape.batch) * shape.heads_q;
    report.max_abs_logit = ref.max_abs_logit;
    // The plain implementation of the chapter's element type, whose error sets the tolerances.
    ForwardReference plain;
    if (dtype != DType::kF32)
      plain = reference_forward(shape, c.inputs,
                                fp8 ? RefPrecision::kPlainFp8 : RefPrecision::kPlainBf16);
    Tolerance o_tolerance;
    if (dtype == DType::kF32) o_tolerance = fp32_output_tolerance(ref.max_abs_logit);
    else if (fp8)
      o_tolerance = twice_plain_tolerance("fp8", max_abs_difference(plain.o, ref.o),
                                          relative_difference(plain.o, ref.o), "rounded inputs");
    else o_tolerance = bf16_output_tolerance(max_abs_difference(plain.o, ref.o));
    const size_t d = shape.head_dim, sq = shape.seqlen_q;
    auto where = [&](const char* what, size_t row_len) {
      return [&, what, row_len](size_t i) {
        const HeadIndex& h = heads[i / (sq * row_len)];
        std::ostringstream s;
        s << what << "[b=" << h.batch << " h=" << h.head << " i=" << i / row_len % sq;
        if (row_len > 1) s << " d=" << i % row_len;
        s << "]";
        return s.str();
      };
    };
    Tolerance lse_tol = lse_tolerance(dtype, ref.max_abs_logit);
    if (fp8)  // the tensor cores' accumulation of S reaches the LSE
      lse_tol = widened_lse_tolerance(lse_tol, max_abs_difference(plain.lse, ref.lse),
                                      relative_difference(plain.lse, ref.lse));
    add_output(report, "o", o_tolerance, c.o, ref.o, where("o", d));
    add_output(report, "lse", lse_tol, c.lse, ref.lse, where("lse", 1));
    if (unrounded) {
      // What a user of the unrounded inputs sees, by the same rule: twice the plain
      // implementation's error (from the rounded inputs) against the unrounded reference.
      const ForwardReference exact = reference_forward(shape, c.unrounded_inputs);
      const ForwardReference& simple = dtype == DType::kF32 ? ref : plain;
      add_output(report, "o_unrounded",
                 twice_plain_tolerance(dtype_name(dtype), max_abs_difference(simple.o, exact.o),
                                       relative_difference(simple.o, exact.o), "unrounded inputs"),
                 c.o, exact.o, where("o", d));
      add_output(report, "lse_unrounded",
                 widened_lse_tolerance(lse_tolerance(dtype, ref.max_abs_logit),
                                       max_abs_difference(simple.lse, exact.lse),
                                       relative_difference(simple.lse, exact.lse)),
                 c.lse, exact.lse, where("lse", 1));
    }
  }

  time_into(
      report, [&](cudaStream_t stream) { chapter.launch(params, stream); }, options,
      forward_flops(shape));
  if (chapter.prepass && report.timed) {
    report.prepass_what = chapter.prepass_what;
    report.prepass_median_ms =
        time_launches([&](cudaStream_t stream) { chapter.prepass(params, stream); }, options.timing)
            .median_ms;
    CUDA_CHECK_LAUNCH();
  }
  return report;
}

}  // namespace attn
