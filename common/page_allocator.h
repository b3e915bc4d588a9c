// A KV cache in pages, as a serving system keeps it (vLLM, FlashInfer): a pool of fixed-size pages
// and, per sequence, the list of pages that hold its tokens in order (a row of the block table).
// Sequences grow a token at a time and end at different times; their pages return to a free list
// and are reused by the next sequence, so after a while a sequence's pages lie anywhere in the pool,
// the way a process's pages lie anywhere in physical memory. Host-side bookkeeping only: the
// harness uses it to build the block table a paged chapter reads.
#pragma once

#include <cstdint>
#include <vector>

namespace attn {

class PageAllocator {
 public:
  // A pool of num_pages pages of page_size tokens each. With shuffle_seed != 0 the free list
  // starts in a seeded random order (a pool that has served many sequences already); with 0 it
  // starts in order, so the first sequence gets pages 0, 1, 2, ...
  PageAllocator(int num_pages, int page_size, uint64_t shuffle_seed = 0);

  // A new, empty sequence; returns its id (ids of freed sequences are not reused).
  int add_sequence();
  // Makes room for `tokens` more tokens of sequence `seq`, taking pages from the free list when
  // its last page is full. Throws std::runtime_error (one sentence) when the pool runs out; then
  // nothing has changed.
  void append(int seq, int tokens);
  // Returns the pages of `seq` to the free list; they are the next ones handed out (last freed,
  // first reused). The id may not be used again.
  void free_sequence(int seq);

  int length(int seq) const;                     // tokens of `seq`
  const std::vector<int>& pages(int seq) const;  // its pages, in token order
  int free_pages() const;
  int num_pages() const { return num_pages_; }
  int page_size() const { return page_size_; }

  // The block table of the given sequences: row i lists the pages of seqs[i], padded with -1 to
  // max_pages_per_seq entries (which must be at least the longest list).
  std::vector<int> block_table(const std::vector<int>& seqs, int max_pages_per_seq) const;

 private:
  int num_pages_;
  int page_size_;
  std::vector<int> free_;  // a stack: back() is handed out next
  std::vector<std::vector<int>> pages_;
  std::vector<int> lengths_;
  std::vector<bool> live_;
};

// Pages needed to hold `tokens` tokens.
inline int pages_for(int64_t tokens, int page_size) {
  return int((tokens + page_size - 1) / page_size);
}

}  // namespace attn
