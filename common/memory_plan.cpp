#include "memory_plan.h"

#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include <unistd.h>

#include "cuda_check.h"
#include "device_buffer.h"

namespace attn {

size_t MemoryNeed::total() const {
  size_t sum = 0;
  for (const auto& part : parts) sum += part.second;
  return sum;
}

std::string MemoryNeed::describe() const {
  std::ostringstream s;
  s << gigabytes(total()) << " (";
  for (size_t i = 0; i < parts.size(); ++i)
    s << (i ? ", " : "") << parts[i].first << " " << gigabytes(parts[i].second);
  s << ")";
  return s.str();
}

std::string gigabytes(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GB", bytes / 1e9);
  return text;
}

std::string device_memory_problem(const MemoryNeed& need, size_t free_bytes, size_t total_bytes) {
  if (need.total() <= free_bytes) return "";
  return "this run needs " + need.describe() + " of device memory, and the GPU has " +
         gigabytes(free_bytes) + " free of " + gigabytes(total_bytes) +
         ": use a smaller batch, fewer heads or shorter sequences.";
}

std::string host_memory_problem(const MemoryNeed& need, size_t available_bytes,
                                const std::string& advice) {
  if (need.total() <= available_bytes) return "";
  return "this run needs " + need.describe() + " of host memory, and this machine has " +
         gigabytes(available_bytes) + " available: " + advice;
}

namespace {

// The number after `key` in a file of "key value" words (/proc/meminfo), or `fallback`.
size_t read_number(const std::string& path, const std::string& key, size_t fallback) {
  std::ifstream file(path);
  std::string word;
  while (file >> word) {
    if (word != key) continue;
    size_t value = 0;
    return file >> value ? value : fallback;
  }
  return fallback;
}

}  // namespace

size_t host_available_bytes() {
  constexpr size_t kUnknown = std::numeric_limits<size_t>::max();
  size_t available = read_number("/proc/meminfo", "MemAvailable:", kUnknown);
  if (available != kUnknown) {
    available *= 1024;  // /proc/meminfo counts kB
  } else {
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) available = size_t(pages) * size_t(page);
  }
  // Under a cgroup v2 memory limit (a container), what is left below the limit.
  std::ifstream max_file("/sys/fs/cgroup/memory.max"),
      current_file("/sys/fs/cgroup/memory.current");
  std::string max_text, current_text;
  if (max_file >> max_text && current_file >> current_text && max_text != "max") {
    try {
      const size_t limit = std::stoull(max_text), used = std::stoull(current_text);
      if (limit > used && limit - used < available) available = limit - used;
    } catch (const std::exception&) {
    }
  }
  return available;
}

void require_device_memory(const MemoryNeed& need) {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (std::string why = device_memory_problem(need, free_bytes, total_bytes); !why.empty())
    throw OutOfDeviceMemory(why);
}

void require_host_memory(const MemoryNeed& need, const std::string& advice) {
  if (std::string why = host_memory_problem(need, host_available_bytes(), advice); !why.empty())
    throw OutOfHostMemory(why);
}

}  // namespace attn
