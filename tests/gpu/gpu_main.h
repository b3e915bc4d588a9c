// The main() of every GPU test program (chapter tests and exercise checks).
#pragma once

namespace attn::test {

// doctest's query options (--help, --list-test-cases, --count, ...) work on any machine. To run
// the cases, a GPU of compute capability min_cc (exactly arch_specific, if given) is needed:
// without one this prints why and returns 77, which CTest reports as skipped (never as passed).
// gpu/chapter_main.cu calls it.
int gpu_test_main(int argc, char** argv, int min_cc, int arch_specific = 0);

}  // namespace attn::test
