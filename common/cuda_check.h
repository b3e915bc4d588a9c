// CUDA error checking: every runtime call and every launch goes through CUDA_CHECK, which throws
// with the file, the line and CUDA's own description of the error.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace attn {

struct CudaError : std::runtime_error {
  cudaError_t code;
  CudaError(cudaError_t c, const std::string& what) : std::runtime_error(what), code(c) {}
};

[[noreturn]] void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line);

}  // namespace attn

#define CUDA_CHECK(expr)                                                       \
  do {                                                                         \
    cudaError_t cuda_check_status_ = (expr);                                   \
    if (cuda_check_status_ != cudaSuccess)                                     \
      ::attn::throw_cuda_error(cuda_check_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: catches bad launch configurations (too much shared memory, a grid too
// large) at once, and faults of earlier asynchronous work.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
