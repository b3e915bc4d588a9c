// Device memory that frees itself. Allocations are counted, so that running out of device memory
// can say how much the run already holds.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

namespace attn {

struct OutOfDeviceMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void* device_allocate(size_t bytes);  // throws OutOfDeviceMemory with the sizes in its message
void device_free(void* ptr, size_t bytes) noexcept;

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count)
      : ptr_(static_cast<T*>(device_allocate(count * sizeof(T)))), count_(count) {}
  ~DeviceBuffer() { device_free(ptr_, count_ * sizeof(T)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(count_, other.count_);
    return *this;
  }
  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace attn
