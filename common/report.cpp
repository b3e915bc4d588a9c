#include "report.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace attn {
namespace {

std::string megabytes(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  return text;
}

// "o" -> "O", "lse" -> "LSE", "dq" -> "dQ": the names the lessons use; "o_unrounded" -> "O vs the
// unrounded inputs".
std::string display_name(const std::string& name) {
  const std::string suffix = "_unrounded";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
    return display_name(name.substr(0, name.size() - suffix.size())) + " vs the unrounded inputs";
  std::string text = name;
  for (size_t i = name.rfind('d', 0) == 0 && name.size() > 1 ? 1 : 0; i < text.size(); ++i)
    text[i] = char(std::toupper(static_cast<unsigned char>(text[i])));
  return text;
}

// A decode run's cache: its layout and size, and for pages what a contiguous cache would take.
void print_decode_cache(const DecodeFacts& f) {
  if (f.page_size == 0) {
    std::printf("cache   contiguous, room for %d tokens per sequence: %s\n", f.shape.max_seqlen_k,
                megabytes(f.cache_bytes).c_str());
    return;
  }
  std::printf(
      "cache   pages of %d tokens: %s; a contiguous cache with room for the longest "
      "sequence: %s\n",
      f.page_size, megabytes(f.cache_bytes).c_str(), megabytes(f.contiguous_cache_bytes).c_str());
}

void print_text(const RunReport& r) {
  const bool backward = r.kind == ChapterKind::kBackward;
  const bool decode = r.kind == ChapterKind::kDecode;
  std::printf("device  %s\n", r.device.c_str());
  std::printf("shape   %s, %s",
              decode ? r.decode.shape.describe().c_str() : r.shape.describe().c_str(),
              dtype_name(r.dtype));
  if (r.output_dtype != r.dtype) std::printf(" (O %s)", dtype_name(r.output_dtype));
  std::printf("\n");
  if (!r.inputs_what.empty()) std::printf("inputs  %s\n", r.inputs_what.c_str());
  if (decode) print_decode_cache(r.decode);
  if (backward)
    std::printf("mode    %s\n", r.deterministic ? "deterministic dQ (a separate pass, no atomics)"
                                                : "dQ summed with atomics");
  std::printf("memory  %s on the device: %s %s", megabytes(r.io_bytes + r.workspace_bytes).c_str(),
              r.io_what.c_str(), megabytes(r.io_bytes).c_str());
  if (r.workspace_bytes)
    std::printf(" + workspace %s (%s)", megabytes(r.workspace_bytes).c_str(),
                r.workspace_what.c_str());
  std::printf("\n");
  if (r.checked) {
    std::printf("check   %zu of %zu %s against the Eigen reference (double)%s\n", r.heads_checked,
                r.heads_total,
                backward ? "(batch, key/value head) groups"
                : decode ? "(sequence, key/value head) groups"
                         : "(batch, head) pairs",
                r.heads_checked < r.heads_total
                    ? ": the first, the last, and a seeded random sample (--check-all for all)"
                    : "");
    if (backward)
      std::printf(
          "        O and LSE are the harness's forward kernel's, the inputs of the chapter\n");
    for (const OutputCheck& output : r.outputs) {
      const Comparison& c = output.comparison;
      std::printf("        %-3s max abs err %.3g, rel err %.3g  [%s]  %s\n",
                  display_name(output.name).c_str(), c.max_abs_err, c.rel_err,
                  output.tolerance.rule.c_str(), c.passed ? "ok" : "FAIL");
      if (c.nonfinite) std::printf("            %zu NaN or Inf values\n", c.nonfinite);
      for (const std::string& m : c.mismatches) std::printf("            %s\n", m.c_str());
      if (c.failed > c.mismatches.size())
        std::printf("            ... %zu elements out of tolerance in all\n", c.failed);
    }
    std::printf("        largest |logit| %.3g\n", r.max_abs_logit);
  } else {
    std::printf("check   skipped (--no-check)\n");
  }
  if (r.timed && decode) {
    std::printf("time    %.4f ms median of %d launches (min %.4f, max %.4f)\n", r.timing.median_ms,
                r.timing.iters, r.timing.min_ms, r.timing.max_ms);
    std::printf(
        "        K and V read at %.0f GB/s = %.2f of this GPU's copy bandwidth (%.0f GB/s "
        "read + written, measured now)\n",
        r.decode.kv_gbps, r.decode.kv_gbps / r.decode.copy_gbps, r.decode.copy_gbps);
  } else if (r.timed) {
    std::printf("time    %.4f ms median of %d launches (min %.4f, max %.4f) = %.2f TFLOP/s%s\n",
                r.timing.median_ms, r.timing.iters, r.timing.min_ms, r.timing.max_ms, r.tflops,
                backward ? " (2.5x the forward's FLOPs)" : "");
    if (!r.prepass_what.empty())
      std::printf("        of which %s: %.4f ms (median, timed alone)\n", r.prepass_what.c_str(),
                  r.prepass_median_ms);
  }
  std::printf("result  %s\n", !r.checked ? "not checked" : r.passed ? "PASS" : "FAIL");
}

// Backward records: the shape, the mode, and each gradient's errors.
void print_backward_csv(const RunReport& r) {
  const Comparison &dq = r.comparison("dq"), &dk = r.comparison("dk"), &dv = r.comparison("dv");
  std::printf(
      "chapter,dtype,batch,heads_q,heads_kv,seqlen_q,seqlen_k,head_dim,causal,deterministic,"
      "checked,passed,dq_max_abs_err,dq_rel_err,dk_max_abs_err,dk_rel_err,dv_max_abs_err,"
      "dv_rel_err,median_ms,tflops,device_bytes,workspace_bytes,device\n");
  std::printf(
      "%s,%s,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%.4g,%.4g,%.4g,%.4g,%.4g,%.4g,%.5f,%.3f,%zu,%zu,"
      "\"%s\"\n",
      r.chapter.c_str(), dtype_name(r.dtype), r.shape.batch, r.shape.heads_q, r.shape.heads_kv,
      r.shape.seqlen_q, r.shape.seqlen_k, r.shape.head_dim, int(r.shape.causal),
      int(r.deterministic), int(r.checked), int(r.passed), dq.max_abs_err, dq.rel_err,
      dk.max_abs_err, dk.rel_err, dv.max_abs_err, dv.rel_err, r.timing.median_ms, r.tflops,
      r.io_bytes + r.workspace_bytes, r.workspace_bytes, r.device.c_str());
}

void print_backward_json(const RunReport& r) {
  std::printf(
      "{\"chapter\": \"%s\", \"kind\": \"backward\", \"dtype\": \"%s\", \"batch\": %d, "
      "\"heads_q\": %d, \"heads_kv\": %d, \"seqlen_q\": %d, \"seqlen_k\": %d, \"head_dim\": %d, "
      "\"causal\": %s, \"deterministic\": %s, \"checked\": %s, \"passed\": %s, "
      "\"groups_checked\": %zu, ",
      r.chapter.c_str(), dtype_name(r.dtype), r.shape.batch, r.shape.heads_q, r.shape.heads_kv,
      r.shape.seqlen_q, r.shape.seqlen_k, r.shape.head_dim, r.shape.causal ? "true" : "false",
      r.deterministic ? "true" : "false", r.checked ? "true" : "false", r.passed ? "true" : "false",
      r.heads_checked);
  for (const OutputCheck& output : r.outputs)
    std::printf("\"%s_max_abs_err\": %.6g, \"%s_rel_err\": %.6g, \"%s_checksum\": \"%016llx\", ",
                output.name.c_str(), output.comparison.max_abs_err, output.name.c_str(),
                output.comparison.rel_err, output.name.c_str(),
                static_cast<unsigned long long>(output.checksum));
  std::printf(
      "\"median_ms\": %.6f, \"tflops\": %.4f, \"device_bytes\": %zu, \"workspace_bytes\": %zu, "
      "\"device\": \"%s\"}\n",
      r.timing.median_ms, r.tflops, r.io_bytes + r.workspace_bytes, r.workspace_bytes,
      r.device.c_str());
}

// Decode records: the lengths summarised, the layout, and bandwidth instead of FLOP/s.
struct LengthSummary {
  int shortest = 0, longest = 0;
  double mean = 0;
};
LengthSummary summarise(const DecodeShape& shape) {
  LengthSummary s;
  if (shape.seqlens_k.empty()) return s;
  s.shortest = *std::min_element(shape.seqlens_k.begin(), shape.seqlens_k.end());
  s.longest = shape.longest_seqlen_k();
  s.mean = double(shape.total_seqlen_k()) / shape.batch;
  return s;
}

double copy_fraction(const DecodeFacts& f) { return f.copy_gbps > 0 ? f.kv_gbps / f.copy_gbps : 0; }

void print_decode_csv(const RunReport& r) {
  const DecodeFacts& f = r.decode;
  const LengthSummary len = summarise(f.shape);
  const Comparison &o = r.comparison("o"), &lse = r.comparison("lse");
  std::printf(
      "chapter,dtype,batch,heads_q,heads_kv,seqlen_q,seqlen_k_min,seqlen_k_max,seqlen_k_mean,"
      "head_dim,page_size,checked,passed,o_max_abs_err,o_rel_err,lse_max_abs_err,median_ms,"
      "kv_gbps,copy_gbps,copy_fraction,device_bytes,workspace_bytes,device\n");
  std::printf(
      "%s,%s,%d,%d,%d,%d,%d,%d,%.1f,%d,%d,%d,%d,%.4g,%.4g,%.4g,%.5f,%.1f,%.1f,%.4f,%zu,%zu,"
      "\"%s\"\n",
      r.chapter.c_str(), dtype_name(r.dtype), f.shape.batch, f.shape.heads_q, f.shape.heads_kv,
      f.shape.seqlen_q, len.shortest, len.longest, len.mean, f.shape.head_dim, f.page_size,
      int(r.checked), int(r.passed), o.max_abs_err, o.rel_err, lse.max_abs_err, r.timing.median_ms,
      f.kv_gbps, f.copy_gbps, copy_fraction(f), r.io_bytes + r.workspace_bytes, r.workspace_bytes,
      r.device.c_str());
}

void print_decode_json(const RunReport& r) {
  const DecodeFacts& f = r.decode;
  const LengthSummary len = summarise(f.shape);
  const Comparison &o = r.comparison("o"), &lse = r.comparison("lse");
  std::printf(
      "{\"chapter\": \"%s\", \"kind\": \"decode\", \"dtype\": \"%s\", \"batch\": %d, "
      "\"heads_q\": %d, \"heads_kv\": %d, \"seqlen_q\": %d, \"seqlen_k_min\": %d, "
      "\"seqlen_k_max\": %d, \"seqlen_k_mean\": %.1f, \"head_dim\": %d, \"page_size\": %d, "
      "\"checked\": %s, \"passed\": %s, \"groups_checked\": %zu, \"o_max_abs_err\": %.6g, "
      "\"o_rel_err\": %.6g, \"lse_max_abs_err\": %.6g, \"median_ms\": %.6f, \"kv_gbps\": %.2f, "
      "\"copy_gbps\": %.2f, \"copy_fraction\": %.4f, \"cache_bytes\": %zu, "
      "\"contiguous_cache_bytes\": %zu, \"device_bytes\": %zu, \"workspace_bytes\": %zu, "
      "\"device\": \"%s\"}\n",
      r.chapter.c_str(), dtype_name(r.dtype), f.shape.batch, f.shape.heads_q, f.shape.heads_kv,
      f.shape.seqlen_q, len.shortest, len.longest, len.mean, f.shape.head_dim, f.page_size,
      r.checked ? "true" : "false", r.passed ? "true" : "false", r.heads_checked, o.max_abs_err,
      o.rel_err, lse.max_abs_err, r.timing.median_ms, f.kv_gbps, f.copy_gbps, copy_fraction(f),
      f.cache_bytes, f.contiguous_cache_bytes, r.io_bytes + r.workspace_bytes, r.workspace_bytes,
      r.device.c_str());
}

void print_csv(const RunReport& r) {
  if (r.kind == ChapterKind::kBackward) return print_backward_csv(r);
  if (r.kind == ChapterKind::kDecode) return print_decode_csv(r);
  const Comparison &o = r.comparison("o"), &lse = r.comparison("lse");
  std::printf(
      "chapter,dtype,batch,heads_q,heads_kv,seqlen_q,seqlen_k,head_dim,causal,checked,passed,"
      "o_max_abs_err,o_rel_err,lse_max_abs_err,median_ms,tflops,device_bytes,workspace_bytes,"
      "device,output_dtype,o_unrounded_rel_err,prepass_ms\n");
  std::printf(
      "%s,%s,%d,%d,%d,%d,%d,%d,%d,%d,%d,%.4g,%.4g,%.4g,%.5f,%.3f,%zu,%zu,\"%s\",%s,%.4g,%.5f\n",
      r.chapter.c_str(), dtype_name(r.dtype), r.shape.batch, r.shape.heads_q, r.shape.heads_kv,
      r.shape.seqlen_q, r.shape.seqlen_k, r.shape.head_dim, int(r.shape.causal), int(r.checked),
      int(r.passed), o.max_abs_err, o.rel_err, lse.max_abs_err, r.timing.median_ms, r.tflops,
      r.io_bytes + r.workspace_bytes, r.workspace_bytes, r.device.c_str(),
      dtype_name(r.output_dtype), r.comparison("o_unrounded").rel_err, r.prepass_median_ms);
}

void print_json(const RunReport& r) {
  if (r.kind == ChapterKind::kBackward) return print_backward_json(r);
  if (r.kind == ChapterKind::kDecode) return print_decode_json(r);
  const Comparison &o = r.comparison("o"), &lse = r.comparison("lse");
  std::printf(
      "{\"chapter\": \"%s\", \"dtype\": \"%s\", \"batch\": %d, \"heads_q\": %d, \"heads_kv\": %d, "
      "\"seqlen_q\": %d, \"seqlen_k\": %d, \"head_dim\": %d, \"causal\": %s, \"checked\": %s, "
      "\"passed\": %s, \"heads_checked\": %zu, \"o_max_abs_err\": %.6g, \"o_rel_err\": %.6g, "
      "\"lse_max_abs_err\": %.6g, \"median_ms\": %.6f, \"tflops\": %.4f, \"device_bytes\": %zu, "
      "\"workspace_bytes\": %zu, \"device\": \"%s\", \"output_dtype\": \"%s\", "
      "\"o_unrounded_rel_err\": %.6g, \"prepass_ms\": %.6f}\n",
      r.chapter.c_str(), dtype_name(r.dtype), r.shape.batch, r.shape.heads_q, r.shape.heads_kv,
      r.shape.seqlen_q, r.shape.seqlen_k, r.shape.head_dim, r.shape.causal ? "true" : "false",
      r.checked ? "true" : "false", r.passed ? "true" : "false", r.heads_checked, o.max_abs_err,
      o.rel_err, lse.max_abs_err, r.timing.median_ms, r.tflops, r.io_bytes + r.workspace_bytes,
      r.workspace_bytes, r.device.c_str(), dtype_name(r.output_dtype),
      r.comparison("o_unrounded").rel_err, r.prepass_median_ms);
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

}  // namespace attn
