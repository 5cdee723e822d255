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
(the settings, the parameter counts and, at the end, the peak memory) and loss.png. Ctrl-C, kill
(SIGTERM) and SIGHUP finish the batch, checkpoint and stop.

The file reads as the experiment: settings, data and batches, model, step, evaluation, logging,
checkpoint, then train() and its loop. What keeps a run folder safe (the lock, one run per folder,
log.csv in step with ckpt.pt, stop signals) is rundir.py's.
"""

import argparse
import csv
import dataclasses
import functools
import math
import os
import random
import shlex
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import rundir
import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
from common import (
    SYMBOLS,
    check_seed,
    fail,
    fmt_time,
    keep_freed_memory,
    one_line_errors,
    peak_memory,
    pick_device,
    plain_output,
)
from extractor import MIXERS, Config, Transformer
from prepare_data import load_data

# ---------------------------------------------------------------------------------------------- settings

# settings a --resume must keep: changing them would no longer continue the same run
FIXED_ON_RESUME = ("batch_size", "data_seed", "seed", "lr", "beta1", "beta2", "weight_decay", "grad_clip")
NOT_SAVED = ("out_dir", "resume", "overwrite", "allow_other_data")  # flags about this command, not the run
MODEL_HELP = {  # the model's flags are extractor.Config's fields
    "block_size": "context length", "n_embd": "dimension of the model", "n_hidden": "nodes in the FFN",
    "n_layer": "number of layers", "n_head": "heads (mixers with heads)", "dropout": "dropout rate",
    "mixer": "the first sublayer",
}  # fmt: skip


def say(*args):
    """A console line, shown at once (also under nohup); under torchrun only rank 0 prints."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, flush=True)


def build_parser():
    """All settings, with the paper's Table 1 as defaults."""
    p = argparse.ArgumentParser(
        description="Train a Transformer LM with a token mixer (Section 6).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = lambda key, text: f"{SYMBOLS[key]}: {text}" if key in SYMBOLS else text  # help led by its symbol

    g = p.add_argument_group("model (extractor.Config; the vocabulary size u comes from the data)")
    for f in dataclasses.fields(Config):
        if f.name != "vocab_size":
            choices = sorted(MIXERS) if f.name == "mixer" else None
            help = s(f.name, MODEL_HELP[f.name])
            g.add_argument(f"--{f.name}", type=type(f.default), default=f.default, choices=choices, help=help)

    g = p.add_argument_group("training (Table 1)")
    g.add_argument("--batch_size", type=int, default=64, help=s("batch_size", "batch size (over all ranks)"))
    g.add_argument("--max_iters", type=int, default=60000, help="number of batches to train on")
    g.add_argument("--lr", type=float, default=1e-3, help=s("lr", "AdamW learning rate gamma, constant"))
    g.add_argument("--weight_decay", type=float, default=0.01, help=s("weight_decay", "AdamW weight decay"))
    g.add_argument("--grad_clip", type=float, default=0.0, help=s("grad_clip", "clip the grad norm; 0 = off"))
    g.add_argument("--seed", type=int, default=1337, help=s("seed", "seed of initialisation and dropout"))
    g.add_argument("--data_seed", type=int, default=1337, help=s("data_seed", "seed of the batch order"))
    g.add_argument("--beta1", type=float, default=0.9, help=s("beta1", "AdamW beta_1"))
    g.add_argument("--beta2", type=float, default=0.999, help=s("beta2", "AdamW beta_2"))

    g = p.add_argument_group("files and logging")
    g.add_argument("--data_dir", default="data", help="folder with train.bin, val.bin, meta.json")
    g.add_argument("--out_dir", help="run folder (default: out/<mixer>, plus -<symbol><value> per change)")
    g.add_argument("--resume", action="store_true", help="continue the run in out_dir from its ckpt.pt")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if out_dir holds a run")
    g.add_argument("--allow_other_data", action="store_true", help="with --resume: go on with other data")
    g.add_argument("--eval_interval", type=int, default=1000, help="validation loss every this many batches")
    g.add_argument(
        "--eval_batches", type=int, default=20, help="batches in the fixed validation set; 0 = none"
    )
    g.add_argument(
        "--ckpt_interval", type=int, default=1000, help="ckpt.pt every this many batches (and at 10)"
    )
    g.add_argument("--log_interval", type=int, default=100, help="console line every this many batches")

    g = p.add_argument_group("system")
    g.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="autocast")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    return one_line_errors(p, "train.py")


def check_args(args):
    """Bounds that would otherwise only fail later, in the middle of a run."""
    for name in ("batch_size", "eval_interval", "ckpt_interval", "log_interval"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("max_iters", "eval_batches", "seed", "data_seed", "grad_clip", "weight_decay"):
        if getattr(args, name) < 0:
            fail(f"--{name} must not be negative, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr must be a positive finite number, got {args.lr}")
    for name in ("grad_clip", "weight_decay"):
        if not math.isfinite(getattr(args, name)):
            fail(f"--{name} must be a finite number, got {getattr(args, name)}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) < 1:
            fail(f"--{name} must be in [0, 1), got {getattr(args, name)}")
    check_seed("seed", args.seed)  # (numpy takes any --data_seed)
    if args.resume and args.overwrite:
        fail("--resume continues the run in out_dir and --overwrite replaces it; pass one of them")
    try:
        Config(**model_settings(args))
    except ValueError as e:
        fail(str(e))


def model_settings(args):
    """The Config fields among the settings (all but vocab_size, which comes from the data)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name != "vocab_size"}


def given_flags(argv):
    """Names of the options given on the command line (a resumed run keeps the checkpoint's others)."""
    probe, unset = build_parser(), object()
    probe.set_defaults(**dict.fromkeys(vars(probe.parse_args(argv)), unset))
    return {k for k, v in vars(probe.parse_args(argv)).items() if v is not unset}


def default_out_dir(args):
    """out/<mixer> (out/sa-<n> for attention) for Table 1, plus -<symbol><value> for each other setting."""
    name, defaults = f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer, build_parser().parse_args([])
    for key, symbol in SYMBOLS.items():
        if getattr(args, key) != getattr(defaults, key) and not (key == "n_head" and args.mixer == "sa"):
            name += f"-{symbol}{exact(getattr(args, key))}"
    return os.path.join("out", name)


def exact(value):
    """A setting as the folder name writes it: short (3e-4 -> 0.0003, 1.0 -> 1) but exact, so that two
    settings never share a name (:g alone makes 12345678 and 12345679 both 1.23457e+07)."""
    return str(value) if isinstance(value, int) or float(f"{value:g}") != value else f"{value:g}"


def resume_settings(args, given, ckpt, path):
    """A resumed run's settings: flags not given keep the checkpoint's values; given ones must not
    change the run."""
    saved = {**ckpt["args"], **ckpt["config"]}
    differ = [
        k for k in FIXED_ON_RESUME + tuple(ckpt["config"]) if k in given and getattr(args, k) != saved[k]
    ]
    if differ:
        was = ", ".join(f"{k}={saved[k]!r}" for k in differ)
        now = ", ".join(f"{k}={getattr(args, k)!r}" for k in differ)
        fail(f"{path} was trained with {was} but the flags give {now}; drop those flags to resume")
    if "dtype" in given and args.dtype != saved.get("dtype", args.dtype):
        say(f"note: the run so far was trained with --dtype {saved['dtype']}; it goes on with {args.dtype}")
    for k in (set(vars(args)) - given - set(NOT_SAVED)) & set(saved):
        setattr(args, k, saved[k])
    check_args(args)


# -------------------------------------------------------------------------------------- data and batches


def check_val_size(args, val):
    """The fixed validation set must fit in val.bin."""
    windows = len(val) - args.block_size
    if args.eval_batches * args.batch_size > windows:
        fail(
            f"--eval_batches {args.eval_batches} x --batch_size {args.batch_size} windows are more than the "
            f"{windows:,} windows of l = {args.block_size} in val.bin; use "
            + (
                f"--eval_batches {windows // args.batch_size} or fewer"
                if windows >= args.batch_size
                else "--eval_batches 0 (no validation) or a smaller --batch_size"
            )
        )


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


# ------------------------------------------------------------------------------------------------- model


def precision(device, dtype):
    """Autocast context and GradScaler: float32 unless --dtype asks for bf16 or fp16 (loss scaling)."""
    if device.type == "cuda":  # TF32 matmuls: float32 range, every mixer alike
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=getattr(torch, dtype))
    return ctx, torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))


def build_model(cfg, args, device, rank):
    """The model (the same initialisation on every rank, then a dropout stream per rank) and AdamW."""
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + rank)  # then a dropout stream per rank
    random.seed(args.seed + rank)
    betas, fused = (args.beta1, args.beta2), device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay, fused=fused
    )
    return model, optimizer


def restore(run, ckpt):
    """A resumed run's state: model, AdamW, loss scaler and this rank's RNG streams."""
    run.raw_model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["scaler"]:
        run.scaler.load_state_dict(ckpt["scaler"])
    if len(ckpt["rng"]) == run.world:
        set_rng_state(ckpt["rng"][run.rank], run.device)
    else:  # another number of processes: the dropout streams cannot continue, so start new ones
        n = len(ckpt["rng"])
        say(f"note: the checkpoint is from {n} process{'es' * (n > 1)}: dropout RNG reseeded")
        torch.manual_seed(run.args.seed + run.rank + 1_000_003 * ckpt["iter"])


def set_rng_state(s, device):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def gather_rng(device, world):
    """Every rank's RNG states, for the checkpoint (each rank has its own dropout stream)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    rngs = [state] * world
    if world > 1:
        dist.all_gather_object(rngs, state)
    return rngs


# -------------------------------------------------------------------------------------------------- step


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


# -------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run):
    """Mean loss over a fixed validation set: eval_batches * batch_size windows spread evenly over
    val.bin, the same at every evaluation; each global batch is split over the ranks like training."""
    args = run.args
    n, b = args.eval_batches * args.batch_size, args.batch_size // run.world
    starts = torch.from_numpy(
        np.linspace(0, len(run.val_data) - args.block_size - 1, n).round().astype(np.int64)
    )
    model = run.model.module if run.world > 1 else run.model
    model.eval()
    total = torch.zeros((), device=run.device)
    for k in range(0, n, args.batch_size):
        mine = starts[k : k + args.batch_size][run.rank * b : (run.rank + 1) * b]  # this rank's part
        x, y = get_batch(run.val_data, mine, args.block_size, run.device)
        with run.ctx:
            total += model(x, y)[1].float()
    if run.world > 1:
        dist.all_reduce(total)
        total /= run.world
    model.train()
    return total.item() / args.eval_batches


# ----------------------------------------------------------------------------------------------- logging


class RunLog:
    """log.csv and the console. Each batch's loss waits in a preallocated buffer until the next log
    point, so no tensor outlives its step (with keep_freed_memory, one that did would pin freed
    memory and the process would grow without bound) and there is no GPU sync per batch."""

    def __init__(self, args, start_iter, elapsed0, device, master):
        self.args, self.start_iter, self.elapsed0 = args, start_iter, elapsed0
        self.buf = torch.zeros(max(1, min(args.log_interval, args.max_iters - start_iter)), device=device)
        self.pending, self.t_session, self.t_chunk = [], time.time(), time.time()
        self.file = open(os.path.join(args.out_dir, "log.csv"), "a", newline="") if master else None
        self.writer = csv.writer(self.file, lineterminator="\n") if master else None

    def add(self, it, loss):
        self.buf[len(self.pending)] = loss
        self.pending.append((it, time.time()))

    def take(self, world):
        """The pending batches as (iteration, time, loss) rows; under DDP each loss is the mean over
        the ranks, the loss of the global batch (so every rank calls this at the same batch)."""
        losses = self.buf[: len(self.pending)].clone()  # (k,)
        if world > 1:
            losses /= world
            dist.all_reduce(losses)
        rows, self.pending = [(i, t, v) for (i, t), v in zip(self.pending, losses.tolist())], []
        return rows

    def write(self, rows, val):
        """The rows in log.csv (val_loss only in the last row, where it was measured) and one console line."""
        now, it, n = time.time(), rows[-1][0], self.args.max_iters
        tok_s = self.args.batch_size * self.args.block_size * len(rows) / max(now - self.t_chunk, 1e-9)
        if self.writer:
            for i, t, v in rows:
                val_i = repr(val) if (i == it and val is not None) else ""
                self.writer.writerow(
                    [i, repr(v), val_i, self.args.lr, f"{tok_s:.1f}", f"{self.elapsed(t):.3f}"]
                )
            self.file.flush()
        eta = (n - it) * (now - self.t_session) / (it - self.start_iter)  # at this session's pace
        say(
            f"iter {it}/{n} ({100 * it / n:.1f}%) | loss {np.mean([v for _, _, v in rows]):.4f}"
            + (f" | val {val:.4f}" if val is not None else "")
            + f" | {tok_s / 1000:.1f}k tok/s | elapsed {fmt_time(self.elapsed(now))} | ETA {fmt_time(eta)}"
        )
        self.t_chunk = time.time()

    def elapsed(self, now=None):
        return self.elapsed0 + (now or time.time()) - self.t_session


# -------------------------------------------------------------------------------------------- checkpoint


def save_checkpoint(run, it, elapsed, saved_at):
    """ckpt.pt: plain dicts and tensors (torch.load(weights_only=True) reads it), written whole or not at
    all; every rank's RNG state, so that a resumed run continues bit for bit."""
    rngs = gather_rng(run.device, run.world)  # (a collective under DDP: every rank comes here)
    if run.rank:
        return
    ckpt = {
        "model": run.raw_model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "config": dataclasses.asdict(run.cfg),
        "args": dict(vars(run.args)),
        "iter": it,  # batches done; batch `it` (0-based) comes next
        "elapsed_s": elapsed,
        "rng": rngs,  # one dict per DDP rank (dropout streams differ per rank)
        "data": run.data,  # vocab size and sha256 of train.bin, val.bin and the tokenizer
    }
    rundir.write_checkpoint(run.args.out_dir, ckpt, saved_at)


def report_peak_memory(run):
    """The run's peak memory (this session's, resuming) in run.json and on the last console line."""
    if run.rank:
        return
    peak, what = peak_memory(run.device)
    rundir.add_to_run_json(run.args.out_dir, peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what)
    say(f"{what}: {peak / 2**30:.2f} GB")


# --------------------------------------------------------------------------------------- train: the loop


@dataclasses.dataclass
class Run:
    """What the loop works with, set up by train() in the order of the sections above."""

    args: argparse.Namespace
    cfg: Config
    data: dict  # the data's fingerprint (vocab size, sha256 of the files), kept in the checkpoint
    train_data: np.ndarray  # (N,) uint16 tokens, memory-mapped
    val_data: np.ndarray
    n_starts: int  # windows of l+1 tokens start at 0 .. N-l-1
    device: torch.device
    rank: int
    world: int
    raw_model: Transformer  # the Transformer itself, whose state_dict is saved
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ctx: object  # autocast, or nothing for float32
    model: torch.nn.Module = None  # what is trained: the Transformer, compiled and/or wrapped for DDP


def settings(argv, world):
    """The parsed and checked settings, and the flags given on the command line."""
    args, given = build_parser().parse_args(argv), given_flags(argv)
    check_args(args)
    args.out_dir = args.out_dir or default_out_dir(args)
    args.data_dir = os.path.abspath(args.data_dir)  # the checkpoint works from any directory
    if args.batch_size % world:
        fail(f"--batch_size {args.batch_size} must be divisible by the {world} processes")
    return args, given


def train(argv):
    # DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
    rank, world, local_rank = (int(os.environ.get(k, "0")) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    world, master = max(world, 1), rank == 0
    args, given = settings(argv, world)
    if args.max_iters == 0 and not args.resume:
        say("--max_iters 0: nothing to train")
        return 0

    # the run folder: locked first, then judged; nothing is written before every check has passed
    with rundir.locked(args.out_dir, master):
        ckpt = rundir.judge(args.out_dir, args.resume, args.overwrite)
        if ckpt:  # a resumed run's settings come from its checkpoint
            resume_settings(args, given, ckpt, os.path.join(args.out_dir, "ckpt.pt"))
        start = ckpt["iter"] if ckpt else 0
        if start >= args.max_iters:
            say(f"{args.out_dir} is at batch {start} >= --max_iters {args.max_iters}: nothing to train")
            return 0

        # data: train.bin and val.bin, checked against meta.json, the settings and the checkpoint
        train_data, val_data, data = load_data(args.data_dir, args.block_size, args.batch_size)
        check_val_size(args, val_data)
        cfg = Config(vocab_size=data["vocab_size"], **model_settings(args))
        if ckpt:
            rundir.check_checkpoint(ckpt, dataclasses.asdict(cfg), data, args)

        # the model, its optimizer and, resuming, their state
        device = pick_device(args.device, local_rank)
        if world > 1:  # all ranks have passed the checks above before rank 0 writes anything
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        run = setup(args, cfg, (train_data, val_data, data), device, rank, world, ckpt)

        # now the folder becomes this run's: run.json and a new (resuming: a cut back) log.csv
        if master:
            counts, config = run.raw_model.param_counts(), dataclasses.asdict(cfg)
            info = {"config": config, "args": dict(vars(args)), "params": counts, "world_size": world}
            rundir.start_files(args.out_dir, info, start)
            describe(run, start)
        log = RunLog(args, start, ckpt["elapsed_s"] if ckpt else 0.0, device, master)
        del ckpt
        try:
            return loop(run, log, start)
        except Exception as e:  # torch.compile compiles at the first step, and fails there if it cannot
            if args.compile:
                fail(f"training with --compile failed ({type(e).__name__}: {str(e)[:80]}); try without it")
            raise


def setup(args, cfg, data, device, rank, world, ckpt):
    """The Run: model and AdamW (resuming, with their state), precision, the model to train (compiled
    with --compile, wrapped for DDP with several processes)."""
    if device.type == "cpu" and sys.platform.startswith("linux"):
        keep_freed_memory()
    ctx, scaler = precision(device, args.dtype)
    raw_model, optimizer = build_model(cfg, args, device, rank)
    train_data, val_data, fingerprint = data
    run = Run(args=args, cfg=cfg, data=fingerprint, train_data=train_data, val_data=val_data,
              n_starts=len(train_data) - args.block_size, device=device, rank=rank, world=world,
              raw_model=raw_model, optimizer=optimizer, scaler=scaler, ctx=ctx)  # fmt: skip
    if ckpt:
        restore(run, ckpt)
    run.model = torch.compile(raw_model) if args.compile else raw_model
    if world > 1:
        run.model = DDP(run.model, device_ids=[device.index] if device.type == "cuda" else None)
    return run


def describe(run, start):
    """What the run is, on the console."""
    args, world = run.args, run.world
    processes = f" x {world} processes" if world > 1 else ""
    say(f"{run.cfg}\non {run.device} ({args.dtype}){processes}; {args.out_dir}")
    say("parameters: " + ", ".join(f"{k} {v:,}" for k, v in run.raw_model.param_counts().items()))
    epochs = args.max_iters * args.batch_size / run.n_starts  # passes over the windows
    targets = epochs * args.block_size  # each window predicts l tokens: passes over the tokens
    say(
        f"data: {run.n_starts + args.block_size:,} train tokens ({run.n_starts:,} windows), "
        f"{len(run.val_data):,} val tokens; {args.max_iters:,} batches of {args.batch_size} = "
        f"{epochs:.3f} epochs of windows, each token a target {targets:.1f} times"
    )
    say(f"training from batch {start} to {args.max_iters}")


def loop(run, log, start):
    """Batch -> step -> (at their intervals) evaluate, log, checkpoint; until max_iters or a stop signal."""
    args, rank, world = run.args, run.rank, run.world
    b, it, val, saved_at = args.batch_size // world, start, None, start or None
    first_log = start + min(10, args.log_interval)
    with rundir.stop_signals() as stop:
        while it < args.max_iters:
            starts = batch_starts(it, run.n_starts, args.batch_size, args.data_seed)[
                rank * b : (rank + 1) * b
            ]
            x, y = get_batch(run.train_data, starts, args.block_size, run.device)  # (b, l), (b, l)
            log.add(it + 1, train_step(run.model, run.optimizer, run.scaler, run.ctx, x, y, args.grad_clip))
            it += 1
            last = it == args.max_iters
            eval_now = args.eval_batches > 0 and (it % args.eval_interval == 0 or last)
            ckpt_now = it % args.ckpt_interval == 0 or it == first_log or last
            if not (it % args.log_interval == 0 or eval_now or ckpt_now or (stop["signal"] and world == 1)):
                continue
            if eval_now:
                val = evaluate(run)
            stopping = rundir.agree_to_stop(stop, world)
            rows = log.take(world)
            rundir.check_finite(rows, saved_at)
            log.write(rows, val if eval_now else None)
            if ckpt_now or stopping:
                save_checkpoint(run, it, log.elapsed(), saved_at)
                saved_at = it
            if stopping:
                name = signal.Signals(stop["signal"] or signal.SIGINT).name
                say(f"{name}: stopped at batch {it}; continue with the same command plus --resume")
                report_peak_memory(run)
                return 128 + (stop["signal"] or signal.SIGINT)

    # the end: loss.png, what to do next, the peak memory
    if rank == 0:
        from plot import plot_run

        plot_run(args.out_dir, os.path.join(args.out_dir, "loss.png"))
        say(f"wrote {args.out_dir}/loss.png" + (f"; final val loss {val:.4f}" if val is not None else ""))
        say(f"sample from it: python sample.py --out_dir {shlex.quote(args.out_dir)}")
    report_peak_memory(run)
    return 0


def main(argv=None):
    plain_output()
    try:
        return train(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # fail() and argparse: the message is already printed
        return e.code
    except KeyboardInterrupt:  # a second Ctrl-C
        say("\naborted; the last checkpoint (if any) is kept")
        return 130
    except OSError as e:  # a full disk or a lost folder while writing log.csv, run.json, loss.png
        where = e.filename or "a file of the run"
        print(
            f"error: cannot write {where} ({e.strerror or e}); the last checkpoint is kept", file=sys.stderr
        )
        return 1
    finally:
        if dist.is_initialized():
            dist.barrier()  # tear the process group down together (gloo may abort if one rank leaves early)
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
