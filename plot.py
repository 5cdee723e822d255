"""
Plot training runs the way the paper does (Section 6): the median training cost of every non-overlapping
window of batches (Figures 7-8), the per-batch costs (Figure 9), or the last window's median against a
swept hyperparameter (Figures 10-11).

    python plot.py out/sa-1 out/sa-32 out/she out/he out/we out/me -o fig8.png       # medians of 2000 batches
    python plot.py out/sa-32 out/she --raw -o fig9.png                                 # every batch
    python plot.py out/l*-m2-* --sweep block_size -o fig10.png                         # last window vs l
Each run folder is one written by train.py (log.csv and run.json). A table of the final medians and
validation losses is printed too.
"""
import argparse
import csv
import json
import os
import sys

import numpy as np
import matplotlib
matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(1)


def read_log(run_dir):
    """log.csv of a run as arrays: iter, train_loss, and the iterations that have a val_loss."""
    path = os.path.join(run_dir, "log.csv")
    if not os.path.isfile(path):
        fail(f"{path} not found; pass folders written by train.py")
    it, loss, val_it, val = [], [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                it.append(int(row["iter"]))
                loss.append(float(row["train_loss"]))
                if row["val_loss"]:
                    val_it.append(it[-1])
                    val.append(float(row["val_loss"]))
            except (KeyError, TypeError, ValueError):
                continue  # a half-written last row of a run that is still going
    if not it:
        fail(f"{path} has no rows yet")
    return {"iter": np.array(it), "train_loss": np.array(loss), "val_iter": np.array(val_it), "val_loss": np.array(val)}


def read_settings(run_dir):
    """Config and training arguments of a run (run.json, else the checkpoint), merged into one dict."""
    path = os.path.join(run_dir, "run.json")
    if os.path.isfile(path):
        with open(path) as f:
            run = json.load(f)
    elif os.path.isfile(os.path.join(run_dir, "ckpt.pt")):
        import torch
        run = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    else:
        fail(f"{run_dir} has neither run.json nor ckpt.pt; pass folders written by train.py")
    return {**run["args"], **run["config"]}


def mixer_label(settings):
    """sa-<heads> for self-attention (the paper compares 1 and 32 heads), else the mixer's name."""
    return f"sa-{settings['n_head']}" if settings["mixer"] == "sa" else settings["mixer"]


def window_medians(loss, window):
    """Median of every non-overlapping window of `window` batches (a last, partial window is dropped).
    Returns the batch count at the end of each window and the medians."""
    n = len(loss) // window
    med = np.median(np.asarray(loss[:n * window]).reshape(n, window), axis=1)  # (n,)
    return window * np.arange(1, n + 1), med


def auto_window(n_batches):
    """The paper's 2000 batches for full-length runs; shorter runs get about 30 windows."""
    return max(1, min(2000, n_batches // 30))


def plot_run(run_dir, path):
    """One run's curve (train.py draws this at the end): every batch, window medians, validation losses."""
    log = read_log(run_dir)
    window = auto_window(len(log["train_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(log["iter"], log["train_loss"], lw=0.5, alpha=0.35 if window > 1 else 1, color="C0",
            label="training cost, every batch")
    if window > 1:
        ends, med = window_medians(log["train_loss"], window)
        ax.plot(ends, med, "-o", ms=3, color="C0", label=f"median of every {window} batches")
    if len(log["val_loss"]):
        ax.plot(log["val_iter"], log["val_loss"], "s--", ms=4, color="C3", label="validation loss")
    ax.set(xlabel="batches", ylabel="cost (cross-entropy, nats)", title=os.path.basename(os.path.normpath(run_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def plot_runs(run_dirs, path, window=2000, raw=False, labels=None, title=None):
    """Several runs overlaid: window medians (Figures 7-8) or, with raw, every batch's cost (Figure 9)."""
    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    fig, ax = plt.subplots(figsize=(8, 5))
    for d, label in zip(run_dirs, labels):
        loss = read_log(d)["train_loss"]
        if raw:
            ax.plot(np.arange(1, len(loss) + 1), loss, lw=0.5, alpha=0.6, label=label)
            continue
        if len(loss) < window:
            fail(f"{d} has {len(loss)} batches, fewer than --window {window}; pass a smaller --window")
        ends, med = window_medians(loss, window)
        ax.plot(ends, med, "-o", ms=3, label=label)
    what = "training cost of every batch" if raw else f"median training cost of every {window} batches"
    ax.set(xlabel="batches", ylabel="cost (cross-entropy, nats)", title=title or what)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def plot_sweep(run_dirs, key, path, window=2000, title=None):
    """The median of each run's last `window` batches against a swept setting (Figures 10-11), one line per
    mixer (sa per head count)."""
    lines = {}
    for d in run_dirs:
        settings, loss = read_settings(d), read_log(d)["train_loss"]
        if key not in settings:
            fail(f"{d} has no setting {key!r}; choose one of {', '.join(sorted(settings))}")
        last = np.median(loss[-window:])
        lines.setdefault(mixer_label(settings), []).append((settings[key], last))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    values = sorted({p[0] for pts in lines.values() for p in pts})
    if all(isinstance(v, (int, float)) and v > 0 for v in values) and max(values) / min(values) >= 8:
        ax.set_xscale("log", base=2)  # l = 32 ... 1024 and similar doubling sweeps
    ax.set_xticks(values, [str(v) for v in values])
    ax.set(xlabel=key, ylabel=f"median cost of the last {window} batches",
           title=title or f"last {window} batches against {key}")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def save(fig, path):
    """Write atomically: a temporary file in the same folder, then rename."""
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp{ext or '.png'}"  # keeps the extension, which picks the format
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def summary(run_dirs, window):
    """One line per run: batches, last window's median, last validation loss."""
    print(f"{'run':<24} {'batches':>8} {'last ' + str(window) + ' median':>18} {'val loss':>9}")
    for d in run_dirs:
        log = read_log(d)
        val = f"{log['val_loss'][-1]:.4f}" if len(log["val_loss"]) else "-"
        med = np.median(log["train_loss"][-window:])
        print(f"{os.path.basename(os.path.normpath(d)):<24} {len(log['train_loss']):>8} {med:>18.4f} {val:>9}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders written by train.py")
    p.add_argument("-o", "--output", default="loss.png", help="image file to write (.png, .pdf, .svg)")
    p.add_argument("--window", type=int, default=2000, help="batches per median (the paper: 2000)")
    p.add_argument("--raw", action="store_true", help="plot every batch's cost instead of medians (Figure 9)")
    p.add_argument("--sweep", metavar="KEY", help="plot the last window's median against this setting, e.g. "
                                                   "block_size (Figure 10) or n_layer (Figure 11)")
    p.add_argument("--labels", nargs="+", help="legend labels, one per run (default: folder names)")
    p.add_argument("--title", help="figure title")
    p.error = lambda msg: fail(f"{msg} (see python plot.py --help)")
    try:
        args = p.parse_args(argv)
        if args.window < 1:
            fail(f"--window must be at least 1, got {args.window}")
        if args.labels and len(args.labels) != len(args.runs):
            fail(f"{len(args.labels)} --labels for {len(args.runs)} runs")
        if args.sweep:
            plot_sweep(args.runs, args.sweep, args.output, args.window, args.title)
        else:
            plot_runs(args.runs, args.output, args.window, args.raw, args.labels, args.title)
        summary(args.runs, args.window)
        print(f"wrote {args.output}")
    except SystemExit as e:
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
