"""
Train a language model whose first sublayer is a token mixer of extractor.py, as the
paper's Section 6 does: Table 1's run, a longer one, one that stops by 40 minutes, DDP.

    python prepare_data.py && python train.py --mixer=me
    python train.py --mixer=me --max_iters=80000 --resume
    python train.py --mixer=she --time_limit=40m
    torchrun --standalone --nproc_per_node=4 train.py --mixer=she

This file is the experiment, where every run sees the same batches, seeded by
--data_seed alone; what keeps a run safe and exact is machinery.py's.
"""

import dataclasses
import functools
import sys

import numpy as np
import torch

import machinery
from extractor import Config, Transformer
from machinery import COUNT, FRACTION, NATURAL, NON_NEGATIVE, SEED

# Every setting of a run: flag -> (Table 1's symbol, its value or our default, type,
# what it is). A setting with a symbol names the run's folder when it is not Table
# 1's value (out/me-m2-l32); the model's values are extractor.Config's.
SETTINGS = {
    "mixer": ("", "sa", str, "sa she we he me he-ext, a Synthesizer or module.Class"),
    "n_layer": ("m", Config.n_layer, COUNT, "number of layers"),
    "block_size": ("l", Config.block_size, COUNT, "context length"),
    "n_embd": ("d", Config.n_embd, COUNT, "dimension of the model"),
    "n_hidden": ("c", Config.n_hidden, COUNT, "nodes in the FFN's hidden layer"),
    "n_head": ("n", Config.n_head, COUNT, "heads of self-attention, the Synthesizers"),
    "dropout": ("p", Config.dropout, FRACTION, "dropout rate"),
    "batch_size": ("b", 64, COUNT, "batch size, over all processes"),
    "lr": ("lr", 1e-3, NON_NEGATIVE, "AdamW's learning rate gamma, constant"),
    "beta1": ("bm", 0.9, FRACTION, "AdamW's beta_1"),
    "beta2": ("bv", 0.999, FRACTION, "AdamW's beta_2"),
    "weight_decay": ("wd", 0.01, NON_NEGATIVE, "AdamW's weight decay (PyTorch's)"),
    "grad_clip": ("clip", 0.0, NON_NEGATIVE, "clip gradients' norm to this; 0: off"),
    "seed": ("seed", 1337, SEED, "seed of the initialisation and of dropout"),
    "data_seed": ("dseed", 1337, NATURAL, "seed of the batch order"),
    "dtype": ("", "float32", ("float32", "bfloat16", "float16"), "autocast's dtype"),
    "tf32": ("", True, bool, "CUDA: TF32 matmuls"),
    "eval_batches": ("", 20, NATURAL, "batches of each validation; 0: none"),
    "max_iters": ("", 60000, NATURAL, "batches to train on"),
    "eval_interval": ("", 1000, COUNT, "a validation every this many batches"),
    "ckpt_interval": ("", 1000, COUNT, "ckpt.pt and log.csv every this many batches"),
    "log_interval": ("", 100, COUNT, "a console line every this many batches"),
    "data_dir": ("", "data", str, "prepare_data.py's train.bin, val.bin, meta.json"),
    "device": ("", "auto", str, "auto (cuda, else cpu), cpu, cuda, cuda:1, mps"),
}
# --resume takes every setting from ckpt.pt but these: the run's length, its logging and
# where it runs (the data must be the same)
MAY_CHANGE = (
    "max_iters eval_interval ckpt_interval log_interval data_dir device".split()
)
MODEL_SETTINGS = dataclasses.fields(Config)[1:]  # all but vocab_size, the data's


# ---- the batches ---------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def epoch_permutation(n_starts, data_seed, epoch):
    """A permutation of 0..n_starts-1 that depends on (data_seed, epoch) alone, so that
    every mixer sees the same batches in the same order."""
    state = np.random.SeedSequence([data_seed, epoch]).generate_state(1, np.uint64)
    generator = torch.Generator().manual_seed(int(state[0]))
    return torch.randperm(n_starts, generator=generator)  # (n_starts,)


def batch_starts(i, n_starts, batch_size, data_seed):
    """Batch i's window starts, a slice of its epoch's permutation. The few starts left
    over at an epoch's end are skipped, so that every batch is whole."""
    epoch, j = divmod(i, n_starts // batch_size)
    starts = epoch_permutation(n_starts, data_seed, epoch)
    return starts[j * batch_size : (j + 1) * batch_size]


def get_batch(data, starts, block_size, device):
    """This process's part of the windows of l + 1 tokens at `starts`: x holds their
    first l tokens and y the same shifted by one, the tokens to predict."""
    mine = starts.chunk(machinery.WORLD)[machinery.RANK]  # (b / WORLD,)
    windows = [data[s : s + block_size + 1] for s in mine.tolist()]
    w = torch.from_numpy(np.stack(windows).astype(np.int64))  # (b, l + 1)
    pin = device.type == "cuda"  # pinned, so that the host need not wait for the copy
    w = w.pin_memory() if pin else w
    w = w.to(device, non_blocking=pin)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # x (b, l), y (b, l)


# ---- the model, AdamW and the step ---------------------------------------------------
def build_model(cfg, args, device):
    """The Transformer drawn from --seed, the same in every process; then dropout is
    seeded with seed + rank, so that each process draws its own masks. AdamW takes
    Table 1's settings, fused on CUDA (the captured step makes it capturable)."""
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    torch.manual_seed(args.seed + machinery.RANK)
    adamw = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=1e-8,
        weight_decay=args.weight_decay,
        fused=device.type == "cuda",
    )
    return model, adamw


def train_step(model, optimizer, scaler, ctx, x, y, grad_clip=0.0):
    """One batch's step; the loss comes back unread, so that the GPU need not wait."""
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


# ---- the evaluation ------------------------------------------------------------------
def validates(args, it):
    """Whether batch `it` ends with a validation (every eval_interval, and the last)."""
    at = it % args.eval_interval == 0 or it == args.max_iters
    return args.eval_batches > 0 and at


@torch.no_grad()
def evaluate(model, args, val_data, device, ctx):
    """The mean loss over the same validation windows each time, spread evenly over
    val.bin, with dropout off; the model is left in the mode it was in."""
    machinery.THIS_RUN["validating"] = True  # (for the line if memory runs out)
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
    machinery.THIS_RUN["validating"] = False
    return machinery.mean_over_processes(total).item() / args.eval_batches


# ---- the run -------------------------------------------------------------------------
def train(args, ckpt, start_time):
    """The data, the model and AdamW; then the loop of batches and log points."""
    model_settings = {f.name: getattr(args, f.name) for f in MODEL_SETTINGS}
    cfg = machinery.check_mixer(Config(**model_settings))  # before the data
    train_data, val_data, fingerprint = machinery.load_data(
        args.data_dir, args.block_size, args.batch_size
    )
    device = machinery.pick_device(args.device)
    ctx, scaler = machinery.precision(device, args.dtype, args.tf32)
    cfg = dataclasses.replace(cfg, vocab_size=fingerprint["vocab_size"])
    raw_model, optimizer = build_model(cfg, args, device)
    if ckpt:
        machinery.restore(ckpt, fingerprint, raw_model, optimizer, scaler, device)
    model = machinery.ddp(raw_model, device)
    how = machinery.computed(device, args)
    step = functools.partial(
        train_step, model, optimizer, scaler, ctx, grad_clip=args.grad_clip
    )
    step = machinery.make_step(step, optimizer, args, device, how)
    info = dict(
        config=dataclasses.asdict(cfg),
        args=vars(args),
        data=fingerprint,
        params=raw_model.param_counts(),
        world_size=machinery.WORLD,
        computed=how,
    )
    progress = machinery.Progress(args, ckpt, start_time, info)
    machinery.say(f"{cfg}")
    machinery.say(
        f"training from batch {progress.start_iter} to {args.max_iters}"
        f" into {args.out_dir}"
    )
    machinery.say(f"computed: {how}")
    n_starts = len(train_data) - args.block_size
    for it in range(progress.start_iter + 1, args.max_iters + 1):
        starts = batch_starts(it - 1, n_starts, args.batch_size, args.data_seed)
        x, y = get_batch(train_data, starts, args.block_size, device)  # (b, l), (b, l)
        progress.batch_done(step(x, y))
        stop = progress.must_stop(validates(args, it + 1))
        val_now = validates(args, it)
        ckpt_now = it % args.ckpt_interval == 0 or it == args.max_iters
        if not (val_now or ckpt_now or stop or it % args.log_interval == 0):
            continue
        val = evaluate(model, args, val_data, device, ctx) if val_now else None
        progress.log(it, val)
        if ckpt_now or stop:
            progress.save(it, raw_model, optimizer, scaler)
        if stop:
            break
        progress.log_point_done(ckpt_now)
    return progress.finish(it, stop)


def main(argv=None):
    return machinery.run_command(SETTINGS, MAY_CHANGE, train, argv)


if __name__ == "__main__":
    sys.exit(main())
