"""
Issue 75's fair fight from run folders (plot.py's). lr: a row per run (mixer, c, lr),
the median of its last 1000 batches, its last validation loss and `best`, the lowest
median of its mixer and c among the runs of --batches (`partial`: shorter, not ranked).
compute: the window medians against the training FLOPs (bench.py's count of a batch's
forward and backward) and against seconds at the run's median tokens/s; their points
(.csv), and where each pair's lines cross and their gap where both end (_crossings.csv).

    python experiments/fair.py lr results/logs/m2l32/* RUNS/fair/*/ -o lr.csv
    python experiments/fair.py compute RUNS/{sa-1,sa-32,she,he,we,me} -o compute.png
"""

import argparse
import itertools
import os
import sys

import numpy as np
import torch

import bench  # (its folder first on sys.path: a script's own)
import plot
from machinery import COUNT  # (the project root on sys.path: bench.py puts it)

POINTS = ["mixer", "batches", "flops", "seconds", "median", "tokens_per_s"]
AXES = {"flops": "training FLOPs", "seconds": "seconds at the run's median tokens/s"}


def lr_rows(runs, batches):
    """lr.csv's rows in the paper's order, then c and lr."""
    rows = []
    for r in runs:
        s = r["settings"]
        first = dict(run=r["name"], mixer=plot.label(s), c=s["n_hidden"], lr=s["lr"])
        rows.append(plot.run_row(first, r["log"], [1000]))
    for row in rows:
        same = [o for o in rows if (o["mixer"], o["c"]) == (row["mixer"], row["c"])]
        done = [o["median_last_1000"] for o in same if o["batches"] == batches]
        best = done and row["median_last_1000"] == min(done)
        row["best"] = "partial" if row["batches"] < batches else "best" * best
    return sorted(rows, key=lambda r: (plot.paper_rank(r["mixer"]), r["c"], r["lr"]))


def flops_per_batch(s):
    """bench.py's FLOPs of one training step (forward, backward) of the run's model."""
    sizes = dict(vocab=s["vocab_size"], l=s["block_size"], d=s["n_embd"])
    sizes |= dict(hidden=s["n_hidden"], n_layer=s["n_layer"])
    heads = argparse.Namespace(n_head=s["n_head"])
    cpu = torch.device("cpu")
    *_, make_step = bench.new_model(sizes, heads, s["mixer"], s["batch_size"], cpu)
    with bench.flop_counter() as counter:
        make_step("float32")()
    return counter.get_total_flops()


def curves(run, window, flops):
    """{axis: (each window's end in FLOPs, `flops` a batch, or seconds; its median)}."""
    log, s = run["log"], run["settings"]
    ends, med = plot.window_medians(log["train_loss"], window)
    seconds = s["batch_size"] * s["block_size"] / np.median(log["tokens_per_s"])
    return {"flops": (ends * flops, med), "seconds": (ends * seconds, med)}


def crossings(a, b):
    """Where lines a and b, (x, y) each, cross in the x both cover (linear between the
    points of either); that x's end, and a's y minus b's there (> 0: a is behind)."""
    lo, hi = max(a[0][0], b[0][0]), min(a[0][-1], b[0][-1])
    x = np.union1d(a[0], b[0])
    x = x[(x >= lo) & (x <= hi)]
    gap = np.interp(x, *a) - np.interp(x, *b)
    i = np.flatnonzero(np.sign(gap[:-1]) * np.sign(gap[1:]) < 0)  # a sign change
    at = x[i] + (x[i + 1] - x[i]) * gap[i] / (gap[i] - gap[i + 1])
    return at, hi, gap[-1]


def compute(runs, output, window):
    """The figure, its points and each pair's crossings; returns the paths written."""
    for r in runs:
        if len(r["log"]["train_loss"]) < window:
            plot.fail(f"{r['dir']} is shorter than --window {window}; pass less")
    fig, axes = plot.plt.subplots(1, 2, figsize=(14, 5))
    lines = {r["name"]: curves(r, window, flops_per_batch(r["settings"])) for r in runs}
    points, pairs = [], []
    for r in runs:
        ends, rates = plot.window_medians(r["log"]["tokens_per_s"], window)
        (flops, med), (seconds, _) = lines[r["name"]].values()
        for row in zip(ends, flops, seconds, med, rates):
            points.append(dict(zip(POINTS, (r["name"], *row))))
        for ax, axis in zip(axes, AXES):
            style = dict(marker="o", ms=3, label=r["name"]) | plot.line(r)
            ax.plot(*lines[r["name"]][axis], **style)
    for ax, axis in zip(axes, AXES):
        ax.set(xlabel=AXES[axis])
        plot.finish(ax, f"median training cost of every {window} batches")
    for (a, b), axis in itertools.product(itertools.combinations(lines, 2), AXES):
        at, end, gap = crossings(lines[a][axis], lines[b][axis])
        at = " ".join(map(repr, at.tolist()))
        pairs.append(dict(axis=axis, first=a, second=b, crossings=at, end=end, gap=gap))
    plot.save(fig, output, plot.setting_title(runs))
    stem = os.path.splitext(output)[0]
    written = [plot.write_csv(f"{stem}.csv", points)]
    return [output, *written, plot.write_csv(f"{stem}_crossings.csv", pairs)]


def main(argv=None):
    intro, examples = __doc__.strip().split("\n\n", 1)
    raw = argparse.RawDescriptionHelpFormatter  # the examples as written
    p = argparse.ArgumentParser(description=intro, epilog=examples, formatter_class=raw)
    p.add_argument("what", choices=["lr", "compute"], help="the table or the figure")
    p.add_argument("runs", nargs="+", help="run folders (train.py's or results/logs/)")
    p.add_argument("-o", "--output", required=True, help="lr.csv, or the figure")
    p.add_argument("--window", type=COUNT, default=500, help="batches per median")
    p.add_argument("--batches", type=COUNT, default=10000, help="a finished run's")
    p.error = lambda msg: plot.fail(f"{msg} (see --help)")
    args = p.parse_args(argv)
    runs = plot.read_runs(args.runs, args.batches)
    plot.check_corpus(runs)
    table = lambda: [plot.write_csv(args.output, lr_rows(runs, args.batches))]
    figure = lambda: compute(runs, args.output, args.window)
    return plot.cli(table if args.what == "lr" else figure, "pick another -o")


if __name__ == "__main__":
    sys.exit(main())
