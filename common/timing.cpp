#include "timing.h"

#include <algorithm>
#include <vector>

#include "cuda_check.h"
#include "device_buffer.h"

namespace attn {

size_t l2_flush_bytes() {
  int device = 0, l2_bytes = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  return size_t(l2_bytes) * 2;
}

Timing time_launches(const std::function<void(cudaStream_t)>& launch,
                     const TimingOptions& options) {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer<unsigned char> flush;
  if (options.flush_l2) flush = DeviceBuffer<unsigned char>(l2_flush_bytes());
  for (int i = 0; i < options.warmup; ++i) launch(stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));

  std::vector<cudaEvent_t> starts(options.iters), stops(options.iters);
  for (int i = 0; i < options.iters; ++i) {
    CUDA_CHECK(cudaEventCreate(&starts[i]));
    CUDA_CHECK(cudaEventCreate(&stops[i]));
  }
  for (int i = 0; i < options.iters; ++i) {
    if (flush.get()) CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xFF, flush.bytes(), stream));
    CUDA_CHECK(cudaEventRecord(starts[i], stream));
    launch(stream);
    CUDA_CHECK(cudaEventRecord(stops[i], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms(options.iters);
  for (int i = 0; i < options.iters; ++i) {
    float elapsed = 0;
    CUDA_CHECK(cudaEventElapsedTime(&elapsed, starts[i], stops[i]));
    ms[i] = elapsed;
    cudaEventDestroy(starts[i]);
    cudaEventDestroy(stops[i]);
  }
  cudaStreamDestroy(stream);
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.iters = options.iters;
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  const size_t mid = ms.size() / 2;
  t.median_ms = ms.size() % 2 ? ms[mid] : 0.5 * (ms[mid - 1] + ms[mid]);
  return t;
}

double copy_bandwidth_gbps() {
  DeviceBuffer<unsigned char> from(kCopyBandwidthBytes), to(kCopyBandwidthBytes);
  CUDA_CHECK(cudaMemset(from.get(), 0, from.bytes()));
  TimingOptions options;
  options.warmup = 3;
  options.iters = 21;
  const Timing t = time_launches(
      [&](cudaStream_t stream) {
        CUDA_CHECK(cudaMemcpyAsync(to.get(), from.get(), kCopyBandwidthBytes,
                                   cudaMemcpyDeviceToDevice, stream));
      },
      options);
  return 2.0 * kCopyBandwidthBytes / (t.median_ms * 1e-3) / 1e9;
}

}  // namespace attn
