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

// The program of a chapter of either kind: `require_fits` and `run` are the kind's functions of
// runner.h.
template <typename Chapter, typename RequireFits, typename Run>
int chapter_main(int argc, char** argv, const Chapter& chapter, RequireFits&& require_fits,
                 Run&& run) {
  auto fail = [&](const char* what, int code) {
    std::fprintf(stderr, "%s: %s\n", chapter.name, what);
    return code;
  };
  CliOptions cli;
  try {
    cli = parse_cli(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const InvalidInput& e) {
    return fail(e.what(), kExitBadInput);
  }
  if (cli.help) {
    std::fputs(usage(chapter).c_str(), stdout);
    return kExitPass;
  }
  if (std::string why = validate(cli.run.shape, chapter.head_dims); !why.empty())
    return fail(why.c_str(), kExitBadInput);
  try {
    if (std::string problem = device_problem(chapter.min_compute_capability); !problem.empty())
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
  return chapter_main(
      argc, argv, chapter, require_forward_fits,
      [](const ForwardChapter& c, const RunOptions& options) {
        if (options.deterministic)
          throw InvalidInput(
              "--deterministic is an option of backward chapters: a forward chapter gives the "
              "same bits on every run already.");
        return run_forward(c, options);
      });
}

int backward_main(int argc, char** argv, const BackwardChapter& chapter) {
  return chapter_main(argc, argv, chapter, require_backward_fits, run_backward);
}

}  // namespace attn
