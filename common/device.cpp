#include "device.h"

#include <sstream>

#include <cuda_runtime_api.h>

#include "cuda_check.h"

namespace attn {
namespace {

std::string cuda_version(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

}  // namespace

std::string device_problem(int min_cc, int arch_specific) {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no NVIDIA driver is installed
  cudaRuntimeGetVersion(&runtime);
  if (driver == 0)
    return "no NVIDIA GPU driver is installed on this machine, and the kernels need an NVIDIA GPU "
           "to run.";
  if (driver < runtime)
    return "the NVIDIA driver supports CUDA up to " + cuda_version(driver) +
           ", older than the CUDA " + cuda_version(runtime) +
           " runtime this program was built with: update the driver, or build with an older "
           "CUDA Toolkit.";
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "no CUDA GPU is visible to this process (the driver is installed, but it reports no "
           "usable device; check CUDA_VISIBLE_DEVICES).";
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int cc = prop.major * 10 + prop.minor;
  if (cc < min_cc) {
    std::ostringstream s;
    s << "this chapter needs a GPU of compute capability " << min_cc / 10 << "." << min_cc % 10
      << " or newer, and " << prop.name << " has " << prop.major << "." << prop.minor << ".";
    return s.str();
  }
  if (arch_specific != 0 && cc != arch_specific) {
    std::ostringstream s;
    s << "this chapter is built for sm_" << arch_specific
      << "a (Hopper's wgmma and TMA instructions), which runs on GPUs of compute capability "
      << arch_specific / 10 << "." << arch_specific % 10 << " only, and " << prop.name << " has "
      << prop.major << "." << prop.minor << ".";
    return s.str();
  }
  return "";
}

std::string device_description() {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int runtime = 0, driver = 0;
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  std::ostringstream s;
  s << prop.name << " (sm_" << prop.major << prop.minor << ", " << prop.multiProcessorCount
    << " SMs), CUDA runtime " << cuda_version(runtime) << ", driver for CUDA "
    << cuda_version(driver);
  return s.str();
}

}  // namespace attn
