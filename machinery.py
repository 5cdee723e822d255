"""
The run's machinery, beside the experiment of train.py: what keeps a run safe, exact
and honest about how it computed. Each guarantee is a function (or a class) that says
it in its docstring:

- the command line: Table 1's settings name the run's folder; a bad flag is one line
- the data: train.bin, val.bin and the tokenizer, each checked against meta.json
- the run folder: made and locked; it holds one run; its files are written whole
- ckpt.pt: plain dicts and tensors; --resume takes the run's settings from it and goes
  on bit for bit
- stopping: Ctrl-C, kill, a closed terminal and --time_limit stop at a checkpoint
- the console and log.csv: a line at each log point, with the pace and an ETA
- the device, precision, the step captured in a CUDA graph, DDP's processes, peak
  memory; every failure one line that says what stays
"""

import argparse
import base64
import ctypes
import fcntl  # (Linux and macOS, as resource: train.py runs on Unix; Windows: WSL)
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
from contextlib import contextmanager, nullcontext
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
TOKENIZER_FILE = "tokenizer.tiktoken"  # prepare_data.py's, in the data folder
LOG_HEADER = "iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n"
# the files of a run, and what our tools draw from it: --overwrite removes them
RUN_FILES = ("ckpt.pt", "log.csv", "run.json", "loss.png", "taps.png")


def fail(msg):
    """Bad input: one line on stderr, what is wrong and what to do; exit 1, no trace."""
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


def atomic_write(path, data):
    """data (bytes or str) whole at path, or nothing there: a temporary file first,
    then renamed over path; an error names path, not the temporary file."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


# ---- the command line ----------------------------------------------------------------
def bounded(kind, low, high=math.inf):
    """An argparse type: a number of this kind in [low, high)."""

    def number(text):
        value = kind(text)
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


def dtype(text):
    """An argparse type: the autocast dtype's name."""
    if text not in ("float32", "bfloat16", "float16"):
        raise argparse.ArgumentTypeError(f"{text!r}: use float32, bfloat16 or float16")
    return text


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
        if kind is bool:
            on_off = argparse.BooleanOptionalAction
            p.add_argument(f"--{name}", action=on_off, default=default, help=about)
        else:
            p.add_argument(f"--{name}", type=kind, default=default, help=about)
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
        # (Python's shortest exact form, 0.0 as 0)
        name += f"-{symbol}{str(v).removesuffix('.0')}"
    return os.path.join("out", name)


def check_mixer(cfg):
    """cfg, once its mixer is a module of the config that keeps x's shape; one line if
    not, or if the mixer refuses the config (a ValueError: heads not dividing d)."""
    try:
        mixer = find_mixer(cfg.mixer)(cfg)
        x = torch.zeros(1, 2, cfg.n_embd)  # (B, t, d)
        assert mixer(x, None).shape == x.shape, "not x's shape"
    except ValueError as e:  # an unknown name, or settings the mixer refuses
        fail(str(e))
    except Exception as e:  # not a module of the config that maps x to x's shape
        fail(
            f"--mixer {cfg.mixer} is not a mixer ({type(e).__name__}: {e}): a mixer is "
            "an nn.Module of the config whose forward(x, cache) keeps x's shape"
        )
    return cfg


# ---- the data ------------------------------------------------------------------------
def checked_file(data_dir, name, key):
    """data_dir/name's path and bytes, and meta.json, once its sha256 is meta[key]."""
    path = os.path.join(data_dir, name)
    meta_path = os.path.join(data_dir, "meta.json")
    try:
        meta = json.loads(Path(meta_path).read_text())
        data = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # no such file, not JSON
        missing = getattr(e, "filename", None) or meta_path
        fail(f"{missing} is missing or damaged: run prepare_data.py first")
    if hashlib.sha256(data).hexdigest() != meta.get(key):
        fail(f"{path} is not the file meta.json describes: re-run prepare_data.py")
    return path, data, meta


def load_tokenizer(data_dir):
    """data_dir's tokenizer as a tiktoken.Encoding, checked by meta.json: prepare_data's
    ranks and split pattern, <|endoftext|> after the ranks."""
    _, data, meta = checked_file(data_dir, TOKENIZER_FILE, "tokenizer_sha256")
    lines = [line.split() for line in data.splitlines()]  # base64(token) rank
    ranks = {base64.b64decode(token): int(rank) for token, rank in lines}
    special = {"<|endoftext|>": len(ranks)}
    return tiktoken.Encoding(
        "bpe",
        pat_str=meta["split_pattern"],
        mergeable_ranks=ranks,
        special_tokens=special,
    )


def load_data(data_dir, block_size, batch_size):
    """train and val tokens memory-mapped, checked against meta.json, and their
    fingerprint (the vocabulary and the files' sha256) for ckpt.pt."""
    tokens = []
    # a batch of windows of l + 1 tokens in train.bin, one in val.bin
    for split, need in (("train", block_size + batch_size), ("val", block_size + 1)):
        path, raw, meta = checked_file(data_dir, f"{split}.bin", f"{split}_sha256")
        n = len(raw) // 2
        if n < need:
            fail(f"{path}: {n} tokens, fewer than one batch ({need}): use a smaller l")
        tokens.append(np.memmap(path, dtype=np.uint16, mode="r"))
        top = int(tokens[-1].max())
        vocab_size = meta.get("vocab_size", 0)
        if top >= vocab_size:
            fail(
                f"{path} holds token {top} >= meta.json's vocab_size {vocab_size}:"
                " run prepare_data.py"
            )
    keys = ("vocab_size", "train_sha256", "val_sha256", "tokenizer_sha256")
    fingerprint = {k: meta.get(k) for k in keys}
    return tokens[0], tokens[1], fingerprint


# ---- the run folder and ckpt.pt ------------------------------------------------------
@contextmanager
def locked(out_dir):
    """The run folder, made, locked against a second train.py, without killed .*.tmp."""
    out = Path(out_dir)
    if out.is_file():
        fail(f"--out_dir {out_dir} is a file: pass a folder (the run's, or a new one)")
    made = not out.is_dir()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(
                f"{out_dir} is in use: a run of another train.py is in progress "
                "there; wait for it, or pick another --out_dir"
            )
        for tmp in out.glob(".*.tmp"):
            tmp.unlink()
        yield
    finally:
        os.close(fd)
        if made and not any(out.iterdir()):
            out.rmdir()


def checkpoint_to_resume(args, parser, argv, settings, may_change):
    """The checkpoint to resume (args then set from it), or None to start: one rule each
    way, a folder holds a run once a checkpoint (and log.csv) was written in it."""
    path = Path(args.out_dir, "ckpt.pt")
    has_ckpt = path.exists()
    has_log = path.with_name("log.csv").exists()
    if args.resume and not has_ckpt:
        how = "--overwrite starts the run again" if has_log else "drop --resume"
        fail(f"no checkpoint {path} to resume; {how}")
    if not (args.resume or args.overwrite) and (has_ckpt or has_log):
        how = "--resume continues it" if has_ckpt else "its ckpt.pt is gone"
        fail(
            f"{args.out_dir} holds a run ({how}; --overwrite starts it again); "
            "or pick another --out_dir"
        )
    if not args.resume:
        return None
    ckpt = load_checkpoint(path)
    saved = {k: v for k, v in ckpt["args"].items() if k in settings}
    vars(args).update(saved)
    parser.parse_args(argv, args)  # the flags given, over the saved settings
    differ = [k for k in saved if k not in may_change and vars(args)[k] != saved[k]]
    if differ:
        flags = ", ".join(f"--{k} {saved[k]}" for k in differ)
        fail(f"{path} was trained with {flags}: --resume keeps them; drop those flags")
    moved = not os.path.isdir(saved["data_dir"])  # (ckpt.pt keeps an absolute path)
    if moved and args.data_dir == saved["data_dir"]:
        fail(
            f"{path} was trained on the data in {saved['data_dir']}, which is gone: "
            "pass --data_dir with the folder where that data is now"
        )
    return ckpt


def load_checkpoint(path):
    """A ckpt.pt of train.py: plain dicts and tensors; one line if damaged."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"model", "config", "args", "iter", "data"} - set(ckpt)
        assert not missing, f"no {', '.join(sorted(missing))}"
    except Exception as e:
        why = textwrap.shorten(f"{type(e).__name__}: {e}", 100, placeholder=" ...")
        fail(f"cannot read {path} ({why}); it is damaged or not train.py's")
    return ckpt


def check_same_data(ckpt, data, args):
    """A resumed run trains on the data of its checkpoint (meta.json's sha256s)."""
    if ckpt and ckpt["data"] != data:
        fail(f"{args.out_dir}/ckpt.pt was trained on other data: pass its --data_dir")


def save_checkpoint(args, info, rows, model, optimizer, scaler):
    """ckpt.pt (run.json's info, log.csv's rows, all processes' RNG states), log.csv,
    run.json, each whole or none."""
    state = {"torch": torch.get_rng_state()}  # (dropout's; Python's random is unused)
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    rngs = [state] * WORLD
    if WORLD > 1:
        dist.all_gather_object(rngs, state)
    if not MASTER:
        return
    ckpt = dict(
        info,
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        scaler=scaler.state_dict(),
        rng=rngs,
        log=rows,
    )
    buffer = io.BytesIO()  # (a full disk then fails in the write: an OSError)
    torch.save(ckpt, buffer)
    out = Path(args.out_dir)
    atomic_write(out / "ckpt.pt", buffer.getvalue())
    atomic_write(out / "log.csv", LOG_HEADER + "".join(rows))
    atomic_write(out / "run.json", json.dumps(info, indent=1) + "\n")


def restore(ckpt, model, optimizer, scaler, device):
    """A resumed run's model, AdamW (as this device runs it), loss scaler and RNGs."""
    if ckpt["world_size"] != WORLD:
        fail(f"ckpt.pt was trained by {ckpt['world_size']} processes: run as many")
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
    """What a run that fails leaves, said as the folder is."""
    path = Path(out_dir, "ckpt.pt")
    if path.exists():
        return f"the last checkpoint, {path}, stays"
    return "no checkpoint was written"


# ---- the console, log.csv and when to stop -------------------------------------------
def say(line):
    """A console line at once, from process 0; a closed stdout (| head) is a signal."""
    if MASTER:
        try:
            print(line, flush=True)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            STOP["signal"] = STOP["signal"] or signal.SIGPIPE


def ask_to_stop(signum, frame):
    STOP["signal"] = signum
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: abort


class Progress:
    """A run's log and pace between the batches: the losses since the last log point
    (one buffer: a tensor kept per batch would split the block the logits freed, and
    the heap would grow by the logits' size each batch, pick_device's settings), the
    batches' end times, log.csv's rows (in ckpt.pt too), when to stop."""

    def __init__(self, args, ckpt, start_time, info):
        self.args, self.info, self.start_time = args, info, start_time
        self.start_iter = ckpt["iter"] if ckpt else 0
        self.rows = ckpt["log"] if ckpt else []  # log.csv's lines
        n = min(args.log_interval, args.max_iters - self.start_iter)
        device = info["computed"]["device"]
        self.losses = torch.zeros(n, device=device)  # since the last log point
        self.times = []  # when each of those batches ended, from the run's start
        self.pause = 5.0  # the longest log point's work, s (a guess until measured)
        self.since = time.time()  # the end of the last log point
        self.t0 = self.since - (ckpt["elapsed_s"] if ckpt else 0.0)  # (its time counts)
        if MASTER and args.overwrite:
            for name in RUN_FILES:  # the old run's, once the new one could start
                Path(args.out_dir, name).unlink(missing_ok=True)

    def batch_done(self, loss):
        """The batch's loss (a tensor on the device, not read) and its end."""
        self.losses[len(self.times)] = loss
        self.times.append(time.time() - self.t0)

    def must_stop(self, evaluates_next):
        """Whether batch `it` must be the last, in every process alike: a signal came,
        or from train.py's start the time limit leaves no room for 2 batches, the next
        validation (if the next batch has one) and a log point."""
        signalled = STOP["signal"] is not None
        return any_process(signalled or self.out_of_time(evaluates_next))

    def out_of_time(self, evaluates_next):
        if self.args.time_limit is None:
            return False
        now = self.t0 + self.times[-1]
        per_batch = (now - self.since) / len(self.times)
        batches = 2 + self.args.eval_batches * evaluates_next
        elapsed = now - self.start_time
        return elapsed + batches * per_batch + self.pause > self.args.time_limit

    def log(self, it, val):
        """log.csv's rows since the last log point and a console line with the pace and
        the ETA; a cost that is nan or inf stops the run."""
        args, n = self.args, len(self.times)
        costs = mean_over_processes(self.losses[:n]).tolist()  # (DDP: the batch's)
        now = self.t0 + self.times[-1]
        tok_s = n * args.batch_size * args.block_size / (now - self.since)
        eta = (args.max_iters - it) * (now - self.start_time) / (it - self.start_iter)
        for i, (cost, t) in enumerate(zip(costs, self.times), it - n + 1):
            if not math.isfinite(cost):
                fail(
                    f"the training cost became {cost} at batch {i}; "
                    f"{kept(args.out_dir)}. Start again (--overwrite) with a smaller "
                    "--lr or with --grad_clip"
                )
            val_i = repr(val) if i == it and val is not None else ""
            self.rows.append(f"{i},{cost!r},{val_i},{args.lr},{tok_s:.1f},{t:.3f}\n")
        line = f"iter {it}/{args.max_iters} | loss {np.mean(costs):.4f}"
        if val is not None:
            line += f" | val {val:.4f}"
        line += f" | {tok_s / 1e3:.1f}k tok/s | elapsed {fmt_time(self.times[-1])}"
        say(f"{line} | ETA {fmt_time(eta)}")

    def save(self, it, model, optimizer, scaler):
        """ckpt.pt, log.csv and run.json, with this session's peak memory."""
        peak, what = peak_memory(self.losses.device)
        info = self.info
        info.update(peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what)
        info.update(iter=it, elapsed_s=time.time() - self.t0)
        save_checkpoint(self.args, info, self.rows, model, optimizer, scaler)

    def log_point_done(self):
        """The pace counts again from here; the longest log point's work is kept."""
        self.pause = max(self.pause, time.time() - self.t0 - self.times[-1])
        self.times = []
        self.since = time.time()

    def finish(self, it, stop):
        """The last lines: the peak memory and what ended the run; its exit status."""
        peak, what = peak_memory(self.losses.device)
        say(f"{what}: {peak / 2**30:.2f} GB")
        if not stop:
            plot = f"python experiments/plot.py {self.args.out_dir}"
            say(f"done: {plot} draws its losses")
            return 0
        signum = STOP["signal"]
        why = "--time_limit" if signum is None else signal.Signals(signum).name
        say(f"{why}: stopped at batch {it} with a checkpoint; go on with --resume")
        return 0 if signum is None else 128 + signum


def any_process(flag):
    """Whether any process's flag is set (under DDP each calls this at one point),
    over a CPU process group: it waits for no GPU."""
    if WORLD == 1:
        return flag
    t = torch.tensor(float(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=CPU_GROUP["group"])
    return t.item() > 0


def mean_over_processes(t):
    """Under DDP the mean of t over the processes (each calls this at one point)."""
    if WORLD > 1:
        t = t / WORLD
        dist.all_reduce(t)
    return t


# ---- the device, precision, the step -------------------------------------------------
def pick_device(name):
    """--device as a torch.device (auto: cuda, else cpu); one line if there is none."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":  # under torchrun: this process's GPU
        name = f"cuda:{LOCAL_RANK}"
    try:
        device = torch.device(name)
        torch.empty(0, device=device)  # (raises if torch has no such device)
    except Exception:
        fail(f"--device {name}: torch sees no such device here; use --device cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu" and platform.libc_ver()[0] == "glibc":
        # glibc keeps freed memory, not giving large tensors' pages back to fault in at
        # each step: 1.4x tokens/s at m = 2
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: no trim
        libc.mallopt(-2, 2**28)  # M_TOP_PAD: grow the heap 256 MB at a time
    return device


def start_processes(device):
    """Under torchrun, the process group (NCCL between GPUs, else gloo) and a gloo group
    beside it for the flags the processes agree on between the batches."""
    if WORLD > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        CPU_GROUP["group"] = dist.new_group(backend="gloo")


def ddp(model):
    """The model as DDP wraps it under torchrun (one device a process), else itself."""
    return DDP(model) if WORLD > 1 else model


def precision(device, dtype, tf32=True):
    """Autocast to --dtype, the loss scaler (float16's), and CUDA's TF32 matmuls."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    cache = device.type != "cuda"  # (CUDA graphs want no autocast cache)
    cast = nullcontext()
    if dtype != "float32":
        cast = torch.autocast(device.type, getattr(torch, dtype), cache_enabled=cache)
    return cast, torch.amp.GradScaler(device.type, enabled=dtype == "float16")


def computed(device, args):
    """How the run computes, for run.json."""
    tf32 = "tf32" if device.type == "cuda" and args.tf32 else "ieee"
    how = dict(
        device=str(device),
        torch=str(torch.__version__),  # (a plain str: weights_only loads it)
        dtype=args.dtype,
        float32_matmul=tf32,
        fir_matmul=tf32 if fir.ALLOW_TF32 else "ieee",
    )
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
    on a side stream, then the recording (failed, with `how` given: eager from then)."""

    def __init__(self, step, optimizer=None, how=None):
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
            self.x, self.y = x.clone(), y.clone()  # the static inputs
            try:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    self.loss = self.step(self.x, self.y)
            except Exception as error:
                if self.how is None:
                    raise
                return self.fall_back(error, x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.loss.clone()

    def fall_back(self, error, x, y):
        """The eager step from now on, said on the console and in run.json."""
        why = f"{type(error).__name__}: {error}".splitlines()[0]
        say(f"the step cannot be captured in a CUDA graph ({why}); it runs eagerly")
        self.how["step"] = f"eager, the capture failed ({why})"
        self.optimizer.zero_grad(set_to_none=True)  # (the recording's, not computed)
        self.warmup = math.inf  # eager, on the side stream, from now on
        return self(x, y)


# ---- train.py's main -----------------------------------------------------------------
def run_command(settings, may_change, train, argv=None):
    """train.py's command: the flags, the run folder locked, a resume or a fresh start,
    the signals that stop at a checkpoint, then train(args, ckpt, start_time); every
    failure one line with what stays, and the process group torn down together."""
    start_time = time.time()  # --time_limit counts from here
    parser = build_parser(settings)
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    handlers = {s: signal.getsignal(s) for s in signals}
    try:
        args = parser.parse_args(argv)
        args.out_dir = args.out_dir or default_out_dir(args, settings)
        with locked(args.out_dir) if MASTER else nullcontext():
            ckpt = checkpoint_to_resume(args, parser, argv, settings, may_change)
            args.data_dir = os.path.abspath(args.data_dir)
            start = ckpt["iter"] if ckpt else 0
            if start >= args.max_iters:
                say(f"{args.out_dir} is at batch {start}: nothing to train")
                return 0
            for s in signals:
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
        cpu = "can't allocate memory" in str(e)  # (torch's CPU allocator)
        if not (cpu or isinstance(e, (torch.OutOfMemoryError, MemoryError))):
            raise
        fail(f"out of memory: use a smaller --batch_size; {kept(args.out_dir)}")
    finally:
        STOP["signal"] = None
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            # tear the process group down together (gloo may abort if one leaves early)
            dist.barrier()
            dist.destroy_process_group()
