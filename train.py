"""
Train a language model whose first sublayer is a token mixer of extractor.py (the paper's Section 6).

    python prepare_data.py && python train.py --mixer=me      # Table 1: m=18, l=d=128, 60000 batches of 64
    python train.py --mixer=me --n_layer=2 --block_size=64 --batch_size=32 --max_iters=1000  # CPU: minutes
    python train.py --mixer=me --max_iters=80000 --resume     # continue out/me where it stopped
    python train.py --mixer=she --time_limit=40m              # stop at a checkpoint before 40 minutes
    torchrun --standalone --nproc_per_node=4 train.py --mixer=she   # one run over 4 GPUs (DDP)

Every run sees the same batches in the same order: batch i is slice i of a permutation of the start
positions in train.bin, seeded by --data_seed alone. The run folder (out/<mixer>, plus -<symbol><value>
for each setting that is not Table 1's) holds log.csv (every batch's training cost, the validation
losses, tokens/s), ckpt.pt (all that --resume needs to continue bit for bit) and run.json (settings,
parameter counts, the data's sha256, how the run computed, peak memory). A folder holds one run once it
has a ckpt.pt. Ctrl-C, kill, a closed terminal and --time_limit end the batch, checkpoint and stop.
"""

import argparse
import ctypes
import dataclasses
import functools
import glob
import json
import math
import os
import re
import signal
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fir
from extractor import Config, Transformer
from prepare_data import atomic_write, fail, fmt_time, load_data

# DDP: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is one process
RANK, WORLD, LOCAL_RANK = (
    int(os.environ.get(k, "0")) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
)
WORLD, MASTER = max(WORLD, 1), RANK == 0
STOP = {
    "signal": None
}  # set by Ctrl-C, kill, a closed terminal or stdout: stop after this batch
TABLE_1 = {  # the settings that name a run: flag -> (the paper's symbol, Table 1's value, what it is)
    "n_layer": ("m", 18, "number of layers"),
    "block_size": ("l", 128, "context length"),
    "n_embd": ("d", 128, "dimension of the model"),
    "n_hidden": ("c", 512, "nodes in the FFN's hidden layer"),
    "n_head": ("n", 32, "heads of self-attention (and of the Synthesizers)"),
    "dropout": ("p", 0.1, "dropout rate"),
    "batch_size": ("b", 64, "batch size, over all processes"),
    "lr": ("lr", 1e-3, "AdamW's learning rate gamma, constant"),
    "beta1": ("bm", 0.9, "AdamW's beta_1"),
    "beta2": ("bv", 0.999, "AdamW's beta_2"),
    "weight_decay": (
        "wd",
        0.01,
        "AdamW's weight decay (not in the paper: PyTorch's default)",
    ),
    "grad_clip": ("clip", 0.0, "clip the gradients' norm to this; 0 = off"),
    "seed": ("seed", 1337, "seed of the initialisation and of dropout"),
    "data_seed": ("dseed", 1337, "seed of the batch order"),
}
# --resume takes every setting from ckpt.pt but these; the data must be the same
MAY_CHANGE = {
    "max_iters",
    "eval_interval",
    "ckpt_interval",
    "log_interval",
    "data_dir",
    "device",
    "compile",
}
THIS_COMMAND = {
    "out_dir",
    "resume",
    "overwrite",
    "time_limit",
    "cuda_graph",
}  # never from ckpt.pt


def build_parser():
    p = argparse.ArgumentParser(
        description="Train a Transformer language model with a token mixer."
    )
    p.error = lambda msg: fail(f"{msg} (see python train.py --help)")
    mixers = "sa, she, we, he, me, he-ext, a Synthesizer (dense, random, ...) or your module.Class"
    p.add_argument(
        "--mixer", default="sa", help=f"the first sublayer: {mixers} (default: sa)"
    )
    for name, (symbol, value, text) in TABLE_1.items():
        p.add_argument(
            f"--{name}",
            type=type(value),
            default=value,
            help=f"{symbol}: {text} (%(default)s)",
        )
    p.add_argument(
        "--max_iters", type=int, default=60000, help="batches to train on (%(default)s)"
    )
    p.add_argument(
        "--time_limit",
        default="",
        help="stop at a checkpoint before this is up: 90s, 40m, 2h",
    )
    p.add_argument(
        "--eval_interval",
        type=int,
        default=1000,
        help="validation every this many batches",
    )
    p.add_argument(
        "--eval_batches",
        type=int,
        default=20,
        help="batches of validation (20); 0: none",
    )
    p.add_argument(
        "--ckpt_interval",
        type=int,
        default=1000,
        help="ckpt.pt every this many batches",
    )
    p.add_argument(
        "--log_interval",
        type=int,
        default=100,
        help="a console line every this many batches",
    )
    p.add_argument(
        "--data_dir",
        default="data",
        help="prepare_data.py's train.bin, val.bin, meta.json",
    )
    p.add_argument(
        "--out_dir",
        default="",
        help="the run folder (default: out/<mixer>-<changed settings>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue out_dir's run, with its settings",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start out_dir's run again from batch 0",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda, mps, then cpu), cpu, cuda, cuda:1, mps",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="autocast",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    on_off = argparse.BooleanOptionalAction
    p.add_argument(
        "--tf32",
        action=on_off,
        default=True,
        help="CUDA: float32 matmuls in TF32 (default)",
    )
    p.add_argument(
        "--cuda_graph",
        action=on_off,
        default=True,
        help="CUDA: replay the step as a CUDA graph",
    )
    return p


def check_args(args):
    """Bounds that would otherwise fail in the middle of a run: one line each."""
    for name in ("batch_size", "eval_interval", "ckpt_interval", "log_interval"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("max_iters", "eval_batches", "grad_clip", "weight_decay", "data_seed"):
        if not 0 <= getattr(args, name) < math.inf:
            fail(f"--{name} must be a finite number >= 0, got {getattr(args, name)}")
    a = args
    if not (
        0 < a.lr < math.inf
        and 0 <= a.beta1 < 1
        and 0 <= a.beta2 < 1
        and 0 <= a.seed < 2**63
    ):
        fail(
            f"need --lr > 0, --beta1, --beta2 in [0, 1), --seed in [0, 2**63); got {a.lr}, {a.beta1}, ..."
        )
    if args.resume and args.overwrite:
        fail(
            "--resume continues out_dir's run and --overwrite replaces it: pass one of them"
        )
    if args.batch_size % WORLD:
        fail(
            f"--batch_size {args.batch_size} must be divisible by the {WORLD} processes"
        )
    try:
        seconds(args.time_limit)
        Config(**model_settings(args, vocab_size=1))
    except ValueError as e:
        fail(str(e))


def seconds(text):
    """--time_limit in seconds (90, 90s, 40m, 2h); none is no limit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if text and not m:
        raise ValueError(f"--time_limit {text!r} is not a time: write 90s, 40m or 2h")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[m[2]] if text else math.inf


def model_settings(args, **more):
    return {
        k: getattr(args, k) for k in Config.__dataclass_fields__ if k != "vocab_size"
    } | more


# -------------------------------------------------------------------------------------
# data and batches
@functools.lru_cache(maxsize=1)
def epoch_permutation(n_starts, data_seed, epoch):
    """A permutation of 0..n_starts-1 seeded by (data_seed, epoch) alone: the same in
    every run.
    """
    seed = int(
        np.random.SeedSequence([data_seed, epoch]).generate_state(1, np.uint64)[0]
    )
    return torch.randperm(
        n_starts, generator=torch.Generator().manual_seed(seed)
    )  # (n_starts,)


def batch_starts(i, n_starts, batch_size, data_seed):
    """Batch i's starts: slice i of its epoch's permutation (the n_starts % batch_size
    left over skipped).
    """
    epoch, j = divmod(i, n_starts // batch_size)
    return epoch_permutation(n_starts, data_seed, epoch)[
        j * batch_size : (j + 1) * batch_size
    ]


def get_batch(data, starts, block_size, device):
    """Windows of l+1 tokens at the starts: x is each window's first l tokens, y the
    same shifted by one.
    """
    windows = [data[s : s + block_size + 1] for s in starts.tolist()]
    w = torch.from_numpy(np.stack(windows).astype(np.int64))  # (b, l + 1)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (b, l), (b, l)
    pin = device.type == "cuda"  # pinned: the copy to the GPU runs beside the step
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)


# ------------------------------------------------------------------------------- the
# model and the step
def build_model(cfg, args, device):
    """The Transformer, the same in every process (then a dropout stream each), and
    AdamW (CUDA: fused, and capturable, which the captured step needs).
    """
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + RANK)
    betas = (args.beta1, args.beta2)
    kind = dict(fused=device.type == "cuda", capturable=device.type == "cuda")
    adamw = torch.optim.AdamW(
        model.parameters(), args.lr, betas, 1e-8, args.weight_decay, **kind
    )
    return model, adamw


def train_step(model, optimizer, scaler, ctx, x, y, grad_clip=0.0):
    """One batch: forward, the loss of Eq. (3), backward, clipping if on, AdamW.
    Returns the loss.
    """
    with ctx:
        _, loss = model(x, y)  # the mean cross-entropy of the batch, Eq. (3)
    scaler.scale(
        loss
    ).backward()  # (only float16 scales its loss; else scale and unscale_ do nothing)
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_step(model, optimizer, scaler, ctx, args, device):
    """The training step: on CUDA captured in a CUDA graph, unless --no-cuda_graph, DDP,
    torch.compile or float16's loss scaling (their steps run eagerly).
    """
    step = functools.partial(
        train_step, model, optimizer, scaler, ctx, grad_clip=args.grad_clip
    )
    eager = WORLD > 1 or args.compile or args.dtype == "float16"
    if device.type == "cuda" and args.cuda_graph and not eager:
        step = CapturedStep(step, optimizer, os.path.join(args.out_dir, "run.json"))
    return step


class CapturedStep:
    """step(x, y) replayed from a CUDA graph: one launch instead of the step's ~1000
    kernels. The first 3 calls run eagerly on a side stream (cuBLAS, AdamW and the
    allocator set up), the 4th records the step on static inputs, then each call copies
    its batch in and replays. Parameters, gradients and AdamW's state keep their
    addresses: a replay is the eager step bit for bit, dropout's generator included.
    With run.json's path, a step that cannot be recorded runs eagerly from then on."""

    def __init__(self, step, optimizer=None, run_json=None, warmup=3):
        self.step = step
        self.optimizer = optimizer
        self.run_json = run_json
        self.warmup = warmup
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
                if self.run_json is None:
                    raise
                return self.fall_back(error, x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.loss.clone()

    def fall_back(self, error, x, y):
        """The eager step from now on, said on the console and in run.json; the failed
        recording's gradients, never computed, dropped.
        """
        why = f"{type(error).__name__}: {error}".splitlines()[0]
        say(f"the step cannot be captured in a CUDA graph ({why}); it runs eagerly")
        with open(self.run_json) as f:
            info = json.load(f)
        info["computed"]["step"] = f"eager, the capture failed ({why})"
        atomic_write(self.run_json, json.dumps(info, indent=1) + "\n")
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = None
        self.warmup = math.inf  # eager, on the side stream, from now on
        return self(x, y)


# --------------------------------------------------------------------------------------------
# the run
def train(args, ckpt):
    """The data, the model and its step, the run's files, then the loop."""
    start, elapsed0 = (ckpt["iter"], ckpt["elapsed_s"]) if ckpt else (0, 0.0)
    train_data, val_data, data = load_data(
        args.data_dir, args.block_size, args.batch_size
    )
    if args.eval_batches * args.batch_size > len(val_data) - args.block_size:
        fail(
            "val.bin holds fewer than --eval_batches x --batch_size windows: use fewer --eval_batches"
        )
    if ckpt and ckpt["data"] != data:
        differ = ", ".join(k for k in data if ckpt["data"].get(k) != data[k])
        fail(
            f"{args.out_dir}/ckpt.pt was trained on other data ({differ} differ); pass its --data_dir"
        )
    device = pick_device(args.device)
    if WORLD > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx, scaler = precision(device, args.dtype, args.tf32)
    cfg = Config(**model_settings(args, vocab_size=data["vocab_size"]))
    raw_model, optimizer = build_model(cfg, args, device)
    if ckpt:
        restore(ckpt, raw_model, optimizer, scaler, device)
    model = torch.compile(raw_model) if args.compile else raw_model
    ddp = (
        DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if WORLD > 1
        else model
    )
    step = make_step(ddp, optimizer, scaler, ctx, args, device)
    if MASTER:  # the folder becomes this run's: run.json, and log.csv new or cut back to the checkpoint
        info = dict(
            config=dataclasses.asdict(cfg),
            args=vars(args),
            params=raw_model.param_counts(),
        )
        info.update(data=data, world_size=WORLD, computed=computed(device, args, step))
        start_files(args.out_dir, info, start)
        describe(args, cfg, info, len(train_data), len(val_data), start)
    # batch -> step -> at log points: evaluate, log, checkpoint; until max_iters, a
    # signal or the time limit
    b, n_starts = args.batch_size // WORLD, len(train_data) - args.block_size
    losses = torch.zeros(
        args.log_interval, device=device
    )  # each batch's loss, kept on the device
    t0 = t_resumed = time.time()  # (t_resumed: the end of the last log point)
    val, times, slowest, pause = (
        None,
        [],
        0.0,
        5.0,
    )  # (pause: the longest log point's work, s)
    for it in range(
        start + 1, args.max_iters + 1
    ):  # it: the batches done once this one is
        starts = batch_starts(it - 1, n_starts, args.batch_size, args.data_seed)[
            RANK * b : (RANK + 1) * b
        ]
        x, y = get_batch(train_data, starts, args.block_size, device)  # (b, l), (b, l)
        losses[len(times)] = step(x, y)
        times.append(time.time())
        slowest = max(slowest, times[-1] - (times[-2] if len(times) > 1 else t_resumed))
        asked = STOP["signal"] is not None or times[
            -1
        ] + 2 * slowest + pause - t0 > seconds(args.time_limit)
        evaluate_now = args.eval_batches > 0 and (
            it % args.eval_interval == 0 or it == args.max_iters
        )
        ckpt_now = it % args.ckpt_interval == 0 or it == args.max_iters
        log_now = (
            evaluate_now or ckpt_now or it % args.log_interval == 0 or it == start + 10
        )
        if not (
            log_now or asked and WORLD == 1
        ):  # (under DDP, every process stops at a log point)
            continue
        val = evaluate(model, args, val_data, device, ctx) if evaluate_now else val
        stopping = (
            mean_over_processes(torch.tensor(float(asked), device=device)).item() > 0
        )
        tok_s = len(times) * args.batch_size * args.block_size / (times[-1] - t_resumed)
        rows = log(
            args,
            losses[: len(times)],
            times,
            it,
            val if evaluate_now else None,
            tok_s,
            elapsed0 - t0,
        )
        eta = fmt_time(
            (args.max_iters - it) * (times[-1] - t0) / (it - start)
        )  # at this session's pace
        line = (
            f"iter {it}/{args.max_iters} | loss {np.mean([v for _, v, _ in rows]):.4f}"
        )
        line += f" | val {val:.4f}" if evaluate_now else ""
        say(
            f"{line} | {tok_s / 1e3:.1f}k tok/s | elapsed {fmt_time(elapsed0 + times[-1] - t0)} | ETA {eta}"
        )
        if ckpt_now or stopping:
            save_checkpoint(
                args,
                raw_model,
                optimizer,
                scaler,
                cfg,
                data,
                it,
                elapsed0 + time.time() - t0,
            )
        if stopping:
            why = (
                "--time_limit"
                if STOP["signal"] is None
                else signal.Signals(STOP["signal"]).name
            )
            say(
                f"{why}: stopped at batch {it} with a checkpoint; go on with the same command and --resume"
            )
            return report_peak_memory(
                args, device, 0 if STOP["signal"] is None else 128 + STOP["signal"]
            )
        times, t_resumed, pause = [], time.time(), max(pause, time.time() - times[-1])
    say(
        f"done: {args.out_dir}"
        + (f"; final val loss {val:.4f}" if val is not None else "")
    )
    say(
        f"plot: python experiments/plot.py {args.out_dir}; sample: python sample.py --out_dir {args.out_dir}"
    )
    return report_peak_memory(args, device, 0)


@torch.no_grad()
def evaluate(model, args, val_data, device, ctx):
    """The mean loss over the same eval_batches x batch_size windows each time, spread
    evenly over val.bin.
    """
    n, b = args.eval_batches * args.batch_size, args.batch_size // WORLD
    starts = torch.from_numpy(
        np.linspace(0, len(val_data) - args.block_size - 1, n).round().astype(np.int64)
    )
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for k in range(0, n, args.batch_size):
        mine = starts[k : k + args.batch_size][
            RANK * b : (RANK + 1) * b
        ]  # this process's part
        with ctx:
            total += model(*get_batch(val_data, mine, args.block_size, device))[
                1
            ].float()
    model.train(was_training)
    return mean_over_processes(total).item() / args.eval_batches


def mean_over_processes(t):
    """Under DDP the mean of t over the processes, each of which calls this at the same
    point.
    """
    if WORLD > 1:
        t = t / WORLD
        dist.all_reduce(t)
    return t


def log(args, losses, times, it, val, tok_s, t_to_elapsed):
    """The batches since the last log point into log.csv (DDP: the whole batch's loss);
    nan or inf ends it.
    """
    rows = list(
        zip(
            range(it - len(times) + 1, it + 1),
            mean_over_processes(losses).tolist(),
            times,
        )
    )
    for i, v, _ in rows:
        if not math.isfinite(v):
            fail(f"the training cost became {v} at batch {i}; its last checkpoint is kept. Start again "
                 "(--overwrite) with a smaller --lr or with --grad_clip")  # fmt: skip
    if MASTER:
        with open(os.path.join(args.out_dir, "log.csv"), "a") as f:
            for i, v, t in rows:
                val_i = repr(val) if i == it and val is not None else ""
                f.write(
                    f"{i},{v!r},{val_i},{args.lr},{tok_s:.1f},{t_to_elapsed + t:.3f}\n"
                )
    return rows


def describe(args, cfg, info, n_train, n_val, start):
    """What the run is and how it computes, on the console."""
    how = info["computed"]
    say(
        f"{cfg}\non {how['device']}, {args.dtype} ({how['float32_matmul']} matmuls), {how['step']} step"
    )
    say("parameters: " + ", ".join(f"{k} {v:,}" for k, v in info["params"].items()))
    epochs = (
        args.max_iters * args.batch_size / (n_train - args.block_size)
    )  # passes over the windows
    tokens = (
        f"{n_train:,} train, {n_val:,} val tokens"  # each window predicts l tokens:
    )
    say(
        f"data: {tokens}; {epochs:.3f} epochs, each token a target {epochs * args.block_size:.1f} times"
    )
    if how["device"] == "cpu" and args.n_layer * args.block_size >= 18 * 128:
        say(
            "note: Table 1's model takes days on a CPU; the README's CPU quick start takes minutes"
        )
    say(f"training from batch {start} to {args.max_iters} into {args.out_dir}")


# --------------------------------------------------------------------------- the run
# folder and ckpt.pt
def default_out_dir(args):
    """out/<mixer> (sa-<n>) plus -<symbol><value> per setting not Table 1's (exact):
    out/me-m2-l64-b32.
    """
    name = f"sa-{args.n_head}" if args.mixer == "sa" else args.mixer
    for flag, (symbol, value, _) in TABLE_1.items():
        v = getattr(args, flag)
        if v != value and not (flag == "n_head" and args.mixer == "sa"):
            name += f"-{symbol}{v if isinstance(v, int) or float(f'{v:g}') != v else f'{v:g}'}"
    return os.path.join("out", name)


def judge(args, parser, argv):
    """The checkpoint to resume, args set from it (flags may change MAY_CHANGE's only),
    or None to start.
    """
    path = os.path.join(args.out_dir, "ckpt.pt")
    if not args.resume:
        if os.path.exists(path) and not args.overwrite:
            fail(f"{args.out_dir} holds a run: --resume continues it, --overwrite starts it again; or pick "
                 "another --out_dir")  # fmt: skip
        return None
    if not os.path.exists(path):
        fail(f"no checkpoint {path} to resume; drop --resume to start the run")
    ckpt, unset = load_checkpoint(path), object()
    given = vars(
        parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    )
    saved = {
        k: ckpt["args"][k] for k in given if k in ckpt["args"] and k not in THIS_COMMAND
    }
    differ = [
        f"--{k} {v}"
        for k, v in saved.items()
        if k not in MAY_CHANGE and given[k] not in (unset, v)
    ]
    if differ:
        fail(
            f"{path} was trained with {', '.join(differ)}: --resume keeps its settings; drop those flags"
        )
    vars(args).update({k: v for k, v in saved.items() if given[k] is unset})
    return ckpt


@contextmanager
def locked(out_dir):
    """The run folder, made if need be and locked against a second train.py (Unix;
    freed even by kill -9).
    """
    made = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY) if os.name == "posix" else None
    try:
        if fd is not None:
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fail(
                    f"another train.py is running in {out_dir}; wait for it, or pick another --out_dir"
                )
        for tmp in glob.glob(
            os.path.join(glob.escape(out_dir), ".*.tmp")
        ):  # of a write killed midway
            os.remove(tmp)
        yield
    finally:
        if fd is not None:
            os.close(fd)
        if made and not os.listdir(out_dir):
            os.rmdir(out_dir)


def load_checkpoint(path):
    """A ckpt.pt of train.py: plain dicts and tensors, read with weights_only=True; one
    line if damaged.
    """
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"model", "config", "args", "iter", "data"} - set(ckpt)
        assert not missing, f"no {', '.join(sorted(missing))}"
    except Exception as e:
        fail(
            f"cannot read {path} ({type(e).__name__}: {str(e)[:60]}); it is damaged or not train.py's"
        )
    return ckpt


def start_files(out_dir, info, start):
    """run.json, and log.csv: new (the old ckpt.pt gone first), or resuming, cut back
    to the checkpoint.
    """
    path, rows = os.path.join(out_dir, "log.csv"), []
    if start and os.path.exists(path):
        with open(path) as f:
            rows = [
                r
                for r in f.readlines()[1:]
                if r.endswith("\n") and r.split(",")[0].isdigit()
            ]
        rows = [r for r in rows if int(r.split(",")[0]) <= start]
    elif os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        os.remove(
            os.path.join(out_dir, "ckpt.pt")
        )  # --overwrite: never the old model beside a new log
    atomic_write(
        path, "iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n" + "".join(rows)
    )
    atomic_write(os.path.join(out_dir, "run.json"), json.dumps(info, indent=1) + "\n")


def save_checkpoint(args, model, optimizer, scaler, cfg, data, it, elapsed):
    """ckpt.pt, written whole or not at all, with every process's RNG states: --resume
    goes on bit for bit.
    """
    state = {
        "torch": torch.get_rng_state()
    }  # (dropout's streams: Python's random is not used)
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    rngs = [state] * WORLD
    if WORLD > 1:
        dist.all_gather_object(rngs, state)
    if MASTER:
        ckpt = dict(
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            scaler=scaler.state_dict(),
        )
        ckpt.update(
            config=dataclasses.asdict(cfg),
            args=vars(args),
            iter=it,
            elapsed_s=elapsed,
            data=data,
        )
        ckpt["rng"] = rngs
        atomic_write(
            os.path.join(args.out_dir, "ckpt.pt"), lambda f: torch.save(ckpt, f)
        )


def restore(ckpt, model, optimizer, scaler, device):
    """A resumed run's state: the model, AdamW (as this device runs it), the loss
    scaler, the RNGs.
    """
    if len(ckpt["rng"]) != WORLD:
        fail(
            f"ckpt.pt was trained by {len(ckpt['rng'])} processes: resume it with as many (torchrun)"
        )
    model.load_state_dict(ckpt["model"])
    saved, mine = (
        ckpt["optimizer"],
        optimizer.param_groups,
    )  # AdamW's kind (fused, ...) stays this device's
    kind = lambda m: dict(fused=m["fused"], capturable=m["capturable"])
    groups = [dict(g, **kind(m)) for g, m in zip(saved["param_groups"], mine)]
    optimizer.load_state_dict(dict(saved, param_groups=groups))
    scaler.load_state_dict(ckpt["scaler"]) if ckpt["scaler"] else None
    torch.set_rng_state(ckpt["rng"][RANK]["torch"])
    if device.type == "cuda" and "cuda" in ckpt["rng"][RANK]:
        torch.cuda.set_rng_state(ckpt["rng"][RANK]["cuda"])


# ------------------------------------------------------------------------------ the
# device and its memory
def pick_device(name):
    """--device as a torch.device: auto is cuda, then mps, then cpu; one line if it is
    not there.
    """
    if name == "auto":
        name = (
            "cuda"
            if torch.cuda.is_available()
            else "mps"
            if torch.backends.mps.is_available()
            else "cpu"
        )
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"unknown --device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    cuda = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if not {"cpu": True, "cuda": cuda, "mps": torch.backends.mps.is_available()}.get(
        device.type
    ):
        fail(f"--device {name}: torch sees no such device here; use --device cpu")
    if device.type == "cuda":
        device = torch.device(
            "cuda", LOCAL_RANK if device.index is None else device.index
        )
        torch.cuda.set_device(device)
    if device.type == "cpu" and sys.platform == "linux":
        # glibc keeps freed memory rather than give large tensors' pages back and fault
        # them in at every step: 1.4x tokens/s at m = 2 (the options: M_MMAP_MAX,
        # M_TRIM_THRESHOLD, M_TOP_PAD)
        for option, value in ((-4, 0), (-1, 2**31 - 1), (-2, 2**28)):
            ctypes.CDLL("libc.so.6").mallopt(option, value)
    return device


def precision(device, dtype, tf32=True):
    """Autocast to --dtype, the loss scaler (on for float16's small range), and CUDA's
    TF32 matmuls.
    """
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    cache = device.type != "cuda"  # (CUDA graphs want no autocast cache)
    cast = nullcontext()
    if dtype != "float32":
        cast = torch.autocast(device.type, getattr(torch, dtype), cache_enabled=cache)
    return cast, torch.amp.GradScaler(device.type, enabled=dtype == "float16")


def computed(device, args, step):
    """How the run computes, for run.json: device, torch, matmul precision, autocast,
    the step.
    """
    tf32 = "tf32" if device.type == "cuda" and args.tf32 else "ieee"
    how = dict(device=str(device), torch=torch.__version__, dtype=args.dtype)
    how.update(float32_matmul=tf32, fir_matmul=tf32 if fir.ALLOW_TF32 else "ieee")
    how["step"] = type(step).__name__.replace("partial", "eager")
    if device.type == "cuda":
        how["device_name"] = torch.cuda.get_device_name(device)
    return how


def peak_memory(device):
    """(bytes, what): on CUDA the most the tensors ever held, elsewhere the process's
    peak resident memory.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak CUDA memory allocated"
    import resource  # (Unix; ru_maxrss is in kB on Linux, in bytes on macOS)

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
        1024 if sys.platform == "darwin" else 1
    )
    return int(kb * 1024), "peak resident memory"


def report_peak_memory(args, device, exit_code):
    """The peak memory (this session's, when resumed) into run.json and on the console;
    the exit code.
    """
    if MASTER:
        peak, what = peak_memory(device)
        with open(os.path.join(args.out_dir, "run.json")) as f:
            info = dict(
                json.load(f), peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what
            )
        atomic_write(
            os.path.join(args.out_dir, "run.json"), json.dumps(info, indent=1) + "\n"
        )
        say(f"{what}: {peak / 2**30:.2f} GB")
    return exit_code


# -------------------------------------------------------------------------------- the
# console, stopping
def say(*args):
    """A console line at once (nohup too), from process 0; a closed stdout (| head)
    acts as a signal.
    """
    if MASTER:
        try:
            print(*args, flush=True)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            STOP["signal"] = STOP["signal"] or signal.SIGPIPE


def ask_to_stop(signum, frame):
    STOP["signal"] = signum
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # a second Ctrl-C aborts at once


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    signals = [
        s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s
    ]
    handlers = {s: signal.getsignal(s) for s in signals}
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        check_args(args)
        args.data_dir, args.out_dir = (
            os.path.abspath(args.data_dir),
            args.out_dir or default_out_dir(args),
        )
        ckpt = judge(args, parser, argv)
        check_args(args)  # (the checkpoint's settings too)
        if (ckpt["iter"] if ckpt else 0) >= args.max_iters:
            return (
                say(
                    f"{args.out_dir} is at batch {ckpt['iter'] if ckpt else 0}: nothing to train"
                )
                or 0
            )
        with locked(args.out_dir) if MASTER else nullcontext():
            for s in signals:
                signal.signal(s, ask_to_stop)
            return train(args, ckpt)
    except torch.OutOfMemoryError:
        print(
            "error: out of memory on the device: use a smaller --batch_size",
            file=sys.stderr,
        )
        return 1
    except SystemExit as e:  # fail() and argparse: the line is printed
        return e.code
    except KeyboardInterrupt:  # a second Ctrl-C
        return say("\naborted; the last checkpoint is kept") or 130
    except OSError as e:  # a full disk, a lost folder
        print(
            f"error: cannot write {e.filename} ({e.strerror}); the last checkpoint stays",
            file=sys.stderr,
        )
        return 1
    finally:
        STOP["signal"] = None
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            dist.barrier()  # tear the process group down together (gloo may abort if one leaves early)
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
