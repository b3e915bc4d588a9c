#include "device_buffer.h"

#include <sstream>

#include "cuda_check.h"
#include "memory_plan.h"

namespace attn {
namespace {
size_t g_in_use = 0;  // bytes currently allocated through device_allocate
}  // namespace

void* device_allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the sticky-free error so later calls work
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    std::ostringstream s;
    s << "out of device memory: this run needs another " << gigabytes(bytes) << " on top of "
      << gigabytes(g_in_use) << ", and the GPU has " << gigabytes(free_bytes) << " free of "
      << gigabytes(total_bytes) << "; try a smaller batch or sequence length.";
    throw OutOfDeviceMemory(s.str());
  }
  CUDA_CHECK(status);
  g_in_use += bytes;
  return ptr;
}

void device_free(void* ptr, size_t bytes) noexcept {
  if (!ptr) return;
  cudaFree(ptr);
  g_in_use -= bytes;
}

}  // namespace attn
