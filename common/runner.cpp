#include "runner.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "cli.h"
#include "cuda_check.h"
#include "device_buffer.h"
#include "host_data.h"
#include "npy.h"

namespace attn {

std::string device_problem(int min_cc) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    std::string why = status != cudaSuccess ? cudaGetErrorString(status) : "no devices";
    return "no CUDA GPU found (" + why + "): this program runs its kernels on an NVIDIA GPU.";
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int cc = prop.major * 10 + prop.minor;
  if (cc < min_cc) {
    std::ostringstream s;
    s << "this chapter needs a GPU of compute capability " << min_cc / 10 << "." << min_cc % 10
      << " or newer, and " << prop.name << " has " << prop.major << "." << prop.minor << ".";
    return s.str();
  }
  return "";
}

std::string device_description() {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int runtime = 0, driver = 0;
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  std::ostringstream s;
  s << prop.name << " (sm_" << prop.major << prop.minor << ", " << prop.multiProcessorCount
    << " SMs), CUDA runtime " << runtime / 1000 << "." << runtime % 1000 / 10
    << ", driver for CUDA " << driver / 1000 << "." << driver % 1000 / 10;
  return s.str();
}

namespace {

// The rows of the checked (batch, head) pairs, copied out of a full [B, Hq, Sq, row_len] output.
std::vector<float> gather_heads(const std::vector<float>& full, const AttentionShape& shape,
                                const std::vector<HeadIndex>& heads, size_t row_len) {
  const size_t per_head = size_t(shape.seqlen_q) * row_len;
  std::vector<float> out;
  out.reserve(heads.size() * per_head);
  for (const HeadIndex& h : heads) {
    auto begin = full.begin() + (size_t(h.batch) * shape.heads_q + h.head) * per_head;
    out.insert(out.end(), begin, begin + per_head);
  }
  return out;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

RunReport run_forward(const ForwardChapter& chapter, const RunOptions& options) {
  const AttentionShape& shape = options.shape;
  if (std::string why = validate(shape, chapter.head_dims); !why.empty()) throw InvalidInput(why);

  RunReport report;
  report.chapter = chapter.name;
  report.dtype = chapter.dtype;
  report.shape = shape;
  report.device = device_description();
  report.workspace_what = chapter.workspace_what;

  // Inputs: fresh normal values per seed, rounded to what the device will hold.
  std::vector<float> q(shape.q_elements()), k(shape.kv_elements()), v(shape.kv_elements());
  fill_normal(q, options.seed, 0, options.q_scale);
  fill_normal(k, options.seed, 1, 1.0f);
  fill_normal(v, options.seed, 2, 1.0f);
  if (chapter.dtype == DType::kBF16) {
    round_to_bf16(q);
    round_to_bf16(k);
    round_to_bf16(v);
  }

  DeviceTensor q_dev(chapter.dtype, q.size()), k_dev(chapter.dtype, k.size()),
      v_dev(chapter.dtype, v.size()), o_dev(chapter.dtype, q.size()),
      lse_dev(DType::kF32, shape.lse_elements());
  report.io_bytes = q_dev.bytes() + k_dev.bytes() + v_dev.bytes() + o_dev.bytes() + lse_dev.bytes();
  report.workspace_bytes = chapter.workspace_bytes(shape);
  DeviceBuffer<unsigned char> workspace(report.workspace_bytes);
  q_dev.upload(q);
  k_dev.upload(k);
  v_dev.upload(v);
  o_dev.poison();
  lse_dev.poison();

  ForwardParams params;
  params.shape = shape;
  params.q = q_dev.data();
  params.k = k_dev.data();
  params.v = v_dev.data();
  params.o = o_dev.data();
  params.lse = static_cast<float*>(lse_dev.data());
  params.workspace = workspace.get();
  chapter.launch(params, nullptr);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaDeviceSynchronize());

  if (options.check || !options.save_dir.empty()) {
    const std::vector<float> o = o_dev.download(), lse = lse_dev.download();
    if (!options.save_dir.empty()) {
      std::filesystem::create_directories(options.save_dir);
      const size_t b = shape.batch, hq = shape.heads_q, hkv = shape.heads_kv;
      const size_t sq = shape.seqlen_q, sk = shape.seqlen_k, d = shape.head_dim;
      save_npy(options.save_dir + "/q.npy", q, {b, hq, sq, d});
      save_npy(options.save_dir + "/k.npy", k, {b, hkv, sk, d});
      save_npy(options.save_dir + "/v.npy", v, {b, hkv, sk, d});
      save_npy(options.save_dir + "/o.npy", o, {b, hq, sq, d});
      save_npy(options.save_dir + "/lse.npy", lse, {b, hq, sq});
    }
    if (options.check) {
      const std::vector<HeadIndex> heads =
          options.check_all ? all_heads(shape)
                            : sample_heads(shape, options.check_mac_budget, options.seed,
                                           size_t(options.check_max_heads));
      const ForwardReference ref = reference_forward(shape, q, k, v, heads);
      report.checked = true;
      report.heads_checked = heads.size();
      report.heads_total = size_t(shape.batch) * shape.heads_q;
      report.max_abs_logit = ref.max_abs_logit;
      if (chapter.dtype == DType::kF32) {
        report.o_tolerance = fp32_output_tolerance(ref.max_abs_logit);
      } else {
        const ForwardReference plain =
            reference_forward(shape, q, k, v, heads, RefPrecision::kPlainBf16);
        report.o_tolerance = bf16_output_tolerance(max_abs_difference(plain.o, ref.o));
      }
      report.lse_tolerance = lse_tolerance(chapter.dtype, ref.max_abs_logit);
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
      report.o =
          compare(gather_heads(o, shape, heads, d), ref.o, report.o_tolerance, where("o", d));
      report.lse = compare(gather_heads(lse, shape, heads, 1), ref.lse, report.lse_tolerance,
                           where("lse", 1));
      report.passed = report.o.passed && report.lse.passed;
    }
  }

  if (options.bench) {
    report.timing =
        time_launches([&](cudaStream_t stream) { chapter.launch(params, stream); }, options.timing);
    CUDA_CHECK_LAUNCH();
    report.timed = true;
    report.tflops = forward_flops(shape) / (report.timing.median_ms * 1e-3) / 1e12;
  }
  return report;
}

namespace {

std::string megabytes(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  return text;
}

void print_text(const RunReport& r) {
  std::printf("device  %s\n", r.device.c_str());
  std::printf("shape   %s, %s\n", r.shape.describe().c_str(), dtype_name(r.dtype));
  std::printf("memory  %s on the device: Q, K, V, O, LSE %s",
              megabytes(r.io_bytes + r.workspace_bytes).c_str(), megabytes(r.io_bytes).c_str());
  if (r.workspace_bytes)
    std::printf(" + workspace %s (%s)", megabytes(r.workspace_bytes).c_str(),
                r.workspace_what.c_str());
  std::printf("\n");
  if (r.checked) {
    std::printf("check   %zu of %zu (batch, head) pairs against the Eigen reference (double)%s\n",
                r.heads_checked, r.heads_total,
                r.heads_checked < r.heads_total
                    ? ": the first, the last, and a seeded random sample (--check-all for all)"
                    : "");
    auto line = [](const char* what, const Comparison& c, const Tolerance& t) {
      std::printf("        %-3s max abs err %.3g, rel err %.3g  [%s]  %s\n", what, c.max_abs_err,
                  c.rel_err, t.rule.c_str(), c.passed ? "ok" : "FAIL");
      if (c.nonfinite) std::printf("            %zu NaN or Inf values\n", c.nonfinite);
      for (const std::string& m : c.mismatches) std::printf("            %s\n", m.c_str());
      if (c.failed > c.mismatches.size())
        std::printf("            ... %zu elements out of tolerance in all\n", c.failed);
    };
    line("O", r.o, r.o_tolerance);
    line("LSE", r.lse, r.lse_tolerance);
    std::printf("        largest |logit| %.3g\n", r.max_abs_logit);
  } else {
    std::printf("check   skipped (--no-check)\n");
  }
  if (r.timed) {
    std::printf("time    %.4f ms median of %d launches (min %.4f, max %.4f) = %.2f TFLOP/s\n",
                r.timing.median_ms, r.timing.iters, r.timing.min_ms, r.timing.max_ms, r.tflops);
  }
  std::printf("result  %s\n", !r.checked ? "not checked" : r.passed ? "PASS" : "FAIL");
}

void print_csv(const RunReport& r) {
  std::printf(
      "chapter,dtype,batch,heads_q,heads_kv,seqlen_q,seqlen_k,head_dim,causal,checked,passed,"
      "o_max_abs_err,o_rel_err,lse_max_abs_err,median_ms,tflops,device_bytes,workspace_bytes,"
      "device\n");
  std::printf("%s,%s,%d,%d,%d,%d,%d,%d,%d,%d,%d,%.4g,%.4g,%.4g,%.5f,%.3f,%zu,%zu,\"%s\"\n",
              r.chapter.c_str(), dtype_name(r.dtype), r.shape.batch, r.shape.heads_q,
              r.shape.heads_kv, r.shape.seqlen_q, r.shape.seqlen_k, r.shape.head_dim,
              int(r.shape.causal), int(r.checked), int(r.passed), r.o.max_abs_err, r.o.rel_err,
              r.lse.max_abs_err, r.timing.median_ms, r.tflops, r.io_bytes + r.workspace_bytes,
              r.workspace_bytes, r.device.c_str());
}

void print_json(const RunReport& r) {
  std::printf(
      "{\"chapter\": \"%s\", \"dtype\": \"%s\", \"batch\": %d, \"heads_q\": %d, \"heads_kv\": %d, "
      "\"seqlen_q\": %d, \"seqlen_k\": %d, \"head_dim\": %d, \"causal\": %s, \"checked\": %s, "
      "\"passed\": %s, \"heads_checked\": %zu, \"o_max_abs_err\": %.6g, \"o_rel_err\": %.6g, "
      "\"lse_max_abs_err\": %.6g, \"median_ms\": %.6f, \"tflops\": %.4f, \"device_bytes\": %zu, "
      "\"workspace_bytes\": %zu, \"device\": \"%s\"}\n",
      r.chapter.c_str(), dtype_name(r.dtype), r.shape.batch, r.shape.heads_q, r.shape.heads_kv,
      r.shape.seqlen_q, r.shape.seqlen_k, r.shape.head_dim, r.shape.causal ? "true" : "false",
      r.checked ? "true" : "false", r.passed ? "true" : "false", r.heads_checked, r.o.max_abs_err,
      r.o.rel_err, r.lse.max_abs_err, r.timing.median_ms, r.tflops, r.io_bytes + r.workspace_bytes,
      r.workspace_bytes, r.device.c_str());
}

}  // namespace

void print_report(const RunReport& report, OutputFormat format) {
  switch (format) {
    case OutputFormat::kText:
      print_text(report);
      break;
    case OutputFormat::kCsv:
      print_csv(report);
      break;
    case OutputFormat::kJson:
      print_json(report);
      break;
  }
  std::fflush(stdout);
}

int forward_main(int argc, char** argv, const ForwardChapter& chapter) {
  CliOptions cli;
  try {
    cli = parse_cli(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const InvalidInput& e) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, e.what());
    return kExitBadInput;
  }
  if (cli.help) {
    std::fputs(usage(chapter).c_str(), stdout);
    return kExitPass;
  }
  if (std::string why = validate(cli.run.shape, chapter.head_dims); !why.empty()) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, why.c_str());
    return kExitBadInput;
  }
  try {
    if (std::string problem = device_problem(chapter.min_compute_capability); !problem.empty()) {
      std::fprintf(stderr, "%s: %s\n", chapter.name, problem.c_str());
      return kExitNoDevice;
    }
    if (cli.format == OutputFormat::kText) std::printf("%s: %s\n", chapter.name, chapter.summary);
    const RunReport report = run_forward(chapter, cli.run);
    print_report(report, cli.format);
    return report.passed ? kExitPass : kExitCheckFailed;
  } catch (const InvalidInput& e) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, e.what());
    return kExitBadInput;
  } catch (const OutOfDeviceMemory& e) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, e.what());
    return kExitNoDevice;
  } catch (const CudaError& e) {
    std::fprintf(stderr, "%s: CUDA error: %s\n", chapter.name, e.what());
    return kExitCudaError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, e.what());
    return kExitCudaError;
  }
}

}  // namespace attn
