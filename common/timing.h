// Timing with CUDA events: warm-up launches first, then each timed launch between its own pair of
// events, reporting the median. With flush_l2, a buffer larger than the L2 cache is overwritten
// before every timed launch, so each one starts with a cold cache (as a decode step would).
#pragma once

#include <cstddef>
#include <functional>

#include <cuda_runtime_api.h>

namespace attn {

struct TimingOptions {
  int warmup = 10;
  int iters = 50;
  bool flush_l2 = false;
};

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  int iters = 0;
};

// The size of the buffer that flush_l2 overwrites: twice this GPU's L2 cache.
size_t l2_flush_bytes();

Timing time_launches(const std::function<void(cudaStream_t)>& launch, const TimingOptions& options);

}  // namespace attn
