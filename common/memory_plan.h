// The bytes a run needs, worked out before anything is allocated: a problem too large for the GPU
// or for this machine's memory is refused with one sentence that names the bytes and what to
// change, instead of failing halfway (std::bad_alloc, or the operating system ending the process).
// Every kind of chapter adds up its own tensors and asks the same two questions.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace attn {

// Device memory: the runner's exit status 3. (OutOfDeviceMemory, in device_buffer.h, is what a
// refused plan and a failed allocation both throw.)
// Host memory: exit status 2, since the remedy is a smaller problem or a smaller check.
struct OutOfHostMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A named list of byte counts, e.g. {"Q, K, V, O, LSE", 5e8}, {"workspace", 1e9}.
struct MemoryNeed {
  std::vector<std::pair<std::string, size_t>> parts;
  void add(const std::string& what, size_t bytes) {
    if (bytes) parts.emplace_back(what, bytes);
  }
  size_t total() const;
  std::string describe() const;  // "12.50 GB (Q, K, V, O, LSE 4.29 GB, workspace 8.21 GB)"
};

std::string gigabytes(size_t bytes);  // "1.25 GB"

// "" when `need` fits in `available`, otherwise the sentence the runner prints. Pure functions,
// so the CPU tests can check them.
std::string device_memory_problem(const MemoryNeed& need, size_t free_bytes, size_t total_bytes);
std::string host_memory_problem(const MemoryNeed& need, size_t available_bytes,
                                const std::string& advice);

// What this process may still allocate on the host: /proc/meminfo's MemAvailable, or the
// remaining room under a cgroup memory limit if that is lower (as in a container).
size_t host_available_bytes();

// Throw OutOfDeviceMemory (asks the GPU how much is free) or OutOfHostMemory when the need does
// not fit.
void require_device_memory(const MemoryNeed& need);
void require_host_memory(const MemoryNeed& need, const std::string& advice);

}  // namespace attn
