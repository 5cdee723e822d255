"""
How causal_fir is computed fast. The four Extractors of extractor.py share one operation, a causal
FIR filter along time, Eq. (23), (26), (28), (29):

    y_i = sum_{j <= i} x_j (*) w_{i-j+1}        x (B, t, d); taps w (l, d, d), (l, d) or (l,)

where (*) is x_j @ W for SHE's matrix taps, x_j o w for WE's and HE's vector taps and x_j w for ME's
scalar taps. extractor.causal_fir_reference writes it as that double sum: t(t+1)/2 products, one
Python step each. This file computes the same numbers, and tests.py checks every path against the
reference in float64, forward and backward.

Two entries, called by extractor.causal_fir:
    fir_full(x, w)      the whole sequence, (B, t, d) -> (B, t, d); it picks the path
    fir_last_row(x, w)  only the newest position, (B, t, d) -> (B, d): one token of generation

The paths of fir_full:
    scalar taps, t < FFT_MIN_T_SCALAR  toeplitz: the sum is one lower-triangular (t x t) matrix of
                                       the taps times X, a single GEMM: t^2 d multiply-adds, yet
                                       faster than the FFT below t ~ 1024 (measured on the CPU)
    everything else                    FIRFFT: a convolution is a product in frequency space, so an
                                       rfft, a product per frequency and an irfft: O(t log t) per
                                       channel instead of O(t^2), with a hand-written backward
A device's own path (another layout, another kernel) goes into fir_full beside these, with a test
against the reference; extractor.py does not change.
"""

import torch

FFT_MIN_T_SCALAR = 1024  # scalar taps (ME): one Toeplitz GEMM below this t, the FFT from here on


def fir_full(x, w):
    """The filter over the whole sequence: x (B, t, d), taps w (l, ...) with l >= t -> (B, t, d).
    Only the first t taps are used. The FFTs run in float32 also under autocast (float64 stays
    float64); the result comes back in the input's dtype."""
    t = x.shape[1]
    if t > w.shape[0]:
        raise ValueError(f"sequence length {t} exceeds the {w.shape[0]} taps (block_size l)")
    w = w[:t]
    if w.dim() == 1 and t < FFT_MIN_T_SCALAR:
        return toeplitz(w).to(x.dtype) @ x  # (t, t) @ (B, t, d) -> (B, t, d)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        return FIRFFT.apply(x.to(dtype), w.to(dtype)).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Scalar taps, short sequences: the sum as one matrix product


def toeplitz(w):
    """(t,) taps -> (t, t) lower-triangular Toeplitz matrix T[i, j] = w[i - j] for j <= i."""
    t = w.shape[0]
    k = torch.arange(t, device=w.device)
    lag = k[:, None] - k[None, :]  # (t, t), i - j
    return torch.where(lag >= 0, w[lag.clamp(min=0)], w.new_zeros(()))  # (t, t)


# ----------------------------------------------------------------------------------------------------
# Everything else: products in frequency space. Zero-padded to n >= 2t - 1 points, the circular
# convolution that the FFT computes equals the linear one (nothing wraps around). Autograd's own
# backward of rfft builds full complex spectra: 1.4-1.6x slower than FIRFFT's hand-written one.


def fft_size(t):
    """The smallest n >= 2t - 1 with no prime factor above 5: FFTs of such lengths are fast,
    while n = 2t can be slow: t = 127 gives 254 = 2 * 127, and 2.1x the time of t = 128 (measured)."""
    if t < 1:
        raise ValueError(f"an FFT over {t} positions: the sequence needs at least one")
    n = 2 * t - 1
    while True:
        m = n
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        if m == 1:
            return n
        n += 1


class FIRFFT(torch.autograd.Function):
    """fir_full through rfft/irfft along the last (time) axis. The backward reuses the saved
    spectra: dx = irfft(G W^H), dw = irfft(sum over the batch of X^H G), correlations, exact since
    n >= 2t - 1. SHE's matrix taps are a (d x d) complex product per frequency, in (F, B, d) layout:
    MKL's batched complex GEMM is 2.5-3.5x slower on rfft's own layout or a lazily conjugated operand."""

    @staticmethod
    def forward(ctx, x, w):  # x (B, t, d), w (t, ...)
        t = x.shape[1]
        n = fft_size(t)
        X = torch.fft.rfft(x.transpose(1, 2), n=n, dim=-1)  # (B, d, F), F = n // 2 + 1
        if w.dim() == 3:  # matrices
            X = X.permute(2, 0, 1).contiguous()  # (F, B, d)
            W = torch.fft.rfft(w.permute(1, 2, 0), n=n, dim=-1).permute(2, 0, 1).contiguous()  # (F, d, d)
            Y = torch.bmm(X, W).permute(1, 2, 0)  # (B, d, F)
        else:  # vectors (d, F) or scalars (F,)
            W = torch.fft.rfft(w.t(), n=n, dim=-1)
            Y = X * W  # (B, d, F)
        ctx.save_for_backward(X, W)
        return torch.fft.irfft(Y, n=n, dim=-1)[..., :t].transpose(1, 2)  # (B, t, d)

    @staticmethod
    def backward(ctx, g):  # g (B, t, d)
        X, W = ctx.saved_tensors
        t = g.shape[1]
        n = fft_size(t)
        G = torch.fft.rfft(g.transpose(1, 2), n=n, dim=-1)  # (B, d, F)
        dx = dw = None
        if W.dim() == 3:
            G = G.permute(2, 0, 1).contiguous()  # (F, B, d)
            if ctx.needs_input_grad[0]:
                W_H = W.transpose(1, 2).conj().resolve_conj()  # conj resolved: MKL's fast path
                dX = torch.bmm(G, W_H).permute(1, 2, 0)  # (B, d, F)
                dx = torch.fft.irfft(dX, n=n, dim=-1)[..., :t].transpose(1, 2)
            if ctx.needs_input_grad[1]:
                X_H = X.conj().resolve_conj().transpose(1, 2)  # (F, d, B)
                dW = torch.bmm(X_H, G).permute(1, 2, 0)  # (d, d, F), summed over the batch
                dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t].permute(2, 0, 1)  # (t, d, d)
            return dx, dw
        if ctx.needs_input_grad[0]:
            dx = torch.fft.irfft(G * W.conj(), n=n, dim=-1)[..., :t].transpose(1, 2)  # (B, t, d)
        if ctx.needs_input_grad[1]:
            dW = (X.conj() * G).sum(0)  # (d, F), summed over the batch
            if W.dim() == 1:
                dW = dW.sum(0)  # (F,), and over the features
            dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t]
            dw = dw.t() if dw.dim() == 2 else dw  # (t, d) or (t,)
        return dx, dw


# ----------------------------------------------------------------------------------------------------
# Generation: one new token needs only the last row of the sum, O(t d) for vector or scalar taps and
# O(t d^2) for matrix taps (Tables 5 and 6), a direct product with no FFT


def fir_last_row(x, w):
    """Row t-1 of the sum for x (B, t, d): the newest token's output, (B, d)."""
    x_back = x.flip(1)  # x_back[:, k] is the token k steps back, which meets tap k
    w = w[: x.shape[1]]
    if w.dim() == 3:
        return torch.einsum("btd,tde->be", x_back, w.to(x.dtype))  # Eq. (23), one row
    if w.dim() == 2:
        return (x_back * w.to(x.dtype)).sum(1)  # Eq. (26), (28), one row
    return torch.einsum("btd,t->bd", x_back, w.to(x.dtype))  # Eq. (29), one row
