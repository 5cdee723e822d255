"""
The Synthesizer family (Tay et al., "Synthesizer: Rethinking Self-Attention for
Transformer Models", ICML 2021, arXiv:2005.00743) as further drop-in token mixers:
synthesized alignment matrices instead of Q K^T, named in SYNTHESIZERS (at the end).
It stands on torch alone; extractor.find_mixer finds its mixers by these names.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Synthesizer equations are cited as `# Synthesizer Eq. (k)`, the Extractors paper's
# (its self-attention, reused here) as `# Eq. (k)`. Each head j replaces Q_j K_j^T /
# sqrt(h) of Eq. (13) by synthesized logits S_j, masks them as Eq. (14) does, and keeps
# the values, concatenation and output map of Eq. (12), (15)-(17): X_out_sub1 =
# (softmax(S_1) V_1, ..., softmax(S_n) V_n) W^[out_att],  V_j = X W_j^[V]. Parameters
# that depend on the length (R, W_2, ...) are sized for l and sliced to the t rows and
# columns in use (the Synthesizer paper's "On Parameters Depending on Sequence Length").
# Parameter counts follow its Table 1 and text, its "d" the model's d: Dense d^2 + d l
# for the whole sublayer: W_1 (d x d) gives head j h = d/n hidden units from all of x_i
# (as W_Q (d x d) feeds the heads, Table 1's "Dot Product 2 d^2" row), W_2 maps each
# head's h units to l logits (n h l = d l, "the Dense Synthesizer adds d x N"); no
# biases (Eq. (2) and Table 1 have none). Factorized Dense d^2 + d (a + b);  Random n
# l^2 ("each head adds N^2");  Factorized Random 2 n l k ("for each head ... 2(Nk)");
# Fixed Random 0 trainable;  mixtures add their parts and 2n mixing weights.  W_V and
# W_out_att add 2 d^2 to every one. Cached decoding: cache['v'] (and cache['k'] for the
# +sa mixtures) holds the earlier positions; their number `past`, the absolute position
# of the first new token in the window, picks the rows of the position-indexed matrices.
# A new token costs one row of logits plus the cached values.

# k of the Factorized Random Synthesizer ("In practice, we use a small value of k = 8")
SYN_RANK = 8


def normal_weight(*shape):
    """A weight drawn N(0, 0.01²), as the Extractors paper's Section 6 draws every one
    (extractor.INIT_STD): the Synthesizers train here on the same footing."""
    return nn.Parameter(torch.randn(*shape) * 0.01)


def check_heads(cfg):
    """A ValueError unless the heads divide d: each head has h = d/n features."""
    if cfg.n_embd % cfg.n_head:
        raise ValueError(
            f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd} for mixer "
            f"{cfg.mixer!r} (each head has d/n features)"
        )


def _syn_factors(l):
    """Factorized Dense: a * b = l with a the largest divisor of l not above sqrt(l)
    (l = 128: 8 x 16). A prime l (only 1 x l, no factors): a ValueError."""
    a = max(f for f in range(1, math.isqrt(l) + 1) if l % f == 0)
    if a == 1 < l:
        raise ValueError(
            f"dense-fact needs block_size l = a b with a, b > 1, "
            f"but l={l} is prime: try block_size={max(4, l + 1)}"
        )
    return a, l // a


def _syn_cache(cache, name, z):
    """z (B, n, t, e) appended to cache[name] (if any): all positions (B, n, T, e)."""
    if cache is None:
        return z
    if name in cache:
        z = torch.cat([cache[name], z], dim=2)
    cache[name] = z
    return z


def _syn_softmax(s, past):
    """Eq. (14) for synthesized logits: row i (absolute position past + i) keeps
    columns j <= past + i, normalises over them only. s (..., t, T) -> (..., t, T)."""
    keep = s.new_ones(s.shape[-2:], dtype=torch.bool).tril(past)
    return s.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # Eq. (14)


def _syn_attend(q, k, v, past, bias=None):
    """softmax(q k^T + bias) v over the causal rows, Eq. (14), (15), by torch's fused
    attention, unscaled (the caller scales): q (B, n, t, e), k (B, n, T, e), v (B, n, T,
    h), bias (n, t, T); a float bias needing a gradient runs plain math on the CPU."""
    if bias is None and past == 0:
        # Eq. (14), (15)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    keep = q.new_ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(past)
    if bias is not None:
        keep = bias.to(q.dtype).masked_fill(~keep, float("-inf"))  # additive float mask
    # Eq. (14), (15)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0)


class _Synthesizer(nn.Module):
    """What every Synthesizer shares: values, cache, concatenation and output map.
    Subclasses define mix(x, v, past, cache) -> softmax(S) V, new rows (B, n, t, h)."""

    def __init__(self, cfg):
        super().__init__()
        check_heads(cfg)
        self.d, self.n, self.l = cfg.n_embd, cfg.n_head, cfg.block_size
        self.h = self.d // self.n
        self.W_V = nn.Linear(self.d, self.d, bias=False)  # G(X) = X W_j^[V], all heads
        self.W_out_att = nn.Linear(self.d, self.d, bias=False)  # W^[out_att]

    def forward(self, x, cache=None):
        B, t, d = x.shape
        past = cache["v"].shape[2] if cache else 0  # positions cached before x
        T = past + t
        if T > self.l:
            raise ValueError(f"sequence length {T} exceeds block_size l={self.l}")
        v = _syn_cache(cache, "v", self.heads(self.W_V(x)))  # Eq. (12), (B, n, T, h)
        r = self.mix(x, v, past, cache)  # Eq. (15), (B, n, t, h)
        return self.W_out_att(r.transpose(1, 2).reshape(B, t, d))  # Eq. (16), (17)

    def heads(self, z):  # (B, t, d) -> (B, n, t, h)
        return z.view(z.shape[0], z.shape[1], self.n, self.h).transpose(1, 2)

    def mix(self, x, v, past, cache):
        """Input-independent Synthesizers: one (n, t, T) alignment for the whole batch,
        times v (B, n, T, h) as one (t x T) @ (T x B h) GEMM a head, not B n small."""
        B, n, T, h = v.shape
        p = _syn_softmax(self.logits(past, T), past)  # (n, t, T)
        vv = v.permute(1, 2, 0, 3).reshape(n, T, B * h)  # (n, T, B h)
        # Eq. (15), (B, n, t, h)
        return (p.to(v.dtype) @ vv).view(n, -1, B, h).permute(2, 0, 1, 3)

    # +sa mixtures: alpha_SA Q / sqrt(h) (B, n, t, h), K (B, n, T, h)
    def scaled_qk(self, x, cache, a_SA):
        q, k = (self.heads(z) for z in self.W_QK(x).chunk(2, dim=-1))  # Eq. (10), (11)
        return q * (a_SA / math.sqrt(self.h)), _syn_cache(cache, "k", k)  # Eq. (13)

    def mixing_weights(self):
        # alpha_{1,h}, alpha_{2,h} > 0, sum 1; zeros at init: 1/2 each
        w = self.alpha.softmax(dim=-1)
        return w[:, 0, None, None], w[:, 1, None, None]  # (n, 1, 1) each


class DenseSynthesizer(_Synthesizer):
    """Dense Synthesizer, Synthesizer Eq. (1)-(3)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.W_1 = nn.Linear(self.d, self.d, bias=False)  # W_{1,h}, h units per head
        self.W_2 = normal_weight(self.n, self.l, self.h)  # W_{2,h} (out, in): h -> l

    def hidden(self, x):
        return self.heads(F.relu(self.W_1(x)))  # Synthesizer Eq. (2), (B, n, t, h)

    def keys(self, B, T):
        """B_i = W_2 hidden_i (Synthesizer Eq. (1), (2)): the rows of W_2 (l, h) act as
        keys, so the fused attention kernel computes Synthesizer Eq. (3)."""
        return self.W_2[:, :T].expand(B, -1, -1, -1)  # (B, n, T, h)

    def mix(self, x, v, past, cache):  # Synthesizer Eq. (1)-(3)
        return _syn_attend(self.hidden(x), self.keys(x.shape[0], v.shape[2]), v, past)


class FactorizedDenseSynthesizer(_Synthesizer):
    """Factorized Dense Synthesizer, Synthesizer Eq. (5), (6). The hidden layer is the
    Dense Synthesizer's (Table 1: d^2 + d (k_1 + k_2)); from it each head predicts a
    values A and b values B per token, a * b = l (_syn_factors). H_A repeats each A_u b
    times, H_B tiles B a times, so their product C_{i, u b + v} = A_{i,u} B_{i,v} is the
    outer product flattened: every one of the l positions gets its own pair (u, v), "to
    avoid having similar values within the same block"."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.a, self.b = _syn_factors(self.l)
        self.W_1 = nn.Linear(self.d, self.d, bias=False)  # the Dense one's W_{1,h}
        self.W_A = normal_weight(self.n, self.h, self.a)  # F_{A,h}: h -> a per head
        self.W_B = normal_weight(self.n, self.h, self.b)  # F_{B,h}: h -> b per head

    def mix(self, x, v, past, cache):
        hid = self.heads(F.relu(self.W_1(x)))  # (B, n, t, h)
        A, B_ = hid @ self.W_A, hid @ self.W_B  # Synthesizer Eq. (5), (B, n, t, a|b)
        # Synthesizer Eq. (6), (B, n, t, l)
        C = (A[..., :, None] * B_[..., None, :]).flatten(-2)
        return _syn_softmax(C[..., : v.shape[2]], past) @ v  # Synthesizer Eq. (6)


class RandomSynthesizer(_Synthesizer):
    """Random Synthesizer, Synthesizer Eq. (4): a learned (l x l) R per head, the same
    for every input (normal_weight)."""

    fixed = False

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.fixed:
            # R_h ~ N(0, 1), in the state_dict, never in parameters(): not trained
            self.register_buffer("R", torch.randn(self.n, self.l, self.l))
        else:
            self.R = normal_weight(self.n, self.l, self.l)  # R_h

    def logits(self, past, T):
        return self.R[:, past:T, :T]  # Synthesizer Eq. (4), (n, t, T)


class FixedRandomSynthesizer(RandomSynthesizer):
    """Fixed Random Synthesizer (Synthesizer Eq. (4), "kept fixed"): R is drawn once
    from the model's RNG and never trained. Its logits are N(0, 1), not the trained
    Random's N(0, 0.01²): at 0.01 softmax(R) would be a uniform causal average to within
    about 1%, a running mean, not the random alignment the Synthesizer paper tests. At
    l = 128 the rows' mean entropy is 3.43 nats against the uniform rows' 3.88 (N(0,
    0.01²): 3.878), the last row's largest weight 0.071 against 1/l = 0.0078."""

    fixed = True


class FactorizedRandomSynthesizer(_Synthesizer):
    """Factorized Random Synthesizer, Synthesizer Eq. (7): R = R_1 R_2^T of rank k."""

    def __init__(self, cfg, k=SYN_RANK):
        super().__init__(cfg)
        self.R_1 = normal_weight(self.n, self.l, k)  # R_{1,h}, (l, k) per head
        self.R_2 = normal_weight(self.n, self.l, k)  # R_{2,h}

    def logits(self, past, T):
        # Synthesizer Eq. (7), (n, t, T)
        return self.R_1[:, past:T] @ self.R_2[:, :T].transpose(1, 2)


# Mixtures (Synthesizer Sec. 3.1, "Mixture of Synthesizers", unnumbered): Y_h =
# softmax(alpha_{1,h} S_{1,h}(X) + alpha_{2,h} S_{2,h}(X)) G_h(X),  alpha_{1,h} +
# alpha_{2,h} = 1: the softmax of a learned (n, 2) `alpha`, a pair per head (the paper's
# alpha_{i,h,l}); the dot-product part (the paper's "+V", "+sa" here) is Eq. (13).


class RandomDenseSynthesizer(DenseSynthesizer):
    """Random + Dense: alpha[:, 0] weighs R, alpha[:, 1] the Dense logits."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.R = normal_weight(self.n, self.l, self.l)  # Random's R_h
        self.alpha = nn.Parameter(torch.zeros(self.n, 2))

    def mix(self, x, v, past, cache):
        a_R, a_D = self.mixing_weights()
        q = a_D * self.hidden(x)  # alpha_D B_i: Synthesizer Eq. (1), (2)
        T = v.shape[2]
        bias = a_R * self.R[:, past:T, :T]  # alpha_R R: Synthesizer Eq. (4)
        return _syn_attend(q, self.keys(x.shape[0], T), v, past, bias)  # the mixture


class RandomSASynthesizer(_Synthesizer):
    """Random + dot product: alpha[:, 0] weighs R, alpha[:, 1] Q K^T / sqrt(h)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.W_QK = nn.Linear(self.d, 2 * self.d, bias=False)  # all W_j^[Q], W_j^[K]
        self.R = normal_weight(self.n, self.l, self.l)  # Random's R_h
        self.alpha = nn.Parameter(torch.zeros(self.n, 2))

    def mix(self, x, v, past, cache):
        a_R, a_SA = self.mixing_weights()
        q, k = self.scaled_qk(x, cache, a_SA)  # alpha_SA Q K^T / sqrt(h): Eq. (13)
        T = v.shape[2]
        bias = a_R * self.R[:, past:T, :T]  # alpha_R R: Synthesizer Eq. (4)
        return _syn_attend(q, k, v, past, bias)  # the mixture


class DenseSASynthesizer(DenseSynthesizer):
    """Dense + dot-product attention: alpha[:, 0] weighs the Dense logits, alpha[:, 1] Q
    K^T / sqrt(h). Both are dot products, so one kernel takes the concatenated queries
    (alpha_SA Q / sqrt(h), alpha_D hidden) and keys (K, W_2)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.W_QK = nn.Linear(self.d, 2 * self.d, bias=False)  # all W_j^[Q], W_j^[K]
        self.alpha = nn.Parameter(torch.zeros(self.n, 2))

    def mix(self, x, v, past, cache):
        a_D, a_SA = self.mixing_weights()
        q, k = self.scaled_qk(x, cache, a_SA)  # alpha_SA Q K^T / sqrt(h): Eq. (13)
        q = torch.cat([q, a_D * self.hidden(x)], dim=-1)  # (B, n, t, 2h)
        k = torch.cat([k, self.keys(x.shape[0], v.shape[2])], dim=-1)  # (B, n, T, 2h)
        # the mixture: alpha_SA Eq. (13) + alpha_D Synthesizer Eq. (1), (2)
        return _syn_attend(q, k, v, past)


SYNTHESIZERS = {  # the --mixer names
    "dense": DenseSynthesizer,
    "dense-fact": FactorizedDenseSynthesizer,
    "random": RandomSynthesizer,
    "random-fixed": FixedRandomSynthesizer,
    "random-fact": FactorizedRandomSynthesizer,
    "random+dense": RandomDenseSynthesizer,
    "random+sa": RandomSASynthesizer,
    "dense+sa": DenseSASynthesizer,
}
