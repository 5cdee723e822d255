"""
What each layer's token mixer learned, from each run's ckpt.pt: a panel per run, a line
per layer, against the distance back k = 1..l: |w_k| (ME), ||w_k||_2 (WE, HE), ||W_k||_F
(SHE); the mean weight k - 1 tokens back of self-attention (on the run's val.bin) and
of a Random Synthesizer (softmax(R)), beside uniform weights'.

    python experiments/taps.py out/sa-32 out/she out/he out/we out/me -o taps.png
    python experiments/taps.py out/me                             # out/me/taps.png
"""

import argparse
import hashlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from plot import cli, fail, label, output_path, paper_rank, plt, save  # noqa: E402
from sample import load_model  # noqa: E402
from synthesizer import _syn_softmax  # noqa: E402

# the y axis of each mixer's panel; the others': ||w_k||_2
YLABEL = {"sa": "mean attention weight", "she": r"$\|W_k\|_F$", "me": r"$|w_k|$"}


def tap_profile(model, windows=None):
    """{layer (from 1): (l,) what its mixer weighs k - 1 tokens back}, as this file's
    docstring says for each kind of mixer; attention's on `windows` (N, l)."""
    if model.cfg.mixer == "sa":
        return attention_by_distance(model, windows)
    if hasattr(model.layers[0].mixer, "logits"):  # R: Random, Fixed, Factorized
        return {i: random_by_distance(L.mixer) for i, L in enumerate(model.layers, 1)}
    # (l, d, d), (l, d) or (l,) where there are taps
    mixers = [L.mixer for L in model.layers]
    taps = [getattr(m, "W_ext", getattr(m, "w_ext", None)) for m in mixers]
    if any(w is None for w in taps):
        fail(f"mixer {model.cfg.mixer!r} has no Extractor taps, no attention weights")
    norms = [w.detach().double().reshape(len(w), -1).norm(dim=1) for w in taps]
    return {i: norm.numpy() for i, norm in enumerate(norms, 1)}


def attention_weights(mixer, x):
    """Eq. (13), (14) from a SelfAttention's input x (B, t, d): A (B, n, t, t), each
    row a softmax over j <= i (F.scaled_dot_product_attention does not return it)."""
    (B, t, d), n = x.shape, mixer.n
    q, k, _ = mixer.W_QKV(x).split(d, dim=2)  # Eq. (10), (11), (B, t, d) each
    q, k = (z.view(B, t, n, d // n).transpose(1, 2) for z in (q, k))  # (B, n, t, h)
    z = q @ k.transpose(2, 3) / math.sqrt(d // n)  # Eq. (13), (B, n, t, t)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # j > i
    return z.masked_fill(future, -math.inf).softmax(dim=-1)  # Eq. (14)


def attention_by_distance(model, windows, chunk=32):
    """{layer: (t,) mean of A[i, i - k + 1] over heads, i >= k - 1 and the windows
    (N, t)}, from each mixer's input (the layer-normed residual stream), by a hook."""
    t = windows.shape[1]
    sums = {L.mixer: torch.zeros(t, t, dtype=torch.float64) for L in model.layers}

    def add(mixer, args, out):  # args[0]: the mixer's input (B, t, d)
        sums[mixer] += attention_weights(mixer, args[0]).double().sum(dim=(0, 1))

    hooks = [mixer.register_forward_hook(add) for mixer in sums]
    with torch.no_grad():
        for x in windows.split(chunk):
            model.eval()(x)
    for h in hooks:
        h.remove()
    n = len(windows) * model.cfg.n_head  # the (t, t) matrices each layer's sum holds
    return {i: mean_by_distance(s, n) for i, s in enumerate(sums.values(), 1)}


def random_by_distance(mixer):
    """(l,) a Random Synthesizer's softmax(R) (Synthesizer Eq. (4), causal rows): its
    mean weight k - 1 tokens back over heads and positions i >= k - 1."""
    with torch.no_grad():
        a = _syn_softmax(mixer.logits(0, mixer.l).double(), 0).sum(dim=0)  # (l, l)
    return mean_by_distance(a, mixer.n)


def mean_by_distance(a, n):
    """(t,) the mean of a[i, i - back] over i and the n matrices summed in a."""
    t = len(a)
    sums = torch.stack([a.diagonal(-back).sum() for back in range(t)])
    return (sums / (n * (t - torch.arange(t)))).numpy()


def uniform_by_distance(t):
    """attention_by_distance of uniform attention, A[i, j] = 1 / (i + 1): (t,)."""
    w = 1 / np.arange(1, t + 1)  # row i's weight
    return np.array([w[back:].mean() for back in range(t)])


def val_windows(data_dir, l, n=256, sha256=None):
    """n windows of l tokens spread evenly over data_dir/val.bin: (n, l) int64; refused
    unless val.bin's sha256 is `sha256` (the checkpoint's), where given."""
    path = os.path.join(data_dir, "val.bin")
    if not os.path.isfile(path):
        fail(f"{path} not found; pass --data_dir, the folder with the run's val.bin")
    val = np.memmap(path, dtype=np.uint16, mode="r")
    if sha256 and hashlib.sha256(val).hexdigest() != sha256:  # (of the file's bytes)
        fail(f"{path} is not the run's val.bin (sha256 differs); pass its --data_dir")
    starts = np.linspace(0, len(val) - l - 1, n).round().astype(np.int64)
    return np.stack([val[s : s + l] for s in starts]).astype(np.int64)  # (n, l)


def plot_taps(run_dirs, path, data_dir=None):
    """A panel per run in the paper's order, a line per layer: tap_profile against k."""
    panels = []
    for run_dir in run_dirs:
        model, ckpt = load_model(run_dir, torch.device("cpu"))
        cfg = model.cfg
        windows = None
        if cfg.mixer == "sa":
            folder = data_dir or ckpt["args"]["data_dir"]
            sha = ckpt.get("data", {}).get("val_sha256")
            windows = torch.from_numpy(val_windows(folder, cfg.block_size, sha256=sha))
        profile = tap_profile(model, windows)
        ylabel = YLABEL.get(cfg.mixer, r"$\|w_k\|_2$")
        if hasattr(model.layers[0].mixer, "logits"):
            ylabel = "mean softmax(R) weight"
        panels.append((label(vars(cfg)), ckpt.get("iter", "?"), ylabel, profile))
    rows, cols = -(-len(panels) // 3), min(3, len(panels))  # three panels a row
    size = (4.8 * cols, 3.6 * rows)
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    panels.sort(key=lambda p: paper_rank(p[0]))
    for ax, (name, batch, ylabel, profile) in zip(axes.flat, panels):
        colours = plt.cm.viridis(np.linspace(0, 0.9, len(profile)))
        k = np.arange(1, len(profile[1]) + 1)
        for colour, (layer, y) in zip(colours, profile.items()):
            ax.plot(k, y, color=colour, lw=1.2, label=f"layer {layer}")
        if ylabel.startswith("mean"):  # what weights spread evenly over j <= i give
            ax.plot(k, uniform_by_distance(len(k)), "--", color="gray", label="uniform")
        ax.set(yscale="log", title=f"{name}, batch {batch}", ylabel=ylabel)
        ax.set(xlabel="distance back k (k = 1: the current token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=1 + (len(profile) - 1) // 6)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    save(fig, path)
    return [path]


def main(argv=None):
    form = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=form)
    p.add_argument("runs", nargs="+", help="run folders of train.py, with ckpt.pt")
    p.add_argument("-o", "--output", help="image file; one run alone: RUN/taps.png")
    p.add_argument("--data_dir", help="sa: the val.bin folder (default: the run's own)")
    p.error = lambda msg: fail(f"{msg} (see --help)")
    args = p.parse_args(argv)
    output = output_path(args.output, args.runs, "taps.png")
    return cli(lambda: plot_taps(args.runs, output, args.data_dir), "pick another -o")


if __name__ == "__main__":
    sys.exit(main())
