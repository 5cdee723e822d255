from tests_header import *  # noqa: F403
# ruff: noqa: F405, I001  (a section of tests.py: the names of tests_header.py, which comes first)

import dataclasses
import importlib
import io
import itertools
import math

import torch.nn.functional as F

import extractor
import synthesizer
from extractor import MIXERS, SYNTHESIZERS, find_mixer

# ======== the model and its equations (extractor.py, synthesizer.py) as literal float64 loops ========

PAPER = ["sa", "she", "he", "we", "me", "he-ext"]
SYNTHS = "dense dense-fact random random-fixed random-fact random+dense random+sa dense+sa".split()
ALL = PAPER + SYNTHS


def literal_fir(x, w):
    """Eq. (23)/(26)/(28)/(29) as the paper writes them: x_i = sum_{j<=i} x_j (*) w_{i-j+1}."""
    y = torch.zeros_like(x)
    for i in range(x.shape[1]):
        for j in range(i + 1):
            y[:, i] += x[:, j] @ w[i - j] if w.dim() == 3 else x[:, j] * w[i - j]  # tap k = i - j + 1
    return y


def causal_softmax_rows(S, V):
    """Eq. (14) (only k <= i, the denominator over f <= i) and Eq. (15): S (B, t, t), V (B, t, h)."""
    R = torch.zeros(V.shape, dtype=V.dtype)
    for i in range(S.shape[1]):
        e = torch.exp(S[:, i, : i + 1])
        R[:, i] = (e[:, :, None] / e.sum(1)[:, None, None] * V[:, : i + 1]).sum(1)
    return R


def literal_sa(m, x):
    """Eq. (10)-(17), head by head."""
    d, n = x.shape[2], m.n
    h, W = d // n, m.W_QKV.weight.T  # (d, 3d): the columns of W^Q, W^K, W^V of all heads
    heads = []
    for j in range(n):
        WQ, WK, WV = (W[:, s * d + j * h : s * d + (j + 1) * h] for s in range(3))
        Q, K, V = x @ WQ, x @ WK, x @ WV  # Eq. (10)-(12)
        heads.append(causal_softmax_rows(Q @ K.transpose(1, 2) / math.sqrt(h), V))  # Eq. (13)-(15)
    return torch.cat(heads, dim=2) @ m.W_out_att.weight.T  # Eq. (16), (17)


def literal_synth(name, m, x):
    """Synthesizer Eq. (1)-(7) and the mixtures give each head's logits S_j, then Eq. (14)-(17)."""
    B, t, d = x.shape
    h, b = d // m.n, getattr(m, "b", 0)  # b: the second factor of l = a b (Factorized Dense)
    V = x @ m.W_V.weight.T  # Eq. (12), all heads
    heads = []
    for j in range(m.n):
        c = slice(j * h, (j + 1) * h)
        hid = lambda: torch.relu(x @ m.W_1.weight.T)[:, :, c]  # Synthesizer Eq. (2), head j's h units
        W = lambda: m.W_QK.weight.T  # (d, 2d): the columns of W^Q of all heads, then of W^K
        logits = {
            "dense": lambda: hid() @ m.W_2[j, :t].T,  # Synthesizer Eq. (1): B_i, the first t of l
            "dense-fact": lambda: torch.stack(  # Synthesizer Eq. (5), (6): C_{i, u b + v} = A_{i,u} B_{i,v}
                [(hid() @ m.W_A[j])[:, :, p // b] * (hid() @ m.W_B[j])[:, :, p % b] for p in range(t)], dim=2
            ),
            "random": lambda: m.R[j, :t, :t],  # Synthesizer Eq. (4)
            "random-fixed": lambda: m.R[j, :t, :t],
            "random-fact": lambda: torch.stack(  # Synthesizer Eq. (7): R_1 R_2^T, entry by entry
                [torch.stack([(m.R_1[j, i] * m.R_2[j, k]).sum() for k in range(t)]) for i in range(t)]
            ),
            "sa": lambda: (x @ W()[:, c]) @ (x @ W()[:, d:][:, c]).transpose(1, 2) / math.sqrt(h),  # (13)
        }
        S = [logits[part]() for part in name.split("+")]
        if len(S) == 2:  # the mixtures: alpha_1 S_1 + alpha_2 S_2 with (alpha_1, alpha_2) = softmax(alpha_h)
            e = torch.exp(m.alpha[j])
            S = [e[0] / e.sum() * S[0] + e[1] / e.sum() * S[1]]
        heads.append(causal_softmax_rows(S[0].expand(B, t, t), V[:, :, c]))
    return torch.cat(heads, dim=2) @ m.W_out_att.weight.T  # Eq. (16), (17)


def literal_mixer(name, m, x):
    lin = lambda layer, z: z @ layer.weight.T
    if name in SYNTHS:
        return literal_synth(name, m, x)
    return {
        "sa": lambda: literal_sa(m, x),
        "she": lambda: lin(m.W_out, lin(m.W_adj, x) * literal_fir(x, m.W_ext)),  # Eq. (23)-(25)
        "we": lambda: lin(m.W_out, lin(m.W_adj, x) * literal_fir(x, m.w_ext)),  # Eq. (26), (24), (25)
        "he": lambda: lin(m.W_out, lin(m.W_adj, x) * literal_fir(lin(m.W_in_ext, x), m.w_ext)),  # (27)-(28)
        "me": lambda: literal_fir(x, m.w_ext),  # Eq. (29)
        "he-ext": lambda: literal_fir(lin(m.W_in_ext, x), m.w_ext),  # Eq. (27), (28)
    }[name]()


def random_mixer(name, d=8, l=12, n=2, seed=0, std=0.5):
    """A mixer on the CPU, every parameter (and Fixed Random's R) drawn ~ N(0, std²), in float64."""
    torch.manual_seed(seed)
    return scrambled(find_mixer(name)(Config(n_embd=d, block_size=l, n_head=n, mixer=name)), std)


def output_and_grads(m, x, g, forward):
    """forward(m, x) and the gradients of x and of every parameter of m for the output gradient g."""
    x = x.detach().requires_grad_()
    y = forward(m, x)
    return cpu64(y, *torch.autograd.grad(y, [x, *m.parameters()], g))


def test_the_mixers_and_their_names():
    assert list(MIXERS) == PAPER and SYNTHESIZERS == SYNTHS and list(synthesizer.SYNTHESIZERS) == SYNTHS
    for name, cls in [*MIXERS.items(), *synthesizer.SYNTHESIZERS.items()]:
        assert find_mixer(name) is cls and name in ALL


@pytest.mark.parametrize("name", ALL)
def test_mixer_forward_and_backward_equal_literal_equations(name):
    moved = {}
    for trial, (d, l, n, t) in enumerate([(8, 12, 2, 1), (8, 12, 2, 7), (12, 6, 3, 6), (8, 16, 1, 9)]):
        m = random_mixer(name, d, l, n, seed=trial)
        x, g = torch.randn(2, t, d, dtype=torch.float64), torch.randn(2, t, d, dtype=torch.float64)
        got = output_and_grads(dev(m), dev(x), dev(g), lambda mixer, x: mixer(x))
        ref = output_and_grads(m, x, g, lambda mixer, x: literal_mixer(name, mixer, x))
        for what, a, b in zip(["y", "x"] + [k for k, _ in m.named_parameters()], got, ref):
            assert torch.allclose(a, b, atol=TOL, rtol=0), (what, t)
            moved[what] = moved.get(what, False) or bool(b.abs().max() > 0)
    assert all(moved.values()), moved  # every parameter has a gradient to compare


@pytest.mark.parametrize("name", ALL)
def test_mixer_is_causal(name):
    m = dev(random_mixer(name, d=8, l=12, n=2))
    x = dev(torch.randn(2, 12, 8)).requires_grad_()
    y = m(x)
    for i in (0, 5, 11):
        (g,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        past, future = g[:, : i + 1].abs().max(), g[:, i + 1 :].abs().amax(dim=(0, 2)).sum()
        assert past > 0, f"output {i} ignores its inputs"
        assert future <= TOL * 1e-3 * past, f"output {i} depends on later positions"  # FFT: round-off only


def test_fir_reading_copy_is_the_causal_filter_with_these_taps():
    """extractor.causal_fir_reference as a filter, not as another copy of its sum: a unit impulse in
    channel c at position j gives the taps back from j on (w_1 at j), nothing before, and the map is
    linear, so these impulse responses are the whole map."""
    torch.manual_seed(5)
    fir = lambda x, w: cpu64(extractor.causal_fir_reference(dev(x), dev(w)))[0]
    for shape in ((7,), (7, 3), (7, 3, 3)):
        w = torch.randn(*shape, dtype=torch.float64)
        for j, c in itertools.product(range(7), range(3)):
            x = torch.zeros(1, 7, 3, dtype=torch.float64)
            x[0, j, c] = 1.0
            want = torch.zeros(7, 3, dtype=torch.float64)
            for k in range(7 - j):  # tap k + 1: row c of a matrix, else e_c scaled
                want[j + k] = w[k][c] if w.dim() == 3 else w[k] * x[0, j]
            assert torch.allclose(fir(x, w)[0], want, atol=TOL, rtol=0), (shape, j, c)
        x1, x2 = torch.randn(2, 2, 7, 3, dtype=torch.float64)
        assert torch.allclose(fir(2 * x1 - x2, w), 2 * fir(x1, w) - fir(x2, w), atol=TOL, rtol=0)


# ---- the whole Transformer, Section 4 alone, against `Transformer` on the same weights
def literal_transformer(model, idx, targets, masks=None):
    """Eq. (3)-(22) with model's weights, on the CPU in float64: logits (inside Eq. 21's softmax), Y-hat
    and the loss. masks: what each dropout keeps, in the paper's order (Eq. 7, then per layer the one
    draw of Eq. 18 and 20 and that of Eq. 20), or None for no dropout (evaluation)."""
    cfg, t = model.cfg, idx.shape[1]
    u, l, d, p = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.dropout
    draws = iter(masks or [])
    dropout = lambda X: X if masks is None else torch.where(next(draws), X / (1 - p), 0.0)  # Eq. (6)

    def layernorm(X, ln):  # Eq. (8), mean and standard deviation of each row (torch's eps 1e-5 inside)
        mu = X.mean(-1, keepdim=True)
        return ln.weight * (X - mu) / ((X - mu) ** 2).mean(-1, keepdim=True).add(1e-5).sqrt() + ln.bias

    X_in_tok = F.one_hot(idx, u).double()  # (B, t, u): [s_i = j - 1]
    X_in_pos = torch.eye(l, dtype=torch.float64)[:t]  # (t, l): [i = j]
    X_emb_tok = X_in_tok @ (model.emb_tok.weight * math.sqrt(d))  # Eq. (4), W^[emb_tok] times sqrt(d)
    X_emb_pos = X_in_pos @ (model.emb_pos.weight * math.sqrt(d))  # Eq. (5), W^[emb_pos] times sqrt(d)
    X = dropout(X_emb_tok + X_emb_pos)  # Eq. (7): X^[in_lay1]
    for lay in model.layers:
        X_out_sub1 = literal_mixer(cfg.mixer, lay.mixer, layernorm(X, lay.ln1))  # Eq. (9), the mixer
        D1 = dropout(X_out_sub1)  # one draw, used by Eq. (18) and (20)
        X_in_sub2 = layernorm(D1 + X, lay.ln2)  # Eq. (18)
        f1, f2 = lay.ffn.sub2_1, lay.ffn.sub2_2
        X_out_sub2 = torch.relu(X_in_sub2 @ f1.weight.T + f1.bias) @ f2.weight.T + f2.bias  # Eq. (19)
        X = dropout(X_out_sub2) + D1 + X  # Eq. (20)
    Z = layernorm(X, model.ln_f) @ model.soft.weight.T + model.soft.bias  # Eq. (21), (B, t, u)
    Y_hat = torch.exp(Z) / torch.exp(Z).sum(-1, keepdim=True)  # Eq. (21), (22)
    loss = -torch.log(Y_hat.gather(-1, targets[..., None])).mean()  # Eq. (3), over every row of the batch
    return Z, Y_hat, loss


def dropout_masks(model):
    """Records, in call order, what each nn.Dropout of model keeps (its nonzero outputs)."""
    masks = []
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(lambda mod, args, out: masks.append((out != 0).cpu()))
    return masks


@pytest.mark.parametrize("name", PAPER)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_transformer_equals_section4_written_out(name, mode):
    """Forward (logits, Y-hat, loss) and backward (every parameter's gradient) of the whole model, in
    evaluation and in training with the dropout masks the model drew applied to the literal model."""
    torch.manual_seed(1)
    sizes = dict(vocab_size=11, block_size=8, n_embd=8, n_hidden=12, n_layer=2, n_head=2)
    ref = scrambled(Transformer(Config(**sizes, dropout=0.3, mixer=name)), 0.4)
    model, t = dev(ref).train(mode == "train"), 8 if mode == "eval" else 6
    idx, targets = torch.randint(0, 11, (2, t)), torch.randint(0, 11, (2, t))
    masks = dropout_masks(model)
    logits, loss = model(dev(idx).long(), dev(targets).long())
    loss.backward()
    if mode == "train":
        assert len(masks) == 1 + 2 * 2 and all(0 < (~m).sum() < m.numel() for m in masks), len(masks)
    Z, Y_hat, L = literal_transformer(ref, idx, targets, masks if mode == "train" else None)
    L.backward()
    got = cpu64(logits, logits.softmax(-1), loss)
    for what, a, b in zip(["logits", "Y_hat", "loss"], got, (Z, Y_hat, L)):
        assert torch.allclose(a, b, atol=TOL, rtol=0), what
    for (what, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(cpu64(p.grad)[0], p_ref.grad, atol=TOL, rtol=0), what
    assert model(dev(idx).long())[1] is None  # no targets, no loss


# ---- initialisation (Section 6)
def ks_distance_from_normal(v, sigma):
    """Kolmogorov-Smirnov distance sup |F_n - F| of the sample v from N(0, sigma^2)."""
    v = v.detach().double().flatten().sort().values
    n = v.numel()
    cdf = 0.5 * (1 + torch.erf(v / (sigma * math.sqrt(2))))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - cdf).max().item(), (cdf - (i - 1) / n).max().item())


@pytest.mark.parametrize("mixer", PAPER)
def test_initialisation_follows_section6(mixer):
    """Biases 0, LayerNorm gains 1, every weight tensor ~ N(0, 0.01²). Bands from each tensor's size n
    pass a true N(0, 0.01²) sample with probability 1 - 1e-6: 5 standard errors for the std (0.01 /
    sqrt(2(n-1))) and the mean (0.01 / sqrt(n)); the Kolmogorov-Smirnov distance below
    sqrt(ln(2 / 1e-6) / 2n) (DKW), which checks the shape too (a uniform of std 0.01 is 0.058 away)."""
    model = tiny_model(mixer, l=64, d=128, n_hidden=256, vocab=500)
    for name, p in model.named_parameters():
        n = p.numel()
        if name.endswith("bias"):
            assert (p == 0).all(), name
        elif ".ln" in name or name.startswith("ln_f"):
            assert (p == 1).all(), name
        else:
            assert abs(p.std().item() - 0.01) < 5 * 0.01 / math.sqrt(2 * (n - 1)), (name, p.std().item())
            assert abs(p.mean().item()) < 5 * 0.01 / math.sqrt(n), (name, p.mean().item())
            assert ks_distance_from_normal(p, 0.01) < math.sqrt(math.log(2 / 1e-6) / (2 * n)), name


def test_synth_initialisation():
    """Weights ~ N(0, 0.01²) as Section 6, mixing alphas zero (1/2 each), Fixed Random's R N(0, 1)."""
    for name in SYNTHS:
        mixer = tiny_model(name, l=64, d=64, n_layer=1).layers[0].mixer
        for p_name, p in list(mixer.named_parameters()) + list(mixer.named_buffers()):
            std = 1.0 if (name, p_name) == ("random-fixed", "R") else 0.01
            if p_name == "alpha":
                assert (p == 0).all() and torch.allclose(mixer.mixing_weights()[0], torch.tensor(0.5))
            else:
                assert abs(p.std().item() - std) < 0.15 * std and abs(p.mean().item()) < 0.1 * std, p_name


# ---- parameter counts: Tables 3 and 4 (no biases, ERRATA) and the Synthesizer paper's Table 1
def paper_params(name, d, l):  # Tables 3 and 4 (ERRATA: no biases)
    sa, she, he, we = 4 * d * d, l * d * d + 2 * d * d, l * d + 3 * d * d, l * d + 2 * d * d
    return {"sa": sa, "she": she, "he": he, "we": we, "me": l, "he-ext": l * d + d * d}[name]


def synth_params(name, d, l, n, a, b, k=8):
    """Table 1 of the Synthesizer paper and its text (a b = l, k = 8), plus W_V and W_out_att (2 d^2)."""
    part = {"dense": d * d + d * l, "dense-fact": d * d + d * (a + b), "random": n * l * l}  # "adds d x N"
    part.update({"random-fixed": 0, "random-fact": 2 * n * l * k, "sa": 2 * d * d})  # "N^2", "2(Nk)"
    return 2 * d * d + sum(part[p] for p in name.split("+")) + 2 * n * ("+" in name)  # mixtures: 2n alphas


@pytest.mark.parametrize(
    "d,l,n,a,b", [(128, 128, 32, 8, 16), (24, 12, 3, 3, 4), (16, 9, 4, 3, 3), (8, 1, 1, 1, 1)]
)
def test_parameter_counts_equal_formulas(d, l, n, a, b):
    count = lambda name: sum(
        p.numel() for p in find_mixer(name)(Config(n_embd=d, block_size=l, n_head=n)).parameters()
    )
    for name in PAPER:
        assert count(name) == paper_params(name, d, l), name
    for name in SYNTHS:
        assert count(name) == synth_params(name, d, l, n, a, b), name
    assert synthesizer._syn_factors(l) == (a, b)


@pytest.mark.parametrize("name", ALL)
def test_whole_model_parameter_count(name):
    u, l, d, c, m = 97, 16, 24, 40, 3
    model = Transformer(
        Config(vocab_size=u, block_size=l, n_embd=d, n_hidden=c, n_layer=m, n_head=4, mixer=name)
    )
    mixer = paper_params(name, d, l) if name in PAPER else synth_params(name, d, l, 4, 4, 4)
    want = {
        "embeddings": u * d + l * d,  # Eq. (4), (5)
        "mixers": m * mixer,
        "ffns": m * (d * c + c + c * d + d),  # Eq. (19)
        "norms_and_head": m * 2 * 2 * d + 2 * d + d * u + u,  # Eq. (8) twice a layer, and before Eq. (21)
    }
    want["total"] = sum(want.values())
    assert model.param_counts() == want and want["total"] == sum(p.numel() for p in model.parameters())


# ---- bad configurations and inputs: one clear ValueError each
def refused(message, fn, *args, **kw):
    """fn(*args, **kw) raises a ValueError that says exactly `message`."""
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    assert str(e.value) == message


def test_bad_config_gives_one_clear_value_error():
    for field in ("n_layer", "n_embd", "block_size", "vocab_size", "n_hidden", "n_head"):
        for bad in (0, -1, 2.0, True):
            refused(f"{field} must be a positive integer, got {bad!r}", Config, **{field: bad})
    for bad in (-0.1, 1.0, 1.5):
        refused(f"dropout must be in [0, 1), got {bad}", Config, dropout=bad)
    Config(dropout=0.0, n_layer=1, vocab_size=1, n_hidden=1)
    for name in ("sa", "dense", "random+sa"):  # the mixers with heads
        why = f"n_head=3 must divide n_embd=128 for mixer '{name}' (each head has d/n features)"
        refused(why, Config, n_head=3, mixer=name)
    Config(n_head=3, mixer="me")  # heads mean nothing to the Extractors
    for l, fix in ((2, 4), (3, 4), (7, 8), (127, 128)):  # Factorized Dense needs l = a b with a, b > 1
        why = f"dense-fact needs block_size l = a b with a, b > 1, but l={l} is prime: try block_size={fix}"
        refused(why, tiny_model, "dense-fact", l=l)


def test_bad_inputs_give_one_clear_value_error():
    model = dev(scrambled(tiny_model("me", l=8), 0.3))
    tokens = lambda t: torch.zeros(1, t, dtype=torch.long, device=DEVICE)
    model(tokens(8))  # l tokens fit
    refused("sequence length 9 exceeds block_size l=8; crop it to its last l tokens", model, tokens(9))
    cache = model.new_cache()
    model(tokens(5), cache=cache)
    refused(
        "sequence length 9 exceeds block_size l=8; crop it to its last l tokens",
        model,
        tokens(4),
        cache=cache,
    )
    for name in ("sa", "me", "dense"):
        for cache in (None, model.new_cache()):
            empty = torch.zeros(2, 0, dtype=torch.long)
            refused(
                "idx (2, 0) holds no tokens; give each sequence at least one",
                tiny_model(name),
                empty,
                cache=cache,
            )
    x = torch.zeros(1, 13, 8, dtype=torch.float64)
    refused("sequence length 13 exceeds block_size l=12", random_mixer("dense"), x)  # a Synthesizer alone


# ---- find_mixer: the paper's names, the Synthesizers' (imported only then), module.Class
USER_MIXER = '''
import torch, torch.nn as nn

class Mean(nn.Module):
    """A mixer of one's own: the running mean of the inputs, scaled per feature."""
    def __init__(self, cfg):
        super().__init__()
        self.w = nn.Parameter(torch.ones(cfg.n_embd))
    def forward(self, x, cache=None):
        return self.w * x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]

NOT_A_CLASS = 3
'''


def test_find_mixer_knows_three_forms_and_names_them_when_it_does_not(tmp_path, monkeypatch):
    (tmp_path / "my_mixers.py").write_text(USER_MIXER)
    monkeypatch.syspath_prepend(str(tmp_path))
    Mean = importlib.import_module("my_mixers").Mean
    assert find_mixer("my_mixers.Mean") is Mean and find_mixer("she") is extractor.SHE
    cfg = Config(vocab_size=9, block_size=6, n_embd=10, n_head=3, n_layer=1, mixer="my_mixers.Mean")
    model = Transformer(Config(**dataclasses.asdict(cfg)))  # a checkpoint's config: no flag, no registering
    assert type(model.layers[0].mixer) is Mean and model(torch.zeros(1, 6).long())[0].shape == (1, 6, 9)
    choices = ", ".join(ALL) + ", or module.Class (a mixer class of yours)"
    for bad, why in [
        ("xx", ""),
        ("he.ext", " (No module named 'he')"),
        ("my_mixers.Nope", " (module 'my_mixers' has no attribute 'Nope')"),
        ("my_mixers.NOT_A_CLASS", ""),
        ("math.pi", ""),
    ]:
        refused(f"unknown mixer {bad!r}{why}; choose one of: {choices}", Config, mixer=bad)


def test_the_synthesizers_are_imported_only_when_used(monkeypatch):
    monkeypatch.delitem(sys.modules, "synthesizer")
    for name in PAPER:
        Transformer(Config(mixer=name, n_layer=1, block_size=4, n_embd=8, n_head=2, vocab_size=5))
    assert "synthesizer" not in sys.modules
    assert find_mixer("random+sa").__name__ == "RandomSASynthesizer" and "synthesizer" in sys.modules


@pytest.mark.slow
def test_a_fresh_python_imports_no_synthesizer_for_a_paper_mixer():
    code = "import extractor, sys; extractor.Config(mixer='me'); assert 'synthesizer' not in sys.modules"
    code += "; extractor.Config(mixer='dense'); assert 'synthesizer' in sys.modules"
    rc, out, err = run_script("-c", code)
    assert rc == 0, err


# ---- generation (Eq. 2) and sampling
def scrambled_model(name, l=16):
    return dev(scrambled(tiny_model(name, l=l), 0.3))


@pytest.mark.parametrize("name", ALL)
def test_cached_generation_equals_uncached(name):
    model = scrambled_model(name, l=12)
    idx = torch.randint(0, 50, (2, 5), device=DEVICE)
    cached = model.generate(idx, 7, temperature=0, use_cache=True)  # fills l = 12 exactly
    assert torch.equal(cached, model.generate(idx, 7, temperature=0, use_cache=False))
    cache = model.new_cache()  # a token, chunks of 4 and 2, then one token at a time: one full forward
    steps = [model(cached[:, i:j], cache=cache)[0] for i, j in ((0, 1), (1, 5), (5, 7))]
    steps += [model(cached[:, i : i + 1], cache=cache)[0] for i in range(7, 12)]
    assert cache["t"] == 12 and torch.allclose(torch.cat(steps, 1), model(cached)[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ALL)
def test_generation_beyond_block_size_is_a_sliding_window_of_l_tokens(name):
    """Eq. (2): every token beyond l is predicted from exactly the l tokens before it."""
    model = scrambled_model(name, l=8)
    prompt = torch.randint(0, 50, (2, 5), device=DEVICE)
    idx = prompt
    for _ in range(10):  # the plain sliding-window loop
        idx = torch.cat([idx, model(idx[:, -8:])[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, 10, temperature=0), idx)
    for use_cache in (True, False):  # a prompt longer than l: its last l tokens
        assert torch.equal(model.generate(idx[:, :12], 3, temperature=0, use_cache=use_cache), idx[:, :15])


def sampled_from(monkeypatch, logits, **kw):
    """The probabilities sample_next draws from (what it hands torch.multinomial), and its token."""
    drawn, multinomial = [], torch.multinomial
    monkeypatch.setattr(
        torch, "multinomial", lambda p, num_samples: drawn.append(p) or multinomial(p, num_samples)
    )
    token = extractor.sample_next(torch.tensor(logits, dtype=torch.float64), **kw)
    monkeypatch.undo()
    assert token.shape == (len(logits), 1) and (not drawn or drawn[0][0, token[0, 0]] > 0)
    return drawn[0].double() if drawn else None, token


def test_temperature_top_k_and_top_p_draw_from_exactly_these_probabilities(monkeypatch):
    def near(logits, want, **kw):
        p, _ = sampled_from(monkeypatch, logits, **kw)
        want = torch.tensor(want, dtype=torch.float64)
        assert torch.allclose(p, want / want.sum(-1, keepdim=True), atol=1e-6, rtol=0), (kw, p)

    e = math.exp
    near([[2.0, 1.0, 0.0, -1.0]], [[e(2), e(1), 1, e(-1)]])  # softmax
    near([[2.0, 1.0, 0.0, -1.0]], [[e(4), e(2), 1, e(-2)]], temperature=0.5)  # softmax(logits / T)
    two_rows = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]]
    near(two_rows, [[e(1), e(0.5), 0, 0], [0, e(1.5), 0, e(1)]], temperature=2, top_k=2)  # the 2 largest
    near([[2.0, 1.0, 0.0, -1.0]], [[e(2), e(1), 1, e(-1)]], top_k=9)  # k beyond u: every token
    probs = [[0.5, 0.2, 0.15, 0.1, 0.05]]
    logp = torch.tensor(probs).log().tolist()
    near(logp, [[0.5, 0.2, 0, 0, 0]], top_p=0.6)  # 0.5 < 0.6 needs the second token, 0.7 reaches it
    near(logp, [[0.5, 0, 0, 0, 0]], top_p=0.45)
    near(logp, [[0.5, 0.2, 0.15, 0, 0]], top_p=0.75)
    near(logp, probs, top_p=1.0)
    near(logp, [[0.25, 0.04, 0, 0, 0]], top_p=0.8, temperature=0.5)  # p² / 0.335: 0.746, then 0.866
    near(logp, [[0.5, 0.2, 0, 0, 0]], top_p=0.7, top_k=3)  # 0.5 / 0.85 = 0.59, then 0.82
    p, _ = sampled_from(monkeypatch, [[3.0, 2.0, 2.0, 2.0, 0.0]], top_k=2)  # a tie at the boundary
    assert (p > 0).sum() == 2 and abs(p[0, 0] - e(3) / (e(3) + e(2))) < 1e-6
    p, _ = sampled_from(monkeypatch, [[1.0, 1.0, 1.0, 1.0]], top_p=0.5)  # 0.25 each: 0.5 is reached by two
    assert sorted(p[0].tolist()) == [0, 0, 0.5, 0.5]
    for T in (0, 1e-38):  # greedy, and a tiny temperature stays finite
        p, token = sampled_from(monkeypatch, [[0.0, 1.0, 2.0, -2.0], [7.0, 1.0, 5.0, -2.0]], temperature=T)
        assert token.tolist() == [[2], [0]] and (T == 0) == (p is None)
        assert T == 0 or p.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_generate_refuses_bad_settings_and_samples_in_eval_mode():
    model = scrambled_model("sa")
    prompt = torch.tensor([[1, 2, 3]], device=DEVICE)
    for kw, says in [
        ({"top_k": 0}, "top_k must be at least 1 (or None for all tokens), got 0"),
        ({"top_p": 0}, "top_p must be in (0, 1] (or None for all tokens), got 0"),
        ({"top_p": 1.01}, "top_p must be in (0, 1] (or None for all tokens), got 1.01"),
        ({"temperature": -1e-9}, "temperature must be a finite number >= 0 (0 is greedy), got -1e-09"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0 (0 is greedy), got nan"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0 (0 is greedy), got inf"),
    ]:
        refused(says, model.generate, prompt, 0, **kw)  # at once, before any token
        refused(says, extractor.sample_next, prompt.float(), **kw)
    for bad in (prompt[:, :0], prompt[0]):
        says = f"idx must be (B, t) token ids with t >= 1 (a prompt), got {tuple(bad.shape)}"
        refused(says, model.generate, bad, 4)
    assert model.generate(prompt, 0).tolist() == prompt.tolist()
    greedy = model.generate(prompt, 6, temperature=0, top_k=1, top_p=1)
    for block in model.modules():
        if isinstance(block, torch.nn.Dropout):
            block.p = 0.9  # in training mode this would change every logit
    for training in (True, False):
        model.train(training)
        assert torch.equal(model.generate(prompt, 6, temperature=0), greedy) and model.training == training
    torch.manual_seed(3)
    sampled = model.generate(prompt.expand(64, 3), 1, temperature=100.0)[:, -1]  # nearly uniform over 50
    assert len(set(sampled.tolist())) > 20


# ---- the Synthesizers: Fixed Random, and the mixed precision of training
def test_synth_fixed_random_is_a_random_alignment_not_trained_but_saved():
    """N(0, 1) logits: rows far from the running mean a trained Random starts as (N(0, 0.01²))."""
    torch.manual_seed(0)
    l, cfg = 128, dict(n_embd=64, block_size=128, n_head=4)
    uniform = sum(math.log(i + 1) for i in range(8, l)) / (l - 8)  # a running mean's mean row entropy
    for name, low, high in (("random-fixed", 0, uniform - 0.4), ("random", uniform - 0.01, uniform)):
        P = synthesizer._syn_softmax(find_mixer(name)(Config(**cfg, mixer=name)).logits(0, l), 0)  # (n, l, l)
        assert low < -(P * P.clamp_min(1e-30).log()).sum(-1)[:, 8:].mean() < high, name
    model = tiny_model("random-fixed", l=8, d=16, vocab=40)
    assert not any("R" in name.split(".") for name, _ in model.named_parameters())
    model(torch.randint(0, 40, (4, 8)), torch.randint(0, 40, (4, 8)))[1].backward()
    mixer, R0 = model.layers[0].mixer, model.layers[0].mixer.R.clone()
    assert not mixer.R.requires_grad and mixer.R.grad is None and mixer.W_V.weight.grad.abs().max() > 0
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other = tiny_model("random-fixed", l=8, d=16, vocab=40, seed=1)
    assert not torch.equal(other.layers[0].mixer.R, R0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(other.layers[0].mixer.R, R0)


@pytest.mark.parametrize("name", ALL)
def test_training_under_bfloat16_autocast(name):
    """train.py's --dtype bfloat16: float32 weights meet bf16 activations, the loss (Eq. 3) is computed
    in float32, every parameter gets a gradient, and the loss stays near float32's."""
    model = dev(scrambled(tiny_model(name, l=8), 0.2)).float()
    idx = torch.randint(0, 50, (2, 8), device=DEVICE)
    loss32 = model(idx, idx)[1]
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32 and abs(loss - loss32) < 0.05
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
