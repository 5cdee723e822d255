"""
Every token mixer of extractor.py measured against attention on this device: the paper's cost claims
(Tables 3-7: fewer operations, cheap incremental inference) checked against real kernels.

    python bench.py                                   # sections 1-6 at Table 1 shapes (minutes on a CPU)
    python bench.py --quick                           # tiny shapes, few repeats: seconds
    python bench.py --sections 1,2 --mixers me,we --json bench.json
    python bench.py --device cuda --dtype bf16 --compile
    python bench.py --table7                          # the paper's Table 7, from the formulas

Sections: 1 sublayer forward+backward at Table 1 shapes, 2 context sweep at fixed tokens per batch,
3 whole model training (m = 18 and m = 2; on CUDA, or with --floor, each way of running the step:
captured in a CUDA graph, eager, bf16, compiled with --compile, against the floor its FLOPs and bytes
set at the rates measured in the same run), 4 generation with and without the cache, 5 the paper's
operation counts beside the FLOPs torch.utils.flop_counter measures, 6 the memory of one Table 1
training step (parameters, gradients, AdamW, saved activations, peak) and the largest batch that fits
a GPU (--gpu_gib, default the paper's 6 GB RTX 4050). Times are medians of interleaved
rounds after warm-up (the mixers take turns, so a noisy moment of a shared machine hits them all);
ratios to sa come from the same process. sa (and in section 3 the "none" floor) is always measured.
Each table's columns are the keys of its rows in the --json file.
"""

import argparse
import ctypes
import functools
import gc
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, flop_registry  # noqa: E402

import extractor  # noqa: E402
import fir  # noqa: E402
import rundir  # noqa: E402
import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
import train  # noqa: E402
from common import atomic_write, fail, keep_freed_memory, one_line_errors, pick_device  # noqa: E402
from extractor import MIXERS, Config, Transformer  # noqa: E402

# name: (the paper's Table 1 shapes, the tiny ones of --quick)
SETTINGS = {
    "d": (128, 32),  # Table 1: d, l, the batch size, u and c
    "l": (128, 32),
    "batch": (64, 4),
    "vocab": (5000, 300),
    "hidden": (512, 128),
    "warmup": (3, 1),  # section 1: calls before timing, then interleaved timed rounds
    "rounds": (15, 2),
    "sweep_t": ((128, 256, 512, 1024, 2048), (16, 32, 64)),  # section 2: l = t at a fixed B * t
    "sweep_tokens": (8192, 256),
    "sweep_rounds": (5, 1),
    "layers": ((18, 2), (2, 1)),  # section 3: m of the two models, timed steps per model
    "model_rounds": (4, 1),
    "gemm_n": (
        8192,
        256,
    ),  # section 3's floor: the GEMM (n x n) @ (n x n) and the copy that measure the rates
    "copy_mib": (1024, 16),
    "paper_batches": (60000, 60000),  # Section 6: the paper trains on 60000 batches
    "gen_layers": (2, 1),  # section 4, batch 1
    "gen_block": (512, 32),
    "gen_prompt": (32, 4),
    "gen_new": (256, 8),
    "gen_rounds": (2, 1),
    "mem_layers": (18, 2),  # section 6: m of the model, measured at batch and batch // 2
}
PAPER_MIXERS = ("sa", "she", "he", "we", "me", "he-ext")  # the default: attention and the paper's Extractors
SECTIONS = {1: "sublayer", 2: "sweep", 3: "model", 4: "generation", 5: "flops", 6: "memory"}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# -------------------------------------------------------------------------------------------- timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def progress(text):
    print(f"  {text}", file=sys.stderr, flush=True)


def interleaved(fns, warmup, rounds, device, label, max_call_s=math.inf):
    """Call every fn `warmup` times, then `rounds` rounds in which each fn runs once (the order rotates
    each round). Returns name -> list of seconds, and the set of names whose first warm-up call took
    longer than max_call_s: those are timed by that one call only."""
    times, slow = {k: [] for k in fns}, set()
    for k, fn in fns.items():
        first = timed(fn, device)  # the first call builds plans, caches
        if first > max_call_s:
            times[k] = [first]
            slow.add(k)
            continue
        for _ in range(warmup - 1):
            fn()
    live = [k for k in fns if k not in slow]
    t_start = last = time.perf_counter()
    for r in range(rounds):
        for k in live[r % len(live) :] + live[: r % len(live)] if live else []:
            times[k].append(timed(fns[k], device))
        if time.perf_counter() - last > 10 and r + 1 < rounds:  # progress with an ETA on long work
            done, last = time.perf_counter() - t_start, time.perf_counter()
            eta = done / (r + 1) * (rounds - r - 1)
            progress(f"{label}: round {r + 1}/{rounds}, {done:.0f} s, ETA {eta:.0f} s")
    return times, slow


def med(xs):
    return statistics.median(xs)


def quartile_spread(xs):
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return q(0.75) - q(0.25)


def loglog_slope(ms_by_t, tokens):
    """Least-squares slope of log(time per token) against log(t)."""
    pts = [(math.log(t), math.log(ms / tokens)) for t, ms in ms_by_t.items()]
    if len(pts) < 2:
        return None
    mx, my = (sum(p[i] for p in pts) / len(pts) for i in (0, 1))
    return sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts)


# ---------------------------------------------------------------------------------- what to measure


def fir_taps(module):
    """The Extractor's taps (W_ext or w_ext), None for a mixer without a FIR."""
    return next((p for n, p in module.named_parameters() if n.split(".")[-1] in ("W_ext", "w_ext")), None)


def fir_path(module, t):
    """Which computation a mixer takes at sequence length t on its device: fir.default_path of its taps
    (toeplitz, toeplitz-strided, fft, fft-cuda), else sdpa (attention) or matmul."""
    taps = fir_taps(module)
    if taps is None:
        return "sdpa" if isinstance(module, extractor.SelfAttention) else "matmul"
    return fir.default_path(taps.device.type, taps.dim(), t)


def sublayer_paths(module, t, device):
    """The paths section 1 times for a mixer: on CUDA every FIR path that computes its taps, the default
    first, so that a GPU run decides fir.py's defaults; elsewhere the default alone."""
    taps = fir_taps(module)
    if taps is None:
        return [fir_path(module, t)]
    default = fir.default_path(device.type, taps.dim(), t)
    if device.type != "cuda":
        return [default]
    return [default] + [p for p, dims in fir.PATHS.items() if taps.dim() in dims and p != default]


def forced(path, step):
    """step, with every FIR inside it taking this path (sdpa and matmul have none to force)."""

    def run():
        with fir.forcing(path) if path in fir.PATHS else nullcontext():
            step()

    return run


def make_config(s, args, mixer, l, n_layer=1):
    return Config(
        vocab_size=s["vocab"], block_size=l, n_embd=s["d"], n_hidden=s["hidden"], n_layer=n_layer,
        n_head=args.n_head, mixer=mixer,
    )  # fmt: skip


def sublayer_step(module, x, g, ctx):
    """Forward and backward of one first sublayer; gradients are dropped as zero_grad would."""

    def step():
        with ctx:
            y = module(x)  # (B, t, d)
        y.backward(g.to(y.dtype))
        module.zero_grad(set_to_none=True)
        x.grad = None

    return step


class NoMixer(nn.Module):
    """The floor of section 3: the first sublayer adds nothing (Layer still adds zeros and drops them out)."""

    def forward(self, x, cache=None):
        return torch.zeros_like(x)


def build_model(s, args, mixer, n_layer, device):
    model = Transformer(make_config(s, args, "me" if mixer == "none" else mixer, s["l"], n_layer))
    if mixer == "none":
        for layer in model.layers:
            layer.mixer, layer.ln1 = NoMixer(), nn.Identity()
    return model.to(device)


def make_optimizer(model, device):
    cuda = device.type == "cuda"  # as train.py: fused, and capturable in a CUDA graph
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=cuda, capturable=cuda)


def peak_bytes(step, model, opt, device):
    """Peak memory of one training step: the high-water mark above what was resident before it, plus
    this model's parameters and AdamW states (resident before it). cpu: Linux VmHWM, reset through
    /proc/self/clear_refs after giving free heap back; cuda: max_memory_allocated. None elsewhere."""
    tensors = list(model.parameters()) + [v for st in opt.state.values() for v in st.values()]
    state = sum(v.numel() * v.element_size() for v in tensors if torch.is_tensor(v))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base + state
    if device.type != "cpu" or not os.path.exists("/proc/self/clear_refs"):
        return None

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give free heap back, so RSS shows only live memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except (OSError, AttributeError):
        return None
    base = status("VmRSS:")
    step()
    return status("VmHWM:") - base + state


def storage_bytes(tensors):
    """Bytes of the storages under these tensors, each storage once: views share their base's."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def saved_for_backward(fn, params):
    """Call fn; return its result and the bytes autograd saved for backward meanwhile: each storage once
    (q, k and v are views of one tensor), the parameters' left out (a layer saves its weight, which is
    no activation). Exact, and blind to the allocator: the hooks see each tensor the device's kernels save."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    saved = {}  # data_ptr -> bytes; a saved tensor lives until backward, so no address is reused

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def step_memory(model, opt, step, device):
    """One training step taken apart, in bytes: parameters, their gradients (recorded as each is
    accumulated: the step frees them at its end), AdamW's exp_avg and exp_avg_sq, the activations
    saved for backward; then the peak of a second step (peak_bytes). The first step also warms up."""
    params = list(model.parameters())
    grads = {}  # id(param) -> bytes of its gradient
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: grads.update({id(p): p.grad.nbytes})) for p in params
    ]
    try:
        _, saved = saved_for_backward(step, params)
    finally:
        for h in hooks:
            h.remove()
    adamw = storage_bytes(st[k] for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    return dict(
        params=storage_bytes(params), grads=sum(grads.values()), adamw=adamw, saved=saved,
        peak=peak_bytes(step, model, opt, device),
    )  # fmt: skip


def largest_batch(b, peak, b_half, peak_half, budget):
    """Peak memory grows linearly with the batch (activations and their gradients; parameters and
    AdamW stay): fit peak(B) = fixed + B * per_seq through the two measured points and return
    (per_seq, the largest B with peak(B) <= budget); None where the two points do not rise."""
    per_seq = (peak - peak_half) / (b - b_half)
    if per_seq <= 0:
        return per_seq, None
    return per_seq, max(0, math.floor((budget - (peak - b * per_seq)) / per_seq))


def complete_mapping():
    """FlopCounterMode additions for what it leaves out here: SDPA's CPU kernel (counted with the
    flash kernel's formula: full t x t, the causal half not subtracted), complex bmm (8 real flops
    per complex multiply-add, not 2), elementwise mul (1 flop, 6 if complex), and FFTs, estimated as
    2.5 n log2(n) real flops per real transform of length n (half a complex radix-2 FFT's 5 n log2 n)."""
    aten = torch.ops.aten

    def bmm(a, b, *args, out_val=None, **kwargs):
        return flop_registry[aten.bmm](a, b, out_val=out_val) * (4 if a.is_complex() else 1)

    def mul(a, b, *args, out_val=None, **kwargs):
        return out_val.numel() * (6 if out_val.is_complex() else 1) if torch.is_tensor(out_val) else 0

    def sdpa_cpu(*args, out_val=None, **kwargs):
        return flop_registry[aten._scaled_dot_product_flash_attention](*args, out_val=out_val, **kwargs)

    def sdpa_cpu_backward(grad_out, query, key, value, *args, out_val=None, **kwargs):
        flash = flop_registry[aten._scaled_dot_product_flash_attention_backward]
        return flash(grad_out, query, key, value, out_val=out_val)

    def r2c(x, dim, *args, out_val=None, **kwargs):
        return int(2.5 * x.numel() * math.log2(math.prod(x.shape[d] for d in dim)))

    def c2r(x, dim, normalization, last_dim_size, *args, out_val=None, **kwargs):
        return int(2.5 * out_val.numel() * math.log2(math.prod(out_val.shape[d] for d in dim)))

    for f in (bmm, mul, sdpa_cpu, sdpa_cpu_backward, r2c, c2r):
        f._get_raw = True
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward,
        aten.bmm: bmm,
        aten.mul: mul,
        aten._fft_r2c: r2c,
        aten._fft_c2r: c2r,
    }


def maybe_compile(module, args):
    return torch.compile(module) if args.compile else module


# ---------------------------------------------------- the five sections; each returns a list of rows


def section_sublayer(s, args, mixers, device, ctx):
    x = torch.randn(s["batch"], s["l"], s["d"], device=device, requires_grad=True)  # (B, t, d)
    g = torch.randn(s["batch"], s["l"], s["d"], device=device)
    steps = {}  # (mixer, path) -> step
    for m in mixers:
        module = MIXERS[m](make_config(s, args, m, s["l"])).to(device)
        for path in sublayer_paths(module, s["l"], device):
            steps[m, path] = forced(path, sublayer_step(maybe_compile(module, args), x, g, ctx))
    times, _ = interleaved(steps, s["warmup"], s["rounds"], device, "sublayer")
    ms = {k: 1e3 * med(times[k]) for k in steps}
    sa = ms["sa", "sdpa"]
    return [
        dict(mixer=m, path=p, ms=ms[m, p], iqr_ms=1e3 * quartile_spread(times[m, p]), vs_sa=ms[m, p] / sa)
        for m, p in steps
    ]


def section_sweep(s, args, mixers, device, ctx):
    ms = {m: {} for m in mixers}  # mixer -> t -> ms
    paths, one_call = {m: {} for m in mixers}, {m: [] for m in mixers}
    for t in s["sweep_t"]:
        B = max(1, s["sweep_tokens"] // t)
        x = torch.randn(B, t, s["d"], device=device, requires_grad=True)  # (B, t, d), B * t fixed
        g = torch.randn(B, t, s["d"], device=device)
        steps = {}
        for m in mixers:
            if m == "sa" or not one_call[m]:  # a mixer too slow at a shorter t skips the longer ones
                module = MIXERS[m](make_config(s, args, m, t)).to(device)
                paths[m][t] = fir_path(module, t)
                steps[m] = sublayer_step(maybe_compile(module, args), x, g, ctx)
        progress(f"sweep: t = {t}, batch {B}: {', '.join(steps)}")
        times, slow = interleaved(steps, 2, s["sweep_rounds"], device, f"sweep t={t}", args.max_call_s)
        for m, ts in times.items():
            ms[m][t] = 1e3 * med(ts)
            one_call[m] += [t] if m in slow else []
        del steps, times
    rows = []
    for m in mixers:
        row = dict(mixer=m, path=path_ranges(paths[m]))
        row.update({f"ms_t{t}": ms[m].get(t) for t in s["sweep_t"]})
        row.update({f"vs_sa_t{t}": ms[m][t] / ms["sa"][t] if t in ms[m] else None for t in s["sweep_t"]})
        rows.append(dict(row, slope=loglog_slope(ms[m], s["sweep_tokens"]), one_call=one_call[m]))
    return rows


def path_ranges(path_by_t):
    """{128: 'toeplitz', 256: 'toeplitz', 1024: 'fft'} -> 'toeplitz 128-256, fft 1024'."""
    spans = []
    for t, p in path_by_t.items():
        if spans and spans[-1][0] == p:
            spans[-1][2] = t
        else:
            spans.append([p, t, t])
    if len(spans) == 1:
        return spans[0][0]
    return ", ".join(f"{p} {a}" + (f"-{b}" if b != a else "") for p, a, b in spans)


def section_model(s, args, mixers, device, ctx, dtype):
    if device.type == "cuda" or args.floor:
        return section_model_floor(s, args, mixers, device)
    B, l, rows = s["batch"], s["l"], []
    data = torch.randint(0, s["vocab"], (B, l + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)  # (B, l) inputs and next tokens
    for n_layer in s["layers"]:
        models, steps = {}, {}
        for m in mixers:
            torch.manual_seed(0)
            model = build_model(s, args, m, n_layer, device).train()
            opt = make_optimizer(model, device)
            scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
            compiled = maybe_compile(model, args)
            models[m] = (model, opt)  # one Table 1 training step, exactly train.py's
            steps[m] = lambda c=compiled, o=opt, sc=scaler: train.train_step(c, o, sc, ctx, x, y)
        progress(f"model m = {n_layer}: {len(steps)} models")
        times, _ = interleaved(steps, 2, s["model_rounds"], device, f"model m={n_layer}")
        for m in mixers:
            step_s, peak = med(times[m]), peak_bytes(steps[m], *models[m], device)
            rows.append(
                dict(
                    model=f"m={n_layer}",
                    mixer=m,
                    params=sum(p.numel() for p in models[m][0].parameters()),
                    step_ms=1e3 * step_s,
                    tokens_per_s=B * l / step_s,
                    vs_sa=med(times["sa"]) / step_s,
                    peak_mb=None if peak is None else peak / 2**20,
                    paper_hours=s["paper_batches"] * step_s / 3600,
                )
            )
        del models, steps, times
    return rows


# Section 3 on CUDA (and with --floor): every way of running the step, against the floor it counts.
# name -> (autocast dtype, how the step runs); train.py's step on CUDA first (gpu.py reads a model's
# first row), then the others; compiled with --compile only (minutes of compiling per model)
VARIANTS = {
    "captured": ("float32", "captured"),
    "eager": ("float32", "eager"),
    "bf16-captured": ("bfloat16", "captured"),
    "bf16": ("bfloat16", "eager"),
    "compiled": ("float32", "compiled"),
}


def section_model_floor(s, args, mixers, device):
    """Each variant's training step (train.train_step, as train.py runs it on this device) timed, beside
    the floor counted for its model: FLOPs over the measured matrix rate, the fewest bytes over the
    measured copy rate, whichever is longer. float32 as train.py: TF32 matmuls on CUDA."""
    cuda = device.type == "cuda"  # the CPU: eager (and compiled), float32
    variants = [v for v, (dt, how) in VARIANTS.items() if (cuda or dt == "float32" and how != "captured")]
    variants = [v for v in variants if v != "compiled" or args.compile]
    tf32_before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        ctxs = {dt: train.precision(device, dt)[0] for dt in dict.fromkeys(VARIANTS[v][0] for v in variants)}
        rates = measure_rates(device, list(ctxs), s)
        rows = [
            row
            for n_layer in s["layers"]
            for row in floor_rows(s, args, mixers, device, n_layer, variants, ctxs, rates)
        ]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
    return rows


def measure_rates(device, dtypes, s):
    """This machine's rates, measured once: FLOP/s of an (n x n) @ (n x n) GEMM in each dtype (float32
    under the TF32 setting in effect) and bytes/s of a large copy (each byte read once, written once).
    On the CPU at most n = 2048 and 256 MiB."""
    cpu = device.type != "cuda"
    n, mib = min(s["gemm_n"], 2048) if cpu else s["gemm_n"], min(s["copy_mib"], 256) if cpu else s["copy_mib"]
    fns = {}
    for dt in dtypes:
        a, b = (torch.randn(n, n, device=device).to(getattr(torch, dt)) for _ in range(2))
        fns[dt] = functools.partial(torch.mm, a, b, out=torch.empty_like(a))
    src = torch.randn(mib * 2**18, device=device)  # float32: mib MiB
    fns["copy"] = functools.partial(torch.Tensor.copy_, torch.empty_like(src), src)
    times, _ = interleaved(fns, 2, 10, device, "rates")
    rates = {dt: 2 * n**3 / med(times[dt]) for dt in dtypes}
    rates["copy"] = 2 * src.nbytes / med(times["copy"])
    s.update(gemm=f"{n}^3 GEMM", copy=f"{mib} MiB copy", rates=", ".join(
        [f"{dt}{' (TF32)' * (dt == 'float32' and not cpu and torch.backends.cuda.matmul.allow_tf32)} "
         f"{rates[dt] / 1e12:.3g} TFLOP/s" for dt in dtypes] + [f"copy {rates['copy'] / 1e9:.4g} GB/s"]
    ))  # fmt: skip
    return rates


def step_counts(model, opt, step, logits):
    """One training step counted, (FLOPs, bytes): its FLOPs as torch.utils.flop_counter counts them
    (completed as in section 5; forward, backward, AdamW's none) and the fewest bytes it must move:
    parameters, gradients and AdamW's two moments each read and written once, each activation saved for
    backward written once and read once, the logits (`logits` bytes) written once and read once."""
    params = list(model.parameters())
    with FlopCounterMode(display=False, custom_mapping=complete_mapping()) as counter:
        _, saved = saved_for_backward(step, params)
    moments = storage_bytes(st[k] for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    state = 2 * storage_bytes(params) + moments  # parameters, their gradients (as large), the moments
    return counter.get_total_flops(), 2 * (state + saved + logits)


def floor_rows(s, args, mixers, device, n_layer, variants, ctxs, rates):
    """Section 3's rows at m = n_layer: a model and AdamW per mixer, shared by its variants (a captured
    step past its warm-up and capture, a compiled one past compiling: one line where that fails, and no
    row), timed in interleaved rounds; the floor from step_counts and the rates."""
    B, l, rounds = s["batch"], s["l"], s["model_rounds"] * (5 if device.type == "cuda" else 1)
    s["floor_rounds"] = rounds
    data = torch.randint(0, s["vocab"], (B, l + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)  # (B, l) inputs and next tokens
    if "compiled" in variants:  # a compiled model per mixer, each a new Transformer.forward to compile
        torch._dynamo.config.recompile_limit = 64
    steps, counts, params = {}, {}, {}
    for m in mixers:
        torch.manual_seed(0)
        model = build_model(s, args, m, n_layer, device).train()
        opt, scaler = make_optimizer(model, device), torch.amp.GradScaler(device.type, enabled=False)
        params[m] = sum(p.numel() for p in model.parameters())
        for dt, ctx in ctxs.items():  # (also AdamW's first step, which makes its moments)
            logits = B * l * s["vocab"] * (2 if dt == "bfloat16" else 4)
            counts[m, dt] = step_counts(
                model, opt, lambda: train.train_step(model, opt, scaler, ctx, x, y), logits
            )
        for v in variants:
            dt, how = VARIANTS[v]
            step = functools.partial(
                train.train_step, torch.compile(model) if how == "compiled" else model, opt, scaler, ctxs[dt]
            )
            step = rundir.CapturedStep(step) if how == "captured" else step
            try:
                for _ in range(4 if how == "captured" else 1 if how == "compiled" else 0):
                    step(x, y)  # a captured step: 3 eager warm-up steps, then the capture
            except Exception as e:  # torch.compile does not generate code for complex tensors (SHE, HE, WE)
                print(f"  m={n_layer} {m} {v} fails, no row: {type(e).__name__}: {first_line(e)}", flush=True)
                continue
            steps[m, v] = functools.partial(step, x, y)
    progress(f"model m = {n_layer}: {len(mixers)} models, {len(steps)} steps")
    times, _ = interleaved(steps, 2, rounds, device, f"model m={n_layer}")
    rows = []
    for (m, v), ts in times.items():
        dt, t = VARIANTS[v][0], med(ts)
        flops, moved = counts[m, dt]
        flop_s, byte_s = flops / rates[dt], moved / rates["copy"]
        floor, sa = max(flop_s, byte_s), times.get(("sa", v))
        rows.append(dict(
            model=f"m={n_layer}", mixer=m, variant=v, params=params[m], step_ms=1e3 * t,
            tokens_per_s=B * l / t, vs_sa=med(sa) / t if sa else None, flops=flops,
            bytes=moved, flop_ms=1e3 * flop_s, byte_ms=1e3 * byte_s, floor_ms=1e3 * floor,
            vs_floor=t / floor, paper_hours=s["paper_batches"] * t / 3600, flop_rate=rates[dt],
            byte_rate=rates["copy"],
        ))  # fmt: skip
    return sorted(rows, key=lambda r: (mixers.index(r["mixer"]), list(VARIANTS).index(r["variant"])))


def first_line(e):
    return (str(e).strip().splitlines() or [""])[0][:80]


def generate_timed(model, prompt, n_new, use_cache, ctx, device):
    """Generate greedily; return the tokens and the seconds from the start to each new token (on
    cuda and mps synchronised at each token, so a stamp is the token's compute, not its launch)."""
    sync(device)
    t0, stamps, toks = time.perf_counter(), [], []
    with ctx:
        for nxt in model.generate_stream(prompt, n_new, temperature=0, use_cache=use_cache):
            toks.append(nxt)
            sync(device)
            stamps.append(time.perf_counter() - t0)
    return torch.cat(toks, 1), stamps


def section_generation(s, args, mixers, device, ctx):
    n_new, rows, models = s["gen_new"], [], {}
    prompt = torch.randint(0, s["vocab"], (1, s["gen_prompt"]), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)  # (1, prompt)
    for m in mixers:
        torch.manual_seed(0)
        cfg = make_config(s, args, m, s["gen_block"], s["gen_layers"])
        models[m] = Transformer(cfg).to(device).eval()
    res = {(m, c): [] for m in mixers for c in (True, False)}
    t_start, calls = time.perf_counter(), (s["gen_rounds"] + 1) * len(mixers)
    for r in range(s["gen_rounds"] + 1):  # round 0 is the warm-up
        for i, m in enumerate(mixers):
            for c in (True, False):
                toks, stamps = generate_timed(models[m], prompt, n_new, c, ctx, device)
                res[m, c] += [(toks, stamps)] if r > 0 else []
            done, k = time.perf_counter() - t_start, r * len(mixers) + i + 1
            progress(f"generation: round {r}, {m}, {done:.0f} s, ETA {done / k * (calls - k):.0f} s")
    for m in mixers:
        row = dict(mixer=m)
        for c, key in ((True, "cached"), (False, "full")):
            totals = [st[-1] for _, st in res[m, c]]
            lat = [b - a for _, st in res[m, c] for a, b in zip(st, st[1:])]  # one forward per new token
            row[f"{key}_tokens_per_s"] = n_new / med(totals)
            row[f"{key}_ms_per_token"] = 1e3 * med(lat) if lat else 1e3 * med(totals)
        row["speedup"] = row["cached_tokens_per_s"] / row["full_tokens_per_s"]
        a, b = res[m, True][0][0], res[m, False][0][0]
        same = int((a == b).all(0).long().cumprod(0).sum())  # agreeing prefix length
        rows.append(dict(row, same_tokens=f"{same}/{n_new}"))
    return rows


# -------------------------------------------------------- the paper's operation counts, Tables 3-7
# In closed form; tests.py checks them against the tables' sums. Section 5 sets them beside the FLOPs
# measured, --table7 prints Table 7. `complexity_training` is for one sequence of length l;
# `complexity_inference` is the increment for one new token at sequence length t.


def complexity_training(d, l, n=1):
    """Tables 3 and 4: multiplications, additions, divisions, exponentiations, parameters. SHE's
    multiplications use the summand d*d*t + d*d + d + d*d (Notes on the paper, 5)."""
    counts = {  # (mult, add, div, exp, params)
        "sa": (l * l * d + 4 * l * d * d + l * d, l * l * d + 4 * l * d * d - 4 * l * d - l * n,
               n * l * l + n * l, (n * l * l + n * l) // 2, 4 * d * d),
        "she": ((l * l * d * d + 5 * l * d * d) // 2 + l * d,
                (l * l * d * d + 5 * l * d * d) // 2 - 3 * l * d, 0, 0, l * d * d + 2 * d * d),
        "he": ((l * l * d + 3 * l * d) // 2 + 3 * l * d * d, 3 * l * d * d + (l * l * d - 7 * l * d) // 2,
               0, 0, l * d + 3 * d * d),
        "we": ((l * l * d + 3 * l * d) // 2 + 2 * l * d * d, 2 * l * d * d + (l * l * d - 5 * l * d) // 2,
               0, 0, l * d + 2 * d * d),
        "me": ((l * l * d + l * d) // 2, (l * l * d - l * d) // 2, 0, 0, l),
    }  # fmt: skip
    return {k: dict(zip(("mult", "add", "div", "exp", "params"), v)) for k, v in counts.items()}


def complexity_inference(d, t, n=1):
    """Tables 5 and 6: the increment for one new token at sequence length t. SA's additions are
    the paper's own per-token sum, 2td + 4d^2 - 5d - n, whose sum over t = 1..l is Table 3's count;
    the printed closed form 2td - tn + t + 4d^2 - 5d - 1 undercounts it by (n-1)(t-1) (Notes, 6)."""
    return {
        "sa": dict(
            mult=2 * t * d + 4 * d * d, add=2 * t * d + 4 * d * d - 5 * d - n, div=2 * t * n, exp=t * n
        ),
        "she": dict(mult=t * d * d + 2 * d * d + d, add=t * d * d + 2 * d * d - 3 * d, div=0, exp=0),
        "he": dict(mult=t * d + 3 * d * d + d, add=t * d + 3 * d * d - 4 * d, div=0, exp=0),
        "we": dict(mult=t * d + 2 * d * d + d, add=t * d + 2 * d * d - 3 * d, div=0, exp=0),
        "me": dict(mult=t * d, add=t * d - d, div=0, exp=0),
    }


def table7(d=128, l=128):
    """Table 7's columns: (label, mixer, n) -> counts with 'total' arithmetic operations."""
    cols = [("1-head SA", "sa", 1), ("32-head SA", "sa", 32), ("SHE", "she", 1)]
    cols += [("HE", "he", 1), ("WE", "we", 1), ("ME", "me", 1)]
    out = {}
    for label, mixer, n in cols:
        c = dict(complexity_training(d, l, n)[mixer])
        c["total"] = c["mult"] + c["add"] + c["div"] + c["exp"]
        out[label] = (mixer, n, c)
    return out


def mixer_param_count(mixer, d, l, n=1):
    """Parameters of one sublayer built from the module itself (no mixer has biases)."""
    module = MIXERS[mixer](Config(n_embd=d, block_size=l, n_head=n, mixer=mixer))
    return sum(p.numel() for p in module.parameters())


def print_table7():
    """Table 7 (d = l = 128) from the formulas, and below it the parameters counted from the modules."""
    cols = table7()
    print("Table 7 (d = l = 128): the paper's formulas, and the parameters counted from the modules")
    print(f"{'':>8}" + "".join(f"{label:>14}" for label in cols))
    for r in ["mult", "add", "div", "exp", "params", "total"]:
        print(f"{r:>8}" + "".join(f"{c[r]:>14,}" for _, _, c in cols.values()))
    counts = [mixer_param_count(m, 128, 128, n) for m, n, _ in cols.values()]
    print(f"{'modules':>8}" + "".join(f"{c:>14,}" for c in counts))


def section_flops(s, args, mixers, device):
    d, l, rows = s["d"], s["l"], []
    x = torch.randn(1, l, d)  # one sequence, (1, t, d)
    for m in mixers:
        module = MIXERS[m](make_config(s, args, m, l))
        paper = complexity_training(d, l, args.n_head if m == "sa" else 1).get(m)
        with torch.no_grad(), FlopCounterMode(display=False) as stock:
            module(x)
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=complete_mapping()) as full:
            module(x)
        by_op = {str(k).split(".")[-1]: v for k, v in full.get_flop_counts()["Global"].items()}
        mult_add = None if paper is None else paper["mult"] + paper["add"]
        rows.append(
            dict(
                mixer=m,
                path=fir_path(module, l),
                paper_ops=None if paper is None else mult_add + paper["div"] + paper["exp"],
                paper_mult_add=mult_add,
                stock_flops=stock.get_total_flops(),
                fft_flops_est=sum(v for k, v in by_op.items() if "fft" in k),
                completed_flops=full.get_total_flops(),
                completed_vs_paper=None if not mult_add else full.get_total_flops() / mult_add,
                by_op=by_op,
            )
        )
    return rows


def section_memory(s, args, mixers, device, ctx, dtype):
    B, half, MiB = s["batch"], s["half_batch"], 2**20
    mib = lambda v: None if v is None else v / MiB
    rows = []
    for m in mixers:
        full, lo = (memory_at_batch(s, args, m, b, device, ctx, dtype) for b in (B, half))
        per_seq = fit = fits = None
        if full["peak"] is not None:  # None on mps
            per_seq, fit = largest_batch(B, full["peak"], half, lo["peak"], s["budget_mib"] * MiB)
            fits = "yes" if full["peak"] <= s["budget_mib"] * MiB else "no"
        row = dict(mixer=m, **{f"{k}_mib": mib(v) for k, v in full.items()})
        row.update(saved_half_mib=mib(lo["saved"]), peak_half_mib=mib(lo["peak"]), per_seq_mib=mib(per_seq))
        rows.append(dict(row, fits=fits, max_batch=fit))
    return rows


def memory_at_batch(s, args, mixer, B, device, ctx, dtype):
    """step_memory of a fresh model (m = mem_layers, Table 1 otherwise) at batch B; the last one's freed."""
    progress(f"memory: {mixer}, batch {B}")
    gc.collect()  # the previous model and its optimizer, so that they cannot count here
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build_model(s, args, mixer, s["mem_layers"], device).train()
    opt = make_optimizer(model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    data = torch.randint(0, s["vocab"], (B, s["l"] + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)  # (B, l) inputs and next tokens
    return step_memory(model, opt, lambda: train.train_step(model, opt, scaler, ctx, x, y), device)


# ---------------------------------------------------------------------------------------------- tables

# Each section's table, printed by show(): a block of "name: title", its columns (a row's key, with a
# format after the colon; "per t" for the sweep's, see sweep_columns) and its notes, "- " each. A
# backslash at a line's end continues it; {d}, {rounds}, ... are filled from the settings.
TABLE_TEXT = """
sublayer: 1. Sublayer forward+backward, d = l = {d}, batch {batch} (sa: {n_head} heads); \
median of {rounds} interleaved rounds
mixer path ms:.2f iqr_ms:.2f vs_sa:.3f
- path: the computation causal_fir takes (fir.py's paths), sdpa for attention, matmul otherwise; \
on cuda a row per FIR path that computes the mixer's taps, its default first

sweep: 2. Context sweep, l = t, batch * t = {sweep_tokens} tokens: forward+backward ms, ratio to sa, \
slope of log(time per token) vs log(l)
per t
- path: the computation taken at each t (scalar taps: toeplitz below t = {fft_min_t}, then fft)
- one_call: t at which one call took over --max_call_s, so it was timed once; longer t skipped

model: 3. Whole model training step (fwd, loss, bwd, AdamW), batch {batch} x {l}, Table 1 otherwise; \
median of {model_rounds} interleaved steps
model mixer params:si step_ms:.0f tokens_per_s:.0f vs_sa:.2f peak_mb:.0f paper_hours:.1f
- none: no first sublayer (zeros added): embeddings, FFNs and the softmax are the floor
- peak_mb: high-water mark of one step above the memory resident before it, plus the parameters \
and AdamW states (cpu: Linux VmHWM)
- paper_hours: the paper's {paper_batches} batches at this step time

model_floor: 3. Whole model training step (fwd, loss, bwd, AdamW) against its floor, batch {batch} x {l}, \
Table 1 otherwise; median of {floor_rounds} interleaved steps; rates measured: {rates}
model mixer variant params:si step_ms:.2f tokens_per_s:.0f vs_sa:.2f flops:si bytes:si flop_ms:.3f \
byte_ms:.3f floor_ms:.3f vs_floor:.1f paper_hours:.2f
- variant: train.train_step as train.py runs it, float32 (TF32 matmuls on CUDA) or bf16 autocast; captured: \
replayed as a CUDA graph (rundir.CapturedStep, train.py's default on CUDA); compiled: torch.compile(model)
- flops: one step's FLOPs, torch.utils.flop_counter completed as in section 5 (backward included)
- bytes: the fewest bytes one step must move: parameters, gradients, AdamW's two moments read and \
written once, each activation saved for backward written and read once, the logits written and read once
- flop_ms, byte_ms: flops at the GEMM rate of the variant's dtype ({gemm}), bytes at the copy rate \
({copy}); floor_ms: the larger; vs_floor: step_ms / floor_ms
- vs_sa: sa's step time over this one, same variant (above 1: faster)
- paper_hours: the paper's {paper_batches} batches at this step time
- expected before any GPU ran it, at m = 18 on an H100/H200: captured 4-9x eager's speed and still 4-10x \
its floor, since each of the step's 480-1070 unfused ops reads and writes its tensors (9-19 GB)

generation: 4. Generation, batch 1, {gen_prompt}-token prompt, {gen_new} new tokens (greedy), \
m = {gen_layers}, l = {gen_block}, d = {d}; median of {gen_rounds} rounds
mixer cached_tokens_per_s:.0f cached_ms_per_token:.2f full_tokens_per_s:.0f full_ms_per_token:.2f \
speedup:.1f same_tokens
- ms_per_token: median time of one new token; tokens_per_s includes the prompt's forward
- same_tokens: leading tokens on which cached and full recomputation agree (beyond l both run \
a forward over the last l tokens per token, Eq. 2)

flops: 5. One sublayer forward, one sequence, d = l = {d}: the paper's Tables 3/4 counts against \
torch.utils.flop_counter
mixer path paper_ops:si paper_mult_add:si stock_flops:si fft_flops_est:si completed_flops:si \
completed_vs_paper:.2f
- paper_ops: mult+add+div+exp of complexity_training (sa with n = --n_head)
- stock_flops: FlopCounterMode as shipped: matmuls only, 2 flops per multiply-add, complex ones \
as real; no FFT, no elementwise op, not SDPA's cpu kernel (sa: projections only)
- completed_flops: adds SDPA's cpu kernel (full t x t, causal half not subtracted), complex bmm \
x4 (8 real flops per complex multiply-add), elementwise mul (6 if complex)
-   and FFTs estimated at 2.5 n log2 n per real transform (fft_flops_est); softmax, exp and \
additions outside matmuls are still not counted

memory: 6. Memory of one training step (train.train_step: fwd, loss, bwd, AdamW), m = {mem_layers}, \
l = d = {d}, batch {batch} (sa: {n_head} heads), MiB; does it fit a {gpu_gib:g} GiB GPU?
mixer params_mib:.1f grads_mib:.1f adamw_mib:.1f saved_mib:.1f peak_mib:.0f saved_half_mib:.1f \
peak_half_mib:.0f per_seq_mib:.2f fits max_batch
- params, grads, adamw (exp_avg + exp_avg_sq): the tensors of one train.train_step; saved: what \
autograd saves for backward in it, each storage once, parameters left out
- peak: high-water mark of the next train.train_step, with the parameters and AdamW states \
(cpu: Linux VmHWM; cuda: max_memory_allocated)
- *_half: the same at batch {half_batch}; per_seq: the peak's slope, (peak - peak_half) / {half_batch}
- fits: peak <= {budget_mib:.0f} MiB, a {gpu_gib:g} GiB GPU less a {margin_gib:g} GiB margin (the \
CUDA context takes a few hundred MB that max_memory_allocated does not count, plus
-   the caching allocator's slack); max_batch: the largest batch under it on the line through \
both peaks
"""


def parse_tables(text):
    """TABLE_TEXT as {name: (title, columns, notes)}."""
    tables = {}
    for block in text.strip().split("\n\n"):
        head, columns, *notes = block.split("\n")
        name, title = head.split(": ", 1)
        tables[name] = (title, columns, [n[2:] for n in notes])
    return tables


TABLES = parse_tables(TABLE_TEXT)


def fmt(v, spec):
    """One cell: '-' for nothing, 1234567 -> '1.23M' for spec 'si', else format(v, spec)."""
    if v is None or v == []:
        return "-"
    if isinstance(v, list):
        return ",".join(map(str, v))
    if spec == "si":
        unit, div = next(((u, x) for u, x in (("G", 1e9), ("M", 1e6), ("k", 1e3)) if abs(v) >= x), ("", 1))
        return f"{v / div:.2f}{unit}" if unit else str(int(v))
    return format(v, spec)


def sweep_columns(s):
    ts = s["sweep_t"]
    return " ".join(["mixer path"] + [f"ms_t{t}:.1f" for t in ts] + [f"vs_sa_t{t}:.2f" for t in ts]) + (
        " slope:.2f one_call"
    )


def show(name, rows, s):
    """Print one section's rows as a table: a title, the columns, a dashed line, the rows, the notes."""
    title, columns, notes = TABLES[name]
    columns = sweep_columns(s) if columns == "per t" else columns
    columns = [c.partition(":")[::2] for c in columns.split()]  # (key, spec)
    table = [[key for key, _ in columns]] + [[fmt(r[k], spec) for k, spec in columns] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    line = lambda r: "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    print("\n" + title.format(**s))
    print("\n".join([line(table[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in table[1:]]))
    print("\n".join(f"  {n.format(**s)}" for n in notes))


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Benchmark every token mixer against attention (sections 1-6).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    one_line_errors(p, "bench.py")
    p.add_argument(
        "--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps"
    )
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="fp32, or bf16/fp16 autocast")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile sublayers and models (not generation)"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: runs in seconds")
    p.add_argument("--floor", action="store_true", help="section 3 against its floor also off CUDA")
    sections = ", ".join(f"{k} {v}" for k, v in SECTIONS.items())
    p.add_argument("--sections", default="1,2,3,4,5,6", help=f"comma list of: {sections}")
    p.add_argument(
        "--mixers", default=",".join(PAPER_MIXERS), help="comma list, or 'all' (sa is always added)"
    )
    p.add_argument("--sweep_mixers", default=None, help="mixers of section 2, or 'all'; default: --mixers")
    p.add_argument("--max_call_s", type=float, default=20.0, help="sweep: slower calls are timed once")
    p.add_argument("--n_head", type=int, default=32, help="heads of sa (Table 1: 32)")
    p.add_argument("--gen_layers", type=int, default=None, help="section 4: m of the model (default 2)")
    p.add_argument("--gen_block", type=int, default=None, help="section 4: its l (default 512)")
    p.add_argument("--gpu_gib", type=float, default=6.0, help="section 6: the GPU's memory (paper: 6 GB)")
    p.add_argument("--margin_gib", type=float, default=1.0, help="section 6: of it kept for CUDA itself")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    p.add_argument("--no_malloc_tune", action="store_true", help="leave glibc's allocator at its defaults")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.add_argument("--table7", action="store_true", help="print the paper's Table 7 (no timing) and exit")
    args = p.parse_args(argv)
    try:
        args.sections = sorted({int(x) for x in args.sections.split(",") if x.strip()})
    except ValueError:
        fail(f"--sections takes numbers, e.g. 1,3, got {args.sections!r}")
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        fail(f"--sections must be a comma list of {', '.join(map(str, SECTIONS))}, got {args.sections}")
    args.mixers = pick_mixers(args.mixers, "--mixers")
    args.sweep_mixers = pick_mixers(args.sweep_mixers or ",".join(args.mixers), "--sweep_mixers")
    for k in ("n_head", "gen_layers", "gen_block"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            fail(f"--{k} must be at least 1, got {getattr(args, k)}")
    if args.threads < 0 or not args.max_call_s > 0:
        fail("--threads must be >= 0 and --max_call_s > 0")
    if not 0 <= args.margin_gib < args.gpu_gib:
        fail(f"need 0 <= --margin_gib < --gpu_gib, got {args.margin_gib} and {args.gpu_gib}")
    if args.json:
        check_writable(args.json)
    return args


def check_writable(path):
    """--json is written at the end: a path it cannot be written to is one line before any timing."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        fail(f"the folder of --json {path!r} does not exist; create it or pick another path")
    if os.path.isdir(path):
        fail(f"--json {path!r} is a folder; name a file, e.g. --json {os.path.join(path, 'bench.json')}")
    try:  # atomic_write's temp file, made and removed
        with tempfile.NamedTemporaryFile(dir=folder, prefix="." + os.path.basename(path), suffix=".tmp"):
            pass
    except OSError as e:
        fail(f"cannot write --json {path!r} ({e.strerror}); pick another path")


def pick_mixers(text, flag):
    names = list(MIXERS) if text.strip() == "all" else [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MIXERS]
    if bad:
        fail(f"unknown {flag} {', '.join(bad)}; choose from: {', '.join(MIXERS)}")
    return ["sa"] + [m for m in dict.fromkeys(names) if m != "sa"]


def run_section(k, s, args, device, ctx, dtype):
    torch.manual_seed(0)
    if k == 1:
        return section_sublayer(s, args, args.mixers, device, ctx)
    if k == 2:
        return section_sweep(s, args, args.sweep_mixers, device, ctx)
    if k == 3:
        return section_model(s, args, args.mixers + ["none"], device, ctx, dtype)
    if k == 4:
        return section_generation(s, args, args.mixers, device, ctx)
    if k == 5:
        return section_flops(s, args, args.mixers, device)
    return section_memory(s, args, args.mixers, device, ctx, dtype)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table7:
        print_table7()
        return 0
    tuned = not args.no_malloc_tune and sys.platform.startswith("linux")
    if tuned:
        keep_freed_memory()  # the allocator setting of a training run, so bench measures the same
    device = pick_device(args.device)  # auto: cuda, then mps, then cpu; one clear line if absent
    if args.threads:
        torch.set_num_threads(args.threads)
    s = {k: v[1] if args.quick else v[0] for k, v in SETTINGS.items()}
    s.update({k: getattr(args, k) for k in ("gen_layers", "gen_block") if getattr(args, k) is not None})
    if s["d"] % args.n_head:
        fail(f"--n_head {args.n_head} must divide d = {s['d']}")
    s.update(n_head=args.n_head, fft_min_t=fir.FFT_MIN_T_SCALAR, half_batch=max(1, s["batch"] // 2))
    s.update(
        gpu_gib=args.gpu_gib, margin_gib=args.margin_gib, budget_mib=1024 * (args.gpu_gib - args.margin_gib)
    )
    dtype = DTYPES[args.dtype]
    ctx = nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
    threads, load = torch.get_num_threads(), os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    info = dict(
        device=str(device), dtype=args.dtype, compile=args.compile, threads=threads, torch=torch.__version__
    )
    results = dict(settings=dict(s, **info, malloc_tuned=tuned, load_before=load), sections={})
    quick = ", quick" if args.quick else ""
    print(
        "bench.py: " + ", ".join(f"{k} {v}" for k, v in info.items()) + f", glibc malloc tuned {tuned}{quick}"
    )
    if load is not None and load > 0.5:  # other processes: 2-thread timings suffer most
        print(
            f"warning: load average {load:.2f} before starting; other processes share the CPU, so times "
            "are inflated and noisy (ratios less so); rerun on a quiet machine"
            + (", or try --threads 1" if threads > 1 else "")
        )
    t0 = time.perf_counter()
    for k in args.sections:
        print(
            f"[section {k}: {SECTIONS[k]}] {time.perf_counter() - t0:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
        try:
            results["sections"][SECTIONS[k]] = rows = run_section(k, s, args, device, ctx, dtype)
        except torch.OutOfMemoryError:
            fail(f"out of memory in section {k}; pick fewer --sections or --mixers, or use --quick")
        except Exception as e:
            if args.compile:
                fail(f"section {k} failed under --compile ({type(e).__name__}); run without --compile")
            raise
        show("model_floor" if rows and "variant" in rows[0] else SECTIONS[k], rows, s)
        sys.stdout.flush()
    results["elapsed_s"] = time.perf_counter() - t0
    results["settings"]["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"\ndone in {results['elapsed_s']:.0f} s")
    if args.json:
        try:
            atomic_write(args.json, json.dumps(results, indent=1, default=str))
        except OSError as e:  # a disk that filled up while it ran
            fail(f"cannot write --json {args.json!r} ({e.strerror}); the tables above hold the results")
    return 0


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):  # `python bench.py | head` ends quietly, as a shell tool does
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
