"""Tests: python -m pytest tests.py  (CPU, no network; loopback servers only)."""

import math
import random

import pytest
import torch

import extractor
from extractor import MIXERS, Config, Transformer, causal_fir

# =============================================================================
# extractor.py: every mixer against its equations written as literal loops (float64)

TOL = 1e-9


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
    W = m.W_QKV.weight.T                       # (d, 3d): columns are Q, K, V of all heads
    out = torch.zeros(B, t, d, dtype=x.dtype)
    for j in range(n):
        WQ, WK, WV = (W[:, s * d + j * h: s * d + (j + 1) * h] for s in range(3))
        Q, K, V = x @ WQ, x @ WK, x @ WV       # Eq. (10)-(12)
        Z = Q @ K.transpose(1, 2) / math.sqrt(h)  # Eq. (13)
        R = torch.zeros(B, t, h, dtype=x.dtype)
        for i in range(t):
            e = torch.exp(Z[:, i, : i + 1])    # Eq. (14): only k <= i, denominator over f <= i
            a = e / e.sum(dim=1, keepdim=True)
            R[:, i] = (a[:, :, None] * V[:, : i + 1]).sum(1)  # Eq. (15)
        out[:, :, j * h: (j + 1) * h] = R      # Eq. (16)
    return out @ m.W_out_att.weight.T         # Eq. (17)


def literal_mixer(name, m, x):
    lin = lambda layer, z: z @ layer.weight.T
    if name == "sa":
        return literal_sa(m, x)
    if name == "she":
        return lin(m.W_out, lin(m.W_adj, x) * literal_fir(x, m.W_ext))          # Eq. (23)-(25)
    if name == "he":
        x_ext = literal_fir(lin(m.W_in_ext, x), m.w_ext)                         # Eq. (27), (28)
        return lin(m.W_out, lin(m.W_adj, x) * x_ext)                             # Eq. (24), (25)
    if name == "we":
        return lin(m.W_out, lin(m.W_adj, x) * literal_fir(x, m.w_ext))          # Eq. (26), (24), (25)
    if name == "me":
        return literal_fir(x, m.w_ext)                                           # Eq. (29)
    if name == "he-ext":
        return literal_fir(lin(m.W_in_ext, x), m.w_ext)                          # Eq. (27), (28)
    raise KeyError(name)


PAPER_MIXERS = ["sa", "she", "he", "we", "me", "he-ext"]


def random_mixer(name, d=8, l=12, n=2, seed=0):
    torch.manual_seed(seed)
    m = MIXERS[name](Config(n_embd=d, block_size=l, n_head=n, mixer=name)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)  # larger than the paper's init, so every term matters
    return m


@pytest.mark.parametrize("name", PAPER_MIXERS)
def test_mixer_equals_literal_equations(name):
    rng = random.Random(name)
    for trial in range(3):
        t = rng.randint(1, 12)
        m = random_mixer(name, seed=trial)
        x = torch.randn(2, t, 8, dtype=torch.float64)
        assert torch.allclose(m(x), literal_mixer(name, m, x), atol=TOL, rtol=0)


@pytest.mark.parametrize("shape,path", [((12,), "toeplitz"), ((12,), "fft"), ((12, 5), "fft"),
                                        ((12, 5, 5), "fft")], ids=["scalar-toeplitz", "scalar-fft",
                                                                   "vector-fft", "matrix-fft"])
def test_fir_forward_and_backward_equal_literal_sum(shape, path, monkeypatch):
    monkeypatch.setattr(extractor, "FFT_MIN_T_SCALAR", 1 if path == "fft" else 10**9)
    torch.manual_seed(1)
    for t in (1, 7, 12):
        x = torch.randn(3, t, 5, dtype=torch.float64, requires_grad=True)
        w = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        g = torch.randn(3, t, 5, dtype=torch.float64)
        y = causal_fir(x, w)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        y_ref = literal_fir(x, w)
        dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), g)
        assert torch.allclose(y, y_ref, atol=TOL, rtol=0)
        assert torch.allclose(dx, dx_ref, atol=TOL, rtol=0)
        assert torch.allclose(dw, dw_ref, atol=TOL, rtol=0)
        assert (dw[t:] == 0).all()  # taps beyond t get no gradient


def test_fir_float32_under_autocast():
    torch.manual_seed(2)
    x = torch.randn(2, 16, 8)
    w = torch.randn(16, 8)
    ref = literal_fir(x.double(), w.double())
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y = causal_fir(x.bfloat16(), w)
    assert y.dtype == torch.float32  # the FFT ran in float32, not bf16
    assert torch.allclose(y.double(), ref, atol=0.1, rtol=0.02)  # input rounded to bf16 only


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixer_is_causal(name):
    m = random_mixer(name, d=8, l=12, n=2)
    x = torch.randn(2, 12, 8, dtype=torch.float64, requires_grad=True)
    y = m(x)
    for i in (0, 5, 11):
        (g,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        past, future = g[:, : i + 1].abs().max(), g[:, i + 1:].abs().amax(dim=(0, 2)).sum()
        assert past > 0, f"output {i} ignores its inputs"
        # exactly zero for direct sums; FFT paths leave float64 round-off (~1e-16) only
        assert future <= 1e-12 * past, f"output {i} depends on later positions"


# ---- parameter counts and the complexity tables

def param_formula(name, d, l):
    """Tables 3 and 4 (ERRATA: no biases)."""
    return {"sa": 4 * d * d, "she": l * d * d + 2 * d * d, "he": l * d + 3 * d * d,
            "we": l * d + 2 * d * d, "me": l, "he-ext": l * d + d * d}[name]


@pytest.mark.parametrize("d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (24, 7, 3), (16, 256, 16)])
def test_parameter_counts_equal_formulas(d, l, n):
    for name in PAPER_MIXERS:
        assert extractor.mixer_param_count(name, d, l, n) == param_formula(name, d, l)
        if name != "he-ext":
            assert extractor.complexity_training(d, l, n)[name]["params"] == param_formula(name, d, l)


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
    got = extractor.table7(128, 128)
    for label, numbers in TABLE7.items():
        mixer, n, c = got[label]
        assert tuple(c[k] for k in ("mult", "add", "div", "exp", "params", "total")) == numbers
        assert extractor.mixer_param_count(mixer, 128, 128, n) == numbers[4]


def literal_training_counts(d, l, n):
    """The left-hand sums of Tables 3 and 4, term by term (with ERRATA's SHE summand)."""
    h = d // n
    S = lambda f: sum(f(t) for t in range(1, l + 1))
    return {
        "sa": dict(mult=(3 * d * h * l + S(lambda t: t * h + t * h)) * n + d * d * l,
                   add=(S(lambda t: t * (h - 1) + (t - 1) * h + (t - 1)) + 3 * (d - 1) * h * l) * n
                   + (d - 1) * d * l,
                   div=n * S(lambda t: t + t), exp=n * S(lambda t: t)),
        "she": dict(mult=S(lambda t: d * d * t + d * d + d + d * d),
                    add=S(lambda t: (d - 1) * d * t + (t - 1) * d + (d - 1) * d + (d - 1) * d), div=0, exp=0),
        "he": dict(mult=S(lambda t: d * t + d * d + d + d * d) + d * d * l,
                   add=S(lambda t: (t - 1) * d + (d - 1) * d + (d - 1) * d) + (d - 1) * d * l, div=0, exp=0),
        "we": dict(mult=S(lambda t: d * t + d * d + d + d * d),
                   add=S(lambda t: (t - 1) * d + (d - 1) * d + (d - 1) * d), div=0, exp=0),
        "me": dict(mult=S(lambda t: d * t), add=S(lambda t: (t - 1) * d), div=0, exp=0),
    }


def literal_inference_counts(d, t, n):
    """The left-hand sides of Tables 5 and 6."""
    h = d // n
    return {
        "sa": dict(mult=(3 * d * h + t * h + t * h) * n + d * d,
                   # Table 5's printed closed form exceeds its printed sum by t - 1 (one softmax
                   # denominator's additions); the code follows the closed form, so add them here.
                   add=(3 * (d - 1) * h + t * (h - 1) + (t - 1) * h) * n + (d - 1) * d + (t - 1),
                   div=(t + t) * n, exp=t * n),
        "she": dict(mult=d * d * t + d * d + d + d * d,
                    add=(d - 1) * d * t + (t - 1) * d + (d - 1) * d + (d - 1) * d, div=0, exp=0),
        "he": dict(mult=d * t + d * d + d * d + d + d * d,
                   add=(t - 1) * d + (d - 1) * d + (d - 1) * d + (d - 1) * d, div=0, exp=0),
        "we": dict(mult=d * t + d * d + d + d * d, add=(t - 1) * d + (d - 1) * d + (d - 1) * d, div=0, exp=0),
        "me": dict(mult=d * t, add=(t - 1) * d, div=0, exp=0),
    }


@pytest.mark.parametrize("d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (12, 9, 3)])
def test_complexity_closed_forms_equal_table_sums(d, l, n):
    got = extractor.complexity_training(d, l, n)
    for name, counts in literal_training_counts(d, l, n).items():
        for k, v in counts.items():
            assert got[name][k] == v, (name, k)
    for t in (1, l // 2, l):
        got = extractor.complexity_inference(d, t, n)
        for name, counts in literal_inference_counts(d, t, n).items():
            assert got[name] == counts, (name, t)


def test_whole_model_parameter_count_closed_form():
    for name in PAPER_MIXERS:
        cfg = Config(vocab_size=97, block_size=16, n_embd=24, n_hidden=40, n_layer=3, n_head=4, mixer=name)
        u, l, d, c, m = 97, 16, 24, 40, 3
        expect = (u * d + l * d                      # Eq. (4), (5)
                  + m * (param_formula(name, d, l)   # first sublayer
                         + d * c + c + c * d + d     # Eq. (19)
                         + 2 * 2 * d)                # two layer norms, Eq. (8)
                  + 2 * d + d * u + u)               # final layer norm and Eq. (21)
        model = Transformer(cfg)
        counts = model.param_counts()
        assert counts["total"] == expect == sum(p.numel() for p in model.parameters())
        assert counts["mixers"] == m * param_formula(name, d, l)


def test_initialisation_follows_section6():
    model = Transformer(Config(vocab_size=500, block_size=32, n_embd=64, n_hidden=128, n_layer=2, mixer="he"))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert (p == 0).all(), name
        elif ".ln" in name or name.startswith("ln_f"):
            assert (p == 1).all(), name  # LayerNorm gain starts at 1
        else:
            assert abs(p.std().item() - 0.01) < 0.002 and abs(p.mean().item()) < 0.002, name


def test_forward_loss_is_eq3():
    torch.manual_seed(3)
    model = Transformer(Config(vocab_size=30, block_size=8, n_embd=16, n_hidden=32, n_layer=2, mixer="we"))
    idx, targets = torch.randint(0, 30, (2, 8)), torch.randint(0, 30, (2, 8))
    model.eval()
    logits, loss = model(idx, targets)
    p_hat = logits.softmax(-1)                                              # Eq. (21), (22)
    nll = -torch.log(p_hat.gather(-1, targets[..., None])).mean()           # Eq. (3)
    assert torch.allclose(loss, nll, atol=1e-6)


# ---- generation

def tiny_model(name, l=16, seed=0):
    torch.manual_seed(seed)
    cfg = Config(vocab_size=50, block_size=l, n_embd=16, n_hidden=32, n_layer=2, n_head=4, dropout=0.0, mixer=name)
    model = Transformer(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # distinct logits, so greedy choices are not ties
    return model


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_cached_generation_equals_uncached(name):
    model = tiny_model(name)
    idx = torch.randint(0, 50, (2, 5))
    cached = model.generate(idx, 11, temperature=0, use_cache=True)       # fills l = 16 exactly
    uncached = model.generate(idx, 11, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    # logits: prefill plus one token at a time equals one full forward
    cache = model.new_cache()
    steps = [model(cached[:, :5], cache=cache)[0]]
    steps += [model(cached[:, i: i + 1], cache=cache)[0] for i in range(5, 16)]
    full = model(cached)[0]
    assert torch.allclose(torch.cat(steps, 1), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["sa", "she", "me"])
def test_cached_generation_beyond_block_size_reprefills_half_window(name):
    l = 16
    model = tiny_model(name, l=l)
    prompt = torch.randint(0, 50, (1, 20))                                 # longer than l
    out = model.generate(prompt, 40, temperature=0, use_cache=True)
    start = prompt.shape[1] - l
    for q in range(prompt.shape[1], out.shape[1]):                         # predict position q
        if q - start > l:
            start = q - l // 2                                             # the documented rebuild
        logits = model(out[:, start:q])[0][:, -1]
        assert out[0, q] == logits.argmax(-1)[0], f"token {q} differs from a forward over its window"


def test_top_k_keeps_exactly_k_and_top_p_is_nucleus():
    torch.manual_seed(4)
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    seen = {extractor.sample_next(logits, top_k=2).item() for _ in range(300)}
    assert len(seen) == 2 and 0 in seen  # a tie at the boundary still keeps exactly 2
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    seen = {extractor.sample_next(probs.log(), top_p=0.6).item() for _ in range(300)}
    assert seen == {0, 1}                # 0.5 < 0.6 needs the second token; 0.7 >= 0.6 stops there
    seen = {extractor.sample_next(probs.log(), top_p=0.5).item() for _ in range(100)}
    assert seen == {0}
    assert extractor.sample_next(probs.log(), temperature=0).item() == 0


# ---- bad inputs

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
    model = tiny_model("me", l=8)
    with pytest.raises(ValueError, match="exceeds block_size l=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
