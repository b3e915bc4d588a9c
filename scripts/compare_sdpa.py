#!/usr/bin/env python3
"""Compare the chapter ladder with what a user would pick instead: PyTorch SDPA.

Reads a CSV of `scripts/ladder --grid`, times PyTorch's scaled_dot_product_attention with its
flash (FlashAttention-2) and cuDNN backends on the same shapes, in the same run and on the same
GPU, and prints each chapter's TFLOP/s as a ratio of theirs. Writes the merged table as CSV and
draws the ladder plot (TFLOP/s per chapter per shape). Optional: needs PyTorch and matplotlib;
nothing in the build or the tests does.

    python3 scripts/compare_sdpa.py build/ladder.csv --plot build/ladder.png
    python3 scripts/compare_sdpa.py build/ladder-backward.csv --out build/comparison-backward.csv

A CSV of backward chapters (it has a `deterministic` column) is compared with the backward pass
of the same backends: torch.autograd.grad of the SDPA output with respect to q, k and v, timed
alone (the forward runs once, outside the timing), FLOPs 2.5x the forward's.

Everything it writes goes under build/ unless told otherwise: the course's own plot is made with
`--plot docs/ladder.png` (docs/benchmarks.md, "Reproduce").

Timing follows the chapters' convention (common/timing.cpp): CUDA events around each launch,
10 warm-up launches, the median of 50. FLOPs: 4 * B * H * N^2 * D, halved for causal (and times
2.5 for the backward).
"""
import argparse
import csv
import os
import statistics
import sys


def time_ms(fn, warmup=10, iters=50):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops))


def sdpa_tflops(shape, backward):
    """TFLOP/s of the flash and cuDNN backends on (batch, heads, seqlen, head_dim, causal): of the
    forward pass, or of the backward pass alone."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, seqlen, head_dim, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen, requires_grad=backward) for _ in range(3))
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    if backward:
        flops *= 2.5
    result = {}
    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                if backward:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    grad_o = torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=gen)
                    ms = time_ms(lambda: torch.autograd.grad(o, (q, k, v), grad_o,
                                                             retain_graph=True))
                    del o
                else:
                    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            result[name] = flops / (ms * 1e-3) / 1e12
        except RuntimeError as error:  # backend not available for this shape or GPU
            print(f"  {name} unavailable for {shape}: {str(error).splitlines()[0]}", file=sys.stderr)
            result[name] = float("nan")
    return result


def plot(rows, path, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for ax, (head_dim, causal) in zip(axes[0], panels):
        panel = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal]
        colors = plt.get_cmap("tab20")  # one colour per chapter: the default cycle has only 10
        for i, chapter in enumerate(sorted({r["chapter"] for r in rows})):
            points = sorted((r["seqlen"], r["tflops"]) for r in panel if r["chapter"] == chapter)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    color=colors(i % 20), label=chapter)
        for peer, style in (("fa2", "k--"), ("cudnn", "k:")):
            points = sorted({(r["seqlen"], r[peer]) for r in panel if r[peer] == r[peer]})
            if points:
                label = "PyTorch SDPA flash (FA2)" if peer == "fa2" else "PyTorch SDPA cuDNN"
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title}head_dim {head_dim}, {'causal' if causal else 'non-causal'}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ladder_csv", help="output of scripts/ladder --grid")
    parser.add_argument("--out", default="build/comparison.csv")
    parser.add_argument("--plot", default="", help="PNG path for the ladder plot")
    args = parser.parse_args()

    if not os.path.exists(args.ladder_csv):
        sys.exit(f"compare_sdpa.py: {args.ladder_csv} not found: make it first with "
                 f"scripts/ladder --grid --csv {args.ladder_csv}")
    with open(args.ladder_csv) as f:
        records = list(csv.DictReader(f))
    if not records:
        sys.exit(f"{args.ladder_csv} holds no records")

    try:
        import torch
    except ImportError:
        sys.exit("compare_sdpa.py: needs PyTorch (pip install torch); the chapters themselves do not.")
    if not torch.cuda.is_available():
        sys.exit("compare_sdpa.py: PyTorch sees no CUDA GPU, so there is nothing to compare on.")
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}")

    # Backward records carry their mode; a deterministic run is its own line of the table and plot.
    backward = "deterministic" in records[0]
    shapes = sorted({(int(r["batch"]), int(r["heads_q"]), int(r["seqlen_q"]), int(r["head_dim"]),
                      r["causal"] == "1") for r in records})
    peers = {}
    for shape in shapes:
        peers[shape] = sdpa_tflops(shape, backward)

    rows = []
    for r in records:
        shape = (int(r["batch"]), int(r["heads_q"]), int(r["seqlen_q"]), int(r["head_dim"]),
                 r["causal"] == "1")
        peer = peers[shape]
        tflops = float(r["tflops"])
        chapter = r["chapter"]
        if backward and r["deterministic"] == "1":
            chapter += " (deterministic)"
        rows.append(dict(chapter=chapter, head_dim=shape[3], seqlen=shape[2], batch=shape[0],
                         heads=shape[1], causal=int(shape[4]), passed=r["passed"], tflops=tflops,
                         fa2=peer["fa2"], cudnn=peer["cudnn"],
                         vs_fa2=tflops / peer["fa2"], vs_cudnn=tflops / peer["cudnn"]))

    print("backward pass" if backward else "forward pass")
    print(f"{'chapter':38} {'d':>4} {'seqlen':>6} {'causal':>6} {'TFLOP/s':>8} {'FA2':>7} "
          f"{'cuDNN':>7} {'x FA2':>6} {'x cuDNN':>7}")
    for r in rows:
        print(f"{r['chapter']:38} {r['head_dim']:4d} {r['seqlen']:6d} {r['causal']:6d} "
              f"{r['tflops']:8.1f} {r['fa2']:7.1f} {r['cudnn']:7.1f} {r['vs_fa2']:6.2f} "
              f"{r['vs_cudnn']:7.2f}")
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    print(f"records: {args.out}")
    if args.plot:
        plot(rows, args.plot, "backward, " if backward else "")


if __name__ == "__main__":
    main()
