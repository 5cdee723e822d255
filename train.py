"""Train a language model whose first sublayer is a token mixer of extractor.py (the
paper's Section 6): Table 1's run, a longer run of out/me, a run that stops at a
checkpoint before 40 minutes, one run over 4 GPUs (DDP).

    python prepare_data.py && python train.py --mixer=me
    python train.py --mixer=me --max_iters=80000 --resume
    python train.py --mixer=she --time_limit=40m
    torchrun --standalone --nproc_per_node=4 train.py --mixer=she

Every run sees the same batches, seeded by --data_seed alone. The run folder holds
run.json, ckpt.pt (all --resume needs to go on bit for bit) and log.csv, written with
each checkpoint. Ctrl-C, kill, a closed terminal and --time_limit stop at a checkpoint.
"""

import argparse
import ctypes
import dataclasses
import fcntl  # (Linux and macOS, as resource: train.py runs on Unix; Windows: WSL)
import functools
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
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fir
from extractor import Config, Transformer, find_mixer
from prepare_data import atomic_write, fail, fmt_time, load_data

# DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
MASTER = RANK == 0
STOP = {"signal": None}  # set by Ctrl-C, kill, a closed terminal or stdout
LOG_HEADER = "iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n"
# the files of a run, and what our tools draw from it: --overwrite removes them
RUN_FILES = ("ckpt.pt", "log.csv", "run.json", "loss.png", "taps.png")


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


COUNT = bounded(int, 1)
NATURAL = bounded(int, 0)
NON_NEGATIVE = bounded(float, 0)
FRACTION = bounded(float, 0, 1)
SEED = bounded(int, 0, 2**63)
# the settings that name a run: flag -> (its symbol, Table 1's value, what, its type)
TABLE_1 = {
    "n_layer": ("m", 18, "number of layers", int),
    "block_size": ("l", 128, "context length", int),
    "n_embd": ("d", 128, "dimension of the model", int),
    "n_hidden": ("c", 512, "nodes in the FFN's hidden layer", int),
    "n_head": ("n", 32, "heads of self-attention (and of the Synthesizers)", int),
    "dropout": ("p", 0.1, "dropout rate", float),
    "batch_size": ("b", 64, "batch size, over all processes", COUNT),
    "lr": ("lr", 1e-3, "AdamW's learning rate gamma, constant", NON_NEGATIVE),
    "beta1": ("bm", 0.9, "AdamW's beta_1", FRACTION),
    "beta2": ("bv", 0.999, "AdamW's beta_2", FRACTION),
    "weight_decay": ("wd", 0.01, "AdamW's weight decay (PyTorch's)", NON_NEGATIVE),
    "grad_clip": ("clip", 0.0, "clip gradients' norm to this; 0: off", NON_NEGATIVE),
    "seed": ("seed", 1337, "seed of the initialisation and of dropout", SEED),
    "data_seed": ("dseed", 1337, "seed of the batch order", NATURAL),
}
# the other flags with a value: flag -> (its type, default, what it is)
FLAGS = {
    "mixer": (str, "sa", "sa, she, we, he, me, he-ext, a Synthesizer or module.Class"),
    "max_iters": (NATURAL, 60000, "batches to train on (%(default)s)"),
    "time_limit": (seconds, None, "stop at a checkpoint before this: 90s, 40m, 2h"),
    "eval_interval": (COUNT, 1000, "validation every this many batches (%(default)s)"),
    "eval_batches": (NATURAL, 20, "batches of validation (%(default)s); 0: none"),
    "ckpt_interval": (COUNT, 1000, "ckpt.pt and log.csv every this many batches"),
    "log_interval": (COUNT, 100, "a console line every this many batches"),
    "data_dir": (str, "data", "prepare_data.py's train.bin, val.bin, meta.json"),
    "out_dir": (str, "", "the run folder (default: out/<mixer>-<changed settings>)"),
    "device": (str, "auto", "auto (cuda, else cpu), cpu, cuda, cuda:1, mps"),
}
# --resume takes every setting from ckpt.pt but these; the data must be the same
MAY_CHANGE = {
    "max_iters",
    "eval_interval",
    "ckpt_interval",
    "log_interval",
    "data_dir",
    "device",
}
# and these come from the command alone, never from ckpt.pt
THIS_COMMAND = {"out_dir", "resume", "overwrite", "time_limit", "cuda_graph"}


def build_parser():
    p = argparse.ArgumentParser(description="Train a language model with a token mixer")
    p.error = lambda msg: fail(f"{msg} (see python train.py --help)")
    for name, (symbol, value, text, kind) in TABLE_1.items():
        about = f"{symbol}: {text} ({value})"  # as Table 1 writes it
        p.add_argument(f"--{name}", type=kind, default=value, help=about)
    for name, (kind, value, text) in FLAGS.items():
        p.add_argument(f"--{name}", type=kind, default=value, help=text)
    one_of = p.add_mutually_exclusive_group()
    one_of.add_argument("--resume", action="store_true", help="go on with its run")
    one_of.add_argument("--overwrite", action="store_true", help="start out_dir again")
    dtypes = ["float32", "bfloat16", "float16"]
    p.add_argument("--dtype", default="float32", choices=dtypes, help="autocast")
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--tf32", action=on_off, default=True, help="CUDA: TF32 matmuls")
    p.add_argument("--cuda_graph", action=on_off, default=True, help="CUDA: graph step")
    return p


def check_model(args):
    """The model's Config (vocab_size 1 for now), --mixer a mixer; one line if not."""
    if args.batch_size % WORLD:
        fail(f"--batch_size {args.batch_size} must divide among {WORLD} processes")
    given = {k: v for k, v in vars(args).items() if k in Config.__dataclass_fields__}
    try:
        cfg = Config(vocab_size=1, **given)
    except ValueError as e:
        fail(str(e))
    x = torch.zeros(1, 2, cfg.n_embd)  # (B, t, d)
    try:
        assert find_mixer(cfg.mixer)(cfg)(x, None).shape == x.shape, "not x's shape"
    except Exception as e:  # not a module of the config that maps x to x's shape
        fail(
            f"--mixer {cfg.mixer} is not a mixer ({type(e).__name__}: {e}): a mixer is "
            "an nn.Module of the config whose forward(x, cache) keeps x's shape"
        )
    return cfg


# ---- the batches, the model and the step ---------------------------------------------
@functools.lru_cache(maxsize=1)
def epoch_permutation(n_starts, data_seed, epoch):
    """A permutation of 0..n_starts-1 seeded by (data_seed, epoch) alone."""
    state = np.random.SeedSequence([data_seed, epoch]).generate_state(1, np.uint64)
    generator = torch.Generator().manual_seed(int(state[0]))
    return torch.randperm(n_starts, generator=generator)  # (n_starts,)


def batch_starts(i, n_starts, batch_size, data_seed):
    """Batch i's starts: slice i of its epoch's permutation (the rest skipped)."""
    epoch, j = divmod(i, n_starts // batch_size)
    starts = epoch_permutation(n_starts, data_seed, epoch)
    return starts[j * batch_size : (j + 1) * batch_size]


def get_batch(data, starts, block_size, device):
    """Windows of l+1 tokens at this process's part of the starts: x their first l
    tokens, y shifted by one."""
    mine = starts.chunk(WORLD)[RANK]  # (b / WORLD,)
    windows = [data[s : s + block_size + 1] for s in mine.tolist()]
    w = torch.from_numpy(np.stack(windows).astype(np.int64))  # (b, l + 1)
    pin = device.type == "cuda"  # pinned: the copy to the GPU runs beside the step
    if pin:
        w = w.pin_memory()
    w = w.to(device, non_blocking=pin)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # x (b, l), y (b, l)


def build_model(cfg, args, device):
    """The Transformer, the same in every process, then a dropout stream each; AdamW."""
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + RANK)
    cuda = device.type == "cuda"  # fused, and capturable: the captured step needs it
    adamw = torch.optim.AdamW(
        model.parameters(),
        args.lr,
        (args.beta1, args.beta2),
        1e-8,
        args.weight_decay,
        fused=cuda,
        capturable=cuda,
    )
    return model, adamw


def train_step(model, optimizer, scaler, ctx, x, y, grad_clip=0.0):
    """One batch: forward, the loss, backward, clipping if on, AdamW; the loss."""
    with ctx:
        _, loss = model(x, y)  # the mean cross-entropy of the batch, Eq. (3)
    # (only float16 scales its loss; else scale and unscale_ do nothing)
    scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_step(model, optimizer, scaler, ctx, args, device, how):
    """The step, named in how: on CUDA captured in a graph (DDP, float16: eager)."""
    step = functools.partial(
        train_step, model, optimizer, scaler, ctx, grad_clip=args.grad_clip
    )
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


# ---- the run -------------------------------------------------------------------------
def train(args, ckpt, start, started):
    """The data, the model, then batch, step, and at a log point evaluate, log, stop."""
    cfg = check_model(args)  # (the checkpoint's settings too), before the data
    train_data, val_data, data = load_data(
        args.data_dir, args.block_size, args.batch_size
    )
    if ckpt and ckpt["data"] != data:  # (meta.json's sha256s and vocab_size)
        fail(f"{args.out_dir}/ckpt.pt was trained on other data: pass its --data_dir")
    device = pick_device(args.device)
    if WORLD > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx, scaler = precision(device, args.dtype, args.tf32)
    cfg = dataclasses.replace(cfg, vocab_size=data["vocab_size"])
    raw_model, optimizer = build_model(cfg, args, device)
    if ckpt:
        restore(ckpt, raw_model, optimizer, scaler, device)
    # DDP's module on one device: device_ids may be None
    model = DDP(raw_model) if WORLD > 1 else raw_model
    how = computed(device, args)
    step = make_step(model, optimizer, scaler, ctx, args, device, how)
    info = dict(  # run.json
        config=dataclasses.asdict(cfg),
        args=vars(args),
        data=data,
        params=raw_model.param_counts(),
        world_size=WORLD,
        computed=how,
    )
    rows = ckpt["log"] if ckpt else []  # log.csv's lines, in ckpt.pt too
    if MASTER and args.overwrite:
        for name in RUN_FILES:  # the old run's
            Path(args.out_dir, name).unlink(missing_ok=True)
    say(f"{cfg}")
    say(f"training from batch {start} to {args.max_iters} into {args.out_dir}")
    say(f"computed: {how}")
    n_starts = len(train_data) - args.block_size
    # the batches' losses since the last log point in one buffer: a tensor kept per
    # batch would split the block the logits freed, and the heap would grow by the
    # logits' size each batch (pick_device's allocator settings)
    losses = torch.zeros(min(args.log_interval, args.max_iters - start), device=device)
    done = []  # when each of them ended, from the run's start
    pause = 5.0  # the longest log point's work, s (a guess until one is measured)
    since = time.time()  # the end of the last log point
    t0 = since - (ckpt["elapsed_s"] if ckpt else 0.0)  # (a resumed run's time counts)
    for it in range(start + 1, args.max_iters + 1):  # it: the batches done after it
        starts = batch_starts(it - 1, n_starts, args.batch_size, args.data_seed)
        x, y = get_batch(train_data, starts, args.block_size, device)  # (b, l), (b, l)
        losses[len(done)] = step(x, y)
        now = time.time()
        done.append(now - t0)
        per_batch = (now - since) / len(done)
        stop = must_stop(args, it, now - started, per_batch, pause)
        evaluate_now = evaluates(args, it)
        ckpt_now = it % args.ckpt_interval == 0 or it == args.max_iters
        log_now = evaluate_now or ckpt_now or it % args.log_interval == 0
        stop_now = stop and WORLD == 1  # (under DDP, all stop at a log point)
        if not (log_now or stop_now):
            continue
        val = evaluate(model, args, val_data, device, ctx) if evaluate_now else None
        # (DDP: any process's)
        stop = mean_over_processes(torch.tensor(float(stop), device=device)).item() > 0
        costs = mean_over_processes(losses[: len(done)]).tolist()  # (DDP: the batch's)
        tok_s = len(done) * args.batch_size * args.block_size / (now - since)
        eta = (args.max_iters - it) * (now - started) / (it - start)  # at this pace
        rows += log(args, it, costs, done, val, tok_s, eta)
        if ckpt_now or stop:
            peak, what = peak_memory(device)  # (this session's)
            info.update(
                peak_memory_mb=round(peak / 2**20, 1),
                peak_memory_is=what,
                iter=it,
                elapsed_s=time.time() - t0,
            )
            save_checkpoint(args, info, rows, raw_model, optimizer, scaler)
        if stop:
            break
        pause = max(pause, time.time() - now)
        done = []
        since = time.time()
    say(f"{what}: {peak / 2**30:.2f} GB")
    if not stop:
        say(f"done: python experiments/plot.py {args.out_dir} draws its losses")
        return 0
    signum = STOP["signal"]
    why = "--time_limit" if signum is None else signal.Signals(signum).name
    say(f"{why}: stopped at batch {it} with a checkpoint; go on with --resume")
    return 0 if signum is None else 128 + signum


@torch.no_grad()
def evaluate(model, args, val_data, device, ctx):
    """The mean loss, dropout off, over the same windows each time, spread evenly."""
    n = args.eval_batches * args.batch_size
    last = len(val_data) - args.block_size - 1
    starts = torch.from_numpy(np.linspace(0, last, n).round().astype(np.int64))
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for batch in starts.split(args.batch_size):
        x, y = get_batch(val_data, batch, args.block_size, device)
        with ctx:
            total += model(x, y)[1].float()
    model.train(was_training)
    return mean_over_processes(total).item() / args.eval_batches


def mean_over_processes(t):
    """Under DDP the mean of t over the processes (each calls this at one point)."""
    if WORLD > 1:
        t = t / WORLD
        dist.all_reduce(t)
    return t


def evaluates(args, it):
    """Whether batch `it` ends with a validation: every eval_interval, and the last."""
    at = it % args.eval_interval == 0 or it == args.max_iters
    return args.eval_batches > 0 and at


def must_stop(args, it, elapsed, per_batch, pause):
    """Whether batch `it` must be the last: a signal came, or from train.py's start the
    time limit leaves no room for 2 batches, the next validation and a log point."""
    if STOP["signal"]:
        return True
    if args.time_limit is None:
        return False
    batches = 2 + args.eval_batches * evaluates(args, it + 1)
    return elapsed + batches * per_batch + pause > args.time_limit


def log(args, it, costs, times, val, tok_s, eta):
    """log.csv's rows since the last log point, a console line; nan or inf: stop."""
    rows = []
    for i, (cost, t) in enumerate(zip(costs, times), it - len(costs) + 1):
        if not math.isfinite(cost):
            fail(
                f"the training cost became {cost} at batch {i}; {kept(args.out_dir)}. "
                "Start again (--overwrite) with a smaller --lr or with --grad_clip"
            )
        val_i = repr(val) if i == it and val is not None else ""
        rows.append(f"{i},{cost!r},{val_i},{args.lr},{tok_s:.1f},{t:.3f}\n")
    line = f"iter {it}/{args.max_iters} | loss {np.mean(costs):.4f}"
    if val is not None:
        line += f" | val {val:.4f}"
    line += f" | {tok_s / 1e3:.1f}k tok/s | elapsed {fmt_time(times[-1])}"
    say(f"{line} | ETA {fmt_time(eta)}")
    return rows


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


# ---- the run folder, ckpt.pt, the console -------------------------------------------
def default_out_dir(args):
    """out/<mixer> (sa-<n>), -<symbol><value> per setting not Table 1's: out/me-l64."""
    name = f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer
    for flag, (symbol, value, _, _) in TABLE_1.items():
        v = getattr(args, flag)
        if v == value or flag == "n_head" and args.mixer == "sa":
            continue
        # (Python's shortest exact form, 0.0 as 0)
        name += f"-{symbol}{str(v).removesuffix('.0')}"
    return os.path.join("out", name)


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


def judge(args, parser, argv):
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
    saved = {k: v for k, v in ckpt["args"].items() if k not in THIS_COMMAND}
    vars(args).update(saved)
    parser.parse_args(argv, args)  # the flags given, over the saved settings
    differ = [k for k in saved if k not in MAY_CHANGE and vars(args)[k] != saved[k]]
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


def kept(out_dir):
    """What a run that fails leaves, said as the folder is."""
    path = Path(out_dir, "ckpt.pt")
    if path.exists():
        return f"the last checkpoint, {path}, stays"
    return "no checkpoint was written"


def main(argv=None):
    started = time.time()  # --time_limit counts from here
    parser = build_parser()
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    handlers = {s: signal.getsignal(s) for s in signals}
    try:
        args = parser.parse_args(argv)
        args.out_dir = args.out_dir or default_out_dir(args)
        with locked(args.out_dir) if MASTER else nullcontext():
            ckpt = judge(args, parser, argv)
            args.data_dir = os.path.abspath(args.data_dir)
            start = ckpt["iter"] if ckpt else 0
            if start >= args.max_iters:
                say(f"{args.out_dir} is at batch {start}: nothing to train")
                return 0
            for s in signals:
                signal.signal(s, ask_to_stop)
            return train(args, ckpt, start, started)
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


if __name__ == "__main__":
    sys.exit(main())
