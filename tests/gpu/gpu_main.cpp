#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "gpu_main.h"

#include <cstdio>
#include <string>

#include "device.h"

namespace attn::test {

int gpu_test_main(int argc, char** argv, int min_cc, int arch_specific) {
  doctest::Context context(argc, argv);
  if (context.shouldExit()) return context.run();
  if (std::string why = device_problem(min_cc, arch_specific); !why.empty()) {
    const std::string program = argv[0];
    std::printf("SKIPPED %s: %s\n", program.substr(program.find_last_of('/') + 1).c_str(),
                why.c_str());
    return 77;
  }
  return context.run();
}

}  // namespace attn::test
