// The chapter's program: hands its launch function to the program every chapter shares
// (common/program.h), whose runner (common/runner.h) makes inputs, checks the outputs against the
// CPU reference and times it. Run with --help for the options.
#include "attention.cuh"
#include "program.h"

int main(int argc, char** argv) { return attn::forward_main(argc, argv, ch52::chapter()); }
