"""
Multi-query associative recall (MQAR; Zoology, Arora et al. 2023, arXiv:2312.04927) for
any mixer: a 2-layer Transformer of extractor.py answers, at each query key, the value
that followed that key earlier (the task: mqar). A sweep is one command over a grid;
each run goes on from its last finished epoch when the command is given again.

    python experiments/recall.py --mixers sa,he --lrs 1e-3,3e-3 --seeds 0,1,2
    python experiments/recall.py --quick                      # end to end in seconds
    python experiments/recall.py --mixers sa,he --cost 20     # seconds per epoch, timed
"""

import argparse
import functools
import io
import itertools
import json
import math
import os
import sys
import time

# the project root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import machinery  # noqa: E402
from extractor import Config, Transformer  # noqa: E402
from train import epoch_permutation  # noqa: E402

VOCAB = 8192  # keys are the lower half, values the upper one
PAIRS = {64: 4, 128: 8, 256: 16, 512: 64}  # N by length, Zoology's Figure 2
POWER_A = 0.01  # the query gaps' power law, p(g) ~ g^(a - 1), as Zoology's generator
STOP_AT = 0.99  # test accuracy that ends a run early
LOG_HEADER = "epoch,train_loss,test_accuracy,seconds\n"
SUMMARY = (
    "mixer,width,length,lr,seed,best_test_accuracy,epochs_run,stopped_early,seconds"
)
GRID = ("lengths", "mixers", "widths", "lrs", "seeds")  # the sweep's axes, outer first
# what a run's folder name does not say but its checkpoint must agree on
KEPT = (
    "pairs train test batch_size warmup weight_decay n_head ffn head data_seed".split()
)


# ---- the task ------------------------------------------------------------------------
def distinct(gen, n, k, low, high):
    """(n, k) tokens from [low, high), distinct within each row and uniform over such
    rows: a row with a repeat is drawn again."""
    draw = torch.randint(low, high, (n, k), generator=gen)
    while True:
        ordered = draw.sort(dim=1).values
        again = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if not again.any():
            return draw
        draw[again] = torch.randint(low, high, (int(again.sum()), k), generator=gen)


def mqar(n, length, pairs, seed):
    """n sequences: x (n, length) tokens, pos (n, pairs) the query positions and y
    (n, pairs) their values, the targets; the same seed, the same tensors. N pairs k v
    at the start; then each key once at a slot 2N + 2g, its gap g drawn from a power
    law; every other position a random token (Zoology's generator has all three)."""
    gen = torch.Generator().manual_seed(seed)
    keys = distinct(gen, n, pairs, 1, VOCAB // 2)  # (n, N)
    values = distinct(gen, n, pairs, VOCAB // 2, VOCAB)  # (n, N)
    x = torch.randint(VOCAB, (n, length), generator=gen)  # the ignored positions
    x[:, 0 : 2 * pairs : 2] = keys
    x[:, 1 : 2 * pairs : 2] = values
    slots = (length - 2 * pairs) // 2  # the even offsets after the pairs
    weight = POWER_A * torch.arange(1.0, slots + 1) ** (POWER_A - 1)  # (slots,)
    # an exponential race: the first N slots to arrive are N draws without replacement,
    # each in proportion to its weight among those left (key i takes the i-th)
    arrival = torch.empty(n, slots).exponential_(generator=gen) / weight
    pos = 2 * pairs + 2 * arrival.topk(pairs, dim=1, largest=False).indices  # (n, N)
    x.scatter_(1, pos, keys)
    return x, pos, values


# ---- the model and its loss at the queries -------------------------------------------
def build(mixer, width, length, lr, seed, args):
    """The 2-layer Transformer (without the FFN unless --ffn: Zoology's blocks have
    none) drawn from seed, and AdamW."""
    torch.manual_seed(seed)
    model = Transformer(config(mixer, width, length, args)).to(args.device)
    for layer in model.layers if not args.ffn else []:
        layer.ffn = layer.ln2 = None
    decay = args.weight_decay
    return model, torch.optim.AdamW(model.parameters(), lr, weight_decay=decay)


def config(mixer, width, length, args):
    """The model's settings, dropout 0; one line for a mixer that cannot take them."""
    cfg = Config(VOCAB, length, width, 4 * width, 2, args.n_head, 0.0, mixer)
    return machinery.check_mixer(cfg)


def hidden(model, idx, ffn):
    """Transformer.forward to the layernorm of Eq. (21), with dropout 0: (B, t, d)."""
    scale = math.sqrt(model.cfg.n_embd)  # Section 4: embeddings times sqrt(d)
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.emb_tok(idx) * scale + model.emb_pos(pos) * scale  # Eq. (4), (5), (7)
    for layer in model.layers:
        # Eq. (9)-(20); without the FFN, Eq. (18) is the layer's output
        x = layer(x) if ffn else x + layer.mixer(layer.ln1(x))
    return model.ln_f(x)  # Eq. (21) before the head


def at(h, pos):
    """h (B, t, e) at the positions pos (B, N): (B, N, e)."""
    return h.gather(1, pos[..., None].expand(-1, -1, h.shape[-1]))


def query_logits(model, x, pos, head, ffn):
    """(B, N, u): the head W^soft at the queries alone, or (head "all", to measure what
    it saves) at every position, as a language model computes it, then picked."""
    h = hidden(model, x, ffn)
    return at(model.soft(h), pos) if head == "all" else model.soft(at(h, pos))


def scores(logits, y):
    """The mean cross-entropy of the queries' values, Eq. (3), and how many of them the
    argmax gets exactly."""
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return loss, (logits.argmax(dim=-1) == y).sum()


# ---- one run -------------------------------------------------------------------------
def step(model, adamw, x, pos, y, args):
    """One batch's step of AdamW on the loss at the queries; the loss."""
    loss = scores(query_logits(model, x, pos, args.head, args.ffn), y)[0]
    loss.backward()
    adamw.step()
    adamw.zero_grad(set_to_none=True)
    return loss.detach()


def train_epoch(model, adamw, data, epoch, args, lr, say):
    """One epoch of whole batches in the order of (data_seed, epoch); the learning rate
    rises linearly over the first --warmup steps, then stays. The mean loss."""
    x, pos, y = data
    order = epoch_permutation(len(x), args.data_seed, epoch)
    batches = len(x) // args.batch_size
    total, t0 = 0.0, time.time()
    for j in range(batches):
        steps = epoch * batches + j + 1  # this one included
        adamw.param_groups[0]["lr"] = lr * min(1.0, steps / args.warmup)
        b = order[j * args.batch_size : (j + 1) * args.batch_size]
        total += step(model, adamw, x[b], pos[b], y[b], args).item()
        if (j + 1) % 50 == 0:
            eta = machinery.fmt_time((time.time() - t0) / (j + 1) * (batches - j - 1))
            say(f"batch {j + 1}/{batches} loss {total / (j + 1):.4f} ETA {eta}")
    return total / batches


@torch.no_grad()
def accuracy(model, data, args):
    """The fraction of the test queries' values predicted exactly (argmax)."""
    correct = 0
    for x, pos, y in zip(*(t.split(args.batch_size) for t in data)):
        correct += scores(query_logits(model, x, pos, "queries", args.ffn), y)[1].item()
    return correct / data[2].numel()


def run(args, name, mixer, width, length, lr, seed, data, say):
    """Train one run to --epochs or to STOP_AT, from its checkpoint if it has one; a
    checkpoint, log.csv and run.json at the end of each epoch."""
    folder = os.path.join(args.out, name)
    os.makedirs(folder, exist_ok=True)
    settings = {k: getattr(args, k) for k in KEPT}
    model, adamw = build(mixer, width, length, lr, seed, args)
    info = dict(mixer=mixer, width=width, length=length, lr=lr, seed=seed)
    rows, path = [], os.path.join(folder, "ckpt.pt")
    if os.path.exists(path):
        ckpt = load(path)
        if ckpt["info"]["settings"] != settings:
            was = ckpt["info"]["settings"]
            machinery.fail(
                f"{folder} was trained with {was}: give those or another --out"
            )
        model.load_state_dict(ckpt["model"])
        adamw.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        rows, info = ckpt["log"], ckpt["info"]
    if info.get("stopped_early") or len(rows) >= args.epochs:
        return
    train_data, test_data = data
    for epoch in range(len(rows), args.epochs):
        t0 = time.time()
        loss = train_epoch(model, adamw, train_data, epoch, args, lr, say)
        acc = accuracy(model, test_data, args)
        seconds = info.get("seconds", 0.0) + time.time() - t0
        rows.append(f"{epoch + 1},{loss!r},{acc!r},{time.time() - t0:.1f}\n")
        best = max(float(r.split(",")[2]) for r in rows)
        info.update(best_test_accuracy=best, epochs_run=epoch + 1, seconds=seconds)
        info.update(stopped_early=acc >= STOP_AT, settings=settings)
        peak, what = machinery.peak_memory(torch.device(args.device))
        info.update(peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what)
        ckpt = dict(model=model.state_dict(), optimizer=adamw.state_dict())
        ckpt.update(rng=torch.get_rng_state(), log=rows, info=info)
        buffer = io.BytesIO()
        torch.save(ckpt, buffer)
        files = {"ckpt.pt": buffer.getvalue(), "log.csv": LOG_HEADER + "".join(rows)}
        files["run.json"] = json.dumps(info, indent=1) + "\n"
        for file, data in files.items():  # ckpt.pt first: log.csv is never ahead
            machinery.atomic_write(os.path.join(folder, file), data)
        left = machinery.fmt_time(seconds / (epoch + 1) * (args.epochs - epoch - 1))
        say(f"epoch {epoch + 1}/{args.epochs} loss {loss:.4f} acc {acc:.4f} ETA {left}")
        if acc >= STOP_AT:
            break


def load(path):
    """A run's ckpt.pt: plain dicts and tensors; one line if damaged."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        machinery.fail(f"cannot read {path} ({type(e).__name__}): delete it to restart")


def cost(args, mixer, width, length, data):
    """Seconds of one epoch, from --cost batches timed after two: on the clock and in
    this process's CPU time (which others' work on the machine slows less)."""
    model, adamw = build(mixer, width, length, 1e-3, 0, args)
    x, pos, y = (t[: (args.cost + 2) * args.batch_size] for t in data)
    for j, b in enumerate(torch.arange(len(x)).split(args.batch_size)):
        if j == 2:  # the first two warm the allocator up
            t0, cpu0 = time.time(), time.process_time()
        step(model, adamw, x[b], pos[b], y[b], args)
    per_epoch = (args.train // args.batch_size) / args.cost
    return (time.time() - t0) * per_epoch, (time.process_time() - cpu0) * per_epoch


def write_summary(out):
    """summary.csv: a row per run folder under out, from its run.json."""
    rows = [SUMMARY + "\n"]
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name, "run.json")
        if os.path.exists(path):
            r = json.load(open(path))
            rows.append(",".join(str(r[k]) for k in SUMMARY.split(",")) + "\n")
    machinery.atomic_write(os.path.join(out, "summary.csv"), "".join(rows))


def listed(kind):
    """An argparse type: comma-separated values of this kind."""
    return lambda text: [kind(v) for v in text.split(",")]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.error = lambda msg: machinery.fail(f"{msg} (see experiments/recall.py --help)")
    p.add_argument("--mixers", type=listed(str), default=["sa"], help="sa,he,...")
    p.add_argument("--widths", type=listed(machinery.COUNT), default=[64], help="d")
    p.add_argument("--lengths", type=listed(machinery.COUNT), default=[64], help="l")
    p.add_argument("--lrs", type=listed(machinery.NON_NEGATIVE), default=[1e-3])
    p.add_argument("--seeds", type=listed(machinery.SEED), default=[0])
    p.add_argument("--epochs", type=machinery.COUNT, default=32, help="epoch cap")
    p.add_argument("--pairs", type=machinery.COUNT, help="N (default: by length)")
    p.add_argument("--train", type=machinery.COUNT, default=100_000, help="sequences")
    p.add_argument("--test", type=machinery.COUNT, default=3_000, help="sequences")
    p.add_argument("--batch_size", type=machinery.COUNT, default=256)
    p.add_argument("--warmup", type=machinery.COUNT, default=100, help="steps")
    p.add_argument("--weight_decay", type=machinery.NON_NEGATIVE, default=0.1)
    p.add_argument("--n_head", type=machinery.COUNT, default=1, help="sa, Synthesizers")
    p.add_argument("--ffn", action="store_true", help="keep the paper's FFN (c = 4d)")
    head = "the head at the queries, or at all positions (to measure it)"
    p.add_argument("--head", choices=("queries", "all"), default="queries", help=head)
    p.add_argument("--data_seed", type=machinery.NATURAL, default=0)
    p.add_argument("--out", default="out/recall", help="the sweep's folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    p.add_argument("--cost", type=machinery.COUNT, help="time this many batches only")
    p.add_argument("--quick", action="store_true", help="a tiny sweep, in seconds")
    args = p.parse_args(argv)
    if args.quick:  # d 16, l 16, N 2, 2 epochs of 2 batches, unless flags say else
        p.set_defaults(widths=[16], lengths=[16], pairs=2, epochs=2, train=64, test=32)
        p.set_defaults(batch_size=32, warmup=2)
        args = p.parse_args(argv)
    for length in args.lengths:
        n = args.pairs or PAIRS.get(length)
        if n is None or 4 * n > length:
            lengths = ", ".join(map(str, PAIRS))
            p.error(f"--lengths {length}: pass one of {lengths} or --pairs N <= l/4")
    if args.cost and (args.cost + 2) * args.batch_size > args.train:
        p.error(f"--cost {args.cost}: --train holds fewer batches (2 more run first)")
    args.device = str(machinery.pick_device(args.device))
    return args


def task(args, length):
    """The train and test (x, pos, y) of this length, on the device."""
    n = args.pairs or PAIRS[length]
    tensors = mqar(args.train + args.test, length, n, args.data_seed)
    train = tuple(t[: args.train].to(args.device) for t in tensors)
    return train, tuple(t[args.train :].to(args.device) for t in tensors)


def main(argv=None):
    args = parse(argv)
    grid = list(itertools.product(*(getattr(args, axis) for axis in GRID)))
    for length, mixer, width, *_ in grid:  # every mixer checked before any run
        config(mixer, width, length, args)
    data = {}
    if args.cost:
        print("mixer,width,length,head,ffn,batches_timed,epoch_s,epoch_cpu_s")
    try:
        for i, (length, mixer, width, lr, seed) in enumerate(grid):
            data = data if length in data else {length: task(args, length)}
            name = f"{mixer}-d{width}-l{length}-lr{lr:g}-s{seed}"
            say = functools.partial(print, f"[{i + 1}/{len(grid)}] {name}:", flush=True)
            if args.cost:
                wall, cpu = cost(args, mixer, width, length, data[length][0])
                what = f"{mixer},{width},{length},{args.head},{args.ffn},{args.cost}"
                print(f"{what},{wall:.1f},{cpu:.1f}", flush=True)
                continue
            run(args, name, mixer, width, length, lr, seed, data[length], say)
            write_summary(args.out)
    except KeyboardInterrupt:
        print("stopped: the same command goes on from each run's last epoch")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
