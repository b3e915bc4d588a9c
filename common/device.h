// Which GPU this process runs on, and whether a chapter can run there at all.
#pragma once

#include <string>

namespace attn {

// "" if this machine can run a chapter that needs compute capability min_cc (e.g. 80), otherwise
// one sentence saying why not: no NVIDIA driver, a driver older than this program's CUDA runtime,
// no GPU, or too old a GPU. With arch_specific (e.g. 90, for code built for sm_90a) the GPU must
// be of exactly that compute capability.
std::string device_problem(int min_cc, int arch_specific = 0);
// e.g. "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs), CUDA runtime 13.0, driver for CUDA 13.0"
std::string device_description();

}  // namespace attn
