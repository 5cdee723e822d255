"""
Figures 8 and 9 on one GPU: Table 1's six models (self-attention with 1 and 32 heads, SHE, HE, WE, ME)
trained side by side to 60000 batches within a time limit; run again, it goes on where it stopped. After
each call the logs are kept in results/logs/table1/ and the figures redrawn into results/table1/.

    python experiments/reproduce.py --check                   # first: the same experiment as on the CPU?
    python experiments/reproduce.py --time_limit 14m          # the six side by side; again: it goes on
    python experiments/reproduce.py sa-32 she --time_limit 7m # Figure 9's two

--check trains each model for 100 batches and compares every 10-batch window's mean
training cost with the committed CPU runs of results/logs/table1-cpu: within 0.05, or it
fails (results/gpu/check.txt). The children are train.py processes; Ctrl-C or kill stops
them at a checkpoint, and so does kill -9 of this script on Linux."""

import argparse
import contextlib
import ctypes
import gzip
import os
import shutil
import signal
import subprocess
import sys

from plot import read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
PLOT = [
    sys.executable,
    os.path.join(ROOT, "experiments", "plot.py"),
]  # the command that draws the figures
# Table 1's six models: train.py's defaults but the mixer (and attention's heads)
RUNS = {"sa-1": ["--mixer=sa", "--n_head=1"], "sa-32": ["--mixer=sa"]}
RUNS |= {mixer: [f"--mixer={mixer}"] for mixer in ("she", "he", "we", "me")}
WINDOW, TOLERANCE = (
    10,
    0.05,
)  # the check: batches per window, the largest gap to the CPU run


def die_with_parent():
    """Linux: the kernel sends the child SIGTERM (it checkpoints) if this script dies,
    even by kill -9.
    """
    with contextlib.suppress(
        OSError, AttributeError
    ):  # (no libc.so.6 or no prctl: not Linux)
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def train_all(names, flags, work):
    """train.py for each run, side by side, into work/<name> (resumed where it has a
    checkpoint); returns their exit codes. A stop of this script stops them, each at a
    checkpoint."""
    procs = []
    try:
        for name in names:
            out = os.path.join(work, name)
            resume = (
                ["--resume"] if os.path.exists(os.path.join(out, "ckpt.pt")) else []
            )
            cmd = [
                sys.executable,
                TRAIN,
                *RUNS[name],
                *flags,
                f"--out_dir={out}",
                *resume,
            ]
            os.makedirs(out, exist_ok=True)
            console = open(os.path.join(out, "console.txt"), "a")
            proc = subprocess.Popen(
                cmd,
                stdout=console,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
            procs.append(proc)
            print(f"{name}: {' '.join(cmd[1:])}", flush=True)
        return [p.wait() for p in procs]
    finally:  # Ctrl-C, kill, an error: every child gets SIGTERM, checkpoints and stops
        for p in procs:
            p.send_signal(signal.SIGTERM)  # (nothing for a child that has exited)
        for p in procs:
            p.wait()


def window_means(run_dir):
    """The mean training cost of each 10-batch window of a run's log.csv (or
    log.csv.gz).
    """
    costs = read_log(run_dir)["train_loss"]
    return [
        sum(costs[i : i + WINDOW]) / WINDOW
        for i in range(0, len(costs) - WINDOW + 1, WINDOW)
    ]


def check(names, args):
    """Each model's first 100 batches here against its committed CPU run: the windows'
    gaps, a table.
    """
    flags = [
        "--max_iters=100",
        "--log_interval=10",
        "--overwrite",
        f"--device={args.device}",
    ]
    train_all(
        names, flags + [f"--data_dir={args.data_dir}"], os.path.join(args.work, "check")
    )
    ends = " ".join(f"{i + WINDOW:>7d}" for i in range(0, 100, WINDOW))
    lines = [
        f"mean training cost here minus on the CPU, windows of {WINDOW} batches ending at:"
    ]
    lines.append(f"{'run':6s} {ends}   worst")
    worst = 0
    for name in names:
        here = window_means(os.path.join(args.work, "check", name))
        cpu = window_means(os.path.join(args.results, "logs", "table1-cpu", name))
        same_length = len(here) == len(cpu) == 100 // WINDOW
        gaps = [a - b for a, b in zip(here, cpu)] if same_length else [float("inf")]
        gap = max(map(abs, gaps))
        worst = max(worst, gap)
        lines.append(
            f"{name:6s} " + " ".join(f"{g:+7.4f}" for g in gaps) + f" {gap:7.4f}"
        )
    verdict = "passed" if worst <= TOLERANCE else "FAILED"
    lines.append(
        f"{verdict}: every 10-batch window within {TOLERANCE} of the CPU run's (worst {worst:.4f})"
    )
    text = "\n".join(lines)
    os.makedirs(os.path.join(args.results, "gpu"), exist_ok=True)
    with open(os.path.join(args.results, "gpu", "check.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if verdict == "passed" else 1


def keep_and_redraw(names, args):
    """Each run's log (gzipped) and run.json into results/logs/table1/, then Figures 8
    and 9 redrawn.
    """
    logs = os.path.join(args.results, "logs", "table1")
    for name in names:
        src, dst = os.path.join(args.work, name), os.path.join(logs, name)
        if not os.path.exists(os.path.join(src, "log.csv")):
            continue
        os.makedirs(dst, exist_ok=True)
        with (
            open(os.path.join(src, "log.csv"), "rb") as f,
            open(os.path.join(dst, "log.csv.gz"), "wb") as g,
        ):
            g.write(gzip.compress(f.read(), mtime=0))
        shutil.copy(os.path.join(src, "run.json"), os.path.join(dst, "run.json"))
    kept = [
        os.path.join(logs, n)
        for n in RUNS
        if os.path.exists(os.path.join(logs, n, "log.csv.gz"))
    ]
    figures = os.path.join(args.results, "table1")
    subprocess.run(
        PLOT + kept + ["--results", figures, "-o", os.path.join(figures, "fig8.png")]
    )
    pair = [r for r in kept if os.path.basename(r) in ("sa-32", "she")]
    if len(pair) == 2:
        subprocess.run(PLOT + pair + ["--raw", "-o", os.path.join(figures, "fig9.png")])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument(
        "runs",
        nargs="*",
        default=list(RUNS),
        help=f"which of {', '.join(RUNS)} (default: all)",
    )
    p.add_argument(
        "--time_limit",
        default="14m",
        help="each train.py stops at a checkpoint before this",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only the same-experiment check (100 batches each)",
    )
    p.add_argument("--device", default="cuda", help="the device of every train.py")
    p.add_argument("--data_dir", default="data", help="prepare_data.py's folder")
    p.add_argument("--work", default="out/table1", help="the run folders")
    p.add_argument(
        "--results",
        default=os.path.join(ROOT, "results"),
        help="where logs and figures go",
    )
    args = p.parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)
    )  # (so that `finally` runs)
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        sys.exit(f"error: unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    if args.check:
        return check(args.runs, args)
    flags = [
        f"--time_limit={args.time_limit}",
        f"--device={args.device}",
        f"--data_dir={args.data_dir}",
    ]
    codes = train_all(args.runs, flags, args.work)
    keep_and_redraw(args.runs, args)
    for name, code in zip(args.runs, codes):
        print(
            f"{name}: exit {code}, see {os.path.join(args.work, name, 'console.txt')}"
        )
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
