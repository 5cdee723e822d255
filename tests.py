"""Tests: python -m pytest tests.py  (CPU, no network; loopback servers only)."""

import argparse
import builtins
import collections
import contextlib
import copy
import csv
import functools
import glob
import gzip
import hashlib
import http.server
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

import common
import extractor
import fir
import prepare_data
import rundir
import sample
import synthesizer
import train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments"))
import bench  # noqa: E402
import plot  # noqa: E402
import taps  # noqa: E402
from extractor import MIXERS, Config, Transformer  # noqa: E402


def _test_device():
    """TEST_DEVICE=cuda (or cuda:N, mps) runs the mixer, causality, generation and training tests on
    that device; the literal references stay on the CPU in float64. Default: the CPU. Returns the
    device, and why it cannot be used (None if it can)."""
    name = os.environ.get("TEST_DEVICE", "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        return torch.device("cpu"), f"TEST_DEVICE={name!r} is not a device name; use cpu, cuda, cuda:N or mps"
    there = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": torch.backends.mps.is_available(),
    }
    if not there.get(device.type, False):
        why = f"TEST_DEVICE={name}: torch sees no such device here; unset it to test on the CPU"
        return torch.device("cpu"), why
    if device.type == "cuda":  # the same numbers every time, so "bit for bit" means what it does on the CPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    return device, None


@pytest.fixture(autouse=True, scope="session")
def _test_device_is_there():
    if _NO_DEVICE:  # one line, before any test runs
        pytest.exit(_NO_DEVICE, returncode=4)


ROOT = os.path.dirname(os.path.abspath(__file__))  # the scripts run here in subprocesses


DEVICE, _NO_DEVICE = _test_device()


FLOAT = torch.float32 if DEVICE.type == "mps" else torch.float64  # MPS has no float64


TOL = 1e-9 if FLOAT == torch.float64 else 1e-4


def dev(obj):
    """A copy of a CPU tensor or module on the test device in FLOAT; the original stays the reference."""
    return (copy.deepcopy(obj) if isinstance(obj, torch.nn.Module) else obj).to(DEVICE, FLOAT)


def cpu64(*tensors):
    return [t.detach().cpu().double() for t in tensors]


def error_line(capsys, fn, *args, many_lines=False, **kw):
    """fn(*args, **kw), a script's main or one of its functions, must end with exit status 1 (returned or
    raised as SystemExit) and one line "error: ..." on stderr, no traceback; returns that line (with
    many_lines: the whole message, for an error that lists several items below its first line)."""
    capsys.readouterr()
    try:
        rc = fn(*args, **kw)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: ") and "Traceback" not in err, (rc, err)
    assert many_lines or "\n" not in err, err
    return err


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


def tiny_model(mixer, l=16, d=16, n_head=4, n_layer=2, vocab=50, n_hidden=32, seed=0):
    """A small Transformer on the CPU in float32, with the paper's initialisation, in eval mode."""
    torch.manual_seed(seed)
    cfg = Config(
        vocab_size=vocab, block_size=l, n_embd=d, n_hidden=n_hidden, n_layer=n_layer, n_head=n_head,
        mixer=mixer,
    )  # fmt: skip
    return Transformer(cfg).eval()


def scrambled(module, std):
    """module in float64 with every parameter and buffer (Fixed Random's R too) drawn again ~ N(0, std²):
    larger than the paper's init, so that every term matters, alignments are far from uniform and
    greedy choices are not ties."""
    module = module.double()
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.normal_(0, std)
    return module


def scrambled_model(name, l=16):
    """tiny_model on the test device, scrambled to N(0, 0.3²): distinct logits."""
    return dev(scrambled(tiny_model(name, l=l), 0.3))


@pytest.mark.slow
def test_an_absent_test_device_ends_the_run_with_one_line():
    env = {**os.environ, "TEST_DEVICE": "cuda:99"}  # no machine has a hundredth GPU
    argv = [sys.executable, "-m", "pytest", "tests.py", "-q", "-p", "no:cacheprovider", "-k", "fir_reading"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    said = [line for line in (r.stdout + r.stderr).splitlines() if "TEST_DEVICE" in line]
    assert r.returncode == 4 and len(said) == 1 and "no such device" in said[0], r.stdout


# ======== model and equations (extractor.py): every mixer against its equations as literal loops ========


def literal_fir(x, w):
    """Eq. (23)/(26)/(28)/(29) as the paper writes them: x_i = sum_{j<=i} x_j (*) w_{i-j+1}."""
    B, t, d = x.shape
    y = torch.zeros_like(x)
    for i in range(t):
        for j in range(i + 1):
            k = i - j  # the paper's tap index minus one
            y[:, i] += x[:, j] @ w[k] if w.dim() == 3 else x[:, j] * w[k]
    return y


def literal_sa(m, x):
    """Eq. (10)-(17) with explicit loops over heads, rows and the masked softmax of Eq. (14)."""
    B, t, d = x.shape
    n = m.n
    h = d // n
    W = m.W_QKV.weight.T  # (d, 3d): columns are Q, K, V of all heads
    out = torch.zeros(B, t, d, dtype=x.dtype)
    for j in range(n):
        WQ, WK, WV = (W[:, s * d + j * h : s * d + (j + 1) * h] for s in range(3))
        Q, K, V = x @ WQ, x @ WK, x @ WV  # Eq. (10)-(12)
        Z = Q @ K.transpose(1, 2) / math.sqrt(h)  # Eq. (13)
        R = torch.zeros(B, t, h, dtype=x.dtype)
        for i in range(t):
            e = torch.exp(Z[:, i, : i + 1])  # Eq. (14): only k <= i, denominator over f <= i
            a = e / e.sum(dim=1, keepdim=True)
            R[:, i] = (a[:, :, None] * V[:, : i + 1]).sum(1)  # Eq. (15)
        out[:, :, j * h : (j + 1) * h] = R  # Eq. (16)
    return out @ m.W_out_att.weight.T  # Eq. (17)


def literal_mixer(name, m, x):
    lin = lambda layer, z: z @ layer.weight.T
    if name == "sa":
        return literal_sa(m, x)
    if name == "she":
        return lin(m.W_out, lin(m.W_adj, x) * literal_fir(x, m.W_ext))  # Eq. (23)-(25)
    if name == "he":
        x_ext = literal_fir(lin(m.W_in_ext, x), m.w_ext)  # Eq. (27), (28)
        return lin(m.W_out, lin(m.W_adj, x) * x_ext)  # Eq. (24), (25)
    if name == "we":
        return lin(m.W_out, lin(m.W_adj, x) * literal_fir(x, m.w_ext))  # Eq. (26), (24), (25)
    if name == "me":
        return literal_fir(x, m.w_ext)  # Eq. (29)
    if name == "he-ext":
        return literal_fir(lin(m.W_in_ext, x), m.w_ext)  # Eq. (27), (28)
    raise KeyError(name)


PAPER_MIXERS = ["sa", "she", "he", "we", "me", "he-ext"]


def random_mixer(name, d=8, l=12, n=2, seed=0):
    """A mixer on the CPU, scrambled to N(0, 0.5²) in float64."""
    torch.manual_seed(seed)
    return scrambled(MIXERS[name](Config(n_embd=d, block_size=l, n_head=n, mixer=name)), 0.5)


@pytest.mark.parametrize("name", PAPER_MIXERS)
def test_mixer_equals_literal_equations(name):
    rng = random.Random(name)
    for trial in range(3):
        t = rng.randint(1, 12)
        m = random_mixer(name, seed=trial)
        x = torch.randn(2, t, 8, dtype=torch.float64)
        (y,) = cpu64(dev(m)(dev(x)))
        assert torch.allclose(y, literal_mixer(name, m, x), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixer_is_causal(name):
    m = dev(random_mixer(name, d=8, l=12, n=2))
    x = dev(torch.randn(2, 12, 8)).requires_grad_()
    y = m(x)
    for i in (0, 5, 11):
        (g,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        past, future = g[:, : i + 1].abs().max(), g[:, i + 1 :].abs().amax(dim=(0, 2)).sum()
        assert past > 0, f"output {i} ignores its inputs"
        # exactly zero for direct sums; FFT paths leave float64 round-off (~1e-16) only
        assert future <= TOL * 1e-3 * past, f"output {i} depends on later positions"


def test_fir_reading_copy_is_the_causal_filter_with_these_taps():
    """extractor.causal_fir_reference, the few lines a reader checks against Eq. (23), tested as a filter
    rather than against another copy of its sum: a unit impulse in channel c at position j gives the
    taps back from j on (w_1 at j: Eq. 23's k = i - j + 1), nothing before j, and the output is linear
    in the input, so these impulse responses are the whole map."""
    torch.manual_seed(5)
    fir = lambda x, w: cpu64(extractor.causal_fir_reference(dev(x), dev(w)))[0]
    for shape in ((9,), (9, 4), (9, 4, 4)):
        w = torch.randn(*shape, dtype=torch.float64)
        for j, c in itertools.product(range(9), range(4)):
            x = torch.zeros(1, 9, 4, dtype=torch.float64)
            x[0, j, c] = 1.0
            want = torch.zeros(9, 4, dtype=torch.float64)
            for k in range(9 - j):  # the impulse read through tap k + 1: row c of a matrix, else e_c scaled
                want[j + k] = w[k][c] if w.dim() == 3 else w[k] * x[0, j]
            assert torch.allclose(fir(x, w)[0], want, atol=TOL, rtol=0), (shape, j, c)
        x1, x2 = torch.randn(2, 2, 9, 4, dtype=torch.float64)
        assert torch.allclose(fir(2 * x1 - x2, w), 2 * fir(x1, w) - fir(x2, w), atol=TOL, rtol=0)


# ---- initialisation (Section 6) and the loss (Eq. 3)
def _ks_distance_from_normal(v, sigma):
    """Kolmogorov-Smirnov distance sup |F_n - F| of the sample v from N(0, sigma^2)."""
    v = v.detach().double().flatten().sort().values
    n = v.numel()
    cdf = 0.5 * (1 + torch.erf(v / (sigma * math.sqrt(2))))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - cdf).max().item(), (cdf - (i - 1) / n).max().item())


@pytest.mark.parametrize("mixer", PAPER_MIXERS)
def test_initialisation_follows_section6(mixer):
    """Section 6: biases 0, weights ~ N(0, 0.01^2), here every weight tensor on its own. The bands come
    from the sample size n of each tensor, each wide enough to pass a true N(0, 0.01^2) sample with
    probability 1 - 1e-6: the sample std has standard error 0.01 / sqrt(2(n-1)) and the mean
    0.01 / sqrt(n), 5 of them each; the Kolmogorov-Smirnov distance from N(0, 0.01^2) stays below
    sqrt(ln(2 / 1e-6) / 2n) (the DKW inequality), which checks the shape (a uniform draw of std 0.01 is
    0.058 away) and the scale at once. n = 8192 (w_ext, emb_pos): std within +-0.00039, distance
    below 0.030; std 0.0115 is 0.034 away and 19 standard errors off."""
    model = tiny_model(mixer, l=64, d=128, n_hidden=256, vocab=500)
    for name, p in model.named_parameters():
        n = p.numel()
        if name.endswith("bias"):
            assert (p == 0).all(), name
        elif ".ln" in name or name.startswith("ln_f"):
            assert (p == 1).all(), name  # LayerNorm gain starts at 1
        else:
            assert abs(p.std().item() - 0.01) < 5 * 0.01 / math.sqrt(2 * (n - 1)), (name, p.std().item())
            assert abs(p.mean().item()) < 5 * 0.01 / math.sqrt(n), (name, p.mean().item())
            distance, band = _ks_distance_from_normal(p, 0.01), math.sqrt(math.log(2 / 1e-6) / (2 * n))
            assert distance < band, (name, distance, band)


def test_forward_loss_is_eq3():
    model = tiny_model("we", l=8, vocab=30, seed=3)
    idx, targets = torch.randint(0, 30, (2, 8)), torch.randint(0, 30, (2, 8))
    logits, loss = model(idx, targets)
    p_hat = logits.softmax(-1)  # Eq. (21), (22)
    nll = -torch.log(p_hat.gather(-1, targets[..., None])).mean()  # Eq. (3)
    assert torch.allclose(loss, nll, atol=1e-6)


# ---- parameter counts: each mixer's against Tables 3 and 4, the whole model's
def param_formula(name, d, l):
    """Tables 3 and 4 (ERRATA: no biases)."""
    return {
        "sa": 4 * d * d,
        "she": l * d * d + 2 * d * d,
        "he": l * d + 3 * d * d,
        "we": l * d + 2 * d * d,
        "me": l,
        "he-ext": l * d + d * d,
    }[name]


@pytest.mark.parametrize("d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (24, 7, 3), (16, 256, 16)])
def test_parameter_counts_equal_formulas(d, l, n):
    for name in PAPER_MIXERS:
        assert bench.mixer_param_count(name, d, l, n) == param_formula(name, d, l)
        if name != "he-ext":
            assert bench.complexity_training(d, l, n)[name]["params"] == param_formula(name, d, l)


def test_whole_model_parameter_count_closed_form():
    for name in PAPER_MIXERS:
        cfg = Config(vocab_size=97, block_size=16, n_embd=24, n_hidden=40, n_layer=3, n_head=4, mixer=name)
        u, l, d, c, m = 97, 16, 24, 40, 3
        expect = (
            u * d
            + l * d  # Eq. (4), (5)
            + m
            * (
                param_formula(name, d, l)  # first sublayer
                + d * c
                + c
                + c * d
                + d  # Eq. (19)
                + 2 * 2 * d
            )  # two layer norms, Eq. (8)
            + 2 * d
            + d * u
            + u
        )  # final layer norm and Eq. (21)
        model = Transformer(cfg)
        counts = model.param_counts()
        assert counts["total"] == expect == sum(p.numel() for p in model.parameters())
        assert counts["mixers"] == m * param_formula(name, d, l)


# ---- bad configurations and inputs
def test_bad_config_gives_clear_value_errors():
    with pytest.raises(ValueError, match="unknown mixer 'xx'.*sa.*she.*he.*we.*me"):
        Config(mixer="xx")
    with pytest.raises(ValueError, match="n_head=3 must divide n_embd=128"):
        Config(n_head=3, mixer="sa")
    Config(n_head=3, mixer="me")  # heads are irrelevant to ME
    for field in ("n_layer", "n_embd", "block_size", "vocab_size", "n_hidden"):
        with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
            Config(**{field: -1})
    with pytest.raises(ValueError, match="dropout"):
        Config(dropout=1.5)


def test_sequence_longer_than_block_size_is_refused():
    model = scrambled_model("me", l=8)
    with pytest.raises(ValueError, match="exceeds block_size l=8"):
        model(torch.zeros(1, 9, dtype=torch.long, device=DEVICE))


def test_empty_sequence_is_refused_with_a_value_error():
    """t = 0 is one clear ValueError for every mixer, with or without a cache, and the FFT's length
    refuses it too (fft_size(0) used to loop forever). sa is checked first: it ran t = 0 quietly."""
    empty = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    for name in MIXERS:
        model = tiny_model(name).to(DEVICE)
        for cache in (None, model.new_cache()):
            with pytest.raises(ValueError, match=r"idx \(2, 0\) holds no tokens"):
                model(empty, cache=cache)
    for t in (0, -3):
        with pytest.raises(ValueError, match="at least one"):
            fir.fft_size(t)
    for w in (torch.randn(8, 4), torch.randn(8, 4, 4)):  # the tap shapes that take the FFT
        with pytest.raises(ValueError, match="at least one"):
            fir.fir_full(torch.zeros(2, 0, 4), w)


# ---- generation and sampling
@pytest.mark.parametrize("name", sorted(MIXERS))
def test_cached_generation_equals_uncached(name):
    model = scrambled_model(name)
    idx = torch.randint(0, 50, (2, 5), device=DEVICE)
    cached = model.generate(idx, 11, temperature=0, use_cache=True)  # fills l = 16 exactly
    uncached = model.generate(idx, 11, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    # logits: prefill plus one token at a time equals one full forward
    cache = model.new_cache()
    steps = [model(cached[:, :5], cache=cache)[0]]
    steps += [model(cached[:, i : i + 1], cache=cache)[0] for i in range(5, 16)]
    full = model(cached)[0]
    assert torch.allclose(torch.cat(steps, 1), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_generation_beyond_block_size_is_a_sliding_window_of_l_tokens(name):
    """Eq. (2): every token beyond l is predicted from exactly the l tokens before it."""
    l = 16
    model = scrambled_model(name, l=l)
    prompt = torch.randint(0, 50, (2, 9), device=DEVICE)
    out = model.generate(prompt, 30, temperature=0)  # the default: cached, then sliding
    idx = prompt
    for _ in range(30):  # the plain sliding-window loop
        nxt = model(idx[:, -l:])[0][:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    assert torch.equal(out, idx)
    long_prompt = torch.randint(0, 50, (1, 23), device=DEVICE)  # a prompt longer than l
    assert torch.equal(
        model.generate(long_prompt, 5, temperature=0),
        model.generate(long_prompt, 5, temperature=0, use_cache=False),
    )


def test_top_k_keeps_exactly_k_and_top_p_is_nucleus():
    torch.manual_seed(4)
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    seen = {extractor.sample_next(logits, top_k=2).item() for _ in range(300)}
    assert len(seen) == 2 and 0 in seen  # a tie at the boundary still keeps exactly 2
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    seen = {extractor.sample_next(probs.log(), top_p=0.6).item() for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.6 needs the second token; 0.7 >= 0.6 stops there
    seen = {extractor.sample_next(probs.log(), top_p=0.5).item() for _ in range(100)}
    assert seen == {0}
    assert extractor.sample_next(probs.log(), temperature=0).item() == 0


def test_generate_refuses_bad_settings_and_samples_in_eval_mode(monkeypatch):
    model = scrambled_model("sa")
    prompt = torch.tensor([[1, 2, 3]], device=DEVICE)
    for kw in ({"top_k": 0}, {"top_p": 0}, {"temperature": -1}, {"temperature": math.nan}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            model.generate(prompt, 4, **kw)
    with pytest.raises(ValueError, match="prompt"):
        model.generate(prompt[:, :0], 4)
    greedy = model.generate(prompt, 6, temperature=0)
    assert torch.equal(model.generate(prompt, 6, temperature=1e-38), greedy)  # a tiny T is greedy
    model.cfg.dropout = 0.5
    for block in model.modules():
        if isinstance(block, torch.nn.Dropout):
            block.p = 0.9  # in training mode this would change every logit
    model.train()
    assert torch.equal(model.generate(prompt, 6, temperature=0), greedy) and model.training
    monkeypatch.delitem(sys.modules, "synthesizer")
    with pytest.raises(ValueError, match="import synthesizer"):
        Config(mixer="no-such-mixer")


# ======== the FIR's fast paths (fir.py): each against the literal sum, forward and backward ========


FIR_TAPS = {1: (12,), 2: (12, 5), 3: (12, 5, 5)}  # w.dim() -> taps of l = 12 for 5 features


FIR_CASES = [(FIR_TAPS[dim], path) for path, dims in fir.PATHS.items() for dim in dims]


@pytest.mark.parametrize("shape,path", FIR_CASES, ids=[f"{len(s)}d-{p}" for s, p in FIR_CASES])
def test_fir_forward_and_backward_equal_literal_sum(shape, path):
    """Each path of fir.fir_full, named explicitly (so every path runs on every device), against
    extractor.causal_fir_reference, the double sum as written."""
    torch.manual_seed(1)
    for t in (1, 7, 8, 12):
        x, w, g = torch.randn(3, t, 5).double(), torch.randn(*shape).double(), torch.randn(3, t, 5).double()
        y, dx, dw = fir_and_grads(functools.partial(fir.fir_full, path=path), dev(x), dev(w), dev(g))
        y_ref, dx_ref, dw_ref = fir_and_grads(extractor.causal_fir_reference, x, w, g)
        assert torch.allclose(y, y_ref, atol=TOL, rtol=0)
        assert torch.allclose(dx, dx_ref, atol=TOL, rtol=0)
        assert torch.allclose(dw, dw_ref, atol=TOL, rtol=0)
        assert (dw[t:] == 0).all()  # taps beyond t get no gradient


def fir_and_grads(fir, x, w, g):
    """fir(x, w) and its gradients dx, dw for the output gradient g, on the CPU in float64."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fir(x, w)
    return cpu64(y, *torch.autograd.grad(y, (x, w), g))


# ---- which path runs: the device's default, a named path, a forced one
def test_fir_default_path_by_device_type_taps_and_length(monkeypatch):
    """The CPU and MPS keep the paths measured on the CPU. CUDA takes its own for scalar and matrix taps,
    and the FFT for vector taps until a GPU measures the batched Toeplitz product faster (then
    CUDA_TOEPLITZ_MAX_T_VECTOR is raised). taps: w.dim(), 1 scalars (ME), 2 vectors, 3 matrices (SHE)."""
    want = {  # (device type, w.dim(), t) -> path
        ("cpu", 1, 1): "toeplitz", ("cpu", 1, 1023): "toeplitz", ("cpu", 1, 1024): "fft",
        ("cpu", 2, 1): "fft", ("cpu", 2, 128): "fft", ("cpu", 3, 128): "fft",
        ("mps", 1, 128): "toeplitz", ("mps", 2, 128): "fft", ("mps", 3, 128): "fft",
        ("cuda", 1, 1): "toeplitz-strided", ("cuda", 1, 1023): "toeplitz-strided", ("cuda", 1, 1024): "fft",
        ("cuda", 2, 1): "fft", ("cuda", 2, 128): "fft",
        ("cuda", 3, 1): "fft-cuda", ("cuda", 3, 128): "fft-cuda",
    }  # fmt: skip
    for (device, dim, t), path in want.items():
        assert fir.default_path(device, dim, t) == path, (device, dim, t)
    monkeypatch.setattr(fir, "CUDA_TOEPLITZ_MAX_T_VECTOR", 256)
    assert [fir.default_path("cuda", 2, t) for t in (1, 256, 257)] == ["toeplitz-strided"] * 2 + ["fft"]
    assert fir.default_path("cpu", 2, 128) == "fft"


def spy_fir_paths(monkeypatch):
    """A list to which each fir_full call appends the path it computes by, told by the function it calls."""
    taken = []
    toeplitz, strided, fft = fir.toeplitz, fir.ToeplitzStrided.apply, fir.FIRFFT.apply
    monkeypatch.setattr(fir, "toeplitz", lambda w: taken.append("toeplitz") or toeplitz(w))
    monkeypatch.setattr(
        fir.ToeplitzStrided, "apply", lambda x, w: taken.append("toeplitz-strided") or strided(x, w)
    )
    monkeypatch.setattr(
        fir.FIRFFT, "apply", lambda x, w, cuda: taken.append("fft-cuda" if cuda else "fft") or fft(x, w, cuda)
    )
    return taken


def test_fir_full_takes_its_device_default_unless_a_path_is_named_or_forced(monkeypatch):
    taken = spy_fir_paths(monkeypatch)
    for dim, shape in FIR_TAPS.items():
        x, w = dev(torch.randn(2, 12, 5)), dev(torch.randn(*shape))
        fir.fir_full(x, w)
        assert taken == [fir.default_path(DEVICE.type, dim, 12)], (dim, taken)
        for path in [p for p, dims in fir.PATHS.items() if dim in dims]:
            taken.clear()
            fir.fir_full(x, w, path=path)
            with fir.forcing(path):
                fir.fir_full(x, w)
            assert taken == [path, path], (dim, path, taken)
            taken.clear()


def test_fir_full_refuses_a_path_that_does_not_compute_the_taps():
    x = torch.randn(1, 4, 5)
    for path, shape in [
        ("fft-cuda", (4, 5)),
        ("toeplitz", (4, 5)),
        ("toeplitz-strided", (4, 5, 5)),
        ("fftw", (4,)),
    ]:
        with pytest.raises(ValueError, match=f"no FIR path '{path}' for taps of shape"):
            fir.fir_full(x, torch.randn(*shape), path=path)
    with pytest.raises(ValueError, match="no FIR path 'fftw'"), fir.forcing("fftw"):
        pass


# ---- the FFT's length
def test_fft_size_is_the_smallest_5_smooth_length_for_odd_and_even_t(monkeypatch):
    smooth = lambda n: all(p in (2, 3, 5) for p in _prime_factors(n))
    for t in range(1, 300):
        n = fir.fft_size(t)
        assert n >= 2 * t - 1 and smooth(n) and not any(smooth(m) for m in range(2 * t - 1, n)), t
    assert fir.fft_size(127) == 256 and fir.fft_size(129) == 270 and fir.fft_size(32) == 64
    monkeypatch.setattr(fir, "FFT_MIN_T_SCALAR", 1)  # every tap shape through the FFT
    torch.manual_seed(6)
    for t in (5, 13, 27):  # n = 9, 25, 54: padding short of 2t, still no wrap-around
        for shape in ((t,), (t, 3), (t, 3, 3)):
            x, w, g = (
                torch.randn(2, t, 3).double(),
                torch.randn(*shape).double(),
                torch.randn(2, t, 3).double(),
            )
            got = fir_and_grads(fir.fir_full, dev(x), dev(w), dev(g))
            ref = fir_and_grads(extractor.causal_fir_reference, x, w, g)
            assert all(torch.allclose(a, b, atol=TOL, rtol=0) for a, b in zip(got, ref)), (t, shape)


def _prime_factors(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


# ---- precision: the GEMMs in IEEE float32 while TF32 is on, and under autocast
GEMM_CASES = [
    (shape, path) for shape, path in FIR_CASES if path in ("toeplitz-strided", "fft-cuda") or len(shape) == 3
]


@pytest.mark.parametrize("shape,path", GEMM_CASES, ids=[f"{len(s)}d-{p}" for s, p in GEMM_CASES])
def test_fir_gemms_run_inside_ieee_float32(shape, path, monkeypatch):
    """The forward GEMM and both gradients' of each path built on torch.bmm run inside fir.ieee_float32,
    where TF32 cannot reach them on CUDA. (toeplitz, the CPU's path for scalar taps, and the FFT's
    elementwise products for scalar and vector taps have no bmm.)"""
    depth, inside = [0], []
    ieee, bmm = fir.ieee_float32, torch.bmm

    @contextlib.contextmanager
    def counted(device):
        depth[0] += 1
        try:
            with ieee(device):
                yield
        finally:
            depth[0] -= 1

    monkeypatch.setattr(fir, "ieee_float32", counted)
    monkeypatch.setattr(torch, "bmm", lambda a, b: inside.append(depth[0] > 0) or bmm(a, b))
    x, w, g = torch.randn(3, 12, 5), torch.randn(*shape), torch.randn(3, 12, 5)
    fir_and_grads(functools.partial(fir.fir_full, path=path), dev(x), dev(w), dev(g))
    assert inside == [True] * 3, inside


def test_ieee_float32_turns_tf32_off_for_cuda_inside_and_restores_it(monkeypatch):
    """Needs no GPU: the switch is PyTorch's global flag. Off for a CUDA device while TF32 is on; the CPU,
    ALLOW_TF32 = True and TF32 already off leave the flag alone; an exception inside still restores it."""
    matmul, cuda, seen = torch.backends.cuda.matmul, torch.device("cuda"), []
    monkeypatch.setattr(matmul, "allow_tf32", True)
    for device, allow in ((cuda, False), (torch.device("cpu"), False), (cuda, True)):
        monkeypatch.setattr(fir, "ALLOW_TF32", allow)
        with fir.ieee_float32(device):
            seen.append(matmul.allow_tf32)
        assert matmul.allow_tf32 and matmul.fp32_precision == "tf32"
    assert seen == [False, True, True]
    monkeypatch.setattr(fir, "ALLOW_TF32", False)
    with pytest.raises(KeyError), fir.ieee_float32(cuda):
        raise KeyError("inside")
    assert matmul.allow_tf32
    matmul.allow_tf32 = False
    with fir.ieee_float32(cuda):
        assert not matmul.allow_tf32
    assert not matmul.allow_tf32


# max |error| / max |reference| of fir_full in float32, forward and both gradients: float32 reaches 0.9-3.7e-7
# (the CPU, every path, d = 32, t = 64, three seeds), the GEMMs' inputs rounded to TF32's 10-bit mantissa
# 2.1-4.1e-4 (TF32's unit roundoff is 2^-11 = 4.9e-4); 1e-5 lies 25x above the one and 20x below the other
FIR_FLOAT32_BOUND = 1e-5


def fir_float32_errors(name, path=None, d=32, l=64, batch=4):
    """fir_full in float32 on the test device (path: the device's default unless named) for the taps of
    mixer `name` as the paper initialises them, against the literal sum in float64 on the CPU: the
    relative errors, max |error| / max |reference|, of the output, dx and dw."""
    torch.manual_seed(7)
    w = bench.fir_taps(MIXERS[name](Config(n_embd=d, block_size=l, mixer=name))).detach()
    x, g = torch.randn(batch, l, d), torch.randn(batch, l, d)
    ref = fir_and_grads(extractor.causal_fir_reference, x.double(), w.double(), g.double())
    got = fir_and_grads(functools.partial(fir.fir_full, path=path), x.to(DEVICE), w.to(DEVICE), g.to(DEVICE))
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]


@pytest.mark.parametrize("name", ["she", "he", "we", "me", "he-ext"])
def test_fir_in_float32_with_tf32_matmuls_on_keeps_float32_accuracy(name, monkeypatch):
    """train.py turns TF32 on for CUDA's float32 matmuls; each Extractor's FIR on its default path for the
    test device must still compute at float32's accuracy, forward and both gradients. On a GPU where
    cuBLAS runs SHE's complex products in TF32 (fir.ALLOW_TF32 = True, as before) this is expected to
    fail: the suspected cause of SHE's GPU run falling behind its CPU run (results/logs/table1/ against
    results/logs/table1-cpu/). The CPU has no TF32: there it passes either way."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    errors = fir_float32_errors(name)
    assert max(errors) < FIR_FLOAT32_BOUND, f"relative errors of y, dx, dw: {errors}"


def tf32_rounded(a):
    """float32 (or both parts of complex64) rounded to TF32's 10 explicit mantissa bits, to nearest."""
    if a.is_complex():
        a = a.resolve_conj()
        return torch.complex(tf32_rounded(a.real), tf32_rounded(a.imag))
    bits = a.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)  # 23 - 10 = 13 low bits dropped, half added


@pytest.mark.parametrize(
    "name,path", [("she", "fft"), ("she", "fft-cuda"), ("we", "toeplitz-strided"), ("me", "toeplitz-strided")]
)
def test_tf32_rounded_gemm_inputs_exceed_the_float32_fir_bound(name, path, monkeypatch):
    """The bound above bites: TF32 emulated by rounding every bmm's inputs to a 10-bit mantissa, as cuBLAS's
    TF32 mode feeds SHE's complex products to the tensor cores, puts the output and both gradients above
    it (measured 20x and more)."""
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: bmm(tf32_rounded(a), tf32_rounded(b)))
    errors = fir_float32_errors(name, path)
    assert min(errors) > FIR_FLOAT32_BOUND, f"relative errors of y, dx, dw: {errors}"


@pytest.mark.parametrize("shape", [(16,), (16, 8), (16, 8, 8)], ids=["scalar", "vector", "matrix"])
def test_fir_under_autocast_computes_in_float32_and_returns_the_input_dtype(shape, monkeypatch):
    monkeypatch.setattr(fir, "FFT_MIN_T_SCALAR", 1)
    torch.manual_seed(2)
    x, w = torch.randn(2, 16, 8), torch.randn(*shape)
    x16 = x.bfloat16().double()  # the input rounded to bf16, the rest exact
    ref = extractor.causal_fir_reference(x16, w.double())
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        y = fir.fir_full(x.bfloat16().to(DEVICE), w.to(DEVICE))
    assert y.dtype == torch.bfloat16  # cast back, as the Toeplitz path's matmul returns bf16
    # float32 taps and sums: the one rounding is the output's to bf16, at most 2^-8 of it (8 significant
    # bits), plus float32's FFT round-off (measured <= 3e-6 here, |ref| <= 31). Measured: the error
    # reaches 0.95 of this bound; taps rounded to bf16 exceed it 30-390x at a quarter of the outputs.
    err, bound = (y.cpu().double() - ref).abs(), 2**-8 * ref.abs() + 1e-5
    assert (err <= bound).all(), f"error up to {(err / bound).max().item():.3g} times the bound"


# ======== computational complexity (Section 7, Tables 3-7): bench.py's counts against the paper's ========


# ---- Tables 3-6: the closed forms against the sums they stand for
def literal_training_counts(d, l, n):
    """The left-hand sums of Tables 3 and 4, term by term (with ERRATA's SHE summand)."""
    h = d // n
    S = lambda f: sum(f(t) for t in range(1, l + 1))
    return {
        "sa": dict(
            mult=(3 * d * h * l + S(lambda t: t * h + t * h)) * n + d * d * l,
            add=(S(lambda t: t * (h - 1) + (t - 1) * h + (t - 1)) + 3 * (d - 1) * h * l) * n
            + (d - 1) * d * l,
            div=n * S(lambda t: t + t),
            exp=n * S(lambda t: t),
        ),
        "she": dict(
            mult=S(lambda t: d * d * t + d * d + d + d * d),
            add=S(lambda t: (d - 1) * d * t + (t - 1) * d + (d - 1) * d + (d - 1) * d),
            div=0,
            exp=0,
        ),
        "he": dict(
            mult=S(lambda t: d * t + d * d + d + d * d) + d * d * l,
            add=S(lambda t: (t - 1) * d + (d - 1) * d + (d - 1) * d) + (d - 1) * d * l,
            div=0,
            exp=0,
        ),
        "we": dict(
            mult=S(lambda t: d * t + d * d + d + d * d),
            add=S(lambda t: (t - 1) * d + (d - 1) * d + (d - 1) * d),
            div=0,
            exp=0,
        ),
        "me": dict(mult=S(lambda t: d * t), add=S(lambda t: (t - 1) * d), div=0, exp=0),
    }


def literal_inference_counts(d, t, n):
    """The left-hand sides of Tables 5 and 6."""
    h = d // n
    return {
        "sa": dict(
            mult=(3 * d * h + t * h + t * h) * n + d * d,
            add=(3 * (d - 1) * h + t * (h - 1) + (t - 1) * h + (t - 1)) * n + (d - 1) * d,
            div=(t + t) * n,
            exp=t * n,
        ),
        "she": dict(
            mult=d * d * t + d * d + d + d * d,
            add=(d - 1) * d * t + (t - 1) * d + (d - 1) * d + (d - 1) * d,
            div=0,
            exp=0,
        ),
        "he": dict(
            mult=d * t + d * d + d * d + d + d * d,
            add=(t - 1) * d + (d - 1) * d + (d - 1) * d + (d - 1) * d,
            div=0,
            exp=0,
        ),
        "we": dict(mult=d * t + d * d + d + d * d, add=(t - 1) * d + (d - 1) * d + (d - 1) * d, div=0, exp=0),
        "me": dict(mult=d * t, add=(t - 1) * d, div=0, exp=0),
    }


@pytest.mark.parametrize("d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (12, 9, 3)])
def test_complexity_closed_forms_equal_table_sums(d, l, n):
    got = bench.complexity_training(d, l, n)
    for name, counts in literal_training_counts(d, l, n).items():
        for k, v in counts.items():
            assert got[name][k] == v, (name, k)
    for t in (1, l // 2, l):
        got = bench.complexity_inference(d, t, n)
        for name, counts in literal_inference_counts(d, t, n).items():
            assert got[name] == counts, (name, t)


@pytest.mark.parametrize("d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (12, 9, 3), (30, 7, 5)])
def test_table5_per_token_counts_add_up_to_table3(d, l, n):
    """One token at a time for t = 1..l costs what Table 3 counts for the whole sequence. This fails
    for the misprinted closed form of SA's additions, 2td - tn + t + 4d^2 - 5d - 1, whenever n > 1."""
    for name in ("sa", "she", "he", "we", "me"):
        total = bench.complexity_training(d, l, n)[name]
        for k in ("mult", "add", "div", "exp"):
            per_token = sum(bench.complexity_inference(d, t, n)[name][k] for t in range(1, l + 1))
            assert per_token == total[k], (name, k)
    misprint = sum(2 * t * d - t * n + t + 4 * d * d - 5 * d - 1 for t in range(1, l + 1))
    assert misprint == bench.complexity_training(d, l, n)["sa"]["add"] - (n - 1) * (l - 1) * l // 2


# ---- Table 7: d = l = 128
# The paper's Table 7 (d = l = 128), as printed in the paper.
TABLE7 = {
    "1-head SA": (10502144, 10420096, 16512, 8256, 65536, 20947008),
    "32-head SA": (10502144, 10416128, 528384, 264192, 65536, 21710848),
    "SHE": (139476992, 139411456, 0, 0, 2129920, 278888448),
    "HE": (7364608, 7282688, 0, 0, 65536, 14647296),
    "WE": (5267456, 5201920, 0, 0, 49152, 10469376),
    "ME": (1056768, 1040384, 0, 0, 128, 2097152),
}


def test_complexity_reproduces_table7():
    got = bench.table7(128, 128)
    for label, numbers in TABLE7.items():
        mixer, n, c = got[label]
        assert tuple(c[k] for k in ("mult", "add", "div", "exp", "params", "total")) == numbers
        assert bench.mixer_param_count(mixer, 128, 128, n) == numbers[4]


def test_bench_table7_prints_the_papers_table_and_the_modules_counts(capsys):
    assert bench.main(["--table7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == "1-head SA 32-head SA SHE HE WE ME".split()
    rows = {line.split()[0]: [int(v.replace(",", "")) for v in line.split()[1:]] for line in lines[2:]}
    for i, row in enumerate(("mult", "add", "div", "exp", "params", "total")):
        assert rows[row] == [numbers[i] for numbers in TABLE7.values()], row
    assert rows["modules"] == [numbers[4] for numbers in TABLE7.values()]


# ======== Synthesizers (synthesizer.py) against their equations as literal loops ========


SYNTHS = "dense dense-fact random random-fixed random-fact random+dense random+sa dense+sa".split()


def synth_literal(name, m, x):
    """Synthesizer Eq. (1)-(7) and the mixture formula per head j and row i, with the causal row
    softmax of Eq. (14), then Eq. (15)-(17). x (B, t, d) -> (B, t, d)."""
    B, t, d = x.shape
    n = m.n
    h = d // n
    V = x @ m.W_V.weight.T  # Eq. (12), all heads
    out = torch.zeros(B, t, d, dtype=x.dtype)
    for j in range(n):
        cols = slice(j * h, (j + 1) * h)

        def dense():  # Synthesizer Eq. (1), (2): (B, t, t)
            S = torch.zeros(B, t, t, dtype=x.dtype)
            for i in range(t):
                hid = torch.relu(x[:, i] @ m.W_1.weight.T)[:, cols]  # head j's h hidden units
                S[:, i] = hid @ m.W_2[j, :t].T  # B_i, l values, first t
            return S

        def dense_fact():  # Synthesizer Eq. (5), (6)
            S = torch.zeros(B, t, t, dtype=x.dtype)
            for i in range(t):
                hid = torch.relu(x[:, i] @ m.W_1.weight.T)[:, cols]
                A, Bv = hid @ m.W_A[j], hid @ m.W_B[j]  # (B, a), (B, b)
                for p in range(t):  # C_p = A_{p // b} B_{p mod b}
                    S[:, i, p] = A[:, p // m.b] * Bv[:, p % m.b]
            return S

        def random_():  # Synthesizer Eq. (4)
            return m.R[j, :t, :t].expand(B, t, t)

        def random_fact():  # Synthesizer Eq. (7)
            S = torch.zeros(t, t, dtype=x.dtype)
            for i in range(t):
                for k in range(t):
                    S[i, k] = sum(m.R_1[j, i, r] * m.R_2[j, k, r] for r in range(m.R_1.shape[2]))
            return S.expand(B, t, t)

        def dot():  # Eq. (10), (11), (13)
            W = m.W_QK.weight.T  # (d, 2d): Q of all heads, then K
            Q, K = x @ W[:, j * h : (j + 1) * h], x @ W[:, d + j * h : d + (j + 1) * h]
            return Q @ K.transpose(1, 2) / math.sqrt(h)

        def alphas():  # softmax of alpha_h: positive, sum 1
            e = torch.exp(m.alpha[j])
            return e[0] / e.sum(), e[1] / e.sum()

        if name == "dense":
            S = dense()
        elif name == "dense-fact":
            S = dense_fact()
        elif name in ("random", "random-fixed"):
            S = random_()
        elif name == "random-fact":
            S = random_fact()
        elif name == "random+dense":
            a1, a2 = alphas()
            S = a1 * random_() + a2 * dense()
        elif name == "random+sa":
            a1, a2 = alphas()
            S = a1 * random_() + a2 * dot()
        elif name == "dense+sa":
            a1, a2 = alphas()
            S = a1 * dense() + a2 * dot()
        else:
            raise KeyError(name)
        for i in range(t):
            e = torch.exp(S[:, i, : i + 1])  # Eq. (14): only k <= i
            a = e / e.sum(dim=1, keepdim=True)
            out[:, i, cols] = (a[:, :, None] * V[:, : i + 1, cols]).sum(1)  # Eq. (15), (16)
    return out @ m.W_out_att.weight.T  # Eq. (17)


@pytest.mark.parametrize("name", SYNTHS)
@pytest.mark.parametrize("d,l,n", [(12, 12, 3), (8, 16, 1), (8, 7, 4)])
def test_synth_forward_and_gradients_equal_literal_equations(name, d, l, n):
    for trial, t in enumerate((1, l // 2 + 1, l)):
        m = random_mixer(name, d, l, n, seed=trial)
        x, g = torch.randn(2, t, d).double(), torch.randn(2, t, d).double()
        got = output_and_grads(dev(m), dev(x), dev(g), lambda mixer, x: mixer(x))
        ref = output_and_grads(m, x, g, lambda mixer, x: synth_literal(name, mixer, x))
        for what, a, b in zip(["y", "x"] + [k for k, _ in m.named_parameters()], got, ref):
            assert torch.allclose(a, b, atol=TOL, rtol=0), what


def output_and_grads(m, x, g, forward):
    """forward(m, x) and the gradients of x and of m's parameters (zero where unused) for the output
    gradient g, on the CPU in float64."""
    x = x.detach().requires_grad_()
    y = forward(m, x)
    grads = torch.autograd.grad(y, [x, *m.parameters()], g, allow_unused=True)
    return cpu64(y, *(torch.zeros((), dtype=y.dtype) if d is None else d for d in grads))


@pytest.mark.parametrize("name", SYNTHS)
def test_synth_float32_gradients_reach_every_parameter(name):
    """The float32 path (other kernels than float64's) against the float64 literal equations."""
    m = random_mixer(name, d=16, l=16, n=4, seed=5)
    x = torch.randn(3, 16, 16, dtype=torch.float64)
    g = torch.randn(3, 16, 16, dtype=torch.float64)
    ref = torch.autograd.grad(synth_literal(name, m, x), list(m.parameters()), g)
    m32 = copy.deepcopy(m).to(DEVICE, torch.float32)
    got = cpu64(
        *torch.autograd.grad(
            m32(x.to(DEVICE, torch.float32)), list(m32.parameters()), g.to(DEVICE, torch.float32)
        )
    )
    for (p, _), a, b in zip(m32.named_parameters(), got, ref):
        assert (a != 0).any(), f"{p} gets no gradient"
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3), p


@pytest.mark.parametrize("name", SYNTHS)
def test_synth_cache_in_chunks_equals_full_forward(name):
    """Prefill, then a chunk of several positions, then single tokens: every row equals the full
    forward, so the position-indexed rows (R[past:T], W_2's columns) are the right ones."""
    m, x = dev(random_mixer(name, d=12, l=12, n=3, seed=1)), dev(torch.randn(2, 12, 12))
    cache = {}
    steps = [m(x[:, :3], cache), m(x[:, 3:7], cache)] + [m(x[:, i : i + 1], cache) for i in range(7, 12)]
    assert torch.allclose(torch.cat(steps, 1), m(x), atol=TOL, rtol=0)
    assert cache["v"].shape == (2, 3, 12, 4)
    with pytest.raises(ValueError, match="exceeds block_size l=12"):
        m(x[:, :1], cache)


# ---- parameter counts: the Synthesizer paper's Table 1 and text, plus W_V and W_out_att (2 d^2)
def synth_param_formula(name, d, l, n, k=synthesizer.SYN_RANK):
    a, b = synthesizer._syn_factors(l)
    dense, random, mix = d * d + d * l, n * l * l, 2 * n  # Table 1; "each head adds N^2"; alphas
    align = {
        "dense": dense,
        "dense-fact": d * d + d * (a + b),
        "random": random,
        "random-fixed": 0,
        "random-fact": 2 * n * l * k,
        "random+dense": random + dense + mix,
        "random+sa": random + 2 * d * d + mix,
        "dense+sa": dense + 2 * d * d + mix,
    }[name]
    return align + 2 * d * d


@pytest.mark.parametrize(
    "d,l,n", [(128, 128, 1), (128, 128, 4), (128, 128, 32), (64, 32, 4), (24, 7, 3), (16, 256, 16)]
)
def test_synth_parameter_counts_equal_formulas(d, l, n):
    for name in SYNTHS:
        assert bench.mixer_param_count(name, d, l, n) == synth_param_formula(name, d, l, n), name
    fixed = MIXERS["random-fixed"](Config(n_embd=d, block_size=l, n_head=n, mixer="random-fixed"))
    assert fixed.state_dict()["R"].shape == (n, l, l)  # stored, but not a parameter


def test_synth_factorized_dense_factors():
    for l in range(1, 300):
        a, b = synthesizer._syn_factors(l)
        assert a * b == l and a <= b
        assert not any(l % f == 0 for f in range(a + 1, math.isqrt(l) + 1))  # a is the largest


def test_synth_whole_model_parameter_count():
    for name in SYNTHS:
        cfg = Config(vocab_size=97, block_size=16, n_embd=24, n_hidden=40, n_layer=3, n_head=4, mixer=name)
        model = Transformer(cfg)
        assert model.param_counts()["mixers"] == 3 * synth_param_formula(name, 24, 16, 4)


def test_synth_initialisation():
    """nn.Linear and raw weights ~ N(0, 0.01²) (Section 6), mixing alphas zero (weights 1/2 each)."""
    for name in SYNTHS:
        model = Transformer(
            Config(vocab_size=50, block_size=64, n_embd=64, n_hidden=64, n_layer=1, n_head=4, mixer=name)
        )
        mixer = model.layers[0].mixer
        for p_name, p in list(mixer.named_parameters()) + list(mixer.named_buffers()):
            if p_name == "alpha":
                assert (p == 0).all() and torch.allclose(mixer.mixing_weights()[0], torch.tensor(0.5))
            elif name == "random-fixed" and p_name == "R":  # N(0, 1): a random alignment, not a mean
                assert abs(p.std().item() - 1.0) < 0.05 and abs(p.mean().item()) < 0.05, (name, p_name)
            else:
                assert abs(p.std().item() - 0.01) < 0.002 and abs(p.mean().item()) < 0.002, (name, p_name)


# ---- Fixed Random: a random alignment, not trained, but saved
def _row_entropy(mixer, t):
    """Mean entropy (nats) of the rows of softmax(R) over their causal columns, for positions 8..t-1."""
    p = synthesizer._syn_softmax(mixer.logits(0, t), 0)  # (n, t, t)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (n, t)
    return ent[:, 8:].mean().item()


def test_synth_fixed_random_rows_are_far_from_uniform():
    torch.manual_seed(0)
    l = 128
    uniform = sum(math.log(i + 1) for i in range(8, l)) / (l - 8)  # a running mean's rows
    fixed = MIXERS["random-fixed"](Config(n_embd=64, block_size=l, n_head=4, mixer="random-fixed"))
    learned = MIXERS["random"](Config(n_embd=64, block_size=l, n_head=4, mixer="random"))
    assert _row_entropy(fixed, l) < uniform - 0.4  # N(0, 1) logits
    assert _row_entropy(learned, l) > uniform - 0.01  # N(0, 0.01²): uniform at init
    p = synthesizer._syn_softmax(fixed.logits(0, l), 0)[:, -1]  # the last row, (n, l)
    assert (p.max(-1).values > 5 / l).all()  # peaked, not 1/l everywhere


def test_synth_fixed_random_is_not_trained_and_is_saved():
    cfg = Config(
        vocab_size=40, block_size=8, n_embd=16, n_hidden=16, n_layer=2, n_head=4, mixer="random-fixed"
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert not any("R" in name.split(".") for name, _ in model.named_parameters())
    R0 = [layer.mixer.R.clone() for layer in model.layers]
    W0 = [layer.mixer.W_V.weight.clone() for layer in model.layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 40, (4, 8))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    for layer, R, W in zip(model.layers, R0, W0):
        assert torch.equal(layer.mixer.R, R)  # the alignment did not move
        assert not torch.equal(layer.mixer.W_V.weight, W)  # the values did
    # a checkpoint (plain tensors, weights_only) reproduces R; the seed decides it
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(1)
    other = Transformer(cfg)
    assert not torch.equal(other.layers[0].mixer.R, R0[0])
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert all(torch.equal(a.mixer.R, b.mixer.R) for a, b in zip(other.layers, model.layers))
    torch.manual_seed(0)
    assert torch.equal(Transformer(cfg).layers[1].mixer.R, R0[1])


@pytest.mark.parametrize("name", SYNTHS)
def test_synth_trains_under_bfloat16_autocast(name):
    """train.py's --dtype bfloat16 path: the mixed dtypes (float32 R and alphas, bf16 activations)
    must meet without errors, and the result stays close to float32."""
    m = random_mixer(name, d=16, l=16, n=4, seed=2).to(DEVICE, torch.float32)
    with torch.no_grad():
        for p in list(m.parameters()) + list(m.buffers()):
            p.mul_(0.4)
    x = torch.randn(2, 16, 16, device=DEVICE)
    y32 = m(x)
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        y = m(x)
    y.float().sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert torch.allclose(y.float(), y32, atol=0.05 * y32.abs().max().item(), rtol=0)


# ======== data (prepare_data.py) ========


# Fixture books are made-up text in real-shaped Project Gutenberg wrappers, served by a loopback
# HTTP server on a free port; no network.
_PD_VOCAB = 400  # small, so that training on the fixture books takes a moment


_PD_SYLLABLES = "ka lo mi ren tho va quil sa ne dor bri el fen u ya zo pe gra ish om tü ça wy har".split()


def fake_book(seed, n_sentences=220, words=None):
    """Deterministic made-up prose: a title line, chapters, dialogue; its words made of syllables with a
    few non-ASCII letters, or drawn from `words`."""
    rng = random.Random(seed)
    syllables = lambda: "".join(rng.choice(_PD_SYLLABLES) for _ in range(rng.randint(1, 3)))
    words = words or [syllables() for _ in range(200)]
    title = " ".join(rng.choice(words) for _ in range(3)).upper()
    lines, para = [f"THE TALE OF {title}", "", f"by {rng.choice(words).title()}", "", ""], []
    for s in range(n_sentences):
        if s % 60 == 0:
            lines += ["", f"CHAPTER {s // 60 + 1}.", ""]
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "!", "?", ";", "--"])
        if rng.random() < 0.2:
            sentence = f"\u201c{sentence}\u201d said {rng.choice(words).title()}."
        para.append(sentence)
        if rng.random() < 0.15:
            text = " ".join(para)
            while len(text) > 70:  # wrap like a Gutenberg text
                cut = text.rfind(" ", 0, 70)
                lines.append(text[:cut])
                text = text[cut + 1 :]
            lines += [text, ""]
            para = []
    lines += [" ".join(para), "", "THE END"]
    return "\n".join(lines) + "\n"


_PD_LICENCE = """\
Updated editions will replace the previous one--the old editions will be renamed.

START: FULL LICENSE

THE FULL PROJECT GUTENBERG LICENSE
PLEASE READ THIS BEFORE YOU DISTRIBUTE OR USE THIS WORK

Section 1. General Terms of Use and Redistributing Project Gutenberg-tm electronic works
Project Gutenberg-tm is synonymous with the free distribution of electronic works.
Most people start at our website which has the main PG search facility: www.gutenberg.org
"""


def _pd_wrap(kind, book_id, title, body):
    """body inside a header and footer of the given historical shape; returns the raw bytes."""
    up = title.upper()
    if kind == "the":  # current shape
        text = (
            f"The Project Gutenberg eBook of {title}\n\nThis ebook is for the use of anyone anywhere "
            f"in the United States and\nmost other parts of the world at no cost.\n\nTitle: {title}\n\n"
            f"Release date: May 1, 2001 [eBook #{book_id}]\n\nLanguage: English\n\n"
            f"*** START OF THE PROJECT GUTENBERG EBOOK {up} ***\n\n\n\n{body}\n\n\n"
            f"*** END OF THE PROJECT GUTENBERG EBOOK {up} ***\n\n" + _PD_LICENCE
        )
        return text.encode("utf-8")
    if kind == "this":  # 2000s shape: THIS, a producer credit, the "End of ..." line split over two
        text = (
            f"Project Gutenberg\u2019s {title}, by Somebody\n\nThis eBook is for the use of anyone anywhere"
            f" at no cost and with\nalmost no restrictions whatsoever.\n\nTitle: {title}\n\n"
            f"Posting Date: June 25, 2008 [EBook #{book_id}]\nCharacter set encoding: UTF-8\n\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {up} ***\n\n\n\n\nProduced by Some Volunteers and"
            " the Online Distributed\nProofreading Team at http://www.pgdp.net\n\n\n\n\n"
            f"{body}\n\n\n\n\nEnd of the Project Gutenberg EBook of {title}, by\nSomebody Else\n\n"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK {up} ***\n\n***** This file should be named "
            f"{book_id}.txt or {book_id}.zip *****\n\n" + _PD_LICENCE
        )
        return b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8")  # BOM and CRLF
    if kind == "split":  # markers split over lines
        text = (
            f"The Project Gutenberg EBook of {title}\n\nTitle: {title}\n\n"
            f"***START OF THE PROJECT GUTENBERG EBOOK A RATHER LONG AND\nWINDING {up}***\n\n"
            "Note: Project Gutenberg also has an HTML version of this\n      file which includes the "
            "original illustrations.\n      (http://www.gutenberg.net/dirs/1/2/3/123-h.zip)\n\n\n"
            f"{body}\n\n*** END OF THE PROJECT\nGUTENBERG EBOOK A RATHER LONG AND WINDING {up} ***\n\n"
            + _PD_LICENCE
        )
        return text.encode("utf-8")
    if kind == "small_print":  # 1990s shape: no START marker, licence ends "*END*THE SMALL PRINT!"
        text = (
            f"The Project Gutenberg Etext of {title}\n\nPlease take a look at the important information in"
            " this header.\n\n**Welcome To The World of Free Plain Vanilla Electronic Texts**\n\n"
            f"Release Date: January, 2002  [Etext #{book_id}]\n\n**The Legal Small Print**\n\n"
            "***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\n"
            "Why is this \u201cSmall Print!\u201d statement here?  You know: lawyers.\n"
            "ABOUT PROJECT GUTENBERG-TM ETEXTS\n"
            "*END THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n\n\n"
            "This etext was prepared by A Scanner, typed and\nproofread by A Reader.\n\n\n\n"
            f"{body}\n\n\nEnd of The Project Gutenberg Etext of {title}\nby Somebody\n\n"
        )
        return text.encode("cp1252")  # an old Windows file: not valid UTF-8
    if kind == "none":  # no Project Gutenberg markers at all: kept whole
        return body.encode("utf-8")
    raise ValueError(kind)


# (ebook id, title, wrapper shape); ids are made up
_PD_BOOKS = [
    (9001, "Mossy Dell", "the"),
    (9002, "The Brass Kite", "this"),
    (9003, "Oddly Far", "split"),
    (9004, "Quince Hall", "small_print"),
    (9005, "Plain Thing", "none"),
    (9006, "Lark Rise", "the"),
    (9007, "Tin Fern", "this"),
]


_PD_BODIES = {i: fake_book(i) for i, _, _ in _PD_BOOKS}


_PD_RAW = {i: _pd_wrap(kind, i, title, _PD_BODIES[i]) for i, title, kind in _PD_BOOKS}


def _pd_books_tsv(path, books=_PD_BOOKS):
    with open(path, "w", encoding="utf-8") as f:
        f.write("rank\tid\ttitle\tauthor\n")
        for rank, (i, title, _) in enumerate(books, 1):
            f.write(f"{rank}\t{i}\t{title}\tSomebody\n")
    return str(path)


class _PdServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # clients that gave up (timeout fault) make writes fail; that is expected


class _PdHandler(http.server.BaseHTTPRequestHandler):
    """Serves server.files; server.faults[path] is a list of faults used up one per request: an HTTP
    status such as '500', '429' or '404', 'html' (an HTML page), 'timeout' (answer after server.delay
    s), 'truncate' (half the promised bytes)."""

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.log.append((self.path, self.headers.get("User-Agent", "")))
            faults = srv.faults.get(self.path)
            fault = faults.pop(0) if faults else None
        body = srv.files.get(self.path)
        if fault == "html":
            body = b"<!DOCTYPE html>\n<html><body>Please complete the check.</body></html>\n"
        if fault == "timeout":
            time.sleep(srv.delay)
        status = int(fault) if fault and fault.isdigit() else 404 if body is None else 200
        if status != 200:
            self.send_error(status)
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2] if fault == "truncate" else body)
            self.close_connection = True

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _pd_serve(raws, all_paths=True):
    """A loopback server with every book at gutenberg.org's three paths (or only the first); raws:
    {ebook id: bytes}. A user's proxy must not see loopback requests: no_proxy is set meanwhile."""
    srv = _PdServer(("127.0.0.1", 0), _PdHandler)
    srv.lock, srv.log, srv.faults, srv.delay = threading.Lock(), [], {}, 1.0
    patterns = prepare_data.URL_PATTERNS if all_paths else prepare_data.URL_PATTERNS[:1]
    srv.files = {p.format(id=i): raw for i, raw in raws.items() for p in patterns}
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("no_proxy", "127.0.0.1,localhost")
            yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _pd_run(data_dir, *extra, books_tsv, mirror=None, timeout=0.5):
    """prepare_data.main with fast network settings (a 0.5 s timeout, 2 retries after 0.01 s and
    0.02 s, no pause); returns its exit status."""
    argv = ["--data_dir", str(data_dir), "--books", books_tsv, *f"--vocab_size {_PD_VOCAB} --pause 0".split()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare_data, "TIMEOUT", timeout)
        mp.setattr(prepare_data, "RETRIES", 2)
        mp.setattr(prepare_data, "BACKOFF", 0.01)
        return prepare_data.main(argv + (["--mirror", mirror] if mirror else []) + list(extra))


def _pd_source(folder, raws=_PD_RAW, name="{}.txt"):
    """Write raws ({ebook id: bytes}) into folder, a --source DIR, as name.format(id); returns folder."""
    for i, raw in raws.items():
        path = folder / name.format(i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    return folder


def _pd_outputs(data_dir):
    names = ["train.bin", "val.bin", "tokenizer.tiktoken", "meta.json"]
    return {n: open(os.path.join(data_dir, n), "rb").read() for n in names}


def _pd_leftovers(root):
    """Temp files anywhere under root (a half-written file would show up as one)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


@pytest.fixture(autouse=True)
def _pd_no_proxy(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")  # a user's proxy must not see loopback


@pytest.fixture(scope="module")
def pd_clean(tmp_path_factory):
    """One run against a clean server: (data_dir, books.tsv, server url)."""
    root = tmp_path_factory.mktemp("pd_clean")
    tsv = _pd_books_tsv(root / "books.tsv")
    with _pd_serve(_PD_RAW) as srv:
        assert _pd_run(root / "data", books_tsv=tsv, mirror=srv.url) == 0
        url = srv.url
    return root / "data", tsv, url


# ---- a book's text: Project Gutenberg's wrappers and the encodings
def test_pd_strip_keeps_body_and_drops_licence():
    for book_id, title, kind in _PD_BOOKS:
        body, warning = prepare_data.strip_gutenberg(prepare_data.decode_book(_PD_RAW[book_id]))
        assert body == _PD_BODIES[book_id], (book_id, kind)
        assert (warning is not None) == (kind == "none"), (book_id, kind)
        raw_lines = prepare_data.decode_book(_PD_RAW[book_id]).replace("\r\n", "\n").split("\n")
        body_lines = set(_PD_BODIES[book_id].split("\n"))
        wrapper = [ln for ln in raw_lines if ln.strip() and ln not in body_lines]
        assert kind == "none" or len(wrapper) > 5  # the fixture really has a header and licence
        kept = [ln for ln in wrapper if ln in body.split("\n")]
        assert kept == [], (book_id, kind, kept)
        assert "gutenberg" not in body.lower() and "small print" not in body.lower()


def test_pd_decode_utf8_bom_and_cp1252():
    assert (
        prepare_data.decode_book("\ufeffcaf\u00e9 \u201cx\u201d".encode("utf-8")) == "caf\u00e9 \u201cx\u201d"
    )
    assert prepare_data.decode_book("caf\u00e9 \u201cx\u201d".encode("cp1252")) == "caf\u00e9 \u201cx\u201d"


def test_pd_book_cut_short_is_used_with_a_warning_naming_it(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    raw = _PD_RAW[9001]
    cut = raw[: raw.index(b"*** END")]  # a download cut short: no END marker, no licence
    body, warning = prepare_data.strip_gutenberg(prepare_data.decode_book(cut))
    assert warning is not None and "cut short" in warning
    assert prepare_data.strip_gutenberg(prepare_data.decode_book(raw))[1] is None
    src = _pd_source(tmp_path / "src", {**_PD_RAW, 9001: cut})
    capsys.readouterr()
    assert _pd_run(tmp_path / "data", "--source", str(src), books_tsv=tsv) == 0
    out = capsys.readouterr().out
    assert "ebook 9001" in out and "cut short" in out and str(src / "9001.txt") in out


# ---- a run: its outputs, faults and retries, the cache, --source
def test_pd_clean_run_outputs(pd_clean):
    data_dir, _, url = pd_clean
    meta = json.load(open(data_dir / "meta.json"))
    ids = [i for i, _, _ in _PD_BOOKS]
    assert meta["vocab_size"] == _PD_VOCAB and meta["source"] == url
    assert sorted(meta["train_books"] + meta["val_books"]) == sorted(ids)
    assert set(meta["train_books"]).isdisjoint(meta["val_books"]) and meta["val_books"]
    enc = prepare_data.load_tokenizer(data_dir)
    assert enc.n_vocab == _PD_VOCAB and enc.eot_token == _PD_VOCAB - 1
    assert enc.decode([enc.eot_token]) == "<|endoftext|>"
    for split in ("train", "val"):
        tokens = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        assert len(tokens) == meta[f"{split}_tokens"]
        books = [i for i in ids if i in meta[f"{split}_books"]]  # in list order
        expected = "".join(_PD_BODIES[i] + "<|endoftext|>" for i in books)
        assert enc.decode(tokens.tolist()) == expected
        assert int(tokens.max()) == enc.eot_token and (tokens == enc.eot_token).sum() == len(books)
    lines = open(data_dir / "tokenizer.tiktoken", "rb").read().splitlines()
    assert len(lines) == _PD_VOCAB - 1 and len({ln.split()[0] for ln in lines}) == _PD_VOCAB - 1
    assert (
        hashlib.sha256(open(data_dir / "tokenizer.tiktoken", "rb").read()).hexdigest()
        == meta["tokenizer_sha256"]
    )
    assert sorted(os.listdir(data_dir / "raw")) == sorted(f"{i}.txt" for i in ids)
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ["train.bin", "meta.json", "raw/9001.txt"]:  # written via temp files, normal modes
        assert os.stat(data_dir / name).st_mode & 0o777 == 0o666 & ~umask
    for i in ids:
        assert open(data_dir / "raw" / f"{i}.txt", "rb").read() == _PD_RAW[i]


def _pd_record_sleeps(monkeypatch):
    """Record the main thread's time.sleep calls (the server's threads sleep for real)."""
    calls, real_sleep = [], time.sleep

    def sleep(s):
        if threading.current_thread() is threading.main_thread():
            calls.append(s)
        real_sleep(s)

    monkeypatch.setattr(time, "sleep", sleep)
    return calls


def test_pd_faults_are_retried_and_give_the_clean_result(pd_clean, tmp_path, monkeypatch):
    clean_dir, tsv, _ = pd_clean
    sleeps = _pd_record_sleeps(monkeypatch)
    with _pd_serve(_PD_RAW) as srv:
        first, second = prepare_data.URL_PATTERNS[:2]
        srv.faults = {
            first.format(id=9001): ["500", "500"],
            first.format(id=9002): ["timeout"],
            first.format(id=9003): ["404"],
            first.format(id=9004): ["truncate"],
            first.format(id=9005): ["html"],
            first.format(id=9007): ["429"],
        }
        assert _pd_run(tmp_path / "data", books_tsv=tsv, mirror=srv.url) == 0
        paths = collections.Counter(p for p, _ in srv.log)
        agents = {a for _, a in srv.log}
    assert all(not f for f in srv.faults.values())  # every fault was served
    assert paths[first.format(id=9001)] == 3 and paths[first.format(id=9002)] == 2
    assert paths[first.format(id=9003)] == 1 and paths[second.format(id=9003)] == 1
    assert paths[first.format(id=9004)] == 2 and paths[first.format(id=9006)] == 1
    assert paths[first.format(id=9005)] == 1 and paths[second.format(id=9005)] == 1  # HTML is no book
    assert paths[first.format(id=9007)] == 2  # 429 Too Many Requests: wait, then the same URL
    assert agents == {prepare_data.USER_AGENT}
    # backoff 0.01 s doubling: 9001 waits twice, 9002, 9004 and 9007 once; --pause 0 between books
    assert sorted(s for s in sleeps if s) == [0.01, 0.01, 0.01, 0.01, 0.02]
    got, want = _pd_outputs(tmp_path / "data"), _pd_outputs(clean_dir)
    meta_got, meta_want = json.loads(got.pop("meta.json")), json.loads(want.pop("meta.json"))
    assert got == want  # train.bin, val.bin, tokenizer: byte for byte
    meta_got.pop("source"), meta_want.pop("source")  # the two servers have different ports
    assert meta_got == meta_want
    assert _pd_leftovers(tmp_path) == []


def test_pd_second_run_uses_cache_and_is_identical(pd_clean, tmp_path, monkeypatch):
    _, tsv, _ = pd_clean
    sleeps = _pd_record_sleeps(monkeypatch)
    with _pd_serve(_PD_RAW) as srv:
        assert _pd_run(tmp_path / "data", "--pause", "0.05", books_tsv=tsv, mirror=srv.url) == 0
        assert sleeps == [0.05] * (len(_PD_BOOKS) - 1)  # a pause between downloads
        first = _pd_outputs(tmp_path / "data")
        n_requests = len(srv.log)
        assert _pd_run(tmp_path / "data", "--pause", "0.05", books_tsv=tsv, mirror=srv.url) == 0
        assert len(srv.log) == n_requests == len(_PD_BOOKS)  # nothing fetched twice
        assert len(sleeps) == len(_PD_BOOKS) - 1  # and no pauses for cached books
    assert _pd_outputs(tmp_path / "data") == first


def test_pd_source_dir_gives_the_same_result(pd_clean, tmp_path):
    clean_dir, tsv, _ = pd_clean
    src = tmp_path / "src"
    for k, name in enumerate(["{}.txt", "pg{}.txt", "cache/epub/{0}/pg{0}.txt"]):  # every naming style
        _pd_source(src, {i: raw for i, raw in _PD_RAW.items() if i % 3 == k}, name)
    assert _pd_run(tmp_path / "data", "--source", str(src), books_tsv=tsv) == 0
    got, want = _pd_outputs(tmp_path / "data"), _pd_outputs(clean_dir)
    for name in ("train.bin", "val.bin", "tokenizer.tiktoken"):
        assert got[name] == want[name]


def test_pd_server_down_fails_fast_and_leaves_no_partial_file(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    url = f"http://127.0.0.1:{port}"
    msg = error_line(
        capsys, _pd_run, tmp_path / "data", books_tsv=tsv, mirror=url, timeout=30, many_lines=True
    )
    # a hang check, not a speed measurement: retrying must not wait for the 30 s timeout
    assert time.time() - t0 < 10
    assert "could not download" in msg and "ebook 9001" in msg and "--mirror" in msg and "--source" in msg
    assert "not tried" in msg
    first_book = [ln for ln in msg.split("\n") if "ebook 9001" in ln][0]
    assert first_book.count("http://") == 1  # an unreachable host: its other paths are not tried
    assert os.listdir(tmp_path / "data" / "raw") == [] and not os.path.exists(tmp_path / "data" / "train.bin")
    assert _pd_leftovers(tmp_path) == []


def test_pd_missing_book_is_reported_and_resumed(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    raws = {i: r for i, r in _PD_RAW.items() if i != 9003}
    with _pd_serve(raws) as srv:
        err = error_line(capsys, _pd_run, tmp_path / "data", books_tsv=tsv, mirror=srv.url, many_lines=True)
        failed = [ln for ln in err.split("\n") if ln.startswith("  ebook")]
        assert len(failed) == 1 and "ebook 9003" in failed[0] and "HTTP 404" in failed[0]
        assert sorted(os.listdir(tmp_path / "data" / "raw")) == sorted(f"{i}.txt" for i in raws)
        assert not os.path.exists(tmp_path / "data" / "train.bin")
        srv.files.update({p.format(id=9003): _PD_RAW[9003] for p in prepare_data.URL_PATTERNS})
        n_requests = len(srv.log)
        assert _pd_run(tmp_path / "data", books_tsv=tsv, mirror=srv.url) == 0
        assert [p for p, _ in srv.log[n_requests:]] == [prepare_data.URL_PATTERNS[0].format(id=9003)]


def test_pd_non_utf8_terminal_prints_titles_with_a_replacement_character(pd_clean, tmp_path, monkeypatch):
    """On an ASCII terminal (PYTHONIOENCODING=ascii) a title such as "The N\u00fcrnberg Stove" prints
    as "The N?rnberg Stove" instead of ending the run with UnicodeEncodeError."""
    tsv = _pd_books_tsv(tmp_path / "books.tsv", [(9001, "The N\u00fcrnberg Stove", "the"), *_PD_BOOKS[1:]])
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="ascii") for _ in range(2))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with _pd_serve(_PD_RAW) as srv:
        assert _pd_run(tmp_path / "data", books_tsv=tsv, mirror=srv.url) == 0
    out.flush()
    assert "ebook 9001" in out.buffer.getvalue().decode("ascii")
    assert "The N?rnberg Stove" in out.buffer.getvalue().decode("ascii")


# ---- the tokenizer and the BPE
def test_pd_encoded_books_round_trip_arbitrary_unicode(pd_clean):
    enc = prepare_data.load_tokenizer(pd_clean[0])
    rng = random.Random(0)
    ranges = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x590, 0x6FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x10FFFF),
    ]
    samples = [
        "",
        " ",
        "\n\n\t \r\n",
        "e\u0301\u0302 a\u0308",
        "\U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f44d\U0001f3fd",
        "\u4f60\u597d\uff0c\u4e16\u754c\u3002",
        "\u00a0\u3000x",
        "<|endoftext|>",
        "don't 123 4567 ...!!",
    ]
    for _ in range(200):
        lo, hi = rng.choice(ranges)
        chars = [
            chr(c)
            for c in (rng.randint(lo, hi) for _ in range(rng.randint(1, 40)))
            if not 0xD800 <= c <= 0xDFFF
        ]
        samples.append("".join(chars))
        samples.append(bytes(rng.randrange(256) for _ in range(60)).decode("utf-8", errors="replace"))
    samples.append(_PD_BODIES[9001])
    ids = prepare_data.encode_books(enc, samples).tolist()  # the path train.bin is written by
    ends = [i for i, t in enumerate(ids) if t == enc.eot_token]
    assert len(ends) == len(samples)  # one <|endoftext|> after each book; text never turns into one
    for s, start, end in zip(samples, [-1] + ends, ends):
        assert enc.decode(ids[start + 1 : end]) == s


def test_pd_load_tokenizer_is_never_stale_and_checks_meta(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    src = _pd_source(tmp_path / "src")
    data = tmp_path / "data"
    for vocab in (_PD_VOCAB, 300):  # the same path, a new file: no cached ranks may survive
        assert _pd_run(data, "--source", str(src), "--vocab_size", str(vocab), books_tsv=tsv) == 0
        enc = prepare_data.load_tokenizer(data)
        assert enc.n_vocab == vocab and enc.eot_token == vocab - 1
        assert enc.decode(enc.encode_ordinary(_PD_BODIES[9002])) == _PD_BODIES[9002]
    tok = data / "tokenizer.tiktoken"
    tok.write_bytes(tok.read_bytes().replace(b" 298\n", b" 297\n"))
    assert "meta.json" in error_line(capsys, prepare_data.load_tokenizer, data)
    os.remove(data / "meta.json")
    assert "damaged" in error_line(capsys, prepare_data.load_tokenizer, data)
    assert "run `python prepare_data.py" in error_line(
        capsys, prepare_data.load_tokenizer, tmp_path / "nowhere"
    )


def _pd_both_bpes(words, n_tokens):
    """The tokens of the reference trainer and of the fast one."""
    return prepare_data.train_bpe_reference(words, n_tokens), prepare_data.train_bpe(
        words, n_tokens, log_every=0
    )


def test_pd_bpe_worked_example_of_the_docstring():
    for vocab in _pd_both_bpes(collections.Counter({"aaab": 2, "ab": 1}), 259):
        assert vocab[:256] == [bytes([b]) for b in range(256)] and vocab[256:] == [b"aa", b"ab", b"aaab"]


def test_pd_bpe_ties_go_to_the_smallest_pair_of_ids():
    """Pairs ba and zy both occur twice: ba (98, 97) first. Then ab and ac once each: ab (97, 98)
    before ac (97, 99), the left ids equal."""
    for vocab in _pd_both_bpes(collections.Counter({"ba": 2, "zy": 2, "ab": 1, "ac": 1}), 260):
        assert vocab[256:] == [b"ba", b"zy", b"ab", b"ac"]


def test_pd_incremental_bpe_matches_full_recount():
    for seed, alphabet in enumerate(["ab", "abc", "abcde", "xyz\u00e9\u4e00"]):  # few letters: many ties
        rng = random.Random(seed)
        words = collections.Counter(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(400)
        )
        reference, fast = _pd_both_bpes(words, 256 + 60)
        assert fast == reference
        assert len(set(fast)) == len(fast) == 256 + 60
    reference, fast = _pd_both_bpes(prepare_data.count_words([_PD_BODIES[9001]]), 256 + 80)
    assert fast == reference


# ---- the split and the book list
def test_pd_split_is_whole_books_deterministic_and_about_the_fraction():
    rng = random.Random(1)
    ids = rng.sample(range(1, 60000), 100)
    texts = ["x" * rng.randint(20_000, 600_000) for _ in ids]
    train, val = prepare_data.split_books(ids, texts, 0.05)
    assert sorted(train + val) == list(range(100)) and not set(train) & set(val)
    share = sum(len(texts[i]) for i in val) / sum(map(len, texts))
    assert 0.05 <= share < 0.05 + max(map(len, texts)) / sum(map(len, texts))
    # the split depends on the books, not on their order in the list
    order = list(range(100))
    rng.shuffle(order)
    train2, val2 = prepare_data.split_books([ids[i] for i in order], [texts[i] for i in order], 0.05)
    assert sorted(ids[order[i]] for i in val2) == sorted(ids[i] for i in val)


def test_pd_split_holds_out_books_in_the_order_of_sha256_of_their_ids():
    ids = [i for i, _, _ in prepare_data.read_books_tsv(prepare_data.parse_args([]).books)]
    # the default list's ids by sha256(str(id)), worked out by hand with hashlib: 2726 (00f3ca2e...),
    # 55 (02d20bbd...), 51 (031b4af5...), 1154 (06ec44cc...), 2557 (0844b610...), 146 (0a5b046d...),
    # 520 (0b35b06a...); the real books' lengths stop after six (meta.json's val_books of the default
    # list, prepared: 55, 146, 51, 2726, 2557, 1154, as prepare_data.py's docstring says)
    first = [2726, 55, 51, 1154, 2557, 146, 520]
    for k in range(1, len(first) + 1):  # books of equal length: k - 0.5 of 100 books' text takes k
        _, val = prepare_data.split_books(ids, ["x" * 1000] * len(ids), (k - 0.5) / len(ids))
        assert sorted(ids[i] for i in val) == sorted(first[:k]), k
    texts = ["x" * (20_000 if i == 2726 else 1000) for i in ids]  # the first book alone holds 17%
    assert [ids[i] for i in prepare_data.split_books(ids, texts, 0.05)[1]] == [2726]


def test_pd_default_book_list_is_the_100_ranked_books_in_the_repository():
    path = prepare_data.parse_args([]).books
    assert os.path.dirname(path) == os.path.dirname(os.path.abspath(prepare_data.__file__))
    books = prepare_data.read_books_tsv(path)
    ranks = [line.split("\t")[0] for line in open(path, encoding="utf-8").read().splitlines()[1:]]
    assert len(books) == 100 and ranks == [str(r) for r in range(1, 101)]
    assert all(title and author for _, title, author in books)
    assert books[0] == (11, "Alice's Adventures in Wonderland", "Lewis Carroll")
    # the six validation books the docstring names are on the list
    assert {55, 146, 51, 2726, 2557, 1154} <= {i for i, _, _ in books}


# ---- bad input: one clear line, nothing half-written
def test_pd_bad_input_gives_one_clear_line(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    bad = tmp_path / "bad.tsv"
    bad.write_text("rank\tid\ttitle\tauthor\n1\t11\tAlice\tCarroll\n2\televen\tOops\tX\n")
    cases = [
        (["--books", str(bad)], "line 3"),
        (["--books", tsv, "--mirror", "http://127.0.0.1:9", "--data_dir", str(bad)], "check --data_dir"),
        (["--books", tsv, "--vocab_size", "70000"], "uint16"),
        (["--books", tsv, "--vocab_size", "many"], "invalid int value"),
        (["--books", tsv, "--pause", "-1"], "--pause"),
        (["--books", tsv, "--source", str(tmp_path / "nowhere")], "not a folder"),
        (["--books", tsv, "--mirror", "ftp://example"], "http"),
        (["--books", tsv, "--source", str(tmp_path)], "not found in --source"),
    ]
    utf16 = tmp_path / "books-utf16.tsv"  # a spreadsheet's "Unicode text": read as it is
    utf16.write_bytes(
        open(tsv, encoding="utf-8").read().replace("The Brass Kite", "Brass Kite \u00e9").encode("utf-16")
    )
    titles = [t for _, t, _ in prepare_data.read_books_tsv(tsv)]
    titles[1] = "Brass Kite \u00e9"
    assert [t for _, t, _ in prepare_data.read_books_tsv(str(utf16))] == titles
    latin1 = tmp_path / "books-latin1.tsv"
    latin1.write_bytes("rank\tid\ttitle\n1\t11\tCaf\u00e9\n2\t12\tNa\u00efve\n".encode("latin-1"))
    cases.append((["--books", str(latin1)], "save it as UTF-8"))
    for argv, words in cases:  # a --data_dir in argv wins over the first
        msg = error_line(capsys, prepare_data.main, ["--data_dir", str(tmp_path / "data"), *argv])
        assert words in msg, (argv, msg)
    assert not os.path.exists(tmp_path / "data" / "train.bin")


def test_pd_books_tsv_id_of_other_digits_is_one_line(tmp_path, capsys):
    bad = tmp_path / "books.tsv"
    bad.write_text("rank\tid\ttitle\tauthor\n1\t11\tAlice\tCarroll\n2\t\u00b2\tSquare\tX\n", encoding="utf-8")
    err = error_line(capsys, prepare_data.read_books_tsv, str(bad))
    assert "line 3" in err and len(err.strip().splitlines()) == 1


def test_pd_read_only_data_dir_is_refused_before_any_work(pd_clean, tmp_path, monkeypatch, capsys):
    """A --data_dir it may not write to is one line before the books are read and the BPE trained,
    not after (as root, chmod would not stop it: the refusal is simulated)."""
    _, tsv, _ = pd_clean
    data, src = tmp_path / "data", _pd_source(tmp_path / "src")
    data.mkdir()
    real_mkstemp = tempfile.mkstemp

    def read_only(*a, dir=None, **k):
        if os.path.abspath(dir or ".") == str(data):
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.setattr(prepare_data, "count_words", lambda texts: pytest.fail("the BPE started"))
    err = error_line(capsys, _pd_run, data, "--source", str(src), books_tsv=tsv)
    assert f"cannot write to --data_dir {data} (Permission denied)" in err
    assert os.listdir(data) == []


def test_pd_refuses_short_empty_and_binary_books_naming_the_file(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    short = _pd_wrap("the", 9006, "Lark Rise", "A short error page.\n")
    src = _pd_source(tmp_path / "src", {**_PD_RAW, 9006: short})
    err = error_line(capsys, _pd_run, tmp_path / "data", "--source", str(src), books_tsv=tsv)
    assert "ebook 9006" in err and "characters" in err and str(src / "9006.txt") in err
    (src / "9006.txt").write_bytes(b"")  # an empty file: the advice names it, not raw/9006.txt
    err = error_line(capsys, _pd_run, tmp_path / "data", "--source", str(src), books_tsv=tsv)
    assert "only 0 characters" in err and str(src / "9006.txt") in err and "raw" not in err
    (src / "9006.txt").write_bytes(bytes(range(256)) * 40)  # a binary file is refused, not decoded
    before = {p: p.read_bytes() for p in src.iterdir()}
    err = error_line(capsys, _pd_run, tmp_path / "data", "--source", str(src), books_tsv=tsv)
    assert "not a text file" in err and str(src / "9006.txt") in err
    assert {p: p.read_bytes() for p in src.iterdir()} == before
    assert not os.path.exists(tmp_path / "data" / "train.bin")


def test_pd_too_small_corpus_for_the_vocab_is_a_clear_error(pd_clean, tmp_path, capsys):
    _, tsv, _ = pd_clean
    argv = ["--source", str(_pd_source(tmp_path / "src")), *"--vocab_size 60000".split()]
    err = error_line(capsys, _pd_run, tmp_path / "data", *argv, books_tsv=tsv)
    assert "smaller --vocab_size" in err


# ======== training (train.py): the batches, settings, precision, the step eager or captured, DDP ========


_TR_TINY = "--n_layer 2 --n_embd 32 --n_hidden 64 --block_size 16 --batch_size 8 --n_head 4".split()


_TR_TINY += f"--eval_batches 2 --log_interval 5 --device {DEVICE}".split()


def _tr_make_data(path, vocab=64, n_words=5000, seed=0):
    """A data folder as prepare_data.py writes it (train.bin, val.bin, meta.json), from made-up 'words':
    fixed random token strings, so that there is something to learn."""
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, vocab - 1, size=rng.integers(2, 6)) for _ in range(40)]
    ids = np.concatenate([words[i] for i in rng.integers(0, 40, size=n_words)]).astype(np.uint16)
    os.makedirs(path, exist_ok=True)
    cut = int(0.9 * len(ids))
    ids[:cut].tofile(os.path.join(path, "train.bin"))
    ids[cut:].tofile(os.path.join(path, "val.bin"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"vocab_size": vocab}, f)
    return str(path)


def _tr_log(run_dir):
    with open(os.path.join(run_dir, "log.csv"), newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tr_data(tmp_path_factory):
    return _tr_make_data(tmp_path_factory.mktemp("trdata") / "data")


def _tr_add_checksums(path):
    """meta.json as prepare_data.py writes it: token counts and sha256 of the token files."""
    meta = json.load(open(os.path.join(path, "meta.json")))
    for split in ("train", "val"):
        raw = open(os.path.join(path, f"{split}.bin"), "rb").read()
        meta[f"{split}_tokens"], meta[f"{split}_sha256"] = len(raw) // 2, hashlib.sha256(raw).hexdigest()
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    return str(path)


def _tr_files(folder):
    """Every file in a folder with its bytes, to show that a refused command changed nothing."""
    if not os.path.isdir(folder):
        return None
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def _tr_train_loss_column(run_dir):
    rows = _tr_log(run_dir)
    assert [int(r["iter"]) for r in rows] == list(range(1, len(rows) + 1))  # no gaps, no duplicates
    return [r["train_loss"] for r in rows], {r["iter"]: r["val_loss"] for r in rows if r["val_loss"]}


def _tr_argv(tmp_path, *argv, data, name="run"):
    """train.py's arguments for the tiny settings into tmp_path/name."""
    return _TR_TINY + ["--data_dir", data, "--out_dir", str(tmp_path / name), *argv]


def _tr_train(tmp_path, *argv, data, name="run"):
    """train.main on the tiny settings into tmp_path/name; returns (exit status, folder)."""
    return train.main(_tr_argv(tmp_path, *argv, data=data, name=name)), str(tmp_path / name)


# ---- the batches: a seeded order per epoch, the same for every mixer
def test_train_batch_order_is_a_seeded_permutation_per_epoch():
    starts = train.batch_starts  # (i, n_starts, batch_size, data_seed) -> the starts of batch i
    n, b = 50, 8
    per_epoch = n // b  # 6 full batches; the 2 leftover starts of each epoch are skipped
    batches = [starts(i, n, b, 3) for i in range(3 * per_epoch)]
    assert [len(x) for x in batches] == [b] * (3 * per_epoch)  # every batch full, in every epoch
    epochs = [torch.cat(batches[e * per_epoch : (e + 1) * per_epoch]) for e in range(3)]
    for epoch in epochs:
        assert len(set(epoch.tolist())) == per_epoch * b  # no start repeats within an epoch
        assert 0 <= epoch.min() and epoch.max() < n
    assert not torch.equal(epochs[0], epochs[1])  # a new permutation for the next epoch
    assert torch.equal(starts(2, n, b, 3), starts(2, n, b, 3))
    assert not torch.equal(starts(0, n, b, 3), starts(0, n, b, 4))


def test_train_two_mixers_see_identical_batches(tr_data, tmp_path, monkeypatch):
    seen = {}
    real_get_batch = train.get_batch

    def recording(run):
        def get_batch(data, starts, block_size, device):
            x, y = real_get_batch(data, starts, block_size, device)
            seen.setdefault(run, []).append((x.clone(), y.clone()))
            return x, y

        return get_batch

    runs = {
        "sa": ["--mixer", "sa", "--seed", "1", "--dropout", "0.1"],
        "me": ["--mixer", "me", "--seed", "2", "--dropout", "0.0"],
        "other_data_seed": ["--mixer", "me", "--data_seed", "99"],
    }
    for run, flags in runs.items():
        monkeypatch.setattr(train, "get_batch", recording(run))
        rc = train.main(_TR_TINY + flags + f"--data_dir {tr_data} --max_iters 6 --eval_interval 3".split()
                        + ["--out_dir", str(tmp_path / run)])  # fmt: skip
        assert rc == 0
    assert len(seen["sa"]) == len(seen["me"]) > 6  # 6 training batches plus the validation batches
    for (xa, ya), (xm, ym) in zip(seen["sa"], seen["me"]):
        assert torch.equal(xa, xm) and torch.equal(ya, ym)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # y is x shifted by one token
    assert not torch.equal(seen["sa"][0][0], seen["other_data_seed"][0][0])
    # the validation windows are the same at every evaluation (batches 4-5 and 8-9 of the calls)
    assert torch.equal(seen["sa"][3][0], seen["sa"][8][0])


# ---- settings and bad input
def test_train_help_gives_every_setting_its_symbol(capsys):
    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    import dataclasses

    for f in dataclasses.fields(train.Config):
        if f.name != "vocab_size":
            assert f"--{f.name}" in text, f.name
    # written here, not read from common.py: the paper's letters (Table 1's l, d, c, m, p and Section 4's
    # n heads), then the short names the other settings carry in run folders (README: out/me-m2-l64-b32)
    symbols = dict(block_size="l", n_embd="d", n_hidden="c", n_layer="m", n_head="n", dropout="p")
    symbols |= dict(batch_size="b", lr="lr", weight_decay="wd", grad_clip="clip", seed="seed")
    symbols |= dict(data_seed="dseed", beta1="bm", beta2="bv")
    for name, symbol in symbols.items():  # the flag's own help starts with its symbol
        assert re.search(rf"--{name} \S+\s+{re.escape(symbol)}: ", text), (name, symbol)


@pytest.mark.parametrize(
    "case",
    [
        "unknown mixer",
        "missing data",
        "n_head",
        "negative",
        "other config",
        "existing run",
        "token beyond vocab",
        "resume nothing",
        "bad batch",
        "eval beyond val",
    ],
)
def test_train_bad_input_gives_one_clear_line(case, tr_data, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    base = _TR_TINY + ["--data_dir", tr_data, "--out_dir", out_dir, "--max_iters", "2"]
    if case in ("other config", "existing run"):
        assert train.main(base) == 0
        capsys.readouterr()
    if case == "token beyond vocab":
        bad = _tr_make_data(tmp_path / "bad", vocab=64)
        with open(os.path.join(bad, "meta.json"), "w") as f:
            json.dump({"vocab_size": 32}, f)
        base = base + ["--data_dir", bad]
    argv = (
        base
        + {
            "unknown mixer": ["--mixer", "nope"],
            "missing data": ["--data_dir", str(tmp_path / "none")],
            "n_head": ["--n_embd", "30", "--n_head", "4", "--mixer", "sa"],
            "negative": ["--n_layer", "-2"],
            "other config": ["--resume", "--n_layer", "3"],
            "existing run": [],
            "token beyond vocab": [],
            "resume nothing": ["--resume"],
            "bad batch": ["--batch_size", "0"],
            "eval beyond val": ["--eval_batches", "1000000000"],
        }[case]
    )
    before = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else None
    err = error_line(capsys, train.main, argv)
    key = {
        "unknown mixer": "nope",
        "missing data": "prepare_data",
        "n_head": "n_head",
        "negative": "n_layer",
        "other config": "n_layer",
        "existing run": "--resume",
        "token beyond vocab": "vocab_size",
        "resume nothing": "no checkpoint",
        "bad batch": "batch_size",
        "eval beyond val": "--eval_batches",
    }[case]
    assert key in err
    after = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else None
    assert after == before  # nothing written, nothing half-written


@pytest.mark.slow
def test_train_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    argv = f"train.py --mixer sa --n_embd 30 --n_head 4 --data_dir {tmp_path / 'missing'}".split()
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--beta1", "1.5"], "--beta1"),
        (["--beta2", "-0.5"], "--beta2"),
        (["--weight_decay", "nan"], "--weight_decay"),
        (["--grad_clip", "inf"], "--grad_clip"),
        (["--seed", str(2**64)], "--seed"),
    ],
)
def test_train_bad_optimizer_settings_and_huge_seeds_are_one_line(flags, needle, tr_data, tmp_path, capsys):
    assert needle in error_line(
        capsys, train.main, _tr_argv(tmp_path, "--max_iters", "2", *flags, data=tr_data)
    )
    assert not os.path.exists(tmp_path / "run")  # no folder holding only train.lock


def test_train_refuses_data_files_that_do_not_match_meta(tr_data, tmp_path, capsys):
    for case in ("odd size", "changed"):
        data = _tr_add_checksums(_tr_make_data(tmp_path / case.replace(" ", "_")))
        raw = open(os.path.join(data, "train.bin"), "rb").read()
        open(os.path.join(data, "train.bin"), "wb").write(
            raw[:-1] if case == "odd size" else raw[:-2] + b"\0\0"
        )
        out = str(tmp_path / "run")
        argv = _TR_TINY + ["--data_dir", data, "--out_dir", out, "--max_iters", "2"]
        assert ("odd number of bytes" if case == "odd size" else "sha256") in error_line(
            capsys, train.main, argv
        )
        assert not os.path.exists(out)


# ---- precision and the step: eager or captured in a CUDA graph, and what run.json says
def test_train_notes_that_half_precision_on_the_cpu_may_be_slower(tr_data, tmp_path, capsys):
    flags = _TR_TINY + ["--data_dir", tr_data, "--max_iters", "2", "--device", "cpu"]
    for dtype in ("float32", "bfloat16", "float16"):
        assert train.main(flags + ["--dtype", dtype, "--out_dir", str(tmp_path / dtype)]) == 0
        notes = [line for line in capsys.readouterr().out.splitlines() if "on the CPU may run" in line]
        assert len(notes) == (dtype != "float32") and all(f"--dtype {dtype} " in n for n in notes), notes


def test_train_says_in_its_description_line_that_the_step_runs_eager_and_why(tr_data, tmp_path, capsys):
    """The step is a CUDA graph only on CUDA: elsewhere the run's description line, and no other line,
    says it runs eager and why; --no-cuda_graph is accepted and named. Where CUDA could capture it, each
    setting that rules capture out is named (rundir.make_step on a stand-in run: nothing is built)."""
    flags = _TR_TINY + ["--data_dir", tr_data, "--max_iters", "2", "--device", "cpu"]
    for name, extra, why in (
        ("on", [], "no CUDA graphs on cpu"),
        ("off", ["--no-cuda_graph"], "--no-cuda_graph"),
    ):
        out = str(tmp_path / name)
        assert train.main(flags + extra + ["--out_dir", out]) == 0
        said = [line for line in capsys.readouterr().out.splitlines() if "eager" in line or "graph" in line]
        assert said == [f"on cpu (float32), step eager ({why}); {out}"]
    table1 = train.build_parser().parse_args([])
    for change, world, why in (
        (dict(cuda_graph=False), 1, "--no-cuda_graph"),
        ({}, 2, "DDP"),
        (dict(dtype="float16"), 1, "--dtype float16"),
        (dict(compile=True), 1, "--compile"),
    ):
        args = argparse.Namespace(**{**vars(table1), **change})
        run = argparse.Namespace(args=args, device=torch.device("cuda"), model=None, optimizer=None)
        run.scaler = run.ctx = None
        assert rundir.make_step(run, train.train_step, world)[1].startswith(f"eager ({why}"), why


def test_train_run_json_says_how_the_run_computed_and_on_which_data(tmp_path, monkeypatch):
    """run.json: the device and its model, torch, the precision of float32 matmuls actually in effect (TF32
    switched on for CUDA does not make the CPU's matmuls TF32), autocast, the step eager, the FIR's complex
    products not in TF32, and the data's fingerprint as the checkpoint keeps it."""
    data = _tr_add_checksums(_tr_make_data(tmp_path / "data"))
    sha = lambda split: hashlib.sha256(open(os.path.join(data, f"{split}.bin"), "rb").read()).hexdigest()
    fingerprint = dict(vocab_size=64, train_sha256=sha("train"), val_sha256=sha("val"), tokenizer_sha256=None)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)  # as after a CUDA run in this process
    for dtype, autocast in (("float32", None), ("bfloat16", "bfloat16")):
        out = tmp_path / dtype
        flags = _TR_TINY + ["--data_dir", data, "--max_iters", "2", "--device", "cpu", "--out_dir", str(out)]
        assert train.main(flags + ["--dtype", dtype]) == 0
        info = json.load(open(out / "run.json"))
        computed = dict(info["computed"])
        name = computed.pop("device_name")
        assert name and (not os.path.exists("/proc/cpuinfo") or name in open("/proc/cpuinfo").read())
        assert computed == {
            "device": "cpu", "torch": torch.__version__, "float32_matmul": "ieee", "autocast": autocast,
            "captured": False, "step": "eager (no CUDA graphs on cpu)", "fir_matmul": "ieee",
        }  # fmt: skip
        assert info["data"] == fingerprint == torch.load(out / "ckpt.pt", weights_only=True)["data"]


_CUDA_ONLY = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs: run with TEST_DEVICE=cuda")


@_CUDA_ONLY
@pytest.mark.parametrize("mixer", ["sa", "she", "he", "we", "me", "he-ext"])
def test_captured_step_equals_the_eager_step_bit_for_bit(mixer):
    """rundir.CapturedStep against train.train_step, with dropout and gradient clipping on, in float32 and
    under bf16 autocast: 3 eager warm-up steps, the capture, 5 replays. The same losses, parameters and
    AdamW moments, to the bit, and the CUDA generator left where the eager steps leave it (so a
    checkpoint's RNG state continues the run)."""
    cfg = Config(
        vocab_size=50, block_size=16, n_embd=16, n_hidden=32, n_layer=2, n_head=4, dropout=0.1, mixer=mixer
    )
    batches = torch.randint(0, 50, (9, 4, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for dtype in ("float32", "bfloat16"):
        ends = []
        for captured in (False, True):
            torch.manual_seed(0)  # the same initialisation, and the same dropout stream on the GPU
            model = Transformer(cfg).to(DEVICE)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
            ctx, scaler = train.precision(DEVICE, dtype)
            step = functools.partial(train.train_step, model, opt, scaler, ctx, grad_clip=0.5)
            step = rundir.CapturedStep(step) if captured else step
            losses = torch.stack([step(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches])
            moments = [st[k] for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
            ends.append((losses, list(model.parameters()) + moments, torch.cuda.get_rng_state(DEVICE)))
            assert not captured or step.graph is not None  # the last 5 steps were replays
        (eager, eager_tensors, eager_rng), (graph, graph_tensors, graph_rng) = ends
        assert torch.equal(graph, eager), (dtype, graph - eager)
        assert all(torch.equal(a, b) for a, b in zip(graph_tensors, eager_tensors)), dtype
        assert torch.equal(graph_rng, eager_rng), dtype


@_CUDA_ONLY
def test_train_captured_run_resumed_continues_bit_for_bit_and_equals_the_eager_run(tr_data, tmp_path, capsys):
    """train.py on CUDA: a captured run stopped at batch 20 and resumed (3 eager steps, a new capture) logs
    what the run without a stop logs, to the bit, and so does the same run with --no-cuda_graph. run.json
    and the description line say how each computed; --no-tf32 switches TF32 off."""
    flags = (
        _TR_TINY
        + f"--mixer she --dropout 0.1 --grad_clip 0.5 --data_dir {tr_data} --ckpt_interval 10".split()
    )
    flags += ["--eval_interval", "10"]
    runs = {name: str(tmp_path / name) for name in ("full", "part", "eager", "ieee")}
    assert train.main(flags + ["--out_dir", runs["full"], "--max_iters", "30"]) == 0
    assert train.main(flags + ["--out_dir", runs["part"], "--max_iters", "20"]) == 0
    assert train.main(["--out_dir", runs["part"], "--max_iters", "30", "--resume"]) == 0
    assert train.main(flags + ["--out_dir", runs["eager"], "--max_iters", "30", "--no-cuda_graph"]) == 0
    assert train.main(flags + ["--out_dir", runs["ieee"], "--max_iters", "2", "--no-tf32"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("on cuda")]
    precisions = [
        line.split("(", 1)[1].split(")")[0] for line in said
    ]  # full, part, part resumed, eager, ieee
    assert precisions == ["float32, TF32 matmuls"] * 4 + ["float32"], said
    steps = [line.split(", step ", 1)[1].split(";")[0] for line in said]
    assert steps == ["captured in a CUDA graph"] * 3 + ["eager (--no-cuda_graph)", "captured in a CUDA graph"]
    full = _tr_train_loss_column(runs["full"])  # train losses, val losses
    assert len(full[0]) == 30 and _tr_train_loss_column(runs["part"]) == full
    assert _tr_train_loss_column(runs["eager"]) == full
    computed = {k: json.load(open(os.path.join(v, "run.json")))["computed"] for k, v in runs.items()}
    assert computed["full"]["device_name"] == torch.cuda.get_device_name(DEVICE)
    assert [computed[k]["captured"] for k in runs] == [True, True, False, True]
    assert [computed[k]["float32_matmul"] for k in runs] == ["tf32", "tf32", "tf32", "ieee"]
    assert computed["ieee"]["fir_matmul"] == "ieee"


# ---- DDP
@pytest.mark.slow
def test_train_ddp_two_processes_match_single_process(tr_data, tmp_path):
    """torchrun with 2 CPU processes (gloo) splits each global batch; the logged loss is the loss of the
    whole global batch, as in one process."""
    flags = _TR_TINY + f"--mixer sa --dropout 0 --data_dir {tr_data} --max_iters 6 --eval_interval 3".split()
    flags += "--ckpt_interval 3 --device cpu".split()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
        + flags
        + ["--out_dir", str(tmp_path / "ddp")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("iter 6/6") == 1 and r.stdout.count("parameters:") == 1, r.stdout  # rank 0 only
    assert train.main(flags + ["--out_dir", str(tmp_path / "one")]) == 0
    ddp, one = _tr_log(str(tmp_path / "ddp")), _tr_log(str(tmp_path / "one"))
    assert len(ddp) == len(one) == 6
    for a, b in zip(ddp, one):
        assert abs(float(a["train_loss"]) - float(b["train_loss"])) < 1e-5
        assert (a["val_loss"] == "") == (b["val_loss"] == "")
        if a["val_loss"]:
            assert abs(float(a["val_loss"]) - float(b["val_loss"])) < 1e-5
    ckpt = torch.load(str(tmp_path / "ddp" / "ckpt.pt"), weights_only=True)
    assert len(ckpt["rng"]) == 2  # each rank's dropout stream, for resuming


# ======== run folders (rundir.py): lock, judgement, resume, checkpoints, signals, logs, names ========


# ---- the lock and the judgement: a folder holds one run
def test_train_second_run_on_a_locked_folder_is_refused_and_touches_nothing(tr_data, tmp_path, capsys):
    out = str(tmp_path / "run")
    flags = _TR_TINY + ["--data_dir", tr_data, "--out_dir", out, "--max_iters", "4"]
    assert train.main(flags) == 0
    capsys.readouterr()
    before = _tr_files(out)
    held = rundir.lock_run_dir(out)  # as if another train.py were running there
    for argv in (flags + ["--overwrite"], flags[:-1] + ["8", "--resume"]):
        assert "another train.py is running" in error_line(capsys, train.main, argv)
        assert _tr_files(out) == before
    held.close()  # the other process ends: its lock goes with it
    assert train.main(flags[:-1] + ["8", "--resume"]) == 0


class _Killed(BaseException):
    """Stands for kill -9 in the middle of a run: nothing in train.py catches it."""


def test_train_folder_is_locked_before_it_is_judged(tr_data, tmp_path, monkeypatch, capsys):
    """A second train.py started while the first still loads its data (8.6 s for a 1 GB train.bin) is
    refused at once: the first took the lock before it judged the folder, not after the data."""
    out = str(tmp_path / "run")
    flags = _TR_TINY + ["--data_dir", tr_data, "--out_dir", out, "--max_iters", "4"]
    loading, second_done, real_load, first = threading.Event(), threading.Event(), train.load_data, {}

    def slow_load(*args):  # the first call waits until the second run has had its go
        if not loading.is_set():
            loading.set()
            second_done.wait(60)
        return real_load(*args)

    monkeypatch.setattr(train, "load_data", slow_load)
    thread = threading.Thread(target=lambda: first.setdefault("rc", train.main(flags)))
    thread.start()
    assert loading.wait(60)
    err = error_line(capsys, train.main, flags)
    second_done.set()
    thread.join(120)
    assert "another train.py is running" in err
    assert first["rc"] == 0 and torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter"] == 4


def test_train_fresh_run_refuses_a_folder_whose_log_holds_a_run(tr_data, tmp_path, capsys):
    rc, out = _tr_train(tmp_path, "--mixer", "he", "--max_iters", "12", data=tr_data)
    assert rc == 0
    os.remove(os.path.join(out, "ckpt.pt"))  # deleted to save disk: plots need only log.csv
    before = _tr_files(out)
    capsys.readouterr()
    assert "--overwrite" in error_line(
        capsys, train.main, _tr_argv(tmp_path, "--mixer", "me", "--max_iters", "4", data=tr_data)
    )
    assert _tr_files(out) == before  # the he run's 12 rows are still there
    rc, _ = _tr_train(tmp_path, "--max_iters", "3", data=tr_data, name="short")  # ended before batch 10
    os.remove(str(tmp_path / "short" / "ckpt.pt"))
    capsys.readouterr()
    assert "log.csv of a run" in error_line(
        capsys, train.main, _tr_argv(tmp_path, "--max_iters", "4", data=tr_data, name="short")
    )
    rc, _ = _tr_train(tmp_path, "--mixer", "me", "--max_iters", "4", "--overwrite", data=tr_data)
    assert rc == 0 and len(_tr_log(out)) == 4


def test_train_run_without_checkpoint_restarts_and_max_iters_0_writes_nothing(tr_data, tmp_path, capsys):
    out = str(tmp_path / "run")
    flags = _TR_TINY + ["--data_dir", tr_data, "--out_dir", out]
    assert train.main(flags + ["--max_iters", "0"]) == 0 and not os.path.exists(out)
    os.makedirs(out)  # a run killed before its first checkpoint leaves a log and run.json
    open(os.path.join(out, "log.csv"), "w").write(
        "iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n1,5.0,,"
    )
    open(os.path.join(out, "run.json"), "w").write("{}")
    assert train.main(flags + ["--max_iters", "12", "--log_interval", "1000"]) == 0  # no --overwrite needed
    assert [int(r["iter"]) for r in _tr_log(out)] == list(range(1, 13))
    assert "iter 10/12" in capsys.readouterr().out  # the first console line comes at batch 10


def test_train_overwrite_killed_before_its_first_checkpoint_leaves_no_old_model(
    tr_data, tmp_path, monkeypatch, capsys
):
    """--overwrite removes the old run's checkpoint before it writes anything of the new run: killed at the
    worst moment (new run.json and log.csv, no checkpoint yet) the folder holds no model at all."""
    out = str(tmp_path / "run")
    flags = _TR_TINY + ["--data_dir", tr_data, "--out_dir", out, "--max_iters", "4"]
    assert train.main(flags + ["--mixer", "sa"]) == 0
    real_step = train.train_step
    monkeypatch.setattr(train, "train_step", lambda *a, **k: (_ for _ in ()).throw(_Killed()))
    with pytest.raises(_Killed):
        train.main(flags + ["--mixer", "me", "--overwrite"])
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))  # the old model went first
    assert json.load(open(os.path.join(out, "run.json")))["config"]["mixer"] == "me"
    assert "no checkpoint" in error_line(capsys, sample.main, ["--out_dir", out])
    assert "no checkpoint" in error_line(capsys, train.main, flags + ["--resume"])
    monkeypatch.setattr(train, "train_step", real_step)
    assert train.main(flags + ["--mixer", "me"]) == 0  # a plain rerun starts the new run again
    assert [int(r["iter"]) for r in _tr_log(out)] == [1, 2, 3, 4]


def test_train_killed_while_writing_its_first_checkpoint_starts_again_with_the_plain_command(
    tr_data, tmp_path, monkeypatch, capsys
):
    """kill -9 while the first ckpt.pt is written (log.csv already at batch 10): no checkpoint was ever
    written, so the same command starts the run again (gpu.py never passes --overwrite). A run that had
    written one, even if killed later, keeps its log.csv when its ckpt.pt is deleted."""
    real_save, saves = torch.save, []

    def killed_at_save(n):
        def save(obj, f, *a, **k):
            saves.append(1)
            if len(saves) == n:
                f.write(b"half a checkpoint")
                raise _Killed()
            return real_save(obj, f, *a, **k)

        return save

    def killed_run(name, n_save, *argv):
        flags = _TR_TINY + ["--data_dir", tr_data, "--out_dir", str(tmp_path / name), "--log_interval", "10"]
        flags += ["--max_iters", "30", *argv]
        saves.clear()
        monkeypatch.setattr(torch, "save", killed_at_save(n_save))
        with pytest.raises(_Killed):
            train.main(flags)
        monkeypatch.setattr(torch, "save", real_save)
        (tmp_path / name / ".ckpt.ptq7x2k.tmp").write_bytes(b"half a checkpoint")  # what kill -9 leaves
        return flags, str(tmp_path / name)

    flags, out = killed_run("first", 1)
    assert _tr_log(out)[-1]["iter"] == "10" and not os.path.exists(os.path.join(out, "ckpt.pt"))
    assert "no checkpoint" in error_line(capsys, train.main, flags + ["--resume"])
    assert train.main(flags) == 0  # the plain command starts the run again
    assert [int(r["iter"]) for r in _tr_log(out)] == list(range(1, 31))

    flags, out = killed_run("second", 2, "--ckpt_interval", "20")  # killed at batch 20's checkpoint
    os.remove(os.path.join(out, "ckpt.pt"))  # batch 10's, deleted to save disk
    capsys.readouterr()
    assert "log.csv of a run" in error_line(capsys, train.main, flags)
    assert [int(r["iter"]) for r in _tr_log(out)] == list(range(1, 21))  # kept


# ---- resume: bit for bit, on the same data, from a log that reaches the checkpoint
def test_train_resume_equals_uninterrupted_run_bit_for_bit(tr_data, tmp_path):
    flags = (
        _TR_TINY
        + f"--mixer sa --dropout 0.1 --data_dir {tr_data} --eval_interval 4 --ckpt_interval 3".split()
    )
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert train.main(flags + ["--out_dir", full, "--max_iters", "14"]) == 0
    assert train.main(flags + ["--out_dir", part, "--max_iters", "6"]) == 0
    with open(os.path.join(part, "log.csv"), "a") as f:  # a crash after the checkpoint logged more rows
        f.write("7,1.0,,0.001,1.0,1.0\n8,2.")
    # resumed with only --out_dir and --max_iters: every other setting comes from the checkpoint
    assert train.main(["--out_dir", part, "--max_iters", "14", "--resume"]) == 0
    loss_full, val_full = _tr_train_loss_column(full)
    loss_part, val_part = _tr_train_loss_column(part)
    assert len(loss_full) == 14 and loss_part == loss_full  # the same strings: the same floats, to the bit
    assert val_part["4"] == val_full["4"] and val_part["12"] == val_full["12"]
    ckpt = torch.load(os.path.join(part, "ckpt.pt"), weights_only=True)
    assert ckpt["iter"] == 14 and ckpt["config"]["mixer"] == "sa" and ckpt["args"]["data_seed"] == 1337


def test_train_resume_refuses_other_data_unless_asked(tr_data, tmp_path, capsys):
    data = _tr_add_checksums(_tr_make_data(tmp_path / "a", seed=0))
    other = _tr_add_checksums(_tr_make_data(tmp_path / "b", seed=1))
    out = str(tmp_path / "run")
    assert train.main(_TR_TINY + ["--data_dir", data, "--out_dir", out, "--max_iters", "4"]) == 0
    saved = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["args"]["data_dir"]
    assert saved == os.path.abspath(data)
    capsys.readouterr()
    before = _tr_files(out)
    resume = f"--out_dir {out} --max_iters 8 --resume --data_dir {other}".split()
    assert "other data (train, val differ)" in error_line(capsys, train.main, resume)
    assert _tr_files(out) == before
    assert train.main(resume + ["--allow_other_data"]) == 0
    # a checkpoint without the data's checksums is not one of this train.py's
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    del ckpt["data"]
    torch.save(ckpt, os.path.join(out, "ckpt.pt"))
    argv = f"--out_dir {out} --max_iters 10 --resume".split()
    assert "not from this train.py" in error_line(capsys, train.main, argv)


def test_train_resume_refuses_a_log_that_does_not_reach_the_checkpoint(tr_data, tmp_path, capsys):
    rc, out = _tr_train(tmp_path, "--max_iters", "12", data=tr_data)
    assert rc == 0
    log = os.path.join(out, "log.csv")
    rows = open(log).read().splitlines()
    for kept in ([], rows[:6]):  # log.csv deleted, or cut back to batch 5
        if kept:
            open(log, "w").write("\n".join(kept) + "\n")
        else:
            os.remove(log)
        before = _tr_files(out)
        capsys.readouterr()
        assert "ckpt.pt is at batch 12" in error_line(
            capsys, train.main, _tr_argv(tmp_path, "--max_iters", "16", "--resume", data=tr_data)
        )
        assert _tr_files(out) == before


# ---- checkpoints and file errors: what is kept
def test_train_file_errors_are_one_line_saying_what_was_kept(tr_data, tmp_path, monkeypatch, capsys):
    flags = _TR_TINY + ["--data_dir", tr_data, "--max_iters", "30", "--ckpt_interval", "20"]
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert "is a file" in error_line(capsys, train.main, flags + ["--out_dir", str(a_file)])
    # a folder it may not write in (as root, chmod would not stop it: the refusal is simulated)
    real_open = builtins.open

    def read_only(path, *a, **k):
        if str(path).endswith("train.lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", read_only)
        err = error_line(capsys, train.main, flags + ["--out_dir", str(tmp_path / "ro")])
    assert "Permission denied" in err
    # the disk fills up at the second checkpoint (batch 20): torch.save raises RuntimeError
    real_save, saves = torch.save, []

    def disk_full(obj, f, *a, **k):
        saves.append(1)
        if len(saves) == 2:
            f.write(b"half a checkpoint")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", disk_full)
    out = str(tmp_path / "run")
    err = error_line(capsys, train.main, flags + ["--out_dir", out])
    assert "it keeps batch 5" in err  # (the first log point, at 5)
    monkeypatch.undo()
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter"] == 5
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == []


def test_train_removes_the_temp_files_of_a_killed_write(tr_data, tmp_path, capsys):
    out = tmp_path / "run"
    flags = _TR_TINY + ["--data_dir", tr_data, "--out_dir", str(out)]
    assert train.main(flags + ["--max_iters", "4"]) == 0
    (out / ".ckpt.ptx8k2_q.tmp").write_bytes(bytes(5000))  # kill -9 during torch.save leaves this
    (out / "notes.tmp").write_text("the user's own file")
    capsys.readouterr()
    assert train.main(flags + ["--max_iters", "8", "--resume"]) == 0
    assert not (out / ".ckpt.ptx8k2_q.tmp").exists() and (out / "notes.tmp").exists()
    assert "removed 1 temp file(s) of a killed write" in capsys.readouterr().out


def test_train_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    tr_data, tmp_path, capsys, monkeypatch
):
    out = str(tmp_path / "run")
    assert "--lr" in error_line(capsys, train.main, _TR_TINY + ["--data_dir", tr_data, "--lr", "inf"])
    real, calls = train.train_step, []

    def diverging(*a, **k):  # the 15th batch blows up, as a too-large --lr does
        calls.append(1)
        return real(*a, **k) * (math.nan if len(calls) >= 15 else 1.0)

    monkeypatch.setattr(train, "train_step", diverging)
    argv = _TR_TINY + ["--data_dir", tr_data, "--out_dir", out, "--max_iters", "50", "--log_interval", "20"]
    argv += ["--no-cuda_graph"]  # (on CUDA a captured step replays without calling train_step again)
    assert "became nan at batch 15; ckpt.pt keeps batch 10" in error_line(capsys, train.main, argv)
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter"] == 10  # the last good state


# ---- stop signals: Ctrl-C, SIGTERM, SIGHUP
def test_train_ctrl_c_checkpoints_then_resume_continues_exactly(tr_data, tmp_path, monkeypatch):
    flags = (
        _TR_TINY
        + f"--mixer me --dropout 0.1 --data_dir {tr_data} --eval_interval 100 --ckpt_interval 100".split()
    )
    flags += ["--max_iters", "10"]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    assert train.main(flags + ["--out_dir", full]) == 0
    real_get_batch, calls = train.get_batch, []

    def interrupting(data, starts, block_size, device):
        calls.append(1)
        if len(calls) == 4:  # Ctrl-C while batch 4 is being prepared
            os.kill(os.getpid(), signal.SIGINT)
        return real_get_batch(data, starts, block_size, device)

    monkeypatch.setattr(train, "get_batch", interrupting)
    assert train.main(flags + ["--out_dir", cut]) == 130
    assert torch.load(os.path.join(cut, "ckpt.pt"), weights_only=True)["iter"] == 4
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert train.main(flags + ["--out_dir", cut, "--resume"]) == 0
    assert _tr_train_loss_column(cut)[0] == _tr_train_loss_column(full)[0]


def _tr_signal_run(tmp_path, data, sig):
    """train.py in a subprocess whose output goes to a pipe (as under nohup), stopped by `sig` once its
    first console line, at batch 10, has come through."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe is block-buffered
    out = str(tmp_path / f"run-{sig}")
    argv = _TR_TINY + f"--data_dir {data} --out_dir {out} --max_iters 1000000 --log_interval 500".split()
    p = subprocess.Popen(
        [sys.executable, "train.py"] + argv,
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while "iter 10/" not in p.stdout.readline():
        assert time.time() < deadline and p.poll() is None, "no console line at batch 10"
    p.send_signal(sig)
    rest, err = p.communicate(timeout=120)
    return p.returncode, rest, err, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_train_kill_and_hangup_checkpoint_and_stop_like_ctrl_c(tr_data, tmp_path, sig):
    rc, rest, err, out = _tr_signal_run(tmp_path, tr_data, sig)
    assert rc == 128 + sig and "Traceback" not in err and "stopped at batch" in rest
    it = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter"]
    assert it > 10 and [int(r["iter"]) for r in _tr_log(out)] == list(range(1, it + 1))


# ---- log.csv, the console, the peak memory
def test_train_writes_log_checkpoint_and_plots(tr_data, tmp_path, capsys):
    runs = []
    for m, layers in (("sa", "1"), ("me", "1"), ("me", "2")):
        run = str(tmp_path / f"{m} {layers}")  # a space in the path: the printed hint quotes it
        flags = (
            f"--mixer {m} --n_layer {layers} --data_dir {tr_data} --max_iters 12 --eval_interval 6".split()
        )
        assert train.main(_TR_TINY + flags + ["--out_dir", run]) == 0
        runs.append(run)
    out = capsys.readouterr().out
    assert "parameters:" in out and "embeddings" in out and "mixers" in out and "ffns" in out and "ETA" in out
    hint = next(line for line in out.splitlines() if line.startswith("sample from it: "))
    assert shlex.split(hint.split(": ", 1)[1]) == ["python", "sample.py", "--out_dir", runs[0]]
    rows = _tr_log(runs[0])
    assert list(rows[0]) == ["iter", "train_loss", "val_loss", "lr", "tokens_per_s", "elapsed_s"]
    assert len(rows) == 12 and [r["val_loss"] != "" for r in rows].count(True) == 2
    assert all(float(r["lr"]) == 1e-3 and float(r["tokens_per_s"]) > 0 for r in rows)
    ckpt = torch.load(os.path.join(runs[0], "ckpt.pt"), weights_only=True)
    assert {"model", "optimizer", "config", "args", "iter", "rng", "scaler"} <= set(ckpt)
    for path in [os.path.join(r, "loss.png") for r in runs]:
        assert_png(path)
    outs = {k: str(tmp_path / f"{k}.png") for k in ("medians", "raw", "sweep")}
    assert plot.main(runs + ["--window", "4", "-o", outs["medians"]]) == 0
    assert plot.main(runs[:2] + ["--raw", "-o", outs["raw"]]) == 0
    assert plot.main(runs + ["--sweep", "n_layer", "--window", "4", "-o", outs["sweep"]]) == 0
    for path in outs.values():
        assert_png(path)
    table = capsys.readouterr().out
    assert all(os.path.basename(r) in table for r in runs)
    # the printed median is the median of the last 1000 (here all 12) logged costs
    assert f"{np.median([float(r['train_loss']) for r in rows]):.4f}" in table


def test_train_reports_its_peak_memory_last(tr_data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(_TR_TINY + ["--data_dir", tr_data, "--out_dir", out, "--max_iters", "4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    run = json.load(open(os.path.join(out, "run.json")))
    what = "peak CUDA memory allocated" if DEVICE.type == "cuda" else "peak resident memory"
    assert run["peak_memory_is"] == what and last.startswith(f"{what}: ") and last.endswith(" GB")
    assert abs(float(last.split()[-2]) - run["peak_memory_mb"] / 1024) < 0.01
    if DEVICE.type == "cpu":  # the process's own high-water mark: torch alone is over 100 MB
        assert 100 < run["peak_memory_mb"] < 8000


_TR_MEMORY_DRIVER = """
import sys, train
rss, real = {}, train.get_batch
def resident_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024
def get_batch(*args):
    rss[len(rss)] = resident_mb()  # before batch k + 1, i.e. after k batches
    return real(*args)
train.get_batch = get_batch
rc = train.main(sys.argv[1:])
print("RSS", rss[20], resident_mb())
sys.exit(rc)
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/status; the glibc tweak is Linux's"
)
def test_train_resident_memory_stays_flat_with_a_long_log_interval(tmp_path):
    """With 8 MB of logits per batch, a tensor kept per batch until the next log point would let the
    process grow by gigabytes over 200 batches (it did, before the loss buffer)."""
    data = _tr_make_data(tmp_path / "data", vocab=2000, n_words=40000)
    argv = "--mixer me --n_layer 1 --n_embd 16 --n_hidden 16 --block_size 32 --batch_size 32 --max_iters 200"
    argv += f" --log_interval 1000 --ckpt_interval 1000 --eval_batches 0 --device cpu --data_dir {data}"
    argv = (argv + f" --out_dir {tmp_path / 'run'}").split()
    r = subprocess.run(
        [sys.executable, "-c", _TR_MEMORY_DRIVER] + argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    after_20, end = map(float, r.stdout.split("RSS")[1].split())
    assert end < after_20 + 150, f"resident memory grew from {after_20:.0f} MB to {end:.0f} MB"


# ---- default folder names
def test_train_default_run_folders_differ_for_different_settings():
    p = train.build_parser()
    folder = lambda *argv: rundir.default_out_dir(p.parse_args(list(argv)), p.parse_args([]))
    assert folder("--mixer=me") == os.path.join("out", "me")  # Table 1
    assert folder("--mixer=sa") == os.path.join("out", "sa-32") and folder(
        "--mixer=sa", "--n_head=1"
    ).endswith("sa-1")
    quick = folder("--mixer=me", "--n_layer=2", "--block_size=64", "--batch_size=32", "--max_iters=2000")
    assert quick == os.path.join(
        "out", "me-m2-l64-b32"
    )  # max_iters does not name the run: extend with --resume
    assert folder("--mixer=he", "--lr=3e-4", "--seed=2") == os.path.join("out", "he-lr0.0003-seed2")


def test_train_default_run_folders_never_name_two_settings_alike():
    """Every mixer, with no, one or two settings changed from Table 1 to typical values of their type:
    no two of these get the same default folder (compared without case, as macOS and Windows do)."""
    p = train.build_parser()
    table1 = p.parse_args([])
    values = {
        int: [0, 1, 2, 3, 10, 20, 64, 100, 128, 12345678],
        float: [0.0, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0, 2.0, 10.0, 20.0, 1e-05, 3e-4, 0.00030000001],
    }
    changes = [
        (key, v)
        for key in common.SYMBOLS
        for v in values[type(getattr(table1, key))]
        if v != getattr(table1, key)
    ]
    settings = (
        [()]
        + [(c,) for c in changes]
        + [(a, b) for a, b in itertools.combinations(changes, 2) if a[0] != b[0]]
    )
    named = {}
    for mixer in sorted(MIXERS):
        for setting in settings:
            args = argparse.Namespace(**{**vars(table1), "mixer": mixer, **dict(setting)})
            name = rundir.default_out_dir(args, table1).lower()
            assert named.setdefault(name, (mixer, setting)) == (mixer, setting), name
    assert len(named) == len(MIXERS) * len(settings) > 50000


def test_train_default_run_folders_carry_exact_values():
    p = train.build_parser()
    folder = lambda *argv: rundir.default_out_dir(p.parse_args(["--mixer=me", *argv]), p.parse_args([]))
    for a, b in [
        ("--seed=12345678", "--seed=12345679"),
        ("--seed=1000001", "--seed=1000002"),
        ("--data_seed=20240101", "--data_seed=20240102"),
        ("--lr=0.00030000001", "--lr=0.0003"),
    ]:
        assert folder(a) != folder(b), (a, b)
    assert folder("--seed=12345678", "--lr=0.00030000001") == os.path.join(
        "out", "me-lr0.00030000001-seed12345678"
    )
    assert folder("--dropout=0", "--lr=3e-4") == os.path.join("out", "me-p0-lr0.0003")  # short names stay


# ======== sampling (sample.py), and end to end: fixture books -> prepare_data -> train -> sample ========


# English words, so that the prompts of the sampling tests are made of the books' own words
_TR_WORDS = (
    "the a little old fox owl hen miller baker lantern river garden moon kettle meadow sang found "
    "carried laughed whispered wandered over under beside quickly softly bright green silver "
    "morning evening and but so then once upon time there was who"
).split()


@pytest.fixture(scope="module")
def tr_prepared(tmp_path_factory):
    """prepare_data.py's outputs for three made-up books served by a loopback mirror."""
    root = tmp_path_factory.mktemp("trprep")
    books = [(i, f"Made-up Tales {i}", "the") for i in (101, 102, 103)]
    raws = {i: _pd_wrap(kind, i, title, fake_book(i, 900, _TR_WORDS)) for i, title, kind in books}
    tsv = _pd_books_tsv(root / "books.tsv", books)
    with _pd_serve(raws, all_paths=False) as srv:
        argv = ["--data_dir", str(root / "data"), "--mirror", srv.url, "--books", tsv]
        assert prepare_data.main([*argv, *"--vocab_size 300 --pause 0 --min_chars 1000".split()]) == 0
    return str(root / "data")


def test_sample_streams_characters_split_over_tokens(tr_prepared, capsys):
    """A byte-level token may hold part of a UTF-8 character: nothing is printed until it is whole."""
    from prepare_data import load_tokenizer

    enc = load_tokenizer(tr_prepared)
    text = "é€ ok"
    ids = [enc.encode_single_token(bytes([c])) for c in text.encode("utf-8")]  # one token per byte

    class FakeModel:
        def generate_stream(self, idx, max_new_tokens, **kw):
            for i in ids[:max_new_tokens]:
                yield torch.tensor([[i]])

    args = sample.build_parser().parse_args(["--max_new_tokens", str(len(ids))])
    sample.stream(FakeModel(), None, enc, args)
    assert capsys.readouterr().out == text + "\n"


def test_sample_continues_a_prompt_longer_than_l_from_its_last_l_tokens(tr_prepared, tmp_path, capsys):
    out, l = str(tmp_path / "run"), 16  # _TR_TINY's block_size
    assert train.main(_TR_TINY + ["--data_dir", tr_prepared, "--out_dir", out, "--max_iters", "4"]) == 0
    enc = prepare_data.load_tokenizer(tr_prepared)
    prompt = "the old miller sang softly beside the river and the little fox wandered over the green meadow"
    ids = enc.encode(prompt)
    head, tail = enc.decode(ids[:l]), enc.decode(ids[-l:])  # its first and its last l tokens, as text
    assert len(ids) > l and enc.encode(head) == ids[:l] and enc.encode(tail) == ids[-l:]

    def greedy(text):  # the new text of a greedy sample, and what sample.py said on stderr
        capsys.readouterr()
        argv = ["--out_dir", out, "--prompt", text, *"--temperature 0 --max_new_tokens 12".split()]
        assert sample.main(argv) == 0
        said = capsys.readouterr()
        assert said.out.startswith(text)
        return said.out[len(text) :], said.err

    (new, err), (from_tail, _), (from_head, _) = greedy(prompt), greedy(tail), greedy(head)
    assert f"keeping its last {l}" in err
    assert from_head != from_tail  # the model tells the two windows apart: the check below can fail
    assert new == from_tail, (new, from_tail, from_head)


def test_sample_greedy_quiet_ctrl_c_and_other_tokenizers(tr_prepared, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    assert train.main(_TR_TINY + ["--data_dir", tr_prepared, "--out_dir", out, "--max_iters", "4"]) == 0
    capsys.readouterr()
    # --temperature 0 is greedy: the seed no longer matters
    texts = []
    for seed in ("1", "2"):
        assert (
            sample.main(["--out_dir", out, "--temperature", "0", "--seed", seed, "--max_new_tokens", "8"])
            == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    # from another directory: the checkpoint holds the data folder's absolute path
    monkeypatch.chdir(tmp_path.parent.parent)
    assert sample.main(["--out_dir", out, "--max_new_tokens", "3"]) == 0
    capsys.readouterr()
    # a terminal that cannot show a character gets '?', not a UnicodeEncodeError
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert (
        sample.main(["--out_dir", out, "--prompt", "Once upon a time \u2019", "--max_new_tokens", "3"]) == 0
    )
    ascii_out.flush()
    assert ascii_out.buffer.getvalue().startswith(b"Once upon a time ?")
    monkeypatch.undo()
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the peak memory of the generation, last
    assert last.startswith("# 3 tokens in") and ("peak resident memory" in last or DEVICE.type != "cpu")
    assert "finite" in error_line(capsys, sample.main, ["--out_dir", out, "--temperature", "inf"])
    # another corpus's tokenizer is refused
    other = tmp_path / "other"
    os.makedirs(other)
    tok = open(os.path.join(tr_prepared, "tokenizer.tiktoken"), "rb").read().splitlines()
    open(other / "tokenizer.tiktoken", "wb").write(b"\n".join(tok[:-1]) + b"\n")
    assert "tokenizer" in error_line(capsys, sample.main, ["--out_dir", out, "--data_dir", str(other)])
    # Ctrl-C while sampling ends quietly
    capsys.readouterr()
    monkeypatch.setattr(sample, "stream", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert sample.main(["--out_dir", out]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_sample_a_tiny_temperature_is_greedy_and_a_huge_seed_is_one_line(tr_prepared, tmp_path, capsys):
    rc, out = _tr_train(tmp_path, "--max_iters", "4", data=tr_prepared)
    assert rc == 0
    texts = []
    for temperature in ("0", "1e-38"):
        capsys.readouterr()
        assert sample.main(["--out_dir", out, "--temperature", temperature, "--max_new_tokens", "8"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert "--seed" in error_line(capsys, sample.main, ["--out_dir", out, "--seed", str(2**64)])


def test_sample_a_checkpoint_of_only_model_and_config_is_one_line_or_samples_with_data_dir(
    tr_prepared, tmp_path, capsys
):
    from prepare_data import load_tokenizer

    model = tiny_model("me", l=8, d=8, n_head=1, vocab=load_tokenizer(tr_prepared).n_vocab)
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": model.state_dict(), "config": vars(model.cfg)}, run / "ckpt.pt")  # saved by hand
    argv = ["--out_dir", str(run), "--max_new_tokens", "3", "--device", "cpu", "--prompt", "Once"]
    assert error_line(capsys, sample.main, argv) == (
        f"error: {run}/ckpt.pt does not name the run's data folder; "
        "pass --data_dir, the folder with its tokenizer"
    )
    assert sample.main(argv + ["--data_dir", tr_prepared]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Once") and err.startswith(f"# {run}, seed 1337\n"), (out, err)


# ---- end to end, and what the three scripts say when a command cannot go on
@pytest.mark.slow
def test_end_to_end_prepare_train_sa_and_me_then_sample(tr_prepared, tmp_path, capsys, monkeypatch):
    data = tr_prepared
    monkeypatch.chdir(tmp_path)  # default out_dir out/<mixer> lands in tmp_path
    for mixer in ("sa", "me"):
        flags = f"--mixer {mixer} --data_dir {data} --n_layer 2 --n_embd 32 --n_hidden 64 --block_size 32"
        flags += " --batch_size 16 --n_head 4 --max_iters 40 --eval_interval 20 --eval_batches 2 --lr 3e-3"
        flags += f" --device {DEVICE} --out_dir out/{'sa-4' if mixer == 'sa' else 'me'}"
        assert train.main(flags.split()) == 0
        loss = [float(r["train_loss"]) for r in _tr_log(f"out/{'sa-4' if mixer == 'sa' else mixer}")]
        assert len(loss) == 40 and np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.5  # the loss falls
    capsys.readouterr()
    prompt = "Once upon a time there was"
    assert sample.main(["--prompt", prompt, "--max_new_tokens", "30", "--seed", "7"]) == 0  # out/me
    first = capsys.readouterr()
    assert first.out.startswith(prompt) and len(first.out.strip()) > len(prompt) + 10
    assert (
        sample.main(["--out_dir", "out/me", "--prompt", prompt, *"--max_new_tokens 30 --seed 7".split()]) == 0
    )
    assert capsys.readouterr().out == first.out  # the seed makes it reproducible
    long_prompt = "the little fox sang over the river " * 20  # more than l = 32 tokens
    argv = ["--out_dir", "out/sa-4", "--prompt", long_prompt, *"--max_new_tokens 5 --num_samples 2".split()]
    assert sample.main(argv) == 0
    res = capsys.readouterr()
    assert "keeping its last 32" in res.err and res.out.count(long_prompt) == 2
    assert "no checkpoint" in error_line(capsys, sample.main, ["--out_dir", "out/nothing"])


def test_train_sample_and_prepare_data_messages_say_what_to_do(tr_data, tr_prepared, tmp_path, capsys):
    rc, out = _tr_train(tmp_path, "--max_iters", "4", data=tr_data)
    assert rc == 0
    capsys.readouterr()
    assert "pass one of them" in error_line(
        capsys, train.main, _tr_argv(tmp_path, "--max_iters", "6", "--resume", "--overwrite", data=tr_data)
    )
    rc, _ = _tr_train(tmp_path, "--max_iters", "6", "--resume", "--dtype", "bfloat16", data=tr_data)
    assert rc == 0 and "trained with --dtype float32" in capsys.readouterr().out
    big = ["--eval_batches", "1", "--batch_size", "4096"]  # val.bin has fewer windows than one batch
    assert "--eval_batches 0" in error_line(
        capsys, train.main, _tr_argv(tmp_path, "--max_iters", "2", *big, data=tr_data, name="big")
    )
    assert "its settings" in error_line(
        capsys, sample.main, ["--out_dir", str(tmp_path / "none"), "--data_dir", tr_prepared]
    )
    not_a_folder = tmp_path / "README.md"
    not_a_folder.write_text("a file\n")
    src = _pd_source(tmp_path / "src")
    tsv = _pd_books_tsv(tmp_path / "books.tsv")
    err = error_line(capsys, _pd_run, not_a_folder, "--source", str(src), books_tsv=tsv)
    assert "is a file" in err


# ======== tools: plots and their CSVs (plot.py) ========


def test_plot_window_medians():
    loss = np.array([5.0, 1.0, 3.0, 2.0, 9.0, 4.0, 7.0])
    ends, med = plot.window_medians(loss, 3)
    assert ends.tolist() == [3, 6] and med.tolist() == [3.0, 4.0]  # the partial last window is dropped


def _plot_fake_run(
    folder, mixer, n_head, losses, val_every, params=1000, seed=1337, data_seed=1337, **config
):
    """A run folder as train.py writes it, with made-up costs: run.json and log.csv."""
    os.makedirs(folder)
    cfg = {"mixer": mixer, "n_head": n_head, "n_layer": 2, "block_size": 32, **config}
    args = {"batch_size": 64, "seed": seed, "data_seed": data_seed}
    run = {"config": cfg, "args": args, "params": {"mixers": params, "total": 10 * params}}
    with open(os.path.join(folder, "run.json"), "w") as f:
        json.dump(run, f)
    with open(os.path.join(folder, "log.csv"), "w") as f:
        f.write("iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n")
        for i, loss in enumerate(losses, 1):
            val = repr(loss - 0.5) if i % val_every == 0 else ""
            f.write(f"{i},{loss!r},{val},0.001,{1000.0 + i % 3},{i * 0.1:.3f}\n")
        f.write("7")  # a half-written last row, as in a run that is still going


def test_plot_imports_without_torch():
    code = "import sys, plot; assert 'torch' not in sys.modules, 'plot.py imported torch'"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "experiments"))
    assert done.returncode == 0


# ---- the results' CSVs, the summary, the paths it prints
def test_plot_results_csvs_are_the_window_medians_of_the_logs(tmp_path):
    rng = random.Random(0)
    logs = {"sa-32": [rng.uniform(3, 6) for _ in range(23)], "she": [rng.uniform(3, 6) for _ in range(21)]}
    dirs = {"sa-32": str(tmp_path / "a"), "she": str(tmp_path / "b")}
    _plot_fake_run(dirs["she"], "she", 1, logs["she"], val_every=5)  # given first: the order comes from STYLE
    _plot_fake_run(dirs["sa-32"], "sa", 32, logs["sa-32"], val_every=5)
    out = tmp_path / "results"
    argv = [dirs["she"], dirs["sa-32"], "--window", "4", "--results", str(out), "-o", str(out / "f.png")]
    assert plot.main(argv) == 0
    assert_png(out / "f.png")
    read = lambda name: list(csv.reader(open(out / name)))
    medians = read("medians.csv")
    assert medians[0] == ["batches", "sa-32", "she"]
    # every full window of 4 batches, up to the shorter run's 5 windows; the longer run's 5th too
    assert [int(r[0]) for r in medians[1:]] == [4, 8, 12, 16, 20]
    for row in medians[1:]:
        end = int(row[0])
        for col, name in ((1, "sa-32"), (2, "she")):
            window = sorted(logs[name][end - 4 : end])
            assert float(row[col]) == (window[1] + window[2]) / 2  # median of four, exactly
    vals = read("val_loss.csv")
    assert [int(r[0]) for r in vals[1:]] == [5, 10, 15, 20]
    assert float(vals[2][2]) == logs["she"][9] - 0.5
    summary = {r["run"]: r for r in csv.DictReader(open(out / "summary.csv"))}
    assert summary["she"]["batches"] == "21" and summary["sa-32"]["params_mixers"] == "1000"
    assert float(summary["she"]["median_last_1000"]) == float(np.median(logs["she"]))
    assert float(summary["sa-32"]["val_loss"]) == logs["sa-32"][19] - 0.5
    # --batches compares the runs at one length: the first 16 batches of each
    assert plot.main(argv + ["--batches", "16"]) == 0
    assert [int(r[0]) for r in read("medians.csv")[1:]] == [4, 8, 12, 16]
    summary = {r["run"]: r for r in csv.DictReader(open(out / "summary.csv"))}
    assert summary["sa-32"]["batches"] == "16" and float(summary["she"]["median_last_1000"]) == float(
        np.median(logs["she"][:16])
    )
    assert plot.main(argv + ["--batches", "22"]) == 1  # she has only 21


def test_plot_default_window_fits_a_short_run(tmp_path):
    """Without --window a run of 90 batches (fewer than the paper's 2000) gets 30 windows of 3."""
    _plot_fake_run(str(tmp_path / "run"), "me", 1, [5.0 - i / 100 for i in range(90)], val_every=30)
    argv = [str(tmp_path / "run"), "--results", str(tmp_path), "-o", str(tmp_path / "run.png")]
    assert plot.main(argv) == 0
    medians = list(csv.DictReader(open(tmp_path / "medians.csv")))
    assert [int(r["batches"]) for r in medians] == list(range(3, 91, 3))
    assert plot.auto_window(60000) == 2000 and plot.auto_window(90) == 3 and plot.auto_window(5) == 1


def test_plot_summary_has_the_medians_of_the_last_1000_and_2000_batches(tmp_path):
    rng = random.Random(1)
    losses = [rng.uniform(3, 6) for _ in range(2500)]
    _plot_fake_run(str(tmp_path / "he"), "he", 1, losses, val_every=500)
    assert plot.main([str(tmp_path / "he"), "-o", str(tmp_path / "f.png"), "--results", str(tmp_path)]) == 0
    (row,) = csv.DictReader(open(tmp_path / "summary.csv"))
    assert float(row["median_last_1000"]) == float(np.median(losses[-1000:]))
    assert float(row["median_last_2000"]) == float(np.median(losses[-2000:]))
    assert row["batches"] == "2500" and float(row["val_loss"]) == losses[2499] - 0.5


def test_plot_two_runs_of_one_label_and_folder_name_keep_a_column_each(tmp_path, capsys):
    runs = [str(tmp_path / "x" / "r"), str(tmp_path / "y" / "r")]  # one run from two machines
    for run, loss in zip(runs, (5.0, 4.0)):
        _plot_fake_run(run, "me", 1, [loss] * 8, val_every=4)
    res = tmp_path / "res"
    assert plot.main(runs + ["--window", "4", "--results", str(res), "-o", str(res / "f.png")]) == 0
    medians = list(csv.reader(open(res / "medians.csv")))
    assert medians == [["batches", "x/r", "y/r"], ["4", "5.0", "4.0"], ["8", "5.0", "4.0"]]
    assert next(csv.reader(open(res / "val_loss.csv"))) == ["batches", "x/r", "y/r"]
    assert [r["run"] for r in csv.DictReader(open(res / "summary.csv"))] == ["x/r", "y/r"]
    err = error_line(capsys, plot.main, [runs[0], runs[0] + "/", "-o", str(tmp_path / "f.png")])
    assert err == f"error: {runs[0]} and {runs[0]}/ are one run folder; pass each run once"


def test_plot_seeds_csv_has_a_row_per_run_at_the_shortest_runs_length(tmp_path, capsys):
    rng = random.Random(2)
    runs = {  # folder: (mixer, heads, seed, batches); the seed-1337 runs are the longer ones
        "sa-32": ("sa", 32, 1337, 1500),
        "she": ("she", 1, 1337, 1400),
        "she-s1338": ("she", 1, 1338, 1100),
        "she-s1339": ("she", 1, 1339, 1200),
        "sa-32-s1338": ("sa", 32, 1338, 1300),
    }
    losses = {}
    for name, (mixer, heads, seed, n) in runs.items():
        losses[name] = [rng.uniform(3, 6) for _ in range(n)]
        _plot_fake_run(str(tmp_path / name), mixer, heads, losses[name], val_every=100, seed=seed)
    main_runs = [str(tmp_path / n) for n in ("she", "sa-32")]
    seeds = [str(tmp_path / n) for n in ("she-s1338", "she-s1339", "sa-32-s1338")]
    res = tmp_path / "results"
    argv = (
        main_runs + ["--seeds"] + seeds + ["--results", str(res), "-o", str(res / "f.png"), "--window", "100"]
    )
    assert plot.main(argv) == 0
    rows = list(csv.DictReader(open(res / "seeds.csv")))
    assert list(rows[0]) == ["mixer", "seed", "data_seed", "batches", "median_last_1000", "val_loss"]
    labels = [("sa-32", "1337"), ("sa-32", "1338"), ("she", "1337"), ("she", "1338"), ("she", "1339")]
    assert [(r["mixer"], r["seed"]) for r in rows] == labels and {r["data_seed"] for r in rows} == {"1337"}
    for r, name in zip(
        rows, ["sa-32", "sa-32-s1338", "she", "she-s1338", "she-s1339"]
    ):  # every run at the shortest run's 1100 batches
        assert r["batches"] == "1100"
        assert float(r["median_last_1000"]) == float(np.median(losses[name][100:1100]))
        assert float(r["val_loss"]) == losses[name][1099] - 0.5
    # the figure's tables keep one column or row per mixer, each at its full length
    assert next(csv.reader(open(res / "medians.csv"))) == ["batches", "sa-32", "she"]
    summary = list(csv.DictReader(open(res / "summary.csv")))
    assert [(r["run"], r["batches"]) for r in summary] == [("sa-32", "1500"), ("she", "1400")]
    # --batches shorter than every run: all rows there
    assert plot.main(argv + ["--batches", "1050"]) == 0
    assert {r["batches"] for r in csv.DictReader(open(res / "seeds.csv"))} == {"1050"}
    assert "seeds.csv, which --results DIR writes" in error_line(
        capsys, plot.main, main_runs + ["--seeds"] + seeds + ["-o", str(res / "f.png")]
    )


def test_plot_seeds_csv_keeps_the_rows_of_runs_whose_logs_are_gone(tmp_path, capsys):
    """A seeds.csv among --seeds: its rows stay where no run gives the same mixer, seed and data seed, a
    run that does replaces its row, and the data seed is a column of its own; a CSV at another length or
    with another header is one line."""
    rng = random.Random(4)
    spec = {"he": (1337, 1337), "he-s1338": (1338, 1337), "he-d1338": (1337, 1338)}
    losses = {n: [rng.uniform(3, 6) for _ in range(1200)] for n in spec}
    for name, (seed, data_seed) in spec.items():
        _plot_fake_run(
            str(tmp_path / name), "he", 1, losses[name], val_every=100, seed=seed, data_seed=data_seed
        )
    first, res = tmp_path / "first", tmp_path / "res"

    def argv(out, *seeds):
        return [
            str(tmp_path / "he"),
            "--seeds",
            *map(str, seeds),
            "--results",
            str(out),
            "-o",
            str(out / "f.png"),
        ]

    assert plot.main(argv(first, tmp_path / "he-s1338")) == 0  # then that run's folder is gone
    os.rename(tmp_path / "he-s1338", tmp_path / "gone")
    assert plot.main(argv(res, first / "seeds.csv", tmp_path / "he-d1338")) == 0
    rows = list(csv.DictReader(open(res / "seeds.csv")))
    assert [(r["seed"], r["data_seed"]) for r in rows] == [
        ("1337", "1337"),
        ("1337", "1338"),
        ("1338", "1337"),
    ]
    kept = next(csv.DictReader(open(first / "seeds.csv")))  # the he run's row, given again by its run
    assert rows[0] == kept and rows[2]["median_last_1000"] == repr(float(np.median(losses["he-s1338"][200:])))
    assert rows[1]["median_last_1000"] == repr(float(np.median(losses["he-d1338"][200:])))
    assert "pass --batches 1200" in error_line(
        capsys, plot.main, argv(res, first / "seeds.csv") + ["--batches", "900"]
    )
    (tmp_path / "bad.csv").write_text("mixer,seed,batches,median_last_1000,val_loss\nhe,1,1200,4.0,3.9\n")
    assert "its header must be mixer,seed,data_seed," in error_line(
        capsys, plot.main, argv(res, tmp_path / "bad.csv")
    )


def test_plot_reads_each_log_and_run_json_once_per_command(tmp_path, monkeypatch):
    runs = {n: str(tmp_path / n) for n in ("sa-32", "she", "she-s2")}
    for name, run in runs.items():
        _plot_fake_run(
            run, name[:3].rstrip("-"), 32 if name == "sa-32" else 1, [5.0] * 30, 10, seed=len(name)
        )
    reads = collections.Counter()
    for f in ("read_log", "read_settings"):
        real = getattr(plot, f)
        monkeypatch.setattr(plot, f, lambda d, *a, real=real, f=f: reads.update([(f, d)]) or real(d, *a))
    res = str(tmp_path / "res")
    argv = [runs["sa-32"], runs["she"], "--seeds", runs["she-s2"], "--results", res, "--batches", "20"]
    assert plot.main(argv + ["-o", str(tmp_path / "f.png")]) == 0
    assert reads == {(f, d): 1 for f in ("read_log", "read_settings") for d in runs.values()}


def test_plot_printed_paths_paste_back_as_the_same_paths(tmp_path, capsys):
    run = str(tmp_path / "my runs" / "me")
    _plot_fake_run(run, "me", 1, [5.0 - i / 100 for i in range(40)], val_every=10)
    out, res = str(tmp_path / "my figs" / "a b.png"), str(tmp_path / "my results")
    assert plot.main([run, "-o", out, "--results", res]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    csvs = [os.path.join(res, f) for f in ("medians.csv", "val_loss.csv", "summary.csv")]
    assert shlex.split(last) == ["wrote", out] + csvs
    assert all(os.path.isfile(p) for p in [out] + csvs)


# ---- the figures: a run's own loss.png, raw logs, the gap panel
def test_plot_one_run_without_o_redraws_its_own_loss_png(tmp_path, capsys, monkeypatch):
    run = str(tmp_path / "me-m2")
    _plot_fake_run(run, "me", 1, [5.0 - i / 100 for i in range(90)], val_every=30)
    monkeypatch.chdir(tmp_path)
    assert plot.main([run]) == 0
    assert os.listdir(tmp_path) == ["me-m2"]  # nothing in the working folder
    plot.plot_run(run, str(tmp_path / "by_train.png"))  # what train.py draws at the end
    with open(os.path.join(run, "loss.png"), "rb") as a, open(tmp_path / "by_train.png", "rb") as b:
        assert a.read() == b.read()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {run}/loss.png"
    other = str(tmp_path / "other")
    _plot_fake_run(other, "he", 1, [5.0] * 90, val_every=30)
    assert "name it with -o" in error_line(capsys, plot.main, [run, other])  # several runs: no default file


def test_plot_raw_draws_a_resumed_logs_batches_at_their_batch_numbers(tmp_path, monkeypatch):
    run = str(tmp_path / "resumed")
    _plot_fake_run(run, "me", 1, [5.0] * 10, val_every=5)
    rows = open(os.path.join(run, "log.csv")).read().splitlines()
    log = [rows[0]] + [f"{30 + int(r.split(',', 1)[0])},{r.split(',', 1)[1]}" for r in rows[1:-1]]
    open(os.path.join(run, "log.csv"), "w").write("\n".join(log) + "\n")  # batches 31-40 only
    _plot_fake_run(str(tmp_path / "full"), "he", 1, [5.0] * 40, val_every=5)
    figures = []
    monkeypatch.setattr(plot, "save", lambda fig, path: figures.append(fig))
    assert plot.main([run, str(tmp_path / "full"), "--raw", "-o", str(tmp_path / "f.png")]) == 0
    lines = {line.get_label(): line.get_xdata().tolist() for line in figures[0].axes[0].lines}
    assert lines == {"he": list(range(1, 41)), "me": list(range(31, 41))}
    plot.plt.close(figures[0])


def test_plot_gap_panel_is_each_runs_window_medians_minus_the_references(tmp_path, monkeypatch, capsys):
    rng = random.Random(7)
    logs = {name: [rng.uniform(3, 6) for _ in range(n)] for name, n in (("sa-32", 12), ("me", 12), ("he", 8))}
    runs = []
    for name, losses in logs.items():
        runs.append(str(tmp_path / name))
        _plot_fake_run(runs[-1], name[:2], 32, losses, val_every=4, n_layer=2, block_size=32, seed=1337)
    figures = []
    monkeypatch.setattr(plot, "save", lambda fig, path: figures.append(fig))
    assert plot.main(runs + ["--window", "4", "-o", str(tmp_path / "f.png")]) == 0
    medians_ax, gaps_ax = figures[0].axes
    assert figures[0]._suptitle.get_text() == "m = 2, l = 32, 8, 12 batches, seed 1337"
    assert gaps_ax.get_title() == "gap to sa-32, window by window"
    gaps = {
        line.get_label(): ([*map(float, line.get_xdata())], [*map(float, line.get_ydata())])
        for line in gaps_ax.lines
    }
    med = lambda losses: [float(np.median(losses[i : i + 4])) for i in range(0, len(losses) - 3, 4)]
    for name, ends in (("me", [4, 8, 12]), ("he", [4, 8])):  # he has two windows, so two gaps
        assert gaps[name][0] == ends
        expect = [a - b for a, b in zip(med(logs[name]), med(logs["sa-32"]))]
        np.testing.assert_allclose(gaps[name][1], expect, rtol=0, atol=1e-12)
    assert gaps["sa-32"][1] == [0, 0]  # the reference's own line at 0
    assert plot.main(runs + ["--window", "4", "--reference", "me", "-o", str(tmp_path / "f.png")]) == 0
    gaps = {line.get_label(): [*map(float, line.get_ydata())] for line in figures[1].axes[1].lines}
    np.testing.assert_allclose(gaps["sa-32"], [b - a for a, b in zip(med(logs["me"]), med(logs["sa-32"]))])
    assert "--reference mixer is none of the runs" in error_line(
        capsys, plot.main, runs + ["--reference", "mixer", "-o", str(tmp_path / "f.png")]
    )
    _plot_fake_run(str(tmp_path / "he-d2"), "he", 32, logs["he"], val_every=4, data_seed=2)  # the title
    assert plot.main(runs + [str(tmp_path / "he-d2"), "--window", "4", "-o", str(tmp_path / "f.png")]) == 0
    assert figures[-1]._suptitle.get_text() == "m = 2, l = 32, 8, 12 batches, seed 1337, data seeds 2, 1337"
    for fig in figures:
        plot.plt.close(fig)


# ---- sweeps: a setting along the x axis
def test_plot_sweep_writes_its_points_as_a_csv_named_after_the_figure(tmp_path):
    rng = random.Random(3)
    runs, losses = [], {}
    for name, mixer, heads in (("she", "she", 1), ("sa-32", "sa", 32)):
        for l in (64, 128):
            run = str(tmp_path / f"{l}-{name}")  # the names sort in no useful order
            losses[name, l] = [rng.uniform(3, 6) for _ in range(2500)]
            _plot_fake_run(run, mixer, heads, losses[name, l], val_every=500, block_size=l)
            runs.append(run)
    res = tmp_path / "results"
    argv = runs + ["--sweep", "block_size", "--results", str(res), "-o", str(res / "fig10_l_sweep.png")]
    assert plot.main(argv) == 0
    assert sorted(os.listdir(res)) == ["fig10_l_sweep.csv", "fig10_l_sweep.png"]  # no medians.csv etc.
    rows = list(csv.DictReader(open(res / "fig10_l_sweep.csv")))
    assert list(rows[0]) == ["mixer", "l", "batches", "median_last_2000", "val_loss"]  # 2000: the default
    expect = [("sa-32", "64"), ("sa-32", "128"), ("she", "64"), ("she", "128")]
    assert [(r["mixer"], r["l"]) for r in rows] == expect
    for r in rows:
        loss = losses[r["mixer"], int(r["l"])]
        assert r["batches"] == "2500" and float(r["median_last_2000"]) == float(np.median(loss[-2000:]))
        assert float(r["val_loss"]) == loss[2499] - 0.5
    assert plot.main(argv + ["--batches", "2200", "--window", "1000"]) == 0
    rows = list(csv.DictReader(open(res / "fig10_l_sweep.csv")))
    assert float(rows[0]["median_last_1000"]) == float(np.median(losses["sa-32", 64][1200:2200]))
    assert float(rows[0]["val_loss"]) == losses["sa-32", 64][1999] - 0.5 and rows[0]["batches"] == "2200"
    runs, losses = [], {}
    for m in (4, 2):  # an m sweep of short runs: the median of the whole run
        runs.append(str(tmp_path / f"he-m{m}"))
        losses[m] = [rng.uniform(3, 6) for _ in range(50)]
        _plot_fake_run(runs[-1], "he", 1, losses[m], val_every=10, n_layer=m)
    assert (
        plot.main(runs + ["--sweep", "n_layer", "--results", str(res), "-o", str(tmp_path / "f11.svg")]) == 0
    )
    rows = list(csv.DictReader(open(res / "f11.csv")))
    assert list(rows[0]) == ["mixer", "m", "batches", "median_last_50", "val_loss"]
    for r, m in zip(rows, (2, 4)):
        assert (r["mixer"], r["m"], r["batches"]) == ("he", str(m), "50")
        assert float(r["median_last_50"]) == float(np.median(losses[m]))


def test_plot_sweep_draws_the_papers_axes_and_the_validation_loss_beside_them(tmp_path, monkeypatch):
    rows = [  # as sweep_rows gives them; sa-32 has no validation loss at l = 64
        {"mixer": "sa-32", "l": 32, "batches": 10, "median_last_10": 4.0, "val_loss": 3.9},
        {"mixer": "sa-32", "l": 64, "batches": 10, "median_last_10": 3.8, "val_loss": ""},
        {"mixer": "she", "l": 32, "batches": 10, "median_last_10": 4.1, "val_loss": 4.2},
        {"mixer": "she", "l": 64, "batches": 10, "median_last_10": 3.7, "val_loss": 3.95},
    ]
    figures = []
    monkeypatch.setattr(plot, "save", lambda fig, path: figures.append(fig))
    plot.plot_sweep(rows, "block_size", str(tmp_path / "f.png"), 10)
    left, right = figures[0].axes
    assert (
        left.get_ylabel() == "median cost of the last 10 batches" and right.get_ylabel() == "validation loss"
    )
    lines = lambda ax: {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
    assert lines(left) == {"sa-32": ([32, 64], [4.0, 3.8]), "she": ([32, 64], [4.1, 3.7])}
    assert lines(right) == {"sa-32": ([32], [3.9]), "she": ([32, 64], [4.2, 3.95])}
    plot.plt.close(figures[0])


def test_plot_sweep_keeps_the_points_of_a_csv_it_wrote_where_no_run_replaces_them(tmp_path, capsys):
    rng = random.Random(5)
    losses = {}

    def run(name, mixer, heads, l):  # a run folder of 2100 batches at block size l
        losses[name] = [rng.uniform(3, 6) for _ in range(2100)]
        _plot_fake_run(str(tmp_path / name), mixer, heads, losses[name], val_every=100, block_size=l)
        return str(tmp_path / name)

    res = tmp_path / "results"
    fig, table = str(res / "fig10.png"), str(res / "fig10.csv")
    sweep = ["--sweep", "block_size", "--results", str(res), "-o", fig]
    assert plot.main([run("she-32", "she", 1, 32), run("sa-32", "sa", 32, 32)] + sweep) == 0
    earlier = open(table).read()
    # the first runs are gone; a new run and the CSV make the figure with all three points
    assert plot.main([table, run("she-64", "she", 1, 64)] + sweep) == 0
    rows = list(csv.DictReader(open(table)))
    assert [(r["mixer"], r["l"]) for r in rows] == [("sa-32", "32"), ("she", "32"), ("she", "64")]
    assert float(rows[2]["median_last_2000"]) == float(np.median(losses["she-64"][-2000:]))
    assert open(table).read().splitlines()[:3] == earlier.splitlines()  # earlier rows kept to the digit
    # a run folder at a point the CSV holds replaces that point
    assert plot.main([table, run("she-32b", "she", 1, 32)] + sweep) == 0
    rows = list(csv.DictReader(open(table)))
    assert len(rows) == 3 and float(rows[1]["median_last_2000"]) == float(
        np.median(losses["she-32b"][-2000:])
    )
    # the CSV alone redraws the figure and rewrites the same CSV
    before = open(table).read()
    assert plot.main([table] + sweep) == 0 and open(table).read() == before
    # bad inputs: one line each
    other = ["--sweep", "n_layer", "-o", str(tmp_path / "f.png")]
    assert "header must be mixer,m,batches,median_last_2000,val_loss" in error_line(
        capsys, plot.main, [table] + other
    )
    assert "the sa-32 point at l = 32 is at 2100 batches, not --batches 2050" in error_line(
        capsys, plot.main, [table, "--batches", "2050"] + sweep
    )
    assert "adds earlier points to a --sweep figure" in error_line(capsys, plot.main, [table, "-o", fig])
    assert "not found" in error_line(capsys, plot.main, [str(tmp_path / "nope.csv")] + sweep)
    with open(table, "a") as f:
        f.write("we,32,2100,low,3.9\n")
    assert "fig10.csv, line 5: not a number" in error_line(capsys, plot.main, [table] + sweep)


def test_plot_sweep_n_head_writes_the_fig7_csv_one_line_against_n(tmp_path, monkeypatch):
    rng = random.Random(8)
    runs, losses = [], {}
    for n in (8, 1, 32):
        runs.append(str(tmp_path / f"sa-{n}"))
        losses[n] = [rng.uniform(3, 6) for _ in range(2100)]
        _plot_fake_run(runs[-1], "sa", n, losses[n], val_every=700)
    figures, save = [], plot.save
    monkeypatch.setattr(plot, "save", lambda fig, path: figures.append(fig) or save(fig, path))
    res = tmp_path / "results"
    argv = runs + [
        "--sweep",
        "n_head",
        "--batches",
        "2000",
        "--results",
        str(res),
        "-o",
        str(res / "fig7_heads.png"),
    ]
    assert plot.main(argv) == 0
    lines = open(res / "fig7_heads.csv").read().splitlines()
    assert lines[0] == "n_head,batches,median_last_2000,val_loss"
    assert [line.split(",")[:2] for line in lines[1:]] == [["1", "2000"], ["8", "2000"], ["32", "2000"]]
    for line, n in zip(lines[1:], (1, 8, 32)):
        assert float(line.split(",")[2]) == float(np.median(losses[n][:2000]))
        assert float(line.split(",")[3]) == losses[n][1399] - 0.5
    left = figures[0].axes[0]
    assert [line.get_label() for line in left.lines] == ["sa"] and left.get_xscale() == "log"
    assert list(left.lines[0].get_xdata()) == [1, 8, 32]
    assert figures[0]._suptitle.get_text() == "m = 2, l = 32, 2000 batches, seed 1337, one run per point"
    # Figure 7's curves: the window medians, a line per head count, in head order
    assert plot.main(runs + ["--window", "500", "-o", str(tmp_path / "fig7.png")]) == 0
    assert [line.get_label() for line in figures[-1].axes[0].lines] == ["sa-1", "sa-8", "sa-32"]
    _plot_fake_run(str(tmp_path / "he"), "he", 1, losses[1], val_every=700)
    assert plot.main(runs + [str(tmp_path / "he")] + argv[3:]) == 1  # one mixer's head counts only


def test_plot_sweep_refuses_other_corpora_other_lengths_and_two_runs_at_one_point(tmp_path, capsys):
    def run(name, n=60, l=32, data="data"):
        _plot_fake_run(str(tmp_path / name), "me", 1, [4.0] * n, val_every=10, block_size=l, data_dir=data)
        return str(tmp_path / name)

    sweep = ["--sweep", "block_size", "-o", str(tmp_path / "f.png")]
    l32, l64 = run("l32"), run("l64", l=64)
    err = error_line(capsys, plot.main, [l32, l64, run("l128", l=128, data="other")] + sweep)
    assert err == "error: the runs were trained on other data (data, other); sweep runs of one corpus"
    short = run("l256", n=2, l=256)
    err = error_line(capsys, plot.main, [l32, l64, short] + sweep)
    assert err == f"error: the runs have 2 to 60 batches ({short}: 2); pass --batches 2 to compare"
    assert plot.main([l32, l64, short, "--batches", "2"] + sweep) == 0
    again = run("l64-again", l=64)
    assert error_line(capsys, plot.main, [l32, l64, again] + sweep) == (
        f"error: {l64} and {again} are both me at l = 64; pass one per point"
    )
    assert not os.path.exists(tmp_path / "f.csv")


# ---- runs of one corpus side by side
def test_plot_refuses_runs_of_other_corpora_or_vocabularies_side_by_side(tmp_path, capsys):
    def run(name, mixer, data, vocab):
        _plot_fake_run(
            str(tmp_path / name), mixer, 1, [4.0] * 8, val_every=4, data_dir=data, vocab_size=vocab
        )
        return str(tmp_path / name)

    me, he = run("me", "me", "data", 50), run("he", "he", "data", 50)
    other, vocab = run("other", "he", "other", 50), run("vocab", "he", "data", 60)
    res, out = str(tmp_path / "res"), ["-o", str(tmp_path / "res" / "f.png")]
    corpora = "error: the runs were trained on other data (data, other); compare runs of one corpus"
    assert error_line(capsys, plot.main, [me, other, "--window", "4", "--results", res] + out) == corpora
    assert error_line(capsys, plot.main, [me, he, "--results", res, "--seeds", other] + out) == corpora
    assert error_line(capsys, plot.main, [me, other, "--raw"] + out) == corpora
    assert error_line(capsys, plot.main, [me, vocab, "--results", res] + out) == (
        "error: the runs were trained on other data (data, vocabulary 50; data, vocabulary 60); "
        "compare runs of one corpus"
    )
    assert not os.path.exists(res)
    assert plot.main([me, he, "--window", "4", "--results", res] + out) == 0


def test_plot_draws_one_data_fingerprint_from_two_folders_and_refuses_two_fingerprints(tmp_path, capsys):
    """Runs whose run.json hold the data's fingerprint are one corpus if the fingerprints agree, wherever
    the data was prepared (a GPU machine's folder, a laptop's), and two corpora if they differ, even in
    one folder. A run without one (an older run.json) is judged by folder and vocabulary, as before."""

    def run(name, mixer, data_dir, train_sha=None, tokenizer_sha="c" * 64):
        folder = tmp_path / name
        _plot_fake_run(str(folder), mixer, 1, [4.0] * 8, val_every=4, data_dir=data_dir, vocab_size=50)
        if train_sha:
            info = json.load(open(folder / "run.json"))
            info["data"] = dict(vocab_size=50, train_sha256=train_sha, val_sha256="b" * 64)
            info["data"]["tokenizer_sha256"] = tokenizer_sha  # None: data made without prepare_data.py
            (folder / "run.json").write_text(json.dumps(info))
        return str(folder)

    gpu, laptop = run("gpu", "me", "/gpu/data", "a" * 64), run("laptop", "he", "/home/u/data", "a" * 64)
    again, older = run("again", "we", "/gpu/data", "d" * 64), run("older", "sa", "/home/u/data")
    partial = run("partial", "sa", "/home/u/data", "a" * 64, tokenizer_sha=None)
    out = ["--window", "4", "-o", str(tmp_path / "f.png")]
    assert plot.main([gpu, laptop] + out) == 0
    assert error_line(capsys, plot.main, [gpu, again] + out) == (
        "error: the runs were trained on other data (/gpu/data, vocabulary 50, train.bin aaaaaaaaaaaa; "
        "/gpu/data, vocabulary 50, train.bin dddddddddddd); compare runs of one corpus"
    )
    for judged_by_folder in (older, partial):
        assert plot.main([laptop, judged_by_folder] + out) == 0
        assert error_line(capsys, plot.main, [gpu, judged_by_folder] + out) == (
            "error: the runs were trained on other data (/gpu/data, /home/u/data); compare runs of one corpus"
        )


# ---- bad input and file errors: one line
def test_plot_bad_input_gives_one_line(tmp_path, capsys):
    _plot_fake_run(str(tmp_path / "run"), "me", 1, [5.0] * 10, val_every=5)
    cases = [
        [str(tmp_path / "nope")],
        [str(tmp_path / "run"), "--window", "50"],
        [str(tmp_path / "run"), "--sweep", "colour"],
        [str(tmp_path / "run"), "--window", "0"],
    ]
    for argv in cases:
        error_line(capsys, plot.main, argv + ["-o", str(tmp_path / "x.png")])
    assert not os.path.exists(tmp_path / "x.png")


def test_plot_unknown_image_extension_is_one_line_naming_the_formats(tmp_path, capsys):
    run = str(tmp_path / "run")
    _plot_fake_run(run, "me", 1, [5.0] * 10, val_every=5)
    err = error_line(capsys, plot.main, [run, "-o", str(tmp_path / "x.xyz")])
    assert "cannot write a .xyz image" in err and ".png" in err and ".svg" in err and ".pdf" in err
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_plot_batches_errors_are_plain_sentences(tmp_path, capsys):
    run = str(tmp_path / "run")
    _plot_fake_run(run, "me", 1, [5.0] * 10, val_every=5)
    argv = [run, "-o", str(tmp_path / "x.png")]
    assert (
        error_line(capsys, plot.main, argv + ["--batches", "0"])
        == "error: --batches must be at least 1, got 0"
    )
    err = error_line(capsys, plot.main, argv + ["--batches", "11"])
    assert err == f"error: --batches 11: {run} has only 10 batches; pass --batches 10 or less"


def test_plot_damaged_run_json_and_a_setting_that_is_no_number_are_one_line(tmp_path, capsys):
    run = str(tmp_path / "run")
    _plot_fake_run(run, "me", 1, [5.0] * 10, val_every=5)
    out = ["-o", str(tmp_path / "f.png")]
    assert "one of batch_size, block_size, data_seed, mixer, n_head" in error_line(
        capsys, plot.main, [run, "--sweep", "params"] + out
    )
    assert "has no single number for 'params'" in error_line(
        capsys, plot.main, [run, "--sweep", "params"] + out
    )
    open(os.path.join(run, "run.json"), "w").write('{"config": {"mixer"')  # cut short
    assert error_line(capsys, plot.main, [run] + out).startswith(
        f"error: {run}/run.json is damaged (JSONDecodeError"
    )
    open(os.path.join(run, "run.json"), "w").write("{}")
    assert "run.json is damaged (KeyError" in error_line(capsys, plot.main, [run] + out)


def test_plot_o_naming_a_folder_is_one_line_naming_the_folder(tmp_path, capsys):
    run = str(tmp_path / "run")
    _plot_fake_run(run, "me", 1, [5.0] * 10, val_every=5)
    err = error_line(capsys, plot.main, [run, "-o", str(tmp_path)])
    assert err == f"error: -o {tmp_path} is a folder; name an image file, e.g. -o {tmp_path}/fig.png"
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no temp file left


def test_plot_a_cut_or_garbage_log_is_one_line_naming_the_log(tmp_path, capsys):
    run = tmp_path / "run"
    _plot_fake_run(str(run), "me", 1, [random.Random(0).uniform(3, 6) for _ in range(400)], val_every=50)
    log = gzip.compress((run / "log.csv").read_bytes())
    (run / "log.csv").unlink()
    assert len(log) > 1000
    garbage = (
        log[:300],
        bytes(range(256)) * 4,
        gzip.compress(bytes(range(128, 256)) * 8),
        gzip.compress(b"a\nb\n"),
    )
    for content in garbage:  # cut, not gzip, gzip of bytes, gzip of text
        (run / "log.csv.gz").write_bytes(content)
        err = error_line(
            capsys, plot.main, [str(run), "--results", str(tmp_path / "r"), "-o", str(tmp_path / "f.png")]
        )
        assert err.startswith(f"error: {run}/log.csv.gz is damaged (") and "write" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_atomic_write_errors_name_the_target_not_the_temp_file(tmp_path, capsys):
    run = str(tmp_path / "run")
    _plot_fake_run(run, "me", 1, [4.0] * 8, val_every=4)
    res = tmp_path / "res"
    (res / "medians.csv").mkdir(parents=True)  # a folder where the CSV goes
    err = error_line(
        capsys, plot.main, [run, "--window", "4", "--results", str(res), "-o", str(res / "f.png")]
    )
    assert err == f"error: cannot write {res}/medians.csv: Is a directory; pick another -o or --results"

    def disk_full(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as e:
        common.atomic_write(str(tmp_path / "t.png"), disk_full)
    assert e.value.filename == str(tmp_path / "t.png") and e.value.errno == 28
    assert sorted(os.listdir(tmp_path)) == ["res", "run"]  # no temp file left


# ======== tools: the taps and attention by distance (taps.py) ========


def test_plot_tap_profile_is_each_taps_norm_per_layer():
    c = torch.tensor([0.5, -0.25, 0.0, 2.0])  # one tap per distance back k = 1..4
    cases = {  # mixer: (taps, their norms / |c|); d = 4
        "me": (c, 1.0),
        "we": (c[:, None] * torch.ones(4), 2.0),  # ||c (1, 1, 1, 1)||_2 = 2|c|
        "he": (c[:, None] * torch.ones(4), 2.0),
        "she": (c[:, None, None] * torch.eye(4), 2.0),  # ||c I||_F = 2|c|
    }
    for mixer, (w, norm) in cases.items():
        model = tiny_model(mixer, l=4, d=4, n_head=1, vocab=16)
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                (layer.mixer.W_ext if mixer == "she" else layer.mixer.w_ext).copy_(w * (i + 1))
        profile = taps.tap_profile(model)
        assert list(profile) == [1, 2], mixer
        for layer in (1, 2):  # layer 2's taps are twice layer 1's
            assert profile[layer].tolist() == [norm * layer * abs(v) for v in c.tolist()], (mixer, layer)


def test_plot_recomputed_attention_weights_give_the_mixers_output():
    mixer = tiny_model("sa", l=6, d=8, n_head=2, vocab=16).layers[0].mixer
    torch.nn.init.normal_(mixer.W_QKV.weight)  # far from uniform attention
    x = torch.randn(3, 6, 8)
    a = taps.attention_weights(mixer, x)  # (3, 2, 6, 6)
    assert torch.allclose(a.sum(-1), torch.ones(3, 2, 6)) and (a.triu(1) == 0).all()
    assert a.max() > 0.9  # sharp rows: a wrong scale or head split would not reproduce the output
    v = mixer.W_QKV(x)[..., 16:].view(3, 6, 2, 4).transpose(1, 2)  # (B, n, t, h)
    r = (a @ v).transpose(1, 2).reshape(3, 6, 8)
    assert torch.allclose(mixer.W_out_att(r), mixer(x), atol=1e-5)


def test_plot_attention_by_distance_of_uniform_attention_by_hand():
    model = tiny_model("sa", l=4, d=8, n_head=2, vocab=16)
    with torch.no_grad():
        for layer in model.layers:
            layer.mixer.W_QKV.weight.zero_()  # q = k = 0: row i weighs each j <= i by 1 / (i + 1)
    windows = torch.randint(0, 16, (40, 4))  # two chunks of 32 and 8
    by_hand = [(1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, (1 / 2 + 1 / 3 + 1 / 4) / 3, (1 / 3 + 1 / 4) / 2, 1 / 4]
    profile = taps.tap_profile(model, windows)
    assert list(profile) == [1, 2]
    for layer in (1, 2):
        np.testing.assert_allclose(profile[layer], by_hand, rtol=1e-6)
    np.testing.assert_allclose(taps.uniform_by_distance(4), by_hand, rtol=1e-15)


def test_plot_attention_by_distance_equals_a_literal_mean_over_heads_positions_and_windows():
    model = tiny_model("sa", l=5, d=8, n_head=2, vocab=16)
    for layer in model.layers:
        torch.nn.init.normal_(layer.mixer.W_QKV.weight)
    windows = torch.randint(0, 16, (7, 5))
    profile = taps.tap_profile(model, windows)
    with torch.no_grad():
        pos = torch.arange(5)
        h = (model.emb_tok(windows) + model.emb_pos(pos)) * math.sqrt(8)  # dropout is off in eval
        for i, layer in enumerate(model.layers, 1):
            a = taps.attention_weights(layer.mixer, layer.ln1(h))  # (7, 2, 5, 5)
            for back in range(5):
                pairs = [a[b, n, j + back, j] for b in range(7) for n in range(2) for j in range(5 - back)]
                assert abs(profile[i][back] - float(sum(pairs)) / len(pairs)) < 1e-6, (i, back)
            h = layer(h)


def test_plot_val_windows_are_spread_evenly_over_val_bin(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    windows = taps.val_windows(str(tmp_path), 4, n=3)  # starts 0, 47.5 -> 48, 95 = 100 - 4 - 1
    assert windows.tolist() == [[0, 1, 2, 3], [48, 49, 50, 51], [95, 96, 97, 98]]


def _plot_fake_ckpt_run(folder, model, data_dir):
    """A run folder with run.json, log.csv and a ckpt.pt holding `model`."""
    _plot_fake_run(folder, model.cfg.mixer, model.cfg.n_head, [5.0] * 10, val_every=5)
    ckpt = {
        "model": model.state_dict(),
        "config": vars(model.cfg),
        "args": {"data_dir": data_dir},
        "iter": 10,
    }
    torch.save(ckpt, os.path.join(folder, "ckpt.pt"))


def test_plot_taps_draws_a_panel_per_run_with_a_line_per_layer(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (np.arange(300) % 16).astype(np.uint16).tofile(data / "val.bin")
    models = {
        "me": tiny_model("me", l=4, d=4, n_head=1, vocab=16),
        "sa": tiny_model("sa", l=4, d=8, n_head=1, vocab=16),
    }
    runs = {}
    for name, model in models.items():
        runs[name] = str(tmp_path / name)
        _plot_fake_ckpt_run(runs[name], model, str(tmp_path / "moved"))  # its data has moved since
    figures, save = [], taps.save
    monkeypatch.setattr(taps, "save", lambda fig, path: figures.append(fig) or save(fig, path))
    argv = [runs["me"], runs["sa"], "-o", str(tmp_path / "taps.png")]
    assert "val.bin not found; pass --data_dir" in error_line(capsys, taps.main, argv)
    assert taps.main(argv + ["--data_dir", str(data)]) == 0
    assert_png(tmp_path / "taps.png")
    panels = [ax for ax in figures[-1].axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["sa-1, batch 10", "me, batch 10"]  # in paper order
    windows = torch.from_numpy(taps.val_windows(str(data), 4))
    for ax, profile in zip(panels, (taps.tap_profile(models["sa"], windows), taps.tap_profile(models["me"]))):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for layer in (1, 2):
            assert lines[f"layer {layer}"].get_xdata().tolist() == [1, 2, 3, 4]
            assert lines[f"layer {layer}"].get_ydata().tolist() == profile[layer].tolist()
    assert taps.main([runs["me"]]) == 0  # one run: its own folder
    assert os.path.isfile(os.path.join(runs["me"], "taps.png"))
    for extra in (["--results", str(tmp_path)], ["--raw"], ["--batches", "5"]):
        error_line(capsys, taps.main, [runs["me"], "-o", str(tmp_path / "t.png")] + extra)
    assert "unrecognized arguments: --data_dir" in error_line(
        capsys, plot.main, [runs["me"], "--data_dir", str(data)]
    )


def test_taps_refuses_a_val_bin_that_is_not_the_runs(tmp_path, capsys):
    run, data, other = str(tmp_path / "sa"), tmp_path / "data", tmp_path / "other"
    for folder, tokens in ((data, np.arange(300) % 16), (other, np.arange(300) % 15)):
        folder.mkdir()
        tokens.astype(np.uint16).tofile(folder / "val.bin")
    _plot_fake_ckpt_run(run, tiny_model("sa", l=4, d=8, n_head=1, vocab=16), str(data))
    ckpt = torch.load(os.path.join(run, "ckpt.pt"), weights_only=True)
    ckpt["data"] = {"val_sha256": hashlib.sha256((data / "val.bin").read_bytes()).hexdigest()}
    torch.save(ckpt, os.path.join(run, "ckpt.pt"))
    argv = [run, "-o", str(tmp_path / "t.png")]
    err = error_line(capsys, taps.main, argv + ["--data_dir", str(other)])
    assert err == f"error: {other}/val.bin is not the run's val.bin (sha256 differs); pass its --data_dir"
    assert not os.path.exists(tmp_path / "t.png")
    assert taps.main(argv) == 0 and taps.main(argv + ["--data_dir", str(data)]) == 0


# ======== tools: the benchmark (bench.py): every section in quick mode, no timings asserted ========


def test_bench_quick_prints_a_row_per_mixer_in_every_section(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--mixers", "all", "--no_malloc_tune", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    mixers = list(extractor.MIXERS)
    tables = stdout.split("\n\n")[1:]  # the header line, then one block per section
    titles = [t.splitlines()[0][:2] for t in tables]
    assert titles[:6] == ["1.", "2.", "3.", "4.", "5.", "6."]
    for block in tables[:6]:
        rows = [line.split() for line in block.splitlines()[3:] if line.strip()]
        if block.startswith("3."):  # one row per mixer and model size (on CUDA: and variant)
            variants = 4 if bench.pick_device("auto").type == "cuda" else 1
            want = sorted((mixers + ["none"]) * 2 * variants)
            assert sorted(r[1] for r in rows if r[0].startswith("m=")) == want, block
        else:  # section 1 on cuda: a row per FIR path, a mixer's rows together
            assert list(dict.fromkeys(r[0] for r in rows if r[0] in mixers)) == mixers, block
    res = json.loads(out.read_text())
    assert set(res["sections"]) == {"sublayer", "sweep", "model", "generation", "flops", "memory"}
    cuda = res["settings"]["device"].startswith("cuda")
    for name, rows in res["sections"].items():
        want = (mixers + ["none"]) * 2 * variants if name == "model" else mixers
        got = [r["mixer"] for r in rows]
        assert sorted(dict.fromkeys(got) if name == "sublayer" and cuda else got) == sorted(want), name
    for r in res["sections"]["sublayer"]:
        assert r["ms"] > 0 and r["path"] in (
            {"sdpa", "matmul"} | set(fir.PATHS if cuda else ("toeplitz", "fft"))
        )
    for r in res["sections"]["generation"]:
        assert r["cached_tokens_per_s"] > 0 and r["full_tokens_per_s"] > 0

    # vs_sa from the rows' own times: sections 1-2 a mixer's time over sa's (above 1: slower), section 3
    # its training speed over sa's (above 1: faster). The same medians, scaled by 1e3: equal to 1e-12
    def ratio(got, want, *where):
        assert math.isclose(got, want, rel_tol=1e-12), (*where, f"vs_sa {got}, its times give {want}")

    sublayer, sweep = ({r["mixer"]: r for r in res["sections"][k]} for k in ("sublayer", "sweep"))
    for m, r in sublayer.items():
        ratio(r["vs_sa"], r["ms"] / sublayer["sa"]["ms"], "sublayer", m)
    for m, r in sweep.items():
        for key in (k for k in r if k.startswith("ms_t") and r[k] is not None):
            ratio(r[f"vs_sa_t{key[4:]}"], r[key] / sweep["sa"][key], "sweep", m, key)
    # section 3 against its floor (on CUDA, and on the CPU with --floor): the floor and the ratio from the
    # row's own counts and the rates it was measured against
    floor = out.with_name("floor.json")
    argv = f"--quick --sections 3 --floor --mixers me --device cpu --no_malloc_tune --json {floor}".split()
    assert bench.main(argv) == 0
    block = capsys.readouterr().out.split("\n\n")[1]
    assert block.startswith("3.") and " vs_floor " in block.splitlines()[1], block
    floor_rows = json.loads(floor.read_text())["sections"]["model"]
    assert sorted((r["model"], r["mixer"]) for r in floor_rows) == sorted(
        (m, x) for m in ("m=2", "m=1") for x in ("sa", "me", "none")
    )
    for rows in (res["sections"]["model"], floor_rows):
        sa_step = {(r["model"], r.get("variant")): r["step_ms"] for r in rows if r["mixer"] == "sa"}
        for r in rows:
            where = ("model", r["model"], r["mixer"], r.get("variant"))
            ratio(r["vs_sa"], sa_step[r["model"], r.get("variant")] / r["step_ms"], *where)
            if "vs_floor" in r:
                ratio(r["flop_ms"], 1e3 * r["flops"] / r["flop_rate"], *where)
                ratio(r["byte_ms"], 1e3 * r["bytes"] / r["byte_rate"], *where)
                assert r["floor_ms"] == max(r["flop_ms"], r["byte_ms"]) and min(r["flops"], r["bytes"]) > 0
                ratio(r["vs_floor"], r["step_ms"] / r["floor_ms"], *where)
                ratio(r["tokens_per_s"], 1e3 * 4 * 32 / r["step_ms"], *where)  # --quick: batch 4 x 32


def test_bench_loglog_slope_recovers_a_power_law():
    for b in (0.5, 1.0, 2.0):
        ms = {t: 3.0 * t**b for t in (128, 256, 512, 1024)}  # time per step ~ t^b at fixed tokens
        assert abs(bench.loglog_slope(ms, 8192) - b) < 1e-9


def test_bench_memory_section_in_quick_mode(tmp_path, capsys):
    """Section 6 prints a row per mixer; its accounting is AdamW = 2x parameters = 2x gradients."""
    out = tmp_path / "bench.json"
    argv = ["--quick", "--sections", "6", "--mixers", "me,she", "--no_malloc_tune", "--json", str(out)]
    assert bench.main(argv) == 0
    block = capsys.readouterr().out.split("\n\n")[1]
    assert block.startswith("6. Memory of one training step")
    assert [line.split()[0] for line in block.splitlines()[3:6]] == ["sa", "me", "she"]
    rows = json.loads(out.read_text())["sections"]["memory"]
    for r in rows:
        assert r["grads_mib"] == r["params_mib"] and r["adamw_mib"] == 2 * r["params_mib"], r
        assert 0 < r["saved_half_mib"] < r["saved_mib"], r  # activations grow with the batch
        if r["peak_mib"] is not None:  # Linux
            assert r["peak_mib"] >= r["params_mib"] + r["adamw_mib"] and r["fits"] == "yes", r


def test_bench_memory_accounting_of_a_known_step():
    """A step whose memory is known by hand: parameters numel * 4 bytes, their gradients the same,
    AdamW's two states 2x, and the activations saved for backward counted once per storage (views
    share one), leaving out the parameter that an op saves."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False)  # 64 parameters: 256 bytes
    opt = torch.optim.AdamW(lin.parameters())
    x = torch.randn(6, 8, requires_grad=True)  # (6, 8): 192 bytes

    def step():
        h = lin(x)  # saves x (192 bytes) and the weight's transpose (a view of a parameter: left out)
        loss = (h.t() @ h).sum()  # saves h and its view h.t(): one storage, 192 bytes
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    mem = bench.step_memory(lin, opt, step, torch.device("cpu"))
    assert (mem["params"], mem["grads"], mem["adamw"], mem["saved"]) == (256, 256, 512, 384), mem
    assert mem["peak"] is None or mem["peak"] >= 256 + 512
    # a tiny Transformer: the same identities for every parameter, through train.train_step
    model = tiny_model("he", l=8).train()
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 50, (3, 9))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = lambda: train.train_step(model, opt, scaler, contextlib.nullcontext(), idx[:, :-1], idx[:, 1:])
    mem = bench.step_memory(model, opt, step, torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    assert (mem["params"], mem["grads"], mem["adamw"]) == (4 * n, 4 * n, 8 * n), (mem, n)


def test_bench_largest_batch_follows_the_line_through_two_peaks():
    peak = lambda b: 100 + 10 * b  # bytes: a fixed part and 10 per sequence
    assert bench.largest_batch(64, peak(64), 32, peak(32), 1000) == (10, 90)  # 100 + 10 * 90 = 1000
    assert bench.largest_batch(64, peak(64), 32, peak(32), 999) == (10, 89)
    assert bench.largest_batch(64, peak(64), 32, peak(32), 50) == (10, 0)  # not even one sequence
    assert bench.largest_batch(64, 500, 32, 500, 1000)[1] is None  # no slope: nothing to extrapolate


def test_bench_generation_stamps_wait_for_the_device(monkeypatch):
    """On cuda/mps kernels run asynchronously: each token's time stamp must come after a sync."""
    events = []
    monkeypatch.setattr(bench, "sync", lambda device: events.append("sync"))
    clock = time.perf_counter
    monkeypatch.setattr(bench.time, "perf_counter", lambda: events.append("stamp") or clock())
    model = tiny_model("me", l=8, n_layer=1)
    _, stamps = bench.generate_timed(model.eval(), torch.zeros(1, 2, dtype=torch.long), 3, True,
                                     contextlib.nullcontext(), torch.device("cuda"))  # fmt: skip
    assert len(stamps) == 3 and events == ["sync", "stamp"] * 4, events


# ---- the FIR paths it names and times
def test_bench_fir_path_names_the_path_causal_fir_takes(monkeypatch):
    """fir_path reads the taps' shape and device; check it against the code that actually runs."""
    taken = spy_fir_paths(monkeypatch)
    monkeypatch.setattr(fir, "FFT_MIN_T_SCALAR", 8)
    for name in extractor.MIXERS:
        cfg = extractor.Config(vocab_size=10, block_size=12, n_embd=4, n_head=2, n_layer=1, mixer=name)
        module = dev(extractor.MIXERS[name](cfg))
        for t in (4, 12):  # both sides of the scalar-tap threshold
            taken.clear()
            module(dev(torch.randn(1, t, 4)))
            want = taken[0] if taken else "sdpa" if name == "sa" else "matmul"
            assert bench.fir_path(module, t) == want, (name, t)


def test_bench_sublayer_section_times_every_fir_path_on_cuda(monkeypatch, tmp_path):
    """On CUDA section 1 has a row per FIR path that computes a mixer's taps, its default first, and each
    row's calls take that path (bench.forced); elsewhere a row per mixer, as before. Run here with
    sublayer_paths told that the device is CUDA: the paths themselves run on any device."""
    on_cuda = {
        "sa": ["sdpa"], "she": ["fft-cuda", "fft"], "he": ["fft", "toeplitz-strided"],
        "we": ["fft", "toeplitz-strided"], "me": ["toeplitz-strided", "toeplitz", "fft"],
        "he-ext": ["fft", "toeplitz-strided"], "dense": ["matmul"],
    }  # fmt: skip
    on_cpu = {
        "sa": "sdpa",
        "she": "fft",
        "he": "fft",
        "we": "fft",
        "me": "toeplitz",
        "he-ext": "fft",
        "dense": "matmul",
    }
    for name, paths in on_cuda.items():
        module = MIXERS[name](Config(n_embd=8, block_size=16, n_head=2, mixer=name))
        assert bench.sublayer_paths(module, 16, torch.device("cuda")) == paths, name
        assert bench.sublayer_paths(module, 16, torch.device("cpu")) == [on_cpu[name]], name
    taken, sublayer_paths = spy_fir_paths(monkeypatch), bench.sublayer_paths
    for path in fir.PATHS:  # forced: the path runs whatever the default
        taken.clear()
        w = torch.randn(*FIR_TAPS[fir.PATHS[path][-1]])
        bench.forced(path, lambda: fir.fir_full(torch.randn(2, 12, 5), w))()
        assert taken == [path], (path, taken)
    monkeypatch.setattr(
        bench, "sublayer_paths", lambda m, t, device: sublayer_paths(m, t, torch.device("cuda"))
    )
    out = tmp_path / "bench.json"
    argv = [
        "--quick",
        "--sections",
        "1",
        "--mixers",
        ",".join(on_cuda),
        "--no_malloc_tune",
        "--json",
        str(out),
    ]
    taken.clear()
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["sections"]["sublayer"]
    assert [(r["mixer"], r["path"]) for r in rows] == [(m, p) for m, paths in on_cuda.items() for p in paths]
    assert set(taken) == set(fir.PATHS) and all(r["ms"] > 0 for r in rows)


# ---- bad input and a loaded machine
@pytest.mark.skipif(not hasattr(signal, "SIGPIPE"), reason="no SIGPIPE here")
def test_bench_piped_into_a_reader_that_has_gone_ends_without_a_traceback():
    """`python bench.py --table7 | head -1`: the reader is gone before bench's output is flushed. Here the
    pipe's read end is closed before bench starts, so its first write fails every time."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(
            [sys.executable, "experiments/bench.py", "--table7"],
            cwd=ROOT,
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and p.returncode == -signal.SIGPIPE, (p.returncode, p.stderr[-300:])


def test_bench_bad_flags_give_one_line_and_exit_1(capsys):
    bad = (["--mixers", "nope"], ["--sections", "7"], ["--sections", "x"], ["--dtype", "fp8"])
    for argv in bad + (["--gpu_gib", "6", "--margin_gib", "6", "--quick", "--sections", "5"],):
        error_line(capsys, bench.main, argv + ["--no_malloc_tune"])


def test_bench_json_it_cannot_write_is_one_line_before_the_benchmark_and_after_it(
    tmp_path, monkeypatch, capsys
):
    argv = ["--quick", "--mixers", "me", "--sections", "5", "--no_malloc_tune", "--json"]
    err = error_line(capsys, bench.main, argv + [str(tmp_path)])  # one line: no section has started
    folder = f"error: --json {str(tmp_path)!r} is a folder; name a file, e.g. --json {tmp_path}/bench.json"
    assert err == folder
    long = str(tmp_path / ("b" * 300 + ".json"))  # a name no file system takes, even for root
    err = error_line(capsys, bench.main, argv + [long])
    assert err == f"error: cannot write --json {long!r} (File name too long); pick another path"

    def disk_full(path, data):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(bench, "atomic_write", disk_full)  # the disk fills up while it runs
    path = str(tmp_path / "b.json")
    with pytest.raises(SystemExit) as e:
        bench.main(argv + [path])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and "done in" in out and "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"error: cannot write --json {path!r} (No space left on device); the tables above hold the results"
    )


def test_bench_load_warning_suggests_one_thread_only_to_more_threads(monkeypatch, capsys):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            argv = ["--quick", "--mixers", "me", "--sections", "5", "--no_malloc_tune", "--threads", str(n)]
            assert bench.main(argv) == 0
            warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
            assert len(warning) == 1 and warning[0].endswith("machine" if n == 1 else "or try --threads 1")
    finally:
        torch.set_num_threads(threads)


# ======== results/: the committed numbers redrawn from the committed logs ========


def test_results_fig7_csv_is_what_plot_makes_of_the_committed_logs(tmp_path):
    """Every point of results/fig7_heads.csv comes from a log in results/logs/fig7/ (log.csv.gz and
    run.json, as plot.py reads them): drawn again from the repository alone, the CSV is the same."""
    folder = os.path.join(ROOT, "results", "logs", "fig7")
    runs = sorted(os.path.join(folder, name) for name in os.listdir(folder))
    assert all(os.path.isfile(os.path.join(r, "log.csv.gz")) for r in runs) and len(runs) >= 2, runs
    out = tmp_path / "fig7_heads.png"
    assert (
        plot.main(
            runs + ["--sweep", "n_head", "--batches", "10000", "--results", str(tmp_path), "-o", str(out)]
        )
        == 0
    )
    assert_png(out)
    with open(os.path.join(ROOT, "results", "fig7_heads.csv")) as f:
        assert (tmp_path / "fig7_heads.csv").read_text() == f.read()


def test_results_table1_csvs_are_what_plot_makes_of_the_committed_logs(tmp_path):
    """results/table1/'s 2000-batch medians, validation losses and summary come from the six logs in
    results/logs/table1/: drawn again from the repository alone, each CSV is the same."""
    folder = os.path.join(ROOT, "results", "logs", "table1")
    runs = [os.path.join(folder, name) for name in ("sa-1", "sa-32", "she", "he", "we", "me")]
    out = tmp_path / "fig8_w2000.png"
    assert plot.main(runs + ["--window", "2000", "--results", str(tmp_path), "-o", str(out)]) == 0
    assert_png(out)
    for name in ("medians.csv", "val_loss.csv", "summary.csv"):
        with open(os.path.join(ROOT, "results", "table1", name)) as f:
            assert (tmp_path / name).read_text() == f.read(), name


def test_results_data_order_seeds_csv_is_what_plot_makes_of_the_committed_files(tmp_path):
    """results/data-order/seeds.csv comes from the data-order logs, SA-32's Figure 7 log and the rows of
    results/30000/seeds.csv whose logs are gone: drawn again, it is the same."""
    logs = os.path.join(ROOT, "results", "logs")
    runs = sorted(glob.glob(os.path.join(logs, "data-order", "*")))
    seeds = [os.path.join(ROOT, "results", "30000", "seeds.csv"), os.path.join(logs, "fig7", "sa-32")]
    argv = runs + ["--seeds", *seeds, "--batches", "10000", "--window", "500", "--results", str(tmp_path)]
    assert plot.main(argv + ["-o", str(tmp_path / "f.png")]) == 0
    for name in ("seeds.csv", "medians.csv", "summary.csv"):
        with open(os.path.join(ROOT, "results", "data-order", name)) as f:
            assert (tmp_path / name).read_text() == f.read(), name
