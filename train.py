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
(the settings, the parameter counts, the last checkpoint's batch and, at the end, the peak memory) and
loss.png. Ctrl-C, kill (SIGTERM) and SIGHUP finish the batch, checkpoint and stop.

The file reads as the experiment: settings, data and batches, model, step, then train() (the run
folder, data, model, the loop); evaluation after the loop. The run folder's guarantees (its name, the
lock, one run per folder, what a resumed run takes from its checkpoint, log.csv and ckpt.pt in step,
stop signals) are rundir.py's.
"""

import argparse
import dataclasses
import functools
import math
import os
import random
import shlex
import signal
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import rundir
import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
from common import (
    MODEL_SETTINGS,
    TRAINING_SETTINGS,
    check_seed,
    fail,
    keep_freed_memory,
    one_line_errors,
    peak_memory,  # noqa: F401  (for bench.py and sample.py: train.peak_memory)
    pick_device,
    plain_output,
)
from extractor import MIXERS, Config, Transformer
from prepare_data import load_data
from rundir import CapturedStep  # noqa: F401  (for bench.py: train.CapturedStep)

# DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
RANK, WORLD, LOCAL_RANK = (int(os.environ.get(k, "0")) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
WORLD, MASTER = max(WORLD, 1), RANK == 0

# ---------------------------------------------------------------------------------------------- settings


def say(*args):
    """A console line, shown at once (also under nohup); under torchrun only rank 0 prints."""
    if MASTER:
        print(*args, flush=True)


def build_parser():
    """All settings, with the paper's Table 1 as defaults. Those that name a run take their symbol, help
    and default from common.py's tables (the model's defaults are extractor.Config's)."""
    p = argparse.ArgumentParser(
        description="Train a Transformer LM with a token mixer (Section 6).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model (extractor.Config; the vocabulary size u comes from the data)")
    g.add_argument("--mixer", default=Config.mixer, choices=sorted(MIXERS), help="the first sublayer")
    for name, (symbol, text) in MODEL_SETTINGS.items():
        default = getattr(Config, name)
        g.add_argument(f"--{name}", type=type(default), default=default, help=f"{symbol}: {text}")

    g = p.add_argument_group("training (Table 1)")
    for name, (symbol, text, default) in TRAINING_SETTINGS.items():
        g.add_argument(f"--{name}", type=type(default), default=default, help=f"{symbol}: {text}")
    g.add_argument("--max_iters", type=int, default=60000, help="number of batches to train on")

    g = p.add_argument_group("files and logging")
    g.add_argument("--data_dir", default="data", help="folder with train.bin, val.bin, meta.json")
    g.add_argument("--out_dir", help="run folder (default: out/<mixer>, plus -<symbol><value> per change)")
    g.add_argument("--resume", action="store_true", help="continue the run in out_dir from its ckpt.pt")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if out_dir holds a run")
    g.add_argument("--allow_other_data", action="store_true", help="with --resume: go on with other data")
    g.add_argument("--eval_interval", type=int, default=1000, help="validation loss every this many batches")
    g.add_argument("--eval_batches", type=int, default=20, help="batches in the validation set; 0 = none")
    g.add_argument("--ckpt_interval", type=int, default=1000, help="ckpt.pt each this many batches and at 10")
    g.add_argument("--log_interval", type=int, default=100, help="console line every this many batches")

    g = p.add_argument_group("system")
    g.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="autocast")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    on_off = argparse.BooleanOptionalAction
    g.add_argument("--tf32", action=on_off, default=True, help="CUDA: float32 matmuls in TF32")
    g.add_argument("--cuda_graph", action=on_off, default=True, help="CUDA: replay the step as a CUDA graph")
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
    if args.batch_size % WORLD:
        fail(f"--batch_size {args.batch_size} must be divisible by the {WORLD} processes")
    try:
        Config(**model_settings(args))
    except ValueError as e:
        fail(str(e))


def model_settings(args):
    """The Config fields among the settings (all but vocab_size, which comes from the data)."""
    return {name: getattr(args, name) for name in ("mixer", *MODEL_SETTINGS)}


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


def precision(device, dtype, tf32=True):
    """Autocast context and GradScaler: float32 unless --dtype asks for bf16 or fp16 (loss scaling). On
    CUDA float32 matmuls in TF32 (float32's range, a 10-bit mantissa) unless --no-tf32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if device.type == "cpu" and dtype != "float32":
        say(
            f"note: --dtype {dtype} on the CPU may run several times slower than float32, or a little "
            "faster, by CPU and mixer; time a few batches of each before a long run"
        )
    cache, kind = device.type != "cuda", getattr(torch, dtype)  # CUDA graphs ask for no autocast cache
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device.type, kind, cache_enabled=cache)
    return ctx, torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))


def build_model(cfg, args, device):
    """The model (the same initialisation on every rank, then a dropout stream per rank) and AdamW."""
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + RANK)  # then a dropout stream per rank
    random.seed(args.seed + RANK)
    betas, cuda = (args.beta1, args.beta2), device.type == "cuda"
    optimizer = torch.optim.AdamW(  # on CUDA fused, and capturable in a CUDA graph
        model.parameters(), args.lr, betas, weight_decay=args.weight_decay, fused=cuda, capturable=cuda
    )
    return model, optimizer


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


# --------------------------------------------------------------------------------------- train: the loop


@dataclasses.dataclass
class Run:
    """What the loop works with."""

    args: argparse.Namespace
    device: torch.device
    train_data: np.ndarray  # (N,) uint16 tokens, memory-mapped
    val_data: np.ndarray
    data: dict  # the data's fingerprint (vocab size, sha256 of the files), kept in the checkpoint
    raw_model: Transformer  # the Transformer itself, whose state_dict is saved
    model: torch.nn.Module  # what is trained: raw_model, compiled and/or wrapped for DDP
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ctx: object  # autocast, or nothing for float32
    step: object = None  # step(x, y) -> loss: train_step, or its CUDA graph (rundir.make_step)


def train(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args)
    args.data_dir = os.path.abspath(args.data_dir)  # the checkpoint works from any directory
    if args.max_iters == 0 and not args.resume:
        say("--max_iters 0: nothing to train")
        return 0

    # the run folder: named, locked for the whole run, judged before anything in it is written
    with rundir.run_folder(args, parser, argv, MASTER) as ckpt:
        if ckpt:
            check_args(args)  # the checkpoint's settings, checked like the flags
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

        # the model, AdamW, the precision and, resuming, their state; then what is trained
        device = pick_device(args.device, LOCAL_RANK)
        if WORLD > 1:  # all ranks have passed the checks above before rank 0 writes anything
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cpu" and sys.platform.startswith("linux"):
            keep_freed_memory()
        ctx, scaler = precision(device, args.dtype, args.tf32)
        raw_model, optimizer = build_model(cfg, args, device)
        if ckpt:
            rundir.restore(ckpt, raw_model, optimizer, scaler, device, RANK, WORLD)
        model = torch.compile(raw_model) if args.compile else raw_model
        if WORLD > 1:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        run = Run(args, device, train_data, val_data, data, raw_model, model, optimizer, scaler, ctx)
        run.step, how = rundir.make_step(run, train_step, WORLD)  # on CUDA captured in a CUDA graph

        # now the folder becomes this run's: run.json (and how it computes), log.csv (resuming: cut back)
        if MASTER:
            counts, config = raw_model.param_counts(), dataclasses.asdict(cfg)
            info = {"config": config, "args": dict(vars(args)), "params": counts, "world_size": WORLD}
            info.update(data=data, computed=rundir.computed(run, how))
            rundir.start_files(args.out_dir, info, start)
            describe(run, start, info["computed"])
        log = rundir.RunLog(args, start, ckpt["elapsed_s"] if ckpt else 0.0, device, MASTER, WORLD)
        del ckpt
        try:
            return loop(run, log, start)
        except rundir.CaptureError as e:
            fail(f"{e}; train without it: --no-cuda_graph")
        except Exception as e:  # torch.compile compiles at the first step, and fails there if it cannot
            if args.compile:
                fail(f"training with --compile failed ({type(e).__name__}: {str(e)[:80]}); try without it")
            raise


def loop(run, log, start):
    """Batch -> step -> (when due) evaluate, log, checkpoint; until max_iters or a stop signal."""
    args, b = run.args, run.args.batch_size // WORLD
    n_starts = len(run.train_data) - args.block_size  # windows of l+1 tokens start at 0 .. N-l-1
    it, val, saved_at = start, None, start or None
    with rundir.stop_signals() as stop:
        while it < args.max_iters:
            starts = batch_starts(it, n_starts, args.batch_size, args.data_seed)[RANK * b : (RANK + 1) * b]
            x, y = get_batch(run.train_data, starts, args.block_size, run.device)  # (b, l), (b, l)
            log.add(run.step(x, y))  # train_step (on CUDA: its CUDA graph, replayed)
            it += 1
            eval_now, ckpt_now, log_now = due(it, start, args, stop["signal"] is not None)
            if not log_now:
                continue
            if eval_now:
                val = evaluate(run)
            stopping = rundir.agree_to_stop(stop, WORLD)
            log.write(it, val if eval_now else None, saved_at)
            if ckpt_now or stopping:
                rundir.save_checkpoint(run, it, log.elapsed(), saved_at, RANK, WORLD)
                saved_at = it
            if stopping:
                name = signal.Signals(stop["signal"] or signal.SIGINT).name
                say(f"{name}: stopped at batch {it}; continue with the same command plus --resume")
                rundir.report_peak_memory(args.out_dir, run.device, MASTER)
                return 128 + (stop["signal"] or signal.SIGINT)

    # the end: loss.png, what to do next, the peak memory
    if MASTER:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments"))
        from plot import plot_run

        plot_run(args.out_dir, os.path.join(args.out_dir, "loss.png"))
        say(f"wrote {args.out_dir}/loss.png" + (f"; final val loss {val:.4f}" if val is not None else ""))
        say(f"sample from it: python sample.py --out_dir {shlex.quote(args.out_dir)}")
    rundir.report_peak_memory(args.out_dir, run.device, MASTER)
    return 0


def due(it, start, args, stop_asked):
    """What batch `it` (just done) ends with: (evaluate, checkpoint, log point). A log point writes the
    batches since the last one to log.csv and a console line: every log_interval batches, at each
    evaluation and checkpoint, and in one process as soon as a stop signal came (under DDP the ranks
    agree to stop at log points, which they all reach together). The first log point, 10 batches in
    (or at log_interval if sooner), also checkpoints: a new run shows its speed within seconds and can
    be resumed from then on (gpu.py lets a run reach this checkpoint before it stops it)."""
    last = it == args.max_iters
    evaluate = args.eval_batches > 0 and (it % args.eval_interval == 0 or last)
    checkpoint = it % args.ckpt_interval == 0 or it == start + min(10, args.log_interval) or last
    log = evaluate or checkpoint or it % args.log_interval == 0 or (stop_asked and WORLD == 1)
    return evaluate, checkpoint, log


# ----------------------------------------------------------------- after the loop: evaluation, the console


@torch.no_grad()
def evaluate(run):
    """Mean loss over a fixed validation set: eval_batches * batch_size windows spread evenly over
    val.bin, the same at every evaluation; each global batch is split over the ranks like training."""
    args = run.args
    n, b = args.eval_batches * args.batch_size, args.batch_size // WORLD
    starts = torch.from_numpy(
        np.linspace(0, len(run.val_data) - args.block_size - 1, n).round().astype(np.int64)
    )
    model = run.model.module if WORLD > 1 else run.model
    model.eval()
    total = torch.zeros((), device=run.device)
    for k in range(0, n, args.batch_size):
        mine = starts[k : k + args.batch_size][RANK * b : (RANK + 1) * b]  # this rank's part
        x, y = get_batch(run.val_data, mine, args.block_size, run.device)
        with run.ctx:
            total += model(x, y)[1].float()
    if WORLD > 1:
        dist.all_reduce(total)
        total /= WORLD
    model.train()
    return total.item() / args.eval_batches


def describe(run, start, computed):
    """What the run is and how it computes, on the console."""
    args, n_starts = run.args, len(run.train_data) - run.args.block_size
    processes = f" x {WORLD} processes" if WORLD > 1 else ""
    how = f"{args.dtype}{', TF32 matmuls' * (computed['float32_matmul'] == 'tf32')}"
    say(f"{run.raw_model.cfg}\non {run.device} ({how}){processes}, step {computed['step']}; {args.out_dir}")
    say("parameters: " + ", ".join(f"{k} {v:,}" for k, v in run.raw_model.param_counts().items()))
    epochs = args.max_iters * args.batch_size / n_starts  # passes over the windows
    targets = epochs * args.block_size  # each window predicts l tokens: passes over the tokens
    say(
        f"data: {len(run.train_data):,} train tokens ({n_starts:,} windows), "
        f"{len(run.val_data):,} val tokens; {args.max_iters:,} batches of {args.batch_size} = "
        f"{epochs:.3f} epochs of windows, each token a target {targets:.1f} times"
    )
    say(f"training from batch {start} to {args.max_iters}")


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
