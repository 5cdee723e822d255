"""
Figures 8 and 9 on one GPU: Table 1's six models (self-attention with 1 and 32 heads,
SHE, HE, WE, ME) trained to 60000 batches within a time limit, as many at once as the
GPU's free memory holds (--jobs N: N); run again, it goes on where it stopped. The
runs train in out/table1/. A run that ended well is copied into results/logs/table1/
when it is at least as long as the one there and from the same kind of device (or with
--replace), and then Figures 8 and 9 are redrawn into results/table1/ as
results/README.md's "Redrawing" does.

    python experiments/reproduce.py --check           # first: the CPU's experiment?
    python experiments/reproduce.py --time_limit 14m  # the six; again: it goes on
    python experiments/reproduce.py sa-32 she         # Figure 9's two

--check: each model's first 100 batches against the committed CPU runs
(results/logs/table1-cpu), every 10-batch window's mean cost within 0.05. Ctrl-C, kill
and (on Linux) kill -9 of this script stop its train.py children at a checkpoint."""

import argparse
import contextlib
import ctypes
import fcntl
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from plot import atomic_write, fail, read, read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
PLOT = [sys.executable, os.path.join(ROOT, "experiments", "plot.py")]
# Table 1's six models: train.py's defaults but the mixer (and attention's heads)
RUNS = {
    "sa-1": ["--mixer=sa", "--n_head=1"],
    "sa-32": ["--mixer=sa"],
    "she": ["--mixer=she"],
    "he": ["--mixer=he"],
    "we": ["--mixer=we"],
    "me": ["--mixer=me"],
}
WINDOW = 10  # the check: batches per window
TOLERANCE = 0.05  # the check: the largest gap to the CPU run's window mean
# GiB on a GPU, estimated: each model's eager training peak on an H200 (peak_mib in
# results/table1/bench_h200.txt; sa's for both heads) plus CONTEXT_GIB for its context,
# evaluation, slack (the captured step's reserve unmeasured): six ~15 GiB, sa-32 she 5.5
NEED_GIB = {"sa-1": 1.6, "sa-32": 1.6, "she": 2.4, "he": 1.7, "we": 1.7, "me": 1.3}
CONTEXT_GIB = 0.75


def die_with_parent():
    """Linux: the kernel sends the child SIGTERM if this script dies, by kill -9 too."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def lock(work):
    """work/.lock held while open, or one line: a second would undo the first's runs."""
    os.makedirs(work, exist_ok=True)
    held = open(os.path.join(work, ".lock"), "w")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"{work} is in use by another reproduce.py: wait for it, or pass --work")
    return held


def start(name, flags, work):
    """train.py for one run into work/<name> (resumed), its output into console.txt."""
    out = os.path.join(work, name)
    cmd = [sys.executable, TRAIN, *RUNS[name], *flags, f"--out_dir={out}"]
    if os.path.exists(os.path.join(out, "ckpt.pt")):
        cmd.append("--resume")
    os.makedirs(out, exist_ok=True)
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    with open(os.path.join(out, "console.txt"), "a") as console:
        print(f"$ {' '.join(cmd)}", file=console, flush=True)
        output = dict(stdout=console, stderr=subprocess.STDOUT)
        return subprocess.Popen(cmd, **output, preexec_fn=die_with_parent)


def train_all(args, work, *more):
    """train.py (args' device and data, `more` flags) for each of args.runs in turn,
    started once room(args) holds it and those running, or none runs; their exit codes.
    A stop of this script stops each at a checkpoint."""
    flags = [f"--device={args.device}", f"--data_dir={args.data_dir}", *more]
    fits = room(args)
    procs = {}
    running = lambda: [n for n, p in procs.items() if p.poll() is None]
    try:
        for name in args.runs:
            while running() and not fits(running() + [name]):
                time.sleep(1)
            procs[name] = start(name, flags, work)
        return [procs[name].wait() for name in args.runs]
    finally:  # Ctrl-C, kill, an error: every child gets SIGTERM, checkpoints and stops
        for p in procs.values():
            p.send_signal(signal.SIGTERM)  # (nothing for a child that has exited)
        for p in procs.values():
            p.wait()


def room(args):
    """The rule of which runs train at once: --jobs of them; else on CUDA those whose
    NEED_GIB the device's free memory holds; else all."""
    if args.jobs or not args.device.startswith("cuda"):
        return lambda names: not args.jobs or len(names) <= args.jobs
    free = torch.cuda.mem_get_info(args.device)[0] / 2**30
    print(f"{free:.1f} GiB free on {args.device}: as many runs at once as it holds")
    return lambda names: sum(NEED_GIB[n] + CONTEXT_GIB for n in names) <= free


def failure(console, code):
    """Why a run failed, from its console: out of memory and what to do, or its exit."""
    ours = Path(console).read_text().rsplit("$ ", 1)[-1]  # this call's: after "$ "
    if "\nerror: out of memory" in ours:
        return "ran out of memory: run fewer at once (--jobs 1) or free the GPU"
    return f"failed (exit {code})"


def window_means(run_dir):
    """The mean training cost of each 10-batch window of a run's log.csv (or .gz)."""
    costs = read_log(run_dir)["train_loss"]
    starts = range(0, len(costs) - WINDOW + 1, WINDOW)
    return [sum(costs[i : i + WINDOW]) / WINDOW for i in starts]


def check(args):
    """Each model's first 100 batches here against its committed CPU run: a table."""
    work = os.path.join(args.work, "check")
    shutil.rmtree(work, ignore_errors=True)  # the check trains anew
    codes = train_all(args, work, "--max_iters=100", "--log_interval=10")
    for name, code in zip(args.runs, codes):
        if code != 0:
            console = os.path.join(work, name, "console.txt")
            fail(f"the check's {name} run {failure(console, code)}; see {console}")
    cuda = args.device.startswith("cuda")
    card = f" ({torch.cuda.get_device_name(args.device)})" if cuda else ""
    lines = [f"device {args.device}{card}, torch {torch.__version__}"]
    minus = f"mean training cost here minus on the CPU, windows of {WINDOW} batches"
    ends = " ".join(f"{i + WINDOW:>7d}" for i in range(0, 100, WINDOW))
    lines += [minus, f"{'run':6s} {ends}   worst"]
    worst = 0
    for name in args.runs:
        here = window_means(os.path.join(work, name))
        cpu = window_means(os.path.join(args.results, "logs", "table1-cpu", name))
        gaps = [a - b for a, b in zip(here, cpu)]
        if not len(here) == len(cpu) == 100 // WINDOW:
            gaps = [float("inf")]
        gap = max(map(abs, gaps))
        worst = max(worst, gap)
        row = " ".join(f"{g:+7.4f}" for g in gaps)
        lines.append(f"{name:6s} {row} {gap:7.4f}")
    verdict = "passed" if worst <= TOLERANCE else "FAILED"
    within = f"every {WINDOW}-batch window within {TOLERANCE} of the CPU run's"
    lines.append(f"{verdict}: {within} (worst {worst:.4f})")
    text = "\n".join(lines) + "\n"
    # check.txt: the six on CUDA; fewer, or another kind of device, named (check-cpu-me)
    kind = args.device.split(":")[0]
    parts = ["check"] if kind == "cuda" else ["check", kind]
    if args.runs != list(RUNS):
        parts += args.runs
    atomic_write(os.path.join(args.results, "gpu", "-".join(parts) + ".txt"), text)
    print(text, end="")
    return 0 if verdict == "passed" else 1


def length_and_device(run_dir):
    """A run's last batch and the kind of device it trained on (cuda, cpu, mps)."""
    run = read(os.path.join(run_dir, "run.json"), json.load)
    device = run.get("computed", {}).get("device") or run["args"]["device"]
    return int(read_log(run_dir)["iter"][-1]), device.split(":")[0]


def keep(name, code, args):
    """Copy a run that ended well (log gzipped, run.json) into results/logs/table1/ if
    as long as the one there and from one kind of device, or --replace; True if so."""
    src = os.path.join(args.work, name)
    dst = os.path.join(args.results, "logs", "table1", name)
    if code != 0:
        console = os.path.join(src, "console.txt")
        print(f"{name}: {failure(console, code)}; not copied, see {console}")
        return False
    batches, device = length_and_device(src)
    if os.path.exists(dst) and not args.replace:
        old_batches, old_device = length_and_device(dst)
        if batches < old_batches or device != old_device:
            why = f"{batches} batches on {device} against {old_batches} on {old_device}"
            print(f"{name}: not copied, {why} in {dst} (--replace copies it)")
            return False
    log = Path(src, "log.csv").read_bytes()
    atomic_write(os.path.join(dst, "log.csv.gz"), gzip.compress(log, mtime=0))
    atomic_write(os.path.join(dst, "run.json"), Path(src, "run.json").read_bytes())
    print(f"{name}: {batches} batches on {device}, copied into {dst}")
    return True


def redraw(results):
    """Table 1's figures and CSVs as results/README.md redraws them; True if all did."""
    logs = os.path.join(results, "logs", "table1")
    figures = os.path.join(results, "table1")
    runs = [os.path.join(logs, n) for n in RUNS if os.path.isdir(os.path.join(logs, n))]
    out = lambda name: ["-o", os.path.join(figures, name)]
    commands = [
        runs + ["--window", "2000", "--results", figures, *out("fig8_w2000.png")],
        runs + ["--window", "500", *out("fig8.png")],
    ]
    pair = [r for r in runs if os.path.basename(r) in ("sa-32", "she")]
    if len(pair) == 2:  # Figure 9
        commands.append(pair + ["--raw", *out("fig9.png")])
    codes = [subprocess.run(PLOT + argv).returncode for argv in commands]
    return not any(codes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.error = lambda msg: fail(f"{msg} (see python experiments/reproduce.py --help)")
    runs_help = f"which of {', '.join(RUNS)} (default: all)"
    p.add_argument("runs", nargs="*", default=list(RUNS), help=runs_help)
    p.add_argument("--time_limit", default="14m", help="each run stops within it")
    jobs = "runs at once (default: as many as the GPU's free memory holds; all on CPU)"
    p.add_argument("--jobs", type=int, help=jobs)
    p.add_argument("--check", action="store_true", help="only the check, 100 batches")
    p.add_argument("--device", default="cuda", help="the device of every train.py")
    p.add_argument("--data_dir", default="data", help="prepare_data.py's folder")
    p.add_argument("--work", default="out/table1", help="the run folders")
    results = os.path.join(ROOT, "results")
    p.add_argument("--results", default=results, help="where logs and figures go")
    replace = "copy a run that ended well even if shorter or from another device kind"
    p.add_argument("--replace", action="store_true", help=replace)
    args = p.parse_args(argv)
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        fail(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    if not re.fullmatch(r"\d+(\.\d+)?[smh]?", args.time_limit):  # as train.py reads it
        fail(f"--time_limit {args.time_limit!r} is not a time: write 90s, 40m, 2h")
    if args.jobs is not None and args.jobs < 1:
        fail(f"--jobs {args.jobs}: runs at once must be at least 1")
    args.runs = [name for name in RUNS if name in args.runs]  # each once, in order
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail("torch sees no CUDA device here; pass --device cpu to train on the CPU")
    # SIGTERM as Ctrl-C: `finally` stops the children
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with lock(args.work):
        try:
            if args.check:
                return check(args)
            codes = train_all(args, args.work, f"--time_limit={args.time_limit}")
        except KeyboardInterrupt:
            stopped = f"stopped: each run at its last checkpoint in {args.work}"
            print(f"{stopped}; the same command goes on from there", file=sys.stderr)
            return 130
        kept = [keep(name, code, args) for name, code in zip(args.runs, codes)]
        failed = any(kept) and not redraw(args.results)
        return 1 if failed or any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
