#!/usr/bin/env python3
"""Compare the chapter ladder with what a user would pick instead: PyTorch SDPA.

Reads a CSV of `scripts/ladder --grid`, times PyTorch's scaled_dot_product_attention with its
flash (FlashAttention-2) and cuDNN backends on the same shapes, in the same run and on the same
GPU, and prints each chapter's TFLOP/s as a ratio of theirs. Writes the merged table as CSV and
draws the ladder plot (TFLOP/s per chapter per shape). Optional: needs PyTorch and matplotlib;
nothing in the build or the tests does.

    python3 scripts/compare_sdpa.py build/ladder.csv --plot build/ladder.png
    python3 scripts/compare_sdpa.py build/ladder-backward.csv --out build/comparison-backward.csv
    python3 scripts/compare_sdpa.py build/ladder-decode.csv --out build/comparison-decode.csv \\
        --plot build/ladder-decode.png

A CSV of backward chapters (it has a `deterministic` column) is compared with the backward pass
of the same backends: torch.autograd.grad of the SDPA output with respect to q, k and v, timed
alone (the forward runs once, outside the timing), FLOPs 2.5x the forward's.

A CSV of decode chapters (it has a `kv_gbps` column) is compared in bytes of K and V read per
second: SDPA on q [B, Hq, 1, D] and k, v [B, Hkv, L, D] in bf16, with the L2 cache overwritten
before every timed launch as the chapters do, beside torch's own device-to-device copy bandwidth
(bytes read + written). GQA runs with enable_gqa=True where a backend takes it; otherwise K and V
are expanded to Hq heads beforehand, and the GB/s still count the unexpanded bytes (the output
says which). Only records of one new token and one cache length for every sequence are compared.

Everything it writes goes under build/ unless told otherwise: the course's own plots are made with
`--plot docs/ladder.png` (docs/benchmarks.md, "Reproduce"). `--replot COMPARISON_CSV` draws the
plot of a forward or backward comparison written earlier (a record of docs/measurements), with
neither a GPU nor PyTorch:

    python3 scripts/compare_sdpa.py --replot docs/measurements/comparison-fp8-h100-2026-11-23-5b8b12e.csv \
        --plot build/ladder-fp8.png

Timing follows the chapters' convention (common/timing.cpp): CUDA events around each launch,
10 warm-up launches, the median of 50. FLOPs: 4 * B * H * N^2 * D, halved for causal (and times
2.5 for the backward).

Paired rounds. The ladder times every chapter first and this script the peers afterwards, minutes
apart; at the board's power limit the clock drifts between the two, and a cell's ratio moves with
it (several percent from run to run on the H100). `--rounds N` (forward and backward) instead runs
each chapter's binary again for every record, shape by shape, alternating with the peers N times
(chapter, peers, chapter, peers, ...), and reports the median over the rounds of each TFLOP/s and
of each round's ratio, with the ratios' lowest and highest; the ladder CSV then only says which
chapters and shapes to run (its timings are not used):

    python3 scripts/compare_sdpa.py build/grid.csv --rounds 5 --out build/comparison.csv
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys

BACKENDS = ("fa2", "cudnn")  # PyTorch SDPA's flash (FlashAttention-2) and cuDNN backends
PEER_NAMES = {"fa2": "PyTorch SDPA flash (FA2)", "cudnn": "PyTorch SDPA cuDNN"}


def time_ms(fn, warmup=10, iters=50, before=None):
    """Median milliseconds of fn; `before` (the L2 flush) runs ahead of each timed launch, outside
    its events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        if before:
            before()
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops))


def sdpa_backend(name):
    from torch.nn.attention import SDPBackend

    return {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def sdpa_tflops(shape, backward):
    """TFLOP/s of the flash and cuDNN backends on (batch, heads, seqlen, head_dim, causal): of the
    forward pass, or of the backward pass alone."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    batch, heads, seqlen, head_dim, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen, requires_grad=backward) for _ in range(3))
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    if backward:
        flops *= 2.5
    result = {}
    for name in BACKENDS:
        try:
            with sdpa_kernel([sdpa_backend(name)]):
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


def sdpa_problem(arguments):
    """(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal) from a chapter binary's
    options, which must name the batch, the heads, the lengths and the head dim (SDPA has no
    defaults to share with the binaries); causal only with seqlen_q == seqlen_k, where SDPA's
    top-left mask and the chapters' bottom-right one are the same."""
    parser = argparse.ArgumentParser(prog="SDPA problem", add_help=False)
    for option in ("--batch", "--heads", "--heads-kv", "--seqlen", "--seqlen-q", "--seqlen-k",
                   "--head-dim"):
        parser.add_argument(option, type=int)
    parser.add_argument("--causal", action="store_true")
    opts, _ = parser.parse_known_args(arguments)
    seqlen_q = opts.seqlen_q or opts.seqlen
    seqlen_k = opts.seqlen_k or opts.seqlen
    if None in (opts.batch, opts.heads, seqlen_q, seqlen_k, opts.head_dim):
        sys.exit("SDPA needs --batch, --heads, --seqlen (or -q and -k) and --head-dim")
    if opts.causal and seqlen_q != seqlen_k:
        sys.exit("SDPA's causal mask is top-left aligned: causal only with seqlen_q == seqlen_k")
    return (opts.batch, opts.heads, opts.heads_kv or opts.heads, seqlen_q, seqlen_k,
            opts.head_dim, opts.causal)


def sdpa_run(backend, arguments, iters):
    """The forward pass of one SDPA backend ("fa2" or "cudnn") on a chapter binary's problem,
    timed as time_ms does over `iters` launches: {"tflops", "median_ms"}, the keys scripts/ab
    reads from a binary's record. Random bf16 inputs; GQA through enable_gqa."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal = sdpa_problem(arguments)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    k, v = (torch.randn(batch, heads_kv, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)
    with sdpa_kernel([sdpa_backend(backend)]):
        ms = time_ms(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=heads_kv != heads), iters=iters)
    return {"tflops": flops / (ms * 1e-3) / 1e12, "median_ms": ms}


def l2_flush():
    """What the chapters run before each timed decode launch (common/timing.cpp): overwrite a buffer
    of twice the L2 cache, so that the launch reads K and V from device memory."""
    import torch

    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 128 << 20)
    buffer = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
    return buffer.zero_


def copy_gbps():
    """torch's device-to-device copy bandwidth, bytes read + written per second, over 512 MiB (the
    size common/timing.cpp copies)."""
    import torch

    source = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / (time_ms(lambda: target.copy_(source)) * 1e-3) / 1e9


def sdpa_decode_gbps(shape, flush):
    """GB/s of K and V read by the flash and cuDNN backends on one decode step (batch, heads_q,
    heads_kv, seqlen_k, head_dim), each with how it ran: "" (no GQA), "enable_gqa", "K/V expanded"
    (repeated to heads_q beforehand; the GB/s count the unexpanded bytes) or "unavailable"."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    batch, heads_q, heads_kv, seqlen_k, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads_q, 1, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, heads_kv, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    kv_bytes = 2 * k.numel() * k.element_size()
    group = heads_q // heads_kv

    def expanded():
        k_all, v_all = (x.repeat_interleave(group, dim=1) for x in (k, v))
        return lambda: F.scaled_dot_product_attention(q, k_all, v_all)

    # Each way makes the launch to time; the first one the backend takes is timed.
    ways = [("", lambda: lambda: F.scaled_dot_product_attention(q, k, v))]
    if group > 1:
        ways = [("enable_gqa", lambda: lambda: F.scaled_dot_product_attention(q, k, v,
                                                                               enable_gqa=True)),
                ("K/V expanded", expanded)]
    result = {}
    for name in BACKENDS:
        result[name] = (float("nan"), "unavailable")
        refusals = []
        for how, make in ways:
            try:
                with sdpa_kernel([sdpa_backend(name)]):
                    launch = make()
                    ms = time_ms(launch, before=flush)
                result[name] = (kv_bytes / (ms * 1e-3) / 1e9, how)
                break
            except (RuntimeError, TypeError) as error:  # refused (TypeError: no enable_gqa)
                refusals.append(f"{how or 'plain'}: {str(error).splitlines()[0]}")
            finally:
                launch = None  # frees expanded K and V before the next try
        if result[name][1] == "unavailable":
            print(f"  {name} unavailable for {shape}: {'; '.join(refusals)}", file=sys.stderr)
    return result


def attention_shape(record):
    return (int(record["batch"]), int(record["heads_q"]), int(record["seqlen_q"]),
            int(record["head_dim"]), record["causal"] == "1")


def chapter_arguments(record):
    """A chapter binary's options for the problem of a ladder record."""
    arguments = ["--batch", record["batch"], "--heads", record["heads_q"], "--heads-kv",
                 record["heads_kv"], "--seqlen-q", record["seqlen_q"], "--seqlen-k",
                 record["seqlen_k"], "--head-dim", record["head_dim"]]
    if record["causal"] == "1":
        arguments.append("--causal")
    if record.get("deterministic") == "1":
        arguments.append("--deterministic")
    return arguments


def run_chapter(binary, arguments):
    """The record (a dict of its CSV) that a chapter binary prints for these options, run with
    --no-check --csv; exits with the command and its error if it fails. Also used by scripts/ab."""
    command = [binary, *arguments, "--no-check", "--csv"]
    run = subprocess.run(command, capture_output=True, text=True)
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or len(lines) < 2:
        sys.exit(f"{' '.join(command)} failed: {run.stderr.strip()}")
    return next(csv.DictReader(lines[-2:]))


def chapter_tflops(record, bin_dir):
    """TFLOP/s of the record's chapter on the record's problem, timed again now by its binary
    (--no-check: the ladder's run and the tests check the same kernels)."""
    binary = os.path.join(bin_dir, record["chapter"])
    return float(run_chapter(binary, chapter_arguments(record))["tflops"])


def compare_attention(records, backward, rounds, bin_dir):
    """Forward or backward records: one row per record, the chapter's TFLOP/s beside the peers'.
    Backward records carry their mode; a deterministic run is its own line of the table and plot.
    With rounds > 1 the chapters are timed again, alternating with the peers shape by shape."""
    shapes = sorted(set(map(attention_shape, records)))
    # samples[i]: record i's TFLOP/s per round; peer_samples[shape][name]: the peer's per round.
    samples = [[float(r["tflops"])] if rounds == 1 else [] for r in records]
    peer_samples = {}
    for number, shape in enumerate(shapes, 1):
        if rounds > 1:  # a long run: say where it is (stderr, so that the table stays clean)
            print(f"  shape {number} of {len(shapes)}: {shape}", file=sys.stderr, flush=True)
        peer_samples[shape] = {name: [] for name in BACKENDS}
        for _ in range(rounds):
            if rounds > 1:
                for i, r in enumerate(records):
                    if attention_shape(r) == shape:
                        samples[i].append(chapter_tflops(r, bin_dir))
            for name, tflops in sdpa_tflops(shape, backward).items():
                peer_samples[shape][name].append(tflops)

    rows = []
    for r, own in zip(records, samples):
        shape = attention_shape(r)
        peer = peer_samples[shape]
        chapter = r["chapter"]
        if backward and r["deterministic"] == "1":
            chapter += " (deterministic)"
        # Each round's ratio pairs the chapter with the peers timed right after it.
        ratios = {name: [a / b for a, b in zip(own, peer[name])] for name in BACKENDS}
        rows.append(dict(chapter=chapter, head_dim=shape[3], seqlen=shape[2], batch=shape[0],
                         heads=shape[1], causal=int(shape[4]), passed=r["passed"],
                         tflops=statistics.median(own), fa2=statistics.median(peer["fa2"]),
                         cudnn=statistics.median(peer["cudnn"]),
                         vs_fa2=statistics.median(ratios["fa2"]),
                         vs_cudnn=statistics.median(ratios["cudnn"]), rounds=rounds,
                         vs_cudnn_low=min(ratios["cudnn"]), vs_cudnn_high=max(ratios["cudnn"])))

    print("backward pass" if backward else "forward pass")
    if rounds > 1:
        print(f"{rounds} rounds, chapter and peers alternating; medians, and the lowest and highest "
              "x cuDNN of a round")
    print(f"{'chapter':38} {'d':>4} {'seqlen':>6} {'causal':>6} {'TFLOP/s':>8} {'FA2':>7} "
          f"{'cuDNN':>7} {'x FA2':>6} {'x cuDNN':>7}" + ("  low..high" if rounds > 1 else ""))
    for r in rows:
        spread = f"  {r['vs_cudnn_low']:.3f}..{r['vs_cudnn_high']:.3f}" if rounds > 1 else ""
        print(f"{r['chapter']:38} {r['head_dim']:4d} {r['seqlen']:6d} {r['causal']:6d} "
              f"{r['tflops']:8.1f} {r['fa2']:7.1f} {r['cudnn']:7.1f} {r['vs_fa2']:6.2f} "
              f"{r['vs_cudnn']:7.2f}" + spread)
    return rows


def decode_shape(record):
    return (int(record["batch"]), int(record["heads_q"]), int(record["heads_kv"]),
            int(record["seqlen_k_max"]), int(record["head_dim"]))


def one_token_one_length(record):
    return record["seqlen_q"] == "1" and record["seqlen_k_min"] == record["seqlen_k_max"]


def compare_decode(records):
    """Decode records: one row per record of one new token and one cache length, the chapter's
    GB/s beside the peers' and the copy bandwidth; a table per shape."""
    compared = [r for r in records if one_token_one_length(r)]
    for r in records:
        if not one_token_one_length(r):
            print(f"skipped {r['chapter']} (batch {r['batch']}, seqlen_q {r['seqlen_q']}, cache "
                  f"lengths {r['seqlen_k_min']} to {r['seqlen_k_max']}): SDPA is compared on one "
                  "new token and one cache length for every sequence")
    flush = l2_flush()
    copy = copy_gbps()
    # Without GQA first, then by batch and length: the order of the grid.
    shapes = sorted(set(map(decode_shape, compared)), key=lambda s: (s[1] // s[2], s))
    peers = {shape: sdpa_decode_gbps(shape, flush) for shape in shapes}

    rows = []
    for r in compared:
        peer = peers[decode_shape(r)]
        batch, heads_q, heads_kv, seqlen_k, head_dim = decode_shape(r)
        kv_gbps = float(r["kv_gbps"])
        rows.append(dict(chapter=r["chapter"], batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                         seqlen_k=seqlen_k, head_dim=head_dim, page_size=int(r["page_size"]),
                         passed=r["passed"], kv_gbps=kv_gbps, copy_gbps=float(r["copy_gbps"]),
                         copy_fraction=float(r["copy_fraction"]), torch_copy_gbps=copy,
                         fa2=peer["fa2"][0], cudnn=peer["cudnn"][0], fa2_how=peer["fa2"][1],
                         cudnn_how=peer["cudnn"][1], vs_fa2=kv_gbps / peer["fa2"][0],
                         vs_cudnn=kv_gbps / peer["cudnn"][0]))

    print(f"decode, one new token, bf16, L2 flushed before every launch; GB/s of K and V read; "
          f"torch device-to-device copy {copy:.0f} GB/s (bytes read + written)")
    for shape, peer in peers.items():
        batch, heads_q, heads_kv, seqlen_k, head_dim = shape
        print(f"\nbatch {batch}, cache length {seqlen_k}, heads {heads_q} (key/value {heads_kv}), "
              f"head_dim {head_dim}")
        for name in BACKENDS:
            gbps, how = peer[name]
            note = {"": "", "unavailable": " (unavailable)", "enable_gqa": " (enable_gqa)",
                    "K/V expanded": f" (K and V expanded to {heads_q} heads; GB/s of the "
                                    f"{heads_kv} heads' bytes)"}[how]
            print(f"  {PEER_NAMES[name]}: {gbps:.0f} GB/s, {gbps / copy:.2f} x copy{note}")
        print(f"  {'chapter':30} {'page':>4} {'GB/s':>6} {'x copy':>6} {'x cuDNN':>7} "
              f"{'x flash':>7}")
        for r, record in zip(rows, compared):
            if decode_shape(record) == shape:
                print(f"  {r['chapter']:30} {r['page_size'] or '-':>4} {r['kv_gbps']:6.0f} "
                      f"{r['copy_fraction']:6.2f} {r['vs_cudnn']:7.2f} {r['vs_fa2']:7.2f}")
    return rows


def figure(panels):
    """A row of `panels` plots, and one colour per chapter (the default cycle has only 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5), squeeze=False)
    return fig, axes[0], plt.get_cmap("tab20")


def save(fig, axes, path):
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def plot(rows, path, title=""):
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes, colors = figure(len(panels))
    for ax, (head_dim, causal) in zip(axes, panels):
        panel = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal]
        for i, chapter in enumerate(sorted({r["chapter"] for r in rows})):
            points = sorted((r["seqlen"], r["tflops"]) for r in panel if r["chapter"] == chapter)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    color=colors(i % 20), label=chapter)
        for peer, style in (("fa2", "k--"), ("cudnn", "k:")):
            points = sorted({(r["seqlen"], r[peer]) for r in panel if r[peer] == r[peer]})
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style,
                        label=PEER_NAMES[peer])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title}head_dim {head_dim}, {'causal' if causal else 'non-causal'}")
        ax.grid(True, which="both", alpha=0.3)
    save(fig, axes, path)


def plot_decode(rows, path):
    """GB/s of K and V per chapter and per SDPA backend, one point per (batch, cache length), a
    panel per head configuration, with a line at torch's copy bandwidth."""
    panels = sorted({(r["heads_q"], r["heads_kv"], r["head_dim"]) for r in rows},
                    key=lambda heads: (heads[0] // heads[1], heads))
    series = sorted({(r["chapter"], r["page_size"]) for r in rows})
    fig, axes, colors = figure(len(panels))
    for ax, heads in zip(axes, panels):
        panel = [r for r in rows if (r["heads_q"], r["heads_kv"], r["head_dim"]) == heads]
        shapes = sorted({(r["batch"], r["seqlen_k"]) for r in panel})
        x = {shape: i for i, shape in enumerate(shapes)}
        for i, (chapter, page_size) in enumerate(series):
            points = sorted((x[(r["batch"], r["seqlen_k"])], r["kv_gbps"]) for r in panel
                            if (r["chapter"], r["page_size"]) == (chapter, page_size))
            if points:
                label = chapter + (f" (pages of {page_size})" if page_size else "")
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        color=colors(i % 20), label=label)
        for peer, style in (("fa2", "k--"), ("cudnn", "k:")):
            points = sorted({(x[(r["batch"], r["seqlen_k"])], r[peer]) for r in panel
                             if r[peer] == r[peer]})
            if points:
                expanded = any(r[f"{peer}_how"] == "K/V expanded" for r in panel)
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="x",
                        label=PEER_NAMES[peer] + (" (K/V expanded)" if expanded else ""))
        copy = panel[0]["torch_copy_gbps"]
        ax.axhline(copy, color="gray", linestyle="-.",
                   label=f"device-to-device copy (read + written), {copy:.0f} GB/s")
        highest = max([copy] + [r[key] for r in panel for key in ("kv_gbps", "fa2", "cudnn")
                                if r[key] == r[key]])
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{b} x {n // 1024}k" if n % 1024 == 0 else f"{b} x {n}"
                            for b, n in shapes], rotation=30)
        ax.set_ylim(bottom=0, top=1.1 * highest)
        ax.set_xlabel("batch x cached keys per sequence")
        ax.set_ylabel("GB/s of K and V read")
        ax.set_title(f"decode, {heads[0]} query / {heads[1]} key-value heads, head_dim {heads[2]}")
        ax.grid(True, alpha=0.3)
    save(fig, axes, path)


def replot(path, png, title):
    """The plot of a comparison CSV this script wrote before (forward or backward records)."""
    if not png:
        sys.exit("compare_sdpa.py: --replot needs --plot PNG")
    with open(path) as f:
        records = list(csv.DictReader(f))
    if not records or "tflops" not in records[0]:
        sys.exit(f"compare_sdpa.py: {path} holds no forward or backward comparison records")
    rows = []
    for r in records:
        row = dict(r)
        for key in ("head_dim", "seqlen", "causal"):
            row[key] = int(r[key])
        for key in ("tflops", "fa2", "cudnn"):
            row[key] = float(r[key]) if r[key] not in ("", "nan") else float("nan")
        rows.append(row)
    plot(rows, png, title)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ladder_csv", nargs="?", help="output of scripts/ladder --grid")
    parser.add_argument("--out", default="build/comparison.csv")
    parser.add_argument("--plot", default="", help="PNG path for the ladder plot")
    parser.add_argument("--replot", default="", metavar="COMPARISON_CSV",
                        help="only draw --plot from a forward or backward comparison CSV")
    parser.add_argument("--title", default="", help="with --replot: a prefix of each panel's title "
                        "(e.g. 'backward, ')")
    parser.add_argument("--rounds", type=int, default=1, help="forward and backward: time each "
                        "chapter again, alternating with the peers this many times per shape")
    parser.add_argument("--bin", default="build/bin", help="with --rounds: the chapter binaries")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds is 1 or more")

    if args.replot:
        replot(args.replot, args.plot, args.title)
        return
    if not args.ladder_csv:
        parser.error("give the ladder CSV (or --replot COMPARISON_CSV --plot PNG)")

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

    kind = ("decode" if "kv_gbps" in records[0] else
            "backward" if "deterministic" in records[0] else "forward")
    if kind == "decode" and args.rounds > 1:
        sys.exit("compare_sdpa.py: --rounds is for forward and backward records")
    rows = (compare_decode(records) if kind == "decode" else
            compare_attention(records, kind == "backward", args.rounds, args.bin))
    if not rows:
        sys.exit(f"compare_sdpa.py: no record of {args.ladder_csv} has a shape to compare")
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    print(f"records: {args.out}")
    if args.plot and kind == "decode":
        plot_decode(rows, args.plot)
    elif args.plot:
        plot(rows, args.plot, "backward, " if kind == "backward" else "")


if __name__ == "__main__":
    main()
