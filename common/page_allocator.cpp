#include "page_allocator.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "host_data.h"

namespace attn {
namespace {

// Sequence ids name live sequences only: an id never handed out, or one already freed, is a bug in
// the caller, which a silent answer would hide.
void check_live(const std::vector<bool>& live, int seq) {
  if (seq < 0 || size_t(seq) >= live.size() || !live[seq]) {
    throw std::invalid_argument("sequence " + std::to_string(seq) +
                                " is not a live sequence of this page pool.");
  }
}

}  // namespace

PageAllocator::PageAllocator(int num_pages, int page_size, uint64_t shuffle_seed)
    : num_pages_(num_pages), page_size_(page_size) {
  if (num_pages < 0 || page_size < 1) {
    throw std::invalid_argument("a page pool needs 0 or more pages of 1 or more tokens each (got " +
                                std::to_string(num_pages) + " pages of " +
                                std::to_string(page_size) + ").");
  }
  // The stack's top is handed out first, so page 0 goes on top.
  free_.resize(num_pages);
  for (int i = 0; i < num_pages; ++i) free_[i] = num_pages - 1 - i;
  if (shuffle_seed != 0) {
    // Fisher-Yates with splitmix64 (host_data.h), whose output is fixed by its definition: a seed
    // shuffles the pool the same way with every compiler and standard library (std::shuffle and
    // the standard distributions leave their algorithms to the implementation).
    for (size_t i = free_.size(); i > 1; --i)
      std::swap(free_[i - 1], free_[splitmix64(shuffle_seed + i) % i]);
  }
}

int PageAllocator::add_sequence() {
  pages_.emplace_back();
  lengths_.push_back(0);
  live_.push_back(true);
  return int(pages_.size()) - 1;
}

void PageAllocator::append(int seq, int tokens) {
  check_live(live_, seq);
  if (tokens < 0) {
    throw std::invalid_argument("a sequence cannot grow by a negative number of tokens (got " +
                                std::to_string(tokens) + ").");
  }
  const int64_t new_length = int64_t(lengths_[seq]) + tokens;
  if (new_length > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("sequence " + std::to_string(seq) + " would grow past " +
                                std::to_string(std::numeric_limits<int>::max()) + " tokens.");
  }
  const int needed = pages_for(new_length, page_size_) - int(pages_[seq].size());
  if (needed > free_pages()) {
    throw std::runtime_error("the page pool is out of pages: sequence " + std::to_string(seq) +
                             " needs " + std::to_string(needed) + " more for " +
                             std::to_string(tokens) + " tokens, and " +
                             std::to_string(free_pages()) + " are free.");
  }
  for (int i = 0; i < needed; ++i) {
    pages_[seq].push_back(free_.back());
    free_.pop_back();
  }
  lengths_[seq] = int(new_length);
}

void PageAllocator::free_sequence(int seq) {
  check_live(live_, seq);
  // Pushed last page first, so the next sequence gets them back in the order this one held them.
  for (auto page = pages_[seq].rbegin(); page != pages_[seq].rend(); ++page) free_.push_back(*page);
  pages_[seq].clear();
  lengths_[seq] = 0;
  live_[seq] = false;
}

int PageAllocator::length(int seq) const {
  check_live(live_, seq);
  return lengths_[seq];
}

const std::vector<int>& PageAllocator::pages(int seq) const {
  check_live(live_, seq);
  return pages_[seq];
}

int PageAllocator::free_pages() const { return int(free_.size()); }

std::vector<int> PageAllocator::block_table(const std::vector<int>& seqs,
                                            int max_pages_per_seq) const {
  std::vector<int> table(seqs.size() * size_t(std::max(0, max_pages_per_seq)), -1);
  for (size_t row = 0; row < seqs.size(); ++row) {
    const std::vector<int>& held = pages(seqs[row]);
    if (int(held.size()) > max_pages_per_seq) {
      throw std::invalid_argument("sequence " + std::to_string(seqs[row]) + " holds " +
                                  std::to_string(held.size()) + " pages, more than a row of " +
                                  std::to_string(max_pages_per_seq) + " in the block table.");
    }
    std::copy(held.begin(), held.end(), table.begin() + row * max_pages_per_seq);
  }
  return table;
}

}  // namespace attn
