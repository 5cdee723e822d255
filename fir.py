"""
How causal_fir is computed fast. The four Extractors of extractor.py share one operation, a causal
FIR filter along time, Eq. (23), (26), (28), (29):

    y_i = sum_{j <= i} x_j (*) w_{i-j+1}        x (B, t, d); taps w (l, d, d), (l, d) or (l,)

where (*) is x_j @ W for SHE's matrix taps, x_j o w for WE's and HE's vector taps and x_j w for ME's
scalar taps. extractor.causal_fir_reference writes it as that double sum: t(t+1)/2 products, one
Python step each. This file computes the same numbers, and tests.py checks every path against the
reference in float64, forward and backward.

Two entries, called by extractor.causal_fir:
    fir_full(x, w)      the whole sequence, (B, t, d) -> (B, t, d); default_path picks the path
    fir_last_row(x, w)  only the newest position, (B, t, d) -> (B, d): one token of generation

The paths of fir_full (PATHS: the taps each computes), and where each is the default:
    toeplitz          scalar taps, t < FFT_MIN_T_SCALAR, CPU (and MPS): the sum is one lower-triangular
                      (t x t) matrix of the taps times X, a single GEMM: t^2 d multiply-adds, yet faster
                      than the FFT below t ~ 1024 (measured on the CPU). The matrix is gathered through
                      an index tensor, and its gradient scattered back (index_put: a sort on CUDA)
    toeplitz-strided  the same product on CUDA: scalar taps t < FFT_MIN_T_SCALAR, and vector taps at
                      t <= CUDA_TOEPLITZ_MAX_T_VECTOR (one matrix per channel). The matrix is a sliding
                      window over the zero-padded taps (a view) made contiguous by one flip; its gradient
                      is the sums along the diagonals of dT, read through a strided view: no index tensor,
                      no scatter. Scalar taps: one batched GEMM whose batch stride over T is 0, no copy
    fft               everything else: a convolution is a product in frequency space, so an rfft, a
                      product per frequency and an irfft, O(t log t) per channel instead of O(t^2), with
                      a hand-written backward; the layout suits MKL (see FIRFFT)
    fft-cuda          matrix taps (SHE) on CUDA: the same transforms, but the conjugates of the backward go
                      to cuBLAS as its conjugate-transpose flag (two copies fewer, 25 MB at Table 1 shapes)
                      and each irfft runs over the products' own (F, B, d) layout
What did not change for CUDA, and why: torch's cuFFT wrapper folds the batch axes into one by
reshaping, so an rfft along the time axis of a (B, t, d) tensor copies it to time-last first; the
transposes before the rffts are that copy, made explicitly. It writes the spectrum time-last, so the
per-frequency bmm needs its (F, B, d) copy (cuBLAS wants a unit stride inside each matrix); and an irfft
always copies its input first (cuFFT's c2r overwrites it).

TF32 (the suspected cause of SHE's gap in issue 40, under test, not a finding): train.py lets CUDA's
float32 matmuls run in TF32 (10-bit mantissa). cuBLAS's TF32 mode covers complex64 GEMM too, so SHE's
per-frequency products would see inputs rounded to 10 bits, in forward and both gradients. Here every
GEMM of the toeplitz-strided, fft and fft-cuda paths runs in IEEE float32 whatever the global setting
(ieee_float32); ALLOW_TF32 = True lets them follow it again, as before, to reproduce the gap.
"""

import contextlib

import torch
import torch.nn.functional as F

FFT_MIN_T_SCALAR = 1024  # scalar taps (ME): one Toeplitz GEMM below this t, the FFT from here on
CUDA_TOEPLITZ_MAX_T_VECTOR = 0  # vector taps on CUDA: toeplitz-strided up to this t, else the FFT (0:
# never, until bench.py section 1 on a GPU shows it faster at t = l = 128)
ALLOW_TF32 = False  # True: the FIR's GEMMs follow allow_tf32 again (issue 40's diagnosis; see TF32)
PATHS = {"toeplitz": (1,), "toeplitz-strided": (1, 2), "fft": (1, 2, 3), "fft-cuda": (3,)}  # w.dim()s
_forced = None  # the path every fir_full call takes inside forcing()


def default_path(device_type, taps_dim, t):
    """The path fir_full takes on this device type for taps with taps_dim axes (1 scalars, 2 vectors,
    3 matrices) over t positions. The CPU and MPS take the paths measured on the CPU. The dtype plays no
    part: no measurement has yet shown a reason for it to."""
    if device_type == "cuda":
        if taps_dim == 3:
            return "fft-cuda"
        limit = FFT_MIN_T_SCALAR - 1 if taps_dim == 1 else CUDA_TOEPLITZ_MAX_T_VECTOR
        return "toeplitz-strided" if t <= limit else "fft"
    return "toeplitz" if taps_dim == 1 and t < FFT_MIN_T_SCALAR else "fft"


@contextlib.contextmanager
def forcing(path):
    """Every fir_full call inside takes this path (bench.py times each path through the mixers)."""
    global _forced
    if path not in PATHS:
        raise ValueError(f"no FIR path {path!r}; the paths are {', '.join(PATHS)}")
    before, _forced = _forced, path
    try:
        yield
    finally:
        _forced = before


def fir_full(x, w, path=None):
    """The filter over the whole sequence: x (B, t, d), taps w (l, ...) with l >= t -> (B, t, d).
    Only the first t taps are used. path: one of PATHS, else forcing()'s or default_path's. Apart from
    toeplitz (which follows autocast), the products run in float32 also under autocast (float64 stays
    float64); the result comes back in the input's dtype."""
    t = x.shape[1]
    if t > w.shape[0]:
        raise ValueError(f"sequence length {t} exceeds the {w.shape[0]} taps (block_size l)")
    w = w[:t]
    path = path or _forced or default_path(x.device.type, w.dim(), t)
    if w.dim() not in PATHS.get(path, ()):
        raise ValueError(
            f"no FIR path {path!r} for taps of shape {tuple(w.shape)}; paths: taps' dims {PATHS}"
        )
    if path == "toeplitz":
        return toeplitz(w).to(x.dtype) @ x  # Eq. (29): (t, t) @ (B, t, d) -> (B, t, d)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        if path == "toeplitz-strided":
            return ToeplitzStrided.apply(x.to(dtype), w.to(dtype)).to(x.dtype)
        return FIRFFT.apply(x.to(dtype), w.to(dtype), path == "fft-cuda").to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# TF32: the FIR's GEMMs in IEEE float32 on CUDA


@contextlib.contextmanager
def ieee_float32(device):
    """Inside, CUDA's float32 (and complex64) GEMMs run in IEEE float32 even where train.py turned TF32
    on; restored after. Nothing changes on other devices or with ALLOW_TF32. The switch goes through
    the same flag train.py sets, allow_tf32, which keeps PyTorch's old and new precision settings in
    step; fp32_precision is read because it answers under either API (allow_tf32 raises after a mix)."""
    tf32 = device.type == "cuda" and not ALLOW_TF32 and torch.backends.cuda.matmul.fp32_precision == "tf32"
    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        if tf32:
            torch.backends.cuda.matmul.allow_tf32 = True


# ----------------------------------------------------------------------------------------------------
# Short sequences: the sum as a Toeplitz matrix times X (scalar taps; on CUDA vector taps too, per channel)


def toeplitz(w):
    """(t,) taps -> (t, t) lower-triangular Toeplitz matrix T[i, j] = w[i - j] for j <= i."""
    t = w.shape[0]
    k = torch.arange(t, device=w.device)
    lag = k[:, None] - k[None, :]  # (t, t), i - j
    return torch.where(lag >= 0, w[lag.clamp(min=0)], w.new_zeros(()))  # (t, t)


def toeplitz_strided(w):
    """toeplitz without an index tensor, for scalar taps (t,) -> (t, t) or vector taps (t, d) -> (d, t, t),
    one matrix per channel: T[..., i, j] = w[i - j] for j <= i. With t - 1 zeros before the taps, z, row i
    of a sliding window (unfold, a view) reads z[i : i + t]; flipped, it holds z[i + t - 1 - j] = w[i - j]."""
    t = w.shape[0]
    z = torch.cat([w.new_zeros((t - 1,) + w.shape[1:]), w])  # (2t - 1, ...)
    return z.unfold(0, t, 1).movedim(0, -2).flip(-1)  # (t, ..., t) -> (..., t, t)


def diagonal_sums(m):
    """(..., t, t) -> (t, ...): out[k] = sum_j m[..., j + k, j], the k-th diagonal below the main one,
    which is the gradient of tap k from the gradient of its Toeplitz matrix. Below t rows of zeros, a step
    of t + 1 elements goes one row down and one column right: a strided view holds diagonal k as row k."""
    t = m.shape[-1]
    padded = F.pad(m, (0, 0, 0, t))  # (..., 2t, t), contiguous
    diagonals = padded.as_strided(m.shape, padded.stride()[:-2] + (t, t + 1))  # [k, j]: m[j + k, j]
    return diagonals.sum(-1).movedim(-1, 0)


class ToeplitzStrided(torch.autograd.Function):
    """fir_full as T x with T = toeplitz_strided(w): scalar taps, the same (t x t) matrix for every sequence
    (a batched GEMM with batch stride 0 over T, so neither T nor x is copied); vector taps, one (t x t)
    matrix per channel. The backward is written out, dx = T^T g and dw = diagonal_sums(dT) with dT = sum
    over the batch of g x^T, so that its GEMMs run in ieee_float32 too and dw is one reduction (autograd
    through unfold would sum each tap's t terms in one GPU thread, unfold_backward's loop)."""

    @staticmethod
    def forward(ctx, x, w):  # x (B, t, d), w (t,) or (t, d)
        T = toeplitz_strided(w)  # (t, t) or (d, t, t)
        ctx.save_for_backward(x, T)
        with ieee_float32(x.device):
            if T.dim() == 2:
                return torch.bmm(T.expand(x.shape[0], -1, -1), x)  # Eq. (29): (B, t, t) @ (B, t, d)
            return torch.bmm(T, x.permute(2, 1, 0)).permute(2, 1, 0)  # Eq. (26), (28): (d, t, t) @ (d, t, B)

    @staticmethod
    def backward(ctx, g):  # g (B, t, d)
        x, T = ctx.saved_tensors
        dx = dw = None
        with ieee_float32(g.device):
            if T.dim() == 2:
                if ctx.needs_input_grad[0]:
                    dx = torch.bmm(T.mT.expand(g.shape[0], -1, -1), g)  # (B, t, d)
                if ctx.needs_input_grad[1]:
                    dw = diagonal_sums(torch.bmm(g, x.mT).sum(0))  # (t, t) -> (t,)
                return dx, dw
            g_c = g.permute(2, 1, 0)  # (d, t, B)
            if ctx.needs_input_grad[0]:
                dx = torch.bmm(T.mT, g_c).permute(2, 1, 0)  # (B, t, d)
            if ctx.needs_input_grad[1]:
                dw = diagonal_sums(torch.bmm(g_c, x.permute(2, 0, 1)))  # (d, t, t) -> (t, d)
        return dx, dw


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
    MKL's batched complex GEMM is 2.5-3.5x slower on rfft's own layout or a lazily conjugated operand.
    cuda_layout (matrix taps only, the fft-cuda path): cuBLAS takes W^H and X^H as views with its
    conjugate-transpose flag, and each irfft reads the products in their (F, B, d) layout."""

    @staticmethod
    def forward(ctx, x, w, cuda_layout=False):  # x (B, t, d), w (t, ...)
        t = x.shape[1]
        n = fft_size(t)
        ctx.cuda_layout = cuda_layout
        X = torch.fft.rfft(x.transpose(1, 2), n=n, dim=-1)  # (B, d, F), F = n // 2 + 1
        if w.dim() == 3:  # matrices
            X = X.permute(2, 0, 1).contiguous()  # (F, B, d)
            W = torch.fft.rfft(w.permute(1, 2, 0), n=n, dim=-1).permute(2, 0, 1).contiguous()  # (F, d, d)
            ctx.save_for_backward(X, W)
            with ieee_float32(x.device):
                Y = torch.bmm(X, W)  # Eq. (23) per frequency: (F, B, d)
            if cuda_layout:
                return torch.fft.irfft(Y, n=n, dim=0)[:t].transpose(0, 1)  # (B, t, d)
            Y = Y.permute(1, 2, 0)  # (B, d, F)
        else:  # vectors (d, F) or scalars (F,)
            W = torch.fft.rfft(w.t(), n=n, dim=-1)
            Y = X * W  # Eq. (26), (28), (29) per frequency: (B, d, F)
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
            if ctx.cuda_layout:
                return FIRFFT.matrix_grads_cuda(ctx, X, W, G, t, n)
            if ctx.needs_input_grad[0]:
                W_H = W.transpose(1, 2).conj().resolve_conj()  # conj resolved: MKL's fast path
                with ieee_float32(g.device):
                    dX = torch.bmm(G, W_H).permute(1, 2, 0)  # (B, d, F)
                dx = torch.fft.irfft(dX, n=n, dim=-1)[..., :t].transpose(1, 2)
            if ctx.needs_input_grad[1]:
                X_H = X.conj().resolve_conj().transpose(1, 2)  # (F, d, B)
                with ieee_float32(g.device):
                    dW = torch.bmm(X_H, G).permute(1, 2, 0)  # (d, d, F), summed over the batch
                dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t].permute(2, 0, 1)  # (t, d, d)
            return dx, dw, None
        if ctx.needs_input_grad[0]:
            dx = torch.fft.irfft(G * W.conj(), n=n, dim=-1)[..., :t].transpose(1, 2)  # (B, t, d)
        if ctx.needs_input_grad[1]:
            dW = (X.conj() * G).sum(0)  # (d, F), summed over the batch
            if W.dim() == 1:
                dW = dW.sum(0)  # (F,), and over the features
            dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t]
            dw = dw.t() if dw.dim() == 2 else dw  # (t, d) or (t,)
        return dx, dw, None

    @staticmethod
    def matrix_grads_cuda(ctx, X, W, G, t, n):
        """The matrix taps' gradients in the fft-cuda layout: X (F, B, d), W (F, d, d), G (F, B, d)."""
        dx = dw = None
        with ieee_float32(G.device):
            if ctx.needs_input_grad[0]:
                dx = torch.fft.irfft(torch.bmm(G, W.mH), n=n, dim=0)[:t].transpose(0, 1)  # (B, t, d)
            if ctx.needs_input_grad[1]:
                dw = torch.fft.irfft(torch.bmm(X.mH, G), n=n, dim=0)[:t]  # (t, d, d), summed over the batch
        return dx, dw, None


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
