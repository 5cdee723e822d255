"""
Training runs drawn as the paper does (Section 6), and the results' CSVs: the median
training cost of every non-overlapping window of batches (Figures 7-8, each run's gap to
sa-32 beside it), every batch (Figure 9, --raw), or the median of the last window
against a swept setting (Figures 7, 10, 11, --sweep, the validation loss beside it).

    python experiments/plot.py out/me                                  # out/me/loss.png
    python experiments/plot.py out/{sa-1,sa-32,she,he,we,me} -o fig8.png  # and gaps
    python experiments/plot.py out/sa-32 out/she --raw -o fig9.png      # every batch
    python experiments/plot.py out/fig10/* --sweep block_size -o fig10.png  # against l
    python experiments/plot.py RUNS... --seeds MORE... --results results -o fig8.png

Run folders: train.py's (log.csv, run.json) or results/logs/'s (log.csv.gz, run.json).
Runs side by side share a corpus; a sweep's runs also one length (--batches N) and one
run per point, and its window is their last 2000 batches (or all). A sweep CSV that
--results wrote may stand among its runs, a seeds.csv among --seeds: the rows no run
gives again stay.
"""

import argparse
import contextlib
import csv
import gzip
import io
import json
import math
import os
import shlex
import sys
import zlib
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

# one colour per mixer, in this order, in every figure (others: matplotlib's cycle)
STYLE = {
    "sa-1": "tab:gray",
    "sa-32": "black",
    "she": "tab:red",
    "he": "tab:orange",
    "we": "tab:green",
    "me": "tab:blue",
    "he-ext": "tab:purple",
}
SYMBOLS = {"n_layer": "m", "block_size": "l"}  # the paper's, in titles and sweep CSVs
EXTRACTORS = ("she", "we", "he", "me", "he-ext")  # (no heads)
SEED_COLUMNS = ["mixer", "seed", "data_seed", "batches", "median_last_1000", "val_loss"]
# what reading a cut, hand-edited or foreign file raises
DAMAGED = (
    EOFError,
    gzip.BadGzipFile,
    zlib.error,
    csv.Error,
    ValueError,
    KeyError,  # run.json without a key
    TypeError,  # run.json of another shape
)


# (not machinery.py's: this file and those that import it stay free of torch)
def fail(msg):
    """Bad input: one line on stderr, what is wrong and what to do; exit 1, no trace."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def atomic_write(path, data):
    """data (bytes or str) whole at path or none of it (renamed); makes its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        Path(tmp).write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:  # (named as the file it was for)
        raise OSError(e.errno, e.strerror, path) from e
    finally:
        Path(tmp).unlink(missing_ok=True)


def read(path, parse, hint="pass folders written by train.py"):
    """parse(the file at path open as text, a .gz unzipped); one line if it cannot."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", newline="") as f:
            return parse(f)
    except DAMAGED as e:
        why = f"{type(e).__name__}: {e}"
        fail(f"{path} is damaged ({why}); restore it or leave it out")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}; {hint}")


def read_log(run_dir):
    """A run's log.csv (or .gz) as arrays: iter, train_loss, tokens_per_s, val_*."""
    path = os.path.join(run_dir, "log.csv")
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        path += ".gz"  # a finished run's log as results/logs/ keeps it
    good = []
    for row in read(path, lambda f: list(csv.DictReader(f))):
        # left out: a half-written last row, or not train.py's log
        with contextlib.suppress(KeyError, TypeError, ValueError):
            numbers = [float(row[c]) for c in ("iter", "train_loss", "tokens_per_s")]
            good.append(numbers + [float(row["val_loss"] or "nan")])
    if not good:
        fail(f"{path} has no row of train.py's log yet; wait for one, or restore it")
    it, loss, tok_s, val = np.array(good).T  # (rows,) each
    has = ~np.isnan(val)
    log = dict(iter=it.astype(np.int64), train_loss=loss, tokens_per_s=tok_s)
    return log | dict(val_iter=log["iter"][has], val_loss=val[has])


def cut(log, until):
    """read_log's arrays up to batch `until`."""
    kept = log["iter"] <= until
    kept_val = log["val_iter"] <= until
    return {k: v[kept_val if k.startswith("val") else kept] for k, v in log.items()}


def read_runs(run_dirs, until=None):
    """Each run once, in the paper's order: name, dir, settings, its log to `until`."""
    paths = [os.path.realpath(d) for d in run_dirs]
    if len(set(paths)) < len(paths):
        same = " and ".join(d for d, p in zip(run_dirs, paths) if paths.count(p) > 1)
        fail(f"{same} are one run folder; pass each run once")
    settings = [read(os.path.join(d, "run.json"), run_settings) for d in run_dirs]
    names = [label(s) for s in settings]
    depth = 0
    while len(set(names)) < len(names):  # two of one label: the paths' last parts
        depth += 1
        names = ["/".join(p.split(os.sep)[-depth:]) for p in paths]
    runs = []
    for d, name, s in zip(run_dirs, names, settings):
        log = cut(read_log(d), until or np.inf)
        runs.append({"dir": d, "name": name, "settings": s, "log": log})
    return sorted(runs, key=lambda r: paper_rank(r["name"]))


def run_settings(f):
    """run.json's settings: train.py's flags, the model's, parameters and data."""
    run = dict(json.load(f))  # (not an object: a TypeError, ValueError or KeyError)
    more = {"params": run.get("params", {}), "data": run.get("data") or {}}
    return run["args"] | run["config"] | more


def label(settings):
    """sa-<heads> for self-attention (the paper's 1 and 32 heads), else the mixer, and
    -<heads> for one with heads (a Synthesizer) if not Table 1's 32."""
    mixer = settings["mixer"]
    heads = settings["n_head"]
    if mixer == "sa" or heads != 32 and mixer not in EXTRACTORS:
        return f"{mixer}-{heads}"
    return mixer


def paper_rank(name):
    """Sort key: sa by heads (sa-1, sa-2, ...), STYLE's order, the others by name."""
    heads = name.removeprefix("sa-")
    if name.startswith("sa-") and heads.isdigit():
        return (0, int(heads), name)
    return (list(STYLE).index(name) if name in STYLE else len(STYLE), 0, name)


def check_corpus(runs):
    """One corpus for all runs (a cost over other tokens is another quantity): one
    vocabulary, and one train.bin (sha256) among the runs whose run.json records it."""
    settings = [r["settings"] for r in runs]
    corpora = {(s.get("vocab_size"), s["data"].get("train_sha256")) for s in settings}
    shas = {sha for _, sha in corpora if sha}
    if len({v for v, _ in corpora}) > 1 or len(shas) > 1:
        train = lambda sha: f", train.bin {sha[:12]}" if sha else ""
        data = "; ".join(sorted(f"vocabulary {v}{train(sha)}" for v, sha in corpora))
        fail(f"the runs were trained on other data ({data}); pass runs of one corpus")


def window_medians(loss, window):
    """Each full window's last batch number and the median of its training costs."""
    n = len(loss) // window
    med = np.median(np.asarray(loss[: n * window]).reshape(n, window), axis=1)  # (n,)
    return window * np.arange(1, n + 1), med


def plot_run(run, path, window):
    """One run's chart: every batch, the window medians and the validation loss."""
    log = run["log"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    alpha = 0.35 if window > 1 else 1
    x, y = log["iter"], log["train_loss"]
    ax.plot(x, y, lw=0.5, alpha=alpha, color="C0", label="training cost, every batch")
    if window > 1:
        ends, med = window_medians(log["train_loss"], window)
        medians = f"median of every {window} batches"
        ax.plot(ends, med, "-o", ms=3, color="C0", label=medians)
    if len(log["val_loss"]):
        val = "validation loss"
        ax.plot(log["val_iter"], log["val_loss"], "s--", ms=4, color="C3", label=val)
    finish(ax, os.path.basename(os.path.normpath(run["dir"])))
    save(fig, path)


def plot_runs(runs, path, window, raw=False):
    """Several runs overlaid: window medians (Figures 7-8), beside them each run's gap
    to sa-32's where sa-32 is among them; or raw, every batch at its number (Fig. 9)."""
    ref = None if raw else {r["name"]: r for r in runs}.get("sa-32")
    size = (15, 5) if ref else (8, 5)
    fig, axes = plt.subplots(1, 2 if ref else 1, figsize=size, squeeze=False)
    ax = axes[0][0]
    curves = {r["name"]: (r["log"]["iter"], r["log"]["train_loss"]) for r in runs}
    if not raw:  # each full window's last batch and median, once for both panels
        curves = {name: window_medians(y, window) for name, (_, y) in curves.items()}
    style = dict(lw=0.5, alpha=0.6) if raw else dict(marker="o", ms=3)
    for r in runs:
        ax.plot(*curves[r["name"]], label=r["name"], **style, **line(r))
    medians = f"median training cost of every {window} batches"
    finish(ax, "training cost of every batch" if raw else medians)
    if ref:
        ax = axes[0][1]
        ax.axhline(0, color=STYLE["sa-32"], lw=1, label="sa-32")
        ref_med = curves["sa-32"][1]
        for r in [r for r in runs if r is not ref]:
            ends, med = curves[r["name"]]
            n = min(len(med), len(ref_med))  # the windows both runs have
            gap = med[:n] - ref_med[:n]
            ax.plot(ends[:n], gap, marker="o", ms=3, label=r["name"], **line(r))
        ax.set(ylabel="median cost minus sa-32's (nats)")
        finish(ax, "gap to sa-32, window by window")
    save(fig, path, setting_title(runs))


def line(run):
    """A run's colour (its name's) and line: the paper's mixers solid, the rest dashed,
    by its mixer, not its name (he-d1338 is HE's run on another batch order)."""
    paper = run["settings"]["mixer"] in ("sa", *EXTRACTORS)
    return dict(color=STYLE.get(run["name"]), linestyle="-" if paper else "--")


def setting_title(runs, swept=None):
    """The runs' setting, e.g. 'm = 2, l = 32, 30000 batches, seed 1337': each value
    where they differ ('seeds 1337, 1338'), the data seed unless 1337, not the swept."""

    def values(key, default="?"):  # "2" or "2, 4", numbers first; "s" for several
        found = {r["settings"].get(key, default) for r in runs}
        found = sorted(found, key=lambda v: (isinstance(v, str), v))
        return ", ".join(map(str, found)), "s" if len(found) > 1 else ""

    parts = [f"{SYMBOLS[k]} = {values(k)[0]}" for k in SYMBOLS if k != swept]
    lengths = sorted({int(r["log"]["iter"][-1]) for r in runs})
    parts.append(f"{', '.join(map(str, lengths))} batches")
    seeds, plural = values("seed")
    parts.append(f"seed{plural} {seeds}")
    data_seeds, plural = values("data_seed", 1337)
    if data_seeds != "1337":  # not train.py's default batch order
        parts.append(f"data seed{plural} {data_seeds}")
    if swept:
        parts.append("one run per point")
    return ", ".join(parts)


def plot_sweep(rows, key, path, window, title=None):
    """A line per mixer against the swept setting: last window's median, val_loss."""
    x = SYMBOLS.get(key, key)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = {f"median_last_{window}": f"median cost of the last {window} batches"}
    panels["val_loss"] = "validation loss"
    for ax, (y, what) in zip(axes, panels.items()):
        for name in dict.fromkeys(r["mixer"] for r in rows):  # paper order, each once
            pts = [(r[x], r[y]) for r in rows if r["mixer"] == name and r[y] != ""]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, "-o", color=STYLE.get(name), label=name)
        values = sorted({r[x] for r in rows})
        # l = 32 ... 1024, n = 1 ... 128 and similar doubling sweeps
        if all(v > 0 for v in values) and max(values) / min(values) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.set(xlabel=f"{x} ({key})" if x != key else key, ylabel=what)
        finish(ax, f"{what} against {x}")
    save(fig, path, title)


def finish(ax, title):
    xlabel = ax.get_xlabel() or "batches"
    ax.set(xlabel=xlabel, ylabel=ax.get_ylabel() or "cost (cross-entropy, nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    many = len(ax.get_lines()) > 11  # (two columns, smaller)
    ax.legend(ncols=1 + many, fontsize="small" if many else None)


def save(fig, path, title=None):
    """fig, titled, to path in the format its extension names (none: png)."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    kinds = fig.canvas.get_supported_filetypes()  # {"png": "Portable ...", ...}
    if fmt not in kinds:
        known = ", .".join(sorted(kinds))
        fail(f"cannot write a .{fmt} image {shlex.quote(path)}; use one of .{known}")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    metadata = {"Software": None} if fmt == "png" else None  # no version stamp
    image = io.BytesIO()
    fig.savefig(image, format=fmt, dpi=120, bbox_inches="tight", metadata=metadata)
    atomic_write(path, image.getvalue())
    plt.close(fig)


def run_row(first, log, lasts):
    """`first`, batches, the last n batches' median for n in `lasts`, last val_loss."""
    row = first | {"batches": int(log["iter"][-1])}
    for n in lasts:
        row[f"median_last_{n}"] = float(np.median(log["train_loss"][-n:]))
    row["val_loss"] = float(log["val_loss"][-1]) if len(log["val_loss"]) else ""
    return row


def summary_row(run):
    """summary.csv: run_row, the last val_loss's batch, parameters, median tokens/s."""
    log = run["log"]
    row = run_row({"run": run["name"]}, log, (1000, 2000))
    row["val_at"] = int(log["val_iter"][-1]) if len(log["val_loss"]) else ""
    row["params_mixers"] = run["settings"]["params"].get("mixers", "")
    row["params_total"] = run["settings"]["params"].get("total", "")
    row["tokens_per_s"] = round(float(np.median(log["tokens_per_s"])))
    return row


def read_rows(path, header, what):
    """The rows of a CSV that `what` wrote, its numbers as numbers to the last digit."""
    hint = f"pass run folders, or a CSV that {what} wrote"
    rows = read(path, lambda f: list(csv.DictReader(f)), hint)
    if not rows or list(rows[0]) != header:
        columns = ",".join(header)
        fail(f"{path} is not a CSV that {what} wrote: its header must be {columns}")
    parse = lambda k, v: v if k == "mixer" or v == "" else json.loads(v)
    try:
        return [{k: parse(k, v) for k, v in r.items()} for r in rows]
    except ValueError:
        fail(f"{path}: not a number where one belongs; write it again with {what}")


def seed_rows(runs, csvs):
    """seeds.csv: each run at the shortest run's length, the others of `csvs`."""
    n = min(int(r["log"]["iter"][-1]) for r in runs)
    rows = []
    for r in runs:
        s = r["settings"]
        first = {"mixer": label(s)} | {k: s.get(k, "") for k in ("seed", "data_seed")}
        rows.append(run_row(first, cut(r["log"], n), [1000]))
    given = {(r["mixer"], r["seed"], r["data_seed"]) for r in rows}
    earlier = [e for path in csvs for e in read_rows(path, SEED_COLUMNS, "--seeds")]
    for e in earlier:
        if e["batches"] != n:
            at = e["batches"]
            fail(f"seeds.csv: {e['mixer']} has {at} batches; pass --batches {at}")
        if (e["mixer"], e["seed"], e["data_seed"]) not in given:
            rows.append(e)
    order = lambda r: (paper_rank(r["mixer"]), str(r["seed"]), str(r["data_seed"]))
    return sorted(rows, key=order)


def by_batch(columns):
    """{run: (batches, values)} as CSV rows, a batch a row ("" where a run has none)."""
    columns = {n: dict(zip(batches, v)) for n, (batches, v) in columns.items()}
    rows = []
    for b in sorted({int(b) for column in columns.values() for b in column}):
        values = {n: repr(float(c[b])) if b in c else "" for n, c in columns.items()}
        rows.append({"batches": b} | values)
    return rows


def gap_rows(runs, path):
    """gaps.csv: each run's run_row of the last 2000 batches, its gaps to sa-32's, and
    a paper's gap in nats, ln(ppl / sa-32's ppl), from `path`'s lm1b_ppl column."""
    parse = lambda f: {r["run"]: float(r["lm1b_ppl"]) for r in csv.DictReader(f)}
    ppl = read(path, parse, "give --paper_ppl a CSV with run and lm1b_ppl columns")
    rows = [run_row({"run": r["name"]}, r["log"], [2000]) for r in runs]
    base = {r["run"]: r for r in rows}.get("sa-32")
    if base is None or "sa-32" not in ppl:
        fail(f"--paper_ppl: the gaps are to sa-32: give its run and its row in {path}")
    for r in rows:
        r["gap_median"] = r["median_last_2000"] - base["median_last_2000"]
        r["gap_val"] = r["val_loss"] - base["val_loss"]
        paper = ppl.get(r["run"])
        r["paper_gap"] = math.log(paper / ppl["sa-32"]) if paper else ""
    return rows


def write_results(runs, folder, window, seed_table, paper_ppl=None):
    """The CSVs of --results in `folder`, --seeds' and --paper_ppl's where given."""
    medians = {r["name"]: window_medians(r["log"]["train_loss"], window) for r in runs}
    vals = {r["name"]: (r["log"]["val_iter"], r["log"]["val_loss"]) for r in runs}
    tables = {"medians.csv": by_batch(medians), "val_loss.csv": by_batch(vals)}
    tables["summary.csv"] = [summary_row(r) for r in runs]
    if seed_table:
        tables["seeds.csv"] = seed_table
    if paper_ppl:
        tables["gaps.csv"] = gap_rows(runs, paper_ppl)
    return [write_csv(os.path.join(folder, f), rows) for f, rows in tables.items()]


def write_csv(path, rows):
    buf = io.StringIO()
    lines = [list(rows[0])] + [list(r.values()) for r in rows]
    csv.writer(buf, lineterminator="\n").writerows(lines)
    atomic_write(path, buf.getvalue())
    return path


def output_path(output, inputs, own, one_figure=False):
    """-o, or RUN/<own> for one run (not one_figure, not committed: log.csv.gz)."""
    if output is None and (len(inputs) > 1 or one_figure):
        fail("several runs, --raw and --sweep have no default file: name it with -o")
    if output is None and os.path.exists(os.path.join(inputs[0], "log.csv.gz")):
        fail(f"{inputs[0]} is a committed run, kept as it is: name the file with -o")
    return output or os.path.join(inputs[0], own)


def sweep(args, runs, csvs, output, window):
    """Figures 7, 10, 11: a row per run (sa, not sa-<n>, for n_head), the CSVs' rows."""
    key = args.sweep
    x = SYMBOLS.get(key, key)
    rows, seen = [], {}
    for r in runs:
        s = r["settings"]
        value = s.get(key)
        if type(value) not in (int, float):
            names = sorted(k for k, v in s.items() if type(v) in (int, float))
            why = f"{r['dir']} has no number {key!r} in its run.json"
            fail(f"{why}; sweep one of {', '.join(names)}")
        mixer = s["mixer"] if key == "n_head" else label(s)
        if (mixer, value) in seen:
            first = seen[mixer, value]
            fail(f"{first} and {r['dir']} are both {mixer} at {x} = {value}; pass one")
        seen[mixer, value] = r["dir"]
        rows.append(run_row({"mixer": mixer, x: value}, r["log"], [window]))
    if key == "n_head" and (len({row["mixer"] for row in rows}) > 1 or csvs):
        fail("--sweep n_head compares the head counts of one mixer; pass runs of one")
    for path in csvs:
        header = ["mixer", x, "batches", f"median_last_{window}", "val_loss"]
        points = read_rows(path, header, f"--sweep {key}")
        rows += [p for p in points if (p["mixer"], p[x]) not in seen]
    lengths = sorted({r["batches"] for r in rows})
    if len(lengths) > 1:
        fail(f"the points have {lengths[0]} to {lengths[-1]} batches; pass --batches N")
    rows.sort(key=lambda r: (paper_rank(r["mixer"]), r[x]))
    plot_sweep(rows, key, output, window, setting_title(runs, key) if runs else None)
    if not args.results:
        return []
    if key == "n_head":  # Figure 7's CSV: one mixer, no mixer column
        rows = [{k: v for k, v in r.items() if k != "mixer"} for r in rows]
    name = os.path.splitext(os.path.basename(output))[0] + ".csv"
    return [write_csv(os.path.join(args.results, name), rows)]


def plot_logs(args):
    """The figure and the CSVs the flags ask for; returns the paths written."""
    for flag, n in (("--window", args.window), ("--batches", args.batches)):
        if n is not None and n < 1:
            fail(f"{flag} must be at least 1, got {n}")
    if (args.seeds or args.paper_ppl) and (not args.results or args.sweep):
        fail("--seeds and --paper_ppl write CSVs of --results DIR: pass it, no --sweep")
    output = output_path(args.output, args.runs, "loss.png", args.raw or args.sweep)
    csvs = [p for p in args.runs if args.sweep and p.endswith(".csv")]
    runs = read_runs([p for p in args.runs if p not in csvs], args.batches)
    seed_csvs = [p for p in args.seeds if p.endswith(".csv")]
    seeds = read_runs([p for p in args.seeds if p not in seed_csvs], args.batches)
    check_corpus(runs + seeds)
    longest = max((len(r["log"]["train_loss"]) for r in runs), default=2000)
    window = args.window or min(2000, longest if args.sweep else max(1, longest // 30))
    for r in runs:
        n = len(r["log"]["train_loss"])
        if n < (1 if args.raw else window):  # --raw draws every batch
            why = f"{r['dir']} has {n} batches, fewer than a window of {window}"
            fail(f"{why}; pass --window {n} or leave {r['dir']} out")
    if args.sweep:
        return [output] + sweep(args, runs, csvs, output, window)
    if len(runs) == 1 and not args.raw:
        plot_run(runs[0], output, window)
    else:
        plot_runs(runs, output, window, args.raw)
    if not args.results:
        return [output]
    seed_table = seed_rows(runs + seeds, seed_csvs) if args.seeds else []
    written = write_results(runs, args.results, window, seed_table, args.paper_ppl)
    return [output] + written


def cli(work, hint):
    """Print the paths work() wrote; one it cannot write: one line and `hint`."""
    try:
        written = work()
    except OSError as e:
        name = shlex.quote(str(e.filename or "the output"))
        fail(f"cannot write {name}: {e.strerror}; {hint}")
    with contextlib.suppress(AttributeError):  # (a stream that is no TextIOWrapper)
        sys.stdout.reconfigure(errors="backslashreplace")  # a path it cannot show: \xe9
    print("wrote " + " ".join(shlex.quote(path) for path in written))
    return 0


def main(argv=None):
    intro, examples = __doc__.strip().split("\n\n", 1)
    raw = argparse.RawDescriptionHelpFormatter  # the examples as written
    p = argparse.ArgumentParser(description=intro, epilog=examples, formatter_class=raw)
    p.add_argument("runs", nargs="+", help="run folders; with --sweep also its CSVs")
    p.add_argument("-o", "--output", help="image file (.png, .pdf, .svg, ...)")
    p.add_argument("--window", type=int, help="batches per median (2000, or 1/30 run)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true", help="every batch (Figure 9)")
    mode.add_argument("--sweep", metavar="KEY", help="last window against KEY")
    p.add_argument("--results", metavar="DIR", help="write the CSVs here")
    p.add_argument("--seeds", nargs="+", default=[], help="runs or CSV for seeds.csv")
    p.add_argument("--batches", type=int, help="use the first N batches of each run")
    p.add_argument("--paper_ppl", metavar="CSV", help="gaps.csv: beside a paper's gaps")
    p.error = lambda msg: fail(f"{msg} (see --help)")
    args = p.parse_args(argv)
    return cli(lambda: plot_logs(args), "pick another -o or --results")


if __name__ == "__main__":
    sys.exit(main())
