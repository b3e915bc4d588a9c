#!/usr/bin/env python3
"""Turn a benchmark run into the Markdown tables of the docs and the chapter READMEs.

Reads the grid CSV of `scripts/ladder --grid` and the comparison CSV of `scripts/compare_sdpa.py`
from the same run and writes, into --out (default build/tables; the course's own tables are made
with --out docs/measurements/tables, see docs/benchmarks.md):

    <chapter>.md   every grid shape of one chapter: time, TFLOP/s, ratios to the peers, error
    peers.md       PyTorch SDPA's flash (FA2) and cuDNN backends on the same shapes
    panels.md      one table per (head_dim, causal): chapters x seqlen, TFLOP/s and x FA2

    python3 scripts/tables.py build/grid.csv build/comparison.csv

Standard library only.
"""
import argparse
import csv
import os


def load(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def rel_err(record):
    # A record of `scripts/ladder --no-check` has no error to show.
    return f"{float(record['o_rel_err']):.1e}" if record["checked"] == "1" else "not checked"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid_csv")
    parser.add_argument("comparison_csv")
    parser.add_argument("--out", default="build/tables")
    args = parser.parse_args()
    for path in (args.grid_csv, args.comparison_csv):
        if not os.path.exists(path):
            raise SystemExit(f"tables.py: {path} not found: make the grid with scripts/ladder --grid "
                             "and the comparison with scripts/compare_sdpa.py first")

    records = load(args.grid_csv)
    if records and "kv_gbps" in records[0]:
        raise SystemExit(f"tables.py: {args.grid_csv} holds decode records; their tables are the "
                         "ones scripts/compare_sdpa.py prints")
    grid = {(r["chapter"], int(r["head_dim"]), int(r["seqlen_q"]), int(r["causal"])): r
            for r in records}
    rows = load(args.comparison_csv)
    for r in rows:
        for key in ("head_dim", "seqlen", "batch", "heads", "causal"):
            r[key] = int(r[key])
        for key in ("tflops", "fa2", "cudnn", "vs_fa2", "vs_cudnn"):
            r[key] = float(r[key])
    os.makedirs(args.out, exist_ok=True)
    order = lambda r: (r["head_dim"], r["causal"], r["seqlen"])

    chapters = sorted({r["chapter"] for r in rows})
    for chapter in chapters:
        lines = ["| head_dim | causal | seqlen (batch x heads) | time (ms) | TFLOP/s | x FA2 "
                 "| x cuDNN | rel err |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted((r for r in rows if r["chapter"] == chapter), key=order):
            g = grid[(chapter, r["head_dim"], r["seqlen"], r["causal"])]
            lines.append(
                f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} "
                f"({r['batch']} x {r['heads']}) | {float(g['median_ms']):.3f} | {r['tflops']:.1f} "
                f"| {r['vs_fa2']:.2f} | {r['vs_cudnn']:.2f} | {rel_err(g)} |")
        with open(os.path.join(args.out, f"{chapter}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")

    peers = {}
    for r in rows:
        peers[(r["head_dim"], r["causal"], r["seqlen"])] = (r["fa2"], r["cudnn"])
    lines = ["| head_dim | causal | seqlen | FA2 (SDPA flash) | cuDNN (SDPA) |",
             "| --- | --- | --- | --- | --- |"]
    for (d, c, n), (fa2, cudnn) in sorted(peers.items()):
        lines.append(f"| {d} | {'yes' if c else 'no'} | {n} | {fa2:.1f} | {cudnn:.1f} |")
    with open(os.path.join(args.out, "peers.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

    lines = []
    seqlens = sorted({r["seqlen"] for r in rows})
    for d, c in sorted({(r["head_dim"], r["causal"]) for r in rows}):
        title = f"head_dim {d}, {'causal' if c else 'non-causal'} (TFLOP/s; x FA2 in brackets)"
        lines += [f"#### {title}", "", "| chapter | " + " | ".join(str(n) for n in seqlens) + " |",
                  "| --- |" + " --- |" * len(seqlens)]
        by = {(r["chapter"], r["seqlen"]): r
              for r in rows if r["head_dim"] == d and r["causal"] == c}
        for chapter in chapters:
            cells = []
            for n in seqlens:
                r = by.get((chapter, n))
                if r is None:
                    cells.append("-")
                elif r["tflops"] >= 20:  # the fp32 chapters: no ratio, it would read 0.00
                    cells.append(f"{r['tflops']:.1f} ({r['vs_fa2']:.2f})")
                else:
                    cells.append(f"{r['tflops']:.2f}")
            lines.append(f"| {chapter} | " + " | ".join(cells) + " |")
        for name, i in (("PyTorch SDPA flash (FA2)", 0), ("PyTorch SDPA cuDNN", 1)):
            cells = [f"{peers[(d, c, n)][i]:.1f}" if (d, c, n) in peers else "-" for n in seqlens]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    with open(os.path.join(args.out, "panels.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"tables: {args.out}/ ({len(chapters)} chapters, peers.md, panels.md)")


if __name__ == "__main__":
    main()
