"""
Plot training runs the way the paper does (Section 6): the median training cost of every
non-overlapping window of batches (Figures 7-8), every batch's cost (Figure 9), or the median of
the last window against a swept setting (Figures 10-11, the validation loss beside it); or, with
--taps, what each layer's filter learned. Prints a table of the runs too.

    python plot.py out/me-m2-l64-b32                                             # its loss.png again
    python plot.py out/sa-1 out/sa-32 out/she out/he out/we out/me -o fig8.png   # window medians
    python plot.py out/sa-32 out/she --raw -o fig9.png                            # every batch
    python plot.py out/fig10/* --sweep block_size -o fig10.png                    # last 2000 vs l
    python plot.py out/sa-32 out/she out/he out/we out/me --taps -o taps.png      # taps vs distance
    python plot.py RUNS... --seeds MORE... --results results -o results/fig8.png  # + the CSVs

One run without -o redraws its own chart (every batch, window medians, validation) as train.py
does at the end, into RUN/loss.png (with --taps: RUN/taps.png); with -o, that chart goes there.
Several runs, --raw and --sweep make one figure and need -o. Run folders are those train.py
writes (log.csv, run.json; --taps reads ckpt.pt). --window defaults to the paper's 2000 batches,
or to about 30 windows for shorter runs. Lines keep one colour and order per mixer in every figure.
With --sweep, a CSV that --results wrote may stand among the runs: its points stay in the figure
where no run folder gives the same mixer and setting, so a sweep can grow after its runs are gone.
"""

import argparse
import csv
import io
import json
import math
import os
import shlex
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from common import SYMBOLS, atomic_write, fail, one_line_errors  # noqa: E402

# one colour per mixer, in this order, in every figure (others follow in matplotlib's cycle)
STYLE = {
    "sa-1": "tab:gray",
    "sa-32": "black",
    "she": "tab:red",
    "he": "tab:orange",
    "we": "tab:green",
    "me": "tab:blue",
    "he-ext": "tab:purple",
}


def read_log(run_dir, until=None):
    """log.csv of a run as arrays: iter, train_loss, tokens_per_s, and the iterations with a val_loss;
    with `until`, only its first `until` batches (for comparing runs at the same length)."""
    path = os.path.join(run_dir, "log.csv")
    if not os.path.isfile(path):
        fail(f"{path} not found; pass folders written by train.py")
    it, loss, tok_s, val_it, val = [], [], [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                i, l, t = int(row["iter"]), float(row["train_loss"]), float(row["tokens_per_s"])
                v = float(row["val_loss"]) if row["val_loss"] else None
            except (KeyError, TypeError, ValueError):
                continue  # a half-written last row of a run that is still going
            if until is not None and i > until:
                break
            it.append(i), loss.append(l), tok_s.append(t)
            if v is not None:
                val_it.append(i), val.append(v)
    if not it:
        fail(f"{path} has no rows yet; wait for the run's first log line")
    return {
        "iter": np.array(it),
        "train_loss": np.array(loss),
        "tokens_per_s": np.array(tok_s),
        "val_iter": np.array(val_it),
        "val_loss": np.array(val),
    }


def read_settings(run_dir):
    """Config, training arguments and parameter counts of a run (run.json), merged into one dict."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.isfile(path):
        fail(f"{path} not found; pass folders written by train.py")
    with open(path) as f:
        run = json.load(f)
    return {**run["args"], **run["config"], "params": run.get("params", {})}


def label(settings):
    """sa-<heads> for self-attention (the paper compares 1 and 32 heads), else the mixer's name."""
    return f"sa-{settings['n_head']}" if settings["mixer"] == "sa" else settings["mixer"]


def run_names(run_dirs):
    """(name, run_dir) pairs: the mixer labels, or the folder names where two labels are the same."""
    names = [label(read_settings(d)) for d in run_dirs]
    if len(set(names)) < len(names):
        names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return list(zip(names, run_dirs))


def paper_rank(name):
    """Sort key: the mixers in STYLE's order, then any others by name."""
    order = list(STYLE)
    return (order.index(name) if name in order else len(order), name)


def in_paper_order(runs):
    """(label, run_dir) pairs sorted as STYLE lists the mixers."""
    return sorted(runs, key=lambda r: paper_rank(r[0]))


def window_medians(loss, window):
    """Median of every non-overlapping window of `window` batches (a last, partial window is
    dropped). Returns the batch count at the end of each window and the medians."""
    n = len(loss) // window
    med = np.median(np.asarray(loss[: n * window]).reshape(n, window), axis=1)  # (n,)
    return window * np.arange(1, n + 1), med


def auto_window(n_batches):
    """The paper's 2000 batches for full-length runs; shorter runs get about 30 windows."""
    return max(1, min(2000, n_batches // 30))


def check_window(run_dir, loss, window):
    if len(loss) < window:
        fail(f"{run_dir} has {len(loss)} batches, fewer than --window {window}; pass a smaller --window")


def plot_run(run_dir, path, window=None, until=None, title=None):
    """One run's curve (train.py draws it at the end): every batch, window medians, validation."""
    log = read_log(run_dir, until)
    window = window or auto_window(len(log["train_loss"]))
    check_window(run_dir, log["train_loss"], window)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    alpha, every = 0.35 if window > 1 else 1, "training cost, every batch"
    ax.plot(log["iter"], log["train_loss"], lw=0.5, alpha=alpha, color="C0", label=every)
    if window > 1:
        ends, med = window_medians(log["train_loss"], window)
        ax.plot(ends, med, "-o", ms=3, color="C0", label=f"median of every {window} batches")
    if len(log["val_loss"]):
        ax.plot(log["val_iter"], log["val_loss"], "s--", ms=4, color="C3", label="validation loss")
    finish(fig, ax, title or os.path.basename(os.path.normpath(run_dir)), path)


def plot_runs(runs, path, window, raw=False, title=None, until=None):
    """Several runs overlaid: window medians (Figures 7-8) or, with raw, every batch (Figure 9)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, d in runs:
        loss = read_log(d, until)["train_loss"]
        if raw:
            ax.plot(np.arange(1, len(loss) + 1), loss, lw=0.5, alpha=0.6, color=STYLE.get(name), label=name)
            continue
        check_window(d, loss, window)
        ends, med = window_medians(loss, window)
        ax.plot(ends, med, "-o", ms=3, color=STYLE.get(name), label=name)
    what = "training cost of every batch" if raw else f"median training cost of every {window} batches"
    finish(fig, ax, title or what, path)


def sweep_rows(runs, key, window, until=None):
    """One dict per run for Figures 10-11: mixer, the swept setting (under its paper symbol),
    batches, the median of the last `window` batches, and the last validation loss."""
    x, rows = SYMBOLS.get(key, key), []
    for _, d in runs:
        settings, log = read_settings(d), read_log(d, until)
        if key not in settings:
            fail(f"{d} has no setting {key!r}; choose one of {', '.join(sorted(settings))}")
        check_window(d, log["train_loss"], window)
        rows.append(
            {
                "mixer": label(settings),
                x: settings[key],
                "batches": int(log["iter"][-1]),
                f"median_last_{window}": float(np.median(log["train_loss"][-window:])),
                "val_loss": last_val(log),
            }
        )
    return sorted(rows, key=lambda r: (paper_rank(r["mixer"]), r[x]))


def read_points(path, key, window, batches=None):
    """A sweep CSV that --sweep --results wrote earlier: its points, as sweep_rows gives them, so a
    figure can grow run by run after the earlier run folders are gone."""
    x, y = SYMBOLS.get(key, key), f"median_last_{window}"
    header = ["mixer", x, "batches", y, "val_loss"]
    if not os.path.isfile(path):
        fail(f"{path} not found; pass run folders, or a CSV that --sweep {key} --results wrote")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or list(rows[0]) != header:
        want = ",".join(header)
        fail(f"{path} is not a --sweep {key} CSV of the last {window} batches; its header must be {want}")
    points = []
    for i, r in enumerate(rows, 2):
        try:
            value = float(r[x]) if "." in r[x] or "e" in r[x] else int(r[x])  # as run.json holds it
            point = {"mixer": r["mixer"], x: value, "batches": int(r["batches"]), y: float(r[y])}
            point["val_loss"] = float(r["val_loss"]) if r["val_loss"] else ""
        except (TypeError, ValueError):
            fail(f"{path}, line {i}: not a number where one belongs; write it again with --sweep --results")
        if batches is not None and point["batches"] != batches:
            n = point["batches"]
            fail(f"{path}: the {r['mixer']} point at {x} = {r[x]} is at {n} batches, not --batches {batches}")
        points.append(point)
    return points


def merge_points(rows, earlier, key):
    """The runs' points, plus the earlier points (read_points) at settings no run gives."""
    x = SYMBOLS.get(key, key)
    new = {(r["mixer"], r[x]) for r in rows}
    kept = [r for r in earlier if (r["mixer"], r[x]) not in new]
    return sorted(rows + kept, key=lambda r: (paper_rank(r["mixer"]), r[x]))


def plot_sweep(rows, key, path, window, title=None):
    """sweep_rows' points against the swept setting, one line per mixer (sa per head count): on the
    left the median training cost of the last `window` batches (the paper's axes), on the right the
    last validation loss, where the runs have one."""
    x = SYMBOLS.get(key, key)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = {
        f"median_last_{window}": f"median cost of the last {window} batches",
        "val_loss": "validation loss",
    }
    for ax, (y, what) in zip(axes, panels.items()):
        for name in dict.fromkeys(r["mixer"] for r in rows):  # in paper order, each once
            pts = [(r[x], r[y]) for r in rows if r["mixer"] == name and r[y] != ""]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=STYLE.get(name), label=name)
        values = sorted({r[x] for r in rows})
        if all(isinstance(v, (int, float)) and v > 0 for v in values) and max(values) / min(values) >= 8:
            ax.set_xscale("log", base=2)  # l = 32 ... 1024 and similar doubling sweeps
        ax.set_xticks(values, [str(v) for v in values])
        ax.set(xlabel=f"{x} ({key})" if x != key else key, ylabel=what, title=f"{what} against {x}")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)


def finish(fig, ax, title, path):
    if ax.get_xlabel() == "":
        ax.set(xlabel="batches", ylabel="cost (cross-entropy, nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def image_format(path):
    """The format matplotlib writes for path's extension (png without one); one line if it has none."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    kinds = FigureCanvasBase.get_supported_filetypes()  # {"png": "Portable Network Graphics", ...}
    if fmt not in kinds:
        fail(f"cannot write a .{fmt} image {shlex.quote(path)}; use one of: .{', .'.join(sorted(kinds))}")
    return fmt


def save(fig, path):
    fmt = image_format(path)
    metadata = {"Software": None} if fmt == "png" else None  # no version stamp in the file
    atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=120, bbox_inches="tight", metadata=metadata))
    plt.close(fig)


# ----------------------------------------------------------------------------- what the filters learned

TAP_WINDOWS = 256  # evenly spaced windows of val.bin over which attention's weights are averaged
TAP_LABELS = {"sa": "mean attention weight", "she": r"$\|W_k\|_F$", "me": r"$|w_k|$"}  # else ||w_k||_2


def tap_profile(model, windows=None):
    """What each layer's token mixer weighs at each distance back k = 1..l (k = 1 is the current
    token), as {layer (from 1): (l,) array}: ME's |w_k|, WE's and HE's ||w_k||_2, SHE's Frobenius
    ||W_k||_F; for self-attention the mean attention weight k - 1 tokens back, averaged over heads,
    positions and `windows`, a (N, t) tensor of token ids."""
    from extractor import SelfAttention

    mixers = [layer.mixer for layer in model.layers]
    if isinstance(mixers[0], SelfAttention):
        return attention_by_distance(model, windows)
    profile = {}
    for i, mixer in enumerate(mixers, 1):
        w = getattr(mixer, "W_ext", getattr(mixer, "w_ext", None))  # (l, d, d), (l, d) or (l,)
        if w is None:
            fail(f"--taps: the {model.cfg.mixer!r} mixer has neither Extractor taps nor attention weights")
        profile[i] = w.detach().double().reshape(len(w), -1).norm(dim=1).numpy()  # ||W_k||_F, ||w_k||, |w_k|
    return profile


def attention_weights(mixer, x):
    """Eq. (13), (14) recomputed from a SelfAttention's input x (B, t, d): A (B, n, t, t), each row
    a softmax over the positions j <= i (F.scaled_dot_product_attention does not return it)."""
    import torch

    B, t, d = x.shape
    n = mixer.n
    q, k, _ = mixer.W_QKV(x).split(d, dim=2)  # Eq. (10), (11), (B, t, d) each
    q, k = (z.view(B, t, n, d // n).transpose(1, 2) for z in (q, k))  # (B, n, t, h)
    z = q @ k.transpose(2, 3) / math.sqrt(d // n)  # Eq. (13), (B, n, t, t)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # j > i
    return z.masked_fill(future, -math.inf).softmax(dim=-1)  # Eq. (14)


def attention_by_distance(model, windows, chunk=32):
    """{layer: (t,) mean of A[i, i - k + 1] over heads, positions i >= k - 1 and the windows (N, t)}.
    A forward pre-hook catches each mixer's input (the layer-normed residual stream)."""
    import torch

    inputs = {}
    hooks = [
        layer.mixer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
        for i, layer in enumerate(model.layers, 1)
    ]
    N, t = windows.shape
    pos = torch.arange(t)
    back = pos[:, None] - pos[None, :]  # (t, t), the distance back i - j
    seen = back >= 0
    sums = {i: torch.zeros(t, dtype=torch.float64) for i in range(1, len(model.layers) + 1)}
    model.eval()
    try:
        with torch.no_grad():
            for x in windows.split(chunk):
                model(x)
                for i, layer in enumerate(model.layers, 1):
                    a = attention_weights(layer.mixer, inputs[i]).double().sum(dim=(0, 1))  # (t, t)
                    sums[i].index_add_(0, back[seen], a[seen])
    finally:
        for h in hooks:
            h.remove()
    count = N * model.layers[0].mixer.n * (t - pos)  # (t,) weights summed at each distance
    return {i: (s / count).numpy() for i, s in sums.items()}


def uniform_by_distance(t):
    """attention_by_distance of uniform attention, A[i, j] = 1 / (i + 1): (t,) means over i >= k - 1."""
    w = 1 / np.arange(1, t + 1)  # row i's weight
    return np.array([w[back:].mean() for back in range(t)])


def val_windows(data_dir, l, n=TAP_WINDOWS):
    """n windows of l tokens spread evenly over data_dir/val.bin, as train.py picks its validation
    windows: a (n, l) int64 array."""
    path = os.path.join(data_dir, "val.bin")
    if not os.path.isfile(path):
        fail(f"{shlex.quote(path)} not found; pass --data_dir, the folder with the run's val.bin")
    val = np.memmap(path, dtype=np.uint16, mode="r")
    if len(val) < l + 1:
        fail(f"{shlex.quote(path)} has {len(val)} tokens, fewer than l + 1 = {l + 1}")
    starts = np.linspace(0, len(val) - l - 1, n).round().astype(np.int64)
    return np.stack([val[s : s + l] for s in starts]).astype(np.int64)  # (n, l)


def plot_taps(runs, path, data_dir=None, title=None):
    """One panel per run, one line per layer: tap_profile against the distance back k = 1..l."""
    import torch

    from sample import load_model  # the model of a run's ckpt.pt

    panels = []
    for name, d in runs:
        model, ckpt = load_model(d, torch.device("cpu"))
        windows = None
        if model.cfg.mixer == "sa":
            run_data = ckpt.get("args", {}).get("data_dir", "data")
            windows = torch.from_numpy(val_windows(data_dir or run_data, model.cfg.block_size))
        panels.append(
            (f"{name}, batch {ckpt.get('iter', '?')}", model.cfg.mixer, tap_profile(model, windows))
        )
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, mixer, profile) in zip(axes.flat, panels):
        colours = plt.cm.viridis(np.linspace(0, 0.9, len(profile)))
        for colour, (layer, y) in zip(colours, profile.items()):
            k = np.arange(1, len(y) + 1)
            ax.plot(k, y, color=colour, lw=1.2, label=f"layer {layer}")
        if mixer == "sa":  # what attention spread evenly over the seen tokens would give
            ax.plot(k, uniform_by_distance(len(k)), "--", color="gray", label="uniform")
        ax.set_yscale("log")
        ax.set(title=name, xlabel="distance back k (k = 1: the current token)")
        ax.set_ylabel(TAP_LABELS.get(mixer, r"$\|w_k\|_2$"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=1 + (len(profile) - 1) // 6)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)


# ----------------------------------------------------------------------------- tables and CSVs


LASTS = (1000, 2000)  # summary.csv's medians: the last 1000 batches, and the paper's 2000 (Figures 10-11)


def last_val(log):
    """The last validation loss in a log, or "" if it has none."""
    return float(log["val_loss"][-1]) if len(log["val_loss"]) else ""


def summary_rows(runs, until=None):
    """One dict per run: batches, medians of the last 1000 and 2000 batches, last validation loss,
    parameters, and the median of the logged tokens/s."""
    rows = []
    for name, d in runs:
        log, settings = read_log(d, until), read_settings(d)
        medians = {f"median_last_{n}": float(np.median(log["train_loss"][-n:])) for n in LASTS}
        rows.append(
            {
                "run": name,
                "batches": int(log["iter"][-1]),
                **medians,
                "val_loss": last_val(log),
                "val_at": int(log["val_iter"][-1]) if len(log["val_loss"]) else "",
                "params_mixers": settings["params"].get("mixers", ""),
                "params_total": settings["params"].get("total", ""),
                "tokens_per_s": round(float(np.median(log["tokens_per_s"]))),
            }
        )
    return rows


def print_summary(rows):
    keys = list(rows[0])
    print("  ".join(f"{k:>15}" for k in keys))
    for r in rows:
        print("  ".join(f"{v:>15.4f}" if isinstance(v, float) else f"{v!s:>15}" for v in r.values()))


def csv_text(header, rows):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def seed_rows(run_dirs, until=None):
    """seeds.csv: one row per run (mixer, seed), every row at the same number of batches: the
    shortest run's, or `until` if that is shorter. val_loss is the last one at or before it."""
    n = min([int(read_log(d)["iter"][-1]) for d in run_dirs] + ([until] if until else []))
    rows = []
    for d in run_dirs:
        settings, log = read_settings(d), read_log(d, n)
        rows.append(
            {
                "mixer": label(settings),
                "seed": settings.get("seed", ""),
                "batches": int(log["iter"][-1]),
                "median_last_1000": float(np.median(log["train_loss"][-1000:])),
                "val_loss": last_val(log),
            }
        )
    return sorted(rows, key=lambda r: (paper_rank(r["mixer"]), str(r["seed"])))


def write_results(runs, folder, window, until=None, seeds=()):
    """The figure's numbers as CSV in `folder`: medians.csv (median of every `window` batches, a
    column per run), val_loss.csv (every validation loss, a column per run) and summary.csv; with
    `seeds` (more run folders), seeds.csv: a row for each of the runs and the seeds' runs.
    Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    logs = {name: read_log(d, until) for name, d in runs}
    meds = {name: dict(zip(*window_medians(log["train_loss"], window))) for name, log in logs.items()}
    vals = {name: dict(zip(log["val_iter"], log["val_loss"])) for name, log in logs.items()}
    written = []
    for file, table in (("medians.csv", meds), ("val_loss.csv", vals)):
        batches = sorted({int(b) for col in table.values() for b in col})
        rows = [[b] + [repr(float(table[n][b])) if b in table[n] else "" for n in table] for b in batches]
        written.append(write_csv(os.path.join(folder, file), rows, header=["batches"] + list(table)))
    written.append(write_csv(os.path.join(folder, "summary.csv"), summary_rows(runs, until)))
    if seeds:
        rows = seed_rows([d for _, d in runs] + list(seeds), until)
        written.append(write_csv(os.path.join(folder, "seeds.csv"), rows))
    return written


def write_csv(path, rows, header=None):
    """rows: lists under `header`, or dicts (their keys are the header). Returns path."""
    if header is None:
        header, rows = list(rows[0]), [list(r.values()) for r in rows]
    atomic_write(path, csv_text(header, rows))
    return path


# ----------------------------------------------------------------------------- command line


def build_parser():
    intro, examples = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=intro, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "runs",
        nargs="+",
        help="run folders written by train.py; with --sweep also a CSV that --results wrote, whose points "
        "stay in the figure where no run folder gives the same mixer and setting",
    )
    p.add_argument(
        "-o",
        "--output",
        help="image file to write (.png, .pdf, .svg, ...); needed for several runs, --raw and --sweep. "
        "Default for one run: RUN/loss.png, its own chart as train.py draws it (RUN/taps.png with --taps)",
    )
    p.add_argument(
        "--window",
        type=int,
        help="batches per median (default: the paper's 2000, or ~30 windows for shorter runs; "
        "with --sweep, the last 2000 batches or the whole of a shorter run)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--raw", action="store_true", help="plot every batch's cost instead of medians (Figure 9)"
    )
    mode.add_argument(
        "--sweep", metavar="KEY", help="last window's median against this setting (Figures 10, 11)"
    )
    mode.add_argument(
        "--taps",
        action="store_true",
        help="what the filters learned, from each run's ckpt.pt: a panel per run, a line per layer, against "
        "the distance back k: |w_k| (ME), ||w_k|| (WE, HE), ||W_k||_F (SHE), or attention's mean weight (sa)",
    )
    p.add_argument(
        "--data_dir",
        help=f"with --taps for sa: the folder with val.bin (default: the run's own); {TAP_WINDOWS} windows",
    )
    p.add_argument(
        "--results",
        metavar="DIR",
        help="also write medians.csv, val_loss.csv and summary.csv here (and seeds.csv with --seeds); "
        "with --sweep only the figure's points, as <figure name>.csv",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        metavar="RUN",
        default=[],
        help="with --results: more runs (other seeds) for seeds.csv only, a row per run, all at the "
        "shortest run's length",
    )
    p.add_argument("--batches", type=int, help="use the first N batches of each run (compare at one length)")
    p.add_argument("--title", help="figure title")
    return one_line_errors(p, "plot.py")


def check_flags(args):
    """Flags that do not go together, as one line."""
    if args.taps:
        curves = {
            "--window": args.window,
            "--results": args.results,
            "--seeds": args.seeds,
            "--batches": args.batches,
        }
        given = [flag for flag, value in curves.items() if value not in (None, [])]
        if given:
            fail(f"--taps reads each run's ckpt.pt; {', '.join(given)} apply to the training curves only")
    elif args.data_dir:
        fail("--data_dir is for --taps (attention's weights on val.bin)")
    if args.seeds and (not args.results or args.sweep):
        fail("--seeds only adds rows to seeds.csv, which --results DIR writes without --sweep")


def default_output(args):
    """-o, or for one run's own chart (or its --taps) a file in the run folder; else one line."""
    if args.output:
        return args.output
    if len(args.runs) == 1 and not (args.raw or args.sweep):
        return os.path.join(args.runs[0], "taps.png" if args.taps else "loss.png")
    fail("several runs, --raw and --sweep make one figure of many runs: name it with -o FILE")


def split_inputs(paths, sweep):
    """Run folders, and with --sweep the CSVs of earlier points among the inputs."""
    earlier = [p for p in paths if p.endswith(".csv")]
    if earlier and not sweep:
        fail(f"{earlier[0]}: a CSV input adds earlier points to a --sweep figure; pass run folders here")
    return [p for p in paths if not p.endswith(".csv")], earlier


def check_batches(runs, batches):
    """--batches N must be at least 1 and within every run."""
    if batches is None:
        return
    if batches < 1:
        fail(f"--batches must be at least 1, got {batches}")
    for _, d in runs:
        n = int(read_log(d)["iter"][-1])
        if n < batches:
            fail(f"--batches {batches}: {shlex.quote(d)} has only {n} batches; pass --batches {n} or less")


def plot_logs(args, runs, output, earlier=()):
    """The training curves from the runs' log.csv (and with --sweep the `earlier` CSVs' points):
    the figure, the CSVs and the printed table. Returns the paths written."""
    check_batches(runs, args.batches)
    window = args.window
    if window is None:
        shortest = min((len(read_log(d, args.batches)["train_loss"]) for _, d in runs), default=2000)
        window = min(2000, shortest) if args.sweep else auto_window(shortest)
    if window < 1:
        fail(f"--window must be at least 1, got {window}")
    if args.sweep:
        rows = sweep_rows(runs, args.sweep, window, args.batches)
        for path in earlier:
            merged = merge_points(rows, read_points(path, args.sweep, window, args.batches), args.sweep)
            print(f"{len(merged) - len(rows)} points from {path} (settings no run folder gives)")
            rows = merged
        plot_sweep(rows, args.sweep, output, window, args.title)
    elif len(runs) == 1 and not args.raw:
        plot_run(runs[0][1], output, args.window, args.batches, args.title)
    else:
        plot_runs(runs, output, window, args.raw, args.title, args.batches)
    written = [output]
    if args.results and args.sweep:  # the figure's points, named after it
        os.makedirs(args.results, exist_ok=True)
        name = os.path.splitext(os.path.basename(output))[0] + ".csv"
        written.append(write_csv(os.path.join(args.results, name), rows))
    elif args.results:
        written += write_results(runs, args.results, window, args.batches, args.seeds)
    if runs:
        print_summary(summary_rows(runs, until=args.batches))
    return written


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        check_flags(args)
        output = default_output(args)
        image_format(output)  # an unknown extension fails here, before any work
        folders, earlier = split_inputs(args.runs, args.sweep)
        runs = in_paper_order(run_names(folders))
        os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
        if args.taps:
            plot_taps(runs, output, args.data_dir, args.title)
            written = [output]
        else:
            written = plot_logs(args, runs, output, earlier)
        print("wrote " + " ".join(shlex.quote(path) for path in written))
    except OSError as e:  # an unwritable output folder, a full disk
        where = shlex.quote(str(e.filename)) if e.filename else "the output"
        print(f"error: cannot write {where}: {e.strerror}; pick another -o or --results", file=sys.stderr)
        return 1
    except SystemExit as e:
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
