"""
The run folder's guarantees, for train.py: a folder holds one run, is locked while a train.py works in
it, is judged before anything in it is written, never mixes two runs' files, keeps log.csv in step with
ckpt.pt, and a stop signal (on every DDP rank at the same batch) or a non-finite cost ends the run with a
checkpoint kept. With them: the folder's default name, the settings a resumed run takes from its
checkpoint, the step as the loop calls it (on CUDA captured in a CUDA graph), how the run computes
(run.json), log.csv and the console line, and what ckpt.pt holds to continue bit for bit. train.py calls
these, first of all run_folder(); a reader of the experiment can skip them.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import random
import shutil
import signal
import time
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist

import fir
from common import SYMBOLS, atomic_write, device_name, fail, fmt_time, peak_memory

LOG_HEADER = ["iter", "train_loss", "val_loss", "lr", "tokens_per_s", "elapsed_s"]
RUN_FILES = ("ckpt.pt", "log.csv", "run.json", "loss.png")  # what a run folder holds, beside train.lock
CKPT_KEYS = ("model", "optimizer", "scaler", "config", "args", "iter", "elapsed_s", "rng", "data")
# settings a --resume must keep: changing them would no longer continue the same run
FIXED_ON_RESUME = ("batch_size", "data_seed", "seed", "lr", "beta1", "beta2", "weight_decay", "grad_clip")
NOT_SAVED = ("out_dir", "resume", "overwrite", "allow_other_data")  # flags about this command, not the run


# -------------------------------------------------------------------- the one call: name, lock, judge, resume


@contextmanager
def run_folder(args, parser, argv, master):
    """train.py's one call: the run folder (named by the settings unless --out_dir names it), locked for
    the whole run and judged before anything in it is written. Yields the checkpoint to resume, whose
    settings args now holds (flags given on the command line must agree with it), or None to start."""
    args.out_dir = args.out_dir or default_out_dir(args, parser.parse_args([]))
    with locked(args.out_dir, master):
        ckpt = judge(args.out_dir, args.resume, args.overwrite)
        if ckpt:
            resume_settings(args, given_flags(parser, argv, args), ckpt, master)
        yield ckpt


def default_out_dir(args, defaults):
    """out/<mixer> (out/sa-<n> for attention) for Table 1, plus -<symbol><value> for each setting that
    differs from its default: letters, then a value that starts with a digit, so no two settings share
    a name."""
    name = f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer
    for key, symbol in SYMBOLS.items():
        if getattr(args, key) != getattr(defaults, key) and not (key == "n_head" and args.mixer == "sa"):
            name += f"-{symbol}{exact(getattr(args, key))}"
    return os.path.join("out", name)


def exact(value):
    """A setting as the folder name writes it: short (3e-4 -> 0.0003, 1.0 -> 1) but exact, so that two
    settings never share a name (:g alone makes 12345678 and 12345679 both 1.23457e+07)."""
    return str(value) if isinstance(value, int) or float(f"{value:g}") != value else f"{value:g}"


def given_flags(parser, argv, args):
    """Names of the options given on the command line (a resumed run keeps the checkpoint's others):
    argparse sets a default only where the namespace has no value yet."""
    unset = object()
    probe = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    return {k for k, v in vars(probe).items() if v is not unset}


def resume_settings(args, given, ckpt, master):
    """A resumed run's settings: flags not given keep the checkpoint's values; given ones must not
    change the run."""
    saved = {**ckpt["args"], **ckpt["config"]}
    differ = [
        k for k in FIXED_ON_RESUME + tuple(ckpt["config"]) if k in given and getattr(args, k) != saved[k]
    ]
    if differ:
        was = ", ".join(f"{k}={saved[k]!r}" for k in differ)
        now = ", ".join(f"{k}={getattr(args, k)!r}" for k in differ)
        path = os.path.join(args.out_dir, "ckpt.pt")
        fail(f"{path} was trained with {was} but the flags give {now}; drop those flags to resume")
    if "dtype" in given and args.dtype != saved.get("dtype", args.dtype) and master:
        print(
            f"note: the run so far was trained with --dtype {saved['dtype']}; it goes on with {args.dtype}",
            flush=True,
        )
    for k in (set(vars(args)) - given - set(NOT_SAVED)) & set(saved):
        setattr(args, k, saved[k])


# --------------------------------------------------------------------------- the lock, and judging the folder


def lock_run_dir(out_dir):
    """An exclusive OS lock on the run folder (made if need be), held while the returned file is open
    and released when the process ends, even by kill -9."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--out_dir {out_dir} is a file, not a folder; pick another --out_dir")
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, "train.lock"), "a")
    except OSError as e:
        fail(f"cannot write in {out_dir} ({e.strerror}); pick another --out_dir")
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here
        return f
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fail(f"another train.py is running in {out_dir}; wait for it, or pick another --out_dir")
    return f


@contextmanager
def locked(out_dir, master):
    """The run folder, locked before anything in it is judged or written (under DDP rank 0 holds the
    lock for all). A refused run takes back the folder it made; stale temp files of a killed write go."""
    if not master:
        yield
        return
    made = not os.path.exists(out_dir)
    lock = lock_run_dir(out_dir)
    remove_stale_temp_files(out_dir)
    try:
        yield
    except SystemExit:
        if made and os.listdir(out_dir) == ["train.lock"]:
            lock.close()
            os.remove(os.path.join(out_dir, "train.lock"))
            os.rmdir(out_dir)
        raise
    finally:
        lock.close()


def remove_stale_temp_files(out_dir):
    """atomic_write's temp files (.ckpt.pt*.tmp, ...) left by a run killed while writing; with the
    folder locked, no other process is writing them."""
    prefixes = tuple("." + name for name in RUN_FILES)
    stale = [n for n in os.listdir(out_dir) if n.startswith(prefixes) and n.endswith(".tmp")]
    size = sum(os.path.getsize(os.path.join(out_dir, n)) for n in stale)
    for n in stale:
        os.remove(os.path.join(out_dir, n))
    if stale:
        print(f"removed {len(stale)} temp file(s) of a killed write ({size / 1e6:.1f} MB) from {out_dir}")


def judge(out_dir, resume, overwrite):
    """The checkpoint to resume (read and checked whole), or None for a fresh start. A folder whose run
    never reached a checkpoint simply starts again; one that holds a run needs --resume or --overwrite."""
    path = os.path.join(out_dir, "ckpt.pt")
    if resume:
        if not os.path.isfile(path):
            fail(f"no checkpoint {path} to resume; drop --resume to start the run, or pass its --out_dir")
        ckpt = read_checkpoint(path)
        check_log_reaches(out_dir, ckpt["iter"])
        return ckpt
    if overwrite:
        return None
    if os.path.isfile(path):
        fail(
            f"{out_dir} already holds a run; pass --resume to continue it, --overwrite to start again, "
            "or pick another --out_dir"
        )
    if log_holds_a_run(out_dir):
        fail(
            f"{out_dir} holds the log.csv of a run (its ckpt.pt is gone); pass --overwrite to replace "
            "it, or pick another --out_dir"
        )
    return None


def read_checkpoint(path):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        missing = set(CKPT_KEYS) - set(ckpt)
        if missing:
            raise KeyError(", ".join(sorted(missing)))
        return ckpt
    except Exception as e:
        fail(f"cannot read checkpoint {path} ({type(e).__name__}); it is damaged or not from this train.py")


def check_checkpoint(ckpt, config, data, args):
    """Resuming: the checkpoint's model is this config's, and its data this data (or --allow_other_data)."""
    if ckpt["data"] != data and not args.allow_other_data:
        what = [k.replace("_sha256", "") for k in data if ckpt["data"].get(k) != data[k]]
        fail(
            f"{args.out_dir}/ckpt.pt was trained on other data ({', '.join(what)} differ); pass its "
            "--data_dir, or --allow_other_data to continue on this one"
        )
    if config != ckpt["config"]:
        fail(f"{args.out_dir}/ckpt.pt is from another model ({ckpt['config']}); check --data_dir")


def log_rows(path):
    """log.csv's whole data rows as (iteration, line); none if there is no log."""
    lines = open(path, newline="").read().splitlines()[1:] if os.path.exists(path) else []
    whole = [r for r in lines if r.count(",") == len(LOG_HEADER) - 1 and r.split(",", 1)[0].isdigit()]
    return [(int(r.split(",", 1)[0]), r) for r in whole]


def log_holds_a_run(out_dir):
    """Whether log.csv belongs to a run that wrote a checkpoint (run.json's last_checkpoint, recorded
    right after each ckpt.pt is written whole): its ckpt.pt was deleted, the log is worth keeping. A run
    killed before its first checkpoint was whole, even while writing it, simply starts again. (A run.json
    of an older train.py has no last_checkpoint, but peak_memory_mb if its run ended; an unreadable one
    keeps the log.)"""
    if not log_rows(os.path.join(out_dir, "log.csv")):
        return False
    try:
        info = json.load(open(os.path.join(out_dir, "run.json")))
        return info.get("last_checkpoint") is not None or "peak_memory_mb" in info
    except (OSError, ValueError, AttributeError):  # no run.json, or a damaged one
        return True


def check_log_reaches(out_dir, last_iter):
    """Resuming: log.csv must hold the rows up to the checkpoint's batch, or the resumed log would begin
    with a gap (and plots would draw the later batches as the first)."""
    rows = log_rows(os.path.join(out_dir, "log.csv"))
    have = rows[-1][0] if rows else 0
    if have < last_iter:
        what = f"ends at batch {have}" if rows else "is missing or empty"
        fail(
            f"{out_dir}/log.csv {what} but ckpt.pt is at batch {last_iter}: the resumed log would lack "
            f"batches {have + 1}-{last_iter}; restore log.csv, or start afresh with --overwrite"
        )


# ------------------------------------------------------------------------- the step: eager, or a CUDA graph


def make_step(run, train_step, world):
    """The loop's step(x, y) -> loss: train_step with the run's model, AdamW, scaler and autocast; on CUDA
    captured in a CUDA graph and replayed (CapturedStep: the same numbers), eager where capture cannot
    apply. Returns it and how it runs, in words for the console and run.json."""
    args, device = run.args, run.device
    step = functools.partial(
        train_step, run.model, run.optimizer, run.scaler, run.ctx, grad_clip=args.grad_clip
    )
    cannot = {  # the reasons, in this order
        "--no-cuda_graph": not args.cuda_graph,
        f"no CUDA graphs on {device.type}": device.type != "cuda",
        "DDP: not captured": world > 1,
        "--dtype float16: its loss scaling is not captured": args.dtype == "float16",
        "--compile: not captured": args.compile,
    }
    why = next((why for why, applies in cannot.items() if applies), None)
    return (step, f"eager ({why})") if why else (CapturedStep(step), "captured in a CUDA graph")


class CaptureError(RuntimeError):
    """Recording the step in a CUDA graph failed: an operation in it cannot be captured."""


class CapturedStep:
    """step(x, y) -> loss as `step` (a whole training step: forward, loss, backward, clipping, AdamW)
    computes it, replayed from a CUDA graph (PyTorch's whole-network capture, torch.cuda.graphs): Python
    launches one graph instead of each of the step's 500-1000 kernels. The first `warmup` calls are real
    steps, run eagerly on a side stream, so that cuBLAS, AdamW's state and the allocator set themselves up
    outside the capture. The next call copies its batch into static buffers x, y, records one step (which
    runs nothing) and replays it; every later call copies its batch in and replays. Parameters, gradients
    and AdamW's state keep their places, so a replay computes what the eager step would, bit for bit
    (tests.py checks it on a GPU). Dropout draws from the default CUDA generator, which each replay
    advances as the eager step does: a checkpoint's RNG state continues the run. The loss returned is a
    copy; the graph's own is overwritten by the next replay."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup, self.graph = step, warmup, None
        self.stream = torch.cuda.Stream()  # the warm-up's and the capture's

    def __call__(self, x, y):
        if self.graph is None and self.warmup > 0:  # a real step, eager, on the side stream
            self.warmup -= 1
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                loss = self.step(x, y)
            torch.cuda.current_stream().wait_stream(self.stream)
            return loss
        if self.graph is None:
            self.capture(x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.loss.clone()

    def capture(self, x, y):
        graph, self.x, self.y = torch.cuda.CUDAGraph(), x.clone(), y.clone()  # the static inputs (b, l)
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self.loss = self.step(self.x, self.y)  # recorded, not run; the static output
        except Exception as e:
            raise CaptureError(
                f"capturing the step in a CUDA graph failed ({type(e).__name__}: {str(e)[:80]})"
            )
        self.graph = graph


# ------------------------------------------------------------------------- the run's files: run.json, log.csv


def start_files(out_dir, run_info, start):
    """run.json, and log.csv: new for a fresh start, after the old run's files have gone (its checkpoint
    first, so that the folder never holds the old model beside the new run's log); resuming, cut back to
    the checkpoint's batch (a run stopped after its last checkpoint may have logged later rows)."""
    log_path = os.path.join(out_dir, "log.csv")
    if not start:
        for name in RUN_FILES:
            with suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
    run_info = dict(run_info, last_checkpoint=start or None)  # resuming, ckpt.pt is at batch `start`
    atomic_write(os.path.join(out_dir, "run.json"), json.dumps(run_info, indent=1) + "\n")
    keep = [r for i, r in log_rows(log_path) if i <= start]
    atomic_write(log_path, "\n".join([",".join(LOG_HEADER)] + keep) + "\n")


def computed(run, how):
    """How the run computes, for run.json: the device and its model, torch, the precision of float32
    matmuls (tf32 or ieee), autocast, whether the step is captured, and the precision of the FIR's own
    products (SHE's complex ones among them: ieee unless fir.ALLOW_TF32 lets them follow TF32)."""
    tf32 = run.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return {
        "device": str(run.device), "device_name": device_name(run.device), "torch": torch.__version__,
        "float32_matmul": "tf32" if tf32 else "ieee",
        "autocast": None if run.args.dtype == "float32" else run.args.dtype,
        "captured": how.startswith("captured"), "step": how,
        "fir_matmul": "tf32" if tf32 and fir.ALLOW_TF32 else "ieee",
    }  # fmt: skip


def add_to_run_json(out_dir, **info):
    path = os.path.join(out_dir, "run.json")
    atomic_write(path, json.dumps(dict(json.load(open(path)), **info), indent=1) + "\n")


class RunLog:
    """log.csv and the console. Each batch's loss waits on the device (no sync per batch) until the next
    log point, in one buffer allocated once: with keep_freed_memory, a tensor kept per batch would pin
    freed memory and the process would grow without bound (tests.py checks that it stays flat)."""

    def __init__(self, args, start, elapsed0, device, master, world):
        self.args, self.start, self.elapsed0, self.master, self.world = args, start, elapsed0, master, world
        self.losses = torch.zeros(max(1, min(args.log_interval, args.max_iters - start)), device=device)
        self.times = []  # when each batch since the last log point ended
        self.t_session = self.t_chunk = time.time()
        self.file = open(os.path.join(args.out_dir, "log.csv"), "a", newline="") if master else None

    def add(self, loss):
        self.losses[len(self.times)] = loss
        self.times.append(time.time())

    def write(self, it, val, saved_at):
        """The batches since the last log point, up to `it`: their losses (under DDP the mean over the
        ranks, the global batch's loss, so every rank calls this at the same batch), checked finite, as
        rows of log.csv (val_loss in the last, where it was measured) and one console line."""
        losses = self.losses[: len(self.times)].clone()  # (k,)
        if self.world > 1:
            losses /= self.world
            dist.all_reduce(losses)
        rows = list(zip(range(it - len(self.times) + 1, it + 1), self.times, losses.tolist()))
        self.times = []
        check_finite(rows, saved_at)
        if not self.master:
            return
        now, n, lr = time.time(), self.args.max_iters, self.args.lr
        tok_s = self.args.batch_size * self.args.block_size * len(rows) / max(now - self.t_chunk, 1e-9)
        for i, t, v in rows:
            val_i = repr(val) if (i == it and val is not None) else ""
            self.file.write(f"{i},{v!r},{val_i},{lr},{tok_s:.1f},{self.elapsed(t):.3f}\n")
        self.file.flush()
        eta = (n - it) * (now - self.t_session) / (it - self.start)  # at this session's pace
        print(
            f"iter {it}/{n} ({100 * it / n:.1f}%) | loss {sum(v for _, _, v in rows) / len(rows):.4f}"
            + (f" | val {val:.4f}" if val is not None else "")
            + f" | {tok_s / 1000:.1f}k tok/s | elapsed {fmt_time(self.elapsed(now))} | ETA {fmt_time(eta)}",
            flush=True,
        )
        self.t_chunk = time.time()

    def elapsed(self, now=None):
        return self.elapsed0 + (now or time.time()) - self.t_session


def report_peak_memory(out_dir, device, master):
    """The run's peak memory (this session's, resuming) in run.json and on the last console line."""
    if master:
        peak, what = peak_memory(device)
        add_to_run_json(out_dir, peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what)
        print(f"{what}: {peak / 2**30:.2f} GB", flush=True)


# ---------------------------------------------------------------------------------- ckpt.pt: save and restore


def save_checkpoint(run, it, elapsed, saved_at, rank, world):
    """ckpt.pt of train.py's Run: plain dicts and tensors (torch.load(weights_only=True) reads it), written
    whole or not at all; every rank's RNG state, so that a resumed run continues bit for bit."""
    rngs = gather_rng(run.device, world)  # (a collective under DDP: every rank comes here)
    if rank:
        return
    ckpt = {
        "model": run.raw_model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "config": dataclasses.asdict(run.raw_model.cfg),
        "args": dict(vars(run.args)),
        "iter": it,  # batches done; batch `it` (0-based) comes next
        "elapsed_s": elapsed,
        "rng": rngs,  # one dict per DDP rank (dropout streams differ per rank)
        "data": run.data,  # vocab size and sha256 of train.bin, val.bin and the tokenizer
    }
    write_checkpoint(run.args.out_dir, ckpt, saved_at)


def write_checkpoint(out_dir, ckpt, saved_at):
    """ckpt.pt written whole or not at all, then recorded in run.json; a full disk is one line saying which
    checkpoint was kept."""
    path = os.path.join(out_dir, "ckpt.pt")
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:  # a full disk: torch.save says RuntimeError ("unexpected pos")
        kept = f"it keeps batch {saved_at}" if saved_at else "no checkpoint was kept"
        free = shutil.disk_usage(out_dir).free / 2**20
        reason = getattr(e, "strerror", None) or f"{type(e).__name__} with {free:.0f} MB free on its disk"
        fail(f"cannot write {path} ({reason}); {kept}: free space, then continue with --resume")
    add_to_run_json(out_dir, last_checkpoint=ckpt["iter"])  # after ckpt.pt is whole: see log_holds_a_run


def gather_rng(device, world):
    """Every rank's RNG states, for the checkpoint (each rank has its own dropout stream)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    rngs = [state] * world
    if world > 1:
        dist.all_gather_object(rngs, state)
    return rngs


def restore(ckpt, model, optimizer, scaler, device, rank, world):
    """A resumed run's state: model, AdamW, loss scaler and this rank's RNG streams."""
    model.load_state_dict(ckpt["model"])
    saved, keys = ckpt["optimizer"], ("fused", "capturable", "foreach")  # AdamW's kind stays this device's
    groups = [
        dict(g, **{k: m[k] for k in keys}) for g, m in zip(saved["param_groups"], optimizer.param_groups)
    ]
    optimizer.load_state_dict(dict(saved, param_groups=groups))
    if ckpt["scaler"]:
        scaler.load_state_dict(ckpt["scaler"])
    if len(ckpt["rng"]) == world:
        s = ckpt["rng"][rank]
        torch.set_rng_state(s["torch"])
        random.setstate(s["python"])
        if device.type == "cuda" and "cuda" in s:
            torch.cuda.set_rng_state(s["cuda"], device)
    else:  # another number of processes: the dropout streams cannot continue, so start new ones
        n = len(ckpt["rng"])
        if rank == 0:
            print(
                f"note: the checkpoint is from {n} process{'es' * (n > 1)}: dropout RNG reseeded", flush=True
            )
        torch.manual_seed(ckpt["args"]["seed"] + rank + 1_000_003 * ckpt["iter"])


# --------------------------------------------------------------------------------------------------- stopping


@contextmanager
def stop_signals():
    """Ctrl-C (SIGINT), kill (SIGTERM) and a closed terminal (SIGHUP) ask the loop to stop after
    this batch with a checkpoint; a second Ctrl-C aborts at once. Yields {'signal': None or number}."""
    stop, old = {"signal": None}, {}

    def ask(signum, frame):
        stop["signal"] = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (no print here: it may interrupt one)

    for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        try:
            old[s] = signal.signal(s, ask)
        except (ValueError, TypeError):  # not the main thread, or no such signal here
            pass
    try:
        yield stop
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def check_finite(rows, saved_at):
    """A non-finite training cost ends the run; the checkpoint keeps the last good state."""
    bad = [(i, v) for i, _, v in rows if not math.isfinite(v)]
    if bad:
        kept = f"ckpt.pt keeps batch {saved_at}, the last good state; " if saved_at else ""
        fail(
            f"the training cost became {bad[0][1]} at batch {bad[0][0]}; {kept}start the run again"
            f"{' (--overwrite)' if kept else ''} with a smaller --lr or with --grad_clip"
        )


def agree_to_stop(stop, world):
    """Whether to stop now: a signal came (to any rank, under DDP, so that all stop at the same batch)."""
    asked = torch.tensor([float(stop["signal"] is not None)])
    if world > 1:
        dist.all_reduce(asked)
    return bool(asked.item() > 0)
