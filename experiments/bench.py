"""The token mixers against attention on this device, and the paper's operation counts.

    python experiments/bench.py                 # sublayer, step, memory: Table 1's
    python experiments/bench.py --quick         # tiny shapes, few rounds: seconds
    python experiments/bench.py --sections step --device cuda --json bench.json
    python experiments/bench.py --table7        # Tables 3-7, and the FLOPs counted
    python experiments/bench.py --sections length,generate --csv results  # minutes
    python experiments/bench.py --draw results/length_cpu.csv   # its figure, .png

Sections: sublayer, a mixer's forward+backward at Table 1's l (on CUDA each FIR path:
fir.py's CUDA defaults come from it); step, Table 1's training step (on CUDA or with
--floor beside its floor); memory, its peak and the largest batch that fits a --gpu_gib
GPU; by name only length and generate, the sublayer at l and one new token at t = 32 ..
4096. Times: medians of interleaved rounds after warm-up (a noisy moment hits all the
mixers), the ratios to sa from the same run.
"""

import argparse
import contextlib
import csv
import ctypes
import dataclasses
import functools
import gc
import io
import json
import math
import os
import signal
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, flop_registry  # noqa: E402

import extractor  # noqa: E402
import fir  # noqa: E402
import machinery  # noqa: E402
import train  # noqa: E402
from machinery import atomic_write, fail  # noqa: E402

# name: (Table 1's, --quick's); section step's rounds (5x on CUDA), the GEMM's n and
# the copy's MiB that measure the floor's rates (CPU: <= 2048, 256); sections sublayer
# (l alone), length and generate: the lengths l (and t), tokens per batch (sublayer,
# length: at Table 1's l its batch), rounds of timing
SIZES = {
    "d": (128, 32),
    "l": (128, 32),
    "batch": (64, 4),
    "vocab": (5000, 300),  # u
    "hidden": (512, 128),  # c
    "n_layer": (18, 1),  # m
    "step_rounds": (4, 1),
    "gemm_n": (8192, 256),
    "copy_mib": (1024, 16),
    "lengths": ([2**k for k in range(5, 13)], [8, 16, 32]),
    "tokens": (8192, 64),
    "rounds": (7, 2),
}
PAPER_BATCHES = 60000  # Section 6: the paper trains on 60000 batches
# section step: variant -> autocast dtype; CUDA runs all four, the CPU eager; the
# captured ones in a CUDA graph, as train.py does on CUDA (machinery.CapturedStep)
VARIANTS = {
    "captured": "float32",
    "eager": "float32",
    "bf16": "bfloat16",
    "bf16-captured": "bfloat16",
}


def interleaved(fns, rounds, device, warmup=2):
    """{name: fn} -> {name: median seconds}: each fn once a round, in rotating order."""
    names = list(fns)
    times = {k: [] for k in fns}
    # waits for the queued kernels (the CPU's return at once)
    sync = getattr(torch, device.type).synchronize
    for r in range(-warmup, rounds):
        turn = r % len(names)
        for k in names[turn:] + names[:turn]:
            sync()
            t0 = time.perf_counter()
            fns[k]()
            sync()
            if r >= 0:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def queued(step, k):
    """CUDA: seconds per step for the host to queue k steps without waiting for the
    GPU, and until the GPU has run them (the first less: the host runs ahead)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(k):
        step()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / k, (time.perf_counter() - t0) / k


def make_config(s, args, mixer):
    sizes = dict(vocab_size=s["vocab"], block_size=s["l"], n_embd=s["d"])
    sizes |= dict(n_hidden=s["hidden"], n_layer=s["n_layer"], n_head=args.n_head)
    return extractor.Config(**sizes, mixer=mixer)


def sublayer(cfg):
    """The first sublayer, the mixer that cfg names, as a Transformer builds it."""
    one_layer = dataclasses.replace(cfg, n_layer=1, vocab_size=1)
    return extractor.Transformer(one_layer).layers[0].mixer


def new_model(s, args, mixer, batch, device):
    """train.py's default model and AdamW (Table 1), and make_step(dtype, captured):
    their training step on one batch (B, l), a function of no arguments."""
    defaults = machinery.build_parser(train.SETTINGS).parse_args([])
    model, opt = train.build_model(make_config(s, args, mixer), defaults, device)
    seeded = torch.Generator().manual_seed(0)
    data = torch.randint(0, s["vocab"], (batch, s["l"] + 1), generator=seeded)
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)

    def make_step(dtype, captured=False, how=None):
        ctx, scaler = machinery.precision(device, dtype)  # (no float16: no scaling)
        fn = functools.partial(train.train_step, model, opt, scaler, ctx)
        if captured:  # as train.py on CUDA (with `how`: eager if Python fails it)
            fn = machinery.CapturedStep(fn, opt, how)
        return functools.partial(fn, x, y)

    return model.train(), opt, make_step


def sublayer_paths(module, t, device):
    """The paths a mixer is timed on: its FIR taps' default path here, then on CUDA
    every other path for them; sdpa for attention, matmul for the rest."""
    taps = [getattr(module, n) for n in ("W_ext", "w_ext") if hasattr(module, n)]
    if not taps:
        return ["sdpa" if isinstance(module, extractor.SelfAttention) else "matmul"]
    dim = taps[0].dim()
    default = fir.default_path(device.type, dim, t)
    others = [p for p, dims in fir.PATHS.items() if dim in dims and p != default]
    return [default] + (others if device.type == "cuda" else [])


def storage_bytes(tensors, skip=()):
    """Bytes of the tensors' storages, each once (views share one), not `skip`'s."""
    storages = [t.untyped_storage() for t in tensors]
    sizes = {st.data_ptr(): st.nbytes() for st in storages}
    return sum(n for ptr, n in sizes.items() if ptr not in skip)


def state_bytes(model, optimizer):
    states = optimizer.state.values()
    moments = [st[k] for st in states for k in ("exp_avg", "exp_avg_sq")]
    return storage_bytes(model.parameters()) + storage_bytes(moments)


def saved_for_backward(fn, params):
    """Call fn; the bytes autograd saved for backward, each storage once (q, k and v
    are views of one), the parameters' left out (a saved weight is no activation)."""
    saved = []  # a saved tensor lives until backward: no storage is reused

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    params = {p.untyped_storage().data_ptr() for p in params}
    return storage_bytes(saved, skip=params)


def peak_bytes(step, device):
    """The memory high-water mark of one call of step above the use before it (CUDA's
    peak statistics, Linux's VmHWM reset by /proc/self/clear_refs), None elsewhere."""
    if device.type == "cuda":  # (the allocator's statistics are the host's: no wait)
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu" and os.path.exists("/proc/self/clear_refs"):
        # so that what is resident is what is in use
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark down to what is resident now
    else:
        return None
    before = machinery.peak_memory(device)[0]
    step()
    return machinery.peak_memory(device)[0] - before


def flop_counter():
    """A FlopCounterMode completed for the ops it leaves out here: SDPA's CPU kernel
    (the flash kernel's formula: the full t x t, the causal half not subtracted),
    complex bmm (8 real flops per complex multiply-add, not 2), elementwise mul (1 flop,
    6 if complex) and FFTs, estimated as 2.5 n log2(n) real flops per real transform of
    length n (half a complex radix-2 FFT's 5 n log2 n)."""
    aten = torch.ops.aten

    def r2c(x, dim, *_, out_val, **kw):  # length n: 2.5 n log2(n)
        return int(2.5 * x.numel() * math.log2(math.prod(x.shape[d] for d in dim)))

    def c2r(x, dim, *_, out_val, **kw):  # as long as its real output
        return r2c(out_val, dim, out_val=out_val)

    def bmm(a, b, *_, out_val, **kw):
        complex_factor = 4 if a.is_complex() else 1
        return flop_registry[aten.bmm](a, b, out_val=out_val) * complex_factor

    def mul(*_, out_val, **kw):
        return out_val.numel() * (6 if out_val.is_complex() else 1)

    counts = {aten.bmm: bmm, aten.mul: mul, aten._fft_r2c: r2c, aten._fft_c2r: c2r}
    for f in counts.values():
        f._get_raw = True  # called with the op's arguments and output, not their shapes
    # SDPA's CPU kernels as the flash kernels, by the shapes of their first arguments,
    # (grad,) q, k, v: the registry's formulae unwrapped (the mode wraps them again)
    flash = "_scaled_dot_product_flash_attention"
    for kernel in ("", "_backward"):
        formula = flop_registry[getattr(aten, flash + kernel)].__wrapped__
        counts[getattr(aten, f"{flash}_for_cpu{kernel}")] = formula
    return FlopCounterMode(display=False, custom_mapping=counts)


def measure_rates(device, dtypes, s):
    """Now: FLOP/s of an n x n GEMM in each dtype (float32 under the TF32 setting in
    effect; ieee: as fir.py's) and bytes/s of a large copy (each byte read, written)."""
    n, mib = s["gemm_n"], s["copy_mib"]
    if device.type != "cuda":
        n, mib = min(n, 2048), min(mib, 256)
    fns = {}
    for dt in dtypes:
        a = torch.randn(n, n, device=device).to(getattr(torch, dt))
        fns[dt] = functools.partial(torch.mm, a, a.clone(), out=torch.empty_like(a))
    src = torch.randn(mib * 2**18, device=device)  # float32: mib MiB
    fns["copy"] = functools.partial(torch.Tensor.copy_, torch.empty_like(src), src)
    t = interleaved(fns, 10, device)
    with fir.ieee_float32(device):  # fir.py's products: no TF32
        t |= interleaved({"ieee": fns["float32"]}, 10, device)
    rates = {dt: 2 * n**3 / t[dt] for dt in dtypes + ["ieee"]}
    return rates | {"copy": 2 * src.nbytes / t["copy"]}


def step_counts(model, optimizer, step, logits):
    """(FLOPs, fir.py's GEMMs' FLOPs, bytes) of one training step: its forward+backward
    FLOPs (not AdamW's), the FIR's GEMMs' (IEEE float32 in any dtype) among them, and
    the fewest bytes it moves, each written and read once: parameters, gradients,
    AdamW's moments, activations saved for backward, logits (`logits` bytes)."""
    ieee, fir_flops = fir.ieee_float32, []
    gemms = lambda: counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0)

    @contextlib.contextmanager
    def apart(device):  # fir.ieee_float32, the GEMMs' FLOPs inside it counted apart
        before = gemms()
        with ieee(device):
            yield
        fir_flops.append(gemms() - before)

    with mock.patch.object(fir, "ieee_float32", apart), flop_counter() as counter:
        saved = saved_for_backward(step, model.parameters())
    gradients = storage_bytes(model.parameters())  # as large as the parameters
    state = gradients + state_bytes(model, optimizer)
    return counter.get_total_flops(), sum(fir_flops), 2 * (state + saved + logits)


def section_step(s, args, device):
    cuda = device.type == "cuda"
    floor = cuda or args.floor
    variants = list(VARIANTS) if cuda else ["eager"]
    dtypes = list(dict.fromkeys(VARIANTS[v] for v in variants))
    rates = measure_rates(device, dtypes, s) if floor else {}
    rows, rounds = [], s["step_rounds"] * (5 if cuda else 1)
    s["queued"] = rounds
    for m in args.mixers:  # one at a time: its model and graphs freed before the next
        try:
            rows += mixer_steps(m, s, args, device, variants, dtypes, rates, rounds)
        except torch.OutOfMemoryError as e:
            rows.append(dict(mixer=m, variant="-", failed=f"out of memory: {e}"[:80]))
        except SystemExit:  # CUDA failed a capture (its line said): no CUDA work after
            s["broken"] = f"CUDA failed {m}'s capture"
            rows.append(dict(mixer=m, variant="captured", failed=s["broken"]))
            break
        free(device)
    sa = {r["variant"]: r.get("step_ms") for r in rows if r["mixer"] == "sa"}
    for row in rows:
        if sa.get(row["variant"]) and "step_ms" in row:  # (not the failed)
            row["vs_sa"] = row["step_ms"] / sa[row["variant"]]
    units = {k: "TB/s" if k == "copy" else "TFLOP/s" for k in rates}
    measured = ", ".join(f"{k} {r / 1e12:.3g} {units[k]}" for k, r in rates.items())
    s["rates"] = f"; rates measured: {measured}" if floor else ""
    return rows


def mixer_steps(m, s, args, device, variants, dtypes, rates, rounds):
    """One mixer's rows: each variant timed in interleaved rounds after warm-up (a
    capture that fails is a row that says why), beside its floor."""
    model, opt, make_step = new_model(s, args, m, s["batch"], device)
    params = sum(p.numel() for p in model.parameters())
    counts = {}
    for dt in dtypes if rates else []:  # (also AdamW's first step: its moments)
        logits = s["batch"] * s["l"] * s["vocab"] * (2 if "bf" in dt else 4)
        counts[dt] = step_counts(model, opt, make_step(dt), logits)
    steps, rows = {}, []
    for v in variants:
        captured = v.endswith("captured")
        try:  # captured: 3 eager warm-up steps, then the capture
            steps[v] = make_step(VARIANTS[v], captured)
            for _ in range(4 if captured else 0):
                steps[v]()
        except Exception as e:  # (CUDA failing the capture: a SystemExit, passed on)
            why = machinery.first_line(e)
            rows.append(dict(mixer=m, variant=v, params=params, failed=why[:80]))
            steps.pop(v, None)
    for v, sec in interleaved(steps, rounds, device).items():
        row = dict(mixer=m, variant=v, params=params, step_ms=1e3 * sec)
        row["tokens_per_s"] = s["batch"] * s["l"] / sec
        row["paper_hours"] = PAPER_BATCHES * sec / 3600
        if "captured" in v:  # (timed: CUDA ran its graph)
            host, done = queued(steps[v], rounds)
            row |= dict(queued_ms=1e3 * host, done_ms=1e3 * done)
        if rates:  # its FLOPs (the FIR's at ieee's rate) and bytes, overlapped at best
            flops, fir_flops, moved = counts[VARIANTS[v]]
            rate, copy, ieee = rates[VARIANTS[v]], rates["copy"], rates["ieee"]
            at_rates = (flops - fir_flops) / rate + fir_flops / ieee
            row |= dict(flops=flops, fir_flops=fir_flops, flop_ms=1e3 * at_rates)
            row |= dict(byte_ms=1e3 * moved / copy, flop_rate=rate, byte_rate=copy)
            row |= dict(bytes=moved, ieee_rate=ieee)
            row["floor_ms"] = max(row["flop_ms"], row["byte_ms"])
            row["vs_floor"] = row["step_ms"] / row["floor_ms"]
        rows.append(row)
    return sorted(rows, key=lambda r: list(VARIANTS).index(r["variant"]))


def free(device):
    """What the last mixer held given back: its model, AdamW, graphs and their pools."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def section_memory(s, args, device):
    B, MiB = s["batch"], 2**20
    half = s["half"] = max(1, B // 2)
    budget = 2**30 * (args.gpu_gib - 1)
    rows = []
    for m in args.mixers:
        state, saved, peak, reserved = memory_at_batch(s, args, m, B, device)
        peak_half = memory_at_batch(s, args, m, half, device)[2]
        row = dict(mixer=m, state_mib=state / MiB, saved_mib=saved / MiB)
        if reserved is not None:  # CUDA: what the card must hold
            row["reserved_mib"] = reserved / MiB
        if peak is not None:  # None where the high-water mark cannot be reset (MPS)
            # on the line through both: the activations grow with B
            per_seq = (peak - peak_half) / (B - half)
            row |= dict(peak_mib=peak / MiB, peak_half_mib=peak_half / MiB)
            row["per_seq_mib"] = per_seq / MiB
            held = peak if reserved is None else reserved
            row["fits"] = "yes" if held <= budget else "no"
            if per_seq > 0:
                row["max_batch"] = max(0, B + math.floor((budget - held) / per_seq))
        rows.append(row)
    return rows


def memory_at_batch(s, args, mixer, batch, device):
    """Bytes of (parameters and AdamW's moments, saved activations, peak, on CUDA the
    peak reserved: the allocator's cache emptied first, all of it this model's) of
    train.py's step, on CUDA captured as there (2 warm-ups, the recording: peaks')"""
    free(device)
    model, opt, make_step = new_model(s, args, mixer, batch, device)
    step = make_step("float32", captured=device.type == "cuda", how={})
    saved = saved_for_backward(step, model.parameters())
    calls = 3 if device.type == "cuda" else 1
    peak = peak_bytes(lambda: [step() for _ in range(calls)], device)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    state = state_bytes(model, opt)
    return state, saved, None if peak is None else peak + state, reserved


def complexity_training(d, l, n=1):
    """Tables 3 and 4: mult(iplications), add(itions), div(isions), exp(onentiations),
    params; SHE's multiplications use the summand d*d*t + d*d + d + d*d (Notes, 5)."""
    none = dict(div=0, exp=0)  # the Extractors divide and exponentiate nothing
    sa = dict(mult=l * l * d + 4 * l * d * d + l * d, params=4 * d * d)
    sa |= dict(add=l * l * d + 4 * l * d * d - 4 * l * d - l * n)
    sa |= dict(div=n * l * l + n * l, exp=(n * l * l + n * l) // 2)
    she = dict(none, mult=(l * l * d * d + 5 * l * d * d) // 2 + l * d)
    she |= dict(add=(l * l * d * d + 5 * l * d * d) // 2 - 3 * l * d)
    she |= dict(params=l * d * d + 2 * d * d)
    he = dict(none, mult=(l * l * d + 3 * l * d) // 2 + 3 * l * d * d)
    he |= dict(add=3 * l * d * d + (l * l * d - 7 * l * d) // 2)
    he |= dict(params=l * d + 3 * d * d)
    we = dict(none, mult=(l * l * d + 3 * l * d) // 2 + 2 * l * d * d)
    we |= dict(add=2 * l * d * d + (l * l * d - 5 * l * d) // 2)
    we |= dict(params=l * d + 2 * d * d)
    me = dict(none, mult=(l * l * d + l * d) // 2, add=(l * l * d - l * d) // 2)
    me |= dict(params=l)
    return dict(sa=sa, she=she, he=he, we=we, me=me)


def complexity_inference(d, t, n=1):
    """Tables 5 and 6: the increment for one new token at sequence length t. SA's
    additions are the paper's own per-token sum, 2td + 4d^2 - 5d - n, whose sum over
    t = 1..l is Table 3's count; the printed closed form 2td - tn + t + 4d^2 - 5d - 1
    undercounts it by (n-1)(t-1) (Notes, 6)."""
    none = dict(div=0, exp=0)
    sa = dict(mult=2 * t * d + 4 * d * d, add=2 * t * d + 4 * d * d - 5 * d - n)
    sa |= dict(div=2 * t * n, exp=t * n)
    she = dict(none, mult=t * d * d + 2 * d * d + d, add=t * d * d + 2 * d * d - 3 * d)
    he = dict(none, mult=t * d + 3 * d * d + d, add=t * d + 3 * d * d - 4 * d)
    we = dict(none, mult=t * d + 2 * d * d + d, add=t * d + 2 * d * d - 3 * d)
    me = dict(none, mult=t * d, add=t * d - d)
    return dict(sa=sa, she=she, he=he, we=we, me=me)


TABLE7 = {
    "1-head SA": ("sa", 1),
    "32-head SA": ("sa", 32),
    "SHE": ("she", 1),
    "HE": ("he", 1),
    "WE": ("we", 1),
    "ME": ("me", 1),
}
OPS = ("mult", "add", "div", "exp")


def table7(d=128, l=128):
    """Table 7's columns: label -> Tables 3 and 4's counts and their 'total'."""
    out = {}
    for label, (m, n) in TABLE7.items():
        counts = complexity_training(d, l, n)[m]
        out[label] = counts | dict(total=sum(counts[k] for k in OPS))
    return out


def measured(mixer, d, l, n=1):
    """(parameters, flop_counter's FLOPs of one sequence's forward) of a sublayer."""
    module = sublayer(extractor.Config(n_embd=d, block_size=l, n_head=n, mixer=mixer))
    with torch.no_grad(), flop_counter() as counter:
        module(torch.randn(1, l, d))  # (1, t, d)
    return sum(p.numel() for p in module.parameters()), counter.get_total_flops()


def print_table7(d=128, l=128):
    def line(name, values):
        print(f"{name:>8}" + "".join(f"{v:>14,}" for v in values))

    print(f"Table 7 (d = l = {d}) from Tables 3 and 4; below, the modules' parameters")
    print("and one forward's FLOPs (flop_counter's, completed for SDPA, complex, FFT)")
    print(f"{'':>8}" + "".join(f"{label:>14}" for label in TABLE7))
    for r in (*OPS, "params", "total"):
        line(r, [c[r] for c in table7(d, l).values()])
    params, flops = zip(*(measured(m, d, l, n) for m, n in TABLE7.values()))
    line("modules", params)
    line("flops", flops)
    print(f"\nTables 5 and 6 (d = {d}): one new token at t = {l}")
    for r in OPS:
        line(r, [complexity_inference(d, l, n)[m][r] for m, n in TABLE7.values()])


def per_thread_count(device, measure):
    """measure()'s rows on one thread, then the default threads (CUDA: these only)."""
    default = torch.get_num_threads()
    rows = []
    try:
        for k in [default] if device.type == "cuda" else sorted({1, default}):
            torch.set_num_threads(k)
            rows += [dict(mixer=r["mixer"], threads=k) | r for r in measure()]
    finally:
        torch.set_num_threads(default)
    return rows


def timed(rows, steps, rounds, device, tokens):
    """rows[k] gains ms, ms_per_token and vs_sa from interleaved rounds of steps[k]."""
    t = interleaved(steps, rounds, device) if steps else {}
    sa = [sec for k, sec in t.items() if rows[k]["mixer"] == "sa"]
    for k, sec in t.items():
        rows[k] |= dict(ms=1e3 * sec, ms_per_token=1e3 * sec / tokens)
        rows[k]["vs_sa"] = sec / sa[0] if sa else None
    return list(rows.values())


def counted(step, device, counts, batch):
    """A batch's count: Tables 3-6's mult + add + div + exp (counts: one sequence's,
    None for a mixer they lack), then from one call of step, outside the rounds (a
    warm-up too), its FLOPs and its peak."""
    ops = None if counts is None else batch * sum(counts[k] for k in OPS)
    with flop_counter() as counter:
        peak = peak_bytes(step, device)
    row = dict(paper_ops_fwd=ops, flops=counter.get_total_flops())
    return row | {"peak_mib": None if peak is None else peak / 2**20}


def length_at(s, args, device, l, stopped, every_path):
    """Each mixer's forward+backward at length l, b = tokens // l, on its default path
    (on CUDA with every_path each FIR path), but those out of memory at a shorter l (in
    stopped; the CPU's allocations do not fail: Linux ends the process instead)."""
    b, d = s["tokens"] // l, s["d"]
    x = torch.randn(b, l, d, device=device, requires_grad=True)
    g = torch.randn(b, l, d, device=device)  # dL/dy
    counts = complexity_training(d, l, args.n_head)
    rows, steps = {}, {}  # (mixer, path) -> its row, one forward+backward
    for m in [m for m in args.mixers if m not in stopped]:
        module = sublayer(make_config(s | dict(l=l), args, m)).to(device)
        paths = sublayer_paths(module, l, device)
        for path in paths if every_path else paths[:1]:
            row = rows[m, path] = dict(mixer=m, l=l, batch=b, tokens=b * l, path=path)
            row["params"] = sum(p.numel() for p in module.parameters())
            step = functools.partial(forward_backward, module, x, g, path)
            try:
                row |= counted(step, device, counts.get(m), b)
            except torch.OutOfMemoryError:
                row["stop"] = stopped[m] = "out of memory"
                continue
            steps[m, path] = step
    return timed(rows, steps, s["rounds"], device, b * l)


def section_length(s, args, device, every_path=False):
    def measure():
        stopped = {}  # the mixers out of memory, left out at every longer l
        at = lambda l: length_at(s, args, device, l, stopped, every_path)
        return [r for l in s["lengths"] for r in at(l)]

    return per_thread_count(device, measure)


def forward_backward(module, x, g, path):
    """module's forward on x, each FIR on path, and backward from dL/dy = g."""
    with mock.patch.object(fir, "default_path", lambda *_: path):
        module(x).backward(g)
    module.zero_grad(set_to_none=True)
    x.grad = None


def section_sublayer(s, args, device):
    """The length section at Table 1's l alone, on CUDA every FIR path."""
    return section_length(s | dict(lengths=[s["l"]]), args, device, every_path=True)


def one_token(module, x, cache):
    """x (B, 1, d) after the cached positions, on a copy of the cache: each call adds
    the same token to the same past."""
    return module(x, dict(cache))


@torch.no_grad()
def generate_at(s, args, device, modules, t):
    """Each mixer's one new token at position t (t - 1 cached) for a batch."""
    B, d = s["batch"], s["d"]
    counts = complexity_inference(d, t, args.n_head)
    new = torch.randn(B, 1, d, device=device)
    rows, steps = {}, {}
    for m, module in modules.items():
        cache = {}
        module(torch.randn(B, t - 1, d, device=device), cache)  # the t - 1 before
        steps[m] = functools.partial(one_token, module, new, cache)
        rows[m] = dict(mixer=m, t=t, batch=B)
        rows[m] |= counted(steps[m], device, counts.get(m), B)
    return timed(rows, steps, s["rounds"], device, B)


def section_generate(s, args, device):
    s["window"] = l = s["lengths"][-1]  # every t in one window: the longest
    make = lambda m: sublayer(make_config(s | dict(l=l), args, m)).to(device)
    modules = {m: make(m) for m in args.mixers}
    at = lambda t: generate_at(s, args, device, modules, t)
    return per_thread_count(device, lambda: [r for t in s["lengths"] for r in at(t)])


def crossings(rows, x):
    """Where vs_sa crosses 1 in one mixer's rows by length x: (x, ms_per_token) between
    two neighbours, interpolated in log-log (where sa's line meets the mixer's)."""
    found = []
    for a, b in zip(rows, rows[1:]):
        if (a["vs_sa"] < 1) != (b["vs_sa"] < 1):
            f = math.log(a["vs_sa"]) / math.log(a["vs_sa"] / b["vs_sa"])  # 1 at this f
            found.append([a[k] * (b[k] / a[k]) ** f for k in (x, "ms_per_token")])
    return found


def read_bench_csv(path):
    """A length or generate CSV's rows (numbers as floats, "": None), its x: l or t."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        x = "l" if "l" in rows[0] else "t"
        numbers = (x, "threads", "ms_per_token", "vs_sa", "paper_ops_fwd", "flops")
        for r in rows:
            r |= {k: float(r[k]) if r[k] else None for k in numbers}
    except (OSError, ValueError, csv.Error, IndexError, KeyError) as e:
        why = f"{type(e).__name__}: {e}"  # unread, no number, no rows, a column gone
        fail(f"cannot read {path} as a length or generate CSV of bench.py ({why})")
    return rows, x


def draw(path, out):
    """A length or generate CSV as ms per token against l (t), log-log, a panel per
    thread count: measured (solid), Tables 3-6's counts and the FLOPs of the path that
    runs (dashed, dotted), scaled to meet its first point; crossings with sa (x)."""
    import plot  # matplotlib, only to draw

    rows, x = read_bench_csv(path)
    rows = [r for r in rows if r["ms_per_token"] is not None]  # not the stops
    threads = sorted({r["threads"] for r in rows})
    size = (6.4 * len(threads), 4.8)
    fig, axes = plot.plt.subplots(1, len(threads), figsize=size, squeeze=False)
    for ax, k in zip(axes[0], threads):
        for m in dict.fromkeys(r["mixer"] for r in rows if r["threads"] == k):
            mine = [r for r in rows if (r["threads"], r["mixer"]) == (k, m)]
            ls, ms = [r[x] for r in mine], [r["ms_per_token"] for r in mine]
            color = plot.STYLE.get("sa-32" if m == "sa" else m)
            color = ax.plot(ls, ms, "o-", color=color, label=m)[0].get_color()
            for column, style in (("paper_ops_fwd", "--"), ("flops", ":")):
                ops = [r[column] for r in mine]
                if None not in ops:
                    ax.plot(ls, [ms[0] * n / ops[0] for n in ops], style, color=color)
            at = crossings([r for r in mine if r["vs_sa"]], x)
            for v, y in at:
                ax.plot(v, y, "x", color=color, ms=9, mew=2)
                ax.annotate(
                    f"{v:.0f}", (v, y), textcoords="offset points", xytext=(4, 4)
                )
            where = ", ".join(f"{v:.0f}" for v, _ in at) or "none in range"
            if m != "sa":
                print(f"{m}, threads {k:.0f}: vs_sa crosses 1 at {x} = {where}")
        ax.set(xscale="log", yscale="log", xlabel=x, ylabel="ms per token")
        plot.finish(ax, f"threads: {k:.0f}")
    title = "measured (solid); Tables 3-6 (dashed), FLOPs of the path run (dotted)"
    plot.save(fig, out, f"{os.path.basename(path)}: {title}")


SECTIONS = dict(
    sublayer=section_sublayer,
    step=section_step,
    memory=section_memory,
    length=section_length,
    generate=section_generate,
)
# section: title, columns (a row's key:format), notes; {...} filled from the settings
TABLES = {
    "step": (
        "Training step (train.train_step), m = {n_layer}, l = d = {d}, batch {batch};"
        " median of {step_rounds} rounds{rates}",
        "mixer variant params:si step_ms:.2f queued_ms:.2f done_ms:.2f tokens_per_s:.0f"
        " vs_sa:.2f flops:si bytes:si flop_ms:.3f byte_ms:.3f floor_ms:.3f vs_floor:.1f"
        " paper_hours:.2f failed",
        "vs_sa: this step time over sa's (below 1: faster); bytes: parameters,"
        " gradients, AdamW's moments, saved activations, logits\n"
        "queued_ms: per step of {queued} captured steps queued without waiting (CUDA),"
        " the host's time to queue them; done_ms: the time until the GPU ran them\n"
        "floor_ms: the larger of flop_ms and byte_ms, at the rates measured (fir_flops,"
        " fir.py's GEMMs', at ieee's: IEEE float32);"
        f" paper_hours: the paper's {PAPER_BATCHES} batches at step_ms; one mixer at a"
        " time, freed after; failed: why a variant has no time",
    ),
    "memory": (
        "Memory of one training step (train.train_step), m = {n_layer}, l = d = {d},"
        " batch {batch} (sa: {n_head} heads), MiB; does it fit a {gpu_gib:g} GiB GPU?",
        "mixer state_mib:.1f saved_mib:.1f peak_mib:.0f reserved_mib:.0f"
        " peak_half_mib:.0f per_seq_mib:.2f fits max_batch",
        "state: parameters and AdamW's moments; peak: with the state (CPU: VmHWM;"
        " CUDA: the step captured, as train.py runs it);"
        " fits: peak (CUDA: reserved) <= {gpu_gib:g} GiB less 1 (left to CUDA)\n"
        "max_batch: fits' figure plus the slope of peak to peak_half (batch {half})",
    ),
    "length": (
        "Sublayer forward+backward, d = {d}, b l = {tokens} tokens (sa: {n_head}"
        " heads); median of {rounds} rounds",
        "mixer threads l batch path params:si ms:.3f ms_per_token:.3g vs_sa:.3f"
        " paper_ops_fwd:si flops:si peak_mib:.0f stop",
        "path: what causal_fir computes (fir.py; section sublayer on CUDA: each path,"
        " the default first); vs_sa: this time over sa's (below 1: faster)\n"
        "paper_ops_fwd: Tables 3-4's sum, the batch's forward; flops: the path's"
        " forward+backward (as --table7 counts)",
    ),
    "generate": (
        "One new token with the cache at position t (t - 1 cached), window l ="
        " {window}, batch {batch}; median of {rounds} rounds",
        "mixer threads t batch ms:.3f ms_per_token:.3g vs_sa:.3f"
        " paper_ops_fwd:si flops:si peak_mib:.0f",
        "paper_ops_fwd: Tables 5-6's sum times the batch; peak_mib: the first call's",
    ),
}


def cell(value, spec):
    """A table's cell: - for none; format si: 1234567 -> 1.23M."""
    if value is None:
        return "-"
    if spec != "si":
        return format(value, spec)
    for unit, size in zip("GMk", (1e9, 1e6, 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(value)


def show(name, rows, s):
    """One section's rows as a table (sublayer's: the length section's, at one l)."""
    title, columns, notes = TABLES["length" if name == "sublayer" else name]
    columns = [c.partition(":")[::2] for c in columns.split()]  # (key, format)
    table = [[key for key, _ in columns]]
    table += [[cell(r.get(key), spec) for key, spec in columns] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    table.insert(1, ["-" * w for w in widths])
    print("\n" + title.format(**s))
    for r in table:  # the first column to the left, the others to the right
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        print("  ".join([r[0].ljust(widths[0])] + rest))
    print("\n".join("  " + n.format(**s) for n in notes.split("\n")), flush=True)


def csv_text(rows):
    """rows as CSV text: a column per key in the order first seen, "" for none."""
    buf = io.StringIO()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(buf, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def parse_args(argv):
    fmt = argparse.ArgumentDefaultsHelpFormatter
    description = __doc__.strip().split("\n\n")[0]
    p = argparse.ArgumentParser(description=description, formatter_class=fmt)
    p.error = lambda msg: fail(f"{msg} (see --help)")
    sections = ",".join(SECTIONS)
    p.add_argument("--sections", default="sublayer,step,memory", help=sections)
    mixers = "sa,she,he,we,me,he-ext"
    p.add_argument("--mixers", default=mixers, help="comma list or all (sa always)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few rounds")
    p.add_argument("--floor", action="store_true", help="step's floor also off CUDA")
    p.add_argument("--n_head", type=int, default=32, help="heads of sa (Table 1's)")
    p.add_argument("--gpu_gib", type=float, default=6.0, help="memory: the GPU's GiB")
    p.add_argument("--json", help="also write every table's rows to this file")
    p.add_argument("--csv", metavar="DIR", help="also each table: DIR/section_cpu.csv")
    p.add_argument("--draw", metavar="CSV", help="a length or generate CSV's figure")
    p.add_argument("-o", "--out", help="--draw's figure (default: the CSV's .png)")
    p.add_argument("--table7", action="store_true", help="Tables 3-7 and the FLOPs")
    args = p.parse_args(argv)
    args.sections = [k.strip() for k in args.sections.split(",") if k.strip()]
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        given = ",".join(args.sections)
        fail(f"--sections takes a comma list of {sections}, got {given!r}")
    names = args.mixers.split(",")
    if args.mixers.strip() == "all":
        names = [*extractor.MIXERS, *extractor.SYNTHESIZERS]
    args.mixers = list(dict.fromkeys(["sa"] + [m.strip() for m in names if m.strip()]))
    args.sizes = {k: sizes[args.quick] for k, sizes in SIZES.items()}
    for m in args.mixers:  # an unknown name, --n_head not dividing d: one line
        machinery.check_mixer(make_config(args.sizes, args, m))
    if args.gpu_gib <= 1:
        fail(f"--gpu_gib must be above 1 (1 GiB is left to CUDA), got {args.gpu_gib}")
    if args.csv and not os.path.isdir(args.csv):
        fail(f"--csv takes a folder; {args.csv!r} is none (make it first)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table7:
        return print_table7()
    if args.draw:
        return draw(args.draw, args.out or os.path.splitext(args.draw)[0] + ".png")
    device = machinery.pick_device(args.device)
    s = args.sizes | dict(n_head=args.n_head, gpu_gib=args.gpu_gib)
    machinery.precision(device, "float32")  # TF32 matmuls on CUDA, as train.py
    threads = torch.get_num_threads()
    info = dict(device=str(device), threads=threads, torch=torch.__version__)
    quick = ", quick" if args.quick else ""
    print("bench.py: " + ", ".join(f"{k} {v}" for k, v in info.items()) + quick)
    results = dict(settings=s | info, sections={})
    t0 = time.perf_counter()
    for name in args.sections:
        if "broken" in s:  # the rest cannot run in this process; what ran is written
            print(f"[{name}] not run: {s['broken']}", file=sys.stderr, flush=True)
            continue
        so_far = time.perf_counter() - t0
        print(f"[{name}] {so_far:.0f} s so far", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        try:
            rows = SECTIONS[name](s, args, device)
        except torch.OutOfMemoryError:
            fail(f"out of memory in section {name}; pick fewer --sections or --mixers")
        results["sections"][name] = rows
        show(name, rows, s)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    files = {args.json: json.dumps(results, indent=1)} if args.json else {}
    for name, rows in results["sections"].items() if args.csv else ():
        files[os.path.join(args.csv, f"{name}_{device.type}.csv")] = csv_text(rows)
    for path, text in files.items():
        try:
            atomic_write(path, text)
        except OSError as e:
            fail(f"cannot write {path!r} ({e.strerror}); the tables above hold it")
    return 1 if "broken" in s else 0


if __name__ == "__main__":
    # `bench.py | head` ends quietly, as a shell tool does (Unix: machinery needs fcntl)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
