// The decode kind of runner.h: a few new tokens per sequence against a KV cache, contiguous or in
// pages. The cache's values are those of one logical tensor, K[b, kv head, token, :], whatever the
// layout, so the check makes a group's keys again from the seed without reading the device.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "cuda_check.h"
#include "device_buffer.h"
#include "host_data.h"
#include "memory_plan.h"
#include "npy.h"
#include "page_allocator.h"
#include "reference.h"
#include "run_parts.h"
#include "runner.h"

namespace attn {

namespace {

// "100,7,3000": one length per sequence.
std::vector<int> parse_length_list(const std::string& text, int batch) {
  std::vector<int> lengths;
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    char* end = nullptr;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || value < 0 || value > 2147483647L)
      throw InvalidInput("--seqlens-k lists whole numbers of 0 or more (got '" + item + "').");
    lengths.push_back(int(value));
  }
  if (int(lengths.size()) != batch)
    throw InvalidInput("--seqlens-k lists " + std::to_string(lengths.size()) +
                       " lengths for a batch of " + std::to_string(batch) + ".");
  return lengths;
}

// "uniform:LO:HI": each length drawn uniformly from [LO, HI], from the seed.
std::vector<int> draw_lengths(const std::string& text, int batch, uint64_t seed) {
  long low = -1, high = -1;
  char tail = 0;
  if (std::sscanf(text.c_str(), "uniform:%ld:%ld%c", &low, &high, &tail) != 2 || low < 0 ||
      high < low || high > 2147483647L)
    throw InvalidInput(
        "--seqlens-k takes a list of lengths or uniform:LO:HI with 0 <= LO <= HI (got '" + text +
        "').");
  std::vector<int> lengths(batch);
  const uint64_t span = uint64_t(high - low) + 1;
  for (int b = 0; b < batch; ++b)
    lengths[b] =
        int(low + splitmix64(splitmix64(seed * 0x100000001B3ull + kStreamLengths) + b) % span);
  return lengths;
}

// Index of element (b, kv head, token, 0) of the logical cache, the contiguous layout.
size_t cache_index(const DecodeShape& shape, int b, int kv_head, int token) {
  return ((size_t(b) * shape.heads_kv + kv_head) * shape.max_seqlen_k + token) * shape.head_dim;
}

// A paged cache as the runner builds it: a pool with room for every sequence plus one spare page
// per sequence (never read, NaN), and the block table an allocator handed out.
struct PagedCache {
  int page_size = 0, num_pages = 0, max_pages_per_seq = 0;
  std::vector<int> block_table;  // [batch, max_pages_per_seq], -1 past a sequence's pages
  size_t pool_elements(const DecodeShape& shape) const {
    return size_t(num_pages) * page_size * shape.heads_kv * shape.head_dim;
  }
};

PagedCache plan_pages(const DecodeShape& shape, const RunOptions& options) {
  PagedCache cache;
  cache.page_size = options.page_size;
  int used = 0;
  for (int length : shape.seqlens_k) used += pages_for(length, options.page_size);
  cache.num_pages = used + shape.batch;
  cache.max_pages_per_seq = std::max(1, pages_for(shape.longest_seqlen_k(), options.page_size));
  return cache;
}

// Runs the sequences through a PageAllocator as a server would: each sequence is added and grows
// to its length; with a random order the pool's free list starts shuffled.
void allocate_pages(PagedCache& cache, const DecodeShape& shape, const RunOptions& options) {
  const uint64_t shuffle_seed = options.random_page_order
                                    ? splitmix64(options.seed * 0x100000001B3ull + kStreamPages) | 1
                                    : 0;
  PageAllocator allocator(cache.num_pages, cache.page_size, shuffle_seed);
  std::vector<int> seqs;
  for (int b = 0; b < shape.batch; ++b) {
    seqs.push_back(allocator.add_sequence());
    allocator.append(seqs.back(), shape.seqlens_k[b]);
  }
  cache.block_table = allocator.block_table(seqs, cache.max_pages_per_seq);
}

// Fills `pages` pages of the pool from page `first_page` on: each slot that holds token t of a
// sequence gets the logical cache's values of that token for every kv head; every other slot
// (past a sequence's end, or of a page no sequence owns) gets NaN. Pages in parallel.
void fill_pool_pages(float* out, int first_page, int pages, const PagedCache& cache,
                     const std::vector<std::pair<int, int>>& owner, const DecodeShape& shape,
                     DType dtype, uint64_t seed, uint64_t stream) {
  const size_t d = shape.head_dim, slot_elements = size_t(shape.heads_kv) * d;
  const size_t page_elements = cache.page_size * slot_elements;
  auto fill = [&](int from, int to) {
    std::vector<float> rows(size_t(cache.page_size) * d);
    for (int i = from; i < to; ++i) {
      float* page = out + size_t(i) * page_elements;
      std::fill(page, page + page_elements, std::nanf(""));
      const auto [b, logical] = owner[first_page + i];
      if (b < 0) continue;
      const int first_token = logical * cache.page_size;
      const int tokens = std::min(cache.page_size, shape.seqlens_k[b] - first_token);
      for (int h = 0; h < shape.heads_kv; ++h) {
        make_input(rows.data(), size_t(tokens) * d, cache_index(shape, b, h, first_token), dtype,
                   seed, stream, 1.0f);
        for (int s = 0; s < tokens; ++s)
          std::copy_n(rows.data() + s * d, d, page + s * slot_elements + h * d);
      }
    }
  };
  const int workers = std::max(1, std::min<int>(std::thread::hardware_concurrency(), pages));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back(fill, pages * w / workers, pages * (w + 1) / workers);
  for (auto& t : pool) t.join();
}

void upload_pool(DeviceTensor& pool, const PagedCache& cache, const DecodeShape& shape, DType dtype,
                 uint64_t seed, uint64_t stream) {
  // owner[page] = (sequence, its logical page), or (-1, -1) for a spare page.
  std::vector<std::pair<int, int>> owner(cache.num_pages, {-1, -1});
  for (int b = 0; b < shape.batch; ++b)
    for (int p = 0; p < pages_for(shape.seqlens_k[b], cache.page_size); ++p)
      owner[cache.block_table[size_t(b) * cache.max_pages_per_seq + p]] = {b, p};
  const size_t page_elements = size_t(cache.page_size) * shape.heads_kv * shape.head_dim;
  const int pages_per_piece = int(std::max<size_t>(1, kInputPieceElements / page_elements));
  std::vector<float> piece(std::min<size_t>(pool.count(), pages_per_piece * page_elements));
  for (int first = 0; first < cache.num_pages; first += pages_per_piece) {
    const int pages = std::min(pages_per_piece, cache.num_pages - first);
    fill_pool_pages(piece.data(), first, pages, cache, owner, shape, dtype, seed, stream);
    pool.upload(piece.data(), pages * page_elements, first * page_elements);
  }
}

// Every slot of the contiguous cache past a sequence's length becomes NaN (0xFF bytes are a NaN in
// fp32 and bf16), so a kernel that reads one fails the check.
void poison_unused_slots(DeviceTensor& cache, const DecodeShape& shape, DType dtype) {
  for (int b = 0; b < shape.batch; ++b) {
    const int unused = shape.max_seqlen_k - shape.seqlens_k[b];
    if (unused == 0) continue;
    for (int h = 0; h < shape.heads_kv; ++h)
      CUDA_CHECK(cudaMemset(static_cast<unsigned char*>(cache.data()) +
                                cache_index(shape, b, h, shape.seqlens_k[b]) * dtype_size(dtype),
                            0xFF, size_t(unused) * shape.head_dim * dtype_size(dtype)));
  }
}

// The groups the check compares: (sequence, kv head) pairs as HeadIndex {batch, head = kv head}.
std::vector<HeadIndex> checked_groups(const DecodeShape& shape, const RunOptions& options) {
  if (!options.check) return {};
  // A stand-in problem with one "head" per group, group_size * seqlen_q rows and the longest
  // length, so that the sampler's multiply-add count bounds the reference's work.
  const AttentionShape groups =
      make_shape(shape.batch, shape.heads_kv, shape.heads_kv, shape.group_size() * shape.seqlen_q,
                 std::max(1, shape.longest_seqlen_k()), shape.head_dim);
  if (options.check_all) return all_heads(groups);
  return sample_heads(groups, options.check_mac_budget, options.seed,
                      size_t(options.check_max_heads));
}

RunFootprint decode_footprint(const DecodeChapter& chapter, const DecodeShape& shape,
                              const RunOptions& options) {
  const size_t element = dtype_size(chapter.dtype);
  const std::vector<HeadIndex> groups = checked_groups(shape, options);
  RunFootprint f;
  size_t cache_elements = shape.cache_elements();
  if (chapter.paged) {
    const PagedCache cache = plan_pages(shape, options);
    cache_elements = cache.pool_elements(shape);
    f.io_what = "Q, K/V pages, O, LSE, lengths, block table";
    f.io_bytes = sizeof(int) * size_t(shape.batch) * cache.max_pages_per_seq;
  } else {
    f.io_what = "Q, K/V cache, O, LSE, lengths";
  }
  f.io_bytes += (2 * shape.q_elements() + 2 * cache_elements) * element +
                shape.lse_elements() * sizeof(float) + shape.batch * sizeof(int);
  f.timing_what = "copy bandwidth buffers";  // the copy it is compared with
  f.timing_bytes = 2 * kCopyBandwidthBytes;
  f.workspace_bytes = chapter.workspace_bytes(shape);
  f.largest_input_elements = std::max<size_t>(shape.q_elements(), cache_elements);
  // Per group: its Q and O (float), two references of O and LSE (double), its K and V (float).
  const size_t rows = size_t(shape.group_size()) * shape.seqlen_q, d = shape.head_dim;
  size_t check_bytes = 0;
  for (const HeadIndex& g : groups)
    check_bytes +=
        4 * 2 * rows * d + 2 * 8 * rows * (d + 1) + 4 * 2 * size_t(shape.seqlens_k[g.batch]) * d;
  f.check_what = "check of " + std::to_string(groups.size()) + " groups";
  f.check_bytes = check_bytes;
  f.save_bytes = 4 * (2 * shape.q_elements() + 2 * cache_elements + shape.lse_elements());
  f.fewer_checks =
      "check fewer (sequence, key/value head) groups with --check-heads N, or none with "
      "--no-check.";
  return f;
}

}  // namespace

DecodeShape decode_shape(const RunOptions& options) {
  const AttentionShape& s = options.shape;
  DecodeShape shape;
  shape.batch = s.batch;
  shape.heads_q = s.heads_q;
  shape.heads_kv = s.heads_kv;
  shape.seqlen_q = s.seqlen_q;
  shape.head_dim = s.head_dim;
  shape.scale = s.scale;
  if (options.seqlens_k.empty()) shape.seqlens_k.assign(s.batch, s.seqlen_k);
  else if (options.seqlens_k.rfind("uniform:", 0) == 0)
    shape.seqlens_k = draw_lengths(options.seqlens_k, s.batch, options.seed);
  else shape.seqlens_k = parse_length_list(options.seqlens_k, s.batch);
  shape.max_seqlen_k = std::max(1, shape.longest_seqlen_k());
  return shape;
}

void require_decode_fits(const DecodeChapter& chapter, const RunOptions& options) {
  require_fits(decode_footprint(chapter, decode_shape(options), options), options);
}

RunReport run_decode(const DecodeChapter& chapter, const RunOptions& options) {
  const DecodeShape shape = decode_shape(options);
  if (std::string why = validate(shape, chapter.head_dims); !why.empty()) throw InvalidInput(why);
  if (chapter.paged && !page_size_valid(options.page_size)) throw InvalidInput(kPageSizeRule);
  const DType dtype = chapter.dtype;
  const RunFootprint footprint = decode_footprint(chapter, shape, options);
  require_fits(footprint, options);

  RunReport report = start_report(chapter.name, ChapterKind::kDecode, dtype, options, footprint,
                                  chapter.workspace_what);
  report.decode.shape = shape;
  const std::vector<HeadIndex> groups = checked_groups(shape, options);

  PagedCache pages;
  size_t cache_elements = shape.cache_elements();
  if (chapter.paged) {
    pages = plan_pages(shape, options);
    allocate_pages(pages, shape, options);
    cache_elements = pages.pool_elements(shape);
  }
  DeviceTensor q_dev(dtype, shape.q_elements()), k_dev(dtype, cache_elements),
      v_dev(dtype, cache_elements), o_dev(dtype, shape.q_elements()),
      lse_dev(DType::kF32, shape.lse_elements());
  DeviceBuffer<int> seqlens_dev(shape.batch), block_table_dev(pages.block_table.size());
  DeviceBuffer<unsigned char> workspace(report.workspace_bytes);
  upload_input(q_dev, dtype, options.seed, kStreamQ, options.q_scale);
  if (chapter.paged) {
    upload_pool(k_dev, pages, shape, dtype, options.seed, kStreamK);
    upload_pool(v_dev, pages, shape, dtype, options.seed, kStreamV);
    CUDA_CHECK(cudaMemcpy(block_table_dev.get(), pages.block_table.data(),
                          pages.block_table.size() * sizeof(int), cudaMemcpyHostToDevice));
  } else {
    upload_input(k_dev, dtype, options.seed, kStreamK, 1.0f);
    upload_input(v_dev, dtype, options.seed, kStreamV, 1.0f);
    poison_unused_slots(k_dev, shape, dtype);
    poison_unused_slots(v_dev, shape, dtype);
  }
  CUDA_CHECK(cudaMemcpy(seqlens_dev.get(), shape.seqlens_k.data(), shape.batch * sizeof(int),
                        cudaMemcpyHostToDevice));
  o_dev.poison();
  lse_dev.poison();

  DecodeParams params;
  params.shape = shape;
  params.q = q_dev.data();
  params.k = k_dev.data();
  params.v = v_dev.data();
  params.seqlens_k = seqlens_dev.get();
  if (chapter.paged) {
    params.block_table = block_table_dev.get();
    params.page_size = pages.page_size;
    params.max_pages_per_seq = pages.max_pages_per_seq;
    params.num_pages = pages.num_pages;
  }
  params.o = o_dev.data();
  params.lse = static_cast<float*>(lse_dev.data());
  params.workspace = workspace.get();
  chapter.launch(params, nullptr);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaDeviceSynchronize());

  const size_t b = shape.batch, hq = shape.heads_q, hkv = shape.heads_kv, sq = shape.seqlen_q;
  const size_t d = shape.head_dim, g = shape.group_size();
  if (!options.save_dir.empty()) {
    std::filesystem::create_directories(options.save_dir);
    const std::string dir = options.save_dir + "/";
    save_npy(dir + "q.npy", q_dev.download(), {b, hq, sq, d});
    save_npy(dir + "o.npy", o_dev.download(), {b, hq, sq, d});
    save_npy(dir + "lse.npy", lse_dev.download(), {b, hq, sq});
    save_npy(dir + "seqlens_k.npy",
             std::vector<float>(shape.seqlens_k.begin(), shape.seqlens_k.end()), {b});
    if (chapter.paged) {
      const std::vector<size_t> pool_shape = {size_t(pages.num_pages), size_t(pages.page_size), hkv,
                                              d};
      save_npy(dir + "k.npy", k_dev.download(), pool_shape);
      save_npy(dir + "v.npy", v_dev.download(), pool_shape);
      save_npy(dir + "block_table.npy",
               std::vector<float>(pages.block_table.begin(), pages.block_table.end()),
               {b, size_t(pages.max_pages_per_seq)});
    } else {
      const std::vector<size_t> cache_shape = {b, hkv, size_t(shape.max_seqlen_k), d};
      save_npy(dir + "k.npy", k_dev.download(), cache_shape);
      save_npy(dir + "v.npy", v_dev.download(), cache_shape);
    }
  }

  if (options.check) {
    // Each group's rows are one range of Q, O and LSE: query heads kv*g .. kv*g + g - 1.
    const size_t rows = g * sq, n = groups.size();
    std::vector<float> q(n * rows * d), o(n * rows * d), lse(n * rows);
    std::vector<std::vector<float>> k(n), v(n);
    std::vector<DecodeGroupInputs> inputs;
    for (size_t i = 0; i < n; ++i) {
      const HeadIndex& group = groups[i];
      const size_t first_row = (size_t(group.batch) * hq + size_t(group.head) * g) * sq;
      make_input(q.data() + i * rows * d, rows * d, first_row * d, dtype, options.seed, kStreamQ,
                 options.q_scale);
      const std::vector<float> o_rows = o_dev.download(first_row * d, rows * d);
      const std::vector<float> lse_rows = lse_dev.download(first_row, rows);
      std::copy(o_rows.begin(), o_rows.end(), o.begin() + i * rows * d);
      std::copy(lse_rows.begin(), lse_rows.end(), lse.begin() + i * rows);
      const size_t keys = shape.seqlens_k[group.batch];
      k[i].resize(keys * d);
      v[i].resize(keys * d);
      const size_t first_key = cache_index(shape, group.batch, group.head, 0);
      make_input(k[i].data(), keys * d, first_key, dtype, options.seed, kStreamK, 1.0f);
      make_input(v[i].data(), keys * d, first_key, dtype, options.seed, kStreamV, 1.0f);
      inputs.push_back({group.batch, q.data() + i * rows * d, k[i].data(), v[i].data()});
    }
    const DecodeReference ref = reference_decode(shape, inputs);
    const Tolerance o_tolerance =
        dtype == DType::kF32
            ? fp32_output_tolerance(ref.max_abs_logit)
            : bf16_output_tolerance(max_abs_difference(
                  reference_decode(shape, inputs, RefPrecision::kPlainBf16).o, ref.o));
    const Tolerance lse_tol = lse_tolerance(dtype, ref.max_abs_logit);
    report.checked = true;
    report.heads_checked = n;
    report.heads_total = b * hkv;
    report.max_abs_logit = ref.max_abs_logit;
    auto where = [&](const char* what, size_t row_len) {
      return [&, what, row_len](size_t i) {
        const HeadIndex& group = groups[i / (rows * row_len)];
        const size_t row = i / row_len % rows;
        std::ostringstream s;
        s << what << "[b=" << group.batch << " h=" << group.head * g + row / sq
          << " token=" << row % sq;
        if (row_len > 1) s << " d=" << i % row_len;
        s << "]";
        return s.str();
      };
    };
    add_output(report, "o", o_tolerance, o, ref.o, where("o", d));
    add_output(report, "lse", lse_tol, lse, ref.lse, where("lse", 1));
  }

  DecodeFacts& facts = report.decode;
  facts.page_size = chapter.paged ? pages.page_size : 0;
  facts.kv_bytes = decode_kv_bytes(shape, int(dtype_size(dtype)));
  facts.cache_bytes = 2 * cache_elements * dtype_size(dtype);
  facts.contiguous_cache_bytes = 2 * shape.cache_elements() * dtype_size(dtype);
  time_into(
      report, [&](cudaStream_t stream) { chapter.launch(params, stream); }, options, 0);
  if (report.timed) {
    facts.kv_gbps = facts.kv_bytes / (report.timing.median_ms * 1e-3) / 1e9;
    facts.copy_gbps = copy_bandwidth_gbps();
  }
  return report;
}

}  // namespace attn
