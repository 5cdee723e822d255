"""
The run's machinery, beside the experiment of train.py: what keeps a run safe, exact
and honest about how it computed. Each guarantee is a function (or a class) that says
it in its docstring; every failure is one line that says what stays.
"""

import argparse
import base64
import contextlib
import ctypes
import fcntl  # (Linux and macOS, as resource: train.py runs on Unix; Windows: WSL)
import fnmatch
import hashlib
import io
import json
import math
import os
import platform
import re
import resource
import signal
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fir
from extractor import find_mixer

# DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
MASTER = RANK == 0
STOP = {"signal": None}  # set by Ctrl-C, kill, a closed terminal or stdout
CPU_GROUP = {"group": None}  # under DDP: gloo, for the stop every process agrees on
# this process's run: its folder (locked by process 0), the batch it is at (None while
# the model is built), whether it is validating, whether the console went to stderr,
# what stays once the folder is closed; for the failure messages
THIS_RUN = dict(folder=None, batch=None, validating=False, stderr=False, left=None)
TOKENIZER_FILE = "tokenizer.tiktoken"  # prepare_data.py's, in the data folder
LOG_HEADER = "iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n"
# the files of a run, and what our tools draw from it: --overwrite removes them
RUN_FILES = ("ckpt.pt", "log.csv", "run.json", "loss.png", "taps.png")
# what ckpt.pt holds beside run.json's info (from which --resume writes run.json again)
CKPT_ONLY = ("model", "optimizer", "scaler", "rng", "log")
NO_GRAPH = "the step cannot be captured in a CUDA graph"  # (CapturedStep's failures)
RESULTS = os.path.join(os.path.dirname(os.path.realpath(__file__)), "results")


def in_results(path):
    """Whether path lies in the repository's results/, which keeps committed runs."""
    return os.path.commonpath([os.path.realpath(path), RESULTS]) == RESULTS


def fail(msg):
    """Bad input: one line on stderr, what is wrong and what to do; exit 1, no trace.
    Under DDP process 0 says it: every process meets the same input."""
    if MASTER:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def fmt_time(s):
    """Seconds for progress lines and ETAs: 4.2s, 3m05s, 1h02m."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s) // 60}m{int(s) % 60:02d}s"
    return f"{int(s) // 3600}h{int(s) // 60 % 60:02d}m"


def atomic_write(path, data, dir_fd=None, shown=None):
    """data (bytes or str) whole at path (relative to the folder dir_fd), or nothing
    there; an error names path (or shown), not the temporary file."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with open(os.open(tmp, flags, 0o666, dir_fd=dir_fd), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, shown or path) from e
        raise


# ---- the command line ----------------------------------------------------------------
def bounded(kind, low, high=math.inf):
    """An argparse type: a number of this kind in [low, high)."""

    def number(text):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}), got {text}")
        return value

    return number


def seconds(text):
    """An argparse type: --time_limit in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time: write 90s, 40m, 2h")
    return float(m[1]) * {"m": 60, "h": 3600}.get(m[2], 1)


COUNT = bounded(int, 1)
NATURAL = bounded(int, 0)
NON_NEGATIVE = bounded(float, 0)
FRACTION = bounded(float, 0, 1)
SEED = bounded(int, 0, 2**63)


def build_parser(settings):
    """train.py's flags: each setting (its help gives Table 1's symbol and value), then
    this command's own, which no checkpoint keeps."""
    p = argparse.ArgumentParser(description="Train a language model with a token mixer")
    p.error = lambda msg: fail(f"{msg} (see python train.py --help)")
    for name, (symbol, default, kind, text) in settings.items():
        about = f"{symbol}: {text} ({default})" if symbol else f"{text} ({default})"
        how = dict(type=kind)  # a bool is on or off, a tuple the choices
        if kind is bool:
            how = dict(action=argparse.BooleanOptionalAction)
        if isinstance(kind, tuple):
            how = dict(choices=kind)
        p.add_argument(f"--{name}", default=default, help=about, **how)
    out = "the run folder (default: out/<mixer>-<changed settings>)"
    p.add_argument("--out_dir", default="", help=out)
    one_of = p.add_mutually_exclusive_group()
    one_of.add_argument("--resume", action="store_true", help="go on with its run")
    one_of.add_argument("--overwrite", action="store_true", help="start out_dir again")
    limit = "stop at a checkpoint before this: 90s, 40m, 2h"
    p.add_argument("--time_limit", type=seconds, help=limit)
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--cuda_graph", action=on_off, default=True, help="CUDA: graph step")
    return p


def default_out_dir(args, settings):
    """out/<mixer> (sa-<n>), -<symbol><value> per setting not Table 1's: out/me-l64."""
    name = f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer
    for flag, (symbol, value, _, _) in settings.items():
        v = getattr(args, flag)
        if not symbol or v == value or flag == "n_head" and args.mixer == "sa":
            continue
        name += f"-{symbol}{str(v).removesuffix('.0')}"  # (shortest exact, 0.0 as 0)
    return os.path.join("out", name)


def check_mixer(cfg):
    """cfg, once its mixer is a causal module of the config keeping x's shape at t = 2
    and l; one line if not, or if it refuses the config (a ValueError: heads, say)."""
    try:
        mixer = find_mixer(cfg.mixer)(cfg).eval()
        for t in (2, cfg.block_size):
            x = torch.randn(2, t, cfg.n_embd, generator=torch.Generator())  # (B, t, d)
            x[1, :-1] = x[0, :-1]  # two inputs that differ at the last position only
            y = mixer(x, None)
            assert y.shape == x.shape, f"not x's shape at t = {t}"
    except ValueError as e:  # an unknown name, or settings the mixer refuses
        fail(str(e))
    except Exception as e:  # not a module of the config that maps x to x's shape
        if out_of_memory(e):
            raise  # (said as such by run_command)
        why = f"{type(e).__name__}: {e}"
        what = "an nn.Module of the config whose forward(x, cache) keeps x's shape"
        fail(f"--mixer {cfg.mixer} is not a mixer ({why}): a mixer is {what}")
    if (y[1, :-1] - y[0, :-1]).norm() > 1e-4 * y[0].norm():  # (FFTs' rounding: less)
        later = f"its output at i < {t - 1} changes with the input at {t - 1}"
        fail(f"--mixer {cfg.mixer} sees the future ({later}): i may read up to i only")
    return cfg


# ---- the data ------------------------------------------------------------------------
def checked_file(data_dir, name, key):
    """data_dir/name's path and bytes, and meta.json, once its sha256 is meta[key]."""
    path = os.path.join(data_dir, name)
    meta_path = os.path.join(data_dir, "meta.json")
    try:
        meta = json.loads(Path(meta_path).read_text())
        data = Path(path).read_bytes()
        assert isinstance(meta, dict), "not an object"
    except (OSError, ValueError, AssertionError) as e:  # no such file, not JSON's {}
        missing = getattr(e, "filename", None) or meta_path
        fail(f"{missing} is missing or damaged: run prepare_data.py first")
    if hashlib.sha256(data).hexdigest() != meta.get(key):
        fail(f"{path} is not the file meta.json describes: re-run prepare_data.py")
    return path, data, meta


def load_tokenizer(data_dir):
    """data_dir's tokenizer, checked by meta.json, as a tiktoken.Encoding."""
    _, data, meta = checked_file(data_dir, TOKENIZER_FILE, "tokenizer_sha256")
    lines = [line.split() for line in data.splitlines()]  # base64(token) rank
    ranks = {base64.b64decode(token): int(rank) for token, rank in lines}
    pattern = meta["split_pattern"]
    special = {"<|endoftext|>": len(ranks)}
    return tiktoken.Encoding(
        "bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
    )


def load_data(data_dir, block_size, batch_size):
    """train and val tokens memory-mapped, checked against meta.json, and their
    fingerprint (the vocabulary and the files' sha256) for ckpt.pt."""
    tokens = []
    # a batch of windows of l + 1 tokens in train.bin, one in val.bin
    for split, need, batch, less in (
        ("train", block_size + batch_size, "b + l", "--batch_size or --block_size"),
        ("val", block_size + 1, "l + 1", "--block_size"),
    ):
        path, raw, meta = checked_file(data_dir, f"{split}.bin", f"{split}_sha256")
        n = len(raw) // 2
        if n < need:
            few = f"{n} tokens, fewer than a batch needs ({batch} = {need})"
            fail(f"{path}: {few}: use a smaller {less}")
        tokens.append(np.memmap(path, dtype=np.uint16, mode="r"))
        top = int(tokens[-1].max())
        vocab_size = meta.get("vocab_size", 0)
        if top >= vocab_size:
            vocab = f"meta.json's vocab_size {vocab_size}"
            fail(f"{path} holds token {top} >= {vocab}: run prepare_data.py")
    keys = ("vocab_size", "train_sha256", "val_sha256", "tokenizer_sha256")
    return tokens[0], tokens[1], {k: meta.get(k) for k in keys}


# ---- the run folder and ckpt.pt ------------------------------------------------------
# what --resume reads from ckpt.pt (sample.py: config, model, args, iter, data)
RESUME_KEYS = {*CKPT_ONLY, "args", "iter", "data", "world_size", "elapsed_s"}


class RunFolder:
    """The command's run folder: process 0 makes it, locks it against a second train.py
    and writes through the handle it locked, so that a run whose folder is renamed
    while it trains writes into its own folder, never into a new one at the old path."""

    def __init__(self, path):
        if os.path.isfile(path):
            fail(f"--out_dir {path} is a file: pass a folder (the run's, or a new one)")
        if in_results(path):
            committed = "which holds the committed runs and figures: train into out/"
            fail(f"--out_dir {path} is in results/, {committed} or elsewhere")
        THIS_RUN["left"] = None  # (what the last folder's run left)
        self.path, self.made = path, not os.path.isdir(path)
        os.makedirs(path, exist_ok=True)
        self.fd = os.open(path, os.O_RDONLY)

    def __enter__(self):
        """Process 0's lock, refused if another train.py holds the folder or if it
        cannot be written (seen now, not at a checkpoint); killed writes' .*.tmp go."""
        THIS_RUN["folder"] = self
        if not MASTER:
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = "is in use: a run of another train.py is in progress there"
            fail(f"{self.path} {busy}; wait for it, or pick another --out_dir")
        self.remove(fnmatch.filter(os.listdir(self.fd), ".*.tmp"))
        try:
            self.write(".written", b"")
            os.unlink(".written", dir_fd=self.fd)
        except OSError as e:
            fail(f"cannot write in --out_dir {self.path} ({e.strerror}): pick another")
        return self

    def has(self, name):
        return name in os.listdir(self.fd)

    def where(self):
        """The folder's path now: the path given, unless it was renamed (Linux)."""
        with contextlib.suppress(OSError):  # (elsewhere: no /proc)
            now = os.readlink(f"/proc/self/fd/{self.fd}")  # (absolute)
            return self.path if now == os.path.realpath(self.path) else now
        return self.path

    def write(self, name, data):
        """The file `name` whole in this folder, or as it was; an error names it."""
        atomic_write(name, data, self.fd, os.path.join(self.path, name))

    def remove(self, names):
        for name in set(names) & set(os.listdir(self.fd)):
            os.unlink(name, dir_fd=self.fd)

    def __exit__(self, *error):
        """The handle closed; a folder this run made and left empty removed (and not
        another that took its path since)."""
        THIS_RUN["left"] = kept(self.path)  # (for a failure said once it is closed)
        THIS_RUN["folder"] = None
        with contextlib.suppress(OSError):
            ours = os.path.samestat(os.stat(self.path), os.fstat(self.fd))
            if MASTER and self.made and ours and not os.listdir(self.fd):
                os.rmdir(self.path)
        os.close(self.fd)


def checkpoint_to_resume(args, argv, settings, may_change, folder):
    """The checkpoint to resume (args then set from it), or None; a folder holds a run
    once ckpt.pt (or log.csv) is in it (each refusal's line says what to do)."""
    path = os.path.join(args.out_dir, "ckpt.pt")
    if folder.has("log.csv.gz"):
        gz = "a finished run's log.csv.gz (as results/logs/ keeps runs)"
        fix = "train.py writes no such folder; pick another --out_dir"
        fail(f"{args.out_dir} holds {gz}: {fix}")
    has_ckpt = folder.has("ckpt.pt")
    has_run = has_ckpt or folder.has("log.csv")
    if args.resume and not has_ckpt:
        how = "--overwrite starts the run again" if has_run else "drop --resume"
        fail(f"no checkpoint {path} to resume; {how}")
    if not (args.resume or args.overwrite) and has_run:
        how = "--resume continues it" if has_ckpt else "its ckpt.pt is gone"
        how += "; --overwrite starts it again"
        fail(f"{args.out_dir} holds a run ({how}); or pick another --out_dir")
    if not args.resume:
        return None
    ckpt = load_checkpoint(path, "; --overwrite starts the run again")
    missing = ", ".join(sorted(RESUME_KEYS - set(ckpt)))
    if missing:
        older = "an older train.py wrote it; resume it with that version"
        fail(f"{path} has no {missing}: {older}, or --overwrite starts the run again")
    if ckpt["world_size"] != WORLD:
        fail(f"{path} was trained by {ckpt['world_size']} processes: run as many")
    saved = {k: v for k, v in ckpt["args"].items() if k in settings}
    vars(args).update(saved)
    build_parser(settings).parse_args(argv, args)  # the flags given, over saved ones
    differ = [k for k in saved if k not in may_change and vars(args)[k] != saved[k]]
    if differ:
        flags = ", ".join(f"--{k} {saved[k]}" for k in differ)
        fail(f"{path} was trained with {flags}: --resume keeps them; drop those flags")
    old = saved["data_dir"]  # (ckpt.pt keeps an absolute path)
    if not os.path.isdir(old) and args.data_dir == old:
        now = "pass --data_dir with the folder where that data is now"
        fail(f"{path} was trained on the data in {old}, which is gone: {now}")
    return ckpt


def load_checkpoint(path, fix=""):
    """A ckpt.pt of train.py: plain dicts and tensors; one line if damaged."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"model", "config", "args", "iter", "data"} - set(ckpt)
        assert not missing, f"no {', '.join(sorted(missing))}"
    except Exception as e:
        why = textwrap.shorten(f"{type(e).__name__}: {e}", 100, placeholder=" ...")
        fail(f"cannot read {path} ({why}); it is damaged or not train.py's{fix}")
    return ckpt


def restore(ckpt, data, model, optimizer, scaler, device):
    """A resumed run's model, AdamW (as this device runs it), loss scaler and RNGs, once
    data (meta.json's sha256s) is the data of its checkpoint."""
    if ckpt["data"] != data:
        out_dir = THIS_RUN["folder"].path
        fail(f"{out_dir}/ckpt.pt was trained on other data: pass its --data_dir")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # a mixer of one's own whose parameters changed since
        why = " ".join(str(e).split())  # (torch's lines as one)
        fail(f"ckpt.pt does not fit the model --mixer {model.cfg.mixer} makes: {why}")
    saved = ckpt["optimizer"]
    mine = optimizer.defaults  # AdamW's kind stays this device's (build_model's)
    for group in saved["param_groups"]:
        group.update(fused=mine["fused"], capturable=mine["capturable"])
    optimizer.load_state_dict(saved)
    scaler.load_state_dict(ckpt["scaler"])  # (float16's; else it does nothing)
    rng = ckpt["rng"][RANK]  # this process's
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


def kept(out_dir):
    """What a run that fails leaves, said as the folder is (or was, once closed)."""
    folder = THIS_RUN["folder"]
    if folder is None and THIS_RUN["left"]:
        return THIS_RUN["left"]
    with contextlib.suppress(OSError):  # (a name too long, a folder gone)
        if folder.has("ckpt.pt") if folder else os.path.exists(f"{out_dir}/ckpt.pt"):
            return f"the last checkpoint, {out_dir}/ckpt.pt, stays"
    return "no checkpoint was written"


# ---- the console, log.csv and when to stop -------------------------------------------
def say(line):
    """A console line at once, from process 0. A console that cannot be written (| head
    has closed, the terminal is gone, the disk is full) stops the run at a checkpoint,
    as a signal does; the lines go to stderr from then on, where it can be written."""
    if not MASTER:
        return
    console = sys.stderr if THIS_RUN["stderr"] else sys.stdout
    try:
        print(line, file=console, flush=True)
    except OSError as e:
        with contextlib.suppress(OSError, ValueError):  # (written to nowhere from now)
            os.dup2(os.open(os.devnull, os.O_WRONLY), console.fileno())
        closed = signal.SIGPIPE if isinstance(e, BrokenPipeError) else signal.SIGHUP
        STOP["signal"] = STOP["signal"] or closed
        if not THIS_RUN["stderr"]:
            THIS_RUN["stderr"] = True
            say(line)


def ask_to_stop(signum, frame):
    STOP["signal"] = signum
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: abort


class StepClock:
    """The time each step ended as the device did it. On CUDA nothing in a step waits
    for the GPU, so the host could queue a whole log interval ahead and the clock would
    time the queueing: the clock is read once the GPU has finished the step before
    (an event each step), the host one step ahead, the times a step late at most."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.queued = None  # the event after the step before

    def now(self):
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            if self.queued is not None:
                self.queued.synchronize()
            self.queued = done
        return time.time()


class Progress:
    """A run's log and pace between the batches: the losses since the last log point
    (one buffer: a tensor kept per batch would split the block the logits freed, and
    the heap would grow by the logits' size each batch, pick_device's settings), the
    batches' end times, log.csv's rows (in ckpt.pt too), when to stop."""

    def __init__(self, args, ckpt, start_time, info):
        self.args, self.info, self.start_time = args, info, start_time
        self.limit = math.inf if args.time_limit is None else args.time_limit  # (s)
        if time.time() - start_time > self.limit:
            took = f"{time.time() - start_time:.1f} s to start"
            late = f"--time_limit passed before the first batch ({took})"
            fail(f"{late}: nothing was trained; give a longer one")
        self.start_iter = ckpt["iter"] if ckpt else 0
        THIS_RUN["batch"] = self.start_iter + 1
        self.rows = ckpt["log"] if ckpt else []  # log.csv's lines
        n = min(args.log_interval, args.max_iters - self.start_iter)
        self.device = torch.device(info["computed"]["device"])
        self.losses = torch.zeros(n, device=self.device)  # since the last log point
        self.times = []  # when each of those batches ended, from the run's start
        self.clock = StepClock(self.device)
        self.pause = 0.0  # the longest log point's work that saved ckpt.pt, s
        # until one did, a guess: 0.5 s and ckpt.pt (the weights, AdamW's 2 moments)
        self.guess = 0.5 + 3 * 4 * info["params"]["total"] / 50e6  # (at 50 MB/s)
        self.since = time.time()  # the end of the last log point
        self.t0 = self.since - (ckpt["elapsed_s"] if ckpt else 0.0)  # (its time counts)
        if MASTER and args.overwrite:  # the old run's files, once the new one can start
            THIS_RUN["folder"].remove(RUN_FILES)

    def batch_done(self, loss):
        """The batch's loss (a tensor on the device, not read) and its end."""
        self.losses[len(self.times)] = loss
        self.times.append(self.clock.now() - self.t0)
        THIS_RUN["batch"] += 1

    def must_stop(self, evaluates_next):
        """Whether the batch just done must be the last, in every process alike: a
        signal came, or from train.py's start the time limit leaves no room for 2
        batches, the next validation (if any), 2 log points (this one's, the last)."""
        now = self.t0 + self.times[-1]
        per_batch = (now - self.since) / len(self.times)
        batches = 2 + self.args.eval_batches * evaluates_next
        reserve = batches * per_batch + 2 * (self.pause or self.guess)
        late = now - self.start_time + reserve > self.limit
        stop = torch.tensor(float(STOP["signal"] is not None or late))
        if WORLD > 1:  # any process's, over the CPU process group: it waits for no GPU
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=CPU_GROUP["group"])
        return stop.item() > 0

    def log(self, it, val):
        """log.csv's rows since the last log point and a console line with the pace and
        the ETA; a cost that is nan or inf stops the run."""
        args, n = self.args, len(self.times)
        costs = mean_over_processes(self.losses[:n]).tolist()  # (DDP: the batch's)
        now = self.t0 + self.times[-1]
        # the n - 1 intervals between the ends (CUDA: the first batch ends once queued)
        first = self.times[0] if n > 1 else self.since - self.t0
        batches = max(n - 1, 1)
        tok_s = batches * args.batch_size * args.block_size / (self.times[-1] - first)
        eta = (args.max_iters - it) * (now - self.start_time) / (it - self.start_iter)
        for i, (cost, t) in enumerate(zip(costs, self.times), it - n + 1):
            if not math.isfinite(cost):
                left = kept(args.out_dir)
                again = "(--overwrite) " if "stays" in left else ""
                fix = f"Start again {again}with a smaller --lr or with --grad_clip"
                fail(f"the training cost became {cost} at batch {i}; {left}. {fix}")
            val_i = repr(val) if i == it and val is not None else ""
            self.rows.append(f"{i},{cost!r},{val_i},{args.lr},{tok_s:.1f},{t:.3f}\n")
        line = f"iter {it}/{args.max_iters} | loss {np.mean(costs):.4f}"
        if val is not None:
            line += f" | val {val:.4f}"
        line += f" | {tok_s / 1e3:.1f}k tok/s | elapsed {fmt_time(self.times[-1])}"
        say(f"{line} | ETA {fmt_time(eta)}")

    def save(self, it, model, optimizer, scaler):
        """ckpt.pt (run.json's info, log.csv's rows, all processes' RNG states), log.csv
        and run.json, each whole or none; info has this session's peak memory (on CUDA
        the reserve too: a captured step's pool is reserved, not allocated)."""
        peak, what = peak_memory(self.device)
        self.info.update(peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what)
        if self.device.type == "cuda":
            reserved = torch.cuda.max_memory_reserved(self.device)
            self.info["peak_reserved_mb"] = round(reserved / 2**20, 1)
        self.info.update(iter=it, elapsed_s=time.time() - self.t0)
        self.args.out_dir = THIS_RUN["folder"].where()  # (info's args: its folder now)
        state = {"torch": torch.get_rng_state()}  # (dropout's; random is unused)
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        rngs = [state] * WORLD
        if WORLD > 1:
            dist.all_gather_object(rngs, state)
        if not MASTER:
            return
        ckpt = dict(self.info, model=model.state_dict(), rng=rngs, log=self.rows)
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict())
        buffer = io.BytesIO()  # (a full disk then fails in the write: an OSError)
        torch.save(ckpt, buffer)
        folder = THIS_RUN["folder"]
        folder.write("ckpt.pt", buffer.getvalue())  # first: log.csv is never ahead
        folder.write("log.csv", LOG_HEADER + "".join(self.rows))
        folder.write("run.json", json.dumps(self.info, indent=1) + "\n")

    def log_point_done(self, saved):
        """The pace counts again from here; a log point that saved is measured."""
        if saved:
            self.pause = max(self.pause, time.time() - self.t0 - self.times[-1])
        self.times = []
        self.since = time.time()

    def finish(self, it, stop):
        """The last lines: the peak memory and what ended the run; its exit status."""
        peak, what = peak_memory(self.device)
        reserved = self.info.get("peak_reserved_mb")
        also = f", reserved {reserved / 1024:.2f} GB" if reserved else ""
        say(f"{what}: {peak / 2**30:.2f} GB{also}")
        if not stop:
            plot = f"python experiments/plot.py {self.args.out_dir}"
            say(f"done: {plot} draws its losses")
            return 0
        signum = STOP["signal"]
        why = "--time_limit" if signum is None else signal.Signals(signum).name
        say(f"{why}: stopped at batch {it} with a checkpoint; go on with --resume")
        return 0 if signum is None else 128 + signum


def mean_over_processes(t):
    """Under DDP the mean of t over the processes (each calls this at one point)."""
    if WORLD > 1:
        t = t / WORLD
        dist.all_reduce(t)
    return t


# ---- the device, precision, the step -------------------------------------------------
def pick_device(name):
    """--device as a torch.device once a kernel has run on it; auto: CUDA where it runs
    one, else the CPU (said where CUDA is there but unusable). One line for a device
    torch does not see, or a GPU this build of torch has no kernels for."""
    # (0 without CUDA; not asked at LOCAL_RANK 0: its warning is no_kernel's to read)
    gpus = torch.cuda.device_count() if LOCAL_RANK else 0
    if 0 < gpus <= LOCAL_RANK and name in ("auto", "cuda"):
        fail(f"LOCAL_RANK {LOCAL_RANK} has no GPU: start {gpus} processes at most")
    if name == "auto":
        why = no_kernel(torch.device(f"cuda:{LOCAL_RANK}"))
        if why:
            say(f"note: CUDA is unusable here ({why}); --device auto runs on the CPU")
        name = "cpu" if why is not None else "cuda"
    if name == "cuda":  # under torchrun: this process's GPU
        name = f"cuda:{LOCAL_RANK}"
    try:
        device = torch.device(name)
        torch.empty(0, device=device).cpu()  # (raises for no such device, and meta)
    except Exception:
        fail(f"--device {name}: torch sees no such device here; use --device cpu")
    if device.type == "cuda":
        why = no_kernel(device)
        if why:
            fail(f"--device {name}: {why}; use --device cpu")
        torch.cuda.set_device(device)
    if device.type == "cpu" and platform.libc_ver()[0] == "glibc":
        # glibc keeps freed memory, not giving large tensors' pages back to fault in at
        # each step: 1.2-1.4x tokens/s at m = 2
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: no trim
        libc.mallopt(-2, 2**28)  # M_TOP_PAD: grow the heap 256 MB at a time
    return device


def no_kernel(device):
    """None once a kernel ran on the GPU, else why not: "" where torch or the machine
    has no CUDA at all, torch's warning where it has (as with a driver too old), or the
    build has no kernels for the card's compute capability, and what to install."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not torch.cuda.is_available():
            return str(caught[0].message).splitlines()[0] if caught else ""
    try:
        torch.ones(1, device=device).add_(1).item()  # (waited for: its error is here)
        return None
    except RuntimeError as e:
        major, minor = torch.cuda.get_device_capability(device)
        built = " ".join(torch.cuda.get_arch_list())
        return (
            f"torch {torch.__version__} cannot run on this GPU ({first_line(e)}): "
            f"its compute capability is {major}.{minor}, the build's kernels are for "
            f"{built}; install a PyTorch build that lists sm_{major}{minor}"
        )


def first_line(error):
    """The first error of the chain an exception ends, as one line."""
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def ddp(model, device):
    """Under torchrun the model DDP wraps, in a process group (NCCL between GPUs, else
    gloo) and a gloo group for the flags agreed on between the batches; else itself."""
    if WORLD == 1:
        return model
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    CPU_GROUP["group"] = dist.new_group(backend="gloo")
    return DDP(model)


def precision(device, dtype, tf32=True):
    """Autocast to --dtype, the loss scaler (float16's), and CUDA's TF32 matmuls."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    cache = device.type != "cuda"  # (CUDA graphs want no autocast cache)
    cast = contextlib.nullcontext()
    if dtype != "float32":
        cast = torch.autocast(device.type, getattr(torch, dtype), cache_enabled=cache)
    return cast, torch.amp.GradScaler(device.type, enabled=dtype == "float16")


def computed(device, args):
    """How the run computes, for run.json: TF32 where the card has it (8.0 and up)."""
    tf32 = device.type == "cuda" and args.tf32
    tf32 = tf32 and torch.cuda.get_device_capability(device) >= (8, 0)
    matmul = "tf32" if tf32 else "ieee"
    # (torch's version a plain str: weights_only loads it)
    how = dict(device=str(device), torch=str(torch.__version__), dtype=args.dtype)
    how.update(float32_matmul=matmul, fir_matmul=matmul if fir.ALLOW_TF32 else "ieee")
    if device.type == "cuda":
        how["device_name"] = torch.cuda.get_device_name(device)
    return how


def peak_memory(device):
    """(bytes, what): the most CUDA's tensors held, else the process's peak resident."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak CUDA memory allocated"
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":  # (ru_maxrss: kB on Linux, bytes on macOS)
        kb /= 1024
    return int(kb * 1024), "peak resident memory"


def make_step(step, optimizer, args, device, how):
    """The step, named in how: on CUDA captured in a graph (DDP, float16: eager)."""
    how["step"] = "eager"
    eager = WORLD > 1 or args.dtype == "float16"
    if device.type == "cuda" and args.cuda_graph and not eager:
        step = CapturedStep(step, optimizer, how)
        how["step"] = "CapturedStep"
    return step


class CapturedStep:
    """step(x, y) replayed from a CUDA graph, bit for bit the eager step: 3 eager calls
    on a side stream, then the recording; AdamW is made capturable for it alone (an
    eager step runs faster without). A recording that fails in Python goes on eagerly
    (said in `how`, run.json's, when given); one that CUDA fails stops the run."""

    def __init__(self, step, optimizer, how=None):
        self.step = step
        self.optimizer = optimizer
        self.how = how
        self.warmup = 3
        self.graph = None
        self.stream = torch.cuda.Stream()

    def __call__(self, x, y):
        if self.warmup > 0:
            self.warmup -= 1
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                loss = self.step(x, y)
            torch.cuda.current_stream().wait_stream(self.stream)
            return loss
        if self.graph is None:  # recording runs nothing
            try:
                self.record(x, y)
            except Exception as error:
                if self.how is None:
                    raise
                return self.fall_back(error, x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.loss.clone()

    def record(self, x, y):
        """The step recorded on the side stream. capture_end raises where CUDA failed
        the capture: the caching allocator may then be left in its capture mode (as
        PyTorch's CUDAGraph::reset says), where no eager step may run: the run stops
        with the first error of the chain."""
        self.x, self.y = x.clone(), y.clone()  # the static inputs
        for group in self.optimizer.param_groups:
            group["capturable"] = True
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # as torch.cuda.graph: no warm-up's cached block kept reserved beside the pool
        torch.cuda.empty_cache()
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin()
            try:
                self.loss = self.step(self.x, self.y)
            finally:
                try:
                    self.graph.capture_end()
                except Exception as error:
                    why = first_line(error)
                    fail(f"{NO_GRAPH} ({why}); --no-cuda_graph runs it eagerly")
                for group in self.optimizer.param_groups:  # (recorded: the graph's)
                    group["capturable"] = False

    def fall_back(self, error, x, y):
        """Eager from now on, said on the console and in run.json; the graph freed."""
        why = first_line(error)
        say(f"{NO_GRAPH} ({why}); it runs eagerly")
        self.how["step"] = f"eager, the capture failed ({why})"
        self.graph.reset()
        self.graph = None
        torch.cuda.empty_cache()
        self.optimizer.zero_grad(set_to_none=True)  # (the recording's, not computed)
        self.warmup = math.inf  # eager, on the side stream, from now on
        return self(x, y)


# ---- train.py's main -----------------------------------------------------------------
def run_command(settings, may_change, train, argv=None):
    """train.py's command, around train(args, ckpt, start_time): every failure one
    line with what stays, and the process group torn down together."""
    start_time = started()  # --time_limit counts from here
    with contextlib.suppress(AttributeError):  # (a stream that is no TextIOWrapper)
        sys.stdout.reconfigure(errors="backslashreplace")  # a path it cannot show: \xe9
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    handlers = {s: signal.getsignal(s) for s in signals}
    try:
        args = build_parser(settings).parse_args(argv)
        args.out_dir = args.out_dir or default_out_dir(args, settings)
        with RunFolder(args.out_dir) as folder:
            ckpt = checkpoint_to_resume(args, argv, settings, may_change, folder)
            args.data_dir = os.path.abspath(args.data_dir)
            start = ckpt["iter"] if ckpt else 0
            if ckpt and MASTER:  # log.csv or run.json lost, or behind (a kill -9)
                folder.write("log.csv", LOG_HEADER + "".join(ckpt["log"]))
                info = {k: v for k, v in ckpt.items() if k not in CKPT_ONLY}
                folder.write("run.json", json.dumps(info, indent=1) + "\n")
            if start >= args.max_iters:
                say(f"{args.out_dir} is at batch {start}: nothing to train")
                return 0
            for s in signals:  # one ignored as the run began stays so (nohup's SIGHUP)
                if handlers[s] is not signal.SIG_IGN:
                    signal.signal(s, ask_to_stop)
            return train(args, ckpt, start_time)
    except SystemExit as e:  # fail() or a bad flag (the line is printed), or --help
        return e.code
    except KeyboardInterrupt:  # a second Ctrl-C
        say(f"\naborted; {kept(args.out_dir)}")
        return 130
    except OSError as e:  # a full disk, a lost folder
        fail(f"cannot write {e.filename} ({e.strerror}); {kept(args.out_dir)}")
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        batch = THIS_RUN["batch"]
        where = "building the model" if batch is None else f"at batch {batch}"
        shrink = "--n_layer, --n_embd" if batch is None else "--batch_size"
        if THIS_RUN["validating"]:  # (batch: the next to train)
            where = f"in the validation after batch {batch - 1}"
            shrink = "--eval_batches, --batch_size"
        left = kept(args.out_dir)
        fail(f"out of memory {where}: use a smaller {shrink} or --block_size; {left}")
    finally:
        STOP["signal"] = None
        THIS_RUN.update(batch=None, stderr=False, validating=False)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            # tear the process group down together (gloo may abort if one leaves early)
            dist.barrier()
            dist.destroy_process_group()


def started():
    """When the command started: under torchrun, torchrun's (the workers' parent's,
    its age read from Linux's /proc, on the clock that counts from boot), so that a
    --time_limit counts torchrun's own start and the workers'; else now."""
    now = time.time()
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # (set by torchrun for its workers)
        return now
    with contextlib.suppress(OSError, ValueError):  # (not Linux: from now)
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return now - age
    return now


def out_of_memory(error):
    """Whether memory ran out (torch's CPU allocator: a RuntimeError that says so)."""
    cpu = "can't allocate memory" in str(error)
    return cpu or isinstance(error, (torch.OutOfMemoryError, MemoryError))
