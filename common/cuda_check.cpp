#include "cuda_check.h"

#include <sstream>

namespace attn {

void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line) {
  std::ostringstream s;
  s << file << ":" << line << ": " << expr << " failed: " << cudaGetErrorName(code) << " ("
    << cudaGetErrorString(code) << ")";
  throw CudaError(code, s.str());
}

}  // namespace attn
