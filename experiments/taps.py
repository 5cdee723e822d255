"""
What each layer's token mixer learned, from each run's ckpt.pt: a panel per run, a line per layer,
against the distance back k = 1..l: |w_k| (ME), ||w_k||_2 (WE, HE), ||W_k||_F (SHE), or for
self-attention the mean attention weight on the run's val.bin (plot.py draws the training curves).

    python taps.py out/sa-32 out/she out/he out/we out/me -o taps.png   # a panel per run
    python taps.py out/me-m2-l64-b32                                   # its RUN/taps.png
"""

import argparse
import hashlib
import math
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import fail, one_line_errors  # noqa: E402
from extractor import SelfAttention  # noqa: E402
from plot import cli, default_output, plt, read_runs, save  # noqa: E402
from sample import load_model  # the model of a run's ckpt.pt  # noqa: E402

TAP_WINDOWS = 256  # evenly spaced windows of val.bin over which attention's weights are averaged
TAP_LABELS = {"sa": "mean attention weight", "she": r"$\|W_k\|_F$", "me": r"$|w_k|$"}  # else ||w_k||_2


def tap_profile(model, windows=None):
    """What each layer's token mixer weighs at each distance back k = 1..l (k = 1 is the current
    token), as {layer (from 1): (l,) array}: ME's |w_k|, WE's and HE's ||w_k||_2, SHE's Frobenius
    ||W_k||_F; for self-attention the mean attention weight k - 1 tokens back, averaged over heads,
    positions and `windows`, a (N, t) tensor of token ids."""
    mixers = [layer.mixer for layer in model.layers]
    if isinstance(mixers[0], SelfAttention):
        return attention_by_distance(model, windows)
    profile = {}
    for i, mixer in enumerate(mixers, 1):
        w = getattr(mixer, "W_ext", getattr(mixer, "w_ext", None))  # (l, d, d), (l, d) or (l,)
        if w is None:
            fail(f"the {model.cfg.mixer!r} mixer has neither Extractor taps nor attention weights to draw")
        profile[i] = w.detach().double().reshape(len(w), -1).norm(dim=1).numpy()  # ||W_k||_F, ||w_k||, |w_k|
    return profile


def attention_weights(mixer, x):
    """Eq. (13), (14) recomputed from a SelfAttention's input x (B, t, d): A (B, n, t, t), each row
    a softmax over the positions j <= i (F.scaled_dot_product_attention does not return it)."""
    B, t, d = x.shape
    n = mixer.n
    q, k, _ = mixer.W_QKV(x).split(d, dim=2)  # Eq. (10), (11), (B, t, d) each
    q, k = (z.view(B, t, n, d // n).transpose(1, 2) for z in (q, k))  # (B, n, t, h)
    z = q @ k.transpose(2, 3) / math.sqrt(d // n)  # Eq. (13), (B, n, t, t)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # j > i
    return z.masked_fill(future, -math.inf).softmax(dim=-1)  # Eq. (14)


def attention_by_distance(model, windows, chunk=32):
    """{layer: (t,) mean of A[i, i - k + 1] over heads, positions i >= k - 1 and the windows (N, t)}.
    A forward pre-hook catches each mixer's input (the layer-normed residual stream)."""
    inputs = {}
    hooks = [
        layer.mixer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
        for i, layer in enumerate(model.layers, 1)
    ]
    N, t = windows.shape
    pos = torch.arange(t)
    back = pos[:, None] - pos[None, :]  # (t, t), the distance back i - j
    seen = back >= 0
    sums = {i: torch.zeros(t, dtype=torch.float64) for i in range(1, len(model.layers) + 1)}
    model.eval()
    try:
        with torch.no_grad():
            for x in windows.split(chunk):
                model(x)
                for i, layer in enumerate(model.layers, 1):
                    a = attention_weights(layer.mixer, inputs[i]).double().sum(dim=(0, 1))  # (t, t)
                    sums[i].index_add_(0, back[seen], a[seen])
    finally:
        for h in hooks:
            h.remove()
    count = N * model.layers[0].mixer.n * (t - pos)  # (t,) weights summed at each distance
    return {i: (s / count).numpy() for i, s in sums.items()}


def uniform_by_distance(t):
    """attention_by_distance of uniform attention, A[i, j] = 1 / (i + 1): (t,) means over i >= k - 1."""
    w = 1 / np.arange(1, t + 1)  # row i's weight
    return np.array([w[back:].mean() for back in range(t)])


def val_windows(data_dir, l, n=TAP_WINDOWS, sha256=None):
    """n windows of l tokens spread evenly over data_dir/val.bin, as train.py picks its validation
    windows: a (n, l) int64 array. With sha256 (the checkpoint's), refused unless val.bin is the run's."""
    path = os.path.join(data_dir, "val.bin")
    if not os.path.isfile(path):
        fail(f"{shlex.quote(path)} not found; pass --data_dir, the folder with the run's val.bin")
    if sha256:
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != sha256:
                fail(f"{shlex.quote(path)} is not the run's val.bin (sha256 differs); pass its --data_dir")
    val = np.memmap(path, dtype=np.uint16, mode="r")
    if len(val) < l + 1:
        fail(f"{shlex.quote(path)} has {len(val)} tokens, fewer than l + 1 = {l + 1}")
    starts = np.linspace(0, len(val) - l - 1, n).round().astype(np.int64)
    return np.stack([val[s : s + l] for s in starts]).astype(np.int64)  # (n, l)


def run_panel(name, run_dir, data_dir=None):
    """(title, mixer, tap_profile) of a run's ckpt.pt; self-attention's on the run's val.bin."""
    model, ckpt = load_model(run_dir, torch.device("cpu"))
    windows = None
    if model.cfg.mixer == "sa":
        run_data = data_dir or ckpt.get("args", {}).get("data_dir", "data")
        sha256 = ckpt.get("data", {}).get("val_sha256")
        windows = torch.from_numpy(val_windows(run_data, model.cfg.block_size, sha256=sha256))
    return f"{name}, batch {ckpt.get('iter', '?')}", model.cfg.mixer, tap_profile(model, windows)


def plot_taps(runs, path, data_dir=None, title=None):
    """One panel per run, one line per layer: tap_profile against the distance back k = 1..l."""
    panels = [run_panel(r["name"], r["dir"], data_dir) for r in runs]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, mixer, profile) in zip(axes.flat, panels):
        colours = plt.cm.viridis(np.linspace(0, 0.9, len(profile)))
        for colour, (layer, y) in zip(colours, profile.items()):
            k = np.arange(1, len(y) + 1)
            ax.plot(k, y, color=colour, lw=1.2, label=f"layer {layer}")
        if mixer == "sa":  # what attention spread evenly over the seen tokens would give
            ax.plot(k, uniform_by_distance(len(k)), "--", color="gray", label="uniform")
        ax.set_yscale("log")
        ax.set(title=name, xlabel="distance back k (k = 1: the current token)")
        ax.set_ylabel(TAP_LABELS.get(mixer, r"$\|w_k\|_2$"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=1 + (len(profile) - 1) // 6)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)


def build_parser():
    intro, examples = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=intro, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="run folders written by train.py, each with its ckpt.pt")
    p.add_argument(
        "-o", "--output", help="image file to write; needed for several runs (one run: RUN/taps.png)"
    )
    p.add_argument(
        "--data_dir",
        help=f"for sa runs: the folder with val.bin (default: the run's own); {TAP_WINDOWS} windows",
    )
    p.add_argument("--title", help="figure title")
    return one_line_errors(p, "taps.py")


def main(argv=None):
    def work():
        args = build_parser().parse_args(argv)
        output = default_output(args.output, args.runs, "taps.png")
        plot_taps(read_runs(args.runs, logs=False), output, args.data_dir, args.title)
        return [output]

    return cli(work, "pick another -o")


if __name__ == "__main__":
    sys.exit(main())
