"""
Train a language model whose first sublayer is any token mixer of extractor.py (paper, Section 6).

    python prepare_data.py && python train.py --mixer=me      # Table 1: m=18, l=d=128, 60000 batches of 64
    python train.py --mixer=sa --n_head=1 --n_layer=2 --block_size=64 --batch_size=32 --max_iters=2000
    python train.py --mixer=me --max_iters=80000 --resume     # continue out/me exactly where it stopped
    torchrun --standalone --nproc_per_node=4 train.py --mixer=she   # one run split over 4 GPUs (DDP)

Every run sees the same batches in the same order (Section 6): batch i is slice i of a permutation of all
start positions of train.bin, seeded by --data_seed alone, so runs that differ only in the mixer, heads,
model seed or dropout train on identical data. The run folder (--out_dir, default out/<mixer>) gets
log.csv (every batch's training cost, validation losses, tokens/s), ckpt.pt (everything --resume needs to
continue bit for bit on CPU), run.json (the settings) and, at the end, loss.png.
"""
import argparse
import csv
import ctypes
import dataclasses
import functools
import json
import os
import random
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from extractor import Config, Transformer, MIXERS
import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)

# the paper's symbol for each extractor.Config field (Table 1), shown in --help
CONFIG_HELP = {
    "vocab_size": "u: vocabulary size",
    "block_size": "l: length of the context window",
    "n_embd": "d: dimension of the model",
    "n_hidden": "c: nodes in the hidden layer of the FFN",
    "n_layer": "m: number of layers",
    "n_head": "n: heads of self-attention (used only by mixers with heads)",
    "dropout": "p: dropout rate",
    "mixer": "the first sublayer of each layer",
}
# training settings a --resume must keep: changing them would no longer continue the same run
FIXED_ON_RESUME = ("batch_size", "data_seed", "seed", "lr", "beta1", "beta2", "weight_decay", "grad_clip")
LOG_HEADER = ["iter", "train_loss", "val_loss", "lr", "tokens_per_s", "elapsed_s"]


def build_parser():
    """All settings, with the paper's Table 1 as defaults."""
    p = argparse.ArgumentParser(description="Train a Transformer LM with a chosen token mixer (paper Section 6).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model: every extractor.Config field (u comes from the data's meta.json)")
    for f in dataclasses.fields(Config):
        if f.name == "vocab_size":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)
        extra = {"choices": sorted(MIXERS)} if f.name == "mixer" else {}
        g.add_argument(f"--{f.name}", type=kind, default=default, help=CONFIG_HELP.get(f.name, f.name), **extra)
    g = p.add_argument_group("training (Table 1)")
    g.add_argument("--batch_size", type=int, default=64, help="batch size (global: split over DDP ranks)")
    g.add_argument("--max_iters", type=int, default=60000, help="number of batches to train on")
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate gamma, constant (no warm-up)")
    g.add_argument("--beta1", type=float, default=0.9, help="AdamW beta_1")
    g.add_argument("--beta2", type=float, default=0.999, help="AdamW beta_2")
    g.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (the paper gives none)")
    g.add_argument("--grad_clip", type=float, default=0.0, help="clip the gradient norm to this; 0 = off")
    g.add_argument("--seed", type=int, default=1337, help="seed of initialisation and dropout")
    g.add_argument("--data_seed", type=int, default=1337, help="seed of the batch order, shared by every run")
    g = p.add_argument_group("files, evaluation and logging")
    g.add_argument("--data_dir", default="data", help="folder with train.bin, val.bin, meta.json")
    g.add_argument("--out_dir", default=None, help="run folder; default out/<mixer> (out/sa-<n_head> for sa)")
    g.add_argument("--resume", action="store_true", help="continue the run in out_dir from its ckpt.pt")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if out_dir holds a run")
    g.add_argument("--eval_interval", type=int, default=1000, help="validation loss every this many batches")
    g.add_argument("--eval_batches", type=int, default=20, help="batches in the fixed validation set; 0 = none")
    g.add_argument("--ckpt_interval", type=int, default=1000, help="write ckpt.pt every this many batches")
    g.add_argument("--log_interval", type=int, default=100, help="console line every this many batches")
    g = p.add_argument_group("system")
    g.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 autocast on GPUs that have it, float16 + GradScaler on others, "
                        "float32 on cpu and mps")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    return p


def fail(msg):
    """Bad input: one line saying what is wrong and what to do, non-zero exit, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(1)


def given_flags(argv):
    """Names of the options given on the command line (a resumed run keeps the checkpoint's other values)."""
    probe, unset = build_parser(), object()
    probe.set_defaults(**dict.fromkeys(vars(probe.parse_args(argv)), unset))
    return {k for k, v in vars(probe.parse_args(argv)).items() if v is not unset}


def check_args(args):
    for name in ("batch_size", "eval_interval", "ckpt_interval", "log_interval"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("max_iters", "eval_batches", "seed", "data_seed", "grad_clip", "weight_decay"):
        if getattr(args, name) < 0:
            fail(f"--{name} must not be negative, got {getattr(args, name)}")
    if not args.lr > 0:
        fail(f"--lr must be positive, got {args.lr}")


# ----------------------------------------------------------------------------------------------- data

def load_data(data_dir, block_size, batch_size):
    """Memory-map train.bin and val.bin (uint16 tokens) and read u from meta.json."""
    if not os.path.isdir(data_dir):
        fail(f"data directory {data_dir!r} not found; run `python prepare_data.py` first or pass --data_dir")
    for name in ("meta.json", "train.bin", "val.bin"):
        if not os.path.isfile(os.path.join(data_dir, name)):
            fail(f"{os.path.join(data_dir, name)} is missing; run `python prepare_data.py --data_dir {data_dir}`")
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            vocab_size = int(json.load(f)["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{os.path.join(data_dir, 'meta.json')} has no valid vocab_size ({e}); re-run prepare_data.py")
    data = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        n = os.path.getsize(path) // 2
        need = block_size + (batch_size if split == "train" else 1)
        if n < need:
            fail(f"{path} holds {n} tokens, fewer than the {need} needed for windows of l+1 = {block_size + 1}"
                 f"{f' and a batch of {batch_size}' if split == 'train' else ''}; use more data or a smaller l")
        data[split] = np.memmap(path, dtype=np.uint16, mode="r")
        top = int(data[split].max())
        if top >= vocab_size:
            fail(f"{path} holds token {top}, but meta.json says vocab_size = {vocab_size}; re-run prepare_data.py")
    return data["train"], data["val"], vocab_size


@functools.lru_cache(maxsize=1)
def epoch_permutation(n_starts, data_seed, epoch):
    """A permutation of the start positions 0..n_starts-1, seeded by (data_seed, epoch) alone: independent of
    the model's seed, mixer and dropout, so every run sees the same batches in the same order (Section 6)."""
    seed = int(np.random.SeedSequence([data_seed, epoch]).generate_state(1, np.uint64)[0])
    return torch.randperm(n_starts, generator=torch.Generator().manual_seed(seed))  # (n_starts,)


def batch_starts(i, n_starts, batch_size, data_seed):
    """Start positions of global batch i (0-based): slice i of its epoch's permutation (the leftover
    n_starts % batch_size starts of each epoch are skipped). The data-order state is just i."""
    per_epoch = n_starts // batch_size
    epoch, j = divmod(i, per_epoch)
    return epoch_permutation(n_starts, data_seed, epoch)[j * batch_size:(j + 1) * batch_size]  # (batch_size,)


def get_batch(data, starts, block_size, device):
    """Windows of l+1 tokens at the given starts: x is the first l tokens, y the same shifted by one."""
    w = np.stack([data[s:s + block_size + 1] for s in starts.tolist()]).astype(np.int64)  # (b, l+1)
    w = torch.from_numpy(w)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (b, l), (b, l)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def val_starts(n_val, block_size, n_windows):
    """The fixed validation set: n_windows starts spread evenly over val.bin, the same at every eval."""
    return torch.from_numpy(np.linspace(0, n_val - block_size - 1, n_windows).round().astype(np.int64))


@torch.no_grad()
def evaluate(model, val, starts, batch_size, block_size, device, ctx, rank, world):
    """Mean loss over the fixed validation windows, each global batch split over the ranks like training."""
    model.eval()
    total, n, b = torch.zeros((), device=device), 0, batch_size // world
    for k in range(0, len(starts), batch_size):
        x, y = get_batch(val, starts[k:k + batch_size][rank * b:(rank + 1) * b], block_size, device)
        with ctx:
            _, loss = model(x, y)
        total += loss.float()
        n += 1
    if world > 1:
        dist.all_reduce(total)
        total /= world
    model.train()
    return total.item() / n


# ------------------------------------------------------------------------------------- system helpers

def pick_device(name, local_rank):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"unknown --device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            fail("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if device.type == "mps" and not torch.backends.mps.is_available():
        fail("--device mps asked for, but MPS is not available; use --device cpu")
    return device


def keep_freed_memory():
    """CPU on Linux: let glibc keep freed memory instead of mmapping and unmapping every large tensor.
    Each step frees and reallocates the same big buffers (the logits alone are B*l*u floats) and every
    fresh mmapped page faults; measured on a 2-core VM, m=2: 1.4x more tokens/s."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # from glibc's malloc.h
    mallopt(M_MMAP_MAX, 0)                # big blocks come from the heap too, so they can be reused
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # and the heap is not shrunk after each step
    mallopt(M_TOP_PAD, 2**28)


def precision(device, dtype):
    """Autocast context and GradScaler: bf16 where the GPU has it, fp16 + loss scaling otherwise."""
    if dtype == "auto":
        dtype = "float32"
        if device.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=getattr(torch, dtype))
    return dtype, ctx, torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))


def rng_state(device):
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "mps":
        s["mps"] = torch.mps.get_rng_state()
    return s


def set_rng_state(s, device):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)
    if device.type == "mps" and "mps" in s:
        torch.mps.set_rng_state(s["mps"])


def atomic_write_text(path, text):
    with open(path + ".tmp", "w", newline="") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def save_checkpoint(path, raw_model, optimizer, scaler, cfg, args, it, elapsed, rngs):
    ckpt = {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "config": dataclasses.asdict(cfg),
        "args": dict(vars(args)),
        "iter": it,                        # batches done; batch `it` (0-based) comes next
        "elapsed_s": elapsed,
        "rng": rngs,                       # one dict per DDP rank (dropout streams differ per rank)
        "data_order": {"data_seed": args.data_seed, "batch_size": args.batch_size, "next_batch": it},
    }
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


def truncate_log(path, last_iter):
    """Keep the header and rows up to the checkpoint's iteration: a crash after the last checkpoint may have
    logged later rows, which the resumed run will write again."""
    lines = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            lines = f.read().splitlines()
    keep = [",".join(LOG_HEADER)]
    for line in lines[1:]:
        field = line.split(",", 1)[0]
        if field.isdigit() and int(field) <= last_iter and line.count(",") == len(LOG_HEADER) - 1:
            keep.append(line)
    atomic_write_text(path, "\n".join(keep) + "\n")


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


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---------------------------------------------------------------------------------------------- train

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return train(argv)
    except SystemExit as e:  # fail() and argparse: the message is already printed
        return e.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(argv):
    parser = build_parser()
    parser.error = lambda msg: fail(f"{msg} (see python train.py --help)")  # one line, not usage + error
    args = parser.parse_args(argv)
    given = given_flags(argv)
    check_args(args)

    # DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in
                               (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    master = rank == 0
    say = print if master else (lambda *a, **k: None)

    if args.out_dir is None:
        args.out_dir = os.path.join("out", f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer)
    ckpt_path, log_path = os.path.join(args.out_dir, "ckpt.pt"), os.path.join(args.out_dir, "log.csv")

    ckpt = None
    if args.resume:
        if not os.path.isfile(ckpt_path):
            fail(f"no checkpoint {ckpt_path} to resume; drop --resume to start a new run, or pass its --out_dir")
        try:
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
            saved_args, saved_cfg = ckpt["args"], ckpt["config"]
            missing = {"model", "optimizer", "scaler", "iter", "elapsed_s", "rng"} - set(ckpt)
            if missing:
                raise KeyError(", ".join(sorted(missing)))
        except Exception as e:
            fail(f"cannot read checkpoint {ckpt_path} ({type(e).__name__}); it is damaged or not from train.py")
        differ = [k for k in FIXED_ON_RESUME if k in given and getattr(args, k) != saved_args.get(k)]
        differ += [k for k in saved_cfg if k in given and getattr(args, k) != saved_cfg[k]]
        if differ:
            fail(f"{ckpt_path} was trained with " + ", ".join(f"{k}={saved_cfg.get(k, saved_args.get(k))!r}"
                 for k in differ) + " but the flags give " + ", ".join(f"{k}={getattr(args, k)!r}" for k in differ)
                 + "; drop those flags to resume, or pick another --out_dir")
        for k, v in {**saved_args, **saved_cfg}.items():  # flags not given keep the checkpoint's values
            if k not in given and k not in ("out_dir", "resume", "overwrite") and hasattr(args, k):
                setattr(args, k, v)
        check_args(args)
    elif not args.overwrite and (os.path.exists(ckpt_path) or os.path.exists(log_path)):
        fail(f"{args.out_dir} already holds a run; pass --resume to continue it, --overwrite to start it again, "
             f"or choose another --out_dir")
    if args.batch_size % world:
        fail(f"--batch_size {args.batch_size} must be divisible by the {world} processes")

    cfg_fields = {f.name for f in dataclasses.fields(Config)} - {"vocab_size"}
    try:  # check the model settings before touching the data (u is checked against the data below)
        Config(**{k: getattr(args, k) for k in cfg_fields})
    except ValueError as e:
        fail(str(e))
    train_data, val_data, vocab_size = load_data(args.data_dir, args.block_size, args.batch_size)
    cfg = Config(vocab_size=vocab_size, **{k: getattr(args, k) for k in cfg_fields})
    if ckpt is not None and dataclasses.asdict(cfg) != ckpt["config"]:
        bad = [f"{k}: checkpoint {v!r}, now {getattr(cfg, k, None)!r}" for k, v in ckpt["config"].items()
               if getattr(cfg, k, None) != v]
        fail(f"{ckpt_path} is from another model config ({'; '.join(bad)}); check --data_dir or pick another --out_dir")
    device = pick_device(args.device, local_rank)
    if world > 1:  # all ranks have passed the checks above before rank 0 writes anything
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu" and sys.platform.startswith("linux"):
        keep_freed_memory()
    dtype, ctx, scaler = precision(device, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # model: the same initialisation on every rank, then a dropout stream per rank (seed + rank)
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                                  weight_decay=args.weight_decay, fused=(device.type == "cuda"))
    start_iter, elapsed0 = 0, 0.0
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            fail(f"{ckpt_path} does not fit this model ({str(e).splitlines()[0]}); pick another --out_dir")
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        start_iter, elapsed0 = ckpt["iter"], ckpt["elapsed_s"]
        if len(ckpt["rng"]) == world:
            set_rng_state(ckpt["rng"][rank], device)
        else:  # another number of processes: the dropout streams cannot continue, so start new ones
            say(f"note: checkpoint from {len(ckpt['rng'])} processes, now {world}: dropout RNG reseeded")
            torch.manual_seed(args.seed + rank + 1_000_003 * start_iter)
        del ckpt
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    eval_model = model.module if world > 1 else model

    n_starts = len(train_data) - args.block_size  # windows of l+1 tokens start at 0 .. N-l-1
    tokens_per_batch = args.batch_size * args.block_size
    vstarts = val_starts(len(val_data), args.block_size, args.eval_batches * args.batch_size)
    counts = raw_model.param_counts()
    say(f"{cfg}\non {device} ({dtype}){f' x {world} processes' if world > 1 else ''}; out_dir {args.out_dir}")
    say("parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    say(f"data: {len(train_data):,} train tokens ({n_starts:,} windows), {len(val_data):,} val tokens; "
        f"{args.max_iters:,} batches of {args.batch_size} = {args.max_iters * args.batch_size / n_starts:.3f} epochs")

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        run = {"config": dataclasses.asdict(cfg), "args": dict(vars(args)), "params": counts, "world_size": world}
        atomic_write_text(os.path.join(args.out_dir, "run.json"), json.dumps(run, indent=1) + "\n")
        if args.resume:
            truncate_log(log_path, start_iter)
        else:
            if os.path.exists(ckpt_path):  # --overwrite: an old checkpoint must not outlive its log
                os.remove(ckpt_path)
            atomic_write_text(log_path, ",".join(LOG_HEADER) + "\n")
    log_file = open(log_path, "a", newline="") if master else None
    writer = csv.writer(log_file, lineterminator="\n") if master else None

    # Ctrl-C: finish the current batch, checkpoint, stop (a second Ctrl-C aborts at once)
    stop = {"asked": False}

    def on_sigint(signum, frame):
        stop["asked"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        say(f"\nCtrl-C: stopping {'after this batch' if world == 1 else 'at the next log point'} and writing "
            f"a checkpoint (Ctrl-C again to abort)")
    try:
        old_handler = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread (train.main called from a thread): keep Python's default
        old_handler = None

    b = args.batch_size // world
    # each batch's loss goes into this fixed buffer until the next flush: no tensor outlives its step,
    # so the freed activations of one step are reused by the next (see keep_freed_memory)
    loss_buf = torch.zeros(max(1, min(args.log_interval, args.max_iters - start_iter)), device=device)
    pending, t_session, t_chunk, it = [], time.time(), time.time(), start_iter
    last_val = None
    say(f"training from batch {start_iter} to {args.max_iters}")
    try:
        while it < args.max_iters:
            starts = batch_starts(it, n_starts, args.batch_size, args.data_seed)[rank * b:(rank + 1) * b]
            x, y = get_batch(train_data, starts, args.block_size, device)  # (b, l), (b, l)
            try:
                loss = train_step(model, optimizer, scaler, ctx, x, y, args.grad_clip)
            except Exception as e:
                if args.compile and it == start_iter:
                    fail(f"the first step with --compile failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                         f"run without --compile")
                raise
            it += 1
            loss_buf[len(pending)] = loss.detach()
            pending.append((it, time.time()))

            # flush the losses to log.csv: at log points, evals, checkpoints, the end, and on Ctrl-C
            do_eval = args.eval_batches > 0 and (it % args.eval_interval == 0 or it == args.max_iters)
            do_ckpt = it % args.ckpt_interval == 0 or it == args.max_iters
            if not (it % args.log_interval == 0 or do_eval or do_ckpt or (world == 1 and stop["asked"])):
                continue
            losses = loss_buf[:len(pending)].clone()  # (k,)
            if world > 1:  # mean over ranks = the loss of the global batch; also agree on stopping
                flag = torch.tensor([float(stop["asked"])], device=losses.device)
                buf = torch.cat([losses / world, flag])
                dist.all_reduce(buf)
                losses, stop["asked"] = buf[:-1], bool(buf[-1].item() > 0)
            losses = losses.tolist()
            now = time.time()
            tok_s = tokens_per_batch * len(pending) / max(now - t_chunk, 1e-9)
            val = evaluate(eval_model, val_data, vstarts, args.batch_size, args.block_size, device, ctx,
                           rank, world) if do_eval else None
            if master:
                lr = optimizer.param_groups[0]["lr"]
                for (i, t), l in zip(pending, losses):  # val_loss only in the row it was measured at
                    v = repr(val) if (i == it and val is not None) else ""
                    writer.writerow([i, repr(l), v, lr, f"{tok_s:.1f}", f"{elapsed0 + t - t_session:.3f}"])
                log_file.flush()
            last_val = val if val is not None else last_val
            if it % args.log_interval == 0 or do_eval or it == args.max_iters or stop["asked"]:
                eta = (args.max_iters - it) * (now - t_session) / (it - start_iter)  # at this session's pace
                say(f"iter {it}/{args.max_iters} ({100 * it / args.max_iters:.1f}%) | loss {np.mean(losses):.4f}"
                    + (f" | val {val:.4f}" if val is not None else "") + f" | {tok_s / 1000:.1f}k tok/s"
                    + f" | elapsed {fmt_time(elapsed0 + now - t_session)} | ETA {fmt_time(eta)}")
            pending = []
            if do_ckpt or stop["asked"]:
                rngs = [rng_state(device)]
                if world > 1:
                    rngs = [None] * world
                    dist.all_gather_object(rngs, rng_state(device))
                if master:
                    save_checkpoint(ckpt_path, raw_model, optimizer, scaler, cfg, args, it,
                                    elapsed0 + time.time() - t_session, rngs)
            if stop["asked"]:
                say(f"stopped at batch {it}; continue with the same command plus --resume")
                if world > 1:
                    dist.barrier()
                return 130
            t_chunk = time.time()
    except KeyboardInterrupt:
        say(f"\naborted; the last checkpoint (if any) is {ckpt_path}")
        return 130
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if log_file:
            log_file.close()

    if master:
        if start_iter >= args.max_iters:
            say(f"{ckpt_path} is already at batch {start_iter} >= --max_iters {args.max_iters}; nothing to do")
        try:
            from plot import plot_run
            plot_run(args.out_dir, os.path.join(args.out_dir, "loss.png"))
            say(f"wrote {os.path.join(args.out_dir, 'loss.png')}"
                + (f"; final val loss {last_val:.4f}" if last_val is not None else ""))
        except Exception as e:  # the run itself succeeded; a missing plot is not worth a failure
            say(f"warning: could not draw loss.png ({type(e).__name__}: {e})")
    if world > 1:
        dist.barrier()  # tear the process group down together (gloo may abort if one rank leaves early)
    return 0


if __name__ == "__main__":
    sys.exit(main())
