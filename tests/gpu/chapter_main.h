// The main() of a program that tests one chapter: its GPU test (gpu/test_forward_chapter.cu) or an
// exercise check (exercises/). That program's one source file includes the chapter's attention.cuh
// and then this header (a chapter's kernels may be compiled into one file of a program only).
#pragma once

#include "gpu_main.h"

int main(int argc, char** argv) {
  return attn::test::gpu_test_main(argc, argv, CHAPTER_NAMESPACE::chapter().min_compute_capability,
                                   CHAPTER_NAMESPACE::chapter().arch_specific);
}
