// The page allocator builds the block tables the paged decode chapters read, so a page handed out
// twice would make two sequences share keys and a test pass or fail for the wrong reason. Label
// `cpu`.
#include "page_allocator.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

using namespace attn;

namespace {

std::vector<int> in_order(int n) {
  std::vector<int> pages(n);
  std::iota(pages.begin(), pages.end(), 0);
  return pages;
}

// The order in which a fresh pool hands out its pages: one sequence takes all of them.
std::vector<int> hand_out_order(int num_pages, uint64_t seed) {
  PageAllocator pool(num_pages, 4, seed);
  const int seq = pool.add_sequence();
  pool.append(seq, num_pages * 4);
  return pool.pages(seq);
}

}  // namespace

TEST_CASE("pages_for rounds up to whole pages") {
  CHECK(pages_for(0, 16) == 0);
  CHECK(pages_for(1, 16) == 1);
  CHECK(pages_for(16, 16) == 1);
  CHECK(pages_for(17, 16) == 2);
  CHECK(pages_for(int64_t(1) << 33, 1 << 20) == 1 << 13);
}

TEST_CASE("an unshuffled pool hands out pages 0, 1, 2, ... in order") {
  PageAllocator pool(8, 16);
  CHECK(pool.num_pages() == 8);
  CHECK(pool.page_size() == 16);
  CHECK(pool.free_pages() == 8);
  const int first = pool.add_sequence(), second = pool.add_sequence();
  pool.append(first, 40);  // three pages
  pool.append(second, 1);
  CHECK(pool.pages(first) == std::vector<int>{0, 1, 2});
  CHECK(pool.pages(second) == std::vector<int>{3});
  CHECK(pool.length(first) == 40);
  CHECK(pool.length(second) == 1);
  CHECK(pool.free_pages() == 4);
}

TEST_CASE("a sequence takes a new page only when it crosses a page boundary") {
  PageAllocator pool(4, 16);
  const int seq = pool.add_sequence();
  pool.append(seq, 0);
  CHECK(pool.pages(seq).empty());
  pool.append(seq, 1);
  CHECK(pool.pages(seq).size() == 1);
  pool.append(seq, 15);  // exactly fills the first page
  CHECK(pool.pages(seq).size() == 1);
  CHECK(pool.length(seq) == 16);
  pool.append(seq, 1);  // the 17th token starts the second page
  CHECK(pool.pages(seq).size() == 2);
  for (int t = 0; t < 15; ++t) pool.append(seq, 1);
  CHECK(pool.pages(seq).size() == 2);
  pool.append(seq, 17);  // 32 + 17 = 49 tokens: two pages more, the fourth one started
  CHECK(pool.pages(seq) == std::vector<int>{0, 1, 2, 3});
}

TEST_CASE("freed pages are the next ones handed out, in the order their sequence held them") {
  PageAllocator pool(10, 4);
  const int a = pool.add_sequence(), b = pool.add_sequence();
  pool.append(a, 12);  // pages 0, 1, 2
  pool.append(b, 4);   // page 3
  pool.free_sequence(a);
  CHECK(pool.free_pages() == 9);
  const int c = pool.add_sequence();
  CHECK(c != a);  // ids are not reused
  pool.append(c, 16);
  CHECK(pool.pages(c) == std::vector<int>{0, 1, 2, 4});
  CHECK(pool.pages(b) == std::vector<int>{3});
}

TEST_CASE("running out of pages throws and changes nothing") {
  PageAllocator pool(3, 8);
  const int a = pool.add_sequence(), b = pool.add_sequence();
  pool.append(a, 10);                                      // pages 0, 1
  pool.append(b, 3);                                       // page 2
  CHECK_THROWS_AS(pool.append(a, 7), std::runtime_error);  // 17 tokens: a third page, none free
  CHECK(pool.length(a) == 10);
  CHECK(pool.pages(a) == std::vector<int>{0, 1});
  CHECK(pool.free_pages() == 0);
  pool.append(a, 6);  // 16 tokens still fit the two pages it holds
  CHECK(pool.length(a) == 16);
  pool.free_sequence(b);
  CHECK_THROWS_AS(pool.append(a, 10), std::runtime_error);  // 26 tokens: two more, one free
  CHECK(pool.length(a) == 16);
  CHECK(pool.pages(a) == std::vector<int>{0, 1});
  CHECK(pool.free_pages() == 1);
  pool.append(a, 1);
  CHECK(pool.pages(a) == std::vector<int>{0, 1, 2});
}

TEST_CASE("bad sequence ids and negative token counts are rejected") {
  PageAllocator pool(4, 8);
  const int seq = pool.add_sequence();
  CHECK_THROWS_AS(pool.append(seq, -1), std::invalid_argument);
  CHECK_THROWS_AS(pool.append(seq + 1, 1), std::invalid_argument);
  CHECK_THROWS_AS(pool.append(-1, 1), std::invalid_argument);
  CHECK_THROWS_AS(pool.length(7), std::invalid_argument);
  pool.append(seq, 9);
  pool.free_sequence(seq);
  CHECK_THROWS_AS(pool.free_sequence(seq), std::invalid_argument);  // freeing twice
  CHECK_THROWS_AS(pool.append(seq, 1), std::invalid_argument);
  CHECK_THROWS_AS(pool.pages(seq), std::invalid_argument);
  CHECK(pool.free_pages() == 4);
  CHECK_THROWS_AS(PageAllocator(4, 0), std::invalid_argument);
  CHECK_THROWS_AS(PageAllocator(-1, 8), std::invalid_argument);
}

TEST_CASE("a seeded pool starts in an order fixed by its seed") {
  const int n = 64;
  const std::vector<int> seeded = hand_out_order(n, 7);
  std::vector<int> sorted = seeded;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == in_order(n));  // a permutation: every page once
  CHECK(seeded != in_order(n));
  CHECK(hand_out_order(n, 7) == seeded);
  CHECK(hand_out_order(n, 8) != seeded);
  CHECK(hand_out_order(n, 0) == in_order(n));
}

TEST_CASE("the block table lists each sequence's pages and pads its row with -1") {
  PageAllocator pool(8, 4);
  const int a = pool.add_sequence(), b = pool.add_sequence(), c = pool.add_sequence();
  pool.append(a, 9);  // pages 0, 1, 2
  pool.append(b, 0);
  pool.append(c, 4);  // page 3
  CHECK(pool.block_table({c, a, b}, 4) ==
        std::vector<int>{3, -1, -1, -1, 0, 1, 2, -1, -1, -1, -1, -1});
  CHECK(pool.block_table({a}, 3) == std::vector<int>{0, 1, 2});
  CHECK_THROWS_AS(pool.block_table({a}, 2), std::invalid_argument);
}

TEST_CASE("random appends and frees never hand out a page twice") {
  // The invariant after every step: live sequences' pages are disjoint, hold exactly their
  // lengths, and together with the free pages cover the pool exactly once.
  const int num_pages = 40, page_size = 5;
  PageAllocator pool(num_pages, page_size, 3);
  std::mt19937 rng(11);  // its output is fixed by the standard; only distributions are not
  std::vector<int> live;
  int out_of_pages = 0, frees = 0;
  for (int step = 0; step < 3000; ++step) {
    const unsigned action = rng() % 8;
    if (live.empty() || action == 0) {
      live.push_back(pool.add_sequence());
    } else if (action == 1) {
      const size_t victim = rng() % live.size();
      pool.free_sequence(live[victim]);
      live.erase(live.begin() + victim);
      ++frees;
    } else {
      const int seq = live[rng() % live.size()];
      const int tokens = int(rng() % 12);
      try {
        pool.append(seq, tokens);
      } catch (const std::runtime_error&) {
        ++out_of_pages;
      }
    }
    std::vector<int> seen_times(num_pages, 0);
    for (int seq : live) {
      CHECK(int(pool.pages(seq).size()) == pages_for(pool.length(seq), page_size));
      for (int page : pool.pages(seq)) ++seen_times[page];
    }
    REQUIRE(std::all_of(seen_times.begin(), seen_times.end(), [](int n) { return n <= 1; }));
    REQUIRE(num_pages - pool.free_pages() ==
            std::accumulate(seen_times.begin(), seen_times.end(), 0));
  }
  // The walk went through both a full pool and many frees, or it tested little.
  CHECK(out_of_pages > 10);
  CHECK(frees > 100);
  // The free list holds exactly the pages no live sequence holds: one more sequence that takes
  // every free page leaves the pool covered once.
  const int rest = pool.add_sequence();
  pool.append(rest, pool.free_pages() * page_size);
  live.push_back(rest);
  std::vector<int> every;
  for (int seq : live) every.insert(every.end(), pool.pages(seq).begin(), pool.pages(seq).end());
  std::sort(every.begin(), every.end());
  CHECK(every == in_order(num_pages));
  CHECK(pool.free_pages() == 0);
}
