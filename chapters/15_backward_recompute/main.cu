// The chapter's program: hands its backward launch function to the program every chapter shares
// (common/program.h), whose runner makes inputs and the forward O and LSE, checks dQ, dK and dV
// against the CPU reference and times the pass. Run with --help for the options.
#include "attention.cuh"
#include "program.h"

int main(int argc, char** argv) { return attn::backward_main(argc, argv, ch15::chapter()); }
