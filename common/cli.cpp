#include "cli.h"

#include <cstdlib>
#include <cerrno>
#include <sstream>

#include "host_data.h"

namespace attn {

AttentionShape default_shape() { return make_shape(4, 16, 16, 1024, 1024, 64); }

AttentionShape default_decode_shape() { return make_shape(8, 32, 8, 1, 8192, 128); }

namespace {

long long parse_integer(const std::string& option, const std::string& text, long long low,
                        long long high) {
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || value < low || value > high) {
    std::ostringstream s;
    s << option << " needs a whole number from " << low << " to " << high << " (got '" << text
      << "').";
    throw InvalidInput(s.str());
  }
  return value;
}

// --page-order: true for a shuffled pool.
bool parse_page_order(const std::string& text) {
  if (text != "random" && text != "in-order")
    throw InvalidInput("--page-order is 'random' or 'in-order' (got '" + text + "').");
  return text == "random";
}

// --fp8-scale: one scale per tensor, or per (batch, key/value head).
Fp8Scaling parse_fp8_scaling(const std::string& text) {
  if (text != "tensor" && text != "head")
    throw InvalidInput("--fp8-scale is 'tensor' or 'head' (got '" + text + "').");
  return text == "tensor" ? Fp8Scaling::kPerTensor : Fp8Scaling::kPerHead;
}

float parse_float(const std::string& option, const std::string& text) {
  char* end = nullptr;
  float value = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0')
    throw InvalidInput(option + " needs a number (got '" + text + "').");
  return value;
}

}  // namespace

CliOptions parse_cli(const std::vector<std::string>& args, ChapterKind kind) {
  constexpr long long kMaxInt = 2147483647;
  CliOptions cli;
  const bool decode = kind == ChapterKind::kDecode;
  cli.run.shape = decode ? default_decode_shape() : default_shape();
  cli.run.timing.flush_l2 = decode;
  bool heads_given = false, heads_kv_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string option = args[i], value;
    bool has_inline_value = false;
    if (auto eq = option.find('='); option.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = option.substr(eq + 1);
      option = option.substr(0, eq);
      has_inline_value = true;
    }
    auto next = [&]() -> std::string {
      if (has_inline_value) return value;
      if (i + 1 >= args.size()) throw InvalidInput(option + " needs a value.");
      return args[++i];
    };
    auto integer = [&](long long low) { return int(parse_integer(option, next(), low, kMaxInt)); };
    AttentionShape& shape = cli.run.shape;
    if (option == "-h" || option == "--help") cli.help = true;
    else if (option == "--batch") shape.batch = integer(1);
    else if (option == "--heads") shape.heads_q = integer(1), heads_given = true;
    else if (option == "--heads-kv") shape.heads_kv = integer(1), heads_kv_given = true;
    else if (option == "--seqlen") shape.seqlen_q = shape.seqlen_k = integer(1);
    else if (option == "--seqlen-q") shape.seqlen_q = integer(1);
    else if (option == "--seqlen-k") shape.seqlen_k = integer(1);
    else if (option == "--head-dim") shape.head_dim = integer(1);
    else if (option == "--causal") shape.causal = true;
    else if (option == "--scale") shape.scale = parse_float(option, next());
    else if (option == "--q-scale") cli.run.q_scale = parse_float(option, next());
    else if (option == "--seed") cli.run.seed = uint64_t(parse_integer(option, next(), 0, kMaxInt));
    else if (option == "--no-check") cli.run.check = false;
    else if (option == "--check-all") cli.run.check_all = true;
    else if (option == "--check-heads") cli.run.check_max_heads = integer(1);
    else if (option == "--no-bench") cli.run.bench = false;
    else if (option == "--warmup") cli.run.timing.warmup = integer(0);
    else if (option == "--iters") cli.run.timing.iters = integer(1);
    else if (option == "--flush-l2") cli.run.timing.flush_l2 = true;
    else if (option == "--no-flush-l2") cli.run.timing.flush_l2 = false;
    else if (option == "--seqlens-k") cli.run.seqlens_k = next();
    else if (option == "--page-size") cli.run.page_size = integer(1);
    else if (option == "--page-order") cli.run.random_page_order = parse_page_order(next());
    else if (option == "--csv") cli.format = OutputFormat::kCsv;
    else if (option == "--json") cli.format = OutputFormat::kJson;
    else if (option == "--save") cli.run.save_dir = next();
    else if (option == "--deterministic") cli.run.deterministic = true;
    else if (kind == ChapterKind::kForward && option == "--outliers")
      cli.run.outliers = parse_float(option, next());
    else if (kind == ChapterKind::kForward && option == "--hadamard") cli.run.hadamard = true;
    else if (kind == ChapterKind::kForward && option == "--qk-offset")
      cli.run.qk_offset = parse_float(option, next());
    else if (kind == ChapterKind::kForward && option == "--fp8-scale")
      cli.run.fp8_scaling = parse_fp8_scaling(next());
    else if (kind == ChapterKind::kForward && option == "--check-unrounded")
      cli.run.check_unrounded = true;
    else throw InvalidInput("unknown option '" + args[i] + "'; --help lists the options.");
  }
  // --heads alone means multi-head attention; neither keeps the default's heads.
  if (heads_given && !heads_kv_given) cli.run.shape.heads_kv = cli.run.shape.heads_q;
  if (!(cli.run.q_scale > 0.0f)) throw InvalidInput("--q-scale must be a positive number.");
  if (!page_size_valid(cli.run.page_size)) throw InvalidInput(kPageSizeRule);
  return cli;
}

namespace {

struct UsageOf {
  const char* name;
  const char* summary;
  DType dtype;
  DType output_dtype;
  const std::vector<int>& head_dims;
  ChapterKind kind;
  bool has_deterministic_mode;
  bool paged;
};

// The shape options of a decode binary, and what it reports.
void decode_usage(std::ostringstream& s, const UsageOf& chapter) {
  const AttentionShape d = default_decode_shape();
  s << "Runs the chapter's decode step on random inputs: for each sequence of the batch, a few\n"
    << "new query tokens attend to its KV cache (" << (chapter.paged ? "in pages" : "contiguous")
    << "), causally among themselves.\n"
    << "Checks O and LSE against the Eigen CPU reference, then times it with the L2 cache\n"
    << "flushed before each launch, and reports the K and V bytes read per second beside this\n"
    << "GPU's device-to-device copy bandwidth (read + written), measured in the same process.\n"
    << "Q, the cache and O are " << dtype_name(chapter.dtype) << ".\n\n"
    << "Shape:\n"
    << "  --batch N        sequences (default " << d.batch << ")\n"
    << "  --heads N        query heads (default " << d.heads_q << ")\n"
    << "  --heads-kv N     key/value heads; heads must be a multiple (default " << d.heads_kv
    << ")\n"
    << "  --seqlen-q N     new tokens per sequence, 1 to " << kMaxDecodeQueries
    << " (speculative decoding; default " << d.seqlen_q << ")\n"
    << "  --seqlen-k N     cached tokens of every sequence, the new ones included (default "
    << d.seqlen_k << ")\n"
    << "  --seqlens-k L    one length per sequence instead: a list such as 5,70000,33, or\n"
    << "                   uniform:LO:HI, drawn from the seed\n"
    << "  --head-dim N     head dimension (this chapter:";
  for (int hd : chapter.head_dims) s << " " << hd;
  s << "; default " << d.head_dim << ")\n"
    << "  --scale F        softmax scale (default 1/sqrt(head_dim))\n";
  if (chapter.paged)
    s << "Cache:\n"
      << "  --page-size N    tokens per page, a power of two (default 16)\n"
      << "  --page-order O   random (default: a pool that has served other sequences) or "
         "in-order\n";
}

std::string usage_text(const UsageOf& chapter) {
  const AttentionShape d = default_shape();
  const bool backward = chapter.kind == ChapterKind::kBackward;
  const bool decode = chapter.kind == ChapterKind::kDecode;
  std::ostringstream s;
  s << chapter.name << ": " << chapter.summary << "\n\n";
  if (decode) {
    decode_usage(s, chapter);
  } else if (backward) {
    s << "Runs the chapter's attention backward pass on random inputs (Q, K, V and dO; O and LSE\n"
      << "from the harness's own forward kernel), checks dQ, dK, dV against the Eigen CPU\n"
      << "reference, then times it (TFLOP/s count 2.5x the forward's FLOPs). Q, K, V, O are\n"
      << "[batch, heads, seqlen, head_dim], " << dtype_name(chapter.dtype) << ".\n\n";
  } else {
    s << "Runs the chapter's attention forward pass on random inputs, checks it against the Eigen\n"
      << "CPU reference, then times it. Q, K, V, O are [batch, heads, seqlen, head_dim], "
      << dtype_name(chapter.dtype);
    if (chapter.output_dtype != chapter.dtype)
      s << " (O " << dtype_name(chapter.output_dtype) << ")";
    s << ".\n\n";
  }
  if (!decode) {
    s << "Shape:\n"
      << "  --batch N        sequences in the batch (default " << d.batch << ")\n"
      << "  --heads N        query heads (default " << d.heads_q << ")\n"
      << "  --heads-kv N     key/value heads; heads must be a multiple (default: = heads)\n"
      << "  --seqlen N       query and key length (default " << d.seqlen_q << ")\n"
      << "  --seqlen-q N     query length alone\n"
      << "  --seqlen-k N     key/value length alone\n"
      << "  --head-dim N     head dimension (this chapter:";
    for (int hd : chapter.head_dims) s << " " << hd;
    if (chapter.head_dims.empty()) s << " any up to 256";
    s << "; default " << d.head_dim << ")\n"
      << "  --causal         causal mask, aligned to the bottom-right corner when seqlen_q != "
         "seqlen_k\n"
      << "  --scale F        softmax scale (default 1/sqrt(head_dim))\n";
  }
  if (chapter.has_deterministic_mode)
    s << "Mode:\n"
      << "  --deterministic  dQ from a separate pass without atomics: the same bits on every run\n";
  s << "Inputs:\n"
    << "  --seed N         seed of the random inputs (default 1234)\n"
    << "  --q-scale F      Q ~ Normal(0, F); 100 makes the logits large enough to overflow exp()\n"
    << "                   without the max trick (default 1)\n";
  if (!backward && !decode) {
    s << "  --outliers F     channels 7 and head_dim/2 + 7 of Q and K, in every fourth key/value\n"
      << "                   head, F times larger (default 1: none)\n"
      << "  --hadamard       rotate the rows of Q and K by a Hadamard matrix (Q K^T unchanged)\n"
      << "  --qk-offset F    Q drawn around +F, K around -F: at 1 nearly every score is below\n"
      << "                   zero (default 0: none)\n";
    if (chapter.dtype == DType::kE4M3)
      s << "  --fp8-scale S    tensor or head: one scale per tensor, or per (batch, key/value "
           "head)\n"
        << "                   (default head)\n";
  }
  s << "Check:\n"
    << "  --no-check       skip the comparison with the CPU reference\n";
  if (!backward && !decode)
    s << (chapter.dtype == DType::kE4M3
              ? "                   (O and LSE are held against the reference from the rounded\n"
                "                   inputs, and against the one from the unrounded inputs)\n"
              : "  --check-unrounded  also hold O and LSE against the reference from the "
                "unrounded\n"
                "                   inputs\n");
  if (backward || decode) {
    s << "  --check-all      check every (batch, key/value head) group; by default large problems\n"
      << "                   check a sample of groups, and the report says which\n"
      << "  --check-heads N  check at most N groups (1: the first group only)\n";
  } else {
    s << "  --check-all      check every (batch, head) pair; by default large problems check a\n"
      << "                   sample of pairs, and the report says which\n"
      << "  --check-heads N  check at most N pairs (1: the first pair only)\n";
  }
  s << "Timing:\n"
    << "  --no-bench       run and check only\n"
    << "  --warmup N       untimed launches first (default 10)\n"
    << "  --iters N        timed launches; the median is reported (default 50)\n"
    << (decode ? "  --no-flush-l2    keep the L2 cache between timed launches (by default it is\n"
                 "                   overwritten before each, as a real decode step finds it)\n"
               : "  --flush-l2       overwrite the L2 cache before every timed launch\n")
    << "Output:\n"
    << "  --csv | --json   one machine-readable record instead of the report\n"
    << "  --save DIR       write "
    << (backward ? "q, k, v, o, lse, dout, dq, dk, dv"
        : decode ? "q, o, lse, seqlens_k, the cache (k, v, and block_table if paged)"
        : chapter.dtype == DType::kE4M3 ? "q, k, v (as stored), their descales, o, lse"
                                        : "q, k, v, o, lse")
    << " to DIR as float32 .npy files\n"
    << "  -h, --help       this text\n\n"
    << "Exit status: 0 pass, 1 check failed, 2 bad option, unsupported shape, or too large for\n"
    << "host memory, 3 no usable GPU (none, too old) or too large for its memory, 4 CUDA error.\n";
  return s.str();
}

}  // namespace

std::string usage(const ForwardChapter& chapter) {
  return usage_text({chapter.name, chapter.summary, chapter.dtype, chapter.output_dtype,
                     chapter.head_dims, ChapterKind::kForward, false, false});
}

std::string usage(const BackwardChapter& chapter) {
  return usage_text({chapter.name, chapter.summary, chapter.dtype, chapter.dtype, chapter.head_dims,
                     ChapterKind::kBackward, chapter.has_deterministic_mode, false});
}

std::string usage(const DecodeChapter& chapter) {
  return usage_text({chapter.name, chapter.summary, chapter.dtype, chapter.dtype, chapter.head_dims,
                     ChapterKind::kDecode, false, chapter.paged});
}

}  // namespace attn
