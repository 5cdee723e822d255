"""
One command for a GPU with little time: the same-experiment check, the device tests, bench.py sections
1, 3 and 6, Figure 9's two runs and the other four of Table 1 to 60000 batches, and bfloat16 against
float32, in steps of at most --step_limit that a later call resumes; after every step the figures, CSVs,
tables and logs of what exists so far go to --results (and with --pack, all of it into one file).

    python gpu.py --device cuda --budget 40m     # as far as 40 minutes go, into results/gpu and out/gpu
    python gpu.py --device cuda --budget 40m     # again: skips what is done, continues the runs
    python gpu.py --dry_run                      # the plan and its time estimates only
    python gpu.py --smoke --data_dir /tmp/d      # tiny settings, seconds; into out/gpu-smoke, never out/gpu

The steps, in PLAN's order: check (the six Table 1 models for 100 batches with the flags of the committed
CPU runs, each 10-batch window's mean training cost within 0.05 of results/logs/table1-cpu's: check.txt),
diagnose (CUDA only: SHE again with the FIR's complex products in TF32, as the committed H200 runs had
them, and with TF32 off: diagnose.txt), tests (TEST_DEVICE=<device> python -m pytest tests.py -q -m 'not
slow'), bench (bench.py --sections 1,3,6), Figure 9's runs (sa-32, she), the other four (sa-1, he, we,
me: train.py's Table 1 defaults, the same batches in the same order; --parallel of them side by side,
the least trained first) and dtype (me for 1000 batches in float32, then in bfloat16). A training step
runs train.py and sends it SIGTERM at the step limit (or before the budget ends): train.py finishes the
batch, checkpoints and stops, and the next step goes on with --resume. SIGTERM waits for the step's first
checkpoint (10 batches after the start), so every step makes progress; a step starts only with the
preset's min_step left, and the budget keeps --margin for the last checkpoint and the time the results
take. A check, diagnose, tests or bench step that failed runs again in the next call (the check's and
the diagnosis's runs afresh). <work>/state.json keeps what these steps did on this device with these
settings (a --smoke call's are not a real call's, and a run folder of other settings is refused).

One gpu.py at a time on a --work and a --results: a second is refused while the first or a child of it
runs. The children live and die with gpu.py: Ctrl-C, kill (SIGTERM) and SIGHUP reach them as SIGTERM
(train.py checkpoints), gpu.py waits for them and stops with one line (a second signal: SIGKILL). On
Linux a gpu.py killed with kill -9 takes them along: the kernel sends each SIGTERM. Elsewhere they run on
until they end (and keep the folders locked); stop them with kill.
"""

import argparse
import contextlib
import csv
import ctypes
import dataclasses
import functools
import gzip
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time

from common import atomic_write, fail, fmt_time, one_line_errors, pick_device, plain_output

ROOT = os.path.dirname(os.path.abspath(__file__))  # tests.py, bench.py, train.py run from here

TABLE1 = {  # Figure 8's runs: train.py's default folder name -> flags (Table 1 otherwise)
    "sa-1": ["--mixer", "sa", "--n_head", "1"],
    "sa-32": ["--mixer", "sa", "--n_head", "32"],
    **{m: ["--mixer", m] for m in ("she", "he", "we", "me")},
}
DTYPES = {f"me-{t}": ["--mixer", "me", "--dtype", t] for t in ("float32", "bfloat16")}
RUNS = TABLE1 | DTYPES
FIG9 = ["sa-32", "she"]  # Figure 9: SA-32 against SHE
# The steps in order: a name is a step of its own (STEPS); a list, runs trained side by side (--parallel at
# a time, the least trained first); dtype's runs one at a time, so that their speeds compare.
PLAN = [
    "check",  # the six Table 1 models' first 100 batches against the committed CPU logs
    "diagnose",  # SHE's first 100 batches with the FIR's complex products in TF32, and with TF32 off
    "tests",
    "bench",
    FIG9,
    ["sa-1", "he", "we", "me"],
    ["me-float32"],
    ["me-bfloat16"],
]

# The same-experiment check (issue 40): each run with the flags of the committed CPU runs (their run.json),
# Table 1 otherwise; the mean training cost of each 10-batch window, this device minus the CPU, within 0.05.
CHECK_ITERS, WINDOW, TOLERANCE = 100, 10, 0.05
CHECK_FLAGS = ["--max_iters", str(CHECK_ITERS), "--log_interval", "10"]
# Names from train.py and fir.py, in one place: TF32 off everywhere, and fir.py's switch that puts the FIR's
# products (SHE's complex ones) back in TF32 (the arithmetic of the committed H200 runs)
NO_TF32, FIR_TF32 = "--no-tf32", "ALLOW_TF32"
CHECKS = {  # the check's and the diagnosis's runs: <work>/check/<folder> -> (Table 1 run, flags, fir switch)
    "check": {n: (n, [], None) for n in TABLE1},
    "diagnose": {"she-complex-tf32": ("she", [], FIR_TF32), "she-no-tf32": ("she", [NO_TF32], None)},
}
CHECK_RUNS = CHECKS["check"] | CHECKS["diagnose"]
CUDA_ONLY = {"diagnose"}  # TF32 is CUDA's: elsewhere the diagnosis is skipped
# bench.py section 3's row for each run's speed (sa-1 as sa: 1 head of d or 32 of d/32, the same FLOPs)
BENCH_ROW = {"sa-1": "sa", "sa-32": "sa", **{m: m for m in ("she", "he", "we", "me")}, "me-float32": "me"}
REFERENCE = {"cuda": "bench_h200.json", "cpu": "bench_cpu.json"}  # results/table1/: Table 1's speeds
FULL = {  # the paper's settings; --smoke: tiny ones (bench.py --quick's shapes), every step in seconds
    "train": [], "max_iters": 60000, "dtype_iters": 1000, "tests": ["-m", "not slow"], "bench": [],
    "step_limit": "9m", "margin": "1m", "min_step": "1m", "results_time": "30s", "work": "out/gpu",
    "results": "results/gpu",
}  # fmt: skip
SMOKE = {  # min_step: the least budget a step starts with; results_time: kept for the results at the end
    "train": "--n_layer 1 --block_size 32 --n_embd 32 --n_hidden 128 --batch_size 4 --eval_batches 2 "
    "--eval_interval 50 --log_interval 50".split(),
    "max_iters": 100, "dtype_iters": 30, "tests": ["-k", "test_forward_loss_is_eq3"],
    "bench": ["--quick", "--mixers", "me"], "step_limit": "3m", "margin": "1s", "min_step": "5s",
    "results_time": "3s", "work": "out/gpu-smoke", "results": "out/gpu-smoke/results",
}  # fmt: skip
DURATIONS = ("--budget", "--step_limit", "--margin")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", default="auto", help="auto (cuda, then mps, then cpu; default), cuda:1, mps, cpu"
    )
    p.add_argument(
        "--results", help="figures, CSVs, tables, logs (results/gpu; --smoke: out/gpu-smoke/results)"
    )
    p.add_argument(
        "--work", help="run folders with checkpoints, state.json (out/gpu; --smoke: out/gpu-smoke)"
    )
    p.add_argument("--data_dir", default="data", help="prepare_data.py's folder (data)")
    p.add_argument("--budget", default=None, help="stop cleanly before this much time: 40m, 2h, 90s (none)")
    p.add_argument("--step_limit", default=None, help="the longest step (default 9m; --smoke: 3m)")
    p.add_argument("--margin", default=None, help="budget kept for the last checkpoint (1m; --smoke: 1s)")
    p.add_argument("--max_iters", type=int, default=None, help="batches per Table 1 run (default 60000)")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="Table 1 runs side by side (1; 6 on an H200: about twice the batches of 1 at a time)",
    )
    p.add_argument("--steps", default=None, help="only these steps: a comma list of the plan's names (all)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny settings and a few tests: every step in seconds"
    )
    p.add_argument("--dry_run", action="store_true", help="print the plan and its estimates, do nothing")
    p.add_argument(
        "--pack", help="after every step, all of --results as this one .tar.gz too (a path outside --results)"
    )
    return one_line_errors(p, "gpu.py")


def seconds(text, flag, zero=False):
    """'40m', '2h', '1h30m', '90s' or '90' -> seconds; one clear line if it is none of these, or if it
    is negative or (unless zero) 0."""
    parts = re.fullmatch(
        r"(-?)(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip()
    )
    if not text.strip().lstrip("-") or not parts:
        fail(f"{flag} {text!r} is not a duration; write it like 40m, 2h, 1h30m or 90s")
    minus, *hms = parts.groups()
    h, m, s = (float(x or 0) for x in hms)
    if minus or not (zero or 3600 * h + 60 * m + s):
        fail(f"{flag} {text!r} must be more than 0{' (or 0)' * zero}; write it like 40m, 2h, 1h30m or 90s")
    return 3600 * h + 60 * m + s


def with_negative_durations(argv):
    """'--budget -5m' as '--budget=-5m': argparse reads -5m as an option ("expected one argument")."""
    out = []
    for a in argv:
        if out and out[-1] in DURATIONS and a.startswith("-"):
            out[-1] += "=" + a
        else:
            out.append(a)
    return out


def settings(argv):
    """The parsed flags, with the FULL or SMOKE defaults filled in and every duration in seconds."""
    args = build_parser().parse_args(with_negative_durations(argv))
    preset = SMOKE if args.smoke else FULL
    args.train, args.dtype_iters = preset["train"], preset["dtype_iters"]
    args.tests, args.bench = preset["tests"], preset["bench"]
    args.work, args.results = args.work or preset["work"], args.results or preset["results"]
    args.max_iters = preset["max_iters"] if args.max_iters is None else args.max_iters
    args.step_limit = seconds(args.step_limit or preset["step_limit"], "--step_limit")
    args.margin = seconds(args.margin or preset["margin"], "--margin", zero=True)
    args.min_step, args.results_time = seconds(preset["min_step"], ""), seconds(preset["results_time"], "")
    args.budget = None if args.budget is None else seconds(args.budget, "--budget")
    asked, args.steps = args.steps and args.steps.split(","), None
    names = plan(args)
    if set(asked or ()) - set(names):
        fail(f"--steps {','.join(set(asked) - set(names))}: no such step; pick from {','.join(names)}")
    args.steps = asked or names
    if args.max_iters < 1 or args.parallel < 1:
        fail("--max_iters and --parallel must be positive")
    if args.pack and os.path.abspath(args.pack).startswith(os.path.join(os.path.abspath(args.results), "")):
        fail(f"--pack {args.pack} is inside --results {args.results}; put it elsewhere")
    if not args.dry_run and not os.path.isfile(os.path.join(args.data_dir, "train.bin")):
        fail(f"no {args.data_dir}/train.bin: run python prepare_data.py first, or pass --data_dir")
    return args


# ------------------------------------------------------------------------------ what exists so far


def load_state(work, device, preset):
    """<work>/state.json: what the tests and bench steps did, kept only for the same device and preset
    (the tests of another device, or a --smoke call's, are not this call's); one line if it is not what
    gpu.py writes."""
    path, fresh = os.path.join(work, "state.json"), {"device": device, "preset": preset}
    if not os.path.exists(path):
        return fresh
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        why = None if well_formed(state) else "not what gpu.py writes"
    except (OSError, ValueError) as e:  # cut short, not JSON, not text
        why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    if why:
        fail(f"cannot read {path} ({why}); delete it to run the tests and bench again (the runs are kept)")
    same = (state.get("device"), state.get("preset")) == (device, preset)
    return state if same else fresh


def well_formed(state):
    """Whether state is {"device", "preset", "tests", "bench"}, each step {"done", "summary", "seconds"}."""
    kinds = {"done": bool, "summary": str, "seconds": (int, float)}
    steps = [state[k] for k in ("tests", "bench") if k in state] if isinstance(state, dict) else [None]
    return all(isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in kinds.items()) for s in steps)


def save_state(work, state):
    atomic_write(os.path.join(work, "state.json"), json.dumps(state, indent=1))


def model_settings(args, name):
    """The model this call trains for a run, as train.py's checkpoint records it (its config, less the
    vocabulary): Table 1 (extractor.Config's defaults) with the run's and the preset's flags."""
    from extractor import Config

    flags = [*RUNS[name], *args.train]
    given = dict(zip(flags[::2], flags[1::2]))  # every flag here has a value
    fields = [f for f in dataclasses.fields(Config) if f.name != "vocab_size"]
    return {f.name: type(f.default)(given.get(f"--{f.name}", f.default)) for f in fields}


def batches_done(args, name):
    """The batch the run's checkpoint holds (0 for none): where --resume continues. One line if it
    cannot be read, or if it holds another model than this call trains: a real call never resumes a
    --smoke run's tiny model as a Table 1 run, nor the other way round."""
    import torch

    run_dir = os.path.join(args.work, name)
    path = os.path.join(run_dir, "ckpt.pt")
    if not os.path.exists(path):
        return 0
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        at, config = int(ckpt["iter"]), dict(ckpt["config"])
    except Exception as e:  # cut short, or not train.py's
        fail(
            f"cannot read {path} ({type(e).__name__}); it is damaged: delete {run_dir} to train {name} again"
        )
    want = model_settings(args, name)
    other = "; ".join(f"{k} {config.get(k)}, not {v}" for k, v in want.items() if config.get(k) != v)
    if other:
        made = "without" if args.smoke else "with"
        fail(f"{path} is not the model this call trains ({other}): made {made} --smoke? pick another --work")
    return at


def read_log(run_dir):
    """A run's log.csv (or log.csv.gz, as results/logs/ keeps it) as rows of text; [] if it has none."""
    path = os.path.join(run_dir, "log.csv")
    path += ".gz" * (not os.path.exists(path) and os.path.exists(path + ".gz"))
    if not os.path.exists(path):
        return []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def seconds_per_batch(args, name):
    """From the run's own log.csv, else from bench.py section 3 (its Table 1 model): this device's
    (bench.json in the results), else at Table 1's sizes the one in results/table1/ (an H200's or a
    CPU's); else None."""
    rows = read_log(os.path.join(args.work, name))
    if rows:
        return float(rows[-1]["elapsed_s"]) / int(rows[-1]["iter"])
    benches = [os.path.join(args.results, "bench.json")]
    if not args.smoke and args.device.split(":")[0] in REFERENCE:
        benches.append(os.path.join(ROOT, "results", "table1", REFERENCE[args.device.split(":")[0]]))
    for bench in filter(os.path.exists, benches if name in BENCH_ROW else []):
        model = json.load(open(bench))["sections"].get("model", [])
        times = [r["step_ms"] / 1000 for r in model if r["mixer"] == BENCH_ROW[name]]
        if times:
            return times[0]  # the first model is the deepest, Table 1's m = 18
    return None


# ------------------------------------------------------------------------------ the plan


def plan(args):
    """The steps' names in PLAN's order (of --steps only, once it is known)."""
    names = [n for entry in PLAN for n in ([entry] if isinstance(entry, str) else entry)]
    return [n for n in names if not args.steps or n in args.steps]


def skipped(args, name):
    """Whether the step is one this device skips: the diagnosis of TF32, elsewhere than CUDA."""
    return name in CUDA_ONLY and not args.device.startswith("cuda")


def target(args, name):
    """The batches a run trains to."""
    return args.dtype_iters if name in DTYPES else args.max_iters


def command(args, name):
    if name == "tests":
        return f"TEST_DEVICE={args.device} python -m pytest tests.py -q {shlex.join(args.tests)}".strip()
    if name in CHECKS:
        return f"train.py {' '.join(CHECK_FLAGS)}: {', '.join(CHECKS[name])}"
    return "bench.py --sections 1,3,6" if name == "bench" else "train.py " + " ".join(RUNS[name])


def check_estimate(args, name):
    """The check's or the diagnosis's runs, one after another at this device's speeds (None if unknown)."""
    per = [seconds_per_batch(args, run) for run, _, _ in CHECKS.get(name, {}).values()]
    return CHECK_ITERS * sum(per) if per and None not in per else None


def progress(args, state):
    """A line per step: done or not, how far, how long what is left should take here; then the total."""
    lines, total, unknown = [], 0.0, False
    for name in plan(args):
        if skipped(args, name):
            lines.append(f"  [-] {name:<12} {'skipped':>8}  {command(args, name)}: on CUDA only (TF32)")
            continue
        if name not in RUNS:
            was = state.get(name, {})  # a step that failed or was cut took at least its seconds
            done, how = was.get("done", False), was.get("summary", "not run yet")
            left = was.get("seconds", check_estimate(args, name))
        else:
            at, goal, per = batches_done(args, name), target(args, name), seconds_per_batch(args, name)
            done, left, how = at >= goal, None if per is None else (goal - at) * per, f"batch {at} of {goal}"
        if not done:
            total += left or 0.0
            unknown |= left is None
        eta = "done" if done else "unknown" if left is None else fmt_time(left)
        lines.append(f"  [{'x' if done else ' '}] {name:<12} {eta:>8}  {command(args, name)}: {how}")
    rest = " + ".join([fmt_time(total)] * (total > 0) + ["unknown"] * unknown) or "nothing"
    side = f", Table 1 runs {args.parallel} side by side (estimate: one after another)" * (args.parallel > 1)
    return "\n".join(lines + [f"  left: {rest}{side}"])


def next_step(args, state, tried):
    """The next step's runs (or its one name: check, diagnose, tests, bench), or None when all is done
    (or, a named step, tried this call or skipped on this device)."""
    for entry in PLAN:
        if isinstance(entry, str):
            todo = entry in args.steps and not skipped(args, entry) and entry not in tried
            if todo and not state.get(entry, {}).get("done"):
                return [entry]
            continue
        at = {n: batches_done(args, n) for n in entry if n in args.steps}
        left = sorted((a, i, n) for i, (n, a) in enumerate(at.items()) if a < target(args, n))
        if left:  # least trained first
            return [n for _, _, n in left[: args.parallel]]
    return None


# ------------------------------------------------------------------------------ children live and die with it


class Stopped(Exception):
    """A stop signal (SIGINT, SIGTERM, SIGHUP): raised between steps at once, during one once its
    children have stopped."""


STOP = {"signal": None, "count": 0, "in_step": False}


def on_stop(signum, frame):
    STOP["signal"], STOP["count"] = STOP["signal"] or signum, STOP["count"] + 1
    if not STOP["in_step"]:
        raise Stopped(STOP["signal"])


@contextlib.contextmanager
def stop_signals():
    """Ctrl-C, kill and a closed terminal stop gpu.py (on_stop, wait()); nohup's SIGHUP stays ignored."""
    STOP.update(signal=None, count=0, in_step=False)
    old = {}
    for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        with contextlib.suppress(ValueError, TypeError):  # not the main thread, or no such signal here
            if signal.getsignal(s) is not signal.SIG_IGN:
                old[s] = signal.signal(s, on_stop)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def lock_folders(folders):
    """An exclusive OS lock on each folder (made if need be; the lock is on the folder itself, no file is
    written), held by gpu.py and passed to its children: no second gpu.py starts on these folders until
    the first and every child of it has ended. Returns the open descriptors (none without fcntl)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here
        return []
    fds = []
    for folder in dict.fromkeys(os.path.realpath(f) for f in folders):
        os.makedirs(folder, exist_ok=True)
        fds.append(os.open(folder, os.O_RDONLY))
        try:
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            for fd in fds:
                os.close(fd)
            fail(f"another gpu.py (or a train.py it started) is running on {folder}; wait for it to end")
    return fds


def die_with_parent():
    """Linux: a preexec_fn by which the kernel sends the child SIGTERM when gpu.py ends, even by kill -9
    (train.py then checkpoints and stops). Elsewhere None: the children of a killed gpu.py run on."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent, PR_SET_PDEATHSIG = ctypes.CDLL(None).prctl, os.getpid(), 1  # from <linux/prctl.h>

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # gpu.py ended before that
            os._exit(1)

    return preexec


def launch(args, cmd, log_path, env=None):
    """The child in a process group of its own (a stop reaches the processes it starts too), holding
    gpu.py's folder locks and ended with it."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        env = {**os.environ, **(env or {})}
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            pass_fds=args.locks, preexec_fn=die_with_parent(),
        )  # fmt: skip


def kill_group(p, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def mtime(path):
    return os.stat(path).st_mtime_ns if os.path.exists(path) else None


def wait(procs, deadline, hard_end, ckpts=None):
    """Wait for the processes. SIGTERM each at the deadline once it has written a checkpoint since it
    started (ckpts: its ckpt.pt, None if it has none to write), or at once on a stop signal; SIGKILL at
    hard_end, or on a second stop signal. Their exit codes."""
    start_mtimes = [mtime(c) if c else None for c in ckpts or [None] * len(procs)]
    asked = [False] * len(procs)
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        for i, p in enumerate(procs):
            saved = not ckpts or mtime(ckpts[i]) != start_mtimes[i]
            if p.poll() is None and not asked[i] and (STOP["signal"] or (now >= deadline and saved)):
                kill_group(p, signal.SIGTERM)
                asked[i] = True
            if p.poll() is None and (now >= hard_end or STOP["count"] > 1):
                kill_group(p, signal.SIGKILL)
        time.sleep(0.05)  # a tiny model trains some 20 batches in this time
    return [p.returncode for p in procs]


def start_and_wait(args, cmds, deadline, hard_end, ckpts=None, env=None):
    """Start these (command, log) pairs and wait() for them; meanwhile a stop signal goes to them."""
    procs = []
    STOP["in_step"] = True
    try:
        procs += [launch(args, cmd, log, env) for cmd, log in cmds]
        return wait(procs, deadline, hard_end, ckpts)
    finally:
        STOP["in_step"] = False
        for p in procs:  # only if gpu.py itself failed in the step
            if p.poll() is None:
                kill_group(p, signal.SIGKILL)


# ------------------------------------------------------------------------------ running a step


def tests_step(args, deadline, hard_end):
    cmd = [sys.executable, "-m", "pytest", os.path.join(ROOT, "tests.py"), "-q", *args.tests]
    out = os.path.join(args.results, "tests.txt")
    open(out, "w").close()
    (rc,) = start_and_wait(args, [(cmd, out)], deadline, hard_end, env={"TEST_DEVICE": args.device})
    last = [line for line in open(out).read().splitlines() if line.strip()][-1:]
    return rc == 0, f"pytest exit {rc}: {last[0] if last else 'no output'}"


def bench_step(args, deadline, hard_end):
    out, table = os.path.join(args.results, "bench.txt"), os.path.join(args.results, "bench.json")
    cmd = [sys.executable, os.path.join(ROOT, "bench.py"), "--device", args.device, "--sections", "1,3,6"]
    open(out, "w").close()
    (rc,) = start_and_wait(args, [([*cmd, *args.bench, "--json", table], out)], deadline, hard_end)
    return rc == 0, f"bench.py exit {rc}: tables in {out}"


def train_cmd(args, run_dir, flags, device, switch=None):
    """train.py's command line for a run, or with fir.py's switch set first (python -c '...; fir.<switch>
    = True; train.main(...)'): the flags, then the run folder, the data and the device."""
    flags = [*flags, "--out_dir", run_dir, "--data_dir", args.data_dir, "--device", device]
    if switch is None:
        return [sys.executable, os.path.join(ROOT, "train.py"), *flags]
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); import fir, train\n"
        f"if not hasattr(fir, {switch!r}): sys.exit('fir.py has no {switch}: rename gpu.FIR_TF32')\n"
        f"fir.{switch} = True\nsys.exit(train.main(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code, *flags]


def console(args, run_dir):
    """Where a run's train.py writes its console: <results>/logs/<the run folder under --work>.txt."""
    return os.path.join(args.results, "logs", os.path.relpath(run_dir, args.work) + ".txt")


def train_step(args, names, deadline, hard_end):
    """One step of these runs side by side: each from its checkpoint (--resume) towards its target."""
    cmds, ckpts = [], []
    for name in names:
        run_dir = os.path.join(args.work, name)
        ckpts.append(os.path.join(run_dir, "ckpt.pt"))
        flags = [*RUNS[name], *args.train, "--max_iters", str(target(args, name))]
        flags += ["--resume"] * os.path.exists(ckpts[-1])  # none yet: a fresh start
        cmds.append((train_cmd(args, run_dir, flags, args.device), console(args, run_dir)))
    return start_and_wait(args, cmds, deadline, hard_end, ckpts)


def cpu_logs(args):
    """The check's CPU logs: the committed CPU runs'; --smoke: the same tiny runs on the CPU, trained once
    into <work>/check-cpu (on the CPU itself, the check's own runs)."""
    if not args.smoke:
        return os.path.join(ROOT, "results", "logs", "table1-cpu")
    return os.path.join(args.work, "check" if args.device == "cpu" else "check-cpu")


def check_step(args, deadline, hard_end, step="check"):
    """The check (or the diagnosis): its runs trained afresh, --parallel side by side (with --smoke on a
    GPU also the CPU's runs of the same tiny models, once), then judged."""
    jobs = [(n, os.path.join(args.work, "check", n), args.device) for n in CHECKS[step]]
    if args.smoke and args.device != "cpu":  # first the CPU's runs it lacks
        cpu = {run: os.path.join(cpu_logs(args), run) for run, _, _ in CHECKS[step].values()}
        jobs = [(run, d, "cpu") for run, d in cpu.items() if not read_log(d)] + jobs
    for i in range(0, len(jobs), args.parallel):
        if i and time.monotonic() >= deadline:
            break
        cmds, ckpts = [], []
        for name, run_dir, device in jobs[i : i + args.parallel]:
            run, more, switch = CHECK_RUNS[name]
            flags = [*TABLE1[run], *args.train, *CHECK_FLAGS, *more, "--overwrite"]
            cmds.append((train_cmd(args, run_dir, flags, device, switch), console(args, run_dir)))
            ckpts.append(os.path.join(run_dir, "ckpt.pt"))
        start_and_wait(args, cmds, deadline, hard_end, ckpts)
    done, summary = judge(args, step)
    if step == "diagnose":  # the float32 device test as the H200 runs computed: expected to fail
        done_tf32, said = tf32_test(args, deadline, hard_end)
        return done and done_tf32, f"{summary}; {said}"
    return done, summary


def tf32_test(args, deadline, hard_end):
    """The FIR's float32-accuracy test on the device with fir.ALLOW_TF32 = True (its products in TF32, as
    before the fix): it should fail where TF32 reaches them, and passes in the tests step without the
    switch. Into <results>/diagnose_tests.txt: (ran, summary)."""
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); import fir, pytest; fir.ALLOW_TF32 = True\n"
        f"sys.exit(pytest.main([{os.path.join(ROOT, 'tests.py')!r}, '-q', '-p', 'no:cacheprovider', "
        "'-k', 'float32_with_tf32', '--tb=line']))"
    )
    out = os.path.join(args.results, "diagnose_tests.txt")
    open(out, "w").close()
    cmd = ([sys.executable, "-c", code], out)
    (rc,) = start_and_wait(args, [cmd], deadline, hard_end, env={"TEST_DEVICE": args.device})
    last = [line for line in open(out).read().splitlines() if line.strip()][-1:]
    said = f"with fir.ALLOW_TF32 = True the float32 test: {last[0] if last else 'no output'}"
    return rc in (0, 1), said  # 1: some failed, as expected where TF32 reaches the FIR


def judge(args, step):
    """The windows table of the step's runs against the CPU's logs, printed and written to <results>/
    <step>.csv and .txt: (passed, summary). The check passes if every window of every run is within
    TOLERANCE; the diagnosis once its runs are complete (beside them the check's SHE, if it has run)."""
    names = list(CHECKS[step])
    if step == "diagnose" and read_log(os.path.join(args.work, "check", "she")):
        names.insert(0, "she")  # train.py's defaults
    gaps = {}
    for name in names:
        cpu = read_log(os.path.join(cpu_logs(args), CHECK_RUNS[name][0]))
        gaps[name] = window_gaps(read_log(os.path.join(args.work, "check", name)), cpu)
    text, table = windows_table(gaps)
    head = (
        f"{step}: training cost, mean of each {WINDOW}-batch window, {args.device} minus the CPU's log in "
        f"{os.path.relpath(cpu_logs(args))}; a run passes with every |gap| <= {TOLERANCE}"
    )
    how = []
    for name in names:
        run, more, switch = CHECK_RUNS[name]
        with_switch = f" with fir.{switch} = True" if switch else ""
        how.append(f"  {name}: train.py {' '.join([*TABLE1[run], *CHECK_FLAGS, *more])}{with_switch}")
    atomic_write(os.path.join(args.results, f"{step}.csv"), table)
    atomic_write(
        os.path.join(args.results, f"{step}.txt"), "\n".join([head, *text, "The runs:", *how]) + "\n"
    )
    print("\n".join("   " + line for line in [head, *text]))
    said = {n: "incomplete" if worst(g) is None else f"{worst(g):.4f}" for n, g in gaps.items()}
    where = f"{args.results}/{step}.txt"
    if step == "check":
        over = [f"{n} {said[n]}" for n, g in gaps.items() if worst(g) is None or worst(g) > TOLERANCE]
        verdict = f"failed: {', '.join(over)}" if over else f"passed: every window within {TOLERANCE}"
        return not over, f"{verdict} ({where})"
    largest = ", ".join(f"{n} {w}" for n, w in said.items())
    return "incomplete" not in said.values(), f"largest |gap|: {largest} ({where})"


def window_gaps(log, cpu):
    """The mean training cost of each WINDOW batches of 1..CHECK_ITERS, a log's minus the CPU's (rows of
    log.csv); None for a window that either log lacks a batch of."""

    def means(rows):
        loss = {int(r["iter"]): float(r["train_loss"]) for r in rows}
        spans = [range(a, a + WINDOW) for a in range(1, CHECK_ITERS + 1, WINDOW)]
        return [sum(loss[i] for i in s) / WINDOW if all(i in loss for i in s) else None for s in spans]

    return [None if None in (a, b) else a - b for a, b in zip(means(log), means(cpu))]


def worst(gaps):
    """The largest |gap| of a run's windows; None if it lacks one."""
    return None if None in gaps else max(map(abs, gaps))


def windows_table(gaps):
    """{run: window_gaps} as text lines and as CSV: a column per window, then the largest |gap|."""
    heads = [f"{a}-{a + WINDOW - 1}" for a in range(1, CHECK_ITERS + 1, WINDOW)]
    text = [f"{'run':<17}" + "".join(f"{h:>8}" for h in heads) + "  max|gap|"]
    table = [["run", *heads, "max_abs_gap"]]
    for name, g in gaps.items():
        w = worst(g)
        cells = ["" if x is None else f"{round(x, 4) + 0:+.4f}" for x in g]  # (+ 0: no -0.0000)
        cells.append("" if w is None else f"{w:.4f}")
        verdict = " incomplete" if w is None else f" over {TOLERANCE}" * (w > TOLERANCE)
        text.append(f"{name:<17}" + "".join(f"{c or '-':>8}" for c in cells) + verdict)
        table.append([name, *cells])
    return text, "".join(",".join(row) + "\n" for row in table)


# ------------------------------------------------------------------------------ results after every step


def plot(args, name, *argv):
    """plot.py's command line in this process; its table goes to <results>/<name>.txt."""
    import plot as plot_py

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        rc = plot_py.main(list(argv))
    atomic_write(os.path.join(args.results, f"{name}.txt"), text.getvalue())
    if rc:
        print(f"  {name}: plot.py failed, see {args.results}/{name}.txt")


def dtype_table(args):
    """dtype.csv: float32 against bfloat16, the mean training cost of the last 100 batches, the last
    validation loss and the median tokens/s."""
    lines = ["run,batches,train_loss_last100,val_loss,tokens_per_s"]
    for name in DTYPES:
        rows = read_log(os.path.join(args.work, name))
        if rows:
            loss = [float(r["train_loss"]) for r in rows[-100:]]
            val = [r["val_loss"] for r in rows if r["val_loss"]][-1:] or [""]
            speed = sorted(float(r["tokens_per_s"]) for r in rows)[len(rows) // 2]
            lines.append(f"{name},{len(rows)},{sum(loss) / len(loss):.4f},{val[0]},{speed:.0f}")
    atomic_write(os.path.join(args.results, "dtype.csv"), "\n".join(lines) + "\n")


def gzip_bytes(data):
    """gzip without a time stamp, so the same log packs to the same bytes."""
    return gzip.compress(data, mtime=0)


def write_results(args, state):
    """The runs' log.csv (as log.csv.gz) and run.json, the check's runs' too (runs/check/), Figure 8 with
    its CSVs, Figure 9, dtype.csv and progress.txt; with --pack, all of it into that one file."""
    runs = [n for n in [*RUNS, *(f"check/{c}" for c in CHECK_RUNS)] if read_log(os.path.join(args.work, n))]
    for name in runs:  # the logs kept as results/logs/ keeps them: log.csv.gz (plot.py reads it) and run.json
        os.makedirs(os.path.join(args.results, "runs", name), exist_ok=True)
        for f, pack in (("log.csv", gzip_bytes), ("run.json", bytes)):
            with contextlib.suppress(FileNotFoundError), open(os.path.join(args.work, name, f), "rb") as src:
                dest = os.path.join(args.results, "runs", name, f + (".gz" if pack is gzip_bytes else ""))
                atomic_write(dest, pack(src.read()))
    fig8 = [os.path.join(args.work, n) for n in TABLE1 if n in runs]
    if fig8:
        plot(args, "fig8", *fig8, "--results", args.results, "-o", os.path.join(args.results, "fig8.png"))
    fig9 = [os.path.join(args.work, n) for n in FIG9 if n in runs]
    if fig9:
        plot(args, "fig9", *fig9, "--raw", "-o", os.path.join(args.results, "fig9.png"))
    dtype_table(args)
    atomic_write(os.path.join(args.results, "progress.txt"), f"{state['device']}\n{progress(args, state)}\n")
    if args.pack:
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w:gz") as tar:
            tar.add(args.results, arcname=os.path.basename(os.path.abspath(args.results)))
        atomic_write(args.pack, packed.getvalue())


# ------------------------------------------------------------------------------ the loop


STEPS = {  # PLAN's named steps: (args, deadline, hard_end) -> (done, summary)
    "check": check_step, "diagnose": functools.partial(check_step, step="diagnose"),
    "tests": tests_step, "bench": bench_step,
}  # fmt: skip
FINE = (0, 128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL)  # done, or stopped by wait()


def run(args):
    start = time.monotonic()
    end = start + args.budget if args.budget else float("inf")
    args.locks = [] if args.dry_run else lock_folders([args.work, args.results])
    try:
        return steps(args, start, end)
    finally:
        for fd in args.locks:
            os.close(fd)


def steps(args, start, end):
    """The plan, then its steps until all is done or the budget is spent."""
    args.device, named = describe(args.device)
    state = load_state(args.work, named, "smoke" if args.smoke else "full")
    table = progress(args, state)  # (a run folder of other settings is refused here, before any output)
    print(f"gpu.py on {named}: results in {args.results}, runs in {args.work}")
    budget = fmt_time(args.budget) if args.budget else "none"
    print(f"step limit {fmt_time(args.step_limit)}, budget {budget}; time left from each run's own log.csv,")
    print("else from bench.py section 3 (this device's, else results/table1/'s), else unknown:")
    print(table, flush=True)
    if args.dry_run:
        return 0
    tried, results_time = set(), args.results_time  # the longest the results took, kept at the end
    while names := next_step(args, state, tried):
        step = " ".join(names)
        left = end - time.monotonic() - args.margin - results_time
        if left < args.min_step:
            print(f"budget spent: stopped before {step}; run the same command again to go on")
            return 0
        t0 = time.monotonic()
        deadline, hard_end = t0 + min(args.step_limit, left), end - results_time
        print(f"-- {step}, until {fmt_time(deadline - start)} into this call", flush=True)
        if names[0] in RUNS:
            codes = train_step(args, names, deadline, hard_end)
            print("   " + ", ".join(f"{n} at batch {batches_done(args, n)}" for n in names))
            if any(c not in FINE for c in codes):
                print(f"   train.py failed (exit codes {codes}); see {args.results}/logs/; stopping")
                return 1
        else:
            tried.add(step)
            done, summary = STEPS[step](args, deadline, hard_end)
            state[step] = {"done": done, "summary": summary, "seconds": round(time.monotonic() - t0, 1)}
            print(f"   {summary}")
        save_state(args.work, state)
        t1 = time.monotonic()
        write_results(args, state)
        results_time = max(results_time, time.monotonic() - t1)
        if STOP["signal"]:
            raise Stopped(STOP["signal"])
        print(f"   after {fmt_time(time.monotonic() - start)}:\n{progress(args, state)}", flush=True)
    failed = [n for n in STEPS if n in args.steps and not skipped(args, n) and not state[n]["done"]]
    if failed:
        print(f"failed: {', '.join(failed)} (see {args.results}); the next call runs them again")
    else:
        print("nothing left to do")
    return 1 if failed else 0


def describe(device):
    """The device as train.py, bench.py and TEST_DEVICE take it (cuda:0), and with the GPU's name."""
    import torch

    d = pick_device(device)
    return str(d), f"{d} ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else str(d)


def main(argv=None):
    plain_output()
    try:
        with stop_signals():
            return run(settings(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return e.code
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.args[0] if isinstance(e, Stopped) else signal.SIGINT
        name = signal.Signals(signum).name
        print(f"{name}: gpu.py stopped, its runs at their last checkpoint; run the same command to go on")
        return 128 + signum
    except OSError as e:
        where = e.filename or "a result"
        msg = f"error: cannot write {where} ({e.strerror}); pick another --results or --work"
        print(msg, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
