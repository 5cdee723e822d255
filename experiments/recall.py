"""
Multi-query associative recall (MQAR; Zoology, Arora et al. 2023, arXiv:2312.04927) for
any mixer: a 2-layer Transformer of extractor.py answers, at each query key, the value
that followed that key earlier (the task: mqar). A sweep is one command over a grid;
each run goes on from its last finished epoch when the command is given again.

    python experiments/recall.py --mixers sa,he --lrs 1e-3,3e-3 --seeds 0,1,2
    python experiments/recall.py --quick                      # end to end in seconds
    python experiments/recall.py --mixers sa,he --cost 20     # seconds per epoch, timed
    python experiments/recall.py --draw out/recall/summary.csv recall.png  # the figure
"""

import argparse
import csv
import glob
import io
import itertools
import json
import math
import os
import statistics
import sys
import time

# the project root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import machinery  # noqa: E402
import plot  # noqa: E402
from extractor import Config, Transformer  # noqa: E402
from train import epoch_permutation  # noqa: E402

VOCAB = 8192  # keys are the lower half, values the upper one
# N by length: Zoology's Figure 2, and a tiny one for --quick and the tests
PAIRS = {16: 2, 64: 4, 128: 8, 256: 16, 512: 64}
POWER_A = 0.01  # the query gaps' power law, p(g) ~ g^(a - 1), as Zoology's generator
STOP_AT = 0.99  # test accuracy that ends a run early
WARMUP = 100  # steps of a rate rising linearly from 0
LOG_HEADER = "epoch,train_loss,test_accuracy,seconds\n"
SUMMARY = (
    "mixer,width,length,lr,seed,best_test_accuracy,epochs_run,stopped_early,seconds"
).split(",")
GRID = ("lengths", "mixers", "widths", "lrs", "seeds")  # the sweep's axes, outer first
# what a run's folder name does not say but its checkpoint must agree on
KEPT = ["train", "test", "batch_size", "ffn", "head"]
# Zoology's Figure 2, read by eye from the figure (approximate): accuracy by length
ZOOLOGY = {
    **{("attention", w): dict.fromkeys([64, 128, 256, 512], 1.0) for w in (64, 128)},
    ("BaseConv", 64): {64: 0.7, 512: 0.0},
    **{("BaseConv", w): {512: 0.0} for w in (128, 256)},
}


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


def build(mixer, width, length, lr, seed, args):
    cfg = Config(VOCAB, length, width, 4 * width, 2, 1, 0.0, mixer)  # sa: 1 head
    machinery.check_mixer(cfg)  # before the seed, whose draws are the model's alone
    torch.manual_seed(seed)
    model = Transformer(cfg).to(args.device)
    for layer in model.layers if not args.ffn else []:  # Zoology's blocks have none
        layer.ffn = layer.ln2 = None
    return model, torch.optim.AdamW(model.parameters(), lr, weight_decay=0.1)


def query_logits(model, x, pos, head, ffn):
    """(B, N, u) at the queries pos (B, N): the head W^soft there alone, or (head "all",
    to measure what that saves) at every position, then picked."""
    scale = math.sqrt(model.cfg.n_embd)  # Section 4: embeddings times sqrt(d)
    where = torch.arange(x.shape[1], device=x.device)
    h = model.emb_tok(x) * scale + model.emb_pos(where) * scale  # Eq. (4), (5), (7)
    for layer in model.layers:
        # Eq. (9)-(20); without the FFN, Eq. (18) is the layer's output
        h = layer(h) if ffn else h + layer.mixer(layer.ln1(h))
    h = model.ln_f(h)  # Eq. (21) before the head, (B, t, d)
    rows = torch.arange(len(x), device=x.device)[:, None]  # (B, 1), beside pos
    return model.soft(h)[rows, pos] if head == "all" else model.soft(h[rows, pos])


def scores(logits, y):
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # Eq. (3) at the queries
    return loss, (logits.argmax(dim=-1) == y).sum()


def train_epoch(model, adamw, data, epoch, args, lr, say):
    """One epoch of whole batches in train.py's order (data seed 0); the mean loss."""
    x, pos, y = data
    batches = len(x) // args.batch_size
    order = epoch_permutation(len(x), 0, epoch)[: batches * args.batch_size]
    total, t0 = 0.0, time.time()
    for j, b in enumerate(order.split(args.batch_size)):
        adamw.param_groups[0]["lr"] = lr * min(1.0, (epoch * batches + j + 1) / WARMUP)
        loss = scores(query_logits(model, x[b], pos[b], args.head, args.ffn), y[b])[0]
        loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        total += loss.item()
        if (j + 1) % 50 == 0:
            eta = machinery.fmt_time((time.time() - t0) / (j + 1) * (batches - j - 1))
            say(f"batch {j + 1}/{batches} loss {total / (j + 1):.4f} ETA {eta}")
    return total / batches


@torch.no_grad()
def accuracy(model, data, args):
    correct = 0
    for x, pos, y in zip(*(t.split(args.batch_size) for t in data)):
        correct += scores(query_logits(model, x, pos, "queries", args.ffn), y)[1].item()
    return correct / data[2].numel()


def run(args, folder, model, adamw, info, data, say):
    """Train to --epochs or to STOP_AT, from the last epoch's checkpoint if any."""
    ckpt = dict(log=[], info=info)
    path = os.path.join(folder, "ckpt.pt")
    done = os.path.join(folder, "run.json")
    found = path if os.path.exists(path) else done  # done alone: a committed run's copy
    if os.path.exists(found):
        try:
            if found == path:
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
            saved = ckpt["info"] if found == path else json.load(open(done))
            finished = saved["stopped_early"] or saved["epochs_run"] >= args.epochs
            was = saved["settings"]  # (an older run's: also settings fixed since)
        except Exception as e:
            machinery.fail(f"cannot read {found} ({type(e).__name__}): delete it")
        if not was.items() >= info["settings"].items():
            machinery.fail(f"{folder} has settings {was}: pass those or another --out")
        if found == done and finished:
            return say("finished (its run.json), skipped: no ckpt.pt to go on from")
    if found == path:
        model.load_state_dict(ckpt["model"])
        adamw.load_state_dict(ckpt["optimizer"])
    rows, info = ckpt["log"], ckpt["info"]
    os.makedirs(folder, exist_ok=True)
    for epoch in range(len(rows), args.epochs):
        if info.get("stopped_early"):  # at STOP_AT, in this session or an earlier one
            break
        t0 = time.time()
        loss = train_epoch(model, adamw, data[0], epoch, args, info["lr"], say)
        acc = accuracy(model, data[1], args)
        rows.append(f"{epoch + 1},{loss!r},{acc!r},{time.time() - t0:.1f}\n")
        seconds = info.get("seconds", 0.0) + time.time() - t0
        best = max(acc, info.get("best_test_accuracy", 0.0))
        info.update(best_test_accuracy=best, epochs_run=epoch + 1, seconds=seconds)
        peak, what = machinery.peak_memory(torch.device(args.device))
        info.update(peak_memory_mb=round(peak / 2**20, 1), peak_memory_is=what)
        info["stopped_early"] = acc >= STOP_AT
        ckpt.update(model=model.state_dict(), optimizer=adamw.state_dict())
        buffer = io.BytesIO()
        torch.save(ckpt, buffer)
        files = {"ckpt.pt": buffer.getvalue(), "log.csv": LOG_HEADER + "".join(rows)}
        files["run.json"] = json.dumps(info, indent=1) + "\n"
        for file, text in files.items():  # ckpt.pt first: log.csv is never ahead
            machinery.atomic_write(os.path.join(folder, file), text)
        left = machinery.fmt_time(seconds / (epoch + 1) * (args.epochs - epoch - 1))
        say(f"epoch {epoch + 1}/{args.epochs} loss {loss:.4f} acc {acc:.4f} ETA {left}")


def draw(path, image):
    """Test accuracy against length, a panel per width, a line per mixer: at each point
    the median over seeds of each seed's best best_test_accuracy over learning rates;
    Zoology's points (ZOOLOGY) as markers in the panels of their width."""

    def read(f):  # {width: {mixer: {length: {seed: the best over learning rates}}}}
        runs = {}
        for r in csv.DictReader(f):
            line = runs.setdefault(int(r["width"]), {}).setdefault(r["mixer"], {})
            seeds = line.setdefault(int(r["length"]), {})
            acc = float(r["best_test_accuracy"])
            seeds[r["seed"]] = max(seeds.get(r["seed"], acc), acc)
        return runs

    runs = plot.read(path, read, "pass a summary.csv that recall.py wrote")
    if not runs:
        plot.fail(f"{path} holds no runs: pass a summary.csv that recall.py wrote")
    fig, _ = plot.plt.subplots(1, len(runs), figsize=(9 * len(runs), 4.5))
    mixers = sorted({mixer for lines in runs.values() for mixer in lines})  # colours
    for ax, width in zip(fig.axes, sorted(runs)):
        for mixer, line in sorted(runs[width].items()):
            points = sorted((l, statistics.median(s.values())) for l, s in line.items())
            colour = f"C{mixers.index(mixer) % 10}"  # a mixer's, in every panel
            ax.plot(*zip(*points), marker="o", color=colour, label=mixer)
        for (mixer, w), points in ZOOLOGY.items():
            if w == width:
                label = f"{mixer}, Zoology Fig. 2 (read from the figure)"
                mark = "k*" if mixer == "attention" else "kX"  # hollow: ours show
                ax.plot(*zip(*points.items()), mark, ms=10, mfc="none", label=label)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter("{x:g}")  # 64, not 2^6
        ax.set(xlabel="sequence length l", ylabel="test accuracy", ylim=(-0.05, 1.05))
        plot.finish(ax, f"width d = {width}")
        ax.legend(loc="center left", bbox_to_anchor=(1, 0.5))  # beside: lines fill it
    plot.save(fig, image, "multi-query associative recall")
    return [image]


def parse(argv):
    raw = argparse.RawDescriptionHelpFormatter  # the examples as written
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    p.error = lambda msg: machinery.fail(f"{msg} (see experiments/recall.py --help)")
    listed = lambda kind: lambda text: [kind(v) for v in text.split(",")]  # a,b,...
    p.add_argument("--mixers", type=listed(str), default=["sa"], help="sa,he,...")
    p.add_argument("--widths", type=listed(machinery.COUNT), default=[64], help="d")
    p.add_argument("--lengths", type=listed(machinery.COUNT), default=[64], help="l")
    p.add_argument("--lrs", type=listed(machinery.NON_NEGATIVE), default=[1e-3])
    p.add_argument("--seeds", type=listed(machinery.SEED), default=[0])
    p.add_argument("--epochs", type=machinery.COUNT, default=32, help="epoch cap")
    p.add_argument("--train", type=machinery.COUNT, default=100_000, help="sequences")
    p.add_argument("--test", type=machinery.COUNT, default=3_000, help="sequences")
    p.add_argument("--batch_size", type=machinery.COUNT, default=256)
    p.add_argument("--ffn", action="store_true", help="keep the paper's FFN (c = 4d)")
    p.add_argument("--head", choices=["queries", "all"], default="queries")
    p.add_argument("--out", default="out/recall", help="the sweep's folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    p.add_argument("--cost", type=machinery.COUNT, help="time this many batches only")
    p.add_argument("--quick", action="store_true", help="a tiny sweep, in seconds")
    p.add_argument("--draw", nargs=2, metavar=("CSV", "IMAGE"), help="the figure only")
    args = p.parse_args(argv)
    if args.quick:  # d 16, l 16, 2 epochs of 2 batches, unless flags say otherwise
        p.set_defaults(widths=[16], lengths=[16], epochs=2, train=64, batch_size=32)
        args = p.parse_args(argv)
    for length in set(args.lengths) - set(PAIRS):
        p.error(f"--lengths {length}: pass lengths of {', '.join(map(str, PAIRS))}")
    if args.cost and args.cost * args.batch_size > args.train:
        p.error(f"--cost {args.cost}: --train holds fewer batches; pass more")
    args.device = str(machinery.pick_device(args.device))
    return args


def main(argv=None):
    args = parse(argv)
    if args.draw:
        return plot.cli(lambda: draw(*args.draw), "pick another image")
    grid = list(itertools.product(*(getattr(args, axis) for axis in GRID)))
    for length, mixer, width in dict.fromkeys(g[:3] for g in grid):
        build(mixer, width, length, 0.0, 0, args)  # every mixer checked before any run
    if args.cost:
        print("mixer,width,length,head,ffn,batches_timed,epoch_s,epoch_cpu_s")
    data = {}
    for i, (length, mixer, width, lr, seed) in enumerate(grid):
        if length not in data:  # one length's sequences at a time
            tensors = mqar(args.train + args.test, length, PAIRS[length], 0)
            parts = (t.to(args.device).split([args.train, args.test]) for t in tensors)
            data = {length: tuple(zip(*parts))}  # train's (x, pos, y), test's
        model, adamw = build(mixer, width, length, lr, seed, args)
        if args.cost:
            part = lambda n: [t[: n * args.batch_size] for t in data[length][0]]
            quiet = lambda line: None  # (stdout is the CSV)
            train_epoch(model, adamw, part(2), 0, args, lr, quiet)  # warms up
            t0, cpu0 = time.time(), time.process_time()
            train_epoch(model, adamw, part(args.cost), 0, args, lr, quiet)
            per_epoch = (args.train // args.batch_size) / args.cost
            wall = (time.time() - t0) * per_epoch
            cpu = (time.process_time() - cpu0) * per_epoch
            what = f"{mixer},{width},{length},{args.head},{args.ffn},{args.cost}"
            print(f"{what},{wall:.1f},{cpu:.1f}", flush=True)
            continue
        name = f"{mixer}-d{width}-l{length}-lr{lr:g}-s{seed}"
        say = lambda text: print(f"[{i + 1}/{len(grid)}] {name}: {text}", flush=True)
        info = dict(mixer=mixer, width=width, length=length, lr=lr, seed=seed)
        info["settings"] = {k: getattr(args, k) for k in KEPT}
        run(args, os.path.join(args.out, name), model, adamw, info, data[length], say)
        runs = sorted(glob.glob(f"{glob.escape(args.out)}/*/run.json"))  # summary.csv's
        rows = [{k: r[k] for k in SUMMARY} for r in map(json.load, map(open, runs))]
        plot.write_csv(os.path.join(args.out, "summary.csv"), rows)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # (one line, no trace)
        sys.exit("stopped: the same command goes on from each run's last epoch")
