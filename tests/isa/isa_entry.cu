// What the isa tests compile: one chapter's kernels, instantiated through its launch function (a
// forward or a backward chapter alike: taking the launch function instantiates every kernel it
// can launch).
#include "attention.cuh"

void* isa_entry() { return reinterpret_cast<void*>(CHAPTER_NAMESPACE::chapter().launch); }
