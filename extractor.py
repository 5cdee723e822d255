"""
The pre-LN Transformer of "Attention Is Not All You Need Anymore" (Zhe Chen, 2023, arXiv:2308.07661)
and every token mixer it compares: causal multi-head self-attention (the baseline) and the four
Extractors (SHE, HE, WE, ME), plus the extraction-only HE variant named at the end of Section 5.

Equation numbers, e.g. `# Eq. (23)`, refer to the paper (../shared/papers/, read with ERRATA.md).
Indices: the paper counts positions and taps from 1; the code counts from 0, so the paper's tap
W_k (k = i - j + 1, the distance back plus one) is W_ext[k - 1] here, and W_ext[0] is the tap that
multiplies the current token.

    python extractor.py      # prints Table 7 beside the parameter counts measured from the modules
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    """Defaults are the paper's Table 1."""
    vocab_size: int = 5000  # u, size of the vocabulary
    block_size: int = 128   # l, length of the context window
    n_embd: int = 128       # d, "dimension" of the model
    n_hidden: int = 512     # c, nodes in the hidden layer of the FFN
    n_layer: int = 18       # m, number of layers
    n_head: int = 32        # n, heads of self-attention (and of the Synthesizers)
    dropout: float = 0.1    # p, dropout rate
    mixer: str = "sa"       # the first sublayer: a key of MIXERS

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_embd", "n_hidden", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.mixer not in MIXERS:
            raise ValueError(f"unknown mixer {self.mixer!r}; choose one of: {', '.join(MIXERS)}")
        if MIXERS[self.mixer].uses_heads and self.n_embd % self.n_head != 0:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd} "
                             f"for mixer {self.mixer!r} (each head has d/n features)")


# -----------------------------------------------------------------------------
# The causal FIR filter shared by all four Extractors: Eq. (23), (26), (28), (29)

FFT_MIN_T_SCALAR = 1024  # scalar taps (ME): one Toeplitz GEMM below this t, the FFT from here on


def causal_fir(x, w):
    """The Extractors' "extraction": a causal FIR filter along time.

        y[b, i] = sum_{j=0..i} x[b, j] (*) w[i - j]        for i = 0 .. t-1

    x is (B, t, d); w holds the taps, tap 0 for the current token (the paper's W_1), tap k for
    the token k steps back. The product (*) depends on the taps' shape:
        w (l, d, d)  matrices  x[j] @ w[k]        SHE, Eq. (23)
        w (l, d)     vectors   x[j] * w[k]        WE and HE, Eq. (26) and (28)
        w (l,)       scalars   x[j] * w[k]        ME, Eq. (29)
    Only the first t <= l taps are used. tests.py checks this against the literal double loop.

    Computed as one (t x t) Toeplitz GEMM for scalar taps at small t, otherwise as a product in
    frequency space (zero-padded to n = 2t >= 2t - 1, so the circular convolution equals the
    linear one), with a hand-written backward. FFTs run in float32 (float64 stays float64), also under autocast.
    """
    t = x.shape[1]
    if t > w.shape[0]:
        raise ValueError(f"sequence length {t} exceeds the {w.shape[0]} taps (block_size l)")
    w = w[:t]
    if w.dim() == 1 and t < FFT_MIN_T_SCALAR:
        return _toeplitz(w).to(x.dtype) @ x  # (t, t) @ (B, t, d) -> (B, t, d)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        y = _FIRFFT.apply(x.to(dtype), w.to(dtype))
    return y


def _toeplitz(w):
    """(t,) taps -> (t, t) lower-triangular Toeplitz matrix T[i, j] = w[i - j] for j <= i."""
    t = w.shape[0]
    k = torch.arange(t, device=w.device)
    lag = k[:, None] - k[None, :]                                        # (t, t), i - j
    return torch.where(lag >= 0, w[lag.clamp(min=0)], w.new_zeros(()))  # (t, t)


class _FIRFFT(torch.autograd.Function):
    """causal_fir through rfft/irfft along the last (time) axis, zero-padded to n = 2t.
    Autograd's own FFT backward builds full complex spectra; this backward reuses the saved
    spectra: dx = irfft(G W^H), dw = irfft(sum over the batch of X^H G) (correlations)."""

    @staticmethod
    def forward(ctx, x, w):                                      # x (B, t, d), w (t, ...)
        t = x.shape[1]
        n = 2 * t
        X = torch.fft.rfft(x.transpose(1, 2), n=n, dim=-1)       # (B, d, F), F = t + 1
        if w.dim() == 3:                                         # matrices: a (d x d) product per frequency
            X = X.permute(2, 0, 1).contiguous()                  # (F, B, d)
            W = torch.fft.rfft(w.permute(1, 2, 0), n=n, dim=-1).permute(2, 0, 1).contiguous()  # (F, d, d)
            Y = torch.bmm(X, W).permute(1, 2, 0)                 # (B, d, F)
        else:                                                    # vectors (d, F) or scalars (F,)
            W = torch.fft.rfft(w.t(), n=n, dim=-1)
            Y = X * W                                            # (B, d, F)
        ctx.save_for_backward(X, W)
        return torch.fft.irfft(Y, n=n, dim=-1)[..., :t].transpose(1, 2)  # (B, t, d)

    @staticmethod
    def backward(ctx, g):                                        # g (B, t, d)
        X, W = ctx.saved_tensors
        t = g.shape[1]
        n = 2 * t
        G = torch.fft.rfft(g.transpose(1, 2), n=n, dim=-1)       # (B, d, F)
        dx = dw = None
        if W.dim() == 3:
            G = G.permute(2, 0, 1).contiguous()                  # (F, B, d)
            if ctx.needs_input_grad[0]:
                W_H = W.transpose(1, 2).conj().resolve_conj()    # conj resolved: MKL's fast path
                dX = torch.bmm(G, W_H).permute(1, 2, 0)          # (B, d, F)
                dx = torch.fft.irfft(dX, n=n, dim=-1)[..., :t].transpose(1, 2)
            if ctx.needs_input_grad[1]:
                X_H = X.conj().resolve_conj().transpose(1, 2)    # (F, d, B)
                dW = torch.bmm(X_H, G).permute(1, 2, 0)          # (d, d, F), summed over the batch
                dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t].permute(2, 0, 1)  # (t, d, d)
            return dx, dw
        if ctx.needs_input_grad[0]:
            dx = torch.fft.irfft(G * W.conj(), n=n, dim=-1)[..., :t].transpose(1, 2)  # (B, t, d)
        if ctx.needs_input_grad[1]:
            dW = (X.conj() * G).sum(0)                           # (d, F), summed over the batch
            if W.dim() == 1:
                dW = dW.sum(0)                                   # (F,), and over the features
            dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t]
            dw = dw.t() if dw.dim() == 2 else dw                 # (t, d) or (t,)
        return dx, dw


def causal_fir_cached(x, w, cache):
    """causal_fir for incremental decoding: x (B, t_new, d) are the newest positions; cache['x']
    keeps the earlier inputs. One new token costs O(t d) for vector or scalar taps and O(t d^2)
    for matrix taps, the paper's Tables 5 and 6."""
    past = cache.get("x")
    full = x if past is None else torch.cat([past, x], dim=1)       # (B, T, d)
    cache["x"] = full
    if past is None or x.shape[1] > 1:
        return causal_fir(full, w)[:, -x.shape[1]:]
    T = full.shape[1]
    taps = w[:T].flip(0)                     # taps[j] = w[T-1-j], the tap for position j
    if w.dim() == 3:
        y = torch.einsum("btd,tde->be", full, taps)                 # Eq. (23), one row
    elif w.dim() == 2:
        y = (full * taps).sum(1)                                    # Eq. (26)/(28), one row
    else:
        y = torch.einsum("btd,t->bd", full, taps)                   # Eq. (29), one row
    return y[:, None]                                               # (B, 1, d)


def _taps(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.01)  # Section 6: weights ~ N(0, 0.01)


# -----------------------------------------------------------------------------
# Token mixers: the first sublayer. Each maps X_in_sub1 (B, t, d) -> X_out_sub1 (B, t, d),
# causally, with no dropout inside. `cache` (a dict, or None) turns on incremental decoding:
# x then holds only the new positions and the mixer keeps what it needs from earlier calls.

class SelfAttention(nn.Module):
    """Multi-head causal self-attention, Eq. (10)-(17)."""
    uses_heads = True

    def __init__(self, cfg):
        super().__init__()
        d, self.n = cfg.n_embd, cfg.n_head
        self.W_QKV = nn.Linear(d, 3 * d, bias=False)   # W_j^[Q], W_j^[K], W_j^[V] of all heads
        self.W_out_att = nn.Linear(d, d, bias=False)   # W^[out_att]

    def forward(self, x, cache=None):
        B, t, d = x.shape
        h = d // self.n
        q, k, v = self.W_QKV(x).split(d, dim=2)                  # Eq. (10)-(12), (B, t, d) each
        q, k, v = (z.view(B, t, self.n, h).transpose(1, 2) for z in (q, k, v))  # (B, n, t, h)
        past = 0
        if cache is not None:                                    # a KV cache: Table 5's O(t d + d^2)
            if "k" in cache:
                past = cache["k"].shape[2]
                k = torch.cat([cache["k"], k], dim=2)            # (B, n, T, h)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        # Eq. (13)-(15): Z_j = Q_j K_j^T / sqrt(h); A_j = softmax of Z_j over the unmasked k <= i
        # (Eq. 14 with ERRATA's denominator); R_j = A_j V_j. One fused kernel computes all three.
        if past == 0:
            r = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # (B, n, t, h)
        elif t == 1:
            r = F.scaled_dot_product_attention(q, k, v)                      # last row: no mask
        else:
            T = past + t
            mask = torch.ones(t, T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            r = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        r = r.transpose(1, 2).reshape(B, t, d)                   # Eq. (16), concatenate heads
        return self.W_out_att(r)                                 # Eq. (17)


class SHE(nn.Module):
    """The super high-performance Extractor, Eq. (23)-(25)."""
    uses_heads = False

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.W_ext = _taps(l, d, d)                  # W_1^[ext] .. W_l^[ext]
        self.W_adj = nn.Linear(d, d, bias=False)     # W^[adj]
        self.W_out = nn.Linear(d, d, bias=False)     # W^[out]

    def forward(self, x, cache=None):
        if cache is None:
            x_ext = causal_fir(x, self.W_ext)                    # Eq. (23)
        else:
            x_ext = causal_fir_cached(x, self.W_ext, cache)      # Eq. (23), new rows
        x_adj = self.W_adj(x) * x_ext                            # Eq. (24)
        return self.W_out(x_adj)                                 # Eq. (25)


class HE(nn.Module):
    """The higher-performance Extractor, Eq. (27), (28), (24), (25)."""
    uses_heads = False

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.W_in_ext = nn.Linear(d, d, bias=False)  # W^[in_ext]
        self.w_ext = _taps(l, d)                     # w_1^[ext] .. w_l^[ext]
        self.W_adj = nn.Linear(d, d, bias=False)     # W^[adj]
        self.W_out = nn.Linear(d, d, bias=False)     # W^[out]

    def forward(self, x, cache=None):
        x_e = self.W_in_ext(x)                                   # Eq. (27), X^[ext]
        if cache is None:
            x_ext = causal_fir(x_e, self.w_ext)                  # Eq. (28)
        else:
            x_ext = causal_fir_cached(x_e, self.w_ext, cache)    # Eq. (28), new rows
        x_adj = self.W_adj(x) * x_ext                            # Eq. (24)
        return self.W_out(x_adj)                                 # Eq. (25)


class WE(nn.Module):
    """The worthwhile Extractor, Eq. (26), (24), (25)."""
    uses_heads = False

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.w_ext = _taps(l, d)                     # w_1^[ext] .. w_l^[ext]
        self.W_adj = nn.Linear(d, d, bias=False)     # W^[adj]
        self.W_out = nn.Linear(d, d, bias=False)     # W^[out]

    def forward(self, x, cache=None):
        if cache is None:
            x_ext = causal_fir(x, self.w_ext)                    # Eq. (26)
        else:
            x_ext = causal_fir_cached(x, self.w_ext, cache)      # Eq. (26), new rows
        x_adj = self.W_adj(x) * x_ext                            # Eq. (24)
        return self.W_out(x_adj)                                 # Eq. (25)


class ME(nn.Module):
    """The minimalist Extractor, Eq. (29): only the extraction, with scalar taps."""
    uses_heads = False

    def __init__(self, cfg):
        super().__init__()
        self.w_ext = _taps(cfg.block_size)           # w_1^[ext] .. w_l^[ext]

    def forward(self, x, cache=None):
        if cache is None:
            return causal_fir(x, self.w_ext)                     # Eq. (29)
        return causal_fir_cached(x, self.w_ext, cache)           # Eq. (29), new rows


class HEExtraction(nn.Module):
    """The extraction part of the HE alone, the variant named at the end of Section 5:
    Eq. (27) and (28), no adjustment (Eq. 24) and no output map (Eq. 25)."""
    uses_heads = False

    def __init__(self, cfg):
        super().__init__()
        l, d = cfg.block_size, cfg.n_embd
        self.W_in_ext = nn.Linear(d, d, bias=False)  # W^[in_ext]
        self.w_ext = _taps(l, d)                     # w_1^[ext] .. w_l^[ext]

    def forward(self, x, cache=None):
        x_e = self.W_in_ext(x)                                   # Eq. (27)
        if cache is None:
            return causal_fir(x_e, self.w_ext)                   # Eq. (28)
        return causal_fir_cached(x_e, self.w_ext, cache)         # Eq. (28), new rows


# -----------------------------------------------------------------------------
# The Synthesizer family (Tay et al., 2021): synthesized alignment matrices instead of Q K^T.
# Synthesizer equations are cited as `# Synthesizer Eq. (k)` (the Synthesizer paper, Tay et al.,
# ICML 2021, in ../shared/papers/), to tell them from this paper's `# Eq. (k)`. Each head j replaces
# Q_j K_j^T / sqrt(h) of Eq. (13) by synthesized logits S_j, masks them as Eq. (14) does, and keeps
# the values, concatenation and output map of Eq. (12), (15)-(17):
#     X_out_sub1 = (softmax(S_1) V_1, ..., softmax(S_n) V_n) W^[out_att],  V_j = X W_j^[V].
# Parameters that depend on the length (R, W_2, ...) are sized for l and sliced to the t rows and
# columns in use, as the Synthesizer paper's "On Parameters Depending on Sequence Length" says.
# Parameter counts follow its Table 1 and text; their "d" is the model's d:
#   Dense d^2 + d l for the whole sublayer: W_1 (d x d) gives head j h = d/n hidden units computed
#     from all of x_i (as W_Q (d x d) feeds the heads, Table 1's "Dot Product 2 d^2" row),
#     W_2 maps each head's h units to l logits (n h l = d l, "the Dense Synthesizer adds d x N");
#     no biases (Eq. (2) and Table 1 have none).
#   Factorized Dense d^2 + d (a + b);  Random n l^2 ("each head adds N^2");  Factorized Random
#     2 n l k ("for each head ... 2(Nk)");  Fixed Random 0 trainable;  mixtures add their parts
#     and 2n mixing weights.  W_V and W_out_att add 2 d^2 to every one.
# Cached decoding: cache['v'] (and cache['k'] for the +sa mixtures) hold the earlier positions; their
# number `past` is the absolute position of the first new token in the window, which picks the rows
# of the position-indexed matrices. A new token costs one row of logits plus the cached values.

SYN_RANK = 8  # k of the Factorized Random Synthesizer ("In practice, we use a small value of k = 8")


def _syn_factors(l):
    """Factorized Dense: a * b = l with a the largest divisor of l not above sqrt(l) (l = 128: 8 x 16)."""
    a = max(f for f in range(1, math.isqrt(l) + 1) if l % f == 0)
    return a, l // a


def _syn_cache(cache, name, z):
    """Append z (B, n, t, e) to cache[name] (no cache: skip); return all positions (B, n, T, e)."""
    if cache is None:
        return z
    if name in cache:
        z = torch.cat([cache[name], z], dim=2)
    cache[name] = z
    return z


def _syn_softmax(s, past):
    """Eq. (14) for synthesized logits: row i (absolute position past + i) keeps columns j <= past + i,
    normalises over them only. s (..., t, T) -> (..., t, T)."""
    t, T = s.shape[-2:]
    keep = torch.ones(t, T, dtype=torch.bool, device=s.device).tril(diagonal=past)
    return s.masked_fill(~keep, float("-inf")).softmax(dim=-1)      # Eq. (14)


def _syn_attend(q, k, v, past, bias=None):
    """softmax(q k^T + bias) v over the causal rows, Eq. (14), (15), by F.scaled_dot_product_attention
    (fused where the backend can; a float bias that needs a gradient runs torch's plain math on CPU),
    with no 1/sqrt scale: the caller scales. q (B, n, t, e), k (B, n, T, e), v (B, n, T, h), bias (n, t, T)."""
    t, T = q.shape[2], k.shape[2]
    if bias is None and past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)  # Eq. (14), (15)
    keep = torch.ones(t, T, dtype=torch.bool, device=q.device).tril(diagonal=past)
    if bias is not None:
        keep = bias.to(q.dtype).masked_fill(~keep, float("-inf"))   # additive float mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0)      # Eq. (14), (15)


def _syn_global(p, v):
    """p (n, t, T), one alignment per head shared by the batch, times v (B, n, T, h) -> (B, n, t, h):
    one (t x T) @ (T x B h) GEMM per head instead of B n small ones."""
    B, n, T, h = v.shape
    vv = v.permute(1, 2, 0, 3).reshape(n, T, B * h)             # (n, T, B h)
    return (p.to(v.dtype) @ vv).view(n, -1, B, h).permute(2, 0, 1, 3)  # Eq. (15), (B, n, t, h)


class _Synthesizer(nn.Module):
    """What every Synthesizer shares: values, cache, concatenation and output map. Subclasses
    define mix(x, v, past, cache) -> softmax(S) V for the new rows, (B, n, t, h)."""
    uses_heads = True

    def __init__(self, cfg):
        super().__init__()
        d, self.n, self.l = cfg.n_embd, cfg.n_head, cfg.block_size
        self.h = d // self.n
        self.W_V = nn.Linear(d, d, bias=False)         # G(X) = X W_j^[V] of all heads
        self.W_out_att = nn.Linear(d, d, bias=False)   # W^[out_att]

    def forward(self, x, cache=None):
        B, t, d = x.shape
        past = cache["v"].shape[2] if cache else 0                   # positions cached before x
        if past + t > self.l:
            raise ValueError(f"sequence length {past + t} exceeds block_size l={self.l}")
        v = self.heads(self.W_V(x))                                  # Eq. (12), (B, n, t, h)
        v = _syn_cache(cache, "v", v)                                # (B, n, T, h), T = past + t
        r = self.mix(x, v, past, cache)                              # Eq. (15), (B, n, t, h)
        r = r.transpose(1, 2).reshape(B, t, d)                       # Eq. (16), concatenate heads
        return self.W_out_att(r)                                     # Eq. (17)

    def heads(self, z):                                              # (B, t, d) -> (B, n, t, h)
        return z.view(z.shape[0], z.shape[1], self.n, self.h).transpose(1, 2)

    def mix(self, x, v, past, cache):
        """The input-independent Synthesizers: one (n, t, T) alignment for the whole batch."""
        return _syn_global(_syn_softmax(self.logits(past, v.shape[2]), past), v)

    def mixing_weights(self):
        w = self.alpha.softmax(dim=-1)   # alpha_{1,h}, alpha_{2,h} > 0, sum 1; zeros at init: 1/2 each
        return w[:, 0, None, None], w[:, 1, None, None]              # (n, 1, 1) each


class DenseSynthesizer(_Synthesizer):
    """Dense Synthesizer, Synthesizer Eq. (1)-(3)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.n_embd
        self.W_1 = nn.Linear(d, d, bias=False)         # W_{1,h} of all heads, h hidden units each
        self.W_2 = _taps(self.n, self.l, self.h)       # W_{2,h}: h -> l per head, stored (out, in)

    def hidden(self, x):
        return self.heads(F.relu(self.W_1(x)))                       # Synthesizer Eq. (2), (B, n, t, h)

    def keys(self, B, T):
        """B_i = W_2 hidden_i (Synthesizer Eq. (1), (2)) is a dot product of the hidden units with
        the rows of W_2 (l, h): they act as keys, so the fused attention kernel computes
        Synthesizer Eq. (3)."""
        return self.W_2[:, :T].expand(B, -1, -1, -1)                 # (B, n, T, h)

    def mix(self, x, v, past, cache):
        q = self.hidden(x)
        return _syn_attend(q, self.keys(x.shape[0], v.shape[2]), v, past)  # Synthesizer Eq. (1)-(3)


class FactorizedDenseSynthesizer(_Synthesizer):
    """Factorized Dense Synthesizer, Synthesizer Eq. (5), (6). The hidden layer is the Dense
    Synthesizer's (Table 1: d^2 + d (k_1 + k_2)); from it each head predicts a values A and b values
    B per token, a * b = l (_syn_factors). H_A repeats each A_u b times, H_B tiles B a times, so their
    product C_{i, u b + v} = A_{i,u} B_{i,v} is the outer product flattened: every one of the l
    positions gets its own pair (u, v), "to avoid having similar values within the same block"."""

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.n_embd
        self.a, self.b = _syn_factors(self.l)
        self.W_1 = nn.Linear(d, d, bias=False)         # as the Dense Synthesizer's W_{1,h}
        self.W_A = _taps(self.n, self.h, self.a)       # F_{A,h}: h -> a per head
        self.W_B = _taps(self.n, self.h, self.b)       # F_{B,h}: h -> b per head

    def mix(self, x, v, past, cache):
        hid = self.heads(F.relu(self.W_1(x)))                        # (B, n, t, h)
        A, B_ = hid @ self.W_A, hid @ self.W_B                       # Synthesizer Eq. (5), (B, n, t, a|b)
        C = (A[..., :, None] * B_[..., None, :]).flatten(-2)         # Synthesizer Eq. (6), (B, n, t, l)
        return _syn_softmax(C[..., : v.shape[2]], past) @ v          # Synthesizer Eq. (6)


class RandomSynthesizer(_Synthesizer):
    """Random Synthesizer, Synthesizer Eq. (4): a learned (l x l) R per head, the same for every input."""
    fixed = False

    def __init__(self, cfg):
        super().__init__(cfg)
        R = torch.randn(self.n, self.l, self.l) * 0.01   # R_h, N(0, 0.01) like every weight
        if self.fixed:
            self.register_buffer("R", R)   # in the state_dict, never in parameters(): not trained
        else:
            self.R = nn.Parameter(R)

    def logits(self, past, T):
        return self.R[:, past:T, :T]                                 # Synthesizer Eq. (4), (n, t, T)


class FixedRandomSynthesizer(RandomSynthesizer):
    """Fixed Random Synthesizer (Synthesizer Eq. (4), "kept fixed"): R is drawn at initialisation from
    the model's RNG and never trained; at N(0, 0.01) its rows are close to a uniform causal average."""
    fixed = True


class FactorizedRandomSynthesizer(_Synthesizer):
    """Factorized Random Synthesizer, Synthesizer Eq. (7): R = R_1 R_2^T of rank k = SYN_RANK."""

    def __init__(self, cfg, k=SYN_RANK):
        super().__init__(cfg)
        self.R_1 = _taps(self.n, self.l, k)            # R_{1,h}, (l, k) per head
        self.R_2 = _taps(self.n, self.l, k)            # R_{2,h}

    def logits(self, past, T):
        return self.R_1[:, past:T] @ self.R_2[:, :T].transpose(1, 2)  # Synthesizer Eq. (7), (n, t, T)


# Mixtures (Synthesizer Sec. 3.1, "Mixture of Synthesizers", unnumbered):
#     Y_h = softmax(alpha_{1,h} S_{1,h}(X) + alpha_{2,h} S_{2,h}(X)) G_h(X),  alpha_{1,h} + alpha_{2,h} = 1,
# alpha = softmax of a learned (n, 2) `alpha`, one pair per head (the paper's alpha_{i,h,l}), zeros
# at init. The dot-product part ("+V" in the paper, "+sa" here) is Eq. (13), Q_j K_j^T / sqrt(h).

class RandomDenseSynthesizer(DenseSynthesizer):
    """Random + Dense: alpha[:, 0] weighs R, alpha[:, 1] the Dense logits."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.R = _taps(self.n, self.l, self.l)          # Random's R_h
        self.alpha = nn.Parameter(torch.zeros(self.n, 2))

    def mix(self, x, v, past, cache):
        a_R, a_D = self.mixing_weights()
        q = a_D * self.hidden(x)                                     # alpha_D B_i: Synthesizer Eq. (1), (2)
        bias = a_R * self.R[:, past:v.shape[2], :v.shape[2]]         # alpha_R R: Synthesizer Eq. (4)
        return _syn_attend(q, self.keys(x.shape[0], v.shape[2]), v, past, bias)  # the mixture


class RandomSASynthesizer(_Synthesizer):
    """Random + dot-product attention: alpha[:, 0] weighs R, alpha[:, 1] Q K^T / sqrt(h)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.n_embd
        self.W_QK = nn.Linear(d, 2 * d, bias=False)    # W_j^[Q], W_j^[K] of all heads
        self.R = _taps(self.n, self.l, self.l)          # Random's R_h
        self.alpha = nn.Parameter(torch.zeros(self.n, 2))

    def mix(self, x, v, past, cache):
        a_R, a_SA = self.mixing_weights()
        q, k = (self.heads(z) for z in self.W_QK(x).chunk(2, dim=-1))  # Eq. (10), (11), (B, n, t, h)
        k = _syn_cache(cache, "k", k)                                  # (B, n, T, h)
        q = q * (a_SA / math.sqrt(self.h))                             # alpha_SA Q K^T / sqrt(h): Eq. (13)
        bias = a_R * self.R[:, past:v.shape[2], :v.shape[2]]           # alpha_R R: Synthesizer Eq. (4)
        return _syn_attend(q, k, v, past, bias)                        # the mixture


class DenseSASynthesizer(DenseSynthesizer):
    """Dense + dot-product attention: alpha[:, 0] weighs the Dense logits, alpha[:, 1] Q K^T / sqrt(h).
    Both are dot products, so one kernel takes the concatenated queries (alpha_SA Q / sqrt(h),
    alpha_D hidden) and keys (K, W_2)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.n_embd
        self.W_QK = nn.Linear(d, 2 * d, bias=False)    # W_j^[Q], W_j^[K] of all heads
        self.alpha = nn.Parameter(torch.zeros(self.n, 2))

    def mix(self, x, v, past, cache):
        a_D, a_SA = self.mixing_weights()
        q, k = (self.heads(z) for z in self.W_QK(x).chunk(2, dim=-1))  # Eq. (10), (11), (B, n, t, h)
        k = _syn_cache(cache, "k", k)                                  # (B, n, T, h)
        q = torch.cat([q * (a_SA / math.sqrt(self.h)), a_D * self.hidden(x)], dim=-1)  # (B, n, t, 2h)
        k = torch.cat([k, self.keys(x.shape[0], v.shape[2])], dim=-1)  # (B, n, T, 2h)
        return _syn_attend(q, k, v, past)   # alpha_SA Eq. (13) + alpha_D Synthesizer Eq. (1), (2): the mixture


MIXERS = {
    "sa": SelfAttention,
    "she": SHE,
    "he": HE,
    "we": WE,
    "me": ME,
    "he-ext": HEExtraction,
    "dense": DenseSynthesizer,
    "dense-fact": FactorizedDenseSynthesizer,
    "random": RandomSynthesizer,
    "random-fixed": FixedRandomSynthesizer,
    "random-fact": FactorizedRandomSynthesizer,
    "random+dense": RandomDenseSynthesizer,
    "random+sa": RandomSASynthesizer,
    "dense+sa": DenseSASynthesizer,
}


# -----------------------------------------------------------------------------
# The pre-LN Transformer, Eq. (3)-(22)

class FFN(nn.Module):
    """The second sublayer, Eq. (19)."""

    def __init__(self, cfg):
        super().__init__()
        self.sub2_1 = nn.Linear(cfg.n_embd, cfg.n_hidden)   # W^[sub2_1], b^[sub2_1]
        self.sub2_2 = nn.Linear(cfg.n_hidden, cfg.n_embd)   # W^[sub2_2], b^[sub2_2]

    def forward(self, x):
        return self.sub2_2(F.relu(self.sub2_1(x)))          # Eq. (19)


class Layer(nn.Module):
    """One layer, Eq. (9)-(20). Per ERRATA, Eq. (18) and (20) share one dropout draw of the first
    sublayer's output, which makes the layer the usual pre-LN residual block."""

    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)                  # g, b of Eq. (8) for Eq. (9)
        self.mixer = MIXERS[cfg.mixer](cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)                  # for Eq. (18)
        self.ffn = FFN(cfg)
        self.drop = nn.Dropout(cfg.dropout)                  # Eq. (6)

    def forward(self, x, cache=None):                        # x = X^[in_lay] (B, t, d)
        x_out_sub1 = self.mixer(self.ln1(x), cache)          # Eq. (9), then the mixer
        h = x + self.drop(x_out_sub1)                        # Eq. (18), inside the layernorm
        x_out_sub2 = self.ffn(self.ln2(h))                   # Eq. (18), (19)
        return h + self.drop(x_out_sub2)                     # Eq. (20)


class Transformer(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        u, l, d = cfg.vocab_size, cfg.block_size, cfg.n_embd
        self.emb_tok = nn.Embedding(u, d)                    # W^[emb_tok], Eq. (4)
        self.emb_pos = nn.Embedding(l, d)                    # W^[emb_pos], Eq. (5)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(d)                          # the pre-LN of Eq. (21)
        self.soft = nn.Linear(d, u)                          # W^[soft], b^[soft], no weight tying
        self.apply(_init_weights)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, t) token indices; targets (B, t) the next tokens, or None.
        Returns logits (B, t, u) and the loss of Eq. (3) (None without targets). With `cache`
        (from new_cache), idx holds only new tokens, placed after those already cached."""
        B, t = idx.shape
        past = 0 if cache is None else cache["t"]
        if past + t > self.cfg.block_size:
            raise ValueError(f"sequence length {past + t} exceeds block_size "
                             f"l={self.cfg.block_size}; crop the input to its last l tokens")
        pos = torch.arange(past, past + t, device=idx.device)
        scale = math.sqrt(self.cfg.n_embd)                   # Section 4: embeddings times sqrt(d)
        x = self.drop(self.emb_tok(idx) * scale + self.emb_pos(pos) * scale)  # Eq. (4), (5), (7)
        for i, layer in enumerate(self.layers):
            x = layer(x, None if cache is None else cache["layers"][i])       # Eq. (9)-(20)
        if cache is not None:
            cache["t"] = past + t
        logits = self.soft(self.ln_f(x))                     # Eq. (21) before the softmax, (B, t, u)
        loss = None
        if targets is not None:                              # Eq. (3): mean of -ln P-hat, Eq. (22)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def new_cache(self):
        return {"t": 0, "layers": [{} for _ in self.layers]}

    def param_counts(self):
        count = lambda mods: sum(p.numel() for m in mods for p in m.parameters())
        c = {
            "embeddings": count([self.emb_tok, self.emb_pos]),
            "mixers": count([layer.mixer for layer in self.layers]),
            "ffns": count([layer.ffn for layer in self.layers]),
            "norms_and_head": count([self.ln_f, self.soft]
                                    + [ln for layer in self.layers for ln in (layer.ln1, layer.ln2)]),
        }
        c["total"] = sum(c.values())
        return c

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True):
        """Append max_new_tokens sampled tokens to idx (B, t) and return it, as nanoGPT's does."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache))
        return torch.cat([idx] + new, dim=1)

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        use_cache=True):
        """Yield each new token (B, 1) as soon as it is sampled.

        With the cache (the default) a new token costs one row per layer (Tables 5 and 6). The
        absolute position embedding ties the cache to positions 0..l-1, so when the window is
        full the cache is rebuilt from the last l // 2 tokens and filling starts again: the
        model then conditions on between l/2 and l tokens. Without the cache every token is a
        full forward over the last l tokens (a sliding window, Eq. (2))."""
        l = self.cfg.block_size
        if use_cache:
            cache = self.new_cache()
            logits = self(idx[:, -l:], cache=cache)[0][:, -1]          # prefill, (B, u)
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -l:])[0][:, -1]                     # (B, u)
            nxt = sample_next(logits, temperature, top_k, top_p)         # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
            yield nxt
            if use_cache:
                if cache["t"] == l:                                      # window full: re-prefill
                    cache = self.new_cache()
                    logits = self(idx[:, -max(1, l // 2):], cache=cache)[0][:, -1]
                else:
                    logits = self(nxt, cache=cache)[0][:, -1]


def sample_next(logits, temperature=1.0, top_k=None, top_p=None):
    """logits (B, u) -> token (B, 1). temperature 0 is greedy; top_k keeps exactly the k most
    likely tokens; top_p keeps the smallest set of most likely tokens whose probability reaches
    p (nucleus sampling, the paper's Table 2 uses p = 0.6). Uses torch's global RNG."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        k = min(top_k, logits.size(-1))
        keep = logits.topk(k, dim=-1).indices                           # (B, k)
        logits = torch.full_like(logits, -math.inf).scatter(-1, keep, logits.gather(-1, keep))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)     # (B, u)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p             # mass before it already >= p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1)                      # (B, 1)


def _init_weights(module):
    """Section 6: weights ~ N(0, 0.01), biases zero. LayerNorm keeps gain 1, bias 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.01)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


# -----------------------------------------------------------------------------
# The paper's operation counts, Tables 3-6, in closed form (tests.py checks them against the
# tables' sums). `complexity_training` is for one sequence of length l; `complexity_inference`
# is the increment for one new token at sequence length t.

def complexity_training(d, l, n=1):
    """Tables 3 and 4: multiplications, additions, divisions, exponentiations, parameters."""
    return {
        "sa": dict(mult=l * l * d + 4 * l * d * d + l * d,
                   add=l * l * d + 4 * l * d * d - 4 * l * d - l * n,
                   div=n * l * l + n * l, exp=(n * l * l + n * l) // 2, params=4 * d * d),
        "she": dict(mult=(l * l * d * d + 5 * l * d * d) // 2 + l * d,
                    add=(l * l * d * d + 5 * l * d * d) // 2 - 3 * l * d,
                    div=0, exp=0, params=l * d * d + 2 * d * d),
        "he": dict(mult=(l * l * d + 3 * l * d) // 2 + 3 * l * d * d,
                   add=3 * l * d * d + (l * l * d - 7 * l * d) // 2,
                   div=0, exp=0, params=l * d + 3 * d * d),
        "we": dict(mult=(l * l * d + 3 * l * d) // 2 + 2 * l * d * d,
                   add=2 * l * d * d + (l * l * d - 5 * l * d) // 2,
                   div=0, exp=0, params=l * d + 2 * d * d),
        "me": dict(mult=(l * l * d + l * d) // 2, add=(l * l * d - l * d) // 2,
                   div=0, exp=0, params=l),
    }


def complexity_inference(d, t, n=1):
    """Tables 5 and 6: the increment for one new token at sequence length t."""
    return {
        "sa": dict(mult=2 * t * d + 4 * d * d, add=2 * t * d - t * n + t + 4 * d * d - 5 * d - 1,
                   div=2 * t * n, exp=t * n),
        "she": dict(mult=t * d * d + 2 * d * d + d, add=t * d * d + 2 * d * d - 3 * d, div=0, exp=0),
        "he": dict(mult=t * d + 3 * d * d + d, add=t * d + 3 * d * d - 4 * d, div=0, exp=0),
        "we": dict(mult=t * d + 2 * d * d + d, add=t * d + 2 * d * d - 3 * d, div=0, exp=0),
        "me": dict(mult=t * d, add=t * d - d, div=0, exp=0),
    }


def table7(d=128, l=128):
    """Table 7's columns: (label, mixer, n) -> counts with 'total' arithmetic operations."""
    cols = [("1-head SA", "sa", 1), ("32-head SA", "sa", 32), ("SHE", "she", 1),
            ("HE", "he", 1), ("WE", "we", 1), ("ME", "me", 1)]
    out = {}
    for label, mixer, n in cols:
        c = dict(complexity_training(d, l, n)[mixer])
        c["total"] = c["mult"] + c["add"] + c["div"] + c["exp"]
        out[label] = (mixer, n, c)
    return out


def mixer_param_count(mixer, d, l, n=1):
    """Parameters of one sublayer built from the module itself (no biases exist in any mixer)."""
    module = MIXERS[mixer](Config(n_embd=d, block_size=l, n_head=n, mixer=mixer))
    return sum(p.numel() for p in module.parameters())


if __name__ == "__main__":
    rows = ["mult", "add", "div", "exp", "params", "total"]
    cols = table7()
    print("Table 7 (d = l = 128): the paper's formulas, and the parameters counted from the modules")
    print(f"{'':>8}" + "".join(f"{label:>14}" for label in cols))
    for r in rows:
        print(f"{r:>8}" + "".join(f"{c[r]:>14,}" for _, _, c in cols.values()))
    print(f"{'modules':>8}" + "".join(f"{mixer_param_count(m, 128, 128, n):>14,}"
                                       for m, n, _ in cols.values()))
