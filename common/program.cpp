#include "program.h"

#include <cstdio>
#include <new>

#include "cli.h"
#include "cuda_check.h"
#include "device.h"
#include "device_buffer.h"
#include "memory_plan.h"
#include "report.h"
#include "runner.h"

namespace attn {

namespace {

// "" or what is wrong with the shape (and, for decode, the lengths), before any GPU is touched.
std::string validate_options(const ForwardChapter& chapter, const RunOptions& options) {
  return validate(options.shape, chapter.head_dims);
}
std::string validate_options(const BackwardChapter& chapter, const RunOptions& options) {
  return validate(options.shape, chapter.head_dims);
}
std::string validate_options(const DecodeChapter& chapter, const RunOptions& options) {
  return validate(decode_shape(options), chapter.head_dims);  // decode_shape throws InvalidInput
}

// The program of a chapter of any kind: `require_fits` and `run` are the kind's functions of
// runner.h.
template <typename Chapter, typename RequireFits, typename Run>
int chapter_main(int argc, char** argv, ChapterKind kind, const Chapter& chapter,
                 RequireFits&& require_fits, Run&& run) {
  auto fail = [&](const char* what, int code) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, what);
    return code;
  };
  CliOptions cli;
  try {
    cli = parse_cli(std::vector<std::string>(argv + 1, argv + argc), kind);
  } catch (const InvalidInput& e) {
    return fail(e.what(), kExitBadInput);
  }
  if (cli.run.deterministic && kind != ChapterKind::kBackward)
    return fail(
        "--deterministic is an option of backward chapters: this one gives the same bits on every "
        "run already.",
        kExitBadInput);
  if (cli.help) {
    std::fputs(usage(chapter).c_str(), stdout);
    return kExitPass;
  }
  try {
    if (std::string why = validate_options(chapter, cli.run); !why.empty())
      return fail(why.c_str(), kExitBadInput);
    if (std::string problem = device_problem(chapter.min_compute_capability, chapter.arch_specific);
        !problem.empty())
      return fail(problem.c_str(), kExitNoDevice);
    require_fits(chapter, cli.run);
    if (cli.format == OutputFormat::kText) std::printf("%s: %s\n", chapter.name, chapter.summary);
    const RunReport report = run(chapter, cli.run);
    print_report(report, cli.format);
    return report.passed ? kExitPass : kExitCheckFailed;
  } catch (const InvalidInput& e) {
    return fail(e.what(), kExitBadInput);
  } catch (const OutOfDeviceMemory& e) {
    return fail(e.what(), kExitNoDevice);
  } catch (const OutOfHostMemory& e) {
    return fail(e.what(), kExitBadInput);
  } catch (const std::bad_alloc&) {
    return fail(
        "ran out of host memory although the plan said it would fit (another program may "
        "have taken it): try a smaller problem, or --check-heads 1.",
        kExitBadInput);
  } catch (const CudaError& e) {
    return fail((std::string("CUDA error: ") + e.what()).c_str(), kExitCudaError);
  } catch (const std::exception& e) {
    return fail(e.what(), kExitCudaError);
  }
}

}  // namespace

int forward_main(int argc, char** argv, const ForwardChapter& chapter) {
  return chapter_main(argc, argv, ChapterKind::kForward, chapter, require_forward_fits,
                      run_forward);
}

int backward_main(int argc, char** argv, const BackwardChapter& chapter) {
  return chapter_main(argc, argv, ChapterKind::kBackward, chapter, require_backward_fits,
                      run_backward);
}

int decode_main(int argc, char** argv, const DecodeChapter& chapter) {
  return chapter_main(argc, argv, ChapterKind::kDecode, chapter, require_decode_fits, run_decode);
}

}  // namespace attn
