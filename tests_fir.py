from tests_header import *  # noqa: F403
# ruff: noqa: F405, I001  (a section of tests.py: the names of tests_header.py, which comes first)

import functools

import extractor
import fir

# ======== the FIR's fast paths (fir.py): each against the literal sum, forward and backward ========

TAPS = {1: (13,), 2: (13, 5), 3: (13, 5, 5)}  # w.dim() -> l = 13 taps for d = 5: scalars, vectors, matrices


def fir_by_taps(x, w):
    """Eq. (23), (26), (28), (29), y_i = sum_{j <= i} x_j (*) w_{i-j+1}, summed tap by tap: w_k meets each
    x_j with i - j + 1 = k, so all of x shifted k - 1 positions on (the reference loops over rows i)."""
    t, y = x.shape[1], torch.zeros_like(x)
    for k in range(1, t + 1):  # the paper's tap index; w_k is stored at w[k - 1]
        shifted = x[:, : t - k + 1]  # x_j for i = j + k - 1 = k - 1 ... t - 1
        y[:, k - 1 :] += shifted @ w[k - 1] if w.dim() == 3 else shifted * w[k - 1]
    return y


def fir_and_grads(f, x, w, g, wrt=(0, 1)):
    """f(x, w) and the gradients of the inputs numbered in wrt (0: x, 1: w) for the output gradient g."""
    x, w = [a.detach().requires_grad_(i in wrt) for i, a in enumerate((x, w))]
    y = f(x, w)
    return cpu64(y, *torch.autograd.grad(y, [(x, w)[i] for i in wrt], g))


def close(got, want):
    return all(torch.allclose(a, b, atol=TOL, rtol=0) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dim", [1, 2, 3], ids=["scalar", "vector", "matrix"])
def test_every_path_and_the_last_row_equal_the_literal_sum_forward_and_backward(dim):
    """Each path, named (so each runs on every device), and fir_last_row against causal_fir_reference and
    the sum tap by tap: odd and even t, t < l and t = l (n = 2t - 1 5-smooth at t = 5, 8, 13, not 2, 12)."""
    torch.manual_seed(dim)
    for t in (1, 2, 5, 8, 12, 13):
        (x, g), w = torch.randn(2, 3, t, 5).double(), torch.randn(*TAPS[dim]).double()
        ref = fir_and_grads(extractor.causal_fir_reference, x, w, g)
        assert close(fir_and_grads(fir_by_taps, x, w, g), ref) and (ref[2][t:] == 0).all()
        for path in [p for p, dims in fir.PATHS.items() if dim in dims]:
            f = functools.partial(fir.fir_full, path=path)
            assert close(fir_and_grads(f, dev(x), dev(w), dev(g)), ref), (path, t)
            assert close(cpu64(f(dev(x), dev(w).float())), ref[:1]), (path, t)  # float32 taps, cast to x's
            for i in (0, 1):  # the other input a constant
                assert close(fir_and_grads(f, dev(x), dev(w), dev(g), wrt=(i,)), ref[:1] + ref[1 + i : 2 + i])
        assert close(cpu64(fir.fir_last_row(dev(x), dev(w).float())), [ref[0][:, -1]]), t
        assert fir.fir_last_row(dev(x).float(), dev(w)).dtype == torch.float32  # the taps cast to x's dtype


# ---- which path runs: the device's default, a named path, a forced one
def test_default_path_by_device_type_taps_and_length(monkeypatch):
    want = {  # (device type, w.dim(), t) -> path
        ("cpu", 1, 1023): "toeplitz", ("cpu", 1, 1024): "fft", ("cpu", 2, 1): "fft", ("cpu", 3, 1): "fft",
        ("mps", 1, 1023): "toeplitz", ("mps", 1, 1024): "fft", ("mps", 2, 1): "fft", ("mps", 3, 1): "fft",
        ("cuda", 1, 1): "toeplitz-strided", ("cuda", 1, 1023): "toeplitz-strided", ("cuda", 1, 1024): "fft",
        ("cuda", 2, 1): "fft", ("cuda", 3, 1): "fft-cuda", ("cuda", 3, 1024): "fft-cuda",
    }  # fmt: skip
    assert {key: fir.default_path(*key) for key in want} == want
    monkeypatch.setattr(fir, "CUDA_TOEPLITZ_MAX_T_VECTOR", 256)  # once a GPU measures it faster
    assert [fir.default_path("cuda", 2, t) for t in (1, 256, 257)] == ["toeplitz-strided"] * 2 + ["fft"]


def test_fir_full_takes_the_named_path_else_the_forced_else_the_default(monkeypatch):
    taken, asked, fft, default_path = [], [], fir.FIRFFT.apply, fir.default_path
    monkeypatch.setattr(fir, "default_path", lambda *args: asked.append(args[0]) or default_path(*args))
    spy = lambda name, f: lambda *args: taken.append(name) or f(*args)
    monkeypatch.setattr(fir, "toeplitz", spy("toeplitz", fir.toeplitz))
    monkeypatch.setattr(fir.ToeplitzStrided, "apply", spy("toeplitz-strided", fir.ToeplitzStrided.apply))
    monkeypatch.setattr(fir.FIRFFT, "apply", lambda x, w, c: spy("fft-cuda" if c else "fft", fft)(x, w, c))
    for dim, shape in TAPS.items():
        x, w = dev(torch.randn(2, 12, 5)), dev(torch.randn(*shape))
        default = default_path(DEVICE.type, dim, 12)
        for path in [p for p, dims in fir.PATHS.items() if dim in dims]:
            taken.clear()
            fir.fir_full(x, w)
            fir.fir_full(x, w, path=path)
            with fir.forcing(path):
                fir.fir_full(x, w)
                with fir.forcing("fft"):
                    fir.fir_full(x, w, path=path)  # the named path before the forced one
                fir.fir_full(x, w)  # the outer forcing again
            assert taken == [default] + [path] * 4, (dim, path)  # the default first: no forcing left over
    with pytest.raises(KeyError), fir.forcing("fft"):
        raise KeyError  # an exception inside still ends the forcing
    assert fir.fir_full(x, w[:, 0, 0]) is not None and taken[-1] == default_path(DEVICE.type, 1, 12)
    assert set(asked) == {DEVICE.type}  # the device type of x


def test_fir_full_refuses_a_path_that_cannot_compute_the_taps_too_few_taps_and_no_positions():
    dims = "{'toeplitz': (1,), 'toeplitz-strided': (1, 2), 'fft': (1, 2, 3), 'fft-cuda': (3,)}"
    x = torch.randn(1, 4, 5)
    wrong = [("fft-cuda", (4, 5)), ("toeplitz", (6, 5)), ("toeplitz-strided", (4, 5, 5)), ("fftw", (4,))]
    for path, shape in wrong:
        why = f"no FIR path '{path}' for taps of shape {(4,) + shape[1:]}; taps' dims: {dims}"
        refused(why, fir.fir_full, x, torch.randn(*shape), path=path)
    paths = "toeplitz, toeplitz-strided, fft, fft-cuda"
    refused(f"no FIR path 'fftw'; the paths are {paths}", fir.forcing("fftw").__enter__)
    refused("sequence length 4 exceeds the 3 taps (block_size l)", fir.fir_full, x, torch.randn(3, 5))
    refused("an FFT over 0 positions: the sequence needs at least one", fir.fir_full, x[:, :0], x[0])


# ---- the FFT's length: zero-padded to n >= 2t - 1 nothing wraps around; n 5-smooth, as FFTs are fast then
def test_fft_size_is_the_smallest_5_smooth_n_from_2t_minus_1():
    by_hand = {1: 1, 2: 3, 3: 5, 4: 8, 5: 9, 6: 12, 7: 15, 8: 15, 11: 24, 13: 25, 14: 27, 17: 36, 32: 64}
    by_hand |= {64: 128, 127: 256, 128: 256, 129: 270}  # 253 = 11 * 23, 254 = 2 * 127, 255 = 3 * 5 * 17, ...
    assert {t: fir.fft_size(t) for t in by_hand} == by_hand
    refused("an FFT over 0 positions: the sequence needs at least one", fir.fft_size, 0)


# ---- precision: the GEMMs in IEEE float32 while TF32 is on, and under autocast
def test_ieee_float32_turns_tf32_off_for_cuda_inside_and_restores_it(monkeypatch):
    """Needs no GPU (the switch is PyTorch's global flag): off inside for a CUDA device while TF32 is on, and
    restored, also after an exception; the CPU, ALLOW_TF32 = True and TF32 already off leave it as it is."""
    matmul, cuda, cpu, seen = torch.backends.cuda.matmul, torch.device("cuda"), torch.device("cpu"), []
    cases = [(cuda, False, True), (cpu, False, True), (cuda, True, True), (cuda, False, False)]
    for device, allow, tf32 in cases:  # (device, ALLOW_TF32, TF32 on before)
        monkeypatch.setattr(fir, "ALLOW_TF32", allow)
        monkeypatch.setattr(matmul, "allow_tf32", tf32)
        with pytest.raises(KeyError), fir.ieee_float32(device):
            seen.append(matmul.allow_tf32)
            raise KeyError
        assert matmul.allow_tf32 == tf32 and matmul.fp32_precision == ("tf32" if tf32 else "ieee")
    assert seen == [False, True, True, False]


def test_fir_under_autocast_computes_in_float32_and_returns_the_input_dtype():
    """bf16 autocast: every path but toeplitz (which follows autocast) computes in float32, so the one
    rounding is the output's to bf16 (2^-8 of it at most) and float32's; bf16 taps exceed it 30-390x."""
    torch.manual_seed(2)
    for dim, path in [(dim, path) for path, dims in fir.PATHS.items() for dim in dims]:
        x, w = torch.randn(2, 13, 5), torch.randn(*TAPS[dim])
        ref = extractor.causal_fir_reference(x.bfloat16().double(), w.double())  # the input rounded only
        with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
            y = fir.fir_full(x.bfloat16().to(DEVICE), w.to(DEVICE), path=path)
        err, bound = (y.cpu().double() - ref).abs(), 2**-8 * ref.abs() + 1e-5
        assert y.dtype == torch.bfloat16 and (path == "toeplitz" or (err <= bound).all()), path


# max |error| / max |reference| of fir_full in float32, forward and both gradients: float32 reaches 0.9-3.7e-7
# (the CPU, every path, d = 32, t = 64, three seeds), the GEMMs' inputs rounded to TF32's 10-bit mantissa
# 2.1-4.1e-4 (TF32's unit roundoff is 2^-11 = 4.9e-4); 1e-5 lies 25x above the one and 20x below the other
FIR_FLOAT32_BOUND = 1e-5


def fir_float32_errors(name, path=None, d=32, l=64):
    """fir_full in float32 on the test device (path: the device's default unless named) for mixer name's taps
    as the paper initialises them: max |error| / max |reference| of y, dx and dw (reference: float64, CPU)."""
    torch.manual_seed(7)
    m = extractor.MIXERS[name](Config(n_embd=d, block_size=l, mixer=name))
    w, (x, g) = (m.W_ext if name == "she" else m.w_ext).detach(), torch.randn(2, 4, l, d)
    ref = fir_and_grads(fir_by_taps, x.double(), w.double(), g.double())
    got = fir_and_grads(functools.partial(fir.fir_full, path=path), x.to(DEVICE), w.to(DEVICE), g.to(DEVICE))
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("name", ["she", "he", "we", "me", "he-ext"])
def test_fir_in_float32_with_tf32_matmuls_on_keeps_float32_accuracy(name, monkeypatch):
    """With TF32 on for CUDA's float32 matmuls (train.py's setting) each Extractor's FIR on its default path
    keeps float32's accuracy, forward and backward (with fir.ALLOW_TF32 = True, expected to fail for SHE)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    assert max(errors := fir_float32_errors(name)) < FIR_FLOAT32_BOUND, f"y, dx, dw: {errors}"


def tf32_rounded(a):
    """float32 (or both parts of complex64) rounded to TF32's 10 explicit mantissa bits, to nearest."""
    if a.is_complex():
        return torch.complex(tf32_rounded(a.resolve_conj().real), tf32_rounded(a.resolve_conj().imag))
    bits = a.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)  # 23 - 10 = 13 low bits dropped, half added


@pytest.mark.parametrize(
    "name,path", [("she", "fft"), ("she", "fft-cuda"), ("we", "toeplitz-strided"), ("me", "toeplitz-strided")]
)
def test_fir_gemms_run_in_ieee_float32_while_tf32_is_on(name, path, monkeypatch):
    """TF32 emulated on the CPU: while allow_tf32 is on, bmm rounds its inputs to a 10-bit mantissa (as cuBLAS
    feeds the tensor cores) and ieee_float32 takes the CPU for CUDA. The GEMMs of y, dx and dw run in
    ieee_float32; with ALLOW_TF32 = True each exceeds the bound (measured 20x and more). fft-cuda hands
    cuBLAS the conjugate transposes as views, fft resolves them (MKL's fast path)."""
    matmul, bmm, ieee, conj = torch.backends.cuda.matmul, torch.bmm, fir.ieee_float32, []
    tf32 = lambda a, b: conj.append(a.is_conj() or b.is_conj()) or bmm(*map(tf32_rounded, (a, b)))
    monkeypatch.setattr(torch, "bmm", lambda a, b: (tf32 if matmul.allow_tf32 else bmm)(a, b))
    monkeypatch.setattr(fir, "ieee_float32", lambda d: ieee(torch.device(d.type.replace("cpu", "cuda"))))
    monkeypatch.setattr(matmul, "allow_tf32", True)
    assert max(errors := fir_float32_errors(name, path)) < FIR_FLOAT32_BOUND, f"y, dx, dw: {errors}"
    monkeypatch.setattr(fir, "ALLOW_TF32", True)
    assert min(errors := fir_float32_errors(name, path)) > FIR_FLOAT32_BOUND, f"y, dx, dw: {errors}"
    assert conj == [False] + [path == "fft-cuda"] * 2
