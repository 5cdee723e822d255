"""
The pre-LN Transformer of "Attention Is Not All You Need Anymore" (Zhe Chen, 2023,
arXiv:2308.07661), its baseline token mixer (causal multi-head self-attention) and the
four Extractors (SHE, WE, HE, ME) that replace it, plus the extraction-only HE named at
the end of Section 5. The file follows the paper: Config (Table 1); the Transformer
(Section 4, Eq. 3-22); self-attention (Eq. 10-17); the Extractors (Section 5, Eq. 23
to 29) and the causal FIR filter they share, as the literal sum and as causal_fir (how
it is computed fast is fir.py); last, choosing each new token in generation (Eq. 2).
Every weight starts N(0, 0.01²), i.e. with standard deviation 0.01 (Section 6). The
operation counts of Tables 3-7 are in experiments/bench.py.

Equation numbers, e.g. `# Eq. (23)`, refer to the paper. Indices: the paper counts
positions and taps from 1; the code counts from 0, so the paper's tap W_k, at

    k = i - j + 1  (the distance back plus one),

is W_ext[k - 1] here, and W_ext[0] multiplies the current token.
"""

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fir import fir_full, fir_last_row
from synthesizer import SYNTHESIZERS, check_heads  # further mixers (Tay et al.)

# Section 6: every weight starts N(0, INIT_STD²), every bias at zero
INIT_STD = 0.01


@dataclass
class Config:
    """The model's settings; the defaults are the paper's Table 1. A plain record: the
    command line checks each value, and a mixer the settings it needs."""

    vocab_size: int = 5000  # u, size of the vocabulary
    block_size: int = 128  # l, length of the context window
    n_embd: int = 128  # d, "dimension" of the model
    n_hidden: int = 512  # c, nodes in the hidden layer of the FFN
    n_layer: int = 18  # m, number of layers
    n_head: int = 32  # n, heads of self-attention (and of the Synthesizers)
    dropout: float = 0.1  # p, dropout rate
    mixer: str = "sa"  # the first sublayer: a name find_mixer knows


# --------------------------------------------------------------------------------------
# The pre-LN Transformer, Section 4, Eq. (3)-(22)


class FFN(nn.Module):
    """The second sublayer, Eq. (19)."""

    def __init__(self, cfg):
        super().__init__()
        self.sub2_1 = nn.Linear(cfg.n_embd, cfg.n_hidden)  # W^[sub2_1], b^[sub2_1]
        self.sub2_2 = nn.Linear(cfg.n_hidden, cfg.n_embd)  # W^[sub2_2], b^[sub2_2]

    def forward(self, x):
        return self.sub2_2(F.relu(self.sub2_1(x)))  # Eq. (19)


class Layer(nn.Module):
    """One layer, Eq. (9)-(20). Eq. (18) and (20) share one dropout draw of the first
    sublayer's output (Notes on the paper, 4): the usual pre-LN residual block."""

    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)  # g, b of Eq. (8) for Eq. (9)
        self.mixer = find_mixer(cfg.mixer)(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)  # for Eq. (18)
        self.ffn = FFN(cfg)
        self.drop = nn.Dropout(cfg.dropout)  # Eq. (6)

    def forward(self, x, cache=None):  # x = X^[in_lay] (B, t, d)
        x_out_sub1 = self.mixer(self.ln1(x), cache)  # Eq. (9), then the mixer
        h = x + self.drop(x_out_sub1)  # Eq. (18), inside the layernorm
        x_out_sub2 = self.ffn(self.ln2(h))  # Eq. (18), (19)
        return h + self.drop(x_out_sub2)  # Eq. (20)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        u, l, d = cfg.vocab_size, cfg.block_size, cfg.n_embd
        self.emb_tok = nn.Embedding(u, d)  # W^[emb_tok], Eq. (4)
        self.emb_pos = nn.Embedding(l, d)  # W^[emb_pos], Eq. (5)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(d)  # the pre-LN of Eq. (21)
        self.soft = nn.Linear(d, u)  # W^[soft], b^[soft], no weight tying
        self.apply(init_weights)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, t) token indices; targets (B, t) the next tokens, or None. Returns
        logits (B, t, u) and the loss of Eq. (3) (None without targets). With `cache`
        (from new_cache), idx holds only new tokens, after those already cached."""
        B, t = idx.shape
        if t == 0:
            raise ValueError(
                f"idx {tuple(idx.shape)} holds no tokens; "
                "give each sequence at least one"
            )
        past = 0 if cache is None else cache["t"]  # the positions cached before idx
        l = self.cfg.block_size
        if past + t > l:
            raise ValueError(
                f"sequence length {past + t} exceeds block_size l={l}; "
                "crop it to its last l tokens"
            )
        pos = torch.arange(past, past + t, device=idx.device)
        scale = math.sqrt(self.cfg.n_embd)  # Section 4: embeddings times sqrt(d)
        # Eq. (4), (5), (7)
        x = self.drop(self.emb_tok(idx) * scale + self.emb_pos(pos) * scale)
        for i, layer in enumerate(self.layers):
            x = layer(x, None if cache is None else cache["layers"][i])  # Eq. (9)-(20)
        if cache is not None:
            cache["t"] = past + t
        logits = self.soft(self.ln_f(x))  # Eq. (21) before the softmax, (B, t, u)
        loss = None
        if targets is not None:  # Eq. (3): mean of -ln P-hat, Eq. (22)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def new_cache(self):
        return {"t": 0, "layers": [{} for _ in self.layers]}

    def param_counts(self):
        count = lambda mods: sum(p.numel() for m in mods for p in m.parameters())
        c = {"embeddings": count([self.emb_tok, self.emb_pos])}  # Eq. (4), (5)
        c["mixers"] = count(layer.mixer for layer in self.layers)
        c["ffns"] = count(layer.ffn for layer in self.layers)  # Eq. (19)
        c["norms_and_head"] = count([self]) - sum(c.values())  # Eq. (8), (21)
        c["total"] = count([self])
        return c

    @torch.no_grad()
    def generate(
        self,
        idx,
        max_new_tokens,
        temperature=1.0,
        top_k=None,
        top_p=None,
        use_cache=True,
    ):
        """Yield each new token (B, 1) as soon as it is sampled from the last l
        tokens, Eq. (2): torch.cat([idx, *model.generate(idx, n)], 1) is what
        nanoGPT's generate returns. While the sequence fits in l, a cache makes a new
        token cost one row per layer (Tables 5, 6); beyond l every position shifts, so
        each token is a forward over the last l tokens, as with use_cache=False
        throughout. Runs in eval mode, then puts the model back in its mode."""
        check_sampling(temperature, top_k, top_p)
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(
                "idx must be (B, t) token ids with t >= 1 (a prompt), "
                f"got {tuple(idx.shape)}"
            )
        l, was_training = self.cfg.block_size, self.training
        self.eval()
        try:
            cache = self.new_cache() if use_cache else None
            logits = self(idx[:, -l:], cache=cache)[0][:, -1]  # (B, u)
            for _ in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, top_p)  # (B, 1)
                idx = torch.cat([idx, nxt], dim=1)
                yield nxt
                if cache is not None and cache["t"] < l:
                    logits = self(nxt, cache=cache)[0][:, -1]  # one new row per layer
                else:
                    logits = self(idx[:, -l:])[0][:, -1]  # Eq. (2): the last l tokens
        finally:
            self.train(was_training)


def init_weights(module):
    """Section 6: weights ~ N(0, 0.01²), biases zero. LayerNorm keeps gain 1, bias 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def normal_weight(*shape):
    """A weight tensor that is not an nn.Linear's (the Extractors' taps)."""
    return nn.Parameter(torch.randn(*shape) * INIT_STD)  # Section 6


# --------------------------------------------------------------------------------------
# Token mixers, the first sublayer. A mixer is an nn.Module built as cls(cfg), with
# forward(x, cache=None) mapping X^[in_sub1] (B, t, d) to X^[out_sub1] (B, t, d)
# causally, with no dropout inside; a ValueError for settings it cannot take. With
# `cache` (a dict per layer, for generation) x holds only the new positions, and the
# mixer keeps in the dict what later tokens need. Your own mixer class needs no
# registering: --mixer=module.Class names it.


class SelfAttention(nn.Module):
    """Multi-head causal self-attention, Eq. (10)-(17), with a KV cache (Table 5's
    O(t d + d^2))."""

    def __init__(self, cfg):
        super().__init__()
        d, self.n = cfg.n_embd, cfg.n_head
        check_heads(cfg)
        # W_j^[Q], W_j^[K], W_j^[V] of all heads
        self.W_QKV = nn.Linear(d, 3 * d, bias=False)
        self.W_out_att = nn.Linear(d, d, bias=False)  # W^[out_att]

    def forward(self, x, cache=None):
        B, t, d = x.shape
        h = d // self.n
        q, k, v = self.W_QKV(x).split(d, dim=2)  # Eq. (10)-(12), (B, t, d) each
        # (B, n, t, h) each
        q, k, v = (z.view(B, t, self.n, h).transpose(1, 2) for z in (q, k, v))
        past = 0
        if cache is not None:
            if "k" in cache:
                past = cache["k"].shape[2]
                k = torch.cat([cache["k"], k], dim=2)  # (B, n, T, h)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        # Eq. (13) Z_j = Q_j K_j^T / sqrt(h); Eq. (14) A_j = softmax of Z_j over the
        # unmasked k <= i (the denominator sums over f <= i: Notes on the paper, 1); Eq.
        # (15) R_j = A_j V_j. One fused kernel computes all three; tests.py holds them
        # written out as loops.
        if past == 0:
            r = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n, t, h)
        else:  # new rows past .. past+t-1 see the columns up to their own position
            mask = x.new_ones(t, past + t, dtype=torch.bool).tril(past)
            r = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        r = r.transpose(1, 2).reshape(B, t, d)  # Eq. (16), concatenate the heads
        return self.W_out_att(r)  # Eq. (17)


class SHE(nn.Module):
    """The super high-performance Extractor, Eq. (23)-(25): matrix taps."""

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.W_ext = normal_weight(l, d, d)  # the taps W_1^[ext] .. W_l^[ext]
        self.W_adj = nn.Linear(d, d, bias=False)  # W^[adj]
        self.W_out = nn.Linear(d, d, bias=False)  # W^[out]

    def forward(self, x, cache=None):
        # Eq. (23): x_i^ext = sum_j x_j W_{i-j+1}
        x_out_ext = causal_fir(x, self.W_ext, cache)
        x_out_adj = self.W_adj(x) * x_out_ext  # Eq. (24): X^adj = (X W^adj) o X^ext
        return self.W_out(x_out_adj)  # Eq. (25): X^out_sub1 = X^adj W^out


class WE(nn.Module):
    """The worthwhile Extractor, Eq. (26), (24), (25): vector taps."""

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        # the taps w_1^[ext] .. w_l^[ext] (l of them: Notes, 2)
        self.w_ext = normal_weight(l, d)
        self.W_adj = nn.Linear(d, d, bias=False)  # W^[adj]
        self.W_out = nn.Linear(d, d, bias=False)  # W^[out]

    def forward(self, x, cache=None):
        # Eq. (26): x_i^out_ext = sum_j x_j o w_{i-j+1}
        x_out_ext = causal_fir(x, self.w_ext, cache)
        x_out_adj = self.W_adj(x) * x_out_ext  # Eq. (24)
        return self.W_out(x_out_adj)  # Eq. (25)


class HE(nn.Module):
    """The higher-performance Extractor, Eq. (27), (28), (24), (25): a shared map,
    then vector taps."""

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.W_in_ext = nn.Linear(d, d, bias=False)  # W^[in_ext]
        self.w_ext = normal_weight(l, d)  # the taps w_1^[ext] .. w_l^[ext]
        self.W_adj = nn.Linear(d, d, bias=False)  # W^[adj]
        self.W_out = nn.Linear(d, d, bias=False)  # W^[out]

    def forward(self, x, cache=None):
        x_ext = self.W_in_ext(x)  # Eq. (27): X^ext = X W^in_ext
        # Eq. (28): x_i^out_ext = sum_j x^ext_j o w_{i-j+1}
        x_out_ext = causal_fir(x_ext, self.w_ext, cache)
        x_out_adj = self.W_adj(x) * x_out_ext  # Eq. (24)
        return self.W_out(x_out_adj)  # Eq. (25)


class ME(nn.Module):
    """The minimalist Extractor, Eq. (29): only the extraction, with scalar taps."""

    def __init__(self, cfg):
        super().__init__()
        self.w_ext = normal_weight(cfg.block_size)  # the taps w_1^[ext] .. w_l^[ext]

    def forward(self, x, cache=None):
        # Eq. (29): x_i^out_sub1 = sum_j x_j w_{i-j+1}
        return causal_fir(x, self.w_ext, cache)


class HEExtraction(nn.Module):
    """The extraction part of the HE alone, the variant named at the end of Section 5:
    Eq. (27) and (28), no adjustment (Eq. 24) and no output map (Eq. 25)."""

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.W_in_ext = nn.Linear(d, d, bias=False)  # W^[in_ext]
        self.w_ext = normal_weight(l, d)  # the taps w_1^[ext] .. w_l^[ext]

    def forward(self, x, cache=None):
        return causal_fir(self.W_in_ext(x), self.w_ext, cache)  # Eq. (27), (28)


# the paper's mixers: each --mixer name and its class (the first sublayer)
MIXERS = {
    "sa": SelfAttention,
    "she": SHE,
    "he": HE,
    "we": WE,
    "me": ME,
    "he-ext": HEExtraction,
}


def find_mixer(name):
    """The mixer class called `name`: a key of MIXERS or of SYNTHESIZERS, or
    "module.Class", an nn.Module class of your own, imported by that name."""
    known = MIXERS | SYNTHESIZERS
    if name in known:
        return known[name]
    module, _, cls = name.rpartition(".")
    found, why = None, ""
    try:
        found = getattr(importlib.import_module(module), cls) if module else None
    except (ImportError, AttributeError, TypeError) as e:  # (TypeError: ".mod.Class")
        why = f" ({e})"
    if isinstance(found, type) and issubclass(found, nn.Module):
        return found
    if found is not None:
        why = f" ({name} is {found!r}, not an nn.Module class)"
    choices = ", ".join([*known, "or module.Class (a mixer class of yours)"])
    raise ValueError(f"unknown mixer {name!r}{why}; choose one of: {choices}")


# --------------------------------------------------------------------------------------
# The extraction shared by the four Extractors: a causal FIR filter along time, Eq.
# (23), (26), (28), (29). The same tap k serves every position (the weights follow "the
# reverse order of the input").


def causal_fir_reference(x, w):
    """Eq. (23)/(26)/(28)/(29) as written: y_i = sum_{j<=i} x_j (*) w_{i-j+1}, a direct
    double sum. x (B, t, d); w (l, d, d) matrices x_j @ W (SHE), (l, d) vectors x_j o w
    (WE, HE) or (l,) scalars x_j w (ME). The reading copy: causal_fir computes the same
    faster (fir.py says how)."""
    tap = (lambda x_j, w_k: x_j @ w_k) if w.dim() == 3 else (lambda x_j, w_k: x_j * w_k)
    y = [sum(tap(x[:, j], w[i - j]) for j in range(i + 1)) for i in range(x.shape[1])]
    return torch.stack(y, dim=1)  # (B, t, d)


def causal_fir(x, w, cache=None):
    """causal_fir_reference, fast, and with a cache for generation. Without a cache, x
    is the whole (B, t, d) sequence. With one, x holds the new positions and cache["x"]
    the earlier inputs: a single new token costs one row of the sum, O(t d) for vector
    or scalar taps and O(t d^2) for matrix taps, as Tables 5 and 6 count."""
    if cache is None:
        return fir_full(x, w)
    past = cache.get("x")
    x_all = x if past is None else torch.cat([past, x], dim=1)  # (B, T, d)
    cache["x"] = x_all
    if past is None or x.shape[1] > 1:
        return fir_full(x_all, w)[:, -x.shape[1] :]
    return fir_last_row(x_all, w)[:, None]  # (B, 1, d)


# --------------------------------------------------------------------------------------
# Generation, Eq. (2): Transformer.generate turns the last position's logits into the
# next token


def check_sampling(temperature, top_k, top_p):
    """ValueError for settings that cannot sample."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(logits, temperature=1.0, top_k=None, top_p=None):
    """logits (B, u) -> token (B, 1). temperature 0 is greedy; top_k keeps exactly the k
    most likely tokens; top_p keeps the smallest set of most likely tokens whose
    probability reaches p (nucleus sampling, the paper's Table 2 uses p = 0.6). Uses
    torch's global RNG; Transformer.generate has checked the settings."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    # the top logit at 0: a tiny T stays finite
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        values, indices = logits.topk(min(top_k, logits.size(-1)), dim=-1)  # (B, k)
        logits = torch.full_like(logits, -math.inf).scatter(-1, indices, values)
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, u)
        p = sorted_logits.softmax(dim=-1)
        drop = p.cumsum(dim=-1) - p >= top_p  # the mass before it already reaches p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = logits.scatter(-1, order, sorted_logits)  # back in the tokens' order
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1)  # (B, 1)
