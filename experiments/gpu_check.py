"""
A short GPU job in one command: each stage a subprocess under its own time limit, its
output written under OUT as it runs, so that a stage that fails or runs out of time is
recorded, the next one runs and what ran before stays; the table of the stages last.

    python3 experiments/gpu_check.py OUT --data_dir data    # a GPU: 9 minutes at most
    python experiments/gpu_check.py --dry-run OUT --data_dir data   # the CPU, tiny

The stages, their limits and the minutes expected on an H200 (from the eager steps of
results/table1/bench_h200.txt: sa-32 27 ms, she 42 ms, me 32 ms):
  versions          30 s  0.1  python, torch, CUDA, cuDNN, the card, nvidia-smi -L
  device_tests      90 s  0.5  TEST_DEVICE=cuda pytest -m device (11 tiny tests)
  steps            120 s  0.5  sa-1, sa-32, she, me at Table 1's shapes, each eager,
                               eager again and captured: 23 steps (bit for bit?), then
                               40 timed; ~16 s of steps, the rest starting up
  capture_failure   30 s  0.2  a step calling .item() inside machinery.CapturedStep
  check            120 s  1    reproduce.py --check: six models x 100 batches at once
  bench            130 s  1.5  bench.py --device cuda: sublayer, step, memory
  length            50 s  0.5  bench.py --sections length (l = 32 .. 4096), if there
~4 minutes in all. Under OUT, 7 files: summary.txt (the versions, the table),
device_tests.txt, steps.txt, capture_failure.txt, check.txt (reproduce's output, which
ends with its results/gpu/check.txt), bench_<card>.txt (length's after it) and
bench_<card>.json. --dry-run runs every stage on the CPU at tiny shapes in seconds;
there the captured step, CUDA's events and reserved memory are skipped with a note.
"""

import argparse
import functools
import gc
import glob
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import machinery  # noqa: E402
import train  # noqa: E402
from extractor import Config  # noqa: E402

STAGES = {  # name: (its time limit in seconds, the file under OUT it writes)
    "versions": (30, "summary.txt"),
    "device_tests": (90, "device_tests.txt"),
    "steps": (120, "steps.txt"),
    "capture_failure": (30, "capture_failure.txt"),
    "check": (120, "check.txt"),
    "bench": (130, "bench_{card}.txt"),
    "length": (50, "bench_{card}.txt"),
}
TOTAL_S = 580  # the whole command's limit: a device's command runs 600 s at most
MODELS = {"sa-1": ["--mixer=sa", "--n_head=1"], "sa-32": ["--mixer=sa"]}
MODELS |= {mixer: [f"--mixer={mixer}"] for mixer in ("she", "me")}
DRY = "--n_layer=1 --block_size=16 --n_embd=16 --n_hidden=32 --batch_size=4 --n_head=4"
# the dry run's check: reproduce.py's, of a tiny me, any gap passing (not Table 1's)
DRY_CHECK = """import sys; sys.path.insert(0, "experiments"); import reproduce
reproduce.RUNS = {"me": reproduce.RUNS["me"] + sys.argv[1].split()}
reproduce.TOLERANCE = float("inf")
sys.exit(reproduce.main(sys.argv[2:]))"""


# ---- the stages that run in this script ----------------------------------------------
def stage_versions(a):
    print(f"python {platform.python_version()}, torch {torch.__version__}", end="")
    print(f", CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = (b / 2**30 for b in torch.cuda.mem_get_info(i))
        print(f"cuda:{i} {p.name}, capability {p.major}.{p.minor}, ", end="")
        print(f"{total:.1f} GiB ({free:.1f} free), {p.multi_processor_count} SMs")
    for cmd in (["nvidia-smi", "-L"], ["git", "describe", "--always", "--dirty"]):
        try:
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            print(f"$ {shlex.join(cmd)}: {(run.stdout + run.stderr).strip()}")
        except OSError as e:
            print(f"$ {shlex.join(cmd)}: {e.strerror}")


def setup(a, flags, device):
    """train.py's settings (Table 1's, tiny if dry) with flags, its model, AdamW and
    step (not made captured) for them, and their batch(i)."""
    parser = machinery.build_parser(train.SETTINGS)
    dry = DRY.split() if a.dry_run else []
    targs = parser.parse_args([*dry, *flags, f"--data_dir={a.data_dir}"])
    data, _, fingerprint = machinery.load_data(
        a.data_dir, targs.block_size, targs.batch_size
    )
    settings = {f.name: getattr(targs, f.name) for f in train.MODEL_SETTINGS}
    cfg = Config(vocab_size=fingerprint["vocab_size"], **settings)
    ctx, scaler = machinery.precision(device, targs.dtype, targs.tf32)
    model, optimizer = train.build_model(cfg, targs, device)
    step = functools.partial(
        train.train_step, model, optimizer, scaler, ctx, grad_clip=targs.grad_clip
    )

    def batch(i):
        n_starts = len(data) - targs.block_size
        starts = train.batch_starts(i, n_starts, targs.batch_size, targs.data_seed)
        return train.get_batch(data, starts, targs.block_size, device)

    return targs, model, optimizer, step, batch


def run_model(a, flags, device, captured, n):
    """A model trained on batches 0 .. n + 2 by the step train.py makes (captured: its
    default on CUDA; else as --no-cuda_graph): the step's name, losses, parameters."""
    if device.type == "cuda":  # (the model before and its graph freed)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    targs, model, optimizer, step, batch = setup(a, flags, device)
    targs.cuda_graph, how = captured, {}
    step = machinery.make_step(step, optimizer, targs, device, how)
    losses = torch.stack([step(*batch(i)) for i in range(n + 3)]).cpu()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    return dict(how=how["step"], losses=losses, params=params, step=step, batch=batch)


def timing(run, n, device):
    """The step's time on the GPU (CUDA events, median of n), how far ahead of the GPU
    the host is once it queued n steps, the peaks of memory allocated and reserved."""
    if device.type != "cuda":
        return "times and memory: CUDA's only"
    events = []  # (start, end) of each step
    for i in range(n):
        x, y = run["batch"](i)
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)  # (timing them)
        start.record()
        run["step"](x, y)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    t0 = time.perf_counter()
    for i in range(n):
        run["step"](*run["batch"](i))
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    done = time.perf_counter() - t0
    allocated = torch.cuda.max_memory_allocated(device) / 2**20
    reserved = torch.cuda.max_memory_reserved(device) / 2**20
    return (
        f"step {ms:.2f} ms (CUDA events, median of {n}); {n} steps queued by the host"
        f" in {queued * 1e3:.0f} ms, done at {done * 1e3:.0f} ms (the host"
        f" {(done - queued) * 1e3 / ms:.1f} steps ahead); peak memory allocated"
        f" {allocated:.0f} MiB, reserved {reserved:.0f} MiB"
    )


def compare(ref, run):
    """Whether run's losses and parameters are ref's bit for bit, else by how much."""
    pairs = [(ref["losses"], run["losses"])] + list(zip(ref["params"], run["params"]))
    differ = [(a - b).abs().max().item() for a, b in pairs if not torch.equal(a, b)]
    counts = f"{len(ref['losses'])} losses, {len(ref['params'])} parameters"
    if not differ:
        return f"bit for bit ({counts})"
    return f"DIFFER in {len(differ)} of {counts}, by up to {max(differ):.3g}"


def stage_steps(a):
    device = machinery.pick_device("cpu" if a.dry_run else "cuda")
    n = 2 if a.dry_run else 20  # steps after the 3 warm-up ones; timed: 2 n more
    shapes = DRY if a.dry_run else "Table 1's (train.py's defaults)"
    print(f"each model at {shapes}: 3 + {n} batches, then {2 * n} timed")
    for name, flags in MODELS.items():
        eager = run_model(a, flags, device, False, n)
        first, last = eager["losses"][[0, -1]].tolist()
        print(f"{name}: loss {first:.4f} -> {last:.4f}; {timing(eager, n, device)}")
        del eager["step"], eager["batch"]  # (its memory freed before the next)
        again = run_model(a, flags, device, False, n)
        print(f"  eager again against eager: {compare(eager, again)}")
        del again
        if device.type != "cuda":
            print("  captured: skipped, the capture needs CUDA")
            continue
        graph = run_model(a, flags, device, True, n)
        print(f"  {graph['how']} against eager: {compare(eager, graph)}")
        print(f"    {timing(graph, n, device)}")
        del graph


def chain(error):
    """An exception and what it came from: each one's type and first line."""
    links = []
    while error is not None and len(links) < 8:
        links.append(f"{type(error).__name__}: {str(error).strip()[:200]}")
        error = error.__cause__ or error.__context__
    return " <- ".join(links)


def stage_capture_failure(a):
    """A step that reads its loss (.item(): a sync, which CUDA refuses while it
    captures) in CapturedStep as train.py makes it: what it does, what runs after it."""
    if a.dry_run:
        print("skipped: the capture needs CUDA")
        return
    device = machinery.pick_device("cuda")
    targs, model, optimizer, step, batch = setup(
        a, ["--mixer=me", "--n_layer=2"], device
    )

    def syncing_step(x, y):
        loss = step(x, y)
        loss.item()  # the host waits for the GPU: illegal in a capture
        return loss

    how = {"step": "CapturedStep"}
    captured = machinery.CapturedStep(syncing_step, optimizer, how)
    try:
        for i in range(1, 6):  # 3 warm-up calls, the recording, a replay
            loss = captured(*batch(i)).item()
            print(f"call {i}: loss {loss:.4f}, the step: {how['step']}", flush=True)
    except BaseException as error:  # (fail()'s SystemExit: its line above)
        print(f"call {i} raised {chain(error)}")
    after = {
        "an eager step": lambda: step(*batch(9)).item(),
        "a dropout": lambda: F.dropout(torch.ones(9, device=device), 0.5).sum().item(),
        "torch.cuda.synchronize()": torch.cuda.synchronize,
    }
    for what, run in after.items():
        try:
            run()
            print(f"after it, {what}: ran")
        except Exception as error:
            print(f"after it, {what}: {chain(error)}")
    mib = [torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20]
    print("memory then: allocated {:.0f} MiB, reserved {:.0f} MiB".format(*mib))


# ---- the driver ----------------------------------------------------------------------
def card_name(dry_run):
    """The bench files' name for the card: h200 for an NVIDIA H200; cpu."""
    if dry_run:
        return "cpu"
    words = torch.cuda.get_device_name(0).replace("NVIDIA", "").split() or ["gpu"]
    word = next((w for w in words if re.search(r"\d", w)), words[0])
    return re.sub(r"[^a-z0-9]+", "-", word.lower())


def commands(a, card, tmp):
    """Each stage's command line: this script's own stage, or a project command."""
    py, dev = sys.executable, "cpu" if a.dry_run else "cuda"
    own = [py, os.path.abspath(__file__), a.out, f"--data_dir={a.data_dir}"]
    own += ["--dry-run"] * a.dry_run
    check = [f"--device={dev}", f"--data_dir={a.data_dir}", f"--work={tmp}/work"]
    check += ["--check", f"--results={tmp}/results"]
    reproduce = [py, f"{ROOT}/experiments/reproduce.py"]
    if a.dry_run:
        reproduce = [py, "-c", DRY_CHECK, DRY]
    bench = [py, f"{ROOT}/experiments/bench.py", f"--device={dev}"]
    bench += ["--quick"] * a.dry_run
    pytest = "-m pytest tests.py -m device -q -p no:cacheprovider".split()
    helps = subprocess.run([*bench, "--help"], capture_output=True, text=True).stdout
    has_length = re.search(r"\blength\b", helps)  # (bench.py's --help names it)
    return dict(
        versions=own + ["--stage=versions"],
        device_tests=[py, *pytest],
        steps=own + ["--stage=steps"],
        capture_failure=own + ["--stage=capture_failure"],
        check=reproduce + check,
        bench=bench + [f"--json={a.out}/bench_{card}.json"],
        length=bench + ["--sections=length"] if has_length else None,
    )


def run_stage(cmd, path, mode, limit, env):
    """cmd's output into path (after its command line) within limit s: its status."""
    with open(path, mode) as f:
        print(f"$ {shlex.join(cmd)}", file=f, flush=True)
        output = dict(stdout=f, stderr=subprocess.STDOUT)
        # its own session: a timeout kills its children too (reproduce.py's train.py)
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **output)
        try:
            code = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return f"timed out ({limit:.0f} s)"
    return "ok" if code == 0 else f"failed (exit {code})"


def run_all(a, t0):
    """Every stage in turn into a.out, the table of them in summary.txt after each;
    exit status 1 if one failed or ran out of time."""
    card, tmp = card_name(a.dry_run), tempfile.mkdtemp()
    os.makedirs(f"{tmp}/results")  # the check's: the committed CPU runs, its table
    os.symlink(f"{ROOT}/results/logs", f"{tmp}/results/logs")
    env = os.environ | dict(TEST_DEVICE="cpu" if a.dry_run else "cuda")
    env["PYTHONUNBUFFERED"] = "1"  # (each line in its file at once)
    cmds, head, rows, statuses = commands(a, card, tmp), "", [], []
    for name, (limit, file) in STAGES.items():
        path, start = os.path.join(a.out, file.format(card=card)), time.time()
        limit = min(limit, TOTAL_S - (start - t0))
        print(f"[{time.strftime('%X')}] {name}: into {path}, {limit:.0f} s at most")
        if limit < 5:
            status = "not run (no time left)"
        elif cmds[name] is None:
            status = "skipped (bench.py has no section length)"
        else:  # (length's after bench's in one file)
            mode = "a" if name == "length" else "w"
            status = run_stage(cmds[name], path, mode, limit, env)
        if name == "versions":
            head = open(path).read()
        if (
            name == "check"
        ):  # its train.py runs' consoles: how each computed, or why not
            consoles = sorted(glob.glob(f"{tmp}/work/check/*/console.txt"))
            with open(path, "a") as f:
                f.writelines(f"\n--- {c}\n{open(c).read()}" for c in consoles)
        statuses.append(status)
        rows.append(f"{name:16s} {time.time() - start:7.1f} {limit:5.0f}  {status}")
        print(f"[{time.strftime('%X')}] {name}: {status}", flush=True)
        table = "\n".join(["stage            seconds limit  status", *rows])
        machinery.atomic_write(f"{a.out}/summary.txt", f"{head}\n{table}\n")
    shutil.rmtree(tmp)
    print(table, flush=True)
    return 0 if all(s == "ok" or s.startswith("skipped") for s in statuses) else 1


def main(argv=None):
    t0 = time.time()  # (TOTAL_S counts from here)
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.error = lambda msg: machinery.fail(f"{msg} (see --help)")
    p.add_argument("out", help="the folder of what it measures")
    p.add_argument("--data_dir", default="data", help="prepare_data.py's folder")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny shapes")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # (a child's)
    a = p.parse_args(argv)
    a.out, a.data_dir = os.path.abspath(a.out), os.path.abspath(a.data_dir)
    if a.stage:  # one stage, in a subprocess of the driver
        if os.environ.get("GPU_CHECK_FAIL") == a.stage:  # (the test's broken stage)
            raise RuntimeError(f"GPU_CHECK_FAIL={a.stage}: this stage fails on purpose")
        return globals()[f"stage_{a.stage}"](a)
    if not a.dry_run and not torch.cuda.is_available():
        machinery.fail("no CUDA device here: pass --dry-run to try it on the CPU")
    machinery.load_data(a.data_dir, 1, 1)  # one line now if it is not prepared data
    if os.path.isfile(a.out):
        machinery.fail(f"{a.out} is a file: pass a folder for what it measures")
    os.makedirs(a.out, exist_ok=True)
    return run_all(a, t0)


if __name__ == "__main__":
    sys.exit(main())
