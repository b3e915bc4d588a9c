#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "gpu_main.h"

#include <cstdio>
#include <string>

#include "device.h"

namespace attn::test {

int gpu_test_main(int argc, char** argv, const char* program, int min_cc) {
  doctest::Context context(argc, argv);
  if (context.shouldExit()) return context.run();
  if (std::string why = device_problem(min_cc); !why.empty()) {
    std::printf("SKIPPED %s: %s\n", program, why.c_str());
    return 77;
  }
  return context.run();
}

}  // namespace attn::test
