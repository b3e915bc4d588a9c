#!/usr/bin/env python3
"""The NumPy models behind chapters 12 and 31 (needs NumPy; nothing else uses it).

1. How often a warp of chapter 12 rescales O on the benchmark's inputs: 32 query rows, Q and K
   ~ Normal(0, q_scale) and Normal(0, 1), scores in log2 units, the reference moved only when some
   row's max outgrows it by more than the threshold. Printed beside the count of an exact skip
   (rescale whenever any max grew).
2. The drift that a computed alpha would cause when the reference does not move: alpha =
   exp2(m * c - round(m * c)) is 1 +- 1 ulp for about half of the rows, and applied to l but not
   to O it compounds over the blocks.
3. The same count as 1 for chapter 31's warps (16 rows, 128-key tiles, threshold 8), and for the
   FP8 case of its exercise 2 (192-key tiles at d 128, threshold 1).

    python3 scripts/rescale_model.py
"""
import numpy as np


def rescale_counts(head_dim, keys_per_block, seqlen, q_scale=1.0, threshold=8.0, seed=0, rows=32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, head_dim)) * q_scale
    k = rng.standard_normal((seqlen, head_dim))
    scores = (q @ k.T) / np.sqrt(head_dim) * np.log2(np.e)
    reference = np.full(rows, -np.inf)
    true_max = np.full(rows, -np.inf)
    lazy = exact = 0
    for start in range(0, seqlen, keys_per_block):
        block_max = scores[:, start:start + keys_per_block].max(axis=1)
        exact += bool(np.any(block_max > true_max))
        true_max = np.maximum(true_max, block_max)
        m_new = np.maximum(reference, block_max)
        with np.errstate(invalid="ignore"):
            if np.any(m_new - reference > threshold):
                lazy += 1
                reference = m_new
    return lazy, exact, -(-seqlen // keys_per_block)


def alpha_drift(head_dim, typical_row_max, blocks, samples=100000, seed=1):
    rng = np.random.default_rng(seed)
    c = np.float32(np.log2(np.e) / np.sqrt(head_dim))
    m = rng.normal(typical_row_max, typical_row_max / 8, samples).astype(np.float32)
    rounded = (m * c).astype(np.float32)
    residual = m.astype(np.float64) * np.float64(c) - rounded.astype(np.float64)  # what the FMA sees
    alpha = np.exp2(residual).astype(np.float32).astype(np.float64)
    return np.mean(alpha != 1.0), np.max(np.abs(alpha ** blocks - 1.0))


def main():
    print("1. warp-level rescales of O (32 rows), q-scale 1")
    for head_dim, keys in ((128, 32), (64, 64)):
        for seqlen in (2048, 16384):
            lazy, exact, blocks = rescale_counts(head_dim, keys, seqlen)
            print(f"   d {head_dim}, seqlen {seqlen}: {lazy} of {blocks} blocks "
                  f"(exact skip: {exact})")
    print("2. drift of l from a computed alpha when the reference stays (raw row max ~ 23, d 128)")
    for blocks in (256, 4096, 32768):
        share, drift = alpha_drift(128, 23.0, blocks)
        print(f"   {blocks} blocks: alpha != 1 in {share:.0%} of rows, largest drift {drift:.1e}")
    print("3. chapter 31 (16 rows per warp), q-scale 1, the first tile included; mean of 20 warps")
    for label, keys, threshold in (("bf16, 128-key tiles, threshold 8", 128, 8.0),
                                   ("FP8, 192-key tiles, threshold 1", 192, 1.0)):
        for seqlen in (512, 2048, 16384):
            counts = [rescale_counts(128, keys, seqlen, threshold=threshold, seed=seed, rows=16)
                      for seed in range(20)]
            print(f"   {label}, seqlen {seqlen}: {np.mean([c[0] for c in counts]):.1f} of "
                  f"{counts[0][2]} tiles (exact skip: {np.mean([c[1] for c in counts]):.1f})")


if __name__ == "__main__":
    main()
