"""
Plot training runs the way the paper does (Section 6): the median training cost of every
non-overlapping window of batches (Figures 7-8, each run's gap to a reference run beside it), every
batch's cost (Figure 9), or the median of the last window against a swept setting (Figures 7, 10, 11,
the validation loss beside it). Prints a table of the runs too. Needs only matplotlib and numpy
(taps.py draws what the filters learned, from the checkpoints).

    python plot.py out/me-m2-l64-b32                                             # its loss.png again
    python plot.py out/sa-1 out/sa-32 out/she out/he out/we out/me -o fig8.png   # window medians, gaps
    python plot.py out/sa-32 out/she --raw -o fig9.png                            # every batch
    python plot.py out/fig10/* --sweep block_size -o fig10.png                    # last 2000 vs l
    python plot.py out/sa-* --sweep n_head -o fig7_heads.png                      # last 2000 vs n
    python plot.py RUNS... --seeds MORE... --results results -o results/fig8.png  # + the CSVs

One run without -o redraws its own chart (every batch, window medians, validation) as train.py does
at the end, into RUN/loss.png; with -o, that chart goes there. Several runs, --raw and --sweep make
one figure, titled with the runs' setting, and need -o. Run folders are those train.py writes
(log.csv, run.json), or those results/logs/ keeps (log.csv.gz, run.json). --window defaults to the
paper's 2000 batches, or to about 30 windows for shorter runs. Lines keep one colour and order per
mixer in every figure. Runs side by side share one corpus and vocabulary (their costs are otherwise
other quantities); a sweep also one length (--batches N cuts longer ones), one run per point. With
--sweep, a CSV that --results wrote may stand among the runs: its points stay in the figure where no
run folder gives the same mixer and setting, so a sweep can grow after its runs are gone.
"""

import argparse
import csv
import gzip
import io
import json
import os
import shlex
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

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
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        path += ".gz"  # a finished run's log as results/logs/ keeps it
    if not os.path.isfile(path):
        fail(f"{path} not found; pass folders written by train.py")
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
            reader = csv.DictReader(f)
            rows, header = list(reader), reader.fieldnames or []
    except (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError, csv.Error) as e:  # cut, or not a log
        fail(f"{path} is damaged ({type(e).__name__}: {e}); restore it or leave this run out")
    except OSError as e:  # unreadable: the input's fault, not the output's
        fail(f"cannot read {path}: {e.strerror}")
    if header and not {"iter", "train_loss", "val_loss", "tokens_per_s"} <= set(header):
        fail(f"{path} is damaged (its first line is not train.py's header); restore it or leave this run out")
    it, loss, tok_s, val_it, val = [], [], [], [], []
    for row in rows:
        try:
            i, l, t = int(row["iter"]), float(row["train_loss"]), float(row["tokens_per_s"])
            v = float(row["val_loss"]) if row["val_loss"] else None
        except (KeyError, TypeError, ValueError):
            continue  # a half-written last row of a run that is still going
        it.append(i), loss.append(l), tok_s.append(t)
        if v is not None:
            val_it.append(i), val.append(v)
    if not it:
        fail(f"{path} has no rows yet; wait for the run's first log line")
    log = {"iter": it, "train_loss": loss, "tokens_per_s": tok_s, "val_iter": val_it, "val_loss": val}
    return cut({k: np.array(v) for k, v in log.items()}, until)


def cut(log, until):
    """read_log's arrays up to batch `until` (all of them for None)."""
    if until is None:
        return log
    keep, keep_val = log["iter"] <= until, log["val_iter"] <= until
    return {k: v[keep_val if k.startswith("val") else keep] for k, v in log.items()}


def read_settings(run_dir):
    """Config, training arguments and parameter counts of a run (run.json), merged into one dict."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.isfile(path):
        fail(f"{path} not found; pass folders written by train.py")
    try:
        with open(path) as f:
            run = json.load(f)
        return {**run["args"], **run["config"], "params": run.get("params", {}), "data": run.get("data")}
    except (ValueError, KeyError, TypeError) as e:  # a cut or hand-edited file
        fail(f"{path} is damaged ({type(e).__name__}: {e}); restore it or leave this run out")


def label(settings):
    """sa-<heads> for self-attention (the paper compares 1 and 32 heads), else the mixer's name."""
    return f"sa-{settings['n_head']}" if settings["mixer"] == "sa" else settings["mixer"]


def run_names(run_dirs, settings):
    """A name per run: its mixer label, or where two labels are the same the folders' paths, cut to
    the last parts that tell them apart (r, or x/r and y/r for out/x/r and out/y/r)."""
    paths = [os.path.realpath(d) for d in run_dirs]
    for d, p in zip(run_dirs, paths):
        if paths.count(p) > 1:
            same = " and ".join(e for e, q in zip(run_dirs, paths) if q == p)
            fail(f"{same} are one run folder; pass each run once")
    names, depth = [label(s) for s in settings], 0
    while len(set(names)) < len(names):
        depth += 1
        names = ["/".join(p.split(os.sep)[-depth:]) for p in paths]
    return names


def read_runs(run_dirs, logs=True):
    """Each run folder read once, in STYLE's order: dicts of name, dir, settings and (with logs) log."""
    settings = [read_settings(d) for d in run_dirs]
    runs = [
        {"name": n, "dir": d, "settings": s, "log": read_log(d) if logs else None}
        for n, d, s in zip(run_names(run_dirs, settings), run_dirs, settings)
    ]
    return sorted(runs, key=lambda r: paper_rank(r["name"]))


def paper_rank(name):
    """Sort key: self-attention by head count (sa-1, sa-2, ..., sa-128), then the other mixers in
    STYLE's order, then any others by name."""
    heads = name.removeprefix("sa-")
    if name.startswith("sa-") and heads.isdigit():
        return (0, int(heads), name)
    order = list(STYLE)
    return (order.index(name) if name in order else len(order), 0, name)


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


def plot_run(run_dir, path, window=None, until=None, title=None, log=None):
    """One run's curve (train.py draws it at the end): every batch, window medians, validation."""
    log = read_log(run_dir, until) if log is None else log
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
    finish(ax, title or os.path.basename(os.path.normpath(run_dir)))
    save(fig, path)


def plot_runs(runs, path, window, raw=False, title=None, reference=None):
    """Several runs overlaid: window medians (Figures 7-8) and beside them each run's gap to the
    `reference` run, or with raw every batch at its logged batch number (Figure 9)."""
    ref = None if raw else reference_run(runs, reference)
    fig, axes = plt.subplots(1, 2 if ref else 1, figsize=(15 if ref else 8, 5), squeeze=False)
    ax = axes[0][0]
    for r in runs:
        log, colour = r["log"], STYLE.get(r["name"])
        if raw:
            ax.plot(log["iter"], log["train_loss"], lw=0.5, alpha=0.6, color=colour, label=r["name"])
            continue
        check_window(r["dir"], log["train_loss"], window)
        ax.plot(*window_medians(log["train_loss"], window), "-o", ms=3, color=colour, label=r["name"])
    finish(ax, "training cost of every batch" if raw else f"median training cost of every {window} batches")
    if ref:
        plot_gaps(axes[0][1], window_gaps(runs, ref, window), ref["name"])
    fig.suptitle(title or setting_title(runs))
    fig.tight_layout()
    save(fig, path)


def reference_run(runs, name=None):
    """The run the gap panel measures from: --reference's, else sa-32 where it is among the runs."""
    by_name = {r["name"]: r for r in runs}
    if name is not None and name not in by_name:
        fail(f"--reference {name} is none of the runs; pass one of {', '.join(by_name)}")
    return by_name.get(name or "sa-32") if len(runs) > 1 else None


def window_gaps(runs, ref, window):
    """{name: (window ends, medians)} of each other run's window medians minus the reference run's,
    over the windows both runs have."""
    ref_med = window_medians(ref["log"]["train_loss"], window)[1]
    gaps = {}
    for r in runs:
        if r is not ref:
            ends, med = window_medians(r["log"]["train_loss"], window)
            n = min(len(med), len(ref_med))
            gaps[r["name"]] = (ends[:n], med[:n] - ref_med[:n])
    return gaps


def plot_gaps(ax, gaps, ref_name):
    """window_gaps, a line per run, the reference at 0: the gaps the text gives at a readable scale."""
    ax.axhline(0, color=STYLE.get(ref_name, "black"), lw=1, label=ref_name)
    for name, (ends, gap) in gaps.items():
        ax.plot(ends, gap, "-o", ms=3, color=STYLE.get(name), label=name)
    ax.set(ylabel=f"median cost minus {ref_name}'s (nats)")
    finish(ax, f"gap to {ref_name}, window by window")


def setting_title(runs, swept=None):
    """The runs' setting from run.json and their logs, e.g. 'm = 2, l = 32, 30000 batches, seed 1337';
    where runs differ, each value ('seeds 1337, 1338'); the data seed where it is not 1337 alone; the
    swept setting left out."""

    def values(get):  # "2" or "2, 4", numbers in order
        found = sorted({get(r) for r in runs}, key=lambda v: (isinstance(v, str), v))
        return ", ".join(map(str, found)), len(found)

    setting = {
        key: values(lambda r: r["settings"].get(key, "?")) for key in ("n_layer", "block_size", "seed")
    }
    parts = [f"{SYMBOLS[key]} = {setting[key][0]}" for key in ("n_layer", "block_size") if key != swept]
    parts.append(f"{values(lambda r: int(r['log']['iter'][-1]))[0]} batches")
    seeds, n_seeds = setting["seed"]
    parts.append(f"seed{'s' if n_seeds > 1 else ''} {seeds}")
    data, n_data = values(lambda r: r["settings"].get("data_seed", 1337))
    if data != "1337":  # another batch order than train.py's default: say so
        parts.append(f"data seed{'s' if n_data > 1 else ''} {data}")
    return ", ".join(parts) + (", one run per point" if swept else "")


def sweep_column(key):
    """A sweep's x column: the setting's paper symbol (l, m), but n_head for head counts (Figure 7's
    runs are one mixer, so its CSV needs no mixer column, and sa-<n> would name each point a line)."""
    return key if key == "n_head" else SYMBOLS.get(key, key)


def sweep_rows(runs, key, window):
    """One dict per run for Figures 7, 10 and 11: mixer, the swept setting (sweep_column), batches,
    the median of the last `window` batches, and the last validation loss. Runs that cannot share
    the figure (other corpora, other lengths, two at one point) give one line instead."""
    x, rows = sweep_column(key), []
    for r in runs:
        value = r["settings"].get(key)
        if not isinstance(value, (int, float, str)):
            settings = r["settings"]
            valid = sorted(k for k, v in settings.items() if isinstance(v, (int, float, str)))
            what = "no setting" if value is None else "no single number for"
            fail(f"{r['dir']} has {what} {key!r}; choose one of {', '.join(valid)}")
        check_window(r["dir"], r["log"]["train_loss"], window)
        mixer = r["settings"]["mixer"] if key == "n_head" else label(r["settings"])
        rows.append(run_row({"mixer": mixer, x: value}, r["log"], [window]))
    check_sweep(runs, rows, key)
    return sorted(rows, key=lambda r: (paper_rank(r["mixer"]), r[x]))


def check_sweep(runs, rows, key):
    """A sweep's runs (of one corpus: check_one_corpus): one length, one run per point (a point is a
    median of equal windows only then); else one line naming the runs, since a figure cannot show
    which is which."""
    batches = {row["batches"]: r["dir"] for r, row in zip(runs, rows)}
    if len(batches) > 1:
        n = min(batches)
        fail(
            f"the runs have {n} to {max(batches)} batches ({batches[n]}: {n}); pass --batches {n} to compare"
        )
    x, seen = sweep_column(key), {}
    for r, row in zip(runs, rows):
        point = (row["mixer"], row[x])
        if point in seen:
            fail(f"{seen[point]} and {r['dir']} are both {point[0]} at {x} = {point[1]}; pass one per point")
        seen[point] = r["dir"]
    if key == "n_head" and len({row["mixer"] for row in rows}) > 1:
        fail("--sweep n_head compares the head counts of one mixer; pass runs of one mixer")


def check_one_corpus(runs, verb):
    """Runs in one figure or table: one corpus and one vocabulary (a cost in nats over other text or
    other tokens is another quantity); else one line naming the corpora. Runs whose run.json all hold the
    data's fingerprint are judged by it, wherever their data folder was (one corpus prepared on a GPU
    machine and on a laptop draws together); others by data folder and vocabulary."""
    where = lambda r: os.path.normpath(r["settings"].get("data_dir", "data"))
    prints = [data_fingerprint(r["settings"]) for r in runs]
    if all(prints):  # a name per fingerprint
        corpora = {tuple(sorted(p.items())): (where(r), p) for r, p in zip(runs, prints)}
        names = "; ".join(
            sorted(
                f"{d}, vocabulary {p['vocab_size']}, train.bin {p['train_sha256'][:12]}"
                for d, p in corpora.values()
            )
        )
    else:
        corpora = {(where(r), r["settings"].get("vocab_size")) for r in runs}
        if len({v for _, v in corpora}) > 1:
            names = "; ".join(sorted(f"{d}, vocabulary {v}" for d, v in corpora))
        else:
            names = ", ".join(sorted(d for d, _ in corpora))
    if len(corpora) > 1:
        fail(f"the runs were trained on other data ({names}); {verb} runs of one corpus")


def data_fingerprint(settings):
    """run.json's fingerprint of the data (vocabulary, sha256 of train.bin, val.bin and the tokenizer), or
    None where it is missing or partial (an older run.json, data made without prepare_data.py)."""
    data = settings.get("data")
    return data if isinstance(data, dict) and data and None not in data.values() else None


def read_points(path, key, window, batches=None):
    """A sweep CSV that --sweep --results wrote earlier: its points, as sweep_rows gives them, so a
    figure can grow run by run after the earlier run folders are gone."""
    if key == "n_head":
        fail(f"{path}: --sweep n_head takes run folders only (its CSV has no mixer column)")
    x, y = sweep_column(key), f"median_last_{window}"
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
    x = sweep_column(key)
    new = {(r["mixer"], r[x]) for r in rows}
    kept = [r for r in earlier if (r["mixer"], r[x]) not in new]
    return sorted(rows + kept, key=lambda r: (paper_rank(r["mixer"]), r[x]))


def plot_sweep(rows, key, path, window, title=None):
    """sweep_rows' points against the swept setting, one line per mixer (sa per head count): on the
    left the median training cost of the last `window` batches (the paper's axes), on the right the
    last validation loss, where the runs have one."""
    x = sweep_column(key)
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
            ax.set_xscale("log", base=2)  # l = 32 ... 1024, n = 1 ... 128 and similar doubling sweeps
        ax.set_xticks(values, [str(v) for v in values])
        ax.set(xlabel=f"{x} ({key})" if x != key else key, ylabel=what, title=f"{what} against {x}")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)


def finish(ax, title):
    if ax.get_xlabel() == "":
        ax.set(xlabel="batches")
    if ax.get_ylabel() == "":
        ax.set(ylabel="cost (cross-entropy, nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


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
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=120, bbox_inches="tight", metadata=metadata))
    plt.close(fig)


# ----------------------------------------------------------------------------- tables and CSVs


LASTS = (1000, 2000)  # summary.csv's medians: the last 1000 batches, and the paper's 2000 (Figures 10-11)


def last_val(log):
    """The last validation loss in a log, or "" if it has none."""
    return float(log["val_loss"][-1]) if len(log["val_loss"]) else ""


def run_row(first, log, lasts):
    """A run's row in every table: the `first` columns, batches, the median of the last n batches
    for each n in `lasts`, and the last validation loss."""
    medians = {f"median_last_{n}": float(np.median(log["train_loss"][-n:])) for n in lasts}
    return {**first, "batches": int(log["iter"][-1]), **medians, "val_loss": last_val(log)}


def summary_rows(runs):
    """One dict per run: batches, medians of the last 1000 and 2000 batches, last validation loss,
    parameters, and the median of the logged tokens/s."""
    rows = []
    for r in runs:
        log, params = r["log"], r["settings"]["params"]
        rows.append(
            {
                **run_row({"run": r["name"]}, log, LASTS),
                "val_at": int(log["val_iter"][-1]) if len(log["val_loss"]) else "",
                "params_mixers": params.get("mixers", ""),
                "params_total": params.get("total", ""),
                "tokens_per_s": round(float(np.median(log["tokens_per_s"]))),
            }
        )
    return rows


SEED_COLUMNS = ["mixer", "seed", "data_seed", "batches", "median_last_1000", "val_loss"]


def seed_rows(runs, until=None, earlier=()):
    """seeds.csv: one row per run (mixer, seed, data seed), every row at the same number of batches:
    the shortest run's, or `until` if that is shorter. val_loss is the last one at or before it.
    `earlier`: rows of a seeds.csv (read_seed_rows), kept where no run gives the same three keys."""
    n = min([int(r["log"]["iter"][-1]) for r in runs] + ([until] if until else []))
    rows = []
    for r in runs:
        first = {k: r["settings"].get(k, "") for k in ("seed", "data_seed")}
        rows.append(run_row({"mixer": label(r["settings"]), **first}, cut(r["log"], n), [1000]))
    given = {(r["mixer"], r["seed"], r["data_seed"]) for r in rows}
    for e in earlier:
        if e["batches"] != n:
            m, b = e["mixer"], e["batches"]
            fail(f"a seeds.csv row of {m} is at {b} batches, the runs at {n}: pass --batches {b}")
        if (e["mixer"], e["seed"], e["data_seed"]) not in given:
            rows.append(e)
    return sorted(rows, key=lambda r: (paper_rank(r["mixer"]), str(r["seed"]), str(r["data_seed"])))


def read_seed_rows(path):
    """The rows of a seeds.csv that --seeds --results wrote: runs whose logs may be gone."""
    if not os.path.isfile(path):
        fail(f"{path} not found; pass run folders, or a seeds.csv that --seeds --results wrote")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or list(rows[0]) != SEED_COLUMNS:
        fail(f"{path} is not a seeds.csv; its header must be {','.join(SEED_COLUMNS)}")
    try:
        return [
            {
                "mixer": r["mixer"],
                **{k: int(r[k]) for k in ("seed", "data_seed", "batches")},
                "median_last_1000": float(r["median_last_1000"]),
                "val_loss": float(r["val_loss"]) if r["val_loss"] else "",
            }
            for r in rows
        ]
    except ValueError:
        fail(f"{path}: not a number where one belongs; write it again with --seeds --results")


def write_results(runs, folder, window, until=None, seeds=(), earlier=()):
    """The figure's numbers as CSV in `folder`: medians.csv (median of every `window` batches, a
    column per run), val_loss.csv (every validation loss, a column per run) and summary.csv; with
    `seeds` (more runs) or `earlier` (seeds.csv rows), seeds.csv: a row for each of the runs, the
    seeds' runs and the earlier rows that no run gives again.
    Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    logs = {r["name"]: r["log"] for r in runs}
    meds = {name: dict(zip(*window_medians(log["train_loss"], window))) for name, log in logs.items()}
    vals = {name: dict(zip(log["val_iter"], log["val_loss"])) for name, log in logs.items()}
    written = []
    for file, table in (("medians.csv", meds), ("val_loss.csv", vals)):
        batches = sorted({int(b) for col in table.values() for b in col})
        rows = [[b] + [repr(float(table[n][b])) if b in table[n] else "" for n in table] for b in batches]
        written.append(write_csv(os.path.join(folder, file), rows, header=["batches"] + list(table)))
    written.append(write_csv(os.path.join(folder, "summary.csv"), summary_rows(runs)))
    if seeds or earlier:
        rows = seed_rows(runs + list(seeds), until, earlier)
        written.append(write_csv(os.path.join(folder, "seeds.csv"), rows))
    return written


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
        "Default for one run: RUN/loss.png, its own chart as train.py draws it",
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
        "--sweep",
        metavar="KEY",
        help="last window's median against this setting (Figures 10, 11; n_head: one mixer's head counts)",
    )
    p.add_argument(
        "--reference",
        metavar="RUN",
        help="the run (its label, as the legend names it) whose window medians the gap panel subtracts "
        "(default: sa-32 where it is among the runs)",
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
        "shortest run's length; a seeds.csv among them keeps its rows where no run gives their seeds",
    )
    p.add_argument("--batches", type=int, help="use the first N batches of each run (compare at one length)")
    p.add_argument("--title", help="figure title (default: the runs' setting from run.json)")
    return one_line_errors(p, "plot.py")


def check_flags(args):
    """Flags that do not go together, as one line."""
    if args.seeds and (not args.results or args.sweep):
        fail("--seeds only adds rows to seeds.csv, which --results DIR writes without --sweep")
    if args.reference and (args.raw or args.sweep):
        fail("--reference picks the gap panel's run, which only the window medians' figure has")


def default_output(output, runs, own, one_figure=False):
    """-o, or for one run (unless one_figure) its own chart RUN/<own>; one line for a folder, an
    image format matplotlib does not write, or several runs without -o."""
    if output is None:
        if len(runs) > 1 or one_figure:
            fail("a figure of several runs, --raw or --sweep has no default file: name it with -o FILE")
        output = os.path.join(runs[0], own)
    if os.path.isdir(output):
        fail(
            f"-o {shlex.quote(output)} is a folder; name an image file, e.g. -o {shlex.quote(output)}/fig.png"
        )
    image_format(output)  # an unknown extension fails here, before any work
    return output


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
    for r in runs:
        n = int(r["log"]["iter"][-1])
        if n < batches:
            d = shlex.quote(r["dir"])
            fail(f"--batches {batches}: {d} has only {n} batches; pass --batches {n} or less")


def plot_logs(args, runs, output, earlier=()):
    """The training curves from the runs' log.csv (and with --sweep the `earlier` CSVs' points):
    the figure, the CSVs and the printed table. Returns the paths written."""
    seeds = read_runs([p for p in args.seeds if not p.endswith(".csv")])
    check_one_corpus(runs + seeds, "sweep" if args.sweep else "compare")
    check_batches(runs, args.batches)
    for r in runs:
        r["log"] = cut(r["log"], args.batches)
    window = args.window
    if window is None:
        shortest = min((len(r["log"]["train_loss"]) for r in runs), default=2000)
        window = min(2000, shortest) if args.sweep else auto_window(shortest)
    if window < 1:
        fail(f"--window must be at least 1, got {window}")
    if args.sweep:
        rows = sweep_rows(runs, args.sweep, window)
        for path in earlier:
            merged = merge_points(rows, read_points(path, args.sweep, window, args.batches), args.sweep)
            print(f"{len(merged) - len(rows)} points from {path} (settings no run folder gives)")
            rows = merged
        title = args.title or (setting_title(runs, args.sweep) if runs else None)
        plot_sweep(rows, args.sweep, output, window, title)
    elif len(runs) == 1 and not args.raw:
        plot_run(runs[0]["dir"], output, args.window, title=args.title, log=runs[0]["log"])
    else:
        plot_runs(runs, output, window, args.raw, args.title, args.reference)
    written = [output]
    if args.results and args.sweep:  # the figure's points, named after it
        os.makedirs(args.results, exist_ok=True)
        name = os.path.splitext(os.path.basename(output))[0] + ".csv"
        one_mixer = args.sweep == "n_head"  # Figure 7's CSV: n_head,batches,median_last_2000,val_loss
        rows = [{k: v for k, v in r.items() if not (one_mixer and k == "mixer")} for r in rows]
        written.append(write_csv(os.path.join(args.results, name), rows))
    elif args.results:
        earlier = [row for p in args.seeds if p.endswith(".csv") for row in read_seed_rows(p)]
        written += write_results(runs, args.results, window, args.batches, seeds, earlier)
    if runs:
        print_summary(summary_rows(runs))
    return written


def cli(work, hint):
    """A script's exit status: work() writes files and returns their paths, printed for pasting back;
    bad input, or an output that cannot be written (`hint` says what to do), is one line and 1."""
    try:
        written = work()
        print("wrote " + " ".join(shlex.quote(path) for path in written))
    except OSError as e:  # an unwritable output folder, a full disk
        where = shlex.quote(str(e.filename)) if e.filename else "the output"
        print(f"error: cannot write {where}: {e.strerror}; {hint}", file=sys.stderr)
        return 1
    except SystemExit as e:
        return e.code
    return 0


def main(argv=None):
    def work():
        args = build_parser().parse_args(argv)
        check_flags(args)
        output = default_output(args.output, args.runs, "loss.png", one_figure=args.raw or args.sweep)
        folders, earlier = split_inputs(args.runs, args.sweep)
        return plot_logs(args, read_runs(folders), output, earlier)

    return cli(work, "pick another -o or --results")


if __name__ == "__main__":
    sys.exit(main())
