// What the isa tests compile: one chapter's kernels, instantiated through its launch function.
#include "attention.cuh"

void isa_entry(const attn::ForwardParams& params, cudaStream_t stream) {
  CHAPTER_NAMESPACE::launch(params, stream);
}
