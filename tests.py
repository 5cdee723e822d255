"""Tests: python -m pytest tests.py  (CPU, no network; loopback servers only).

TEST_DEVICE=cuda (or cuda:N, mps) runs the model, FIR, generation and training tests on
that device; the literal references stay on the CPU in float64. `-m device` selects the
tests that only mean something on a GPU (they skip elsewhere).

Where each equation and guarantee is checked (reference -> test, as `-k` words):
  Eq. (3)-(22), the Transformer      literal_transformer -> section4_written_out
  Eq. (10)-(17), self-attention      literal_sa -> mixer_forward_and_backward
  Eq. (23)-(29), the Extractors      literal_fir -> mixer_forward, every_path
  the Synthesizers' equations        literal_synth -> mixer_forward, synth_fixed_random
  Eq. (2), generation and sampling   cached_generation, sliding_window, top_k_and_top_p
  Section 6, the initialisation      initialisation_follows_section6
  Tables 3-7, counts                 per_token_counts -> tables_5_6, table7
  fir.py's paths and precision       every_path, default_path, ieee_float32, tf32
  AdamW with Table 1's settings      literal_adamw -> training_step_is_adamw
  the batches, the same for all      batch_order, every_mixer_sees_the_same_batches
  bit-exact resume after a stop      ctrl_c_checkpoints, kill_and_hangup, closed_stdout
  the resume's and folder's rules    resume_keeps, resume_refuses, folder_holds, locked
  files whole, one line for a fault  written_whole, says_what_stays, bad_flags, console
  memory flat over a run             resident_memory
  DDP: two processes train as one    ddp_with_two_processes, seed_plus_rank
  CUDA's path, checked on the CPU    cuda_gets, clock_waits, capture_that_fails
  on a GPU only (-m device)          captured_step_equals, fir_in_float32
  the data pipeline                  strip, download, bpe, split, load_data, bad_input
  sample.py                          sample_, a_mixer_of_your_own, end_to_end
  tools, results/                    bench_, reproduce_, gpu_check, plot_, taps_, csvs
"""

import argparse
import collections
import contextlib
import copy
import csv
import errno
import functools
import glob
import gzip
import hashlib
import http.server
import importlib
import io
import itertools
import json
import math
import os
import random
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
import weakref

# the tests' own medians, not numpy's, which plot.py takes
from statistics import median
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import extractor
import fir
import machinery
import prepare_data
import sample
import synthesizer
import train
from extractor import MIXERS, SYNTHESIZERS, Config, Transformer, find_mixer

# the scripts run here in subprocesses
ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import bench  # noqa: E402
import fair  # noqa: E402
import plot  # noqa: E402
import recall  # noqa: E402
import reproduce  # noqa: E402
import taps  # noqa: E402


def _test_device():
    """The device TEST_DEVICE names (default cpu), and why it cannot be used or None."""
    name = os.environ.get("TEST_DEVICE", "cpu")
    cpu = torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        why = f"TEST_DEVICE={name!r} is not a device name; use cpu, cuda, cuda:N or mps"
        return cpu, why
    cuda = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    there = {"cpu": True, "cuda": cuda, "mps": torch.backends.mps.is_available()}
    if not there.get(device.type, False):
        return cpu, f"TEST_DEVICE={name}: torch sees no such device here; unset it"
    if device.type == "cuda":
        # the same numbers every time, so "bit for bit" means what it does on the CPU:
        # without warn_only, as attention's backward kernels take only that as leave to
        # drop their atomics, and an op with no deterministic kernel fails loudly
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return device, None


DEVICE, _NO_DEVICE = _test_device()
FLOAT = torch.float32 if DEVICE.type == "mps" else torch.float64  # MPS has no float64
TOL = 1e-9 if FLOAT == torch.float64 else 1e-4
on_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs TEST_DEVICE=cuda")


@pytest.fixture(autouse=True, scope="session")
def _test_device_is_there():
    if _NO_DEVICE:  # one line, before any test runs
        pytest.exit(_NO_DEVICE, returncode=4)


@pytest.fixture
def tf32():
    """CUDA's TF32 switches (matmul, cudnn), set by assignment, put back after: pytest
    >= 9.2's monkeypatch cannot undo them (their module answers through __getattr__)."""
    switches = torch.backends.cuda.matmul, torch.backends.cudnn
    before = [s.allow_tf32 for s in switches]
    yield switches
    switches[0].allow_tf32, switches[1].allow_tf32 = before


def dev(obj):
    """obj copied to the test device in FLOAT; the CPU original stays the reference."""
    if isinstance(obj, torch.nn.Module):
        obj = copy.deepcopy(obj)
    return obj.to(DEVICE, FLOAT)


def cpu64(*tensors):
    return [t.detach().cpu().double() for t in tensors]


def assert_close(a, b, what):
    """a equals b to TOL; a failure says which tensor, by how much and where."""
    torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m: f"{what}: {m}")


def error_line(capsys, fn, *args, **kw):
    """fn(*args, **kw), a script's main or a function of it, must end with exit status 1
    (returned, or SystemExit) and one line "error: ..." on stderr, no traceback: it."""
    capsys.readouterr()
    try:
        rc = fn(*args, **kw)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: ") and "\n" not in err, (rc, err)
    return err


def run_script(*argv, **kw):
    """python <argv>, run in the project's root as a user would: rc, stdout, stderr."""
    cmd = [sys.executable, *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    return r.returncode, r.stdout, r.stderr


def tiny_model(mixer, l=16, d=16, n_head=4, n_layer=2, vocab=50, n_hidden=32, seed=0):
    """A small Transformer: CPU, float32, the paper's initialisation, eval mode."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=vocab, block_size=l, n_embd=d, n_hidden=n_hidden)
    cfg = Config(**sizes, n_layer=n_layer, n_head=n_head, mixer=mixer)
    return Transformer(cfg).eval()


def scrambled(module, std):
    """module in float64, every parameter and buffer drawn again ~ N(0, std²): more than
    the paper's init, so that every term matters and greedy choices are no ties."""
    module = module.double()
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.normal_(0, std)
    return module


def make_data(path, vocab=64, n_words=5000, seed=0):
    """A data folder as prepare_data.py writes it (train.bin, val.bin; meta.json: token
    counts, sha256) of made-up words, fixed random token strings: something to learn."""
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, vocab - 1, size=rng.integers(2, 6)) for _ in range(40)]
    picks = rng.integers(0, 40, size=n_words)
    ids = np.concatenate([words[i] for i in picks]).astype(np.uint16)
    os.makedirs(path, exist_ok=True)
    meta = {"vocab_size": vocab}
    cut = int(0.9 * len(ids))
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        part.tofile(os.path.join(path, f"{split}.bin"))
        meta[f"{split}_tokens"] = len(part)
        meta[f"{split}_sha256"] = hashlib.sha256(part.tobytes()).hexdigest()
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "data")


# ======== the model and its equations (extractor.py, synthesizer.py) as float64 loops

PAPER = ["sa", "she", "he", "we", "me", "he-ext"]
SYNTHS = (
    "dense dense-fact random random-fixed random-fact random+dense random+sa dense+sa"
).split()
ALL = PAPER + SYNTHS


def literal_fir(x, w):
    """Eq. (23)/(26)/(28)/(29) as written: x_i = sum_{j<=i} x_j (*) w_{i-j+1}."""
    y = torch.zeros_like(x)
    for i in range(x.shape[1]):
        for j in range(i + 1):
            # tap k = i - j + 1
            y[:, i] += x[:, j] @ w[i - j] if w.dim() == 3 else x[:, j] * w[i - j]
    return y


def causal_softmax_rows(S, V):
    """Eq. (14) (k, f <= i only) and (15): S (B, t, t), V (B, t, h)."""
    R = torch.zeros(V.shape, dtype=V.dtype)
    for i in range(S.shape[1]):
        e = torch.exp(S[:, i, : i + 1])
        R[:, i] = (e[:, :, None] / e.sum(1)[:, None, None] * V[:, : i + 1]).sum(1)
    return R


def literal_sa(m, x):
    """Eq. (10)-(17), head by head."""
    d = x.shape[2]
    h = d // m.n
    W = m.W_QKV.weight.T  # (d, 3d): the columns of W^Q, W^K, W^V of all heads
    heads = []
    for j in range(m.n):
        WQ, WK, WV = (W[:, s * d + j * h : s * d + (j + 1) * h] for s in range(3))
        Q, K, V = x @ WQ, x @ WK, x @ WV  # Eq. (10)-(12)
        S = Q @ K.transpose(1, 2) / math.sqrt(h)  # Eq. (13)
        heads.append(causal_softmax_rows(S, V))  # Eq. (14), (15)
    return torch.cat(heads, dim=2) @ m.W_out_att.weight.T  # Eq. (16), (17)


def synth_logits(part, m, x, j):
    """Head j's logits S_j (B or 1, t, t) from one part of a Synthesizer's name."""
    t, d = x.shape[1:]
    h = d // m.n
    c = slice(j * h, (j + 1) * h)
    if part == "sa":
        W = m.W_QK.weight.T  # (d, 2d): the columns of W^Q of all heads, then of W^K
        Q, K = x @ W[:, :d][:, c], x @ W[:, d:][:, c]  # Eq. (10), (11)
        return Q @ K.transpose(1, 2) / math.sqrt(h)  # Eq. (13)
    if part in ("random", "random-fixed"):
        return m.R[j, :t, :t]  # Synthesizer Eq. (4)
    if part == "random-fact":  # Synthesizer Eq. (7): R_1 R_2^T, entry by entry
        R_1, R_2 = m.R_1[j], m.R_2[j]
        rows = [torch.stack([R_1[i] @ R_2[k] for k in range(t)]) for i in range(t)]
        return torch.stack(rows)
    hid = torch.relu(x @ m.W_1.weight.T)[:, :, c]  # Synthesizer Eq. (2), head j's units
    if part == "dense":
        return hid @ m.W_2[j, :t].T  # Synthesizer Eq. (1): B_i, the first t of l
    # dense-fact, Synthesizer Eq. (5), (6): C_{i, u b + v} = A_{i,u} B_{i,v}
    A, B = hid @ m.W_A[j], hid @ m.W_B[j]
    return torch.stack([A[:, :, p // m.b] * B[:, :, p % m.b] for p in range(t)], dim=2)


def literal_synth(name, m, x):
    """Each head's S_j by Synthesizer Eq. (1)-(7), the mixtures; then Eq. (14)-(17)."""
    B, t, d = x.shape
    h = d // m.n
    V = x @ m.W_V.weight.T  # Eq. (12), all heads
    heads = []
    for j in range(m.n):
        parts = [synth_logits(part, m, x, j) for part in name.split("+")]
        S = parts[0]
        if len(parts) == 2:  # alpha_1 S_1 + alpha_2 S_2, alpha = softmax(alpha_j)
            e = torch.exp(m.alpha[j])
            S = e[0] / e.sum() * parts[0] + e[1] / e.sum() * parts[1]
        V_j = V[:, :, j * h : (j + 1) * h]
        heads.append(causal_softmax_rows(S.expand(B, t, t), V_j))
    return torch.cat(heads, dim=2) @ m.W_out_att.weight.T  # Eq. (16), (17)


def literal_mixer(name, m, x):
    if name in SYNTHS:
        return literal_synth(name, m, x)
    if name == "sa":
        return literal_sa(m, x)
    if name == "me":
        return literal_fir(x, m.w_ext)  # Eq. (29)
    if name == "he-ext":
        return literal_fir(x @ m.W_in_ext.weight.T, m.w_ext)  # Eq. (27), (28)
    if name == "she":
        x_ext = literal_fir(x, m.W_ext)  # Eq. (23)
    elif name == "we":
        x_ext = literal_fir(x, m.w_ext)  # Eq. (26)
    else:
        x_ext = literal_fir(x @ m.W_in_ext.weight.T, m.w_ext)  # HE: Eq. (27), (28)
    return ((x @ m.W_adj.weight.T) * x_ext) @ m.W_out.weight.T  # Eq. (24), (25)


def random_mixer(name, d=8, l=12, n=2, seed=0, std=0.5):
    """A float64 CPU mixer, its parameters (and Fixed Random's R) drawn ~ N(0, std²)."""
    torch.manual_seed(seed)
    cfg = Config(n_embd=d, block_size=l, n_head=n, mixer=name)
    return scrambled(find_mixer(name)(cfg), std)


def output_and_grads(m, x, g, forward):
    """forward(m, x) and the gradients of x and m's parameters for output gradient g."""
    x = x.detach().requires_grad_()
    y = forward(m, x)
    return cpu64(y, *torch.autograd.grad(y, [x, *m.parameters()], g))


def test_the_mixers_and_their_names():
    assert list(MIXERS) == PAPER and list(SYNTHESIZERS) == SYNTHS  # synthesizer.py's
    for name, cls in [*MIXERS.items(), *SYNTHESIZERS.items()]:
        assert find_mixer(name) is cls and name in ALL


@pytest.mark.parametrize("name", ALL)
def test_mixer_forward_and_backward_equal_literal_equations(name):
    moved = {}
    shapes = [(8, 12, 2, 1), (8, 12, 2, 7), (12, 6, 3, 6), (8, 16, 1, 9)]
    for trial, (d, l, n, t) in enumerate(shapes):
        m = random_mixer(name, d, l, n, seed=trial)
        x, g = torch.randn(2, 2, t, d, dtype=torch.float64)
        got = output_and_grads(dev(m), dev(x), dev(g), lambda mixer, x: mixer(x))
        ref = output_and_grads(m, x, g, functools.partial(literal_mixer, name))
        names = ["y", "x"] + [k for k, _ in m.named_parameters()]
        for what, a, b in zip(names, got, ref, strict=True):
            assert_close(a, b, f"{name}'s {what} at t = {t}")
            moved[what] = moved.get(what, False) or bool(b.abs().max() > 0)
    assert all(moved.values()), moved  # every parameter has a gradient to compare


@pytest.mark.parametrize("name", ALL)
def test_mixer_is_causal(name):
    m = dev(random_mixer(name, d=8, l=12, n=2))
    x = dev(torch.randn(2, 12, 8)).requires_grad_()
    y = m(x)
    for i in (0, 5, 11):
        (g,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        past = g[:, : i + 1].abs().max()
        future = g[:, i + 1 :].abs().amax(dim=(0, 2)).sum()
        assert past > 0, f"output {i} ignores its inputs"
        # the FFT's round-off only
        assert future <= TOL * 1e-3 * past, f"output {i} depends on later positions"


# ---- the whole Transformer, Section 4 alone, against `Transformer` on the same weights
def literal_transformer(model, idx, targets, masks=None):
    """Eq. (3)-(22) with model's weights, in float64: logits (inside Eq. 21's softmax),
    Y-hat, the loss. masks: each dropout's kept elements in the paper's order (Eq. 7,
    then per layer Eq. 18 and 20's one draw and Eq. 20's), or None (evaluation)."""
    cfg, t = model.cfg, idx.shape[1]
    u, l, d, p = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.dropout
    draws = iter(masks or [])

    def dropout(X):  # Eq. (6), in training
        return X if masks is None else torch.where(next(draws), X / (1 - p), 0.0)

    def layernorm(X, ln):  # Eq. (8), over each row (torch's eps 1e-5 inside)
        mu = X.mean(-1, keepdim=True)
        sigma = ((X - mu) ** 2).mean(-1, keepdim=True).add(1e-5).sqrt()
        return ln.weight * (X - mu) / sigma + ln.bias

    X_in_tok = F.one_hot(idx, u).double()  # (B, t, u): [s_i = j - 1]
    X_in_pos = torch.eye(l, dtype=torch.float64)[:t]  # (t, l): [i = j]
    X_emb_tok = X_in_tok @ (model.emb_tok.weight * math.sqrt(d))  # Eq. (4)
    X_emb_pos = X_in_pos @ (model.emb_pos.weight * math.sqrt(d))  # Eq. (5)
    X = dropout(X_emb_tok + X_emb_pos)  # Eq. (7): X^[in_lay1]
    for lay in model.layers:
        # Eq. (9), the mixer
        X_out_sub1 = literal_mixer(cfg.mixer, lay.mixer, layernorm(X, lay.ln1))
        D1 = dropout(X_out_sub1)  # one draw, used by Eq. (18) and (20)
        X_in_sub2 = layernorm(D1 + X, lay.ln2)  # Eq. (18)
        f1, f2 = lay.ffn.sub2_1, lay.ffn.sub2_2
        hidden = torch.relu(X_in_sub2 @ f1.weight.T + f1.bias)
        X_out_sub2 = hidden @ f2.weight.T + f2.bias  # Eq. (19)
        X = dropout(X_out_sub2) + D1 + X  # Eq. (20)
    Z = layernorm(X, model.ln_f) @ model.soft.weight.T + model.soft.bias  # Eq. (21)
    Y_hat = torch.exp(Z) / torch.exp(Z).sum(-1, keepdim=True)  # Eq. (21), (22)
    loss = -torch.log(Y_hat.gather(-1, targets[..., None])).mean()  # Eq. (3)
    return Z, Y_hat, loss


def dropout_masks(model):
    """In call order, what each nn.Dropout of model keeps (its nonzero outputs)."""
    masks = []
    record = lambda module, args, out: masks.append((out != 0).cpu())
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(record)
    return masks


@pytest.mark.parametrize("name", PAPER)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_transformer_equals_section4_written_out(name, mode):
    """Forward (logits, Y-hat, loss) and backward (every parameter's gradient), in eval
    mode and in training, with the dropout masks the model drew in the literal model."""
    torch.manual_seed(1)
    cfg = Config(11, 8, 8, 12, 2, 2, 0.3, name)  # u, l, d, c, m, n, p, the mixer
    ref = scrambled(Transformer(cfg), 0.4)
    model = dev(ref).train(mode == "train")
    t = 8 if mode == "eval" else 6
    idx, targets = torch.randint(0, 11, (2, t)), torch.randint(0, 11, (2, t))
    masks = dropout_masks(model) if mode == "train" else None
    logits, loss = model(dev(idx).long(), dev(targets).long())
    loss.backward()
    if mode == "train":
        assert len(masks) == 1 + 2 * 2, len(masks)
        assert all(0 < (~m).sum() < m.numel() for m in masks)
    Z, Y_hat, L = literal_transformer(ref, idx, targets, masks)
    L.backward()
    got = cpu64(logits, logits.softmax(-1), loss)
    for what, a, b in zip(["logits", "Y_hat", "loss"], got, (Z, Y_hat, L)):
        assert_close(a, b, what)
    for (what, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(cpu64(p.grad)[0], p_ref.grad, f"d loss / d {what}")
    assert model(dev(idx).long())[1] is None  # no targets, no loss


# ---- initialisation (Section 6)
def ks_distance_from_normal(v, sigma):
    """Kolmogorov-Smirnov distance sup |F_n - F| of the sample v from N(0, sigma^2)."""
    v = v.detach().double().flatten().sort().values
    n = v.numel()
    cdf = 0.5 * (1 + torch.erf(v / (sigma * math.sqrt(2))))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - cdf).max().item(), (cdf - (i - 1) / n).max().item())


@pytest.mark.parametrize("mixer", ALL)
def test_initialisation_follows_section6(mixer):
    """Biases 0, LayerNorm gains 1, the mixtures' alphas 0 (1/2 each), every weight
    tensor ~ N(0, 0.01²) but Fixed Random's R, N(0, 1). Bands from each tensor's size n
    pass a true normal sample with probability 1 - 1e-6: 5 standard errors for the std
    (std / sqrt(2(n-1))) and the mean (std / sqrt(n)); the Kolmogorov-Smirnov distance
    below sqrt(ln(2 / 1e-6) / 2n) (DKW) checks the shape (a uniform's is 0.058)."""
    model = tiny_model(mixer, l=64, d=128, n_hidden=256, vocab=500)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        n = p.numel()
        std = 1.0 if mixer == "random-fixed" and name.endswith(".R") else 0.01
        if name.endswith("bias") or name.endswith("alpha"):
            assert (p == 0).all(), name
        elif ".ln" in name or name.startswith("ln_f"):
            assert (p == 1).all(), name
        else:
            std_band = 5 * std / math.sqrt(2 * (n - 1))
            assert abs(p.std().item() - std) < std_band, (name, p.std().item())
            assert abs(p.mean().item()) < 5 * std / math.sqrt(n), (name, p.mean())
            dkw = math.sqrt(math.log(2 / 1e-6) / (2 * n))
            assert ks_distance_from_normal(p, std) < dkw, name


# ---- parameter counts: Tables 3, 4 (no biases: Notes, 7), the Synthesizers' Table 1
def paper_params(name, d, l):
    """Tables 3 and 4, without biases (Notes on the paper, 7)."""
    counts = {"sa": 4 * d * d, "she": l * d * d + 2 * d * d, "he": l * d + 3 * d * d}
    counts |= {"we": l * d + 2 * d * d, "me": l, "he-ext": l * d + d * d}
    return counts[name]


def synth_params(name, d, l, n, a, b, k=8):
    """The Synthesizer paper's Table 1 and text (a b = l, k = 8) plus W_V, W_out_att."""
    part = {"dense": d * d + d * l, "dense-fact": d * d + d * (a + b)}  # "adds d x N"
    part["random"] = n * l * l  # "N^2"
    part["random-fixed"] = 0
    part["random-fact"] = 2 * n * l * k  # "2(Nk)"
    part["sa"] = 2 * d * d
    alphas = 2 * n if "+" in name else 0  # the mixtures' mixing weights
    return 2 * d * d + sum(part[p] for p in name.split("+")) + alphas


@pytest.mark.parametrize(
    "d,l,n,a,b",
    [(128, 128, 32, 8, 16), (24, 12, 3, 3, 4), (16, 9, 4, 3, 3), (8, 1, 1, 1, 1)],
)
def test_parameter_counts_equal_formulas(d, l, n, a, b):
    cfg = Config(n_embd=d, block_size=l, n_head=n)
    count = lambda name: sum(p.numel() for p in find_mixer(name)(cfg).parameters())
    for name in PAPER:
        assert count(name) == paper_params(name, d, l), name
    for name in SYNTHS:
        assert count(name) == synth_params(name, d, l, n, a, b), name
    assert synthesizer._syn_factors(l) == (a, b)


@pytest.mark.parametrize("name", ALL)
def test_whole_model_parameter_count(name):
    u, l, d, c, m = 97, 16, 24, 40, 3
    model = Transformer(Config(u, l, d, c, m, 4, mixer=name))  # n = a = b = 4
    paper = name in PAPER
    mixer = paper_params(name, d, l) if paper else synth_params(name, d, l, 4, 4, 4)
    want = {
        "embeddings": u * d + l * d,  # Eq. (4), (5)
        "mixers": m * mixer,
        "ffns": m * (d * c + c + c * d + d),  # Eq. (19)
        # Eq. (8) twice a layer and before Eq. (21), then Eq. (21)
        "norms_and_head": m * 2 * 2 * d + 2 * d + d * u + u,
    }
    want["total"] = sum(want.values())
    assert model.param_counts() == want
    assert want["total"] == sum(p.numel() for p in model.parameters())


# ---- bad configurations and inputs: one clear ValueError each
def refused(message, fn, *args, **kw):
    """fn(*args, **kw) raises a ValueError that says exactly `message`."""
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    assert str(e.value) == message


def test_a_mixer_refuses_settings_it_cannot_take_with_one_clear_value_error():
    """A mixer refuses what it cannot take; Config is a plain record (no checks)."""
    for name in ("sa", "dense", "random+sa"):  # the mixers with heads
        why = f"for mixer '{name}' (each head has d/n features)"
        cfg = Config(n_head=3, mixer=name)
        refused(f"n_head=3 must divide n_embd=128 {why}", find_mixer(name), cfg)
    extractor.ME(Config(n_head=3, mixer="me"))  # heads mean nothing to the Extractors
    for l, fix in ((2, 4), (3, 4), (7, 8), (127, 128)):
        why = f"but l={l} is prime: try block_size={fix}"
        says = f"dense-fact needs block_size l = a b with a, b > 1, {why}"
        refused(says, tiny_model, "dense-fact", l=l)


def test_bad_inputs_give_one_clear_value_error():
    model = dev(scrambled(tiny_model("me", l=8), 0.3))
    tokens = lambda t: torch.zeros(1, t, dtype=torch.long, device=DEVICE)
    model(tokens(8))  # l tokens fit
    too_long = "sequence length 9 exceeds block_size l=8; crop it to its last l tokens"
    refused(too_long, model, tokens(9))
    cache = model.new_cache()
    model(tokens(5), cache=cache)
    refused(too_long, model, tokens(4), cache=cache)
    why = "idx (2, 0) holds no tokens; give each sequence at least one"
    for name in ("sa", "me", "dense"):
        for cache in (None, model.new_cache()):
            refused(why, tiny_model(name), tokens(0).expand(2, 0), cache=cache)
    x = torch.zeros(1, 13, 8, dtype=torch.float64)  # a Synthesizer alone
    refused("sequence length 13 exceeds block_size l=12", random_mixer("dense"), x)


# ---- find_mixer: the paper's names, the Synthesizers', module.Class
USER_MIXER = '''
import torch, torch.nn as nn

class Mean(nn.Module):
    """A mixer of one's own: the running mean of the inputs, scaled per feature."""
    def __init__(self, cfg):
        super().__init__()
        self.w = nn.Parameter(torch.ones(cfg.n_embd))
    def forward(self, x, cache=None):
        n = torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        return self.w * x.cumsum(1) / n

class Peek(Mean):  # position i reads i + 1: sees the future
    def forward(self, x, cache=None):
        return self.w * torch.cat([x[:, 1:], x[:, -1:]], 1)

class Cut(Mean):  # x's shape at t < l only
    def forward(self, x, cache=None):
        return self.w * x[:, :7]

NOT_A_CLASS = 3
'''


def test_find_mixer_knows_three_forms_else_names_them(tmp_path, monkeypatch):
    (tmp_path / "my_mixers.py").write_text(USER_MIXER)
    monkeypatch.syspath_prepend(str(tmp_path))
    Mean = importlib.import_module("my_mixers").Mean
    assert find_mixer("my_mixers.Mean") is Mean and find_mixer("she") is extractor.SHE
    # a checkpoint's config, a plain dict: no flag, no registering
    cfg = dict(vocab_size=9, block_size=6, n_embd=10, n_head=3, n_layer=1)
    model = Transformer(Config(**cfg, mixer="my_mixers.Mean"))
    assert type(model.layers[0].mixer) is Mean
    assert model(torch.zeros(1, 6).long())[0].shape == (1, 6, 9)
    choices = ", ".join(ALL) + ", or module.Class (a mixer class of yours)"
    relative = "the 'package' argument is required to perform a relative import for"
    module, ordered = ", not an nn.Module class)", "collections.OrderedDict"
    cases = {  # a name: why it is not a mixer, shown after it
        "xx": "",
        "he.ext": " (No module named 'he')",
        "math.pi": f" (math.pi is 3.141592653589793{module}",
        "my_mixers.Nope": " (module 'my_mixers' has no attribute 'Nope')",
        "my_mixers.NOT_A_CLASS": f" (my_mixers.NOT_A_CLASS is 3{module}",
        ordered: f" ({ordered} is <class '{ordered}'>{module}",  # not a module's class
        ".my_mixers.Mean": f" ({relative} '.my_mixers')",
    }
    for bad, why in cases.items():
        says = f"unknown mixer {bad!r}{why}; choose one of: {choices}"
        refused(says, find_mixer, bad)


# ---- generation (Eq. 2) and sampling
def generated(model, idx, n, **kw):
    """The prompt and the n tokens model.generate yields, as nanoGPT's generate."""
    return torch.cat([idx, *model.generate(idx, n, **kw)], dim=1)


def scrambled_model(name, l=16):
    return dev(scrambled(tiny_model(name, l=l), 0.3))


@pytest.mark.parametrize("name", ALL)
def test_cached_generation_equals_uncached(name, monkeypatch):
    model = scrambled_model(name, l=12)
    idx = torch.randint(0, 50, (2, 5), device=DEVICE)
    cached = generated(model, idx, 7, temperature=0, use_cache=True)  # fills l = 12
    assert torch.equal(cached, generated(model, idx, 7, temperature=0, use_cache=False))
    # a token, chunks of 4 and 2, then one token at a time: one full forward
    cache = model.new_cache()
    steps = [model(cached[:, i:j], cache=cache)[0] for i, j in ((0, 1), (1, 5), (5, 7))]
    full = model(cached)[0]
    # one new token: one row of Eq. (23) or (29), O(t d)
    monkeypatch.setattr(extractor, "fir_full", None)
    steps += [model(cached[:, i : i + 1], cache=cache)[0] for i in range(7, 12)]
    assert cache["t"] == 12
    assert_close(torch.cat(steps, 1), full, "cached rows")


@pytest.mark.parametrize("name", ALL)
def test_generation_beyond_block_size_is_a_sliding_window_of_l_tokens(name):
    model = scrambled_model(name, l=8)
    prompt = torch.randint(0, 50, (2, 5), device=DEVICE)
    idx = prompt
    for _ in range(10):  # the plain sliding-window loop
        greedy = model(idx[:, -8:])[0][:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, greedy], dim=1)
    assert torch.equal(generated(model, prompt, 10, temperature=0), idx)
    for use_cache in (True, False):  # a prompt longer than l: its last l tokens
        got = generated(model, idx[:, :12], 3, temperature=0, use_cache=use_cache)
        assert torch.equal(got, idx[:, :15])


def sampled_from(monkeypatch, logits, **kw):
    """What sample_next hands torch.multinomial (the probabilities), and its token."""
    spy = mock.Mock(wraps=torch.multinomial)  # each call recorded
    monkeypatch.setattr(torch, "multinomial", spy)
    token = extractor.sample_next(torch.tensor(logits, dtype=torch.float64), **kw)
    monkeypatch.undo()
    assert token.shape == (len(logits), 1)
    if not spy.called:
        return None, token
    p = spy.call_args_list[0].args[0]
    assert p[0, token[0, 0]] > 0
    return p.double(), token


def test_temperature_top_k_and_top_p_draw_from_exactly_these_probabilities(monkeypatch):
    def near(logits, want, **kw):
        p, _ = sampled_from(monkeypatch, logits, **kw)
        want = torch.tensor(want, dtype=torch.float64)
        want = want / want.sum(-1, keepdim=True)
        assert torch.allclose(p, want, atol=1e-6, rtol=0), (kw, p)

    e = math.exp
    logits = [[2.0, 1.0, 0.0, -1.0]]
    near(logits, [[e(2), e(1), 1, e(-1)]])  # softmax
    near(logits, [[e(4), e(2), 1, e(-2)]], temperature=0.5)  # softmax(logits / T)
    two_rows = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]]
    want = [[e(1), e(0.5), 0, 0], [0, e(1.5), 0, e(1)]]  # the 2 largest
    near(two_rows, want, temperature=2, top_k=2)
    near(two_rows, [[1, 0, 0, 0], [0, 1, 0, 0]], top_k=1)  # the largest alone
    near(logits, [[e(2), e(1), 1, e(-1)]], top_k=9)  # k beyond u: every token
    probs = [[0.5, 0.2, 0.15, 0.1, 0.05]]
    logp = torch.tensor(probs).log().tolist()
    # 0.5 < 0.6 needs the second token, 0.7 reaches it
    near(logp, [[0.5, 0.2, 0, 0, 0]], top_p=0.6)
    near(logp, [[0.5, 0, 0, 0, 0]], top_p=0.45)
    near(logp, [[0.5, 0.2, 0.15, 0, 0]], top_p=0.75)
    near(logp, probs, top_p=1.0)
    near(logp, [[0.25, 0.04, 0, 0, 0]], top_p=0.8, temperature=0.5)  # p² / 0.335
    near(logp, [[0.5, 0.2, 0, 0, 0]], top_p=0.7, top_k=3)  # 0.5 / 0.85, then 0.82
    # a tie at the boundary
    p, _ = sampled_from(monkeypatch, [[3.0, 2.0, 2.0, 2.0, 0.0]], top_k=2)
    assert (p > 0).sum() == 2 and abs(p[0, 0] - e(3) / (e(3) + e(2))) < 1e-6
    # 0.25 each: 0.5 is reached by two
    p, _ = sampled_from(monkeypatch, [[1.0, 1.0, 1.0, 1.0]], top_p=0.5)
    assert sorted(p[0].tolist()) == [0, 0, 0.5, 0.5]
    two_rows = [[0.0, 1.0, 2.0, -2.0], [7.0, 1.0, 5.0, -2.0]]
    for T in (0, 1e-38):  # greedy, and a tiny temperature stays finite
        p, token = sampled_from(monkeypatch, two_rows, temperature=T)
        assert token.tolist() == [[2], [0]] and (T == 0) == (p is None)
        assert T == 0 or p.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_generate_refuses_bad_settings_and_samples():
    model = scrambled_model("sa")
    prompt = torch.tensor([[1, 2, 3]], device=DEVICE)
    top_p = "top_p must be in (0, 1], got "
    temperature = "temperature must be a finite number >= 0 (0 is greedy), got "
    cases = [({"top_k": 0}, "top_k must be at least 1, got 0")]
    cases += [({"top_p": 0}, top_p + "0"), ({"top_p": 1.01}, top_p + "1.01")]
    for T, shown in ((-1e-9, "-1e-09"), (math.nan, "nan"), (math.inf, "inf")):
        cases.append(({"temperature": T}, temperature + shown))
    for kw, says in cases:  # before any token
        refused(says, generated, model, prompt, 0, **kw)
    for bad in (prompt[:, :0], prompt[0]):
        shape = tuple(bad.shape)
        says = f"idx must be (B, t) token ids with t >= 1 (a prompt), got {shape}"
        refused(says, generated, model, bad, 4)
    assert generated(model, prompt, 0).tolist() == prompt.tolist()
    torch.manual_seed(3)
    # nearly uniform over 50
    sampled = generated(model, prompt.expand(64, 3), 1, temperature=100.0)[:, -1]
    assert len(set(sampled.tolist())) > 20


# ---- the Synthesizers: Fixed Random, and the mixed precision of training
def test_synth_fixed_random_is_a_random_alignment_not_trained_but_saved():
    """N(0, 1) logits: rows far from the running mean Random starts as (N(0, 0.01²))."""
    torch.manual_seed(0)
    l = 128
    # a running mean's mean row entropy
    uniform = sum(math.log(i + 1) for i in range(8, l)) / (l - 8)
    bands = {"random-fixed": (0, uniform - 0.4), "random": (uniform - 0.01, uniform)}
    for name, (low, high) in bands.items():
        mixer = find_mixer(name)(Config(n_embd=64, block_size=l, n_head=4, mixer=name))
        P = synthesizer._syn_softmax(mixer.logits(0, l), 0)  # (n, l, l)
        entropy = -(P * P.clamp_min(1e-30).log()).sum(-1)[:, 8:].mean()
        assert low < entropy < high, name
    model = tiny_model("random-fixed", l=8, d=16, vocab=40)
    assert not any("R" in name.split(".") for name, _ in model.named_parameters())
    model(torch.randint(0, 40, (4, 8)), torch.randint(0, 40, (4, 8)))[1].backward()
    mixer = model.layers[0].mixer
    R0 = mixer.R.clone()
    assert not mixer.R.requires_grad and mixer.R.grad is None
    assert mixer.W_V.weight.grad.abs().max() > 0
    other = tiny_model("random-fixed", l=8, d=16, vocab=40, seed=1)
    assert not torch.equal(other.layers[0].mixer.R, R0)  # R is drawn from the seed
    other.load_state_dict(model.state_dict())  # what a checkpoint holds
    assert torch.equal(other.layers[0].mixer.R, R0)


@pytest.mark.parametrize("name", ALL)
def test_training_under_bfloat16_autocast(name):
    """train.py's --dtype bfloat16: float32 weights meet bf16 activations, the loss (Eq.
    3) is float32, every parameter gets a gradient, the loss stays near float32's."""
    model = dev(scrambled(tiny_model(name, l=8), 0.2)).float()
    idx = torch.randint(0, 50, (2, 8), device=DEVICE)
    loss32 = model(idx, idx)[1]
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert abs(loss - loss32) < 0.05
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.abs().max() > 0 for g in grads)


# ======== the FIR's fast paths (fir.py) against the literal sum, forward and backward

# w.dim() -> l = 13 taps for d = 5: scalars, vectors, matrices
TAPS = {1: (13,), 2: (13, 5), 3: (13, 5, 5)}


def fir_and_grads(f, x, w, g, wrt=(0, 1)):
    """f(x, w), and for output gradient g the gradients of wrt's inputs (0: x, 1: w)."""
    x, w = [a.detach().requires_grad_(i in wrt) for i, a in enumerate((x, w))]
    y = f(x, w)
    return cpu64(y, *torch.autograd.grad(y, [(x, w)[i] for i in wrt], g))


def assert_all_close(got, want, what=""):
    """assert_close for each pair of got and want; a failure names the pair's index."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a, b, f"{what} [{i}]")


@pytest.mark.parametrize("dim", [1, 2, 3], ids=["scalar", "vector", "matrix"])
def test_every_path_and_the_last_row_equal_the_literal_sum_forward_and_backward(dim):
    """Each path, named (so each runs on every device), and fir_last_row against
    causal_fir_reference, itself against the literal sum: odd and even t, t < l and t =
    l (n = 2t - 1 5-smooth at t = 5, 8, 13, not 2, 12)."""
    torch.manual_seed(dim)
    for t in (1, 2, 5, 8, 12, 13):
        x, g = torch.randn(2, 3, t, 5).double()
        w = torch.randn(*TAPS[dim]).double()
        ref = fir_and_grads(extractor.causal_fir_reference, x, w, g)
        assert_all_close(fir_and_grads(literal_fir, x, w, g), ref, "literal")
        assert (ref[2][t:] == 0).all()  # the taps beyond t have no gradient
        for path in [p for p, dims in fir.PATHS.items() if dim in dims]:
            f = functools.partial(fir.fir_full, path=path)
            assert_all_close(fir_and_grads(f, dev(x), dev(w), dev(g)), ref, path)
            # float32 taps, cast to x's dtype
            assert_all_close(cpu64(f(dev(x), dev(w).float())), ref[:1], path)
            for i in (0, 1):  # the other input a constant
                got = fir_and_grads(f, dev(x), dev(w), dev(g), wrt=(i,))
                assert_all_close(got, ref[:1] + ref[1 + i : 2 + i], f"{path} {i}")
        last = fir.fir_last_row(dev(x), dev(w).float())
        assert_all_close(cpu64(last), [ref[0][:, -1]], f"last row, t = {t}")
        # the taps cast to x's dtype
        assert fir.fir_last_row(dev(x).float(), dev(w)).dtype == torch.float32


# ---- which path runs: the device's default, else a named path
def test_default_path_by_device_type_taps_and_length():
    # (w.dim(), t) -> path
    cpu = {(1, 1023): "toeplitz", (1, 1024): "fft", (2, 1): "fft", (3, 1): "fft"}
    cuda = {(1, 1): "toeplitz-strided", (1, 1023): "toeplitz-strided", (1, 1024): "fft"}
    cuda |= {(2, 1): "fft", (2, 1023): "fft", (3, 1): "fft-cuda", (3, 1024): "fft-cuda"}
    for device_type, want in (("cpu", cpu), ("mps", cpu), ("cuda", cuda)):
        got = {key: fir.default_path(device_type, *key) for key in want}
        assert got == want, device_type


def record_fir_paths(monkeypatch):
    """Each fir_full call's path, listed as it runs (spied where each path begins)."""
    taken = []
    fft_apply = fir.FIRFFT.apply

    def spy(name, f):  # f, which records its path's name as it runs
        return lambda *args: taken.append(name) or f(*args)

    def fft(x, w, cuda_layout):
        name = "fft-cuda" if cuda_layout else "fft"
        return spy(name, fft_apply)(x, w, cuda_layout)

    monkeypatch.setattr(fir, "toeplitz", spy("toeplitz", fir.toeplitz))
    strided = spy("toeplitz-strided", fir.ToeplitzStrided.apply)
    monkeypatch.setattr(fir.ToeplitzStrided, "apply", strided)
    monkeypatch.setattr(fir.FIRFFT, "apply", fft)
    return taken


def test_fir_full_takes_the_named_path_else_the_default(monkeypatch):
    default_path = fir.default_path
    asking = mock.Mock(wraps=default_path)  # each call recorded
    monkeypatch.setattr(fir, "default_path", asking)
    taken = record_fir_paths(monkeypatch)
    for dim, shape in TAPS.items():
        x, w = dev(torch.randn(2, 12, 5)), dev(torch.randn(*shape))
        default = default_path(DEVICE.type, dim, 12)
        for path in [p for p, dims in fir.PATHS.items() if dim in dims]:
            taken.clear()
            fir.fir_full(x, w)
            fir.fir_full(x, w, path=path)
            assert taken == [default, path], (dim, path)
    fir.fir_full(x, w[:, 0, 0])
    assert taken[-1] == default_path(DEVICE.type, 1, 12)
    asked = {call.args[0] for call in asking.call_args_list}
    assert asked == {DEVICE.type}  # the device type of x


def test_fir_full_refuses_wrong_paths_too_few_taps_and_no_positions():
    dims = "{'toeplitz': (1,), 'toeplitz-strided': (1, 2), 'fft': (1, 2, 3), "
    dims += "'fft-cuda': (3,)}"
    x = torch.randn(1, 4, 5)
    wrong = {"fft-cuda": (4, 5), "toeplitz": (6, 5), "toeplitz-strided": (4, 5, 5)}
    for path, shape in [*wrong.items(), ("fftw", (4,))]:
        taps = (4,) + shape[1:]
        why = f"no FIR path '{path}' for taps of shape {taps}; taps' dims: {dims}"
        refused(why, fir.fir_full, x, torch.randn(*shape), path=path)
    why = "sequence length 4 exceeds the 3 taps (block_size l)"
    refused(why, fir.fir_full, x, torch.randn(3, 5))
    why = "an FFT over 0 positions: the sequence needs at least one"
    refused(why, fir.fir_full, x[:, :0], x[0])
    refused(why, fir.fft_size, 0)


# ---- the FFT's length: n >= 2t - 1 (nothing wraps around), 5-smooth (fast FFTs)
def test_fft_size_is_the_smallest_5_smooth_n_from_2t_minus_1():
    # by hand: t = 127 gives 253 = 11 * 23, 254 = 2 * 127, 255 = 3 * 5 * 17, ...
    t = [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 14, 17, 32, 64, 127, 128, 129]
    n = [1, 3, 5, 8, 9, 12, 15, 15, 24, 25, 27, 36, 64, 128, 256, 256, 270]
    assert [fir.fft_size(k) for k in t] == n


# ---- precision: the GEMMs in IEEE float32 while TF32 is on, and under autocast
def test_ieee_float32_turns_tf32_off_for_cuda_inside_and_restores_it(monkeypatch, tf32):
    """Needs no GPU (the switch is PyTorch's global flag): off inside for a CUDA device
    while TF32 is on, and restored, also after an exception; the CPU, ALLOW_TF32 = True
    and TF32 already off leave it as it is."""
    matmul = tf32[0]
    cuda = torch.device("cuda")
    seen = []
    # (device, ALLOW_TF32, TF32 on before)
    cases = [(cuda, False, True), (torch.device("cpu"), False, True)]
    cases += [(cuda, True, True), (cuda, False, False)]
    for device, allow, on in cases:
        monkeypatch.setattr(fir, "ALLOW_TF32", allow)
        matmul.allow_tf32 = on
        with pytest.raises(KeyError), fir.ieee_float32(device):
            seen.append(matmul.allow_tf32)
            raise KeyError
        assert matmul.allow_tf32 == on
        assert matmul.fp32_precision == ("tf32" if on else "ieee")
    assert seen == [False, True, True, False]


def test_fir_under_autocast_computes_in_float32_and_returns_the_input_dtype():
    """bf16 autocast: every path but toeplitz computes in float32, so the one rounding
    is the output's to bf16 (2^-8 of it at most) and float32's; bf16 taps exceed it
    30-390x. toeplitz follows autocast: its reference takes the taps rounded to bf16."""
    torch.manual_seed(2)
    for dim, path in [(dim, path) for path, dims in fir.PATHS.items() for dim in dims]:
        x, w = torch.randn(2, 13, 5), torch.randn(*TAPS[dim])
        taps = w.bfloat16() if path == "toeplitz" else w
        # the inputs rounded only
        ref = extractor.causal_fir_reference(x.bfloat16().double(), taps.double())
        with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
            y = fir.fir_full(x.bfloat16().to(DEVICE), w.to(DEVICE), path=path)
        err = (y.cpu().double() - ref).abs()
        bound = 2**-8 * ref.abs() + 1e-5
        assert y.dtype == torch.bfloat16 and (err <= bound).all(), path


# max |error| / max |reference| of fir_full in float32, forward and both gradients:
# float32 reaches 0.9-3.7e-7 (the CPU, every path, d = 32, t = 64, three seeds), the
# GEMMs' inputs rounded to TF32's 10-bit mantissa 2.1-4.1e-4 (TF32's unit roundoff is
# 2^-11 = 4.9e-4); 1e-5 lies 25x above the one and 20x below the other
FIR_FLOAT32_BOUND = 1e-5


def fir_float32_errors(name, path=None, d=32, l=64):
    """fir_full in float32 on the test device (path: the device's default unless named)
    for mixer name's taps as the paper initialises them: max |error| / max |reference|
    of y, dx and dw (reference: float64, CPU)."""
    torch.manual_seed(7)
    m = extractor.MIXERS[name](Config(n_embd=d, block_size=l, mixer=name))
    w = (m.W_ext if name == "she" else m.w_ext).detach()
    x, g = torch.randn(2, 4, l, d)
    ref = fir_and_grads(literal_fir, x.double(), w.double(), g.double())
    f = functools.partial(fir.fir_full, path=path)
    got = fir_and_grads(f, x.to(DEVICE), w.to(DEVICE), g.to(DEVICE))
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("name", ["she", "he", "we", "me", "he-ext"])
def test_fir_in_float32_with_tf32_matmuls_on_keeps_float32_accuracy(name, tf32):
    """With TF32 on for CUDA's float32 matmuls (train.py's setting) each Extractor's FIR
    on its default path keeps float32's accuracy, forward and backward (with
    fir.ALLOW_TF32 = True, expected to fail for SHE)."""
    tf32[0].allow_tf32 = True
    errors = fir_float32_errors(name)
    assert max(errors) < FIR_FLOAT32_BOUND, f"y, dx, dw: {errors}"


def tf32_rounded(a):
    """float32 (or complex64's parts) rounded to nearest at TF32's 10 mantissa bits."""
    if a.is_complex():
        a = a.resolve_conj()
        return torch.complex(tf32_rounded(a.real), tf32_rounded(a.imag))
    bits = a.contiguous().view(torch.int32)
    # 23 - 10 = 13 low bits dropped, half of the last kept one added first
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


# the paths that multiply in bmm, each with an Extractor whose taps it takes
FIR_GEMMS = [
    ("she", "fft"),
    ("she", "fft-cuda"),
    ("we", "toeplitz-strided"),
    ("me", "toeplitz-strided"),
]


@pytest.mark.parametrize("name,path", FIR_GEMMS)
def test_fir_gemms_run_in_ieee_float32_while_tf32_is_on(name, path, monkeypatch, tf32):
    """TF32 emulated on the CPU: while allow_tf32 is on, bmm rounds its inputs to a
    10-bit mantissa (as cuBLAS feeds tensor cores), ieee_float32 takes the CPU for CUDA.
    y, dx and dw's GEMMs run in IEEE; with ALLOW_TF32 = True each exceeds the bound
    (20x or more). fft-cuda gives cuBLAS conjugate transposes as views; fft resolves."""
    matmul = tf32[0]
    bmm = torch.bmm
    ieee = fir.ieee_float32
    conj = []

    def tf32_bmm(a, b):
        if not matmul.allow_tf32:
            return bmm(a, b)
        conj.append(a.is_conj() or b.is_conj())
        return bmm(tf32_rounded(a), tf32_rounded(b))

    def ieee_as_if_cuda(device):
        return ieee(torch.device(device.type.replace("cpu", "cuda")))

    monkeypatch.setattr(torch, "bmm", tf32_bmm)
    monkeypatch.setattr(fir, "ieee_float32", ieee_as_if_cuda)
    matmul.allow_tf32 = True
    errors = fir_float32_errors(name, path)
    assert max(errors) < FIR_FLOAT32_BOUND, f"y, dx, dw: {errors}"
    monkeypatch.setattr(fir, "ALLOW_TF32", True)
    errors = fir_float32_errors(name, path)
    assert min(errors) > FIR_FLOAT32_BOUND, f"y, dx, dw: {errors}"
    assert conj == [False] + [path == "fft-cuda"] * 2


# ======== complexity (Section 7, Tables 3-7): bench.py's closed forms and the paper


def per_token_counts(d, t, n):
    """Tables 5-6 for one new token at t (h = d/n), with Notes 5's SA t - 1, SHE d*d."""
    h = d // n
    sa_mult = (3 * d * h + t * h + t * h) * n + d * d
    sa_add = (3 * (d - 1) * h + t * (h - 1) + (t - 1) * h + (t - 1)) * n + (d - 1) * d
    she_mult = d * d * t + d * d + d + d * d
    she_add = (d - 1) * d * t + (t - 1) * d + (d - 1) * d + (d - 1) * d
    he_mult = d * t + d * d + d * d + d + d * d
    he_add = (t - 1) * d + (d - 1) * d + (d - 1) * d + (d - 1) * d
    we_mult = d * t + d * d + d + d * d
    we_add = (t - 1) * d + (d - 1) * d + (d - 1) * d
    return {
        "sa": dict(mult=sa_mult, div=(t + t) * n, exp=t * n, add=sa_add),
        "she": dict(div=0, exp=0, mult=she_mult, add=she_add),
        "he": dict(div=0, exp=0, mult=he_mult, add=he_add),
        "we": dict(div=0, exp=0, mult=we_mult, add=we_add),
        "me": dict(div=0, exp=0, mult=d * t, add=(t - 1) * d),
    }


OPS = ("mult", "add", "div", "exp", "params", "total")  # Table 7's rows


@pytest.mark.parametrize(
    "d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (12, 9, 3), (30, 7, 5)]
)
def test_tables_5_6_closed_forms_are_their_sums_and_add_up_to_tables_3_4(d, l, n):
    for t in range(1, l + 1):
        assert bench.complexity_inference(d, t, n) == per_token_counts(d, t, n), t
        misprint = 2 * t * d - t * n + t + 4 * d * d - 5 * d - 1  # Table 5's SA adds
        assert per_token_counts(d, t, n)["sa"]["add"] - misprint == (n - 1) * (t - 1)
    params = dict(sa=3 * d * (d // n) * n + d * d, she=d * d * l + d * d + d * d)
    params |= dict(we=d * l + d * d + d * d, he=d * l + d * d + d * d + d * d, me=l)
    # Tables 3 and 4: the sums over t
    for mixer, counts in bench.complexity_training(d, l, n).items():
        per_token = [per_token_counts(d, t, n)[mixer] for t in range(1, l + 1)]
        summed = {k: sum(c[k] for c in per_token) for k in OPS[:4]}
        assert counts == dict(summed, params=params[mixer]), mixer


TABLE7 = {  # the paper's Table 7 (d = l = 128): mult, add, div, exp, params, total
    "1-head SA": (10502144, 10420096, 16512, 8256, 65536, 20947008),
    "32-head SA": (10502144, 10416128, 528384, 264192, 65536, 21710848),
    "SHE": (139476992, 139411456, 0, 0, 2129920, 278888448),
    "HE": (7364608, 7282688, 0, 0, 65536, 14647296),
    "WE": (5267456, 5201920, 0, 0, 49152, 10469376),
    "ME": (1056768, 1040384, 0, 0, 128, 2097152),
}


def test_table7_from_the_closed_forms_and_the_modules(capsys):
    table = bench.table7(128, 128)
    assert {label: tuple(c[k] for k in OPS) for label, c in table.items()} == TABLE7
    bench.main(["--table7"])
    out = capsys.readouterr().out.split("\n\n")
    assert out[0].splitlines()[2].split() == "1-head SA 32-head SA SHE HE WE ME".split()

    def parse(lines):
        rows = [line.split() for line in lines]
        return {row[0]: [int(v.replace(",", "")) for v in row[1:]] for row in rows}

    rows = parse(out[0].splitlines()[3:])
    d = l = 128
    # the modules' parameters: Table 7's params column
    for key, i in zip(OPS + ("modules",), (0, 1, 2, 3, 4, 5, 4)):
        assert rows[key] == [numbers[i] for numbers in TABLE7.values()], key
    # FLOPs: SA's four d x d maps, QK^T and AV over all t x t (SDPA's way); ME's T x
    sa_flops = 8 * l * d * d + 4 * l * l * d
    assert [rows["flops"][i] for i in (0, 1, 5)] == [sa_flops, sa_flops, 2 * l * l * d]
    # Tables 5-6 at t = l = d = 128: SA 2td + 4d^2 - 5d - n, SHE td^2 + 2d^2 - 3d, ...
    adds = [97663, 97632, 2129536, 65024, 48768, 16256]
    assert parse(out[1].splitlines()[1:])["add"] == adds


# ======== tools: the benchmark (bench.py): each section quick, each row's arithmetic
def test_bench_quick_prints_rows_and_their_arithmetic(tmp_path, monkeypatch, capsys):
    """A row per mixer (CUDA: per path, per step variant), a mixer's model at a time; a
    variant that cannot run (the captured step without CUDA) is a row saying why."""
    alive, new_model = [], bench.new_model

    def tracked(*a):  # no mixer's model outlives its rows
        assert not any(ref() for ref in alive), "a mixer outlived its rows"
        alive.append(weakref.ref((made := new_model(*a))[0]))
        return made

    monkeypatch.setattr(bench, "new_model", tracked)
    out = tmp_path / "b.json"
    argv = ["--quick", "--floor", "--mixers", "me,he", "--device", str(DEVICE)]
    bench.main(argv + ["--json", str(out)])
    args, cpu = bench.parse_args(argv), torch.device("cpu")
    variants = ["eager", "captured"]
    rows = bench.mixer_steps("me", args.sizes, args, cpu, variants, [], {}, 1)
    assert "CUDA" in rows[0]["failed"] and rows[1]["step_ms"] > 0, rows
    fake = lambda *a: (0, 0, 2**30 * a[3], 9 * 2**30)  # peak b GiB, CUDA's reserve 9
    monkeypatch.setattr(bench, "memory_at_batch", fake)  # fits: judged by the reserve
    memory = bench.section_memory(args.sizes, args, cpu)
    assert [(r["reserved_mib"], r["fits"]) for r in memory] == [(9216, "no")] * 3
    blocks = capsys.readouterr().out.split("\n\n")[1:4]
    res = json.loads(out.read_text())["sections"]
    formats = (("vs_sa", ".3f"), ("vs_floor", ".1f"), ("fits", ""))
    for block, name, (key, spec) in zip(blocks, res, formats):
        # title, columns, ----, the rows, "name: ..." notes
        rows = [ln.split() for ln in block.splitlines()]
        mixers = [r["mixer"] for r in res[name]]
        assert [row[0] for row in rows[3:] if not row[0].endswith(":")] == mixers
        printed = [row[rows[1].index(key)] for row in rows[3 : 3 + len(res[name])]]
        assert printed == [format(r[key], spec) for r in res[name]], name
        assert list(dict.fromkeys(mixers)) == ["sa", "me", "he"], name
    close = lambda got, want: math.isclose(got, want, rel_tol=1e-12)
    sa_ms = {r["threads"]: r["ms"] for r in res["sublayer"] if r["mixer"] == "sa"}
    sa_step = {r["variant"]: r["step_ms"] for r in res["step"] if r["mixer"] == "sa"}
    for r in res["sublayer"]:  # over sa's on the same threads
        assert close(r["vs_sa"], r["ms"] / sa_ms[r["threads"]]), r
    for r in res["step"]:  # --quick's batch of 4 x 32 = 128 tokens
        ms, sa = r["step_ms"], sa_step[r["variant"]]
        assert r["floor_ms"] == max(r["flop_ms"], r["byte_ms"]), r
        assert close(r["vs_sa"], ms / sa) and close(r["vs_floor"], ms / r["floor_ms"])
        assert close(r["tokens_per_s"], 128e3 / ms)
        assert close(r["paper_hours"], 60 * ms / 3600)
        assert close(r["flop_ms"], 1e3 * r["flops"] / r["flop_rate"])
        assert close(r["byte_ms"], 1e3 * r["bytes"] / r["byte_rate"])
    params = {r["mixer"]: r["params"] for r in res["step"]}
    for r in res["memory"]:  # float32 parameters and AdamW's two moments, as large each
        assert close(r["state_mib"], 12 * params[r["mixer"]] / 2**20), r
        assert r["saved_mib"] > 0, r
        if "peak_mib" in r:  # Linux; --quick: batches 4 and 2
            per_seq = (r["peak_mib"] - r["peak_half_mib"]) / (4 - 2)
            assert close(r["per_seq_mib"], per_seq) and r["fits"] == "yes", r
            if per_seq <= 0:  # (the heap's pages kept from batch 4: no line to draw)
                assert "max_batch" not in r, r
                continue
            most = 4 + math.floor((5 * 1024 - r["peak_mib"]) / per_seq)  # 6 GiB less 1
            assert r["max_batch"] == most, r
    bad = (["--mixers", "nope"], ["--sections", "x"], ["--n_head", "5"])
    for argv in bad + (["--gpu_gib", "1"], ["--x"]):  # one line, exit status 1
        error_line(capsys, bench.main, argv + ["--quick"])


def test_bench_counts_a_known_steps_flops_bytes_and_peak():
    lin = torch.nn.Linear(8, 8, bias=False)  # 256 bytes
    x = torch.randn(6, 8, requires_grad=True)  # 192 bytes
    opt = torch.optim.AdamW(lin.parameters())

    # forward (6, 8) @ (8, 8) and (8, 6) @ (6, 8); backward two products for each
    def step():
        # saves x (for the weight's gradient), the weight (a parameter: no activation)
        h = lin(x)
        # saves h and its view h.t(): one storage, 192 bytes
        (h.t() @ h).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's moments: 2 x 256 bytes
    flops, fir_flops, moved = bench.step_counts(lin, opt, step, logits=1000)
    assert (flops, fir_flops) == (3 * (2 * 6 * 8 * 8) + 3 * (2 * 8 * 6 * 8), 0)
    # parameters, gradients, moments, saved, logits
    assert moved == 2 * (256 + 256 + 512 + 192 + 192 + 1000)
    if os.path.exists("/proc/self/clear_refs"):  # Linux: this step's high-water mark
        torch.ones(2**26).sum()  # 256 MiB, freed
        grow = lambda: torch.ones(2**24).add_(1)  # 64 MiB
        peak = bench.peak_bytes(grow, torch.device("cpu"))
        # (freed heap it reused: under 1 MiB)
        assert 2**26 - 2**20 <= peak < 2**26 + 2**24, peak


def test_bench_prices_the_fir_gemms_at_the_ieee_float32_rate():
    """SHE's FIR on the CPU's fft path: 3 complex GEMMs (F, B, d) x (F, d, d) a layer
    (y, dx, dw), 8 real FLOPs a multiply-add, at the IEEE float32 rate; the rest not."""
    args = bench.parse_args(["--quick", "--mixers", "she"])
    s, cpu = args.sizes, torch.device("cpu")
    rates = dict(float32=1e12, ieee=1e11, copy=1e12)
    row = bench.mixer_steps("she", s, args, cpu, ["eager"], ["float32"], rates, 1)[0]
    F = fir.fft_size(s["l"]) // 2 + 1
    assert row["fir_flops"] == s["n_layer"] * 3 * 8 * F * s["batch"] * s["d"] ** 2
    rest = row["flops"] - row["fir_flops"]
    assert math.isclose(row["flop_ms"], 1e3 * (rest / 1e12 + row["fir_flops"] / 1e11))
    assert set(bench.measure_rates(cpu, ["float32"], s)) == {"float32", "ieee", "copy"}


def test_bench_cuda_captured_memory_capture_failed(monkeypatch, capsys, tmp_path):
    """CUDA stubbed. The memory section's step is train.py's, captured: its calls reach
    the recording. A capture CUDA fails (a SystemExit: its line said) ends the step
    section with the rows so far; the rest is not run, the JSON written, exit 1."""
    made, calls, new_model = [], [], bench.new_model
    model, cuda = torch.nn.Linear(4, 4), torch.device("cuda")
    step = lambda: calls.append(1) or model(torch.ones(2, 4)).sum().backward()
    make_step = lambda dtype, captured, how: made.append((captured, how)) or step
    fake = lambda *a: (model, mock.Mock(state={}), make_step)  # (AdamW: no state)
    monkeypatch.setattr(bench, "new_model", fake)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    args = bench.parse_args(["--quick", "--mixers", "me,he,we"])
    bench.memory_at_batch(args.sizes, args, "me", 4, cuda)
    assert made == [(True, {})] and len(calls) == 4  # saved's, 2 warm-ups, recording
    monkeypatch.undo()

    def he_fails(s, args, m, *rest):  # he's step: CUDA fails its capture
        model, opt, make_step = new_model(s, args, m, *rest)
        fails = lambda *a: machinery.fail(f"{machinery.NO_GRAPH} (CUDA: no)")
        return model, opt, fails if m == "he" else make_step

    monkeypatch.setattr(bench, "new_model", he_fails)
    out = tmp_path / "b.json"
    argv = ["--quick", "--sections=step,memory", "--mixers=me,he,we", f"--json={out}"]
    assert bench.main(argv) == 1
    rows = json.loads(out.read_text())["sections"]
    failed = [(r["mixer"], r.get("failed")) for r in rows.pop("step")]
    assert failed == [("sa", None), ("me", None), ("he", "CUDA failed he's capture")]
    assert rows == {}  # the memory section not run, as said
    assert "[memory] not run: CUDA failed he's capture" in capsys.readouterr().err


def test_bench_sublayer_times_every_fir_path_on_cuda_each_forced(monkeypatch, capsys):
    cuda = torch.device("cuda")
    module = lambda m: bench.sublayer(Config(n_embd=8, n_head=2, mixer=m))
    mixers = ("sa", "me", "we", "she")
    paths = {m: bench.sublayer_paths(module(m), 16, cuda) for m in mixers}
    for m, dim in (("me", 1), ("we", 2), ("she", 3)):  # the default, then every path
        want = sorted(p for p, dims in fir.PATHS.items() if dim in dims)
        assert paths[m][0] == fir.default_path("cuda", dim, 16), m
        assert sorted(paths[m]) == want, m
        cpu_paths = bench.sublayer_paths(module(m), 16, torch.device("cpu"))
        assert cpu_paths == [fir.default_path("cpu", dim, 16)]
    assert paths["sa"] == ["sdpa"] and len(paths["me"]) == 3 and len(paths["she"]) == 2
    sublayer_paths, interleaved = bench.sublayer_paths, bench.interleaved
    taken = record_fir_paths(monkeypatch)
    ran = []  # (a timed step's key, the paths its FIRs took) per call

    def watch(key, fn):  # fn, recording the paths its FIRs take
        taken.clear()
        fn()
        ran.append((key, tuple(taken)))

    def watched(fns, *args, **kw):
        watching = {k: functools.partial(watch, k, fn) for k, fn in fns.items()}
        return interleaved(watching, *args, **kw)

    on_cuda = lambda mod, t, _: sublayer_paths(mod, t, cuda)  # the CUDA paths, run here
    monkeypatch.setattr(bench, "sublayer_paths", on_cuda)
    monkeypatch.setattr(bench, "interleaved", watched)
    argv = ["--quick", "--sections", "sublayer", "--mixers", "me,she"]
    bench.main(argv + ["--device", str(DEVICE)])
    # the table: title, columns, ----, rows (mixer threads l batch path ...), notes
    out = capsys.readouterr().out.split("\n\n")[1]
    rows = [ln.split()[:5] for ln in out.splitlines()[3:] if ln[0] != " "]
    rows = [[mixer, path] for mixer, *_, path in rows]
    runs = len({1, torch.get_num_threads()}) if DEVICE.type == "cpu" else 1
    assert rows == [[m, p] for m in ("sa", "me", "she") for p in paths[m]] * runs
    # each row's step, 2 warm-up rounds and 2 timed, its one FIR on the row's path
    fir_of = lambda m, p: () if m == "sa" else (p,)
    want = [((m, p), fir_of(m, p)) for m, p in rows for _ in range(2 + 2)]
    assert sorted(ran) == sorted(want)


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_bench_length_generate_rows_hold_the_counts_and_arithmetic(tmp_path, capsys):
    threads = torch.get_num_threads()
    argv = ["--quick", "--sections", "length,generate", "--mixers", "me,she,he,we"]
    bench.main(argv + ["--csv", str(tmp_path), "--device", str(DEVICE)])
    assert torch.get_num_threads() == threads  # (restored after the 1-thread rounds)
    kind = DEVICE.type
    length = _read_csv(tmp_path / f"length_{kind}.csv")
    generate = _read_csv(tmp_path / f"generate_{kind}.csv")
    mixers, d, n = ["sa", "me", "she", "he", "we"], 32, 32  # --quick: d = 32, 32 heads
    counts = {1, threads} if kind == "cpu" else {threads}
    ops = lambda c: c["mult"] + c["add"] + c["div"] + c["exp"]
    for rows, x in ((length, "l"), (generate, "t")):
        # a row per thread count, length and mixer, in this order, each timed
        keys = [(int(r["threads"]), int(r[x]), r["mixer"]) for r in rows]
        want = [(k, l, m) for k in sorted(counts) for l in (8, 16, 32) for m in mixers]
        assert keys == want  # --quick's lengths
        assert all(float(r["ms"]) > 0 and not r.get("stop") for r in rows)
        sa = {(r["threads"], r[x]): float(r["ms"]) for r in rows if r["mixer"] == "sa"}
        for r in rows:
            ratio = float(r["ms"]) / sa[r["threads"], r[x]]
            assert math.isclose(float(r["vs_sa"]), ratio, rel_tol=1e-12), r
            per_token = float(r["ms"]) / int(r["tokens" if x == "l" else "batch"])
            assert math.isclose(float(r["ms_per_token"]), per_token, rel_tol=1e-12), r
    for r in length:  # b l = 64 tokens; Tables 3-4: Tables 5-6 summed over t
        l, b, m = int(r["l"]), int(r["batch"]), r["mixer"]
        assert b * l == int(r["tokens"]) == 64, r
        summed = sum(ops(per_token_counts(d, t, n)[m]) for t in range(1, l + 1))
        assert int(r["paper_ops_fwd"]) == b * summed, r
        assert float(r["peak_mib"]) >= 0, r
    for r in generate:  # batch 4, one token at t
        t, m = int(r["t"]), r["mixer"]
        assert int(r["paper_ops_fwd"]) == 4 * ops(per_token_counts(d, t, n)[m]), r
    # the FLOPs of what runs: sa's four d x d maps (backward twice the forward's) and
    # SDPA's two t x t GEMMs, five in its backward; ME's Toeplitz GEMM, two in backward
    flops = {(r["mixer"], int(r["l"])): int(r["flops"]) for r in length}
    for l, b in ((8, 8), (16, 4), (32, 2)):
        assert flops["sa", l] == 24 * b * l * d * d + 14 * b * l * l * d, l
        assert flops["me", l] == 6 * b * l * l * d, l
    flops = {(r["mixer"], int(r["t"])): int(r["flops"]) for r in generate}
    for t in (8, 16, 32):  # one token: sa's maps, q k^T and a v over t; ME's row of t
        assert flops["sa", t] == 8 * 4 * d * d + 4 * 4 * t * d, t
        assert flops["me", t] == 2 * 4 * t * d, t
    # the tables: a row per CSV row, in its order
    blocks = capsys.readouterr().out.split("\n\n")[1:3]
    for block, rows in zip(blocks, (length, generate)):
        printed = [ln.split()[:2] for ln in block.splitlines()[3:] if ln[0] != " "]
        assert printed == [[r["mixer"], r["threads"]] for r in rows]
    said = error_line(capsys, bench.main, argv + ["--csv", str(tmp_path / "none")])
    assert "--csv takes a folder" in said


@pytest.mark.parametrize("mixer", ["sa", "we"])
def test_bench_one_token_is_the_next_position_and_leaves_the_cache(mixer):
    module = bench.sublayer(Config(n_embd=8, n_head=2, block_size=6, mixer=mixer))
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    cache = {}
    with torch.no_grad():
        module(x[:, :5], cache)
        want = module(x)[:, 5:]  # the sixth position, uncached
        kept = {k: v.clone() for k, v in cache.items()}
        for _ in range(2):  # the same token after the same five, each time
            torch.testing.assert_close(bench.one_token(module, x[:, 5:], cache), want)
    assert cache.keys() == kept.keys()
    assert all(torch.equal(cache[k], kept[k]) for k in kept)


def test_bench_length_stops_a_mixer_out_of_memory_and_goes_on(tmp_path, monkeypatch):
    peak_bytes = bench.peak_bytes

    def peak(step, device):  # ME: out of memory at l = 16
        module = step.args[0]
        if isinstance(module, extractor.ME) and module.w_ext.shape[0] == 16:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return peak_bytes(step, device)

    monkeypatch.setattr(bench, "peak_bytes", peak)
    argv = ["--quick", "--sections", "length", "--mixers", "me,we"]
    bench.main(argv + ["--csv", str(tmp_path), "--device", "cpu"])
    rows = _read_csv(tmp_path / "length_cpu.csv")
    got = [(r["mixer"], r["l"], bool(r["ms"]), r["stop"]) for r in rows]
    want = [("sa", "8", True, ""), ("me", "8", True, ""), ("we", "8", True, "")]
    want += [("sa", "16", True, ""), ("me", "16", False, "out of memory")]
    want += [("we", "16", True, ""), ("sa", "32", True, ""), ("we", "32", True, "")]
    # on one thread, then on the default threads (where they are more)
    assert got == want * len({1, torch.get_num_threads()})


def test_bench_draw_scales_counts_marks_vs_sa_crossing_1(tmp_path, capsys, monkeypatch):
    path = tmp_path / "length.csv"
    path.write_text(  # he: 0.5 of sa's time at l = 64, twice it at 128
        "mixer,threads,l,ms_per_token,vs_sa,paper_ops_fwd,flops,stop\n"
        "sa,1,64,1.0,1.0,7,9,\nhe,1,64,0.5,0.5,100,10,\nme,1,64,0.1,0.1,1,,\n"
        "sa,1,128,4.0,1.0,21,36,\nhe,1,128,8.0,2.0,400,80,\nme,1,128,0.2,0.1,2,,\n"
        "me,1,256,,,,,out of memory\n"
    )
    drawn, save = [], plot.save

    def keep(fig, out, title):
        lines = fig.axes[0].lines
        drawn.append([(ln.get_linestyle(), ln.get_xydata().tolist()) for ln in lines])
        save(fig, out, title)

    monkeypatch.setattr(plot, "save", keep)
    bench.main(["--draw", str(path)])
    assert capsys.readouterr().out == (
        "he, threads 1: vs_sa crosses 1 at l = 91\n"
        "me, threads 1: vs_sa crosses 1 at l = none in range\n"
    )
    assert (tmp_path / "length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # measured, then the tables' counts (dashed) and the FLOPs (dotted), each scaled
    # to the first point, then its crossings; ME has no FLOPs column, no dotted line
    cross = 64 * 2**0.5  # log 0.5 to log 2: halfway, in log l too
    assert drawn[0] == [
        ("-", [[64, 1.0], [128, 4.0]]),
        ("--", [[64, 1.0], [128, 3.0]]),
        (":", [[64, 1.0], [128, 4.0]]),
        ("-", [[64, 0.5], [128, 8.0]]),
        ("--", [[64, 0.5], [128, 2.0]]),
        (":", [[64, 0.5], [128, 4.0]]),
        ("None", [[pytest.approx(cross), pytest.approx(2.0)]]),  # on sa's line
        ("-", [[64, 0.1], [128, 0.2]]),
        ("--", [[64, 0.1], [128, 0.2]]),
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("mixer,threads,l\nsa,1,64\n")  # no ms_per_token
    said = error_line(capsys, bench.main, ["--draw", str(bad)])
    assert "as a length or generate CSV" in said
    assert not os.path.exists(tmp_path / "bad.png")


@pytest.mark.slow
def test_bench_quick_as_users_run_it_every_mixer_and_a_closed_pipe():
    rc, out, err = run_script("experiments/bench.py", "--quick", "--mixers", "all")
    names = [*MIXERS, *SYNTHESIZERS]  # sa first, the paper's mixers, the Synthesizers
    for block in out.split("\n\n")[1:4]:
        first = [ln.split()[0] for ln in block.splitlines()[3:]]
        assert rc == 0 and first[: len(names)] == names, err
    r, w = os.pipe()
    # `bench.py --table7 | head -1`: the reader is gone before the first line
    os.close(r)
    argv = [sys.executable, "experiments/bench.py", "--table7"]
    p = subprocess.run(argv, cwd=ROOT, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    assert p.returncode == -signal.SIGPIPE, p.stderr[-300:]
    assert b"Traceback" not in p.stderr, p.stderr[-300:]


# ======== data (prepare_data.py): Gutenberg's wrappers, download, split, BPE, loaders

# A made-up book; stripping keeps its first line's indent, a chapter "END OF ...", an
# ornament of asterisks, a paragraph opening like a credit, a footer's words in a line.
BODY = """\
      THE LANTERN

CHAPTER I. END OF THE FERRY

      *       *       *       *       *

Produced by the mill, the flour crossed on "Tuesdays". The End of Project Gutenberg's
ferry was the willow bank.
"""
# What the 100 books put around their text, each form with how many use it (a survey of
# the mirror). The START marker (or the 1990s licence) and the END marker: 91, 8, 1
# books; none splits a marker over two lines.
SMALL_PRINT = (
    "***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\n"
    "A stand-in licence.\n"
    "*END THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.07.00*END*"
)
MARKERS = {
    "THIS": (
        "*** START OF THIS PROJECT GUTENBERG EBOOK {T} ***",
        "*** END OF THIS PROJECT GUTENBERG EBOOK {T} ***",
    ),
    "THE": (
        "***START OF THE PROJECT GUTENBERG EBOOK {T}***",
        "***END OF THE PROJECT GUTENBERG EBOOK {T}***",
    ),
    "small print": (SMALL_PRINT, ""),
}
CREDITS = {  # paragraphs opening the text; 63, 21, 3, 3, 1, 1 and 8 books
    "Produced by": "Produced by Jane Roe\n\n\n",
    "Produced by, 2-5 lines": "Produced by Jane Roe, Rick Poe and the Online "
    "Distributed\nProofreading Team at http://www.pgdp.net (from scans a library\n"
    "lent for the purpose.)\n\n\n\n",
    "Transcribed from": "Transcribed from the 1899 Hollow Press edition by Ann.\n\n",
    "E-text prepared, Note": "E-text prepared by Ann Example and the Project "
    "Gutenberg Online\nTeam\n\n\nNote: Project Gutenberg also has an HTML version of "
    "this\n      file, with pictures.\n\n",
    "E-text prepared": "E-text prepared by Al Example\n\n\n\n",
    "This etext": "This etext was prepared by A Scanner, typed and\nproofread by A "
    "Reader.\n\n\n\n\n",
    "none": "",
}
# the line(s) just before the END marker (no file has one after it); 57, 23, 10, 2, 8
# (of the others) and 8 books (those of "***START OF THE")
FOOTERS = {
    "the EBook of": "End of the Project Gutenberg EBook of The Lantern, by Ada\n\n",
    "Gutenberg's": "End of Project Gutenberg's The Lantern, by Ada\n\n",
    "Gutenberg\u2019s": "End of Project Gutenberg\u2019s The Lantern, by Ada\n\n",
    "The Etext of": "End of The Project Gutenberg Etext of The Lantern by Ada\n\n",
    "two lines": "End of the Project Gutenberg EBook of The Lantern, by\nAda Quill\n\n",
    "none": "",
}
# each form at least once, mixed as the books mix them
FORMS = [
    ("THIS", "Produced by", "the EBook of"),
    ("THIS", "Produced by, 2-5 lines", "Gutenberg's"),
    ("THIS", "none", "Gutenberg\u2019s"),
    ("THIS", "Produced by", "The Etext of"),
    ("THIS", "Produced by, 2-5 lines", "two lines"),
    ("THE", "E-text prepared, Note", "none"),
    ("THE", "Transcribed from", "none"),
    ("THE", "E-text prepared", "none"),
    ("THE", "none", "none"),
    ("small print", "This etext", "two lines"),
]


def gutenberg_file(markers, credits, footer, body=BODY, title="The Lantern"):
    """body with a header, credits, footer and licence of the forms above, as text."""
    start, end = (m.format(T=title.upper()) for m in MARKERS[markers])
    head = f"The Project Gutenberg EBook of {title}, by Ada Quill\n\nTitle: {title}\n\n"
    licence = "***** This file should be named 1.txt or 1.zip *****\n\nA licence.\n"
    tail = f"{end}\n\n{licence}" if end else ""
    gaps = "\n\n\n\n"
    return f"{head}{start}{gaps}{CREDITS[credits]}{body}{gaps}{FOOTERS[footer]}{tail}"


@pytest.mark.parametrize("form", FORMS, ids="-".join)  # markers, credits, footer
def test_strip_keeps_the_book_and_drops_header_credits_footer_and_licence(form):
    assert prepare_data.strip_gutenberg(gutenberg_file(*form)) == (BODY, None)


def test_strip_warns_of_a_file_cut_short_reads_bom_crlf_cp1252_alike(tmp_path, capsys):
    """None of the 100 files is cut short, has a BOM or CRLF or is not UTF-8."""
    # no END marker, no footer: all kept
    cut = gutenberg_file("THIS", "none", "none").split("*** END")[0]
    warning = "no END marker or footer: the file may be cut short"
    assert prepare_data.strip_gutenberg(cut) == (BODY, warning)
    plain = prepare_data.strip_gutenberg("\n  plain text \n\n")
    assert plain == ("  plain text\n", warning)
    body = BODY.replace('"Tuesdays"', "\u201cTuesdays\u201d")
    text = gutenberg_file("THIS", "Produced by", "Gutenberg's", body)
    bom_crlf = ("\ufeff" + text.replace("\n", "\r\n")).encode()
    path = tmp_path / "1.txt"
    # the last without markers
    for raw in (bom_crlf, text.encode("cp1252"), ("\ufeff" + body).encode()):
        path.write_bytes(raw)
        assert prepare_data.book_body((1, "The Lantern", ""), str(path), 100) == body
    path.write_bytes(b"caf\xe9 \x81" * 20)  # cp1252, with a byte it leaves undefined
    expected = "caf\xe9 \ufffd" * 20 + "\n"
    assert prepare_data.book_body((1, "", ""), str(path), 120) == expected
    said = error_line(capsys, prepare_data.book_body, (1, "", ""), str(path), 121)
    assert "has 120 characters after stripping, fewer than --min_chars 121" in said
    end = MARKERS["THIS"][1].format(T="X")
    # a line of the text that starts as a footer does: the last is the footer
    inside = BODY + "End of Project Gutenberg's ferry, the willow bank.\n"
    text = gutenberg_file("THIS", "none", "Gutenberg's", inside)
    assert prepare_data.strip_gutenberg(text) == (inside, None)
    # the text right below
    for start in (MARKERS["THIS"][0].format(T="X"), SMALL_PRINT):
        text = f"{start}\nText.\n{end}\n"
        assert prepare_data.strip_gutenberg(text) == ("Text.\n", None)
    # END is looked for after START, footers and the small print's end before END
    licence = f"End of the Project Gutenberg licence\n{SMALL_PRINT}\n"
    text = f"{end}\n" + gutenberg_file("THIS", "none", "Gutenberg's") + licence
    assert prepare_data.strip_gutenberg(text) == (BODY, None)


# ---- a run: outputs, the download's faults, retries, pauses, the raw/ cache, --source
def fake_book(seed):
    """Made-up prose: 239 lines of syllable words (some not ASCII), paragraphs of 6."""
    rng = random.Random(seed)
    syllables = "ka lo mi ren tho va quil sa ne dor bri el tü ça wy".split()
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(200)]
    lines = [" ".join(rng.choices(words, k=9)) for k in range(1, 240)]
    ends = ["." if k % 6 else ".\n" for k in range(1, 240)]
    return "\n".join(line + end for line, end in zip(lines, ends)) + "\n"


TITLES = "Mossy Dell, Brass Kite, Oddly Far, Quince Hall, Lark Rise, Tin Fern"
BOOKS = list(enumerate([*TITLES.split(", "), "N\u00fcrnberg Stove"], start=9001))
BODIES = {i: fake_book(i) for i, _ in BOOKS}
# their files
RAW = {i: gutenberg_file(*f, BODIES[i], t).encode() for f, (i, t) in zip(FORMS, BOOKS)}
VOCAB = 400
OUTPUTS = ("train.bin", "val.bin", "tokenizer.tiktoken")


def outputs(data_dir):
    return {name: (data_dir / name).read_bytes() for name in OUTPUTS}


class Handler(http.server.BaseHTTPRequestHandler):
    """server.files; faults[path], one a request: a status, html, timeout, truncate."""

    def do_GET(self):
        self.server.log.append((self.path, self.headers["User-Agent"]))
        fault = (self.server.faults.get(self.path) or [""]).pop(0)
        body = self.server.files.get(self.path)
        if fault == "html":
            body = b"<!DOCTYPE html><p>Captcha</p>"
        if fault == "timeout":
            time.sleep(1.0)
        if fault.isdigit() or body is None:
            return self.send_error(int(fault or 404))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if fault == "truncate" else body)

    log_message = lambda *args: None


@contextlib.contextmanager
def serve(raws):
    """A loopback mirror: each book ({id: bytes}) at gutenberg.org's three paths."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.log = []
    srv.faults = {}
    srv.handle_error = lambda *a: None
    paths = prepare_data.URL_PATTERNS
    srv.files = {p.format(id=i): raw for i, raw in raws.items() for p in paths}
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def prepare(data_dir, *flags, tsv, mirror="http://127.0.0.1:9", timeout=0.5):
    """prepare_data.main: a 0.5 s timeout, retries 0.01 and 0.02 s later, no pause."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("no_proxy", "127.0.0.1")  # a user's proxy must not see loopback
        for name, value in dict(TIMEOUT=timeout, RETRIES=2, BACKOFF=0.01).items():
            mp.setattr(prepare_data, name, value)
        argv = ["--data_dir", str(data_dir), "--books", tsv, "--mirror", mirror]
        argv += ["--pause", "0", "--vocab_size", str(VOCAB)]
        return prepare_data.main([*argv, *flags])


def folder(src, raws, names=("{}.txt",)):
    """raws ({id: bytes}) written into src, a --source, taking the names in turn."""
    for k, (i, raw) in enumerate(raws.items()):
        path = src / names[k % len(names)].format(i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    return str(src)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    rows = "".join(f"{r}\t{i}\t{t}\n" for r, (i, t) in enumerate(BOOKS))
    (root / "books.tsv").write_text("id\n" + rows)
    with serve(RAW) as srv:
        assert prepare(root / "data", tsv=str(root / "books.tsv"), mirror=srv.url) == 0
    return root / "data", str(root / "books.tsv")


def test_a_run_writes_books_tokens_tokenizer_alike_from_source(clean, tmp_path, capsys):
    data_dir, tsv = clean
    meta = json.loads((data_dir / "meta.json").read_text())
    enc = machinery.load_tokenizer(data_dir)
    assert (meta["vocab_size"], enc.n_vocab) == (VOCAB, VOCAB)
    assert enc.decode([VOCAB - 1]) == "<|endoftext|>"
    assert sorted(meta["train_books"] + meta["val_books"]) == [i for i, _ in BOOKS]
    assert meta["val_books"]
    for split in ("train", "val"):
        tokens = np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16)
        books = [i for i, _ in BOOKS if i in meta[f"{split}_books"]]  # the list's order
        text = "".join(BODIES[i] + "<|endoftext|>" for i in books)
        assert enc.decode(tokens.tolist()) == text
        assert (tokens == VOCAB - 1).sum() == len(books)
        assert meta[f"{split}_tokens"] == len(tokens)
        assert meta[f"{split}_sha256"] == hashlib.sha256(tokens.tobytes()).hexdigest()
    lines = (data_dir / "tokenizer.tiktoken").read_bytes().splitlines()
    assert [int(line.split()[1]) for line in lines] == list(range(VOCAB - 1))
    raws = {i: (data_dir / f"raw/{i}.txt").read_bytes() for i, _ in BOOKS}
    assert raws == RAW  # byte for byte
    texts = ["", "\n\t \r\n", "e\u0301\u0308", "<|endoftext|>", "\U0001f468\u4f60"]
    many = "".join(map(chr, range(32, 2048, 7)))
    ids = prepare_data.encode_books(enc, [*texts, many])
    ends = [k for k, t in enumerate(ids) if t == enc.eot_token]  # one written is text
    pieces = [enc.decode(ids[a + 1 : b].tolist()) for a, b in zip([-1] + ends, ends)]
    assert pieces[:-1] == texts
    names = ("{}.txt", "pg{}.txt", "cache/epub/{0}/pg{0}.txt")
    src = folder(tmp_path / "src", RAW, names)
    other = "holds other data, which runs trained on it need: pass another --data_dir"
    for again in ([], [], ["--val_fraction=0.5"], ["--vocab_size=300"]):
        flags = ["--source", src, *again]  # the same data once more, then other data
        if again:  # refused, nothing changed; --overwrite replaces it
            before = outputs(tmp_path)
            assert other in error_line(capsys, prepare, tmp_path, *flags, tsv=tsv)
            assert outputs(tmp_path) == before
            flags.append("--overwrite")
        assert prepare(tmp_path, *flags, tsv=tsv) == 0
        enc = machinery.load_tokenizer(tmp_path)  # (the same path, a new file)
        assert enc.decode(enc.encode(BODIES[9002])) == BODIES[9002]
        assert again or outputs(tmp_path) == outputs(data_dir)
    assert enc.n_vocab == 300  # nothing cached survives
    assert json.loads((tmp_path / "meta.json").read_text())["source"] == src
    tok = tmp_path / "tokenizer.tiktoken"
    tok.write_bytes(tok.read_bytes().replace(b" 298\n", b" 297\n"))
    said = error_line(capsys, machinery.load_tokenizer, tmp_path)
    assert f"{tok} is not the file meta.json describes" in said
    said = error_line(capsys, machinery.load_tokenizer, tmp_path / "none")
    assert "none/meta.json is missing" in said


def test_download_retries_pauses_names_missing(clean, tmp_path, monkeypatch, capsys):
    sleeps = []  # the main thread's (the server's threads sleep too)
    sleep = time.sleep

    def recorded_sleep(s):
        if threading.current_thread() is threading.main_thread():
            sleeps.append(s)
        sleep(s)

    monkeypatch.setattr(time, "sleep", recorded_sleep)
    ascii_terminal = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_terminal)
    first, second = prepare_data.URL_PATTERNS[:2]
    faults = {9001: "500 500", 9002: "timeout", 9004: "truncate", 9005: "html"}
    faults[9007] = "429"
    # 9003: 404 at its three paths
    with serve({i: raw for i, raw in RAW.items() if i != 9003}) as srv:
        srv.faults = {first.format(id=i): f.split() for i, f in faults.items()}
        flags = ["--pause", "0.03"]
        args = (prepare, tmp_path, *flags)
        err = error_line(capsys, *args, tsv=clean[1], mirror=srv.url)
        n = collections.Counter(p for p, _ in srv.log)
        kept = sorted(os.listdir(tmp_path / "raw"))
        assert not os.path.exists(tmp_path / "train.bin")
        for p in prepare_data.URL_PATTERNS:
            srv.files[p.format(id=9003)] = RAW[9003]
        for _ in range(2):  # the first downloads 9003 alone, the second nothing
            assert prepare(tmp_path, *flags, tsv=clean[1], mirror=srv.url) == 0
    assert f"ebooks 9003 not found at {srv.url} (no plain text at their URLs)" in err
    assert kept == [f"{i}.txt" for i in RAW if i != 9003]
    # 5xx, 429, no answer, cut short: again; 404, an HTML page: the next path
    assert [n[first.format(id=i)] for i, _ in BOOKS] == [3, 2, 1, 2, 1, 1, 2]
    assert [n[second.format(id=i)] for i, _ in BOOKS] == [0, 0, 1, 0, 1, 0, 0]
    assert [p for p, _ in srv.log[sum(n.values()) :]] == [first.format(id=9003)]
    assert {agent for _, agent in srv.log} == {prepare_data.USER_AGENT}
    # the backoff doubling, then the pauses
    assert sorted(s for s in sleeps if s) == [0.01] * 4 + [0.02] + [0.03] * 6
    sys.stdout.flush()
    assert "N?rnberg Stove" in sys.stdout.buffer.getvalue().decode("ascii")
    assert outputs(tmp_path) == outputs(clean[0])


def test_a_server_down_is_one_line_at_once_and_leaves_nothing(clean, tmp_path, capsys):
    err = error_line(capsys, prepare, tmp_path, tsv=clean[1], timeout=30)  # port 9
    url = "http://127.0.0.1:9/cache/epub/9001/pg9001.txt"
    assert err.startswith(f"error: cannot download ebook 9001 ({url}:")
    assert err.endswith("re-run, or use --mirror or --source")
    assert os.listdir(tmp_path / "raw") == []


def test_load_data_checks_each_file_against_meta(tmp_path, capsys):
    data = make_data(tmp_path, vocab=64)
    err = lambda *a: error_line(capsys, machinery.load_data, *a)
    train, val, fp = machinery.load_data(data, 8, 4)
    assert np.array_equal(train, np.fromfile(f"{data}/train.bin", dtype=np.uint16))
    assert np.array_equal(val, np.fromfile(f"{data}/val.bin", dtype=np.uint16))
    meta = json.loads(open(f"{data}/meta.json").read())
    keys = ("vocab_size", "train_sha256", "val_sha256", "tokenizer_sha256")
    assert fp == {k: meta.get(k) for k in keys}
    n = len(val)
    # windows of l + 1 = n tokens: just enough
    assert len(machinery.load_data(data, n - 1, 1)[1]) == n
    short = f"val.bin: {n} tokens, fewer than a batch needs (l + 1 = {n + 1})"
    assert f"{short}: use a smaller --block_size" in err(data, n, 1)
    n = len(train)
    batch = f"fewer than a batch needs (b + l = {n + 1}): use a smaller --batch_size"
    assert f"train.bin: {n} tokens, {batch} or --block_size" in err(data, 1, n)
    # a token fewer, a token changed
    for change in (lambda b: b[:-2], lambda b: b[:-2] + b"\1\0"):
        raw = open(f"{data}/val.bin", "rb").read()
        open(f"{data}/val.bin", "wb").write(change(raw))
        assert "val.bin is not the file meta.json describes" in err(data, 8, 4)
    json.dump([meta], open(f"{data}/meta.json", "w"))  # JSON, but not meta.json's
    assert "meta.json is missing or damaged: run prepare_data.py" in err(data, 8, 4)
    top = int(train.max())
    json.dump({**meta, "vocab_size": top}, open(f"{data}/meta.json", "w"))
    says = f"train.bin holds token {top} >= meta.json's vocab_size {top}"  # train first
    assert says in err(data, 8, 4)


def literal_bpe(word_counts, n_tokens):
    """Byte-pair encoding as its definition reads: from the 256 bytes, merge the most
    frequent pair of adjacent tokens into a new token until there are n_tokens; ties go
    to the smallest (left id, right id), and a merge making known bytes (x+yz after
    xy+z) reuses that token. It counts every pair again before each merge. Worked
    example, words {"aaab": 2, "ab": 1}:
      pairs (a,a) 2*2 = 4, (a,b) 2 + 1 = 3   -> 256 = "aa";   "aaab" is [256, a, b]
      pairs (256,a) 2, (a,b) 2 + 1 = 3       -> 257 = "ab";   "aaab" is [256, 257]
      pairs (256,257) 2                       -> 258 = "aaab"
    """
    vocab = [bytes([b]) for b in range(256)]
    words = {tuple(w.encode("utf-8")): c for w, c in word_counts.items()}
    while len(vocab) < n_tokens:
        pairs = collections.Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        pair = min(pairs, key=lambda p: (-pairs[p], p))  # of ties, the smallest ids
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in vocab:
            vocab.append(merged)
        new = vocab.index(merged)
        merge = prepare_data.merge
        words = {tuple(merge(list(w), pair, new)): c for w, c in words.items()}
    return vocab


def test_bpe_worked_by_hand_and_the_fast_one_against_the_literal_one(capsys):
    cases = [
        ({"aaab": 2, "ab": 1}, [b"aa", b"ab", b"aaab"]),  # literal_bpe's example
        # ties: ba < zy, ab < ac
        ({"ba": 2, "zy": 2, "ab": 1, "ac": 1}, [b"ba", b"zy", b"ab", b"ac"]),
        # ab first (a tie), then ca's count is 1
        ({"cab": 1, "ab": 1, "ca": 1}, [b"ab", b"ca", b"cab"]),
    ]
    for words, tokens in cases:
        expected = [bytes([b]) for b in range(256)] + tokens
        assert literal_bpe(words, 256 + len(tokens)) == expected
        assert prepare_data.train_bpe(words, 256 + len(tokens)) == expected
    # few letters: many ties
    for seed, letters in enumerate(["ab", "abc", "abcde", "xyz\u00e9\u4e00"]):
        rng = random.Random(seed)
        lengths = [rng.randint(1, 12) for _ in range(400)]
        words = collections.Counter("".join(rng.choices(letters, k=k)) for k in lengths)
        assert prepare_data.train_bpe(words, 316) == literal_bpe(words, 316)
    pieces = prepare_data.regex.findall(prepare_data.SPLIT_PATTERN, BODIES[9001])
    words = collections.Counter(pieces)
    assert prepare_data.train_bpe(words, 336) == literal_bpe(words, 336)
    # 256 + ab + <|endoftext|>
    says = "error: the books allow only 258 tokens, not 259: use a smaller --vocab_size"
    assert error_line(capsys, prepare_data.train_bpe, {"ab": 1}, 258).startswith(says)


def test_split_holds_out_whole_books_in_the_order_of_sha256_of_their_ids(tmp_path):
    def held_out(ids, texts, f):
        return sorted(ids[i] for i in prepare_data.split_books(ids, texts, f)[1])

    # sha256 of "1".."6", worked out once with hashlib: 4 (4b227777...), 3
    # (4e074085...), 1 (6b86b273...), 2 (d4735e3a...), 6 (e7f6c011...), 5 (ef2d127d...);
    # six books of 100 characters, 300 = half of them (0.5: exactly 300)
    cases = {0.01: [4], 0.17: [3, 4], 0.5: [1, 3, 4], 0.51: [1, 2, 3, 4]}
    cases[1] = [1, 2, 3, 4, 6]
    assert {f: held_out([1, 2, 3, 4, 5, 6], ["x" * 100] * 6, f) for f in cases} == cases
    # 4, then 3
    split = prepare_data.split_books([5, 4, 3], ["x" * 10, "x", "x" * 10], 0.5)
    assert split == ([0], [1, 2])
    # the default list, beside the script
    books = prepare_data.read_books_tsv(prepare_data.parse_args([]).books)
    assert len(books) == 100
    assert books[0] == (11, "Alice's Adventures in Wonderland", "Lewis Carroll")
    headless = tmp_path / "headless.tsv"  # the same without its header line
    headless.write_text(open(prepare_data.BOOKS_TSV).read().partition("\n")[2])
    assert prepare_data.read_books_tsv(str(headless)) == books
    # by sha256: 2726 (00f3ca2e), 55 (02d20bbd), 51 (031b4af5), 1154 (06ec44cc), 2557
    # (0844b610), 146 (0a5b046d), 520 (0b35b06a); the real books' lengths stop after six
    first = [2726, 55, 51, 1154, 2557, 146, 520]
    ids = [i for i, _, _ in books]
    # books of equal length: k - 0.5 of 100 books' text takes k
    for k in range(1, len(first) + 1):
        assert held_out(ids, ["x"] * 100, (k - 0.5) / 100) == sorted(first[:k])


# ---- bad input: one line saying what to do, before any work, nothing half-written
def test_bad_input_is_one_line_and_writes_nothing(clean, tmp_path, capsys):
    src = folder(tmp_path / "src", RAW)
    (tmp_path / "e").mkdir()
    cases = {  # books.tsv's bytes, or flags: what the line says
        b"id\n1\t11\n2\televen\n": "cannot read --books",
        b"1\tl1\n2\t11\n3\t12\n": "base 10: 'l1')",  # no header: a typo in an id
        "id\n1\t11\n2\t\u00b2\n".encode(): "cannot read --books",
        b"id\n1\t11\n2\t11\n3\t12\n": "lists ebook 11 twice: list each once",
        b"id\n1\t11\n": "lists 1 books: it needs 2 or more",
        b"id\n1\t11\tCaf\xe9\n": "can't decode byte 0xe9",
        "--books no": "cannot read --books no ([Errno 2]",
        "--vocab_size 256": "--vocab_size 256: give 257 (256 bytes and <|endoftext|>)",
        "--vocab_size 65537": "--vocab_size 65537: give 257",
        "--vocab_size many": "invalid int value: 'many'",
        "--val_fraction 1": "--val_fraction 1.0: give a share between 0 and 1",
        "--val_fraction nan": "--val_fraction nan: give a share",
        "--pause -1": "--pause -1.0: give 0 or more seconds",
        "--pause nan": "--pause nan: give 0 or more",
        "--mirror ftp://x": "--mirror ftp://x must start with http",
        "--source none": "--source none is not a folder",
        f"--source {tmp_path}/e": "ebooks 9001, 9002, 9003",
        f"--vocab_size 60000 --source {src}": "the books allow only ",
    }
    not_a_dir = f"{clean[1]}/x"  # in books.tsv, a file
    cases[f"--source {src} --data_dir {not_a_dir}"] = f"{not_a_dir} (Not a directory)"
    for case, says in cases.items():
        if isinstance(case, bytes):
            (tmp_path / "bad.tsv").write_bytes(case)
            argv = ["--books", str(tmp_path / "bad.tsv")]
        else:
            argv = case.split()
        said = error_line(capsys, prepare, tmp_path / "out", *argv, tsv=clean[1])
        assert says in said, case
        out = tmp_path / "out"
        assert not os.path.exists(out) or os.listdir(out) == [], case


def test_short_empty_binary_books_one_line_a_cut_one_warns(clean, tmp_path, capsys):
    src = tmp_path / "src"
    short = RAW[9006].replace(BODIES[9006].encode(), b"A short error page.")
    cases = [
        (short, "9006 (Tin Fern) has 19 characters"),
        (b"", "9006 (Tin Fern) has 0 chara"),
        (bytes(range(256)) * 9, f"9006: {src}/9006.txt is not a text file (NUL"),
    ]
    fix = f"replace {src}/9006.txt with the book's text (or delete a download"
    for raw, says in cases:
        folder(src, {**RAW, 9006: raw})
        flags = ["--source", str(src)]
        err = error_line(capsys, prepare, tmp_path / "out", *flags, tsv=clean[1])
        assert says in err and fix in err
        assert (src / "9006.txt").read_bytes() == raw
        assert not os.path.exists(tmp_path / "out/train.bin")
    # a download cut short
    folder(src, {**RAW, 9001: RAW[9001].split(b"End of the Project")[0]})
    assert prepare(tmp_path / "out", "--source", str(src), tsv=clean[1]) == 0
    out = capsys.readouterr().out  # the warning names the file
    cut = "ebook 9001 (Mossy Dell): no END marker or footer: the file may be cut short"
    assert cut in out
    assert f"if it is, replace {src}/9001.txt with the book's text" in out


@pytest.mark.slow
def test_prepare_data_from_the_command_line_is_one_line_without_traceback(tmp_path):
    argv = ["prepare_data.py", "--books", "none.tsv", "--data_dir", str(tmp_path)]
    rc, out, err = run_script(*argv)
    assert (rc, out, err.count("\n")) == (1, "", 1)
    assert err.startswith("error: cannot read --books")


# ======== train.py: batches, settings, the step, run folders, checkpoints, stopping

TINY = (
    "--mixer me --n_layer 2 --n_embd 16 --n_hidden 32 --block_size 8 --batch_size 4"
    f" --n_head 4 --eval_batches 2 --eval_interval 5 --log_interval 5 --device {DEVICE}"
).split()


def run(tmp_path, data, *flags, name="run"):
    """train.main on the tiny settings into tmp_path/name: its exit status."""
    out = str(tmp_path / name)
    return train.main(TINY + ["--data_dir", data, "--out_dir", out, *flags])


def log_rows(out):
    return _read_csv(os.path.join(out, "log.csv"))


def losses(out):
    """Each row's batch, training cost and validation loss, as strings: bits."""
    return [(r["iter"], r["train_loss"], r["val_loss"]) for r in log_rows(out)]


def ckpt_iter(out):
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter"]


def files(folder):
    """{path: bytes} of every file under folder: a refused command must change none."""
    paths = glob.glob(f"{folder}/**/*", recursive=True, include_hidden=True)
    return {p: open(p, "rb").read() for p in paths if os.path.isfile(p)}


# ---- the batches: a seeded order per epoch, the same for every mixer
def test_batch_order_is_a_seeded_permutation_per_epoch():
    n, b = 50, 8  # 6 full batches per epoch; each epoch's 2 leftover starts skipped
    batches = [train.batch_starts(i, n, b, 3) for i in range(18)]
    assert all(len(x) == b for x in batches)
    epochs = [torch.cat(batches[e * 6 : (e + 1) * 6]) for e in range(3)]
    assert all(len(set(e.tolist())) == 48 for e in epochs)  # no start twice
    assert all(0 <= e.min() and e.max() < n for e in epochs)
    assert not torch.equal(epochs[0], epochs[1])  # a new permutation for the next epoch
    assert torch.equal(train.batch_starts(2, n, b, 3), batches[2])
    assert not torch.equal(train.batch_starts(0, n, b, 4), batches[0])  # another seed


def test_every_mixer_sees_the_same_batches_and_val_windows(data, tmp_path, monkeypatch):
    seen, get_batch = {}, train.get_batch
    for name, flags in {"sa": "--mixer sa --seed 1", "me": "--dropout 0"}.items():

        def spy(*a, name=name):
            seen.setdefault(name, []).append(get_batch(*a))
            return seen[name][-1]

        monkeypatch.setattr(train, "get_batch", spy)
        # (each run computes its order anew, as in its own process)
        train.epoch_permutation.cache_clear()
        assert run(tmp_path, data, "--max_iters=10", *flags.split(), name=name) == 0
    assert len(seen["sa"]) == len(seen["me"]) == 10 + 2 * 2  # + 2 validations of 2
    for (x_sa, y_sa), (x_me, y_me) in zip(seen["sa"], seen["me"]):
        assert torch.equal(x_sa, x_me) and torch.equal(y_sa, y_me)
    x, y = seen["sa"][0]
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])  # y: x shifted by 1
    tokens = np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16)
    first = train.batch_starts(0, len(tokens) - 8, 4, 1337)  # epoch 0's first slice
    windows = np.stack([tokens[s : s + 8] for s in first.tolist()]).astype(np.int64)
    assert torch.equal(x, torch.from_numpy(windows))
    # the same validation windows each time
    assert torch.equal(seen["sa"][5][0], seen["sa"][12][0])
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16).astype(np.int64)
    # 8 windows of l+1 spread from first to last
    starts = [round(k * (len(val) - 9) / 7) for k in range(8)]
    windows = torch.tensor(np.stack([val[s : s + 8] for s in starts]))
    assert torch.equal(torch.cat([seen["sa"][5][0], seen["sa"][6][0]]), windows)


# ---- settings and bad input
def test_help_gives_each_setting_its_symbol_and_table1_value(capsys):
    assert train.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    table1 = (
        "N_LAYER m: number of layers (18); BLOCK_SIZE l: context length (128); "
        "N_EMBD d: dimension of the model (128); N_HIDDEN c: nodes in the FFN's "
        "hidden layer (512); N_HEAD n: heads of self-attention, the Synthesizers "
        "(32); DROPOUT p: dropout rate (0.1); "
        "BATCH_SIZE b: batch size; LR lr: AdamW's learning rate gamma, constant "
        "(0.001); BETA1 bm: AdamW's beta_1 (0.9); BETA2 bv: AdamW's beta_2 (0.999)"
    )
    for text in table1.split("; "):
        assert text in out, text
    assert "(default: None)" not in out and "(None)" not in out
    # the flags' defaults are the model's, Table 1's
    defaults = vars(machinery.build_parser(train.SETTINGS).parse_args([]))
    model = ("n_layer", "block_size", "n_embd", "n_hidden", "n_head", "dropout")
    assert [defaults[k] for k in model] == [getattr(Config, k) for k in model]
    others = ("lr", "batch_size", "max_iters", "weight_decay")
    assert [defaults[k] for k in others] == [1e-3, 64, 60000, 0.01]


BAD_FLAGS = {
    "--batch_size 0": "argument --batch_size: must be in [1, inf), got 0",
    "--lr -1": "argument --lr: must be in [0, inf), got -1",
    "--beta2 1": "argument --beta2: must be in [0, 1), got 1",
    "--grad_clip nan": "argument --grad_clip: must be in [0, inf), got nan",
    "--seed=-1": "argument --seed: must be in [0, 9223372036854775808), got -1",
    "--time_limit 5x": "'5x' is not a time",
    "--mixer nope": "unknown mixer 'nope'",
    "--mixer torch.nn.Linear": "--mixer torch.nn.Linear is not a mixer (TypeError",
    "--mixer torch.nn.Identity": "is not a mixer (TypeError",
    "--mixer mymod.Peek": "mymod.Peek sees the future (its output at i < 7 changes",
    "--mixer mymod.Cut": "(AssertionError: not x's shape at t = 8): a mixer is",
    "--n_head 5": "n_head=5 must divide n_embd=16",
    "--resume --overwrite": "--overwrite: not allowed with argument --resume",
    "--device cuda:99": "torch sees no such device",
    "--device meta": "--device meta: torch sees no such device",  # (no data)
    "--max_iters x": "argument --max_iters: 'x' is not a whole number",
    "--lr fast": "argument --lr: 'fast' is not a number",
    "--dtype half": "argument --dtype: invalid choice: 'half'",
}


@pytest.mark.parametrize("flags", BAD_FLAGS)
def test_bad_flags_one_line_write_nothing(flags, data, tmp_path, monkeypatch, capsys):
    (tmp_path / "mymod.py").write_text(USER_MIXER)  # mixers of one's own
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--mixer=sa", "--max_iters=3", *flags.split()]
    assert BAD_FLAGS[flags] in error_line(capsys, run, tmp_path, data, *argv)
    assert not os.path.exists(tmp_path / "run")


# ---- the step: AdamW written out from its definition, with Table 1's settings
def literal_adamw(params, grads, state, t, b1, b2, decay, lr=1e-3, eps=1e-8):
    """Loshchilov and Hutter's AdamW step: decoupled decay, bias-corrected moments."""
    for p, g, (m, v) in zip(params, grads, state):
        p.mul_(1 - lr * decay)
        m.mul_(b1).add_((1 - b1) * g)
        v.mul_(b2).add_((1 - b2) * g * g)
        p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@pytest.mark.parametrize("clip, decay", [(0.0, 0.01), (0.05, 0.1)])
def test_training_step_is_adamw_with_table1_settings_written_out(clip, decay):
    """Three of train.py's steps against AdamW written out, in float64, to float64
    precision. Clipping scales the gradients to a norm of at most clip, as they are
    before fp16's loss scaling (2**16, exact in float64)."""
    flags = ["--dropout=0", f"--grad_clip={clip}", "--seed=3"]
    b1, b2 = (0.9, 0.999) if decay == 0.01 else (0.8, 0.99)  # Table 1's, then others
    if decay != 0.01:  # (Table 1's decay as the default, then another)
        flags += [f"--weight_decay={decay}", "--beta1=0.8", "--beta2=0.99"]
    args = machinery.build_parser(train.SETTINGS).parse_args(flags)
    cfg = Config(30, 8, 8, 16, 1, 2, 0.0, "he")  # u, l, d, c, m, n, p, the mixer
    model, adamw = train.build_model(cfg, args, torch.device("cpu"))
    reference = copy.deepcopy(model.double())
    params = list(reference.parameters())
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    dtype = "float16" if clip else "float32"  # fp16 scales the loss
    scaler = machinery.precision(torch.device("cpu"), dtype)[1]
    assert scaler.is_enabled() == (clip > 0)
    ctx = contextlib.nullcontext()
    step = functools.partial(train.train_step, model, adamw, scaler, ctx)
    for t in range(1, 4):
        generator = torch.Generator().manual_seed(t)
        x, y = torch.randint(0, 30, (2, 2, 8), generator=generator)
        loss = step(x, y, grad_clip=args.grad_clip)
        ref_loss = reference(x, y)[1]
        grads = torch.autograd.grad(ref_loss, params)
        assert abs(loss.item() - ref_loss.item()) < 1e-12  # before the step, Eq. (3)
        norm = math.sqrt(sum((g**2).sum().item() for g in grads))
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        with torch.no_grad():
            clipped = [g * scale for g in grads]
            literal_adamw(params, clipped, state, t, b1=b1, b2=b2, decay=decay)
        assert clip == 0 or scale < 1  # the clip binds at least in this test
    for p, q in zip(model.parameters(), params):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), (p - q).abs().max()


# ---- resume: bit for bit after Ctrl-C, the run's settings, its data; log.csv with ckpt
def test_ctrl_c_checkpoints_resume_bit_for_bit(data, tmp_path, monkeypatch, capsys):
    """Ctrl-C, then --resume with log.csv deleted and killed at once (ckpt.pt stays),
    then with log.csv's header only: ckpt.pt's rows make the log whole again."""
    whole = str(tmp_path / "whole")
    assert run(tmp_path, data, "--max_iters", "14", name="whole") == 0
    get_batch, calls = train.get_batch, []

    def ctrl_c(*a):  # in batch 5's validation (calls 6 and 7): it stops after batch 6
        calls.append(1)
        if len(calls) == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return get_batch(*a)

    killed = mock.Mock(side_effect=KeyboardInterrupt)  # a kill before a checkpoint
    monkeypatch.setattr(train, "get_batch", ctrl_c)
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters", "14", "--lr", "0.001") == 130
    assert ckpt_iter(out) == 6 and losses(out) == losses(whole)[:6]
    assert "SIGINT: stopped at batch 6" in capsys.readouterr().out
    path = os.path.join(out, "log.csv")
    os.remove(path)
    monkeypatch.setattr(train, "get_batch", killed)
    resume = ["--out_dir", out, "--resume", "--max_iters", "14"]
    assert train.main(resume) == 130 and ckpt_iter(out) == 6
    assert f"aborted; the last checkpoint, {out}/ckpt.pt" in capsys.readouterr().out
    open(path, "w").write("iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n")
    monkeypatch.setattr(train, "get_batch", get_batch)
    assert train.main(resume) == 0
    assert losses(out) == losses(whole)  # ckpt.pt's rows, then the rest, to the bit


def test_a_kill_9_while_saving_leaves_log_csv_behind(data, tmp_path, monkeypatch):
    """A kill -9 in a checkpoint's writes: ckpt.pt goes first, so log.csv never holds
    a row ckpt.pt lacks; --resume writes log.csv again from ckpt.pt's rows."""
    write = machinery.RunFolder.write

    def killed_at_the_second_log(folder, name, text):
        if name == "log.csv" and text.count("\n") > 6:
            raise SystemError("kill -9")  # (no handler of train.py's catches it)
        write(folder, name, text)

    monkeypatch.setattr(machinery.RunFolder, "write", killed_at_the_second_log)
    out = str(tmp_path / "run")
    with pytest.raises(SystemError):
        run(tmp_path, data, "--max_iters", "10", "--ckpt_interval", "5")
    assert ckpt_iter(out) == 10 and len(log_rows(out)) == 5
    monkeypatch.setattr(machinery.RunFolder, "write", write)
    assert train.main(["--out_dir", out, "--resume"]) == 0
    assert [int(r["iter"]) for r in log_rows(out)] == list(range(1, 11))


def test_resume_keeps_settings_and_data_says_what_moved(tmp_path, monkeypatch, capsys):
    """--resume: the run's settings (flags may change MAY_CHANGE's), its data; a data
    folder that moved (ckpt.pt keeps its path): pass --data_dir; a mixer of one's own
    whose parameters changed since: their names."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mine.py").write_text(USER_MIXER)
    out, moved = str(tmp_path / "run"), str(tmp_path / "moved")
    here = make_data(tmp_path / "data")  # (the fixture's data)
    assert run(tmp_path, here, "--max_iters=5", "--lr=0.003", "--mixer=mine.Mean") == 0
    resume = ["--out_dir", out, "--resume", "--max_iters", "10"]
    other = make_data(tmp_path / "other", seed=1)
    cases = {"--lr=0.001": "--lr 0.003", f"--data_dir={other}": "trained on other data"}
    cases["--dtype=bfloat16"] = "trained with --dtype float32"  # flag: what it says
    for flag, says in cases.items():
        assert says in error_line(capsys, train.main, resume + [flag])
    os.rename(here, moved)
    said = error_line(capsys, train.main, resume)
    assert f"trained on the data in {here}, which is gone: pass --data_dir" in said
    resume += ["--data_dir", moved, "--log_interval", "2"]
    (tmp_path / "mine.py").write_text(USER_MIXER.replace("self.w", "self.weight"))
    sys.modules.pop("mine")
    said = error_line(capsys, train.main, resume)
    assert 'Missing key(s) in state_dict: "layers.0.mixer.weight", "layers.1.' in said
    assert 'Unexpected key(s) in state_dict: "layers.0.mixer.w", "layers.1.' in said
    (tmp_path / "mine.py").write_text(USER_MIXER)
    sys.modules.pop("mine")
    assert train.main(resume) == 0 and ckpt_iter(out) == 10
    args = json.load(open(os.path.join(out, "run.json")))["args"]
    assert (args["lr"], args["log_interval"], args["n_layer"]) == (0.003, 2, 2)
    assert train.main(["--out_dir", out, "--resume"]) == 0
    assert f"{out} is at batch 10: nothing to train" in capsys.readouterr().out
    rows, info = log_rows(out), open(os.path.join(out, "run.json")).read()
    for name in ("log.csv", "run.json"):  # a finished run's log and run.json lost
        os.remove(os.path.join(out, name))
    assert train.main(["--out_dir", out, "--resume"]) == 0
    assert log_rows(out) == rows and open(os.path.join(out, "run.json")).read() == info


def other_value(name, value):
    """A flag giving the setting `name` another value than `value`, one it may take."""
    if isinstance(value, bool):
        return f"--{'no-' if value else ''}{name}"
    others = {"mixer": "he", "dtype": "bfloat16"}
    if name in others:
        return f"--{name}={others[name]}"
    return f"--{name}={value + 1 if isinstance(value, int) else value / 2 or 0.5}"


def test_resume_refuses_kept_settings_other_processes_old_code(data, tmp_path, capsys):
    """Each setting --resume keeps (SETTINGS but MAY_CHANGE), given another value, is
    one line naming it; so is a checkpoint of other processes or older code (a key it
    lacks). A finished run's log.csv.gz, as in results/logs/, is never written."""
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters=2") == 0
    saved = json.load(open(os.path.join(out, "run.json")))["args"]
    kept_ = [k for k in train.SETTINGS if k not in train.MAY_CHANGE]
    assert len(kept_) == 18  # Table 1's 14, the mixer, dtype, tf32, eval_batches
    for name in kept_:
        flag = other_value(name, saved[name])
        said = error_line(capsys, run, tmp_path, data, "--resume", flag)
        assert f"was trained with --{name} {saved[name]}: --resume keeps them" in said
    path = os.path.join(out, "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    for change, says in (
        (dict(world_size=2), f"{path} was trained by 2 processes: run as many"),
        (dict(elapsed_s=None), f"{path} has no elapsed_s: an older train.py wrote it"),
    ):
        torch.save({k: v for k, v in (ckpt | change).items() if v is not None}, path)
        assert says in error_line(capsys, run, tmp_path, data, "--resume")
    for group in ckpt["optimizer"]["param_groups"]:  # a CUDA graph's AdamW
        group["capturable"] = True
    torch.save(ckpt, path)
    assert run(tmp_path, data, "--resume", "--max_iters=3") == 0  # as this device's
    (committed := tmp_path / "committed").mkdir()  # as results/logs/m2l32/me
    (committed / "log.csv.gz").write_bytes(gzip.compress(b"iter\n"))
    (committed / "run.json").write_text("{}")
    for flags in ([], ["--resume"], ["--overwrite"]):
        said = error_line(capsys, run, tmp_path, data, *flags, name="committed")
        assert "holds a finished run's log.csv.gz (as results/logs/ keeps runs)" in said
    assert sorted(os.listdir(committed)) == ["log.csv.gz", "run.json"]


def test_a_run_writes_only_in_the_folder_it_locked(data, tmp_path, monkeypatch, capsys):
    """A killed write's .*.tmp goes; a folder renamed while its run trains gets the
    run's files, a new folder at the old path none; a name too long is one line."""
    out, moved = tmp_path / "run", tmp_path / "moved"
    out.mkdir()
    (out / ".ckpt.pt.4242.tmp").write_bytes(b"half a checkpoint")
    get_batch, calls = train.get_batch, itertools.count(1)

    def renamed_at_3(*a):
        if next(calls) == 3:
            os.rename(out, moved)
            out.mkdir()  # another run's, say
        return get_batch(*a)

    monkeypatch.setattr(train, "get_batch", renamed_at_3)
    assert run(tmp_path, data, "--max_iters=5") == 0
    assert os.listdir(out) == [] and ckpt_iter(str(moved)) == 5
    assert f"done: python experiments/plot.py {moved} draws" in capsys.readouterr().out
    assert json.loads((moved / "run.json").read_text())["args"]["out_dir"] == str(moved)
    assert sorted(os.listdir(moved)) == ["ckpt.pt", "log.csv", "run.json"]

    def moved_then_too_large(*a):  # moved again, then out of memory: ckpt.pt stays
        os.rename(moved, out / "again")
        return torch.empty(2**62, dtype=torch.uint8)

    monkeypatch.setattr(train, "get_batch", moved_then_too_large)
    resume = ["--out_dir", str(moved), "--resume", "--max_iters=9"]
    said = error_line(capsys, train.main, resume)
    assert said.endswith("/ckpt.pt, stays") and ckpt_iter(str(out / "again")) == 5
    said = error_line(capsys, run, tmp_path, data, name="x" * 300)
    assert said.endswith("(File name too long); no checkpoint was written")


def test_a_closed_console_stops_at_a_checkpoint(data, tmp_path, monkeypatch, capsys):
    """A terminal closed under the run (EIO) stops it at a checkpoint, as a hang-up."""

    class Closed(io.StringIO):
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert run(tmp_path, data, "--max_iters=100") == 128 + signal.SIGHUP
    said = capsys.readouterr().err
    assert "SIGHUP: stopped at batch 1 with a checkpoint; go on with --resume" in said
    assert ckpt_iter(str(tmp_path / "run")) == 1


# ---- the run folder: one run each, from its first checkpoint on
def test_a_folder_holds_one_run_from_its_first_checkpoint(data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters", "5") == 0
    before = files(out)
    said = error_line(capsys, run, tmp_path, data, "--max_iters", "5")
    assert f"{out} holds a run (--resume continues it; --overwrite starts" in said
    assert files(out) == before
    with machinery.RunFolder(out):  # a train.py working in the folder
        said = error_line(capsys, run, tmp_path, data, "--max_iters", "9", "--resume")
    assert f"{out} is in use: a run of another train.py is in progress" in said
    assert files(out) == before
    for drawn in ("loss.png", "taps.png"):  # what plot.py and taps.py draw there
        open(os.path.join(out, drawn), "w").close()
    assert run(tmp_path, data, "--max_iters", "3", "--overwrite") == 0
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.csv", "run.json"]
    assert ckpt_iter(out) == 3 and len(log_rows(out)) == 3  # the old run's all gone
    os.remove(os.path.join(out, "ckpt.pt"))  # the log kept, the large file deleted
    before = files(out)
    said = error_line(capsys, run, tmp_path, data, "--max_iters", "4")
    assert f"{out} holds a run (its ckpt.pt is gone; --overwrite starts" in said
    said = error_line(capsys, run, tmp_path, data, "--resume")
    assert "to resume; --overwrite starts the run again" in said
    assert files(out) == before
    said = error_line(capsys, run, tmp_path, data, name="run/log.csv")
    assert "is a file: pass a folder" in said
    results = os.path.join(ROOT, "results")  # the committed runs, figures: untouched
    before = files(results)
    committed = "is in results/, which holds the committed runs and figures: train"
    for under in ("logs/m2l32", ".", "new/run"):
        out_dir = os.path.join(results, under)
        flags = ["--data_dir", data, "--out_dir", out_dir, "--max_iters=1"]
        said = error_line(capsys, train.main, TINY + flags)
        assert said == f"error: --out_dir {out_dir} {committed} into out/ or elsewhere"
    assert files(results) == before and not os.path.exists(f"{results}/new")
    os.remove(os.path.join(out, "log.csv"))  # as a run killed before its checkpoint
    assert run(tmp_path, data, "--max_iters", "4") == 0 and ckpt_iter(out) == 4


@contextlib.contextmanager
def full_disk(size=3000):
    """A full disk: writes past `size` bytes fail (run.json: 1.4 kB, ckpt.pt: 90 kB)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_checkpoints_are_written_whole_or_not_at_all(data, tmp_path, capsys):
    """A full disk in the middle of ckpt.pt: one line that says what stays, no .tmp
    left, and a folder with no checkpoint stays free; a damaged ckpt.pt: one line."""
    out = str(tmp_path / "run")
    path = os.path.join(out, "ckpt.pt")
    with full_disk():
        said = error_line(capsys, run, tmp_path, data, "--max_iters", "5")
    too_large = f"error: cannot write {path} (File too large)"
    assert said == f"{too_large}; no checkpoint was written"
    assert run(tmp_path, data, "--max_iters", "5") == 0  # (a plain command)
    resume = ["--out_dir", out, "--resume", "--max_iters", "10"]
    with full_disk():
        said = error_line(capsys, train.main, resume)
    assert said == f"{too_large}; the last checkpoint, {path}, stays"
    assert ckpt_iter(out) == 5 and len(log_rows(out)) == 5
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == []
    os.truncate(path, 1000)  # half-written: torch's message is a long paragraph
    with pytest.raises(Exception) as e:
        torch.load(path, weights_only=True)
    whole = f"{e.typename}: {e.value}"
    said = error_line(capsys, train.main, resume)
    shown = said.split(f"cannot read {path} (")[1].split(" ...); it is damaged")[0]
    assert len(shown) > 60 and whole.startswith(shown + " ")  # cut between words
    assert said.endswith("not train.py's; --overwrite starts the run again")


def test_a_run_that_fails_says_what_stays(data, tmp_path, monkeypatch, capsys):
    """A cost that is not finite (the last checkpoint stays), the CPU out of memory
    (none was written); no glibc: no malloc options."""
    flags = ["--lr=1e30", "--max_iters=50", "--ckpt_interval=1"]
    said = error_line(capsys, run, tmp_path, data, *flags)
    assert "the training cost became nan at batch" in said and "--grad_clip" in said
    out = str(tmp_path / "run")
    assert f"; the last checkpoint, {out}/ckpt.pt, stays" in said
    assert ckpt_iter(out) < int(said.split("at batch ")[1].split(";")[0])
    step, calls = train.train_step, itertools.count(1)
    infinite = lambda *a, **kw: step(*a, **kw) * (math.inf if next(calls) == 3 else 1)
    monkeypatch.setattr(train, "train_step", infinite)
    said = error_line(capsys, run, tmp_path, data, "--max_iters=9", name="inf")
    gone = "at batch 3; no checkpoint was written. Start again with a smaller --lr"
    assert f"the training cost became inf {gone}" in said
    monkeypatch.setattr(train, "train_step", step)
    flags = ["--eval_batches=72057594037927936", "--max_iters=3"]  # 2 EiB of windows
    said = error_line(capsys, run, tmp_path, data, *flags, name="val")
    val = "the validation after batch 3: use a smaller --eval_batches, --batch_size or"
    assert said.startswith(f"error: out of memory in {val} --block_size")
    too_large = lambda *a: torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: refused
    no_such_library = mock.Mock(side_effect=OSError("cannot open shared object file"))
    monkeypatch.setattr(train, "get_batch", too_large)
    (tmp_path / "other").mkdir()  # the user's own: it stays, made by the run or not
    said = error_line(capsys, run, tmp_path, data, name="other")
    big = "error: out of memory at batch 1: use a smaller --batch_size or --block_size"
    assert said.startswith(big) and said.endswith("; no checkpoint was written")
    assert os.listdir(tmp_path / "other") == []
    # a mixer whose weights do not fit: too_large(cfg) builds it
    monkeypatch.setattr(machinery, "find_mixer", lambda name: too_large)
    said = error_line(capsys, run, tmp_path, data, name="huge")
    model = "building the model: use a smaller --n_layer, --n_embd or --block_size"
    assert said.startswith(f"error: out of memory {model}")
    monkeypatch.setattr(machinery.platform, "libc_ver", lambda: ("", ""))  # musl, macOS
    monkeypatch.setattr(machinery.ctypes, "CDLL", no_such_library)
    assert machinery.pick_device("cpu") == torch.device("cpu")  # (no malloc options)


def test_time_limit_from_start_foresees_validation(data, tmp_path, monkeypatch, capsys):
    """A clock of 1 s a batch (validation's too) and 10 s to load the data: 21 s at
    batch 9, + twice the slowest batch + batch 10's validation (2) + 2 x 0.5 s (the
    guess at a log point that saves) > 25 s. From the loop's start, or without the
    validation: later. A checkpoint measured replaces the guess: 0.25 s (5 s: batch 3
    at 3.5 s + 2 batches + 2 x 0.25 s > 5 s), 2 s (8 s: batch 2 at 4 s + 2 + 2 x 2)."""
    clock, get_batch, load_data = [1000.0], train.get_batch, machinery.load_data

    def batch(*a):
        clock[0] += 1
        return get_batch(*a)

    def slow_load(*a):
        clock[0] += 10
        return load_data(*a)

    monkeypatch.setattr(machinery.time, "time", lambda: clock[0])
    monkeypatch.setattr(train, "get_batch", batch)
    monkeypatch.setattr(machinery, "load_data", slow_load)
    assert run(tmp_path, data, "--max_iters", "100", "--time_limit", "25s") == 0
    said = capsys.readouterr().out
    assert "--time_limit: stopped at batch 9 with a checkpoint" in said
    assert ckpt_iter(str(tmp_path / "run")) == 9 and clock[0] - 1000 <= 25
    flags = ["--max_iters=100", "--time_limit=5s"]  # 10 s to load the data
    said = error_line(capsys, run, tmp_path, data, *flags, name="late")
    assert "--time_limit passed before the first batch (10.0 s to start)" in said
    assert not os.path.exists(tmp_path / "late")  # nothing was trained
    torchrun = subprocess.Popen(["sleep", "9"])  # the worker's parent, 20 s old
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # (torchrun's workers have it)
    monkeypatch.setattr(machinery.os, "getppid", lambda: torchrun.pid)
    boot = time.clock_gettime(time.CLOCK_BOOTTIME) + 20
    monkeypatch.setattr(machinery.time, "clock_gettime", lambda clock: boot)
    said = error_line(capsys, run, tmp_path, data, "--time_limit=25s", name="late")
    torchrun.kill()
    assert 30 <= float(said.split("first batch (")[1].split(" s to")[0]) < 30.5
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setattr(machinery, "load_data", load_data)
    write = machinery.atomic_write

    def slow_write(name, *a):  # ckpt.pt takes `cost` s, the loop's
        clock[0] += cost * (name == "ckpt.pt")
        return write(name, *a)

    monkeypatch.setattr(machinery, "atomic_write", slow_write)
    for cost, limit, last in ((0.25, 5, 3), (2, 8, 2)):
        flags = ["--max_iters=100", f"--time_limit={limit}s", "--ckpt_interval=1"]
        start = clock[0]
        assert run(tmp_path, data, *flags, name=f"{cost}") == 0
        said = capsys.readouterr().out
        assert f"--time_limit: stopped at batch {last} with" in said
        assert clock[0] - start <= limit


def test_a_resumed_run_counts_on_its_time(data, tmp_path, monkeypatch, capsys):
    """A clock of 1 s a batch: 4 batches, 100 s off, 4 more: elapsed 1..8 s in log.csv,
    run.json and the console; the ETA from the resumed batches' pace alone."""
    clock, get_batch = [1000.0], train.get_batch

    def batch(*a):
        clock[0] += 1
        return get_batch(*a)

    monkeypatch.setattr(machinery.time, "time", lambda: clock[0])
    monkeypatch.setattr(train, "get_batch", batch)
    flags = ["--eval_batches=0", "--log_interval=2"]
    assert run(tmp_path, data, "--max_iters=4", *flags) == 0
    clock[0] += 100
    assert run(tmp_path, data, "--max_iters=8", "--resume", *flags) == 0
    out = str(tmp_path / "run")
    assert [r["elapsed_s"] for r in log_rows(out)] == [f"{i}.000" for i in range(1, 9)]
    assert json.load(open(os.path.join(out, "run.json")))["elapsed_s"] == 8
    assert "elapsed 6.0s | ETA 2.0s" in capsys.readouterr().out  # (iter 6/8)


def test_a_folder_an_ascii_console_cannot_show(data, tmp_path, monkeypatch):
    """An ASCII console, a folder 'tür': train.py, plot.py and taps.py show t\\xfcr."""
    out, escaped, shown = str(tmp_path / "tür"), f"{tmp_path}/t\\xfcr", []
    train_it = functools.partial(run, tmp_path, data, "--max_iters=2", name="tür")
    for command in (train_it, lambda: plot.main([out]), lambda: taps.main([out])):
        console = io.BytesIO()  # each its own, as each is a process
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(console, encoding="ascii"))
        assert command() == 0
        sys.stdout.flush()
        shown.append(console.getvalue().decode())
    assert f"done: python experiments/plot.py {escaped} draws its losses" in shown[0]
    assert shown[1:] == [f"wrote '{escaped}/{name}.png'\n" for name in ("loss", "taps")]


# ---- what a run writes: log.csv, run.json, the console
def test_log_run_json_and_console(data, tmp_path, capsys):
    out = str(tmp_path / "run")
    flags = ["--max_iters", "12", "--mixer", "sa", "--n_layer", "1"]
    assert run(tmp_path, data, *flags) == 0
    console = capsys.readouterr().out
    first = console.splitlines()[:3]  # the model, where it trains, how it computes
    assert first[0].startswith("Config(vocab_size=64,") and "computed: {" in first[2]
    assert first[1] == f"training from batch 0 to 12 into {out}"
    rows = log_rows(out)
    assert [int(r["iter"]) for r in rows] == list(range(1, 13))
    assert rows[0]["lr"] == "0.001"
    # every 5 and at the end
    assert [r["iter"] for r in rows if r["val_loss"]] == ["5", "10", "12"]
    # one batch of validation is a validation; --grad_clip reaches the step
    more = ["--eval_batches=1", "--grad_clip=1e-9"]
    assert run(tmp_path, data, *flags, *more, name="clipped") == 0
    clipped = log_rows(str(tmp_path / "clipped"))
    assert [r["iter"] for r in clipped if r["val_loss"]] == ["5", "10", "12"]
    assert clipped[0]["train_loss"] == rows[0]["train_loss"]  # (before any step)
    assert clipped[1]["train_loss"] != rows[1]["train_loss"]
    lines = [line.split(" |")[0] for line in console.splitlines()]
    iters = [line for line in lines if line.startswith("iter")]
    assert iters == ["iter 5/12", "iter 10/12", "iter 12/12"]
    mean = sum(float(r["train_loss"]) for r in rows[5:10]) / 5
    val = float(rows[9]["val_loss"])
    assert f"iter 10/12 | loss {mean:.4f} | val {val:.4f} |" in console
    info = json.load(open(os.path.join(out, "run.json")))
    sizes = dict(vocab_size=64, block_size=8, n_embd=16, n_hidden=32, n_layer=1)
    assert info["config"] == dict(**sizes, n_head=4, dropout=0.1, mixer="sa")
    assert info["params"]["mixers"] == 4 * 16 * 16
    meta = json.load(open(os.path.join(data, "meta.json")))
    assert info["data"]["train_sha256"] == meta["train_sha256"]
    step = "CapturedStep" if DEVICE.type == "cuda" else "eager"
    how = [info["computed"][k] for k in ("device", "torch", "step")]
    assert how == [str(DEVICE), torch.__version__, step]
    assert info["peak_memory_mb"] > 0 and f"{info['peak_memory_is']}: " in console


@pytest.mark.slow
def test_resident_memory_does_not_grow_with_the_batches_between_log_points(tmp_path):
    """The peak in run.json is the same whether the losses are logged every batch or
    once: nothing kept per batch until a log point may cost a logits' block each."""
    data = make_data(tmp_path / "data", vocab=10000)
    logits = 64 * 16 * 10000 * 4  # (b, l, u) float32: 41 MB
    flags = "--mixer me --n_layer 1 --n_embd 16 --n_hidden 32 --block_size 16"
    flags += f" --batch_size 64 --max_iters 30 --eval_batches 0 --data_dir {data}"
    peaks = []
    for every in (1, 30):
        out = str(tmp_path / f"log{every}")
        argv = [*flags.split(), "--device", "cpu", "--out_dir", out]
        rc, _, err = run_script("train.py", *argv, "--log_interval", str(every))
        assert rc == 0, err
        peaks.append(json.load(open(os.path.join(out, "run.json")))["peak_memory_mb"])
    # losses kept per batch cost 980-1170 MB more; runs vary by up to 3 logits' blocks
    assert peaks[1] - peaks[0] < 8 * logits / 2**20, peaks


FOLDER_NAMES = {
    "": "sa-32",
    "--mixer me": "me",
    "--mixer sa --n_head 4": "sa-4",
    "--mixer me --n_layer 2 --block_size 64 --batch_size 32": "me-m2-l64-b32",
    "--lr 3e-4 --dropout 0": "sa-32-p0-lr0.0003",
    "--beta1 0 --batch_size 10": "sa-32-b10-bm0",
    "--seed 12345678": "sa-32-seed12345678",
    "--weight_decay 0.1 --data_seed 7": "sa-32-wd0.1-dseed7",
}


@pytest.mark.parametrize("flags", FOLDER_NAMES)
def test_default_run_folders_name_the_settings_that_are_not_table_1s(flags):
    args = machinery.build_parser(train.SETTINGS).parse_args(flags.split())
    out = machinery.default_out_dir(args, train.SETTINGS)
    assert out == os.path.join("out", FOLDER_NAMES[flags])


# ---- stopping from outside: a signal, a closed stdout; DDP
def start_run(tmp_path, data, *more, **popen):
    """train.py in a subprocess, its console in a pipe, once its first line has come."""
    out = str(tmp_path / "sub")
    flags = TINY + ["--data_dir", data, "--out_dir", out, "--max_iters", "100000"]
    flags += ["--log_interval", "10", *more]
    cmd = [sys.executable, "train.py", *flags]
    p = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, **popen)
    while not p.stdout.readline().startswith("iter "):
        assert p.poll() is None
    return p, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_kill_and_hangup_stop_with_a_checkpoint(sig, data, tmp_path):
    p, out = start_run(tmp_path, data)
    p.send_signal(sig)
    rest = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + sig
    assert f"{signal.Signals(sig).name}: stopped at batch" in rest
    assert [int(r["iter"]) for r in log_rows(out)] == list(range(1, ckpt_iter(out) + 1))


@pytest.mark.slow
def test_nohup_keeps_a_hangup_ignored_the_run_goes_on(data, tmp_path):
    ignored = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup does
    p, out = start_run(tmp_path, data, "--max_iters=60", preexec_fn=ignored)
    p.send_signal(signal.SIGHUP)  # the terminal closes
    rest = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and f"done: python experiments/plot.py {out}" in rest
    assert ckpt_iter(out) == 60


@pytest.mark.slow
def test_a_closed_stdout_stops_like_a_signal_kill_9_resumes_from_ckpt(data, tmp_path):
    p, out = start_run(tmp_path, data, "--log_interval", "1")
    p.stdout.close()  # | head: the reader has gone
    # a batch or two later
    assert p.wait(timeout=60) == 128 + signal.SIGPIPE and ckpt_iter(out) >= 2
    p, out = start_run(tmp_path, data, "--ckpt_interval", "10", "--resume")
    time.sleep(0.5)
    p.kill()  # kill -9: no checkpoint now; the last one stands, and its log
    p.wait()
    done, rows = ckpt_iter(out), [int(r["iter"]) for r in log_rows(out)]
    assert rows == list(range(1, len(rows) + 1)) and done - len(rows) in (0, 10)
    assert train.main(["--out_dir", out, "--resume", "--max_iters", str(done + 5)]) == 0
    assert [int(r["iter"]) for r in log_rows(out)] == list(range(1, done + 6))


@pytest.mark.slow
def test_ddp_with_two_processes_trains_as_one(data, tmp_path):
    """2 CPU processes (gloo) split each batch; the log holds each whole batch's loss,
    with dropout 0 one process's. Process r draws dropout from seed + r (ckpt.pt holds
    it as one process of that seed and half the batch); --time_limit stops them all."""
    flags = TINY + ["--data_dir", data, "--max_iters", "6", "--device", "cpu"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node=2", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def ddp(name, *more, said="iter 6/6"):
        cmd = torchrun + flags + ["--out_dir", str(tmp_path / name), *more]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
        assert r.stdout.count(said) == 1, r.stdout
        return str(tmp_path / name)

    rng_states = lambda out: torch.load(f"{out}/ckpt.pt", weights_only=True)["rng"]
    one = str(tmp_path / "one")
    assert train.main(flags + ["--dropout", "0", "--out_dir", one]) == 0
    for a, b in zip(losses(ddp("ddp", "--dropout", "0")), losses(one), strict=True):
        assert a[0] == b[0] and abs(float(a[1]) - float(b[1])) < 1e-5, (a, b)
        assert bool(a[2]) == bool(b[2])
    streams = rng_states(ddp("ddp-dropout", "--seed", "5"))
    for rank in (0, 1):
        half = str(tmp_path / f"half{rank}")
        more = ["--seed", str(5 + rank), "--batch_size", "2", "--out_dir", half]
        assert train.main(flags + more) == 0
        assert torch.equal(streams[rank]["torch"], rng_states(half)[0]["torch"]), rank
    stop = "--time_limit: stopped at batch"  # every process at one batch, in time
    # (from torchrun's start: 15 s before the first batch on 2 busy cores)
    ddp("limit", "--max_iters=9999", "--time_limit=30s", said=stop)


# ---- modes and random streams
def test_validation_and_generation_run_without_dropout_and_keep_the_mode(data):
    model = dev(scrambled(tiny_model("sa", vocab=64), 0.3))
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.9  # in training mode this would change every logit
    flags = ["--batch_size", "4", "--block_size", "16", "--eval_batches", "2"]
    args = machinery.build_parser(train.SETTINGS).parse_args(flags)
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16)
    ctx = contextlib.nullcontext()
    prompt = torch.tensor([[1, 2, 3]], device=DEVICE)
    val_loss = train.evaluate(model, args, val, DEVICE, ctx)
    greedy = generated(model, prompt, 6, temperature=0)
    for training in (False, True, False):
        model.train(training)
        assert train.evaluate(model, args, val, DEVICE, ctx) == val_loss, training
        assert model.training == training
        assert torch.equal(generated(model, prompt, 6, temperature=0), greedy), training
        assert model.training == training


def test_processes_build_one_model_from_seed_and_draw_from_seed_plus_rank(monkeypatch):
    cfg = Config(50, 8, 16, 32, 2, 4, mixer="random-fixed")  # its R: drawn too
    args = machinery.build_parser(train.SETTINGS).parse_args(["--seed", "7"])
    torch.manual_seed(7)
    want = Transformer(cfg).state_dict()
    resumed = [{"torch": torch.manual_seed(s).get_state()} for s in (1, 2, 3)]
    for rank in (0, 1, 2):
        monkeypatch.setattr(machinery, "RANK", rank)
        torch.manual_seed(1000)
        model, adamw = train.build_model(cfg, args, torch.device("cpu"))
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, want[name]), (rank, name)
        stream = torch.get_rng_state()  # the global RNG, dropout's, from seed + RANK
        torch.manual_seed(7 + rank)
        assert torch.equal(stream, torch.get_rng_state()), rank
        scaler = torch.amp.GradScaler("cpu", enabled=False)  # resumed: its own stream
        ckpt = dict(data=None, model=want, optimizer=adamw.state_dict(), rng=resumed)
        ckpt["scaler"] = scaler.state_dict()
        machinery.restore(ckpt, None, model, adamw, scaler, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), resumed[rank]["torch"]), rank


# ---- on a GPU: the captured step is the eager step
@on_cuda
@pytest.mark.device
@pytest.mark.parametrize(
    "mixer, sizes",  # sa-1: batch x heads 64 < 256, atomics unless deterministic
    [(m, {}) for m in PAPER]
    + [(m, dict(l=128, d=128, n_head=1, batch=64)) for m in ("sa", "she", "me")]
    + [("sa", dict(l=128, d=128, n_head=32, batch=64))],
    ids=[*PAPER, "sa-1-table1", "she-table1", "me-table1", "sa-32-table1"],
)
def test_captured_step_equals_the_eager_step_bit_for_bit(mixer, sizes):
    """3 eager warm-up steps, the capture, 5 replays, dropout and clipping on, float32
    and bf16: losses, parameters, AdamW's state and the CUDA generator to the bit; also
    at Table 1's shapes (l = d = 128, batch 64; 2 layers)."""
    torch.manual_seed(0)
    batch, l = sizes.pop("batch", 4), sizes.get("l", 16)
    data = torch.randint(0, 50, (9, batch, l + 1)).to(DEVICE)
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in data]
    for dtype in ("float32", "bfloat16"):
        ends = []
        for captured in (False, True):
            model = tiny_model(mixer, **sizes).train().to(DEVICE)  # (dropout on)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            ctx, scaler = machinery.precision(DEVICE, dtype)
            step = functools.partial(
                train.train_step, model, opt, scaler, ctx, grad_clip=0.5
            )
            step = machinery.CapturedStep(step, opt) if captured else step
            loss = torch.stack([step(x, y) for x, y in batches])
            moments = [t for state in opt.state.values() for t in state.values()]
            rng = torch.cuda.get_rng_state(DEVICE)
            ends.append((loss, list(model.parameters()) + moments, rng))
        (loss_e, tensors_e, rng_e), (loss_g, tensors_g, rng_g) = ends
        assert torch.equal(loss_g, loss_e) and torch.equal(rng_g, rng_e), dtype
        assert all(torch.equal(a, b) for a, b in zip(tensors_g, tensors_e)), dtype


@on_cuda
@pytest.mark.device
def test_a_capture_cuda_fails_stops_in_one_line():
    """A step reading its loss (.item(): CUDA refuses a sync in a capture), in a process
    of its own: one line naming the step's error, exit 1, what train.py promises (CUDA
    may leave its generator capturing: nothing random can run after it)."""
    code = f"""import functools, torch, machinery, train
cuda = torch.device({str(DEVICE)!r})
args = machinery.build_parser(train.SETTINGS).parse_args([])  # train.py's AdamW
model, opt = train.build_model(train.Config(50, 16, 16, 32, 2, 4), args, cuda)
ctx, scaler = machinery.precision(cuda, "float32")
eager = functools.partial(train.train_step, model, opt, scaler, ctx)
x = torch.randint(0, 50, (4, 16), device=cuda)
step = machinery.CapturedStep(lambda x, y: eager(x, y).item(), opt)
for _ in range(4):  # 3 eager warm-up calls, then the recording
    step(x, x)"""
    rc, out, err = run_script("-c", code)
    assert (rc, out, err.count("\n")) == (1, "", 1), (rc, out, err)
    assert err.startswith("error: the step cannot be captured in a CUDA graph (")
    assert "previous error" not in err, err  # (capture_end's, after the step's)


# ---- CUDA's decisions, checked on the CPU (fir.py's: its default-path and ieee tests)
@pytest.mark.filterwarnings("ignore:CUDA is not available")  # (autocast on "cuda")
def test_cuda_gets_fused_adamw_the_captured_step_tf32_pinning(monkeypatch, tf32):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    parser = machinery.build_parser(train.SETTINGS)
    parse = lambda *flags: parser.parse_args(["--out_dir=r", *flags])
    monkeypatch.setattr(Transformer, "to", lambda model, device: model)
    cfg = Config(30, 8, 8, 16, 1, 2)
    adamw = [train.build_model(cfg, parse(), d)[1] for d in (cuda, cpu)]
    kinds = [(a.defaults["fused"], a.defaults["capturable"]) for a in adamw]
    assert kinds == [(True, False), (False, False)]  # (capturable: the capture's)
    monkeypatch.setattr(torch.cuda, "Stream", object)
    hows = []  # run.json's computed, each step named in it
    step = functools.partial(train.train_step, None)

    def make(device, *flags):
        hows.append({})
        return machinery.make_step(step, "AdamW", parse(*flags), device, hows[-1])

    eager = ("--no-cuda_graph", "--dtype=float16")
    steps = [make(cuda), make(cpu)] + [make(cuda, flag) for flag in eager]
    monkeypatch.setattr(machinery, "WORLD", 2)  # DDP
    steps.append(make(cuda))
    assert steps[1:] == [step] * 4  # eager: the step itself, nothing around it
    assert [how["step"] for how in hows] == ["CapturedStep"] + ["eager"] * 4
    assert (steps[0].step, steps[0].optimizer, steps[0].how) == (step, "AdamW", hows[0])
    matmul, cudnn = tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    seen = []  # TF32's flags, autocast's cache inside it (CUDA graphs want none)
    for device, tf32 in ((cpu, True), (cuda, True), (cuda, False)):
        with machinery.precision(device, "bfloat16", tf32)[0]:
            cache = torch.is_autocast_cache_enabled()
        seen.append((matmul.allow_tf32, cudnn.allow_tf32, cache))
    assert seen == [(False, False, True), (True, True, False), (False, False, False)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"the GPU {d}")
    capability = [(9, 0)]  # an H100's; a T4's (7, 5) has no TF32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability[0])
    how = lambda d, *flags: machinery.computed(d, parse(*flags))["float32_matmul"]
    assert [how(cuda), how(cuda, "--no-tf32"), how(cpu)] == ["tf32", "ieee", "ieee"]
    capability[0] = (7, 5)
    assert how(cuda) == "ieee"
    capability[0] = (8, 0)
    assert machinery.computed(cuda, parse())["fir_matmul"] == "ieee"  # (TF32 elsewhere)
    monkeypatch.setattr(fir, "ALLOW_TF32", True)  # the FIR's products follow TF32
    whole = dict(device="cuda", torch=torch.__version__, dtype="bfloat16")
    whole |= dict(float32_matmul="tf32", fir_matmul="tf32", device_name="the GPU cuda")
    assert machinery.computed(cuda, parse("--dtype=bfloat16")) == whole
    ctx, scaler = machinery.precision(cpu, "float16")  # the loss scaled on the CPU
    assert ctx.fast_dtype == torch.float16 and scaler.scale(torch.ones(())) == 2**16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32: no autocast (torch warns of one)
        machinery.precision(cuda, "float32")  # TF32 on unless --no-tf32
    assert matmul.allow_tf32 and cudnn.allow_tf32
    pinned, moved = [], []  # (last: every tensor's `to` stubbed)
    to = lambda t, d, non_blocking: moved.append((d.type, non_blocking)) or t
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)
    for device in (cuda, cpu):
        train.get_batch(np.arange(20), torch.tensor([0, 5]), 4, device)
    assert len(pinned) == 1 and moved == [("cuda", True), ("cpu", False)]


def test_cuda_clock_waits_a_step_unusable_cuda_says_why(monkeypatch, capsys, tmp_path):
    """CUDA stubbed. The step clock records an event a step and reads the host's clock
    once the GPU has done the step before: one step ahead, no more. run.json keeps the
    peak reserved (a captured step's pool); the pace is over the n - 1 intervals between
    n batches' ends. --device auto on a driver too old or a GPU the build cannot run
    says so and runs on the CPU; a LOCAL_RANK with no GPU stops."""
    args = argparse.Namespace(time_limit=None, overwrite=False, out_dir=str(tmp_path))
    vars(args).update(log_interval=1, max_iters=1, lr=0.1)
    model = torch.nn.Linear(2, 2)
    adamw, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu")
    with machinery.RunFolder(str(tmp_path)):
        on_cpu = dict(computed=dict(device="cpu"), params=dict(total=6))
        progress = machinery.Progress(args, None, 0.0, on_cpu)
        progress.device = torch.device("cuda")
        allocated = (2**30, "peak CUDA memory allocated")
        monkeypatch.setattr(machinery, "peak_memory", lambda device: allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 3 * 2**30)
        progress.save(1, model, adamw, scaler)
        assert progress.finish(1, stop=False) == 0
    info = json.loads((tmp_path / "run.json").read_text())
    assert (info["peak_memory_mb"], info["peak_reserved_mb"]) == (1024.0, 3072.0)
    assert f"{allocated[1]}: 1.00 GB, reserved 3.00 GB\n" in capsys.readouterr().out
    vars(args).update(log_interval=4, max_iters=8, batch_size=10, block_size=100)
    progress = machinery.Progress(args, None, 0.0, on_cpu)  # (lr: log.csv's)
    # 4 batches' ends, the first at the log point's (on CUDA it ends once queued)
    progress.since, progress.times = progress.t0 + 10, [10.0, 11.0, 12.0, 13.0]
    progress.log(4, None)
    assert "| 1.0k tok/s |" in capsys.readouterr().out
    assert [row.split(",")[4] for row in progress.rows] == ["1000.0"] * 4
    seen, events = [], itertools.count(1)

    class Event:  # torch.cuda.Event: numbered as made, its calls recorded in `seen`
        def __init__(self):
            n = next(events)
            self.record = lambda: seen.append(f"record {n}")
            self.synchronize = lambda: seen.append(f"wait {n}")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(machinery.time, "time", lambda: seen.append("clock") or 0.0)
    clock = machinery.StepClock(torch.device("cuda"))
    for _ in range(3):
        clock.now()
    waits = ["record 2", "wait 1", "clock", "record 3", "wait 2", "clock"]
    assert seen == ["record 1", "clock", *waits]
    seen.clear()
    machinery.StepClock(torch.device("cpu")).now()
    assert seen == ["clock"]
    seen.clear()  # bench.queued: k steps between two waits, the host's clock read first
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: seen.append("wait"))
    monkeypatch.setattr(time, "perf_counter", lambda: seen.append("clock") or len(seen))
    assert bench.queued(lambda: seen.append("step"), 2) == (3 / 2, 5 / 2)
    assert seen == ["wait", "clock", "step", "step", "clock", "wait", "clock"]
    monkeypatch.undo()
    old = "CUDA initialization: The NVIDIA driver on your system is too old (11040)"

    def too_old():
        warnings.warn(f"{old}.\nPlease update your GPU driver")
        return False

    monkeypatch.setattr(torch.cuda, "is_available", too_old)
    assert machinery.pick_device("auto") == torch.device("cpu")
    note = f"note: CUDA is unusable here ({old}.); --device auto runs on the CPU\n"
    assert capsys.readouterr().out == note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA at all
    assert machinery.pick_device("auto") == torch.device("cpu")
    assert capsys.readouterr().out == ""
    ones = torch.ones
    no_image = "CUDA error: no kernel image is available for execution on the device"

    def kernel(*a, device):
        if device.type == "cuda":
            raise RuntimeError(f"{no_image}\nCUDA kernel errors might be ...")
        return ones(*a, device=device)

    monkeypatch.setattr(torch, "ones", kernel)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (6, 1))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_90"])
    assert machinery.pick_device("auto") == torch.device("cpu")
    says = f"(RuntimeError: {no_image}): its compute capability is 6.1, the build's "
    says += "kernels are for sm_75 sm_90; install a PyTorch build that lists sm_61"
    assert says in capsys.readouterr().out
    assert says in machinery.no_kernel(torch.device("cuda:0"))
    monkeypatch.setattr(machinery, "LOCAL_RANK", 2)  # torchrun's third process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("auto", "cuda"):
        said = error_line(capsys, machinery.pick_device, name)
        assert said == "error: LOCAL_RANK 2 has no GPU: start 2 processes at most"


def test_a_capture_that_fails_in_python_runs_eagerly_in_cuda_stops(monkeypatch, capsys):
    """CUDA stubbed. A recording (call 4) that fails in Python, CUDA ending the capture:
    the run goes on eagerly (the same losses, parameters), says so in a line and in
    run.json, frees the pool, AdamW capturable for the recording alone. One that works:
    the cache emptied first (torch.cuda.graph's way). Where CUDA fails the capture
    (capture_end raises), the run stops, one line naming the first error."""
    for name in ("Stream", "current_stream", "stream", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, mock.MagicMock())
    graphs = []  # each recording's graph
    recording = lambda: graphs.append(mock.Mock()) or graphs[-1]
    monkeypatch.setattr(torch.cuda, "CUDAGraph", recording)
    how = {"step": "CapturedStep"}  # run.json's computed
    torch.manual_seed(0)
    batches = torch.randint(0, 50, (8, 2, 17))
    ends, capturable = [], []
    for captured in (False, True):
        model = tiny_model("he")
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ctx, scaler = machinery.precision(torch.device("cpu"), "float32")
        eager = functools.partial(train.train_step, model, adamw, scaler, ctx)
        calls = itertools.count(1)

        def step(x, y):  # the 4th call records: the gradients, then a refusal
            if next(calls) == 4:
                capturable.append(adamw.param_groups[0]["capturable"])
                model(x, y)[1].backward()
                raise ValueError("not recordable\n(more)")
            return eager(x, y)

        run = machinery.CapturedStep(step, adamw, how) if captured else eager
        ends.append([torch.stack([run(b[:, :-1], b[:, 1:]) for b in batches])])
        ends[-1] += model.parameters()
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    why = "ValueError: not recordable"
    line = f"the step cannot be captured in a CUDA graph ({why}); it runs eagerly\n"
    assert capsys.readouterr().out == line
    assert how == {"step": f"eager, the capture failed ({why})"}
    assert len(graphs) == 1 and graphs[0].reset.called  # (never recorded again)
    assert torch.cuda.empty_cache.called
    assert capturable == [True] and not adamw.param_groups[0]["capturable"]
    order = mock.Mock()  # the cache's calls and the graph's, in order
    monkeypatch.setattr(torch.cuda, "empty_cache", order.empty_cache)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: order)
    run = machinery.CapturedStep(lambda x, y: torch.zeros(()), adamw, {})
    for _ in range(4):  # the recording's blocks in a cache of the graph's alone
        run(*batches[0].split(16, dim=1))
    calls = [name for name, *_ in order.mock_calls]
    assert calls == ["empty_cache", "capture_begin", "capture_end", "replay"]
    assert not adamw.param_groups[0]["capturable"]  # (bench's eager steps after it)
    first = "CUDA error: operation not permitted when stream is capturing"
    for body_error in (RuntimeError(first), None):
        calls = itertools.count(1)

        def step(x, y):  # (the 4th call records)
            if next(calls) == 4 and body_error:
                raise body_error
            return torch.zeros(())

        run = machinery.CapturedStep(step, adamw, {})
        for _ in range(3):
            run(*batches[0].split(16, dim=1))
        end = RuntimeError("operation failed due to a previous error during capture")
        failing = lambda: mock.Mock(**{"capture_end.side_effect": end})
        monkeypatch.setattr(torch.cuda, "CUDAGraph", failing)
        said = error_line(capsys, run, *batches[0].split(16, dim=1))
        shown = first if body_error else str(end)
        assert f"(RuntimeError: {shown}); --no-cuda_graph runs it eagerly" in said


# ======== sampling (sample.py), and end to end ========


@pytest.fixture(scope="module")
def prepared(clean, tmp_path_factory):
    """The made-up books' data folder (prepare_data.py's, from the data tests), and a
    tiny sa run trained on it (dropout 0.1, the default)."""
    folder = tmp_path_factory.mktemp("prepared")
    assert run(folder, str(clean[0]), "--mixer=sa", "--max_iters=30") == 0
    return str(clean[0]), str(folder / "run")


def test_sample_prints_a_character_split_over_tokens_once_whole(prepared, monkeypatch):
    enc = machinery.load_tokenizer(prepared[0])
    # a token each byte, the last character cut
    ids = [enc.encode_single_token(bytes([c])) for c in "é€ ok€".encode()[:-2]]
    model, ckpt = sample.load_model(prepared[1], torch.device("cpu"))

    class Screen(io.StringIO):  # a terminal: it shows what was written at each flush
        shown = ""
        reconfigure = lambda self, errors: None  # (sample.py's: '?' for the unshowable)

        def flush(self):
            self.shown = self.getvalue()

    screen = Screen()
    seen = []  # what it showed as each token was asked for

    def tokens(*a, **kw):
        for i in ids:
            seen.append(screen.shown)
            yield torch.tensor([[i]])

    monkeypatch.setattr(model, "generate", tokens)
    monkeypatch.setattr(sample, "load_model", lambda *a: (model, ckpt))
    monkeypatch.setattr(sys, "stdout", screen)
    argv = ["--out_dir", prepared[1], "--prompt", "", "--max_new_tokens", "8"]
    assert sample.main(argv) == 0
    # (what a cut character becomes at the end)
    assert screen.getvalue() == "é€ ok\ufffd\n"
    assert seen[-1] == "é€ ok"  # each piece shown as it came, not at the end


def test_sample_goes_on_from_a_long_prompts_last_l_tokens(prepared, tmp_path, capsys):
    enc = machinery.load_tokenizer(prepared[0])
    l = 8
    ckpt = torch.load(prepared[1] + "/ckpt.pt")
    g = torch.Generator().manual_seed(1)
    for w in ckpt["model"].values():
        w.normal_(0, 0.3, generator=g)  # distinct logits: greedy choices are no ties
    torch.save(ckpt, tmp_path / "ckpt.pt")
    prompt = "the little old fox sang over the river and the miller found the moon"
    ids = enc.encode(prompt + " under a garden")
    head = enc.decode(ids[:l])  # the first and the last l tokens, as text
    tail = enc.decode(ids[-l:])
    assert len(ids) > l and enc.encode(head) == ids[:l] and enc.encode(tail) == ids[-l:]

    def greedy(prompt):  # the new text of a greedy sample, and what was said on stderr
        argv = ["--out_dir", str(tmp_path), "--prompt", prompt, "--temperature=0"]
        assert sample.main(argv + ["--max_new_tokens=8"]) == 0
        said = capsys.readouterr()
        return said.out[len(prompt) :], said.err

    new, err = greedy(enc.decode(ids))
    assert "it goes on from the last l" in err
    assert new == greedy(tail)[0]
    assert new != greedy(head)[0]  # the windows differ: it can fail


def test_the_samples_of_a_call_differ_and_a_seed_gives_them_again(prepared, capsys):
    def samples(*flags):
        argv = ["--out_dir", prepared[1] + "/ckpt.pt", "--max_new_tokens=12"]
        assert sample.main([*argv, "--num_samples=3", *flags]) == 0
        return capsys.readouterr().out.split("-" * 40 + "\n")

    first = samples("--seed=5")
    assert len(set(first)) == 3  # each sample draws on from the one before
    assert samples("--seed=5") == first
    assert samples("--seed=6") != first
    greedy = samples("--temperature=0", "--seed=6")
    assert len(set(greedy)) == 1 and greedy == samples("--temperature=0")
    # taps.py reads the model of load_model: dropout (0.1 here) is off
    model, _ = sample.load_model(prepared[1], torch.device("cpu"))
    idx = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_sample_refuses_what_it_cannot_use_in_one_line(prepared, tmp_path, capsys):
    data, out = prepared
    other = tmp_path / "other"
    other.mkdir()
    tokenizer = open(os.path.join(data, "tokenizer.tiktoken"), "rb").read()
    (other / "tokenizer.tiktoken").write_bytes(tokenizer[:-20])
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    cases = {  # flags: what the line says
        "--top_p=1.5": "top_p must be in (0, 1], got 1.5",
        "--temperature=inf": "finite number >= 0 (0 is greedy), got inf",
        "--seed=-1": "argument --seed: must be in [0, 9223372036854775808), got -1",
        "--num_samples=0": "argument --num_samples: must be in [1, inf), got 0",
        "--max_new_tokens=-1": "argument --max_new_tokens: must be in [0, inf), got -1",
        f"--data_dir={other}": f"{other}/tokenizer.tiktoken is not the run's tokenizer",
        f"--out_dir={tmp_path}/none": f"no checkpoint {tmp_path}/none/ckpt.pt",
        f"--out_dir={ROOT}/results/logs/m2l32/me": "results/ keeps runs' logs, not",
        f"--out_dir={tmp_path}/bad.pt": "it is damaged",
    }
    for flag, says in cases.items():
        assert says in error_line(capsys, sample.main, ["--out_dir", out, flag]), flag


def test_a_mixer_of_your_own_trains_and_samples(prepared, tmp_path, monkeypatch):
    (tmp_path / "mymixers.py").write_text(USER_MIXER)  # a module of one's own
    monkeypatch.syspath_prepend(str(tmp_path))
    out = str(tmp_path / "mean")
    flags = ["--mixer=mymixers.Mean", "--max_iters=3", f"--out_dir={out}"]
    assert run(tmp_path, prepared[0], *flags) == 0
    assert sample.main(["--out_dir", out, "--max_new_tokens", "5"]) == 0


@pytest.mark.slow
def test_end_to_end_the_readmes_commands(prepared, tmp_path):
    rc, out, err = run_script("train.py", "--n_layer", "0")
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith("error: argument --n_layer: must be in [1, inf), got 0")
    for mixer in ("sa", "me"):
        flags = [f"--mixer={mixer}", f"--data_dir={prepared[0]}", "--max_iters=60"]
        flags += ["--lr=3e-3", f"--out_dir={tmp_path / mixer}"]
        rc, out, err = run_script("-X", "importtime", "train.py", *TINY, *flags)
        lines = [line for line in err.splitlines() if line.startswith("import ")]
        imported = {line.split("|")[-1].strip() for line in lines}
        # the house: train.py stands on the machinery and the model, not the data script
        assert {"extractor", "fir", "synthesizer", "machinery"} <= imported
        assert not {"prepare_data", "matplotlib"} & imported
        costs = [float(r["train_loss"]) for r in log_rows(str(tmp_path / mixer))]
        assert rc == 0 and len(costs) == 60
        assert np.mean(costs[-10:]) < np.mean(costs[:10]) - 0.3  # it learns
    command = f"{sys.executable} sample.py --out_dir {tmp_path / 'me'}"
    command += " --max_new_tokens 500 | head -c 20"
    r = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
    assert r.stdout.startswith("Once upon a time") and len(r.stdout) == 20
    assert "Traceback" not in r.stderr


# ======== experiments/reproduce.py: Table 1's runs at once, the check, what it copies
def _run(folder, mixer, losses, n_head=1, val_every=5, seed=1, data_seed=1, **more):
    """A run folder as train.py writes it, made-up costs from batch `start` on (its
    validation: cost - 0.5); `more`: start, data, device (run.json's), config's."""
    start = more.pop("start", 1)
    data = more.pop("data", None)
    cfg = dict(mixer=mixer, n_head=n_head, n_layer=2, block_size=32, vocab_size=50)
    args = dict(seed=seed, data_seed=data_seed, device=more.pop("device", "cpu"))
    run = {"config": cfg | more, "args": args, "params": {"mixers": 7}, "data": data}
    os.makedirs(folder, exist_ok=True)  # (reproduce.py makes its runs' folders)
    json.dump(run, open(f"{folder}/run.json", "w"))
    val = lambda i, x: repr(x - 0.5) if i % val_every == 0 else ""
    row = lambda i, x: f"{i},{x!r},{val(i, x)},0.001,{1000 + i % 3},{i / 10}"
    rows = [row(i, x) for i, x in enumerate(losses, start)]
    # 7: a row half-written, as it runs
    open(f"{folder}/log.csv", "w").write(machinery.LOG_HEADER + "\n".join([*rows, "7"]))
    return str(folder)


FALLING = [5 - i / 100 for i in range(1, 101)]  # a run's made-up costs, batches 1-100


def test_reproduce_without_cuda_says_so_touching_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results, work = tmp_path / "results", tmp_path / "work"
    _run(results / "logs" / "table1" / "me", "me", FALLING[:40], device="cuda:0")
    before = files(results)
    for argv in ([], ["--check"], ["me", "--device=cuda:1"]):
        argv += [f"--results={results}", f"--work={work}"]
        assert "no CUDA device" in error_line(capsys, reproduce.main, argv)
    assert files(results) == before and not work.exists()


def test_reproduce_copies_a_run_as_long_same_device_that_ended_well(tmp_path, children):
    results, work = tmp_path / "results", tmp_path / "work"
    committed = results / "logs" / "table1" / "me"
    _run(committed, "me", FALLING[:40], device="cuda:0")
    log = committed / "log.csv"
    (committed / "log.csv.gz").write_bytes(gzip.compress(log.read_bytes()))
    os.remove(log)
    argv = ["me", "--device=cpu", f"--results={results}", f"--work={work}"]
    before = files(results)
    for batches, device, code in ((39, "cuda:0", 0), (40, "cpu", 0), (99, "cuda", 1)):
        children.batches, children.device = batches, device
        children.codes = {"me": code}
        assert reproduce.main(argv) == code
        assert files(results) == before and children.redrawn == [], (batches, device)
    children.batches, children.device, children.codes = 40, "cuda", {}
    assert reproduce.main(argv) == 0 and children.redrawn == [str(results)]  # copied
    assert json.load(open(committed / "run.json"))["args"]["device"] == "cuda"
    children.batches, children.device = 20, "cpu"
    assert reproduce.main(argv + ["--replace"]) == 0 and len(children.redrawn) == 2
    assert reproduce.read_log(committed)["iter"].tolist() == list(range(1, 21))
    assert json.load(open(committed / "run.json"))["args"]["device"] == "cpu"


@pytest.fixture
def children(monkeypatch):
    """reproduce.py's train.py children, made up, on a made-up GPU ("free" GiB): each
    leaves a run of `batches` on `device` and its `console` text, and trains until the
    next one-second sleep ends the oldest running one (exit: `codes`, else 0; `stop`:
    the sleep is a Ctrl-C). `started`: who ran as each started; `redrawn`: redraws;
    `meanwhile`: calls made once, as the next child starts."""
    rec = types.SimpleNamespace(free=16, codes={}, console={}, stop=False, redrawn=[])
    rec.batches, rec.device, rec.meanwhile = 100, "cuda:0", []
    rec.started, rec.running, rec.cmds, rec.signals, rec.preexec = [], [], [], [], []

    class Child:
        def __init__(self, cmd, stdout, stderr, preexec_fn):
            out = os.path.dirname(stdout.name)  # its console is out/console.txt
            self.out, self.name, self.returncode = out, os.path.basename(out), None
            _run(out, "me", FALLING[: rec.batches], device=rec.device)
            rec.cmds.append(cmd)
            rec.preexec.append(preexec_fn)
            rec.running.append(self)
            rec.started.append([c.name for c in rec.running])
            while rec.meanwhile:
                rec.meanwhile.pop()()

        def poll(self):
            return self.returncode

        def end(self, code):
            with open(os.path.join(self.out, "console.txt"), "a") as f:
                f.write(rec.console.get(self.name, "done\n"))
            self.returncode = code
            rec.running.remove(self)

        def wait(self):
            if self.returncode is None:
                self.end(rec.codes.get(self.name, 0))
            return self.returncode

        def send_signal(self, signum):  # as Popen's: nothing if it has exited
            if self.returncode is None:
                rec.signals.append((self.name, signum))
                self.end(128 + signum)

    def sleep(seconds):
        assert rec.running, "it waits while no run is running"
        if rec.stop:
            raise KeyboardInterrupt
        rec.running[0].end(rec.codes.get(rec.running[0].name, 0))

    monkeypatch.setattr(reproduce.subprocess, "Popen", Child)
    monkeypatch.setattr(time, "sleep", sleep)  # (reproduce.time.sleep)
    redraw = lambda results: rec.redrawn.append(results) or True
    monkeypatch.setattr(reproduce, "redraw", redraw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Made-Up GPU")
    free = lambda d=None: (rec.free * 2**30, 0)  # bytes free, (total)
    monkeypatch.setattr(torch.cuda, "mem_get_info", free)
    return rec


def test_reproduce_trains_as_many_at_once_as_free_gpu_memory_holds(tmp_path, children):
    # the training peaks on an H200, MiB: results/table1/bench_h200.txt, section 6
    peak_mib = {"sa-1": 1610, "sa-32": 1610, "she": 2453, "he": 1739, "we": 1736}
    peak_mib["me"] = 1294

    def at_once(free, *flags):
        """The runs running as each started, on a GPU of `free` GiB free."""
        children.free, children.started, children.preexec = free, [], []
        work, results = tmp_path / f"work{free}{flags}", tmp_path / f"res{free}{flags}"
        assert reproduce.main([f"--work={work}", f"--results={results}", *flags]) == 0
        assert sorted(os.listdir(results / "logs" / "table1")) == sorted(reproduce.RUNS)
        assert children.preexec == [reproduce.die_with_parent] * 6  # kill -9: they die
        return children.started

    assert [len(s) for s in at_once(3)] == [1] * 6  # a 4 GB card: one at a time
    assert len(at_once(16)[-1]) == 6  # all six (~15 GiB)
    for free in 8, 12:  # more than one, never more than their peaks fit
        started = at_once(free)
        assert 1 < max(map(len, started)) < 6
        for names in started:  # each model's peak and 0.3 GiB of CUDA context
            assert sum(peak_mib[n] / 1024 + 0.3 for n in names) <= free
    assert max(map(len, at_once(140, "--jobs=2"))) == 2  # --jobs says
    assert len(at_once(3, "--jobs=6")[-1]) == 6
    assert len(at_once(0, "--device=cpu")[-1]) == 6  # on the CPU: all at once


def test_reproduce_stopped_stops_each_child_starts_no_more(tmp_path, capsys, children):
    children.free, children.stop = 8, True  # Ctrl-C (or kill) as the pool waits
    argv = [f"--work={tmp_path / 'work'}", f"--results={tmp_path / 'results'}"]
    assert reproduce.main(argv) == 130
    first = children.started[-1]
    assert 1 < len(first) < 6 and len(children.started) == len(first)  # none later
    assert children.signals == [(name, signal.SIGTERM) for name in first]
    assert children.running == [] and not (tmp_path / "results").exists()
    err = capsys.readouterr().err
    stopped = f"stopped: each run at its last checkpoint in {tmp_path / 'work'}"
    assert err == f"{stopped}; the same command goes on from there\n"


def test_reproduce_a_child_oom_or_stopped_says_so_uncopied(tmp_path, capsys, children):
    work, results = tmp_path / "work", tmp_path / "results"
    argv = [f"--work={work}", f"--results={results}"]
    children.codes = {"she": 1}  # as train.py ends when CUDA runs out of memory
    oom = "error: out of memory at batch 3: use a smaller --batch_size or --block_size"
    oom += "; the last checkpoint, out/she/ckpt.pt, stays\n"
    children.console = {"she": "training from batch 0\n" + oom}
    assert reproduce.main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith("she: ")][-1]
    assert "run fewer at once (--jobs 1)" in said and "not copied" in said
    assert not (results / "logs" / "table1" / "she").exists()
    err = error_line(capsys, reproduce.main, argv + ["--check"])
    assert err.startswith("error: the check's she run ran out of memory: run fewer")
    assert "(--jobs 1)" in err
    children.console = {"she": "error: cannot read data/train.bin\n"}
    assert reproduce.main(argv) == 1  # the earlier call's out of memory is not this
    said = [line for line in capsys.readouterr().out.splitlines() if "she: " in line]
    assert said[-1].startswith("she: failed (exit 1); not copied, see ")
    stopped = {"sa-1": 128 + signal.SIGINT, "sa-32": 128 + signal.SIGTERM}
    children.codes = stopped | {"she": 128 + signal.SIGHUP, "he": -signal.SIGKILL}
    argv = [f"--work={tmp_path / 'again'}", f"--results={tmp_path / 'fresh'}"]
    assert reproduce.main(argv) == 1  # each stopped at a checkpoint, its run whole
    assert sorted(os.listdir(tmp_path / "fresh" / "logs" / "table1")) == ["me", "we"]
    out = capsys.readouterr().out
    for name, code in children.codes.items():
        assert f"{name}: failed (exit {code}); not copied" in out


def test_reproduce_check_fails_a_gap_either_way(tmp_path, children, capsys):
    results = tmp_path / "results"
    argv = ["me", f"--work={tmp_path / 'work'}", f"--results={results}", "--check"]
    said = []  # the check started again as the first's run trains: refused
    again = lambda: said.append(error_line(capsys, reproduce.main, argv))
    children.meanwhile.append(again)
    for shift, rc in ((0.04, 0), (-0.04, 0), (0.1, 1), (-0.1, 1)):
        costs = [c + (shift if 40 < i <= 50 else 0) for i, c in enumerate(FALLING, 1)]
        _run(results / "logs" / "table1-cpu" / "me", "me", costs)
        assert reproduce.main(argv) == rc, shift  # here (5 - i / 100) minus the CPU's
        table = (results / "gpu" / "check-me.txt").read_text().splitlines()
        assert table[-2].startswith("me ") and f"{-shift:+.4f}" in table[-2]
        assert table[-1].startswith("passed" if rc == 0 else "FAILED")
    busy = f"error: {tmp_path / 'work'} is in use by another reproduce.py: wait for it"
    assert len(said) == 1 and said[0].startswith(busy)


def test_reproduce_check_names_its_device_keeps_the_six_models_file(tmp_path, children):
    results = tmp_path / "results"
    argv = [f"--work={tmp_path / 'work'}", f"--results={results}", "--check"]
    for name in reproduce.RUNS:  # as the runs here (children)
        _run(results / "logs" / "table1-cpu" / name, name[:2], FALLING)
    assert reproduce.main(argv) == 0
    six = (results / "gpu" / "check.txt").read_bytes()
    head = six.decode().splitlines()[0]
    assert head == f"device cuda (Made-Up GPU), torch {torch.__version__}"
    assert six.decode().splitlines()[-1].startswith("passed")
    assert reproduce.main(["me", *argv]) == 0
    assert reproduce.main(["he", "--device=cpu", *argv]) == 0
    assert reproduce.main(["--device=cpu", *argv]) == 0
    assert (results / "gpu" / "check.txt").read_bytes() == six  # the six's, kept
    written = sorted(os.listdir(results / "gpu"))
    assert written == ["check-cpu-he.txt", "check-cpu.txt", "check-me.txt", "check.txt"]
    head = (results / "gpu" / "check-cpu-he.txt").read_text().splitlines()[0]
    assert head == f"device cpu, torch {torch.__version__}"


def test_reproduce_refuses_bad_time_limit_or_jobs_in_a_line(tmp_path, capsys, children):
    work = tmp_path / "work"
    argv = [f"--work={work}", f"--results={tmp_path / 'results'}", "--device=cpu"]
    for bad in ("14x", "m", "40 m", "-5m", "1h30m", "2d"):
        with pytest.raises(argparse.ArgumentTypeError):
            machinery.seconds(bad)  # train.py refuses it too
        for more in ([], ["--check"]):
            flags = [f"--time_limit={bad}", *more, *argv]
            err = error_line(capsys, reproduce.main, flags)
            assert err.startswith(f"error: --time_limit {bad!r} is not a time: ")
    for bad in ("0", "-1", "two"):
        assert "--jobs" in error_line(capsys, reproduce.main, [f"--jobs={bad}", *argv])
    assert children.started == [] and not work.exists()
    for good in ("90s", "40m", "2h", "1.5h", "600"):
        machinery.seconds(good)
        assert reproduce.main(["me", f"--time_limit={good}", *argv]) == 0
        assert f"--time_limit={good}" in children.cmds[-1]


@pytest.mark.slow
def test_reproduce_redraws_table1_as_results_readme_does(tmp_path):
    logs = os.path.join(ROOT, "results", "logs", "table1")
    shutil.copytree(logs, tmp_path / "logs" / "table1")  # into a results/ of its own
    assert reproduce.redraw(str(tmp_path))
    drawn = sorted(os.listdir(tmp_path / "table1"))
    figures = ["fig8.png", "fig8_w2000.png", "fig9.png"]
    assert drawn == figures + ["medians.csv", "summary.csv", "val_loss.csv"]
    for name in drawn:  # windows of 2000 (the CSVs, fig8_w2000) and 500 (fig8)
        committed = open(os.path.join(ROOT, "results", "table1", name), "rb").read()
        assert (tmp_path / "table1" / name).read_bytes() == committed, name


@pytest.mark.slow
def test_reproduce_resumes_and_checks_against_the_cpu_runs(data, tmp_path, monkeypatch):
    results, work = tmp_path / "results", str(tmp_path / "work")
    argv = [f"--data_dir={data}", f"--work={work}", f"--results={results}"]
    argv.append("--device=cpu")
    sizes = TINY[2:16]  # TINY's sizes, without its mixer and device
    runs = {"sa-1": [*sizes, "--mixer=sa", "--n_head=1"], "me": [*sizes, "--mixer=me"]}
    # (the figures' windows of 2000 batches are longer than these runs)
    monkeypatch.setattr(reproduce, "redraw", lambda results: True)
    for n in (20, 40):  # a second call goes on from the first's checkpoints
        tiny = {k: v + [f"--max_iters={n}"] for k, v in runs.items()}
        monkeypatch.setattr(reproduce, "RUNS", tiny)
        assert reproduce.main(argv) == 0
    for name in ("sa-1", "me"):
        with gzip.open(results / "logs" / "table1" / name / "log.csv.gz", "rt") as f:
            assert [int(r["iter"]) for r in csv.DictReader(f)] == list(range(1, 41))
        console = open(os.path.join(work, name, "console.txt")).read()
        assert "training from batch 20 to 40" in console
    for name in ("sa-1", "me"):  # the "CPU runs": these models, 100 batches here
        out, cpu = tmp_path / name, results / "logs" / "table1-cpu" / name
        flags = [*runs[name], "--max_iters=100", "--device=cpu", f"--data_dir={data}"]
        assert train.main(flags + [f"--out_dir={out}"]) == 0
        os.makedirs(cpu)
        (cpu / "log.csv.gz").write_bytes(gzip.compress((out / "log.csv").read_bytes()))
    assert reproduce.main(argv + ["--check"]) == 0
    check = results / "gpu" / "check-cpu.txt"  # (the check on the CPU)
    assert "passed: every 10-batch window within 0.05" in check.read_text()
    with gzip.open(results / "logs" / "table1-cpu" / "me" / "log.csv.gz", "rt") as f:
        rows = list(csv.reader(f))
    # batch 35: its window's mean 0.06 lower on the "CPU"
    rows[35][1] = str(float(rows[35][1]) - 0.6)
    with gzip.open(results / "logs" / "table1-cpu" / "me" / "log.csv.gz", "wt") as f:
        csv.writer(f).writerows(rows)
    stale = os.path.join(work, "check", "me", "log.csv")  # a check trains anew
    rows = list(csv.reader(open(stale)))
    rows[35][1] = str(float(rows[35][1]) + 1)
    csv.writer(open(stale, "w"), lineterminator="\n").writerows(rows)
    assert reproduce.main(argv + ["--check"]) == 1
    table = check.read_text().splitlines()
    assert table[-2].startswith("me ") and "+0.0600" in table[-2]
    assert table[-1].startswith("FAILED")


# ======== experiments/gpu_check.sh: the short GPU job, known to start here ========
@pytest.mark.slow
def test_gpu_check_dry_run_reports_each_stage_one_failed_the_rest_run(data, tmp_path):
    """The GPU job on the CPU (--dry-run), its device tests broken: each stage in the
    table, that one failed, the later ones run, 7 files, the versions first."""
    script = ["bash", "experiments/gpu_check.sh", f"--data_dir={data}"]
    env = os.environ | dict(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    job = lambda *argv, **more: subprocess.run(  # more: its environment's
        [*script, *argv], cwd=ROOT, capture_output=True, text=True, env=env | more
    )
    out = tmp_path / "out"
    r = job(str(out), "--dry-run", GPU_CHECK_FAIL="device_tests")
    table = r.stdout.splitlines()[-7:]  # the last lines: a row a stage
    assert r.returncode == 1 and table[0].split() == ["stage", "status", "seconds"]
    status = {row.split()[0]: " ".join(row.split()[1:-1]) for row in table[1:]}
    assert status.pop("device_tests") == "failed (exit 1)"
    assert status == dict.fromkeys("versions check bench length recall".split(), "ok")
    written = "bench_cpu.json bench_cpu.txt check-cpu.txt device_tests.txt"
    written += " recall.txt reproduce.txt summary.txt"  # (the device returns 8)
    assert sorted(os.listdir(out)) == written.split()
    read = lambda name: (out / name).read_text()
    assert read("summary.txt").endswith("\n".join(table) + "\n")
    packages = "torch 2. numpy matplotlib tiktoken pytest".split()
    assert all(f" {p}" in read("summary.txt") for p in packages)  # the versions
    assert read("device_tests.txt") == "$ false\n"
    assert read("check-cpu.txt").startswith("device cpu, torch ")
    assert "computed: {'device': 'cpu'" in read("reproduce.txt")  # (its run's console)
    assert "\n--- length_cpu.csv\nmixer,threads,l,batch," in read("bench_cpu.txt")
    assert "\nmixer,width,length,lr,seed,best" in read("recall.txt")  # its summary


def test_gpu_check_without_its_data_or_cuda_says_what_to_carry_and_why(tmp_path):
    """data/ is not in git (a copy of the tree has none): one line naming the four files
    that must travel; without CUDA one line with the probe's error; OUT not made."""
    script = ["bash", f"{ROOT}/experiments/gpu_check.sh", "out", "--data_dir=."]
    env = os.environ | dict(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    job = lambda: subprocess.run(
        script, cwd=tmp_path, capture_output=True, text=True, env=env
    )
    files = "train.bin val.bin meta.json tokenizer.tiktoken"
    r = job()
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"({files}; 20 MB, not raw/) must travel" in r.stderr
    for f in files.split():
        (tmp_path / f).touch()
    r = job()  # why not: the last line of torch's error ("AssertionError: ...")
    why = r"error: no CUDA device here \(\w+: .+\): pass --dry-run to try it on the CPU"
    assert r.returncode == 1 and re.fullmatch(why + "\n", r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


# ======== tools: plots and CSVs (plot.py), the taps (taps.py), results/ ========
_csv = lambda path: list(csv.reader(open(path, newline="")))


def _lines(ax):
    """{label: [x, y]} of the lines drawn on ax."""
    return {line.get_label(): line.get_xydata().T.tolist() for line in ax.lines}


def _random(seed, *ns):
    return [[random.Random(seed + n).uniform(3, 6) for _ in range(n)] for n in ns]


@pytest.fixture
def figures(monkeypatch):
    """The figures plot.py and taps.py draw, titled, kept for the test, not written."""
    drawn = []

    def keep(fig, path, title=None):
        drawn.append(fig)
        if title:
            fig.suptitle(title)

    for module in (plot, taps):
        monkeypatch.setattr(module, "save", keep)
    yield drawn
    plot.plt.close("all")


@pytest.mark.slow
def test_plot_imports_without_torch():
    code = "import sys, plot; assert 'torch' not in sys.modules, 'it imported torch'"
    experiments = os.path.join(ROOT, "experiments")
    assert subprocess.run([sys.executable, "-c", code], cwd=experiments).returncode == 0


def test_plot_csvs_are_window_medians_the_paths_paste_back(tmp_path, capsys, figures):
    sa, she = _random(0, 2500, 2100)
    out = tmp_path / "my results"
    # named against the paper's order; c: another seed, 1200 batches, for seeds.csv
    runs = [_run(tmp_path / "b", "she", she, 1, 500)]
    runs.append(_run(tmp_path / "a", "sa", sa, 32, 500))
    seed = _run(tmp_path / "c", "she", she[:1200], 1, 500, 2)
    argv = runs + ["--window", "400", "--results", str(out), "-o", str(out / "f 1.png")]
    argv += ["--seeds", seed]
    names = ("f 1.png", "medians.csv", "val_loss.csv", "summary.csv", "seeds.csv")
    assert plot.main(argv) == 0
    wrote = ["wrote"] + [str(out / name) for name in names]
    assert shlex.split(capsys.readouterr().out) == wrote
    med = lambda x, b: repr(median(x[b - 400 : b])) if b <= len(x) else ""
    rows = [[str(b), med(sa, b), med(she, b)] for b in range(400, 2401, 400)]
    assert _csv(out / "medians.csv") == [["batches", "sa-32", "she"]] + rows
    v = lambda x, b: repr(x[b - 1] - 0.5) if b <= len(x) else ""
    vals = [[str(b), v(sa, b), v(she, b)] for b in range(500, 3000, 500)]
    assert _csv(out / "val_loss.csv")[1:] == vals
    last = [repr(median(she[-n:])) for n in (1000, 2000)]
    # tokens/s: 1001, 1002, 1000, 1001, ...: median 1001
    she_row = ["she", "2100", *last, v(she, 2000), "2000", "7", "", "1001"]
    assert _csv(out / "summary.csv")[2] == she_row
    # seeds.csv: each at the shortest run's 1200 batches
    at = lambda m, s, x: [m, s, "1", "1200", repr(median(x[200:1200])), v(x, 1000)]
    seeds = [at("sa-32", "1", sa), at("she", "1", she), at("she", "2", she)]
    assert _csv(out / "seeds.csv")[1:] == seeds
    assert plot.main(argv + ["--batches", "1600"]) == 0  # the runs at one length
    assert _csv(out / "summary.csv")[2][1:3] == ["1600", repr(median(she[600:1600]))]


def test_plot_gaps_csv_has_each_gap_to_sa_32_and_the_papers(tmp_path, capsys, figures):
    runs = [_run(tmp_path / "a", "sa", [4.0] * 2000, 32, 1000)]
    runs.append(_run(tmp_path / "b", "random", [4.0] * 1000 + [4.25] * 1000, 32, 1000))
    runs.append(_run(tmp_path / "c", "random", [3.5] * 2000, 1, 1000))
    (tmp_path / "ppl.csv").write_text("run,model,lm1b_ppl\nsa-32,T,40\nrandom,R,80\n")
    argv = runs + ["--results", str(tmp_path), "-o", str(tmp_path / "f.png")]
    assert plot.main(argv + ["--paper_ppl", str(tmp_path / "ppl.csv")]) == 0
    # medians of the last 2000, the last validation (cost - 0.5) and the gaps
    assert _csv(tmp_path / "gaps.csv") == [
        "run batches median_last_2000 val_loss gap_median gap_val paper_gap".split(),
        ["sa-32", "2000", "4.0", "3.5", "0.0", "0.0", "0.0"],
        ["random", "2000", "4.125", "3.75", "0.125", "0.25", repr(math.log(2))],
        ["random-1", "2000", "3.5", "3.0", "-0.5", "-0.5", ""],
    ]
    no_sa = argv[1:] + ["--paper_ppl", str(tmp_path / "ppl.csv")]
    assert "the gaps are to sa-32: give its run" in error_line(capsys, plot.main, no_sa)
    no_csv = argv + ["--paper_ppl", str(tmp_path / "no.csv")]
    err = error_line(capsys, plot.main, no_csv)
    assert "no.csv: No such file or directory; give --paper_ppl a CSV" in err
    (tmp_path / "no.csv").write_text("run,ppl\nsa-32,40\n")  # not its columns
    err = error_line(capsys, plot.main, no_csv)
    assert "no.csv is damaged (KeyError: 'lm1b_ppl')" in err


def test_plot_one_run_without_o_draws_into_its_folder(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path / "me", "me", [5 - i / 100 for i in range(90)], 1, 30)
    drawn, save = [], plot.save  # the lines each figure drew; the real save
    keep = lambda fig, path: drawn.append(_lines(fig.axes[0])) or save(fig, path)
    monkeypatch.setattr(plot, "save", keep)  # the lines drawn kept, the file written
    monkeypatch.chdir(tmp_path)
    assert plot.main([run]) == 0 and os.listdir(tmp_path) == ["me"]  # nothing here
    assert capsys.readouterr().out == f"wrote {run}/loss.png\n"
    assert os.path.getsize(f"{run}/loss.png") > 1000
    batches = [[*range(1, 91)], [*range(3, 91, 3)], [30, 60, 90]]
    assert [x for x, _ in drawn[0].values()] == batches
    two = [run, _run(tmp_path / "he", "he", [5] * 90)]
    assert "name it with -o" in error_line(capsys, plot.main, two)
    os.remove(f"{run}/loss.png")  # the run committed, as results/logs/ keeps runs
    log = open(f"{run}/log.csv", "rb").read()
    open(f"{run}/log.csv.gz", "wb").write(gzip.compress(log))
    os.remove(f"{run}/log.csv")
    before = files(run)
    said = error_line(capsys, plot.main, [run])
    committed = "a committed run, kept as it is: name the file with -o"
    assert said == f"error: {run} is {committed}" and files(run) == before


def test_plot_gap_panel_subtracts_sa_32_and_raw_draws_batch_numbers(tmp_path, figures):
    logs = dict(zip(("sa-32", "me", "he"), _random(7, 12, 12, 8)))
    runs = [_run(tmp_path / n, n[:2], x, 32, 4, 1337, 1337) for n, x in logs.items()]
    assert plot.main(runs + ["--window", "4", "-o", str(tmp_path / "f.png")]) == 0
    assert figures[0]._suptitle.get_text() == "m = 2, l = 32, 8, 12 batches, seed 1337"
    med = lambda n: [median(logs[n][i : i + 4]) for i in range(0, len(logs[n]), 4)]
    gaps = {}
    for n in logs:  # the windows both runs have
        ends = [4, 8, 12][: len(logs[n]) // 4]
        gaps[n] = [ends, [a - b for a, b in zip(med(n), med("sa-32"))]]
    assert _lines(figures[0].axes[1]) == gaps | {"sa-32": [[0, 1], [0, 0]]}
    resumed = _run(tmp_path / "resumed", "me", logs["me"], start=31)  # batches 31-42
    assert plot.main([resumed, runs[2], "--raw", "-o", str(tmp_path / "f.png")]) == 0
    raw = {"he": [[*range(1, 9)], logs["he"]], "me": [[*range(31, 43)], logs["me"]]}
    assert _lines(figures[1].axes[0]) == raw  # every batch at its number


def test_plot_dashes_the_synthesizers_by_mixer_not_by_folder_name(tmp_path, figures):
    # two HE runs on other batch orders, named by their folders, as results/data-order
    runs = [_run(tmp_path / f"he-d{d}", "he", [4.0] * 8, data_seed=d) for d in (2, 3)]
    runs += [_run(tmp_path / "sa-32", "sa", [4.0] * 8, 32)]
    runs += [_run(tmp_path / "random", "random", [4.0] * 8, 32)]
    assert plot.main(runs + ["--window", "4", "-o", str(tmp_path / "f.png")]) == 0
    styles = {"he-d2": "-", "he-d3": "-", "sa-32": "-", "random": "--"}
    drawn = lambda ax: {x.get_label(): x.get_linestyle() for x in ax.lines}
    medians, gaps = figures[0].axes  # the gap panel: sa-32 its zero line
    assert drawn(medians) == drawn(gaps) == styles


def test_plot_sweep_csv_named_as_its_figure_keeps_old_points(tmp_path, capsys, figures):
    res = tmp_path / "res"
    keys = [(m, l) for m in ("she", "he") for l in (64, 128)]  # in the paper's order
    logs = dict(zip(keys, _random(3, *[2500] * 4)))
    run_of = lambda m, l: _run(tmp_path / f"{m}{l}", m, logs[m, l], block_size=l)
    runs = {(m, l): run_of(m, l) for m, l in keys}
    fig10 = str(res / "fig10.png")
    argv = ["--sweep", "block_size", "--results", str(res), "-o", fig10]
    # she at 128, he at 128 and 64
    assert plot.main([runs[k] for k in keys[:0:-1]] + argv) == 0
    last = lambda k: repr(median(logs[k][-2000:]))
    point = lambda k: [k[0], str(k[1]), "2500", last(k), repr(logs[k][-1] - 0.5)]
    header = ["mixer", "l", "batches", "median_last_2000", "val_loss"]
    rows = [header, *map(point, keys[1:])]
    assert os.listdir(res) == ["fig10.csv"] and _csv(res / "fig10.csv") == rows
    he = [[64, 128], [float(p[3]) for p in rows[2:]]]  # the paper's axes
    assert _lines(figures[0].axes[0])["he"] == he
    she = [[128], [float(rows[1][4])]]  # the validation loss beside
    assert _lines(figures[0].axes[1])["she"] == she
    # she 128, he 128 stay; a new run replaces he 64
    os.rename(res / "fig10.csv", tmp_path / "earlier.csv")
    new = _run(tmp_path / "new", "he", [4.0] * 2500, block_size=64)
    assert plot.main([runs[keys[0]], new, str(tmp_path / "earlier.csv")] + argv) == 0
    he64 = ["he", "64", "2500", "4.0", "3.5"]  # the new run's point
    assert _csv(res / "fig10.csv") == [rows[0], point(keys[0]), rows[1], he64, rows[3]]
    short = [runs[keys[2]], _run(tmp_path / "s", "me", [4] * 2400)]
    assert "have 2400 to 2500 batches" in error_line(capsys, plot.main, short + argv)
    twice = [runs[keys[2]], new] + argv
    assert "both he at l = 64; pass one" in error_line(capsys, plot.main, twice)
    pairs = (("sa", 1), ("sa", 8), ("he", 1))
    heads = [_run(tmp_path / f"{m}{n}", m, [4] * 30, n_head=n) for m, n in pairs]
    heads += ["--sweep", "n_head"] + argv[-2:]
    assert "one mixer" in error_line(capsys, plot.main, heads)


def test_plot_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    run = _run(tmp_path / "run", "me", [5.0] * 10)
    out = ["-o", str(tmp_path / "f.png")]
    long = _run(tmp_path / "long", "he", [4] * 1020)
    other = _run(tmp_path / "other", "he", [5.0] * 10, vocab_size=60)
    sha = lambda c: {"train_sha256": c * 64}  # run.json's data
    shas = [_run(tmp_path / c, "me", [5.0] * 10, data=sha(c)) for c in "ab"]
    window = f"fewer than a window of 50; pass --window 10 or leave {run} out"
    sweep = "no number 'colour' in its run.json; sweep one of block_size, data_seed,"
    columns = "must be mixer,l,batches,median_last_10,val_loss"
    cases = {  # what the line says: the arguments
        "nope/run.json: No such file or directory": [str(tmp_path / "nope")],
        f"{run} and {run}/ are one run folder; pass each run once": [run, run + "/"],
        window: [run, "--window", "50"],
        f"{run} has 10 batches, fewer than a window of 34": [run, long],
        sweep: [run, "--sweep", "colour"],
        "--window must be at least 1, got 0": [run, "--window", "0"],
        columns: [run, run + "/log.csv", "--sweep", "block_size"],
        "cannot write a .xyz image": [run, "-o", str(tmp_path / "f.xyz")],
        f"cannot write {tmp_path}: Is a directory": [run, "-o", str(tmp_path)],
        "(vocabulary 50; vocabulary 60)": [run, other],
        "(vocabulary 50, train.bin aaaaaaaaaaaa; vocabulary 50, train.bin bbbb": shas,
    }
    for err, argv in cases.items():
        assert err in error_line(capsys, plot.main, out + argv), argv
    log = gzip.compress(open(f"{run}/log.csv", "rb").read())
    os.remove(f"{run}/log.csv")
    # cut, not gzip, gzip of bytes, gzip of text
    raws = [log[:60], b"\x00" * 99, gzip.compress(b"\xff" * 9), gzip.compress(b"a\n")]
    for raw in raws:
        open(f"{run}/log.csv.gz", "wb").write(raw)
        err = error_line(capsys, plot.main, [run] + out)
        assert err.startswith(f"error: {run}/log.csv.gz "), err
    damaged = {'{"config": {"mixer"': "JSONDecodeError", "{}": "KeyError", "[]": "KeyE"}
    for text, why in damaged.items():
        open(f"{run}/run.json", "w").write(text)
        err = error_line(capsys, plot.main, [run] + out)
        assert f"{run}/run.json is damaged ({why}" in err
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "long", "other", "run"]


def test_fair_lr_table_ranks_finished_runs_and_compute_crosses(tmp_path, capsys):
    made = dict(a=(1e-3, 512, [3, 1, 2, 5]), b=(3e-3, 512, [1, 1, 4, 1]))
    made |= dict(c=(3e-4, 512, [0, 0, 0]), d=(1e-3, 2424, [9, 9, 9, 9]))  # c: partial
    runs = [str(tmp_path / k) for k in made]
    for run, (lr, c, costs) in zip(runs, made.values()):
        _run(run, "he", costs, 32, 2, lr=lr, n_hidden=c, batch_size=1)
    assert (
        fair.main(["lr", *runs, "-o", str(tmp_path / "lr.csv"), "--batches", "4"]) == 0
    )
    rows = [["c", "he", "512", "0.0003", "3", "0.0", "-0.5", "partial"]]
    rows.append(["a", "he", "512", "0.001", "4", "2.5", "4.5", ""])
    rows.append(["b", "he", "512", "0.003", "4", "1.0", "0.5", "best"])
    rows.append(["d", "he", "2424", "0.001", "4", "9.0", "8.5", "best"])
    assert _csv(tmp_path / "lr.csv")[1:] == rows
    # a's windows of 2: medians 2, 3.5 at batches 2, 4; tokens/s median 1001, 32 a batch
    (flops, y), (seconds, _) = fair.curves(plot.read_runs(runs[:1])[0], 2, 10).values()
    assert flops.tolist() == [20, 40] and y.tolist() == [2.0, 3.5]
    assert seconds.tolist() == [2 * 32 / 1001, 4 * 32 / 1001]
    # 4 - x against 2 + x / 4: they cross at 1.6; at x = 3 the first is 1.75 lower
    at, end, gap = fair.crossings(([1, 2, 3], [3, 2, 1]), ([0, 4], [2, 3]))
    assert at.tolist() == [pytest.approx(1.6)] and (end, gap) == (3, -1.75)


def test_taps_tap_profile_is_each_taps_norm_per_layer():
    c = torch.tensor([0.5, -0.25, 0.0, 2.0])  # a tap per distance back k = 1..4; d = 4
    rows = c[:, None] * torch.ones(4)
    # ||c I||_F = ||c (1, 1, 1, 1)||_2 = 2|c|
    norms = {"me": (c, 1.0), "we": (rows, 2.0), "he": (rows, 2.0)}
    norms["she"] = (c[:, None, None] * torch.eye(4), 2.0)
    for mixer, (w, norm) in norms.items():
        model = tiny_model(mixer, l=4, d=4, n_head=1, vocab=16)
        with torch.no_grad():
            for i, layer in enumerate(model.layers):  # layer 2's taps: twice layer 1's
                taps_of = layer.mixer.W_ext if mixer == "she" else layer.mixer.w_ext
                taps_of.copy_(w * (i + 1))
        profile = {k: v.tolist() for k, v in taps.tap_profile(model).items()}
        want = {n: [norm * n * abs(v) for v in c.tolist()] for n in (1, 2)}
        assert profile == want, mixer


def test_taps_attention_weights_give_the_mixers_output_and_their_mean_by_distance():
    model = tiny_model("sa", l=5, d=8, n_head=2, vocab=16).double()
    for layer in model.layers:
        torch.nn.init.normal_(layer.mixer.W_QKV.weight)  # far from uniform attention
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    mixer = model.layers[0].mixer
    # (3, 2, 5, 5); a wrong scale or head split gives another output
    a = taps.attention_weights(mixer, x)
    v = mixer.W_QKV(x)[..., 16:].view(3, 5, 2, 4).transpose(1, 2)  # (B, n, t, h)
    out = mixer.W_out_att((a @ v).transpose(1, 2).reshape(3, 5, 8))
    assert torch.allclose(out, mixer(x), rtol=1e-12)
    windows = torch.randint(0, 16, (40, 5))  # two chunks of 32 and 8
    profile = taps.tap_profile(model, windows)
    with torch.no_grad():
        # no dropout in eval
        h = (model.emb_tok(windows) + model.emb_pos(torch.arange(5))) * 8**0.5
        for i, layer in enumerate(model.layers, 1):
            a = taps.attention_weights(layer.mixer, layer.ln1(h))  # (40, 2, 5, 5)
            # over windows, heads, i
            mean = lambda k: np.mean([a[:, :, j + k, j] for j in range(5 - k)])
            want = [mean(k) for k in range(5)]
            np.testing.assert_allclose(profile[i], want, rtol=1e-12)
            h = layer(h)
        # q = k = 0: row i weighs each j <= i by 1 / (i + 1)
        model.layers[0].mixer.W_QKV.weight.zero_()
    # (1 + ... + 1/5) / 5, ...
    uniform = [sum(1 / i for i in range(k, 6)) / (6 - k) for k in range(1, 6)]
    np.testing.assert_allclose(taps.tap_profile(model, windows)[1], uniform, rtol=1e-12)
    np.testing.assert_allclose(taps.uniform_by_distance(5), uniform, rtol=1e-15)


def test_taps_random_synthesizers_mean_softmax_r_by_distance_back():
    model = tiny_model("random", l=4, d=4, n_head=2, vocab=16)
    R = torch.randn(2, 4, 4)
    with torch.no_grad():
        model.layers[0].mixer.R.copy_(R)
        model.layers[1].mixer.R.zero_()  # uniform over j <= i
    profile = taps.tap_profile(model)
    # head h, row i: softmax over R[h, i, :i + 1]; k - 1 = back tokens back
    weight = lambda h, i, back: R[h, i, : i + 1].softmax(0)[i - back].item()
    by = lambda back: [weight(h, i, back) for h in (0, 1) for i in range(back, 4)]
    np.testing.assert_allclose(profile[1], [np.mean(by(b)) for b in range(4)], 1e-6)
    uniform = [sum(1 / i for i in range(k, 5)) / (5 - k) for k in range(1, 5)]
    np.testing.assert_allclose(profile[2], uniform, rtol=1e-12)


def test_taps_draws_each_run_from_its_ckpt_and_val_bin(tmp_path, capsys, figures):
    # starts 0, 47.5 -> 48, 95 = 100 - 4 - 1
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    windows = [[*range(s, s + 4)] for s in (0, 48, 95)]
    assert taps.val_windows(str(tmp_path), 4, n=3).tolist() == windows
    sha = hashlib.sha256((tmp_path / "val.bin").read_bytes()).hexdigest()
    moved = {"iter": 10, "args": {"data_dir": str(tmp_path / "gone")}}  # data moved
    moved["data"] = {"val_sha256": sha}
    models = {}
    for mixer in ("me", "sa"):
        models[mixer] = model = tiny_model(mixer, l=4, d=8, n_head=2, vocab=100)
        ckpt = {"model": model.state_dict(), "config": vars(model.cfg)}
        os.makedirs(tmp_path / mixer)
        torch.save(ckpt | moved, tmp_path / mixer / "ckpt.pt")
    runs = [str(tmp_path / mixer) for mixer in ("me", "sa")]
    argv = runs + ["-o", str(tmp_path / "taps.png")]
    err = error_line(capsys, taps.main, argv)
    assert f"{tmp_path}/gone/val.bin not found; pass --data_dir" in err
    np.arange(1, 101, dtype=np.uint16).tofile(tmp_path / "me" / "val.bin")  # another
    err = error_line(capsys, taps.main, argv + ["--data_dir", str(tmp_path / "me")])
    other = "val.bin is not the run's val.bin (sha256 differs); pass its --data_dir"
    assert err.endswith(f"me/{other}")
    assert taps.main(argv + ["--data_dir", str(tmp_path)]) == 0
    panels = [ax for ax in figures[0].axes if ax.get_visible()]
    titles = ["sa-2, batch 10", "me, batch 10"]  # in the paper's order
    assert [ax.get_title() for ax in panels] == titles
    windows = torch.from_numpy(taps.val_windows(str(tmp_path), 4))
    profiles = (taps.tap_profile(models["sa"], windows), taps.tap_profile(models["me"]))
    for ax, p in zip(panels, profiles):
        want = [[[1, 2, 3, 4], q.tolist()] for q in p.values()]
        assert [_lines(ax)[f"layer {n}"] for n in (1, 2)] == want
    assert taps.main([str(tmp_path / "me")]) == 0
    assert capsys.readouterr().out.endswith("/me/taps.png\n")


# ---- results/README.md's Redrawing, run on the committed logs: each CSV byte for byte
def _readme_commands():
    """results/README.md's "Redrawing" commands: (main, argv), {a,b} and * expanded."""
    readme = open(os.path.join(ROOT, "results", "README.md")).read()
    block = readme.split("**Redrawing.**")[1].split("```")[1]
    commands = []
    for line in block.strip().splitlines():
        argv = []
        script, *args = shlex.split(line)[1:]  # after python
        for arg in args:
            head, brace, rest = arg.partition("{")
            names, _, tail = rest.partition("}")
            expanded = [head + n + tail for n in names.split(",")] if brace else [arg]
            argv += sorted(glob.glob(arg, root_dir=ROOT)) if "*" in arg else expanded
        module = os.path.splitext(os.path.basename(script))[0]  # experiments/X.py: X
        commands.append((importlib.import_module(module).main, argv))
    return commands


def test_results_csvs_are_the_readmes_output(tmp_path, monkeypatch, figures, capsys):
    monkeypatch.chdir(ROOT)
    commands = _readme_commands()
    # Figures 7 and 8 (two each), 9, data order, 10, 11, the Synthesizers, section 1;
    # bench.py's two costs; against compute; fair.py's lr (no figure); recall against l
    assert len(commands) == 15
    for main, argv in commands:
        for i, flag in enumerate(argv[:-1]):
            if flag in ("-o", "--results"):  # results/... into tmp_path/...
                argv[i + 1] = str(tmp_path / os.path.relpath(argv[i + 1], "results"))
        assert not main(argv), argv
    printed = capsys.readouterr().out  # the crossings of results/README section 13
    assert "she, threads 1: vs_sa crosses 1 at l = none in range" in printed
    assert "he, threads 1: vs_sa crosses 1 at t = none in range" in printed
    assert len(figures) == 14
    written = sorted(glob.glob("**/*.csv", root_dir=tmp_path, recursive=True))
    assert len(written) == 21, written  # and all of them as committed:
    for name in written:
        committed = open(os.path.join(ROOT, "results", name), "rb").read()
        assert (tmp_path / name).read_bytes() == committed, name
    # 30000/: its logs are gone, but its sa-1 and sa-32 to batch 10000 are fig7's
    fig7 = ["results/logs/fig7/sa-1", "results/logs/fig7/sa-32", "--window", "500"]
    assert plot.main(fig7 + ["--results", str(tmp_path), "-o", "f.png"]) == 0
    committed = lambda name: _csv(os.path.join(ROOT, "results", "30000", name))
    for name in ("medians.csv", "val_loss.csv"):
        assert [row[:3] for row in committed(name)[:21]] == _csv(tmp_path / name)
    for run, n, m, _, val, *_ in _csv(tmp_path / "summary.csv")[1:]:
        assert [run, "1337", "1337", n, m, val] in committed("seeds.csv")


def test_recall_task_and_its_loss_and_accuracy_at_the_queries_alone():
    x, pos, y = recall.mqar(500, 256, 16, seed=3)
    keys = x[:, 0:32:2]  # (n, N) the pairs k v at the start
    assert (keys.sort(1).values.diff(1) > 0).all() and (keys < 4096).all()
    assert (x[:, 1:32:2] == y).all() and (y >= 4096).all()
    # key i once after the pairs (and below 256, or gather raises), its value the target
    assert (pos >= 32).all() and (x.gather(1, pos) == keys).all()
    assert all(map(torch.equal, (x, pos, y), recall.mqar(500, 256, 16, seed=3)))
    assert not torch.equal(recall.mqar(500, 256, 16, seed=4)[0], x)  # another seed's
    # without the context, each key's most frequent value is right ~1/4096 of the time
    tx, _, ty = recall.mqar(100_000, 64, 4, seed=0)
    seen = (tx[:, 0:8:2].flatten(), ty.flatten() - 4096)  # (key, value - 4096)
    table = torch.zeros(4096, 4096).index_put_(seen, torch.tensor(1.0), accumulate=True)
    x, _, y = recall.mqar(3000, 64, 4, seed=1)
    assert (table.argmax(1)[x[:, 0:8:2]] + 4096 == y).float().mean() < 0.01
    logits = torch.full((2, 6, 4), -9.0)  # (B, t, u): every position but the queries
    logits[..., 3] = 9.0  # says token 3, which no target is
    pos, y = torch.tensor([[1, 4], [2, 5]]), torch.tensor([[0, 1], [2, 2]])
    logits[0, 1] = logits[0, 4] = logits[1, 2] = torch.tensor([math.log(2), 0, 0, 0])
    logits[1, 5] = 0.0  # a tie: argmax 0, wrong
    loss, correct = recall.scores(logits[[[0], [1]], pos], y)  # (B, N, u) at pos
    # p(target) = 2/5 for the first, 1/5 for the second and third, 1/4 for the last
    want = -(math.log(2 / 5) + 2 * math.log(1 / 5) + math.log(1 / 4)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6) and correct.item() == 1
    he = recall.build("he", 16, 16, 1e-3, 0, recall.parse(["--quick", "--ffn"]))[0]
    torch.manual_seed(0)  # seed 0's draws are the model's alone, as in train.py
    assert all(map(torch.equal, Transformer(he.cfg).parameters(), he.parameters()))
    x, pos, _ = recall.mqar(3, 16, 2, seed=0)
    want = he(x)[0][[[0], [1], [2]], pos]  # extractor.py's logits at the queries
    for head in ("queries", "all"):  # the head at the queries, or at every position
        torch.testing.assert_close(recall.query_logits(he, x, pos, head, True), want)


def test_recall_quick_resumes_bit_for_bit_and_draws(tmp_path, capsys, monkeypatch):
    quick = ["--quick", "--mixers", "sa,me", "--lrs", "3e-2"]
    assert recall.main([*quick, "--out", str(tmp_path / "a")]) == 0
    assert recall.main([*quick, "--epochs", "1", "--out", str(tmp_path / "b")]) == 0
    assert recall.main([*quick, "--out", str(tmp_path / "b")]) == 0  # epoch 2 alone
    logged = lambda ckpt: [row.split(",")[:3] for row in ckpt["log"]]  # no seconds
    for run in ("sa-d16-l16-lr0.03-s0", "me-d16-l16-lr0.03-s0"):
        a, b = (torch.load(tmp_path / r / run / "ckpt.pt") for r in "ab")
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert logged(a) == logged(b)
    os.remove(tmp_path / "b" / run / "ckpt.pt")  # me as committed: run.json, log.csv
    assert recall.main([*quick, "--out", str(tmp_path / "b")]) == 0  # nothing to do
    # a's two runs' epochs 1 and 2, b's epoch 1, then their epoch 2 alone, then none
    assert capsys.readouterr().out.count(" epoch ") == 4 + 2 + 2
    me = [*quick, "--mixers", "me", "--out", str(tmp_path / "b")]  # run.json alone
    assert "has settings" in error_line(capsys, recall.main, [*me, "--ffn"])
    open(tmp_path / "b" / run / "run.json", "w").write("{")  # damaged
    assert "run.json (JSONDecodeError)" in error_line(capsys, recall.main, me)
    summary, image = tmp_path / "b" / "summary.csv", str(tmp_path / "recall.png")
    err = error_line(capsys, recall.main, ["--draw", str(tmp_path / "no.csv"), image])
    assert f"cannot read {tmp_path / 'no.csv'}:" in err and not os.path.exists(image)
    runs = "sa,64,64,1,0,0.2 sa,64,64,3,0,0.6 sa,64,64,1,1,0.4 sa,64,64,1,2,1.0"
    open(summary, "a").write("".join(f"{r},3,False,9\n" for r in runs.split()))
    figures = []
    monkeypatch.setattr(plot.plt, "close", figures.append)  # plot.save's last step
    assert recall.main(["--draw", str(summary), image]) == 0
    assert os.path.getsize(image) > 1000
    d16, d64 = (_lines(ax) for ax in figures[0].axes)
    zoology = ", Zoology Fig. 2 (read from the figure)"
    assert list(d64) == ["sa", "attention" + zoology, "BaseConv" + zoology]
    assert d64["sa"] == [[64], [0.6]] and list(d16) == ["me", "sa"]  # median of bests
    sa = [ln for ax in figures[0].axes for ln in ax.lines if ln.get_label() == "sa"]
    assert len(sa) == 2 and sa[0].get_color() == sa[1].get_color()  # in each panel
    assert "--lengths 100" in error_line(capsys, recall.main, ["--lengths", "100"])
    assert "'nope'" in error_line(capsys, recall.main, ["--mixers", "nope"])
