"""
How extractor.causal_fir is computed fast. The four Extractors share one operation, a
causal FIR filter along time, Eq. (23), (26), (28), (29):

    y_i = sum_{j <= i} x_j (*) w_{i-j+1}   x (B, t, d); taps w (l, d, d), (l, d) or (l,)

(*) is x_j @ W for SHE's matrix taps, x_j o w for WE's and HE's vector taps, x_j w for
ME's scalar taps. extractor.causal_fir_reference is that double sum as written; every
path here computes the same numbers. fir_full(x, w) filters the whole sequence by a
path of PATHS, default_path's unless told; fir_last_row(x, w) gives the newest position
only (one token of generation).
TF32: train.py lets CUDA's float32 matmuls (and cuBLAS's complex64 GEMMs) run in TF32, a
10-bit mantissa; every GEMM here runs in IEEE float32 (ieee_float32) unless ALLOW_TF32 =
True, which lets them follow the global setting, to measure what TF32 does."""

import contextlib

import torch
import torch.nn.functional as F

# scalar taps: Toeplitz below this t (measured faster on the CPU), FFT from here on
FFT_MIN_T_SCALAR = 1024
ALLOW_TF32 = False  # see TF32 above
PATHS = {  # the taps' dims each path computes
    "toeplitz": (1,),  # one GEMM, a lower-triangular Toeplitz matrix times X
    "toeplitz-strided": (1, 2),  # the same without index tensor or scatter (CUDA)
    "fft": (1, 2, 3),  # rfft, a product per frequency, irfft: O(t log t), not O(t^2)
    "fft-cuda": (3,),  # on CUDA: fft in layouts cuBLAS and cuFFT take as is
}


def default_path(device_type, taps_dim, t):
    """fir_full's path for taps of taps_dim axes (1 scalars, 2 vectors, 3 matrices) over
    t positions: CPU and MPS take the CPU's measured ones, CUDA its own for matrix taps
    and short scalar taps (no scatter in the backward)."""
    if device_type == "cuda" and taps_dim == 3:
        return "fft-cuda"
    if taps_dim == 1 and t < FFT_MIN_T_SCALAR:
        return "toeplitz-strided" if device_type == "cuda" else "toeplitz"
    return "fft"


def fir_full(x, w, path=None):
    """The filter over the whole sequence, by the first t taps: x (B, t, d), taps w (l,
    ...), l >= t -> (B, t, d); path: one of PATHS, else default_path's. toeplitz follows
    autocast; the others use float32 under it (float64 stays) and return x's dtype."""
    t = x.shape[1]
    if t > w.shape[0]:
        raise ValueError(
            f"sequence length {t} exceeds the {w.shape[0]} taps (block_size l)"
        )
    w = w[:t]
    path = path or default_path(x.device.type, w.dim(), t)
    if w.dim() not in PATHS.get(path, ()):
        raise ValueError(
            f"no FIR path {path!r} for taps of shape {tuple(w.shape)}; "
            f"taps' dims: {PATHS}"
        )
    if path == "toeplitz":
        return toeplitz(w).to(x.dtype) @ x  # Eq. (29): (t, t) @ (B, t, d) -> (B, t, d)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        if path == "toeplitz-strided":
            return ToeplitzStrided.apply(x.to(dtype), w.to(dtype)).to(x.dtype)
        return FIRFFT.apply(x.to(dtype), w.to(dtype), path == "fft-cuda").to(x.dtype)


@contextlib.contextmanager
def ieee_float32(device):
    """Inside, CUDA's GEMMs run in IEEE float32 (see TF32 above). It sets allow_tf32,
    train.py's flag, which keeps PyTorch's old and new precision settings in step, and
    reads fp32_precision, which answers under either (allow_tf32 raises after a mix)."""
    matmul = torch.backends.cuda.matmul
    tf32 = device.type == "cuda" and not ALLOW_TF32 and matmul.fp32_precision == "tf32"
    if tf32:
        matmul.allow_tf32 = False
    try:
        yield
    finally:
        if tf32:
            matmul.allow_tf32 = True


# ---- short sequences: the sum as a Toeplitz matrix times X
def toeplitz(w):
    """(t,) taps -> (t, t) lower-triangular Toeplitz matrix T[i, j] = w[i - j] for j <=
    i, gathered through an index tensor (its gradient is a scatter, index_put: a sort on
    CUDA, hence toeplitz_strided there)."""
    t = w.shape[0]
    k = torch.arange(t, device=w.device)
    lag = k[:, None] - k[None, :]  # (t, t), i - j
    return torch.where(lag >= 0, w[lag.clamp(min=0)], w.new_zeros(()))  # (t, t)


def toeplitz_strided(w):
    """toeplitz as a view, for scalar taps (t,) -> (t, t) or vector taps (t, d) -> (d,
    t, t), one matrix per channel. With t - 1 zeros before the taps, z, row i of a
    sliding window (unfold) reads z[i : i + t]; flipped (the one copy), it holds z[i +
    t - 1 - j] = w[i - j]."""
    t = w.shape[0]
    z = torch.cat([w.new_zeros((t - 1,) + w.shape[1:]), w])  # (2t - 1, ...)
    return z.unfold(0, t, 1).movedim(0, -2).flip(-1)  # (t, ..., t) -> (..., t, t)


def diagonal_sums(m):
    """(..., t, t) -> (t, ...): out[k] = sum_j m[..., j + k, j], the k-th diagonal below
    the main one: tap k's gradient from its Toeplitz matrix's. Below t rows of zeros, a
    step of t + 1 elements goes one row down and one column right, so a strided view
    holds diagonal k as row k."""
    t = m.shape[-1]
    padded = F.pad(m, (0, 0, 0, t))  # (..., 2t, t), contiguous
    # [k, j]: m[j + k, j]
    diagonals = padded.as_strided(m.shape, padded.stride()[:-2] + (t, t + 1))
    return diagonals.sum(-1).movedim(-1, 0)


def toeplitz_times(T, z):
    """T z for z (B, t, d): T (t, t) of scalar taps, or (d, t, t) of vector taps."""
    if T.dim() == 2:  # one GEMM whose batch stride over T is 0 (neither T nor z copied)
        # Eq. (29): (B, t, t) @ (B, t, d)
        return torch.bmm(T.expand(z.shape[0], -1, -1), z)
    # Eq. (26), (28): (d, t, t) @ (d, t, B)
    return torch.bmm(T, z.permute(2, 1, 0)).permute(2, 1, 0)


class ToeplitzStrided(torch.autograd.Function):
    """fir_full as T x with T = toeplitz_strided(w) (toeplitz_times). The backward, dx =
    T^T g and dw = diagonal_sums(sum over the batch of g x^T), is written out so that
    its GEMMs run in ieee_float32 and dw is one reduction (autograd through unfold sums
    each tap's t terms in one GPU thread)."""

    @staticmethod
    def forward(ctx, x, w):  # x (B, t, d), w (t,) or (t, d)
        T = toeplitz_strided(w)  # (t, t) or (d, t, t)
        ctx.save_for_backward(x, T)
        with ieee_float32(x.device):
            return toeplitz_times(T, x)  # Eq. (26), (28), (29)

    @staticmethod
    def backward(ctx, g):  # g (B, t, d)
        x, T = ctx.saved_tensors
        dx = dw = None
        with ieee_float32(g.device):
            if ctx.needs_input_grad[0]:
                dx = toeplitz_times(T.mT, g)  # (B, t, d)
            if ctx.needs_input_grad[1] and T.dim() == 2:
                dw = diagonal_sums(torch.bmm(g, x.mT).sum(0))  # (t, t) -> (t,)
            elif ctx.needs_input_grad[1]:
                gx = torch.bmm(g.permute(2, 1, 0), x.permute(2, 0, 1))  # (d, t, t)
                dw = diagonal_sums(gx)  # (t, d)
        return dx, dw


# ---- the rest: products in frequency space; zero-padded to n >= 2t - 1 points, the
# FFT's circular convolution equals the linear one (nothing wraps around)
def fft_size(t):
    """The smallest n >= 2t - 1 with no prime factor above 5, a fast FFT length; n = 2t
    can be slow: t = 127 gives 254 = 2 * 127, 2.1x the time of t = 128 (measured)."""
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


def irfft_fbd(Y, n, t, cuda_layout):
    """irfft's first t positions, Y (F, B, d) -> (B, t, d): along F (cuda_layout), or
    in rfft's (B, d, F)."""
    if cuda_layout:
        return torch.fft.irfft(Y, n=n, dim=0)[:t].transpose(0, 1)
    return torch.fft.irfft(Y.permute(1, 2, 0), n=n, dim=-1)[..., :t].transpose(1, 2)


class FIRFFT(torch.autograd.Function):
    """fir_full through rfft/irfft along time, the last axis (the transposes are the
    copy a transform along another axis makes inside). The backward, written out
    (autograd's is 1.4-1.6x slower), reuses the spectra: dx = irfft(G W^H), dw =
    irfft(sum over the batch of X^H G). Matrix taps: a (d x d) GEMM per frequency in
    (F, B, d) layout (MKL's is 2.5-3.5x slower on rfft's layout or a lazy conjugate);
    cuda_layout: cuBLAS reads W^H and X^H as views through its conjugate-transpose
    flag, irfft the products' (F, B, d) layout."""

    @staticmethod
    def forward(ctx, x, w, cuda_layout):  # x (B, t, d), w (t, ...)
        t = x.shape[1]
        n = fft_size(t)
        ctx.t, ctx.n, ctx.cuda_layout = t, n, cuda_layout
        X = torch.fft.rfft(x.transpose(1, 2), n=n, dim=-1)  # (B, d, F), F = n // 2 + 1
        if w.dim() == 3:  # matrices
            X = X.permute(2, 0, 1).contiguous()  # (F, B, d)
            W = torch.fft.rfft(w.permute(1, 2, 0), n=n, dim=-1)  # (d, d, F)
            W = W.permute(2, 0, 1).contiguous()  # (F, d, d)
            ctx.save_for_backward(X, W)
            with ieee_float32(x.device):
                # Eq. (23) per frequency, (B, t, d)
                return irfft_fbd(torch.bmm(X, W), n, t, cuda_layout)
        W = torch.fft.rfft(w.t(), n=n, dim=-1)  # vectors (d, F) or scalars (F,)
        ctx.save_for_backward(X, W)
        y = torch.fft.irfft(X * W, n=n, dim=-1)[..., :t]  # Eq. (26), (28), (29)
        return y.transpose(1, 2)  # (B, t, d)

    @staticmethod
    def backward(ctx, g):  # g (B, t, d)
        X, W = ctx.saved_tensors
        t, n, cuda_layout = ctx.t, ctx.n, ctx.cuda_layout
        G = torch.fft.rfft(g.transpose(1, 2), n=n, dim=-1)  # (B, d, F)
        dx = dw = None
        if W.dim() == 3:
            G = G.permute(2, 0, 1).contiguous()  # (F, B, d)
            W_H, X_H = W.mH, X.mH  # views (cuda_layout), or resolved: MKL's fast path
            if not cuda_layout:
                W_H, X_H = W_H.resolve_conj(), X_H.resolve_conj()
            with ieee_float32(g.device):
                if ctx.needs_input_grad[0]:  # (B, t, d)
                    dx = irfft_fbd(torch.bmm(G, W_H), n, t, cuda_layout)
                if ctx.needs_input_grad[1]:
                    # summed over the batch, (d, t, d) -> (t, d, d)
                    dw = irfft_fbd(torch.bmm(X_H, G), n, t, cuda_layout).transpose(0, 1)
            return dx, dw, None
        if ctx.needs_input_grad[0]:
            dx = torch.fft.irfft(G * W.conj(), n=n, dim=-1)[..., :t]  # (B, d, t)
            dx = dx.transpose(1, 2)  # (B, t, d)
        if ctx.needs_input_grad[1]:
            dW = (X.conj() * G).sum(0)  # (d, F), summed over the batch
            if W.dim() == 1:
                dW = dW.sum(0)  # (F,), and over the features
            dw = torch.fft.irfft(dW, n=n, dim=-1)[..., :t].t()  # (t, d) or (t,)
        return dx, dw, None


def fir_last_row(x, w):
    """Row t-1 of the sum for x (B, t, d), the newest token's output (B, d): a direct
    product, O(t d) for vector or scalar taps, O(t d^2) for matrices (Tables 5, 6)."""
    x_back = x.flip(1)  # x_back[:, k] is the token k steps back, which meets tap k
    w = w[: x.shape[1]]
    if w.dim() == 3:
        return torch.einsum("btd,tde->be", x_back, w.to(x.dtype))  # Eq. (23), one row
    if w.dim() == 2:
        return (x_back * w.to(x.dtype)).sum(1)  # Eq. (26), (28), one row
    return torch.einsum("btd,t->bd", x_back, w.to(x.dtype))  # Eq. (29), one row
