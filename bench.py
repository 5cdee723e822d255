"""
Every token mixer of extractor.py measured against attention on this device: the paper's cost claims
(Tables 3-7: fewer operations, cheap incremental inference) checked against real kernels.

    python bench.py                                   # sections 1-5 at Table 1 shapes (minutes on a CPU)
    python bench.py --quick                           # tiny shapes, few repeats: seconds
    python bench.py --sections 1,2 --mixers me,we --json bench.json
    python bench.py --device cuda --dtype bf16 --compile

Sections: 1 sublayer forward+backward at Table 1 shapes, 2 context sweep at fixed tokens per batch,
3 whole model training (m = 18 and m = 2), 4 generation with and without the cache, 5 the paper's
operation counts beside the FLOPs torch.utils.flop_counter measures. Times are medians of interleaved
rounds after warm-up (the mixers take turns, so a noisy moment of a shared machine hits them all);
ratios to sa come from the same process. sa (and in section 3 the "none" floor) is always measured.
"""

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import extractor
import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
import train
from extractor import MIXERS, Config, Transformer
from prepare_data import atomic_write, fail

# -----------------------------------------------------------------------------
# settings: the paper's Table 1 shapes, and the tiny ones of --quick
FULL = dict(
    d=128,
    l=128,
    batch=64,  # Table 1: d, l and the batch size
    vocab=5000,
    hidden=512,  # u and c of Table 1
    warmup=3,
    rounds=15,  # section 1: calls before timing, interleaved timed rounds
    sweep_t=(128, 256, 512, 1024, 2048),
    sweep_tokens=8192,
    sweep_rounds=5,  # section 2: B * t fixed
    layers=(18, 2),
    model_rounds=4,  # section 3: m of the two models, timed steps per model
    paper_batches=60000,  # Section 6: the paper trains on 60000 batches
    gen_layers=2,
    gen_block=512,
    gen_prompt=32,
    gen_new=256,
    gen_rounds=2,  # section 4, batch 1
)
QUICK = dict(
    d=32,
    l=32,
    batch=4,
    vocab=300,
    hidden=128,
    warmup=1,
    rounds=2,
    sweep_t=(16, 32, 64),
    sweep_tokens=256,
    sweep_rounds=1,
    layers=(2, 1),
    model_rounds=1,
    paper_batches=60000,
    gen_layers=1,
    gen_block=32,
    gen_prompt=4,
    gen_new=8,
    gen_rounds=1,
)
PAPER_MIXERS = ("sa", "she", "he", "we", "me", "he-ext")  # the default: attention and the paper's Extractors
SECTIONS = {1: "sublayer", 2: "sweep", 3: "model", 4: "generation", 5: "flops"}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# glibc mallopt parameters (malloc.h)
def malloc_trim():
    """Give free heap memory back to the OS (glibc), so the resident set shows only live memory."""
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


# -----------------------------------------------------------------------------
# timing


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
            done = time.perf_counter() - t_start
            print(
                f"  {label}: round {r + 1}/{rounds}, {done:.0f} s, "
                f"ETA {done / (r + 1) * (rounds - r - 1):.0f} s",
                file=sys.stderr,
                flush=True,
            )
            last = time.perf_counter()
    return times, slow


def med(xs):
    return statistics.median(xs)


# -----------------------------------------------------------------------------
# what to measure


def fir_path(module, t):
    """Which computation a mixer takes at sequence length t, read from its taps' shape and
    extractor.FFT_MIN_T_SCALAR: toeplitz (scalar taps, short t), fft, sdpa (attention), matmul."""
    taps = [p for n, p in module.named_parameters() if n.split(".")[-1] in ("W_ext", "w_ext")]
    if not taps:
        return "sdpa" if isinstance(module, extractor.SelfAttention) else "matmul"
    return "toeplitz" if taps[0].dim() == 1 and t < extractor.FFT_MIN_T_SCALAR else "fft"


def make_config(s, args, mixer, l, n_layer=1):
    return Config(
        vocab_size=s["vocab"],
        block_size=l,
        n_embd=s["d"],
        n_hidden=s["hidden"],
        n_layer=n_layer,
        n_head=args.n_head,
        mixer=mixer,
    )


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
    cfg = make_config(s, args, "me" if mixer == "none" else mixer, s["l"], n_layer)
    model = Transformer(cfg)
    if mixer == "none":
        for layer in model.layers:
            layer.mixer, layer.ln1 = NoMixer(), nn.Identity()
    return model.to(device)


def train_step(model, opt, scaler, x, y, ctx):
    """One Table 1 training step, exactly train.py's: forward, loss, backward, AdamW."""
    return lambda: train.train_step(model, opt, scaler, ctx, x, y)


def peak_bytes(step, model, opt, device):
    """Peak memory of one training step: the high-water mark above what was resident before it, plus
    this model's parameters and AdamW states (resident before it). cpu: Linux VmHWM, reset through
    /proc/self/clear_refs after giving free heap back; cuda: max_memory_allocated. None elsewhere."""
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    state += sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
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

    malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    base = status("VmRSS:")
    step()
    return status("VmHWM:") - base + state


def fft_flops():
    """FFT cost, estimated as 2.5 n log2(n) real flops per real transform of length n (half a
    complex radix-2 FFT's 5 n log2 n); FlopCounterMode does not count FFTs at all."""

    def r2c(x, dim, *args, out_val=None, **kwargs):
        n = math.prod(x.shape[d] for d in dim)
        return int(2.5 * x.numel() * math.log2(n))

    def c2r(x, dim, normalization, last_dim_size, *args, out_val=None, **kwargs):
        n = math.prod(out_val.shape[d] for d in dim)
        return int(2.5 * out_val.numel() * math.log2(n))

    r2c._get_raw = c2r._get_raw = True
    return {torch.ops.aten._fft_r2c: r2c, torch.ops.aten._fft_c2r: c2r}


def complete_mapping():
    """FlopCounterMode additions for what it leaves out here: SDPA's CPU kernel (counted with the
    flash kernel's formula: full t x t, the causal half not subtracted), complex bmm (8 real flops
    per complex multiply-add, not 2), elementwise mul (1 flop, 6 if complex), FFTs (estimated)."""
    aten = torch.ops.aten

    def bmm(a, b, *args, out_val=None, **kwargs):
        return flop_registry[aten.bmm](a, b, out_val=out_val) * (4 if a.is_complex() else 1)

    def mul(a, b, *args, out_val=None, **kwargs):
        return out_val.numel() * (6 if out_val.is_complex() else 1) if torch.is_tensor(out_val) else 0

    def sdpa_cpu(*args, out_val=None, **kwargs):
        return flop_registry[aten._scaled_dot_product_flash_attention](*args, out_val=out_val, **kwargs)

    bmm._get_raw = mul._get_raw = sdpa_cpu._get_raw = True
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
        aten.bmm: bmm,
        aten.mul: mul,
        **fft_flops(),
    }


# -----------------------------------------------------------------------------
# the five sections; each returns rows (lists of dicts) for the table and the JSON


def section_sublayer(s, args, mixers, device, ctx):
    d, l, B = s["d"], s["l"], s["batch"]
    x = torch.randn(B, l, d, device=device, requires_grad=True)  # (B, t, d)
    g = torch.randn(B, l, d, device=device)
    steps, paths = {}, {}
    for m in mixers:
        module = MIXERS[m](make_config(s, args, m, l)).to(device)
        paths[m] = fir_path(module, l)
        steps[m] = sublayer_step(maybe_compile(module, args), x, g, ctx)
    times, _ = interleaved(steps, s["warmup"], s["rounds"], device, "sublayer")
    ref = med(times["sa"])
    return [
        dict(
            mixer=m,
            path=paths[m],
            ms=1e3 * med(times[m]),
            vs_sa=med(times[m]) / ref,
            iqr_ms=1e3 * (_q(times[m], 0.75) - _q(times[m], 0.25)),
        )
        for m in mixers
    ]


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def section_sweep(s, args, mixers, device, ctx):
    rows = {m: dict(mixer=m, ms={}, vs_sa={}, path={}, single={}) for m in mixers}
    dropped = set()
    for t in s["sweep_t"]:
        B = max(1, s["sweep_tokens"] // t)
        x = torch.randn(B, t, s["d"], device=device, requires_grad=True)  # (B, t, d), B * t fixed
        g = torch.randn(B, t, s["d"], device=device)
        steps = {}
        for m in mixers:
            if m in dropped:
                continue
            module = MIXERS[m](make_config(s, args, m, t)).to(device)
            rows[m]["path"][t] = fir_path(module, t)
            steps[m] = sublayer_step(maybe_compile(module, args), x, g, ctx)
        print(f"  sweep: t = {t}, batch {B}: {', '.join(steps)}", file=sys.stderr, flush=True)
        times, slow = interleaved(steps, 2, s["sweep_rounds"], device, f"sweep t={t}", args.max_call_s)
        for m, ts in times.items():
            rows[m]["ms"][t] = 1e3 * med(ts)
            rows[m]["single"][t] = m in slow
            if m in slow and m != "sa":  # too slow: one call, skip longer t
                dropped.add(m)
        del steps, times
    for m in mixers:
        for t, ms in rows[m]["ms"].items():
            if t in rows["sa"]["ms"]:
                rows[m]["vs_sa"][t] = ms / rows["sa"]["ms"][t]
        rows[m]["slope"] = loglog_slope(rows[m]["ms"], s["sweep_tokens"])
    return list(rows.values())


def loglog_slope(ms_by_t, tokens):
    """Least-squares slope of log(time per token) against log(t)."""
    pts = [(math.log(t), math.log(ms / tokens)) for t, ms in ms_by_t.items()]
    if len(pts) < 2:
        return None
    mx, my = (sum(p[i] for p in pts) / len(pts) for i in (0, 1))
    return sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts)


def section_model(s, args, mixers, device, ctx, dtype):
    B, l, rows = s["batch"], s["l"], []
    data = torch.randint(0, s["vocab"], (B, l + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)  # (B, l) inputs and next tokens
    for m_layers in s["layers"]:
        models, steps = {}, {}
        for m in mixers:
            torch.manual_seed(0)
            model = build_model(s, args, m, m_layers, device).train()
            opt = torch.optim.AdamW(
                model.parameters(), lr=1e-3, weight_decay=0.01, fused=device.type == "cuda"
            )
            scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
            models[m] = (model, opt)
            steps[m] = train_step(maybe_compile(model, args), opt, scaler, x, y, ctx)
        print(f"  model m = {m_layers}: {len(steps)} models", file=sys.stderr, flush=True)
        times, _ = interleaved(steps, 2, s["model_rounds"], device, f"model m={m_layers}")
        for m in mixers:
            step_s = med(times[m])
            peak = peak_bytes(steps[m], *models[m], device)
            rows.append(
                dict(
                    n_layer=m_layers,
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


def generate_timed(model, prompt, n_new, use_cache, ctx):
    """Generate greedily; return the tokens and the seconds from the start to each new token."""
    t0, stamps, toks = time.perf_counter(), [], []
    with ctx:
        for nxt in model.generate_stream(prompt, n_new, temperature=0, use_cache=use_cache):
            toks.append(nxt)
            stamps.append(time.perf_counter() - t0)
    return torch.cat(toks, 1), stamps


def section_generation(s, args, mixers, device, ctx):
    n_new, rows = s["gen_new"], []
    prompt = torch.randint(0, s["vocab"], (1, s["gen_prompt"]), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)  # (1, prompt)
    models = {}
    for m in mixers:
        torch.manual_seed(0)
        cfg = Config(
            vocab_size=s["vocab"],
            block_size=s["gen_block"],
            n_embd=s["d"],
            n_hidden=s["hidden"],
            n_layer=s["gen_layers"],
            n_head=args.n_head,
            mixer=m,
        )
        models[m] = Transformer(cfg).to(device).eval()
    res = {(m, c): [] for m in mixers for c in (True, False)}
    t_start = time.perf_counter()
    for r in range(s["gen_rounds"] + 1):  # round 0 is the warm-up
        for i, m in enumerate(mixers):
            for c in (True, False):
                toks, stamps = generate_timed(models[m], prompt, n_new, c, ctx)
                if r > 0:
                    res[m, c].append((toks, stamps))
            done = time.perf_counter() - t_start
            left = (s["gen_rounds"] + 1) * len(mixers) - (r * len(mixers) + i + 1)
            print(
                f"  generation: round {r}, {m}, {done:.0f} s, "
                f"ETA {done / (r * len(mixers) + i + 1) * left:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    for m in mixers:
        row = dict(mixer=m)
        for c, key in ((True, "cached"), (False, "full")):
            totals = [st[-1] for _, st in res[m, c]]
            lat = [b - a for _, st in res[m, c] for a, b in zip(st, st[1:])]  # one forward per new token
            row[f"{key}_tokens_per_s"] = n_new / med(totals)
            row[f"{key}_ms_per_token"] = 1e3 * med(lat) if lat else 1e3 * med(totals)
        row["speedup"] = row["cached_tokens_per_s"] / row["full_tokens_per_s"]
        a, b = res[m, True][0][0], res[m, False][0][0]
        row["same_tokens"] = int((a == b).all(0).long().cumprod(0).sum())  # agreeing prefix length
        rows.append(row)
    return rows


def section_flops(s, args, mixers, device):
    d, l, rows = s["d"], s["l"], []
    x = torch.randn(1, l, d)  # one sequence, (1, t, d)
    for m in mixers:
        module = MIXERS[m](make_config(s, args, m, l))
        n = args.n_head if m == "sa" else 1
        paper = extractor.complexity_training(d, l, n).get(m)
        with torch.no_grad(), FlopCounterMode(display=False) as stock:
            module(x)
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=complete_mapping()) as full:
            module(x)
        by_op = {str(k).split(".")[-1]: v for k, v in full.get_flop_counts()["Global"].items()}
        fft = sum(v for k, v in by_op.items() if "fft" in k)
        total = full.get_total_flops()
        rows.append(
            dict(
                mixer=m,
                path=fir_path(module, l),
                paper_ops=None
                if paper is None
                else paper["mult"] + paper["add"] + paper["div"] + paper["exp"],
                paper_mult_add=None if paper is None else paper["mult"] + paper["add"],
                stock_flops=stock.get_total_flops(),
                fft_flops_est=fft,
                completed_flops=total,
                by_op=by_op,
            )
        )
    return rows


def maybe_compile(module, args):
    return torch.compile(module) if args.compile else module


# -----------------------------------------------------------------------------
# tables


def fmt(v, spec=".2f"):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return format(v, spec)


def print_table(title, header, rows, notes=()):
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    print(f"\n{title}")
    line = lambda r: "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    for n in notes:
        print(f"  {n}")


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


def si(v):
    """1234567 -> '1.23M'."""
    if v is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.2f}{unit}"
    return str(int(v))


def show(results, s, args):
    r = results["sections"]
    if "sublayer" in r:
        print_table(
            f"1. Sublayer forward+backward, d = l = {s['d']}, batch {s['batch']} "
            f"(sa: {args.n_head} heads); median of {s['rounds']} interleaved rounds",
            ["mixer", "path", "ms", "IQR ms", "vs sa"],
            [
                [x["mixer"], x["path"], fmt(x["ms"]), fmt(x["iqr_ms"]), fmt(x["vs_sa"], ".3f") + "x"]
                for x in r["sublayer"]
            ],
        )
    if "sweep" in r:
        ts = s["sweep_t"]
        rows = []
        for x in r["sweep"]:
            cells = [fmt(x["ms"].get(t), ".1f") + ("*" if x["single"].get(t) else "") for t in ts]
            ratio = [fmt(x["vs_sa"].get(t), ".2f") for t in ts]
            path = path_ranges(x["path"])
            rows.append([x["mixer"], path] + cells + ratio + [fmt(x["slope"], ".2f")])
        print_table(
            f"2. Context sweep, l = t, batch * t = {s['sweep_tokens']} tokens: forward+backward ms, "
            f"ratio to sa, slope of log(time per token) vs log(l)",
            ["mixer", "path"] + [f"ms t={t}" for t in ts] + [f"/sa {t}" for t in ts] + ["slope"],
            rows,
            [
                f"path: the computation taken at each t (scalar taps: toeplitz below t = "
                f"{extractor.FFT_MIN_T_SCALAR}, then fft); * one call only (over --max_call_s), "
                "longer t skipped"
            ],
        )
    if "model" in r:
        rows = [
            [
                f"m={x['n_layer']}",
                x["mixer"],
                si(x["params"]),
                fmt(x["step_ms"], ".0f"),
                fmt(x["tokens_per_s"], ".0f"),
                fmt(x["vs_sa"], ".2f") + "x",
                fmt(x["peak_mb"], ".0f"),
                fmt(x["paper_hours"], ".1f"),
            ]
            for x in r["model"]
        ]
        print_table(
            f"3. Whole model training step (fwd, loss, bwd, AdamW), batch {s['batch']} x {s['l']}, "
            f"Table 1 otherwise; median of {s['model_rounds']} interleaved steps",
            [
                "model",
                "mixer",
                "params",
                "step ms",
                "tokens/s",
                "vs sa",
                "peak MB",
                f"{s['paper_batches']} batches, h",
            ],
            rows,
            [
                "none: no first sublayer (zeros added): embeddings, FFNs and the softmax are the floor",
                "peak MB: high-water mark of one step above the memory resident before it, plus the "
                "parameters and AdamW states" + (" (cpu: Linux VmHWM)" if args.device_type == "cpu" else ""),
            ],
        )
    if "generation" in r:
        rows = [
            [
                x["mixer"],
                fmt(x["cached_tokens_per_s"], ".0f"),
                fmt(x["cached_ms_per_token"], ".2f"),
                fmt(x["full_tokens_per_s"], ".0f"),
                fmt(x["full_ms_per_token"], ".2f"),
                fmt(x["speedup"], ".1f") + "x",
                f"{x['same_tokens']}/{s['gen_new']}",
            ]
            for x in r["generation"]
        ]
        print_table(
            f"4. Generation, batch 1, {s['gen_prompt']}-token prompt, {s['gen_new']} new tokens (greedy), "
            f"m = {s['gen_layers']}, l = {s['gen_block']}, d = {s['d']}; median of {s['gen_rounds']} rounds",
            ["mixer", "cache tok/s", "cache ms/tok", "full tok/s", "full ms/tok", "speedup", "same tokens"],
            rows,
            [
                "ms/tok: median time of one new token; tok/s includes the prompt's forward",
                "same tokens: leading tokens on which cached and full recomputation agree"
                + (
                    " (beyond l both run a forward over the last l tokens per token, Eq. 2)"
                    if s["gen_prompt"] + s["gen_new"] > s["gen_block"]
                    else ""
                ),
            ],
        )
    if "flops" in r:
        rows = [
            [
                x["mixer"],
                x["path"],
                si(x["paper_ops"]),
                si(x["paper_mult_add"]),
                si(x["stock_flops"]),
                si(x["fft_flops_est"]),
                si(x["completed_flops"]),
                fmt(None if not x["paper_mult_add"] else x["completed_flops"] / x["paper_mult_add"], ".2f"),
            ]
            for x in r["flops"]
        ]
        print_table(
            f"5. One sublayer forward, one sequence, d = l = {s['d']}: the paper's Tables 3/4 counts "
            f"against torch.utils.flop_counter",
            [
                "mixer",
                "path",
                "paper ops",
                "paper mul+add",
                "FlopCounter",
                "FFT est.",
                "completed",
                "compl/paper",
            ],
            rows,
            [
                "paper ops: mult+add+div+exp of extractor.complexity_training (sa with n = --n_head)",
                "FlopCounter: FlopCounterMode as shipped: matmuls only, 2 flops per multiply-add, complex "
                "ones as real; it counts no FFT, no elementwise op, and not SDPA's cpu kernel "
                "(sa: projections only)",
                "completed: adds SDPA's cpu kernel (full t x t, causal half not subtracted), complex bmm "
                "x4 (8 real flops per complex multiply-add), elementwise mul (6 if complex),",
                "  and FFTs estimated at 2.5 n log2 n per real transform (FFT est.); softmax, exp and "
                "additions outside matmuls are still not counted",
            ],
        )


# -----------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Benchmark every token mixer against attention (sections 1-5).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps"
    )
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="fp32, or bf16/fp16 autocast")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile sublayers and models (not generation)"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: runs in seconds")
    p.add_argument(
        "--sections",
        default="1,2,3,4,5",
        help="comma list of: " + ", ".join(f"{k} {v}" for k, v in SECTIONS.items()),
    )
    p.add_argument(
        "--mixers",
        default=",".join(PAPER_MIXERS),
        help="comma list of mixers, or 'all' for every one in extractor.MIXERS (sa is always added)",
    )
    p.add_argument(
        "--sweep_mixers", default=None, help="mixers of the sweep (section 2), or 'all'; default: --mixers"
    )
    p.add_argument(
        "--max_call_s",
        type=float,
        default=20.0,
        help="sweep: a mixer whose one call takes longer is timed once and skips longer t",
    )
    p.add_argument("--n_head", type=int, default=32, help="heads of sa (Table 1: 32)")
    p.add_argument(
        "--gen_layers", type=int, default=None, help="section 4: m of the generating model (default 2)"
    )
    p.add_argument("--gen_block", type=int, default=None, help="section 4: its l (default 512)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    p.add_argument("--no_malloc_tune", action="store_true", help="leave glibc's allocator at its defaults")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.error = lambda msg: fail(f"{msg} (see python bench.py --help)")
    args = p.parse_args(argv)
    try:
        args.sections = sorted({int(x) for x in args.sections.split(",") if x.strip()})
    except ValueError:
        fail(f"--sections takes numbers, e.g. 1,3, got {args.sections!r}")
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        fail(f"--sections must be a comma list of {', '.join(map(str, SECTIONS))}, got {args.sections}")
    args.mixers = pick_mixers(args.mixers, "--mixers")
    args.sweep_mixers = (
        args.mixers if args.sweep_mixers is None else pick_mixers(args.sweep_mixers, "--sweep_mixers")
    )
    if args.n_head < 1:
        fail(f"--n_head must be at least 1, got {args.n_head}")
    if args.threads < 0 or not args.max_call_s > 0:
        fail("--threads must be >= 0 and --max_call_s > 0")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        fail(f"the folder of --json {args.json!r} does not exist; create it or pick another path")
    return args


def pick_mixers(text, flag):
    names = list(MIXERS) if text.strip() == "all" else [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MIXERS]
    if bad:
        fail(f"unknown {flag} {', '.join(bad)}; choose from: {', '.join(MIXERS)}")
    return ["sa"] + [m for m in dict.fromkeys(names) if m != "sa"]


def pick_device(name):
    return train.pick_device(name, local_rank=0)  # auto: cuda, then mps, then cpu; one clear line if absent


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tuned = not args.no_malloc_tune and sys.platform.startswith("linux")
    if tuned:
        train.keep_freed_memory()  # the allocator setting of a training run, so bench measures the same
    device = pick_device(args.device)
    args.device_type = device.type
    if args.threads:
        torch.set_num_threads(args.threads)
    s = dict(QUICK if args.quick else FULL)
    for k in ("gen_layers", "gen_block"):
        if getattr(args, k) is not None:
            if getattr(args, k) < 1:
                fail(f"--{k} must be at least 1, got {getattr(args, k)}")
            s[k] = getattr(args, k)
    if s["d"] % args.n_head:
        fail(f"--n_head {args.n_head} must divide d = {s['d']}")
    dtype = DTYPES[args.dtype]
    ctx = nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
    results = dict(
        settings=dict(
            s,
            device=str(device),
            dtype=args.dtype,
            compile=args.compile,
            n_head=args.n_head,
            threads=torch.get_num_threads(),
            malloc_tuned=tuned,
            torch=torch.__version__,
            fft_min_t_scalar=extractor.FFT_MIN_T_SCALAR,
        ),
        sections={},
    )
    print(
        f"bench.py: device {device}, dtype {args.dtype}, compile {args.compile}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}, glibc malloc tuned: {tuned}{', quick' if args.quick else ''}"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results["settings"]["load_before"] = load
    if (
        load is not None and load > 0.5
    ):  # other processes: 2-thread timings suffer most (threads wait on each other)
        print(
            f"warning: load average {load:.2f} before starting; other processes share the CPU, so times "
            f"are inflated and noisy (ratios less so); rerun on a quiet machine, or try --threads 1"
        )
    t0 = time.perf_counter()
    try:
        for k in args.sections:
            print(
                f"[section {k}: {SECTIONS[k]}] {time.perf_counter() - t0:.0f} s so far",
                file=sys.stderr,
                flush=True,
            )
            torch.manual_seed(0)
            if k == 1:
                rows = section_sublayer(s, args, args.mixers, device, ctx)
            elif k == 2:
                rows = section_sweep(s, args, args.sweep_mixers, device, ctx)
            elif k == 3:
                rows = section_model(s, args, args.mixers + ["none"], device, ctx, dtype)
            elif k == 4:
                rows = section_generation(s, args, args.mixers, device, ctx)
            else:
                rows = section_flops(s, args, args.mixers, device)
            results["sections"][SECTIONS[k]] = rows
            show(dict(sections={SECTIONS[k]: rows}), s, args)
            sys.stdout.flush()
    except torch.OutOfMemoryError:
        fail(f"out of memory in section {k}; pick fewer --sections or --mixers, or use --quick")
    except Exception as e:
        if args.compile:
            fail(f"section {k} failed under --compile ({type(e).__name__}); run without --compile")
        raise
    results["elapsed_s"] = time.perf_counter() - t0
    results["settings"]["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"\ndone in {results['elapsed_s']:.0f} s")
    if args.json:
        atomic_write(args.json, json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
