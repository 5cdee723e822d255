"""
Train a language model whose first sublayer is any token mixer of extractor.py (paper, Section 6).

    python prepare_data.py && python train.py --mixer=me      # Table 1: m=18, l=d=128, 60000 batches of 64
    python train.py --mixer=me --n_layer=2 --block_size=64 --batch_size=32  # into out/me-m2-l64-b32
    python train.py --mixer=me --max_iters=80000 --resume     # continue out/me exactly where it stopped
    torchrun --standalone --nproc_per_node=4 train.py --mixer=she   # one run split over 4 GPUs (DDP)

Every run sees the same batches in the same order (Section 6): batch i is slice i of a permutation of
all start positions of train.bin, seeded by --data_seed alone. The run folder (default out/<mixer>,
plus a suffix for each setting that differs from Table 1) gets log.csv (every batch's training cost,
validation losses, tokens/s), ckpt.pt (everything --resume needs to continue bit for bit), run.json
and, at the end, loss.png. Ctrl-C, kill (SIGTERM) and SIGHUP finish the batch, checkpoint and stop.
"""

import argparse
import csv
import ctypes
import dataclasses
import functools
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
from common import atomic_write, fail, fmt_time, pick_device
from extractor import MIXERS, Config, Transformer
from prepare_data import load_data

# every extractor.Config field but u (which comes from the data's meta.json): (the paper's symbol, help)
CONFIG_HELP = {
    "n_layer": ("m", "number of layers"),
    "block_size": ("l", "length of the context window"),
    "n_embd": ("d", "dimension of the model"),
    "n_hidden": ("c", "nodes in the hidden layer of the FFN"),
    "n_head": ("n", "heads of self-attention (used only by mixers with heads)"),
    "dropout": ("p", "dropout rate"),
    "mixer": (None, "the first sublayer of each layer"),
}
# every other flag: (name, default, symbol, help); False means an on/off switch. A setting with a
# symbol that differs from its default names the default run folder (out/me-m2-l64-b32), as do the
# Config fields; max_iters does not, so a longer run of the same model continues in the same folder.
FLAGS = {
    "training (Table 1)": [
        ("batch_size", 64, "b", "batch size (global: split over DDP ranks)"),
        ("max_iters", 60000, None, "number of batches to train on"),
        ("lr", 1e-3, "lr", "AdamW learning rate gamma, constant (no warm-up)"),
        ("weight_decay", 0.01, "wd", "AdamW weight decay (the paper gives none)"),
        ("grad_clip", 0.0, "clip", "clip the gradient norm to this; 0 = off"),
        ("seed", 1337, "seed", "seed of initialisation and dropout"),
        ("data_seed", 1337, "dseed", "seed of the batch order, the same for every run"),
        ("beta1", 0.9, "b1", "AdamW beta_1"),
        ("beta2", 0.999, "b2", "AdamW beta_2"),
    ],
    "files and logging": [
        ("data_dir", "data", None, "folder with train.bin, val.bin, meta.json"),
        ("out_dir", None, None, "run folder (default: out/<mixer>, plus -<symbol><value> for each change)"),
        ("resume", False, None, "continue the run in out_dir from its ckpt.pt"),
        ("overwrite", False, None, "start afresh even if out_dir holds a run"),
        ("allow_other_data", False, None, "with --resume: go on with other data (fine-tuning)"),
        ("eval_interval", 1000, None, "validation loss every this many batches"),
        ("eval_batches", 20, None, "batches in the fixed validation set; 0 = none"),
        ("ckpt_interval", 1000, None, "ckpt.pt every this many batches; also at batch 10, end, stop"),
        ("log_interval", 100, None, "console line every this many batches (the first at 10)"),
    ],
    "system": [
        ("device", "auto", None, "auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps"),
        ("dtype", "float32", None, "float32 (TF32 on CUDA); or bfloat16/float16 autocast, faster on GPUs"),
        ("compile", False, None, "torch.compile the model"),
    ],
}
# settings a --resume must keep: changing them would no longer continue the same run
FIXED_ON_RESUME = ("batch_size", "data_seed", "seed", "lr", "beta1", "beta2", "weight_decay", "grad_clip")
LOG_HEADER = ["iter", "train_loss", "val_loss", "lr", "tokens_per_s", "elapsed_s"]
say = functools.partial(print, flush=True)  # every line shows at once, also under nohup


def build_parser():
    """All settings, with the paper's Table 1 as defaults."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        description="Train a Transformer LM with a token mixer (Section 6).", formatter_class=fmt
    )
    g = p.add_argument_group("model: every extractor.Config field (u comes from the data's meta.json)")
    for f in dataclasses.fields(Config):
        if f.name != "vocab_size":
            symbol, help = CONFIG_HELP[f.name]
            choices = sorted(MIXERS) if f.name == "mixer" else None
            help = f"{symbol}: {help}" if symbol else help
            g.add_argument(f"--{f.name}", type=type(f.default), default=f.default, choices=choices, help=help)
    for group, flags in FLAGS.items():
        g = p.add_argument_group(group)
        for name, default, _, help in flags:
            if default is False:
                g.add_argument(f"--{name}", action="store_true", help=help)
            else:
                choices = ["float32", "bfloat16", "float16"] if name == "dtype" else None
                kind = str if default is None else type(default)
                g.add_argument(f"--{name}", type=kind, default=default, choices=choices, help=help)
    return p


def check_args(args):
    for name in ("batch_size", "eval_interval", "ckpt_interval", "log_interval"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("max_iters", "eval_batches", "seed", "data_seed", "grad_clip", "weight_decay"):
        if getattr(args, name) < 0:
            fail(f"--{name} must not be negative, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr must be a positive finite number, got {args.lr}")


def given_flags(argv):
    """Names of the options given on the command line (a resumed run keeps the checkpoint's others)."""
    probe, unset = build_parser(), object()
    probe.set_defaults(**dict.fromkeys(vars(probe.parse_args(argv)), unset))
    return {k for k, v in vars(probe.parse_args(argv)).items() if v is not unset}


def default_out_dir(args):
    """out/<mixer> (out/sa-<n> for attention) for Table 1, plus -<symbol><value> for each other setting."""
    name = f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer
    symbols = {k: v[0] for k, v in CONFIG_HELP.items() if v[0] and not (k == "n_head" and args.mixer == "sa")}
    symbols.update({f[0]: f[2] for flags in FLAGS.values() for f in flags if f[2]})
    defaults = vars(build_parser().parse_args([]))
    for key, symbol in symbols.items():
        if getattr(args, key) != defaults[key]:
            name += f"-{symbol}{getattr(args, key):g}"
    return os.path.join("out", name)


# ---------------------------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=1)
def epoch_permutation(n_starts, data_seed, epoch):
    """A permutation of the start positions 0..n_starts-1, seeded by (data_seed, epoch) alone:
    independent of the model's seed, mixer and dropout, so every run sees the same batches."""
    seed = int(np.random.SeedSequence([data_seed, epoch]).generate_state(1, np.uint64)[0])
    return torch.randperm(n_starts, generator=torch.Generator().manual_seed(seed))  # (n_starts,)


def batch_starts(i, n_starts, batch_size, data_seed):
    """Start positions of global batch i (0-based): slice i of its epoch's permutation (the leftover
    n_starts % batch_size starts of each epoch are skipped). The data-order state is just i."""
    epoch, j = divmod(i, n_starts // batch_size)
    return epoch_permutation(n_starts, data_seed, epoch)[j * batch_size : (j + 1) * batch_size]


def get_batch(data, starts, block_size, device):
    """Windows of l+1 tokens at the given starts: x is the first l tokens, y the same shifted by one."""
    w = torch.from_numpy(np.stack([data[s : s + block_size + 1] for s in starts.tolist()]).astype(np.int64))
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (b, l), (b, l)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


@torch.no_grad()
def evaluate(model, val, args, ctx, rank, world, device):
    """Mean loss over a fixed validation set: eval_batches * batch_size windows spread evenly over
    val.bin, the same at every evaluation; each global batch is split over the ranks like training."""
    n = args.eval_batches * args.batch_size
    starts = torch.from_numpy(np.linspace(0, len(val) - args.block_size - 1, n).round().astype(np.int64))
    model.eval()
    total, b = torch.zeros((), device=device), args.batch_size // world
    for k in range(0, n, args.batch_size):
        mine = starts[k : k + args.batch_size][rank * b : (rank + 1) * b]  # this rank's part of the batch
        x, y = get_batch(val, mine, args.block_size, device)
        with ctx:
            total += model(x, y)[1].float()
    if world > 1:
        dist.all_reduce(total)
        total /= world
    model.train()
    return total.item() / args.eval_batches


# ------------------------------------------------------------------------------------ system helpers


def keep_freed_memory():
    """CPU on Linux: let glibc keep freed memory instead of mmapping and unmapping every large tensor.
    Each step frees and reallocates the same big buffers (the logits alone are B*l*u floats) and every
    fresh mmapped page faults: 1.4x more tokens/s at m = 2. Memory stays flat only if no tensor
    outlives its step (the losses go into a preallocated buffer), as tests.py checks."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # from glibc's malloc.h
    mallopt(M_MMAP_MAX, 0)  # big blocks come from the heap too, so they can be reused
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # and the heap is not shrunk after each step
    mallopt(M_TOP_PAD, 2**28)


def precision(device, dtype):
    """Autocast context and GradScaler: float32 unless --dtype asks for bf16 or fp16 (loss scaling)."""
    if device.type == "cuda":  # TF32 matmuls: float32 range, every mixer alike
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=getattr(torch, dtype))
    return ctx, torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))


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


# ------------------------------------------------------------------ run folder: lock, checkpoint, log


def lock_run_dir(out_dir):
    """An exclusive OS lock on the run folder, held until the process ends (even by kill -9)."""
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, "train.lock"), "a")
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here
        return f
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fail(f"another train.py is running in {out_dir}; wait for it, or pick another --out_dir")
    return f


def read_checkpoint(path):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"model", "optimizer", "scaler", "iter", "elapsed_s", "rng", "args", "config"} - set(ckpt)
        if missing:
            raise KeyError(", ".join(sorted(missing)))
        return ckpt
    except Exception as e:
        fail(f"cannot read checkpoint {path} ({type(e).__name__}); it is damaged or not from train.py")


def resume_settings(args, given, ckpt, path):
    """Flags not given keep the checkpoint's values; given ones must not change the run."""
    saved = {**ckpt["args"], **ckpt["config"]}
    differ = [
        k for k in FIXED_ON_RESUME + tuple(ckpt["config"]) if k in given and getattr(args, k) != saved.get(k)
    ]
    if differ:
        fail(
            f"{path} was trained with "
            + ", ".join(f"{k}={saved[k]!r}" for k in differ)
            + " but the flags give "
            + ", ".join(f"{k}={getattr(args, k)!r}" for k in differ)
            + "; drop those flags to resume"
        )
    keep = set(vars(args)) - given - {"out_dir", "resume", "overwrite", "allow_other_data"}
    for k in keep & set(saved):
        setattr(args, k, saved[k])
    if args.dtype == "auto":  # checkpoints from before float32 became the default (auto: float32 on CPU)
        args.dtype = "float32"
    check_args(args)


def check_same_data(ckpt, data, path, allow_other):
    """--resume continues on the checkpoint's corpus and tokenizer, or says why it will not."""
    saved = ckpt.get("data")
    if saved is None:
        say(f"note: {path} predates data checksums, so the data could not be verified")
    elif saved != data and not allow_other:
        what = [k.replace("_sha256", "") for k in data if saved.get(k) != data[k]]
        fail(
            f"{path} was trained on other data ({', '.join(what)} differ); pass its --data_dir, or "
            "--allow_other_data to continue on this one"
        )


def save_checkpoint(path, model, optimizer, scaler, cfg, args, it, elapsed, rngs, data):
    ckpt = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "config": dataclasses.asdict(cfg),
        "args": dict(vars(args)),
        "iter": it,  # batches done; batch `it` (0-based) comes next
        "elapsed_s": elapsed,
        "rng": rngs,  # one dict per DDP rank (dropout streams differ per rank)
        "data": data,  # vocab size and sha256 of train.bin, val.bin and the tokenizer
    }
    atomic_write(path, lambda f: torch.save(ckpt, f))


def truncate_log(path, last_iter):
    """Keep the header and rows up to the checkpoint's iteration: a run stopped after its last
    checkpoint may have logged later rows, which the resumed run writes again."""
    rows = open(path, newline="").read().splitlines()[1:] if os.path.exists(path) else []
    keep = [r for r in rows if r.split(",", 1)[0].isdigit() and int(r.split(",", 1)[0]) <= last_iter]
    atomic_write(path, "\n".join([",".join(LOG_HEADER)] + [r for r in keep if r.count(",") == 5]) + "\n")


def train_step(model, optimizer, scaler, ctx, x, y, grad_clip=0.0):
    """One batch: forward, the loss of Eq. (3), backward, optional clipping, AdamW. Returns the
    loss (detached). bench.py times exactly this."""
    with ctx:
        _, loss = model(x, y)  # mean cross-entropy of the batch, Eq. (3)
    scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class RunLog:
    """log.csv and the console. Each batch's loss waits in a preallocated buffer until the next log
    point, so no tensor outlives its step (with keep_freed_memory, one that did would pin freed
    memory and the process would grow without bound) and there is no GPU sync per batch."""

    def __init__(self, path, args, start_iter, elapsed0, device, master, world):
        self.args, self.start_iter, self.elapsed0 = args, start_iter, elapsed0
        self.master, self.world = master, world
        self.buf = torch.zeros(max(1, min(args.log_interval, args.max_iters - start_iter)), device=device)
        self.pending, self.t_session, self.t_chunk = [], time.time(), time.time()
        self.saved_at = start_iter or None  # the batch of the last checkpoint
        self.file = open(path, "a", newline="") if master else None
        self.writer = csv.writer(self.file, lineterminator="\n") if master else None

    def add(self, it, loss):
        self.buf[len(self.pending)] = loss
        self.pending.append((it, time.time()))

    def flush(self, it, val, stop, lr):
        """Write the pending rows, print one line, and return whether every rank agrees to stop."""
        losses = self.buf[: len(self.pending)].clone()  # (k,)
        if self.world > 1:  # mean over ranks = the loss of the global batch; also agree on stopping
            agreed = torch.cat([losses / self.world, torch.tensor([float(stop)], device=losses.device)])
            dist.all_reduce(agreed)
            losses, stop = agreed[:-1], bool(agreed[-1].item() > 0)
        losses, now = losses.tolist(), time.time()
        bad = [(i, v) for (i, _), v in zip(self.pending, losses) if not math.isfinite(v)]
        if bad:
            kept = f"ckpt.pt keeps batch {self.saved_at}, the last good state; " if self.saved_at else ""
            fail(
                f"the training cost became {bad[0][1]} at batch {bad[0][0]}; {kept}start the run again"
                f"{' (--overwrite)' if kept else ''} with a smaller --lr or with --grad_clip"
            )
        tok_s = (
            self.args.batch_size * self.args.block_size * len(self.pending) / max(now - self.t_chunk, 1e-9)
        )
        if self.master:
            for (i, t), v in zip(self.pending, losses):  # val_loss only in the row it was measured at
                row = [i, repr(v), repr(val) if (i == it and val is not None) else "", lr, f"{tok_s:.1f}"]
                self.writer.writerow(row + [f"{self.elapsed0 + t - self.t_session:.3f}"])
            self.file.flush()
        n = self.args.max_iters
        eta = (n - it) * (now - self.t_session) / (it - self.start_iter)  # at this session's pace
        say(
            f"iter {it}/{n} ({100 * it / n:.1f}%) | loss {np.mean(losses):.4f}"
            + (f" | val {val:.4f}" if val is not None else "")
            + f" | {tok_s / 1000:.1f}k tok/s"
            + f" | elapsed {fmt_time(self.elapsed0 + now - self.t_session)} | ETA {fmt_time(eta)}"
        )
        self.pending, self.t_chunk = [], time.time()
        return stop

    def elapsed(self):
        return self.elapsed0 + time.time() - self.t_session


def open_run(args, given):
    """The checkpoint to resume, or None for a fresh start; a folder whose run never reached a
    checkpoint simply starts again."""
    path = os.path.join(args.out_dir, "ckpt.pt")
    if args.resume:
        if not os.path.isfile(path):
            fail(f"no checkpoint {path} to resume; drop --resume to start the run, or pass its --out_dir")
        ckpt = read_checkpoint(path)
        resume_settings(args, given, ckpt, path)
        return ckpt
    if os.path.isfile(path) and not args.overwrite:
        fail(
            f"{args.out_dir} already holds a run; pass --resume to continue it, --overwrite to start again, "
            "or pick another --out_dir"
        )
    return None


def build_model(cfg, args, device, rank, world, scaler, ckpt):
    """The model (the same initialisation on every rank), AdamW, the state of a resumed run, and the
    model to train: compiled with --compile, wrapped for DDP with several processes."""
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + rank)  # then a dropout stream per rank
    random.seed(args.seed + rank)
    betas, fused = (args.beta1, args.beta2), device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay, fused=fused
    )
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        if len(ckpt["rng"]) == world:
            set_rng_state(ckpt["rng"][rank], device)
        else:  # another number of processes: the dropout streams cannot continue, so start new ones
            say(f"note: checkpoint from {len(ckpt['rng'])} processes: dropout RNG reseeded")
            torch.manual_seed(args.seed + rank + 1_000_003 * ckpt["iter"])
    trained = torch.compile(model) if args.compile else model
    if world > 1:
        trained = DDP(trained, device_ids=[device.index] if device.type == "cuda" else None)
    return model, trained, optimizer


def start_log(args, cfg, counts, world, start, device, n_val, n_starts):
    """run.json, a new (or, resuming, a truncated) log.csv, and what the run is, on the console."""
    run = {"config": dataclasses.asdict(cfg), "args": dict(vars(args)), "params": counts, "world_size": world}
    atomic_write(os.path.join(args.out_dir, "run.json"), json.dumps(run, indent=1) + "\n")
    log_path = os.path.join(args.out_dir, "log.csv")
    if start:
        truncate_log(log_path, start)
    else:
        atomic_write(log_path, ",".join(LOG_HEADER) + "\n")
    say(f"{cfg}\non {device} ({args.dtype}){f' x {world} processes' if world > 1 else ''}; {args.out_dir}")
    say("parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    epochs = args.max_iters * args.batch_size / n_starts
    say(
        f"data: {n_starts + args.block_size:,} train tokens ({n_starts:,} windows), {n_val:,} val tokens; "
        f"{args.max_iters:,} batches of {args.batch_size} = {epochs:.3f} epochs"
    )
    say(f"training from batch {start} to {args.max_iters}")


def gather_rng(device, world):
    """Every rank's RNG states, for the checkpoint (each rank has its own dropout stream)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    rngs = [state] * world
    if world > 1:
        dist.all_gather_object(rngs, state)
    return rngs


def set_rng_state(s, device):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


# ---------------------------------------------------------------------------------------------- train


def settle_run(argv, world):
    """The settings (a resumed run's come from its checkpoint), the checkpoint or None, the data and
    the model's Config, all checked before anything is written."""
    parser = build_parser()
    parser.error = lambda msg: fail(f"{msg} (see python train.py --help)")  # one line, not usage + error
    args, given = parser.parse_args(argv), given_flags(argv)
    check_args(args)
    args.out_dir = args.out_dir or default_out_dir(args)
    ckpt = open_run(args, given)
    if args.batch_size % world:
        fail(f"--batch_size {args.batch_size} must be divisible by the {world} processes")
    model_args = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name != "vocab_size"}
    try:
        Config(**model_args)
    except ValueError as e:
        fail(str(e))
    args.data_dir = os.path.abspath(args.data_dir)  # the checkpoint works from any directory
    train_data, val_data, data = load_data(args.data_dir, args.block_size, args.batch_size)
    cfg = Config(vocab_size=data["vocab_size"], **model_args)
    if ckpt is not None:
        path = os.path.join(args.out_dir, "ckpt.pt")
        check_same_data(ckpt, data, path, args.allow_other_data)
        if dataclasses.asdict(cfg) != ckpt["config"]:
            fail(f"{path} is from another model ({ckpt['config']}); check --data_dir or --out_dir")
    return args, ckpt, train_data, val_data, data, cfg


def train(argv):
    # DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
    rank, world, local_rank = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
    )
    master = rank == 0
    args, ckpt, train_data, val_data, data, cfg = settle_run(argv, world)
    ckpt_path, log_path = os.path.join(args.out_dir, "ckpt.pt"), os.path.join(args.out_dir, "log.csv")
    start = ckpt["iter"] if ckpt else 0
    if start >= args.max_iters:
        say(f"{args.out_dir} is at batch {start} >= --max_iters {args.max_iters}: nothing to train")
        return 0

    # the run folder: locked, then run.json and a fresh or truncated log.csv
    lock = lock_run_dir(args.out_dir) if master else None  # noqa: F841  (held until the process ends)
    device = pick_device(args.device, local_rank)
    if world > 1:  # all ranks have passed the checks above before rank 0 writes anything
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu" and sys.platform.startswith("linux"):
        keep_freed_memory()
    ctx, scaler = precision(device, args.dtype)
    raw_model, model, optimizer = build_model(cfg, args, device, rank, world, scaler, ckpt)
    elapsed0 = ckpt["elapsed_s"] if ckpt else 0.0
    del ckpt
    eval_model = model.module if world > 1 else model
    n_starts = len(train_data) - args.block_size  # windows of l+1 tokens start at 0 .. N-l-1
    if master:
        start_log(args, cfg, raw_model.param_counts(), world, start, device, len(val_data), n_starts)
    log = RunLog(log_path, args, start, elapsed0, device, master, world)
    first_log, b, it, val = start + min(10, args.log_interval), args.batch_size // world, start, None

    with stop_signals() as stop:
        while it < args.max_iters:
            # the batch: slice `it` of the order every run shares, this rank's part of it
            starts = batch_starts(it, n_starts, args.batch_size, args.data_seed)[rank * b : (rank + 1) * b]
            x, y = get_batch(train_data, starts, args.block_size, device)  # (b, l), (b, l)
            # forward, backward, clip, AdamW
            try:
                log.add(it + 1, train_step(model, optimizer, scaler, ctx, x, y, args.grad_clip))
            except Exception as e:
                if args.compile and it == start:
                    fail(f"the first step with --compile failed ({type(e).__name__}); run without --compile")
                raise
            it += 1
            # log, evaluate and checkpoint at their intervals, at the end, and when asked to stop
            do_eval = args.eval_batches > 0 and (it % args.eval_interval == 0 or it == args.max_iters)
            do_ckpt = it % args.ckpt_interval == 0 or it in (first_log, args.max_iters)
            if not (it % args.log_interval == 0 or do_eval or do_ckpt or (stop["signal"] and world == 1)):
                continue
            val = evaluate(eval_model, val_data, args, ctx, rank, world, device) if do_eval else val
            stopping = log.flush(it, val if do_eval else None, stop["signal"] is not None, args.lr)
            if do_ckpt or stopping:
                rngs = gather_rng(device, world)
                if master:
                    save_checkpoint(
                        ckpt_path, raw_model, optimizer, scaler, cfg, args, it, log.elapsed(), rngs, data
                    )
                log.saved_at = it
            if stopping:
                name = signal.Signals(stop["signal"] or signal.SIGINT).name
                say(f"{name}: stopped at batch {it}; continue with the same command plus --resume")
                return 128 + (stop["signal"] or signal.SIGINT)

    if master:
        from plot import plot_run

        plot_run(args.out_dir, os.path.join(args.out_dir, "loss.png"))
        say(f"wrote {args.out_dir}/loss.png" + (f"; final val loss {val:.4f}" if val is not None else ""))
        say(f"sample from it: python sample.py --out_dir {args.out_dir}")
    return 0


def main(argv=None):
    try:
        return train(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # fail() and argparse: the message is already printed
        return e.code
    except KeyboardInterrupt:  # a second Ctrl-C
        say("\naborted; the last checkpoint (if any) is kept")
        return 130
    finally:
        if dist.is_initialized():
            dist.barrier()  # tear the process group down together (gloo may abort if one rank leaves early)
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
