// The chapter's program: hands its launch function to the runner shared by every chapter
// (common/runner.h), which makes inputs, checks the output against the CPU reference and times it.
// Run with --help for the options.
#include "attention.cuh"
#include "runner.h"

int main(int argc, char** argv) { return attn::forward_main(argc, argv, ch11::chapter()); }
