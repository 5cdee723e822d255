"""
The run folder's guarantees, for train.py: a folder holds one run, is locked while a train.py works in
it, is judged before anything in it is written, never mixes two runs' files, keeps log.csv in step with
ckpt.pt, and a stop signal (on every DDP rank at the same batch) or a non-finite cost ends the run with a
checkpoint kept. train.py calls these; a reader of the experiment can skip them.
"""

import json
import math
import os
import shutil
import signal
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist

from common import atomic_write, fail

LOG_HEADER = ["iter", "train_loss", "val_loss", "lr", "tokens_per_s", "elapsed_s"]
RUN_FILES = ("ckpt.pt", "log.csv", "run.json", "loss.png")  # what a run folder holds, beside train.lock
CKPT_KEYS = ("model", "optimizer", "scaler", "config", "args", "iter", "elapsed_s", "rng", "data")


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
    """Whether log.csv records a run worth keeping: one that got past its first checkpoint (at batch 10
    at the latest) or ended (run.json then holds its peak memory). A run killed before its first
    checkpoint has nothing to keep: it simply starts again."""
    rows = log_rows(os.path.join(out_dir, "log.csv"))
    ended = False
    with suppress(OSError, ValueError):  # no run.json, or a damaged one
        ended = "peak_memory_mb" in json.load(open(os.path.join(out_dir, "run.json")))
    return bool(rows) and (rows[-1][0] >= 10 or ended)


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


def start_files(out_dir, run_info, start):
    """run.json, and log.csv: new for a fresh start, after the old run's files have gone (its checkpoint
    first, so that the folder never holds the old model beside the new run's log); resuming, cut back to
    the checkpoint's batch (a run stopped after its last checkpoint may have logged later rows)."""
    log_path = os.path.join(out_dir, "log.csv")
    if not start:
        for name in RUN_FILES:
            with suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
    atomic_write(os.path.join(out_dir, "run.json"), json.dumps(run_info, indent=1) + "\n")
    keep = [r for i, r in log_rows(log_path) if i <= start]
    atomic_write(log_path, "\n".join([",".join(LOG_HEADER)] + keep) + "\n")


def add_to_run_json(out_dir, **info):
    path = os.path.join(out_dir, "run.json")
    atomic_write(path, json.dumps(dict(json.load(open(path)), **info), indent=1) + "\n")


def write_checkpoint(out_dir, ckpt, saved_at):
    """ckpt.pt written whole or not at all; a full disk is one line saying which checkpoint was kept."""
    path = os.path.join(out_dir, "ckpt.pt")
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:  # a full disk: torch.save says RuntimeError ("unexpected pos")
        kept = f"it keeps batch {saved_at}" if saved_at else "no checkpoint was kept"
        free = shutil.disk_usage(out_dir).free / 2**20
        reason = getattr(e, "strerror", None) or f"{type(e).__name__} with {free:.0f} MB free on its disk"
        fail(f"cannot write {path} ({reason}); {kept}: free space, then continue with --resume")


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
