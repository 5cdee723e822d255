"""
Training runs drawn the way the paper does (Section 6), and the results' CSVs: the median training
cost of every non-overlapping window of batches (Figures 7-8, each run's gap to sa-32 beside it), every
batch (Figure 9, --raw), or the median of the last window against a swept setting (Figures 7, 10, 11,
--sweep, the validation loss beside it). Needs only matplotlib and numpy.

    python experiments/plot.py out/me                                        # out/me/loss.png
    python experiments/plot.py out/{sa-1,sa-32,she,he,we,me} -o fig8.png     # window medians, gaps
    python experiments/plot.py out/sa-32 out/she --raw -o fig9.png           # every batch
    python experiments/plot.py out/fig10/* --sweep block_size -o fig10.png   # last 2000 against l
    python experiments/plot.py RUNS... --seeds MORE... --results results -o results/fig8.png  # + CSVs

Run folders: train.py's (log.csv, run.json) or results/logs/'s (log.csv.gz, run.json). Runs side
by side share a corpus; a sweep's runs also one length (--batches N) and one run per point, and its
window is their last 2000 batches (or all). A sweep CSV that --results wrote may stand among its
runs, a seeds.csv among --seeds: the rows no run gives again stay.
"""

import argparse
import contextlib
import csv
import gzip
import io
import json
import os
import shlex
import sys
import zlib

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the project root

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from prepare_data import atomic_write, fail  # noqa: E402

# one colour per mixer, in this order, in every figure (others follow in matplotlib's
# cycle)
STYLE = {
    "sa-1": "tab:gray",
    "sa-32": "black",
    "she": "tab:red",
    "he": "tab:orange",
    "we": "tab:green",
}
STYLE.update({"me": "tab:blue", "he-ext": "tab:purple"})
SYMBOLS = {
    "n_layer": "m",
    "block_size": "l",
}  # the paper's symbols, in titles and sweep CSVs
SEED_COLUMNS = ["mixer", "seed", "data_seed", "batches", "median_last_1000", "val_loss"]


def read_log(run_dir):
    """A run's log.csv (or .gz) as arrays: iter, train_loss, tokens_per_s; val_iter,
    val_loss.
    """
    path = os.path.join(run_dir, "log.csv")
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        path += ".gz"  # a finished run's log as results/logs/ keeps it
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
            rows = list(csv.DictReader(f))
    except (
        EOFError,
        gzip.BadGzipFile,
        zlib.error,
        UnicodeDecodeError,
        csv.Error,
    ) as e:  # cut, or not a log
        fail(
            f"{path} is damaged ({type(e).__name__}: {e}); restore it or leave this run out"
        )
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}; pass folders written by train.py")
    good = []
    for row in (
        rows
    ):  # left out: a half-written last row of a run still going, or not train.py's log
        with contextlib.suppress(KeyError, TypeError, ValueError):
            it, loss, tok_s = (
                float(row[c]) for c in ("iter", "train_loss", "tokens_per_s")
            )
            good.append([it, loss, tok_s, float(row["val_loss"] or "nan")])
    if not good:
        fail(
            f"{path} holds no row of train.py's log; wait for the run's first log line, or restore it"
        )
    it, loss, tok_s, val = np.array(good).T  # (rows,) each
    it, has = it.astype(np.int64), ~np.isnan(val)
    return {
        "iter": it,
        "train_loss": loss,
        "tokens_per_s": tok_s,
        "val_iter": it[has],
        "val_loss": val[has],
    }


def cut(log, until):
    """read_log's arrays up to batch `until`."""
    return {
        k: v[log["val_iter" if k.startswith("val") else "iter"] <= until]
        for k, v in log.items()
    }


def read_runs(run_dirs, until=None):
    """Each run folder once, in the paper's order: name, dir, log (to batch `until`),
    settings (run.json).
    """
    paths, runs = [os.path.realpath(d) for d in run_dirs], []
    if len(set(paths)) < len(paths):
        same = " and ".join(d for d, p in zip(run_dirs, paths) if paths.count(p) > 1)
        fail(f"{same} are one run folder; pass each run once")
    for d in run_dirs:
        path = os.path.join(d, "run.json")
        try:
            with open(path) as f:
                run = json.load(f)
            s = (
                run["args"]
                | run["config"]
                | {"params": run.get("params", {}), "data": run.get("data") or {}}
            )
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror}; pass folders written by train.py")
        except (ValueError, KeyError, TypeError) as e:  # a cut or hand-edited file
            fail(
                f"{path} is damaged ({type(e).__name__}: {e}); restore it or leave this run out"
            )
        runs.append({"dir": d, "settings": s, "log": cut(read_log(d), until or np.inf)})
    names, depth = [label(r["settings"]) for r in runs], 0
    while len(set(names)) < len(
        names
    ):  # two of one label: the last parts of their paths that differ
        depth += 1
        names = ["/".join(p.split(os.sep)[-depth:]) for p in paths]
    runs = [dict(r, name=name) for r, name in zip(runs, names)]
    return sorted(runs, key=lambda r: paper_rank(r["name"]))


def label(settings):
    """sa-<heads> for self-attention (the paper compares 1 and 32 heads), else the
    mixer's name.
    """
    return (
        f"sa-{settings['n_head']}" if settings["mixer"] == "sa" else settings["mixer"]
    )


def paper_rank(name):
    """Sort key: sa by head count (sa-1, sa-2, ..., sa-128), then STYLE's order, then
    others by name.
    """
    heads = name.removeprefix("sa-")
    if name.startswith("sa-") and heads.isdigit():
        return (0, int(heads), name)
    return (list(STYLE).index(name) if name in STYLE else len(STYLE), 0, name)


def check_corpus(runs):
    """One corpus for all runs (a cost over other text or tokens is another quantity): one
    vocabulary, and one train.bin (its sha256) among the runs whose run.json records
    it."""
    corpora = {
        (r["settings"].get("vocab_size"), r["settings"]["data"].get("train_sha256"))
        for r in runs
    }
    if len({v for v, _ in corpora}) > 1 or len({sha for _, sha in corpora if sha}) > 1:
        names = sorted(
            f"vocabulary {v}" + (f", train.bin {sha[:12]}" if sha else "")
            for v, sha in corpora
        )
        fail(
            f"the runs were trained on other data ({'; '.join(names)}); compare runs of one corpus"
        )


def window_medians(loss, window):
    """Each full window's last batch number and the median of its training costs."""
    n = len(loss) // window
    med = np.median(np.asarray(loss[: n * window]).reshape(n, window), axis=1)  # (n,)
    return window * np.arange(1, n + 1), med


def plot_run(run, path, window):
    """One run's chart: every batch, the window medians and the validation loss."""
    log = run["log"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    alpha, every = 0.35 if window > 1 else 1, "training cost, every batch"
    ax.plot(
        log["iter"], log["train_loss"], lw=0.5, alpha=alpha, color="C0", label=every
    )
    if window > 1:
        ends, med = window_medians(log["train_loss"], window)
        ax.plot(
            ends, med, "-o", ms=3, color="C0", label=f"median of every {window} batches"
        )
    if len(log["val_loss"]):
        ax.plot(
            log["val_iter"],
            log["val_loss"],
            "s--",
            ms=4,
            color="C3",
            label="validation loss",
        )
    finish(ax, os.path.basename(os.path.normpath(run["dir"])))
    save(fig, path)


def plot_runs(runs, path, window, raw=False):
    """Several runs overlaid: window medians (Figures 7-8) and beside them each run's gap
    to sa-32's window medians where sa-32 is among them, or with raw every batch at its
    batch number (Figure 9)."""
    ref = None if raw or len(runs) < 2 else {r["name"]: r for r in runs}.get("sa-32")
    fig, axes = plt.subplots(
        1, 2 if ref else 1, figsize=(15 if ref else 8, 5), squeeze=False
    )
    ax = axes[0][0]
    for r in runs:
        log, colour = r["log"], STYLE.get(r["name"])
        if raw:
            ax.plot(
                log["iter"],
                log["train_loss"],
                lw=0.5,
                alpha=0.6,
                color=colour,
                label=r["name"],
            )
        else:
            ax.plot(
                *window_medians(log["train_loss"], window),
                "-o",
                ms=3,
                color=colour,
                label=r["name"],
            )
    finish(
        ax,
        "training cost of every batch"
        if raw
        else f"median training cost of every {window} batches",
    )
    if ref:
        ax = axes[0][1]
        ax.axhline(0, color=STYLE.get(ref["name"], "black"), lw=1, label=ref["name"])
        ref_med = window_medians(ref["log"]["train_loss"], window)[1]
        for r in [r for r in runs if r is not ref]:
            ends, med = window_medians(r["log"]["train_loss"], window)
            n = min(len(med), len(ref_med))  # the windows both runs have
            ax.plot(
                ends[:n],
                med[:n] - ref_med[:n],
                "-o",
                ms=3,
                color=STYLE.get(r["name"]),
                label=r["name"],
            )
        ax.set(ylabel=f"median cost minus {ref['name']}'s (nats)")
        finish(ax, f"gap to {ref['name']}, window by window")
    save(fig, path, setting_title(runs))


def setting_title(runs, swept=None):
    """The runs' setting, e.g. 'm = 2, l = 32, 30000 batches, seed 1337'; where runs
    differ, each value ('seeds 1337, 1338'); the data seed where it is not 1337 alone;
    the swept setting left out."""

    def values(get):  # "2" or "2, 4", numbers in order, and "s" for several
        found = sorted(
            {get(r["settings"]) for r in runs}, key=lambda v: (isinstance(v, str), v)
        )
        return ", ".join(map(str, found)), "s" * (len(found) > 1)

    parts = [
        f"{SYMBOLS[k]} = {values(lambda s: s.get(k, '?'))[0]}"
        for k in SYMBOLS
        if k != swept
    ]
    parts.append(
        f"{', '.join(map(str, sorted({int(r['log']['iter'][-1]) for r in runs})))} batches"
    )
    parts.append("seed{1} {0}".format(*values(lambda s: s.get("seed", "?"))))
    data, s = values(lambda s: s.get("data_seed", 1337))
    parts += (
        [f"data seed{s} {data}"] if data != "1337" else []
    )  # not train.py's default batch order
    return ", ".join(parts) + (", one run per point" if swept else "")


def plot_sweep(rows, key, path, window, title=None):
    """A line per mixer against the swept setting: the median cost of the last `window`
    batches (the paper's axes), and beside it the last validation loss."""
    x = SYMBOLS.get(key, key)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = {f"median_last_{window}": f"median cost of the last {window} batches"}
    for ax, (y, what) in zip(axes, (panels | {"val_loss": "validation loss"}).items()):
        for name in dict.fromkeys(
            r["mixer"] for r in rows
        ):  # in paper order, each once
            pts = [(r[x], r[y]) for r in rows if r["mixer"] == name and r[y] != ""]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                "-o",
                color=STYLE.get(name),
                label=name,
            )
        values = sorted({r[x] for r in rows})
        if all(v > 0 for v in values) and max(values) / min(values) >= 8:
            ax.set_xscale(
                "log", base=2
            )  # l = 32 ... 1024, n = 1 ... 128 and similar doubling sweeps
        ax.set_xticks(values, [str(v) for v in values])
        ax.set(xlabel=f"{x} ({key})" if x != key else key, ylabel=what)
        finish(ax, f"{what} against {x}")
    save(fig, path, title)


def finish(ax, title):
    ax.set(
        xlabel=ax.get_xlabel() or "batches",
        ylabel=ax.get_ylabel() or "cost (cross-entropy, nats)",
    )
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def save(fig, path, title=None):
    """fig, titled, to path in the format its extension names (png without one); one
    line for others.
    """
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    kinds = (
        FigureCanvasBase.get_supported_filetypes()
    )  # {"png": "Portable Network Graphics", ...}
    if fmt not in kinds:
        fail(
            f"cannot write a .{fmt} image {shlex.quote(path)}; use one of: .{', .'.join(sorted(kinds))}"
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    metadata = (
        {"Software": None} if fmt == "png" else None
    )  # no version stamp in the file
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(
        path,
        lambda f: fig.savefig(
            f, format=fmt, dpi=120, bbox_inches="tight", metadata=metadata
        ),
    )
    plt.close(fig)


def run_row(first, log, lasts):
    """`first`, batches, the median of the last n batches for n in `lasts`, the last
    validation loss.
    """
    medians = {
        f"median_last_{n}": float(np.median(log["train_loss"][-n:])) for n in lasts
    }
    val = float(log["val_loss"][-1]) if len(log["val_loss"]) else ""
    return {**first, "batches": int(log["iter"][-1]), **medians, "val_loss": val}


def summary_row(run):
    """summary.csv: run_row, where the last validation loss was, parameters, median
    logged tokens/s.
    """
    log, params = run["log"], run["settings"]["params"]
    row = run_row({"run": run["name"]}, log, (1000, 2000))
    row["val_at"] = int(log["val_iter"][-1]) if len(log["val_loss"]) else ""
    row["params_mixers"], row["params_total"] = (
        params.get("mixers", ""),
        params.get("total", ""),
    )
    return {**row, "tokens_per_s": round(float(np.median(log["tokens_per_s"])))}


def read_rows(path, header, what):
    """The rows of a CSV that `what` (plot.py's flags) wrote, numbers as numbers, to
    the last digit.
    """
    if not os.path.isfile(path):
        fail(f"{path} not found; pass run folders, or a CSV that {what} wrote")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or list(rows[0]) != header:
        fail(
            f"{path} is not a CSV that {what} wrote; its header must be {','.join(header)}"
        )
    try:  # the mixer's name, an empty val_loss, and numbers
        return [
            {k: v if k == "mixer" or v == "" else json.loads(v) for k, v in r.items()}
            for r in rows
        ]
    except ValueError:
        fail(f"{path}: not a number where one belongs; write it again with {what}")


def seed_rows(runs, until, earlier):
    """seeds.csv: a row per run at the shortest length (or `until`), and `earlier` rows
    no run gives.
    """
    n = min([int(r["log"]["iter"][-1]) for r in runs] + ([until] if until else []))
    rows = []
    for r in runs:
        first = {"mixer": label(r["settings"])} | {
            k: r["settings"].get(k, "") for k in ("seed", "data_seed")
        }
        rows.append(run_row(first, cut(r["log"], n), [1000]))
    given = {(r["mixer"], r["seed"], r["data_seed"]) for r in rows}
    for e in earlier:
        if e["batches"] != n:
            fail(
                f"a seeds.csv row of {e['mixer']} is at {e['batches']} batches; pass that --batches"
            )
        rows += [e] if (e["mixer"], e["seed"], e["data_seed"]) not in given else []
    return sorted(
        rows,
        key=lambda r: (paper_rank(r["mixer"]), str(r["seed"]), str(r["data_seed"])),
    )


def write_results(runs, folder, window, seed_table):
    """medians.csv and val_loss.csv (a column per run), summary.csv and seeds.csv in
    `folder`.
    """
    meds = {
        r["name"]: dict(zip(*window_medians(r["log"]["train_loss"], window)))
        for r in runs
    }
    vals = {
        r["name"]: dict(zip(r["log"]["val_iter"], r["log"]["val_loss"])) for r in runs
    }
    written = []
    for file, table in (("medians.csv", meds), ("val_loss.csv", vals)):
        batches = sorted({int(b) for col in table.values() for b in col})
        at = lambda b: {
            n: repr(float(c[b])) if b in c else "" for n, c in table.items()
        }
        written.append(
            write_csv(
                os.path.join(folder, file), [{"batches": b} | at(b) for b in batches]
            )
        )
    written.append(
        write_csv(os.path.join(folder, "summary.csv"), [summary_row(r) for r in runs])
    )
    return written + (
        [write_csv(os.path.join(folder, "seeds.csv"), seed_table)] if seed_table else []
    )


def write_csv(path, rows):
    """rows: dicts, their keys the header. Returns path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(
        [list(rows[0])] + [list(r.values()) for r in rows]
    )
    atomic_write(path, buf.getvalue())
    return path


def build_parser():
    intro, examples = __doc__.strip().split("\n\n", 1)
    form = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        description=intro, epilog=examples, formatter_class=form
    )
    p.add_argument(
        "runs",
        nargs="+",
        help="run folders; with --sweep also CSVs that --sweep --results wrote",
    )
    p.add_argument(
        "-o",
        "--output",
        help="image file (.png, .pdf, .svg, ...); one run alone: RUN/loss.png",
    )
    p.add_argument(
        "--window",
        type=int,
        help="batches per median (2000, or a 30th of the longest run)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--raw",
        action="store_true",
        help="every batch's cost instead of medians (Figure 9)",
    )
    mode.add_argument(
        "--sweep", metavar="KEY", help="the last window's median against this setting"
    )
    p.add_argument(
        "--results",
        metavar="DIR",
        help="write the CSVs here (--sweep: <figure name>.csv)",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        default=[],
        help="with --results: runs or a seeds.csv for seeds.csv",
    )
    p.add_argument("--batches", type=int, help="use the first N batches of each run")
    p.error = lambda msg: fail(f"{msg} (see --help)")
    return p


def output_path(output, inputs, own, one_figure=False):
    """-o, or for one run (unless one_figure) RUN/<own>; one line for several runs
    without -o.
    """
    if output is None and (len(inputs) > 1 or one_figure):
        fail(
            "a figure of several runs, --raw or --sweep has no default file: name it with -o FILE"
        )
    return output or os.path.join(inputs[0], own)


def sweep(args, runs, csvs, output, window):
    """Figures 7, 10, 11: per run its mixer (sa-<n>; sa for n_head), the swept setting,
    batches, the median of the last `window` batches and the last validation loss, and
    the CSVs' points at other settings."""
    key, rows, seen = args.sweep, [], {}
    x = SYMBOLS.get(key, key)
    for r in runs:
        s, value = r["settings"], r["settings"].get(key)
        if type(value) not in (int, float):
            numbers = ", ".join(
                sorted(k for k, v in s.items() if type(v) in (int, float))
            )
            fail(
                f"{r['dir']} has no number {key!r} in its run.json; sweep one of {numbers}"
            )
        point = (s["mixer"] if key == "n_head" else label(s), value)
        if point in seen:
            fail(
                f"{seen[point]} and {r['dir']} are both {point[0]} at {x} = {value}; pass one per point"
            )
        seen[point] = r["dir"]
        rows.append(run_row({"mixer": point[0], x: value}, r["log"], [window]))
    if key == "n_head" and (len({row["mixer"] for row in rows}) > 1 or csvs):
        fail(
            "--sweep n_head compares the head counts of one mixer; pass run folders of one mixer"
        )
    for path in csvs:
        header = ["mixer", x, "batches", f"median_last_{window}", "val_loss"]
        points = read_rows(path, header, f"--sweep {key}")
        rows += [p for p in points if (p["mixer"], p[x]) not in seen]
    lengths = sorted({r["batches"] for r in rows})
    if len(lengths) > 1:
        fail(
            f"the sweep's points have {lengths[0]} to {lengths[-1]} batches; pass --batches N to compare"
        )
    rows.sort(key=lambda r: (paper_rank(r["mixer"]), r[x]))
    plot_sweep(rows, key, output, window, setting_title(runs, key) if runs else None)
    if key == "n_head":  # Figure 7's CSV: one mixer, no mixer column
        rows = [{k: v for k, v in r.items() if k != "mixer"} for r in rows]
    name = os.path.splitext(os.path.basename(output))[0] + ".csv"
    return [write_csv(os.path.join(args.results, name), rows)] if args.results else []


def plot_logs(args):
    """The figure and the CSVs the flags ask for; returns the paths written."""
    if any(n is not None and n < 1 for n in (args.window, args.batches)):
        fail("--window and --batches must be at least 1")
    if args.seeds and (not args.results or args.sweep):
        fail(
            "--seeds only adds rows to seeds.csv, which --results DIR writes without --sweep"
        )
    output = output_path(
        args.output, args.runs, "loss.png", one_figure=args.raw or args.sweep
    )
    csvs = [p for p in args.runs if args.sweep and p.endswith(".csv")]
    runs = read_runs([p for p in args.runs if p not in csvs], args.batches)
    seeds = read_runs([p for p in args.seeds if not p.endswith(".csv")])
    check_corpus(runs + seeds)
    longest = max((len(r["log"]["train_loss"]) for r in runs), default=2000)
    window = args.window or min(2000, longest if args.sweep else max(1, longest // 30))
    for r in runs:
        n = len(r["log"]["train_loss"])
        if n < (1 if args.raw else window):  # --raw draws every batch
            fail(
                f"{r['dir']} has {n} batches, fewer than a window of {window}; pass --window {n} or drop it"
            )
    if args.sweep:
        return [output] + sweep(args, runs, csvs, output, window)
    if len(runs) == 1 and not args.raw:
        plot_run(runs[0], output, window)
    else:
        plot_runs(runs, output, window, args.raw)
    if not args.results:
        return [output]
    earlier = [
        row
        for p in args.seeds
        if p.endswith(".csv")
        for row in read_rows(p, SEED_COLUMNS, "--seeds")
    ]
    seed_table = seed_rows(runs + seeds, args.batches, earlier) if args.seeds else []
    return [output] + write_results(runs, args.results, window, seed_table)


def cli(work, hint):
    """Print the paths work() wrote; one it cannot write (-o a folder, a full disk) is
    one line and `hint`.
    """
    try:
        written = work()
    except OSError as e:
        fail(
            f"cannot write {shlex.quote(str(e.filename or 'the output'))}: {e.strerror}; {hint}"
        )
    print("wrote " + " ".join(shlex.quote(path) for path in written))
    return 0


def main(argv=None):
    return cli(
        lambda: plot_logs(build_parser().parse_args(argv)),
        "pick another -o or --results",
    )


if __name__ == "__main__":
    sys.exit(main())
