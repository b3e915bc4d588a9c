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

// The bytes copy_bandwidth_gbps copies (and the two buffers it allocates hold each).
constexpr size_t kCopyBandwidthBytes = size_t(512) << 20;
// This GPU's device-to-device copy bandwidth in GB/s, bytes read plus bytes written per second:
// the median of cudaMemcpyAsync over kCopyBandwidthBytes, far larger than the L2 cache. What a
// kernel that only streams memory can hope for, measured rather than taken from the datasheet.
double copy_bandwidth_gbps();

}  // namespace attn
