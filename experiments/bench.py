"""
The token mixers against attention on this device, and the paper's operation counts (Tables 3-7).

    python experiments/bench.py                        # every section at Table 1's shapes
    python experiments/bench.py --quick                # tiny shapes, few rounds: seconds
    python experiments/bench.py --sections step --device cuda --compile --json bench.json
    python experiments/bench.py --table7               # Tables 3-7, and the FLOPs counted

Sections: sublayer, one mixer's forward+backward (on CUDA each FIR path: fir.py's CUDA defaults come
from it); step, the Table 1 model's training step as train.py takes it (on CUDA captured in a CUDA
graph, eager, bf16 of both, compiled with --compile), on CUDA or with --floor beside its floor, its
FLOPs and the bytes it must move at the rates measured in the same run; memory, one training step's
peak and the largest batch that fits a --gpu_gib GPU. Times are medians of interleaved rounds after
warm-up (the mixers take turns, so a noisy moment hits them all), and the ratios to sa from the same run.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import json
import math
import os
import signal
import statistics
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the project root

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, flop_registry  # noqa: E402

import extractor  # noqa: E402
import fir  # noqa: E402
import train  # noqa: E402
from extractor import Config, Transformer  # noqa: E402
from prepare_data import atomic_write, fail  # noqa: E402

# Table 1's shapes (d, l, batch, u, c, m) and the tiny ones of --quick; rounds of timing
# (section step: 5x on CUDA); the GEMM's n and the copy's MiB that measure the floor's
# rates (on the CPU <= 2048, 256)
SIZES = dict(d=(128, 32), l=(128, 32), batch=(64, 4), vocab=(5000, 300), hidden=(512, 128), n_layer=(18, 1),
             rounds=(15, 2), step_rounds=(4, 1), gemm_n=(8192, 256), copy_mib=(1024, 16))  # fmt: skip
PAPER_BATCHES = 60000  # Section 6: the paper trains on 60000 batches
# section step: name -> (autocast dtype, how the step runs); CUDA runs the first four
# (captured: train.py's way on CUDA, train.CapturedStep), the CPU eager; compiled with
# --compile
VARIANTS = {"captured": ("float32", "captured"), "eager": ("float32", "eager"), "bf16": ("bfloat16", "eager"),
            "bf16-captured": ("bfloat16", "captured"), "compiled": ("float32", "compiled")}  # fmt: skip


def interleaved(fns, rounds, device, warmup=2):
    """{name: fn} -> {name: median seconds of one call}: `warmup` rounds, then `rounds`
    timed ones, in each of which every fn runs once, the order rotating each round."""
    names, times = list(fns), {k: [] for k in fns}
    sync = getattr(
        torch, device.type
    ).synchronize  # waits for the queued kernels (the CPU's return at once)
    for r in range(-warmup, rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            fns[k]()
            sync()
            times[k] += [time.perf_counter() - t0] if r >= 0 else []
    return {k: statistics.median(v) for k, v in times.items()}


def make_config(s, args, mixer):
    return Config(vocab_size=s["vocab"], block_size=s["l"], n_embd=s["d"], n_hidden=s["hidden"],
                  n_layer=s["n_layer"], n_head=args.n_head, mixer=mixer)  # fmt: skip


def sublayer(cfg):
    """The first sublayer, the mixer that cfg names, as a Transformer builds it."""
    return (
        Transformer(dataclasses.replace(cfg, n_layer=1, vocab_size=1)).layers[0].mixer
    )


def new_model(s, args, mixer, batch, device):
    """The model and AdamW as train.py builds them by default (Table 1), and a batch:
    x, y (B, l) each.
    """
    model, opt = train.build_model(
        make_config(s, args, mixer), train.build_parser().parse_args([]), device
    )
    data = torch.randint(
        0, s["vocab"], (batch, s["l"] + 1), generator=torch.Generator().manual_seed(0)
    )
    return model.train(), opt, data[:, :-1].to(device), data[:, 1:].to(device)


def sublayer_paths(module, t, device):
    """The paths a mixer is timed on: its FIR taps' (W_ext or w_ext) default path on this
    device, then on CUDA every other path that computes them; sdpa for attention, matmul
    for the rest."""
    taps = next(
        (
            p
            for n, p in module.named_parameters()
            if n.split(".")[-1] in ("W_ext", "w_ext")
        ),
        None,
    )
    if taps is None:
        return ["sdpa" if isinstance(module, extractor.SelfAttention) else "matmul"]
    default = fir.default_path(device.type, taps.dim(), t)
    others = [p for p, dims in fir.PATHS.items() if taps.dim() in dims and p != default]
    return [default] + others * (device.type == "cuda")


def storage_bytes(tensors):
    """Bytes of the storages under these tensors, each storage once: views share their
    base's.
    """
    return sum(
        {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors
        }.values()
    )


def state_bytes(model, optimizer):
    """The parameters and AdamW's two moments, exp_avg and exp_avg_sq."""
    moments = (
        st[k] for st in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
    )
    return storage_bytes(model.parameters()) + storage_bytes(moments)


def saved_for_backward(fn, params):
    """Call fn; return the bytes autograd saved for backward meanwhile, each storage once
    (q, k and v are views of one tensor), the parameters' left out (an op saving its
    weight saves no activation)."""
    skip, saved = (
        {p.untyped_storage().data_ptr() for p in params},
        {},
    )  # data_ptr -> bytes

    def pack(t):
        if (
            t.untyped_storage().data_ptr() not in skip
        ):  # a saved tensor lives until backward: no reuse
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


def peak_bytes(step, device):
    """The high-water mark of one call of step above the memory in use before it:
    train.peak_memory reset (CUDA's peak statistics; Linux's VmHWM through
    /proc/self/clear_refs), None where it cannot be."""
    if (
        device.type == "cuda"
    ):  # (the allocator's statistics are the host's: no need to wait)
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu" and os.path.exists("/proc/self/clear_refs"):
        ctypes.CDLL("libc.so.6").malloc_trim(
            0
        )  # so that what is resident is what is in use
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark down to what is resident now
    else:
        return None
    before = train.peak_memory(device)[0]
    step()
    return train.peak_memory(device)[0] - before


def completed_flops():
    """FlopCounterMode's custom_mapping for the ops it leaves out here: SDPA's CPU kernel
    (the flash kernel's formula: the full t x t, the causal half not subtracted),
    complex bmm (8 real flops per complex multiply-add, not 2), elementwise mul (1 flop,
    6 if complex) and FFTs, estimated as
    2.5 n log2(n) real flops per real transform of length n (half a complex radix-2
    FFT's 5 n log2 n)."""
    aten, reg = torch.ops.aten, flop_registry
    fft = lambda x, dim: int(
        2.5 * x.numel() * math.log2(math.prod(x.shape[d] for d in dim))
    )
    counts = {
        aten.bmm: lambda a, b, *_, out_val, **k:
            reg[aten.bmm](a, b, out_val=out_val) * (4 if a.is_complex() else 1),
        aten.mul: lambda *_, out_val, **k: out_val.numel() * (6 if out_val.is_complex() else 1),
        aten._scaled_dot_product_flash_attention_for_cpu: lambda *a, out_val, **k:
            reg[aten._scaled_dot_product_flash_attention](*a, out_val=out_val, **k),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k_, v, *_, out_val, **k:
            reg[aten._scaled_dot_product_flash_attention_backward](g, q, k_, v, out_val=out_val),
        aten._fft_r2c: lambda x, dim, *_, out_val, **k: fft(x, dim),
        aten._fft_c2r: lambda x, dim, *_, out_val, **k: fft(out_val, dim),
    }  # fmt: skip
    for f in counts.values():
        f._get_raw = True  # called with the op's arguments and output, not their shapes
    return counts


def section_sublayer(s, args, device):
    x = torch.randn(
        s["batch"], s["l"], s["d"], device=device, requires_grad=True
    )  # (B, t, d)
    g = torch.randn(s["batch"], s["l"], s["d"], device=device)  # dL/dy

    def fwd_bwd(
        module, path
    ):  # every FIR inside takes this path (sdpa and matmul have none to force)
        with fir.forcing(path) if path in fir.PATHS else contextlib.nullcontext():
            module(x).backward(g)
        module.zero_grad(set_to_none=True)
        x.grad = None

    steps = {}  # (mixer, path) -> one forward+backward
    for m in args.mixers:
        module = sublayer(make_config(s, args, m)).to(device)
        for path in sublayer_paths(module, s["l"], device):
            steps[m, path] = functools.partial(fwd_bwd, module, path)
    t = interleaved(steps, s["rounds"], device, warmup=3)
    return [
        dict(mixer=m, path=p, ms=1e3 * t[m, p], vs_sa=t[m, p] / t["sa", "sdpa"])
        for m, p in steps
    ]


def measure_rates(device, dtypes, s):
    """FLOP/s of an (n x n) @ (n x n) GEMM in each dtype (float32 under the TF32 setting in
    effect) and bytes/s of a large copy (each byte read once and written once), measured
    now."""
    cpu = device.type != "cuda"
    n, mib = (
        (min(s["gemm_n"], 2048), min(s["copy_mib"], 256))
        if cpu
        else (s["gemm_n"], s["copy_mib"])
    )
    fns = {}
    for dt in dtypes:
        a, b = (
            torch.randn(n, n, device=device).to(getattr(torch, dt)) for _ in range(2)
        )
        fns[dt] = functools.partial(torch.mm, a, b, out=torch.empty_like(a))
    src = torch.randn(mib * 2**18, device=device)  # float32: mib MiB
    fns["copy"] = functools.partial(torch.Tensor.copy_, torch.empty_like(src), src)
    t = interleaved(fns, 10, device)
    return dict(
        {dt: 2 * n**3 / t[dt] for dt in dtypes}, copy=2 * src.nbytes / t["copy"]
    )


def step_counts(model, optimizer, step, logits):
    """One training step counted, (FLOPs, bytes): its FLOPs, forward and backward (AdamW's
    not), and the fewest bytes it must move: parameters, gradients and AdamW's moments
    each read and written once, each activation saved for backward and the logits
    (`logits` bytes) written once and read once."""
    with FlopCounterMode(display=False, custom_mapping=completed_flops()) as counter:
        saved = saved_for_backward(step, model.parameters())
    state = storage_bytes(model.parameters()) + state_bytes(
        model, optimizer
    )  # gradients as parameters
    return counter.get_total_flops(), 2 * (state + saved + logits)


def section_step(s, args, device):
    """Each variant timed in interleaved rounds, past its warm-up (a model and AdamW per
    mixer, shared by its variants; a line where capturing or compiling fails, and no
    row), beside its floor if asked."""
    cuda, floor = device.type == "cuda", device.type == "cuda" or args.floor
    variants = [v for v in list(VARIANTS)[:4] if cuda or v == "eager"] + [
        "compiled"
    ] * args.compile
    ctxs = {
        dt: train.precision(device, dt)[0]
        for dt in dict.fromkeys(VARIANTS[v][0] for v in variants)
    }
    rates = measure_rates(device, list(ctxs), s) if floor else {}
    steps, counts, params = {}, {}, {}
    for m in args.mixers:
        model, opt, x, y = new_model(s, args, m, s["batch"], device)
        scaler = torch.amp.GradScaler(device.type, enabled=False)
        params[m] = sum(p.numel() for p in model.parameters())
        for dt in (
            ctxs if floor else ()
        ):  # (also AdamW's first step, which makes its moments)
            step = functools.partial(
                train.train_step, model, opt, scaler, ctxs[dt], x, y
            )
            counts[m, dt] = step_counts(
                model, opt, step, x.numel() * s["vocab"] * (2 if "bf" in dt else 4)
            )
        for v in variants:
            dt, how = VARIANTS[v]
            net = torch.compile(model) if how == "compiled" else model
            step = functools.partial(train.train_step, net, opt, scaler, ctxs[dt])
            step = train.CapturedStep(step) if how == "captured" else step
            try:
                for _ in range({"captured": 4, "compiled": 1}.get(how, 0)):
                    step(x, y)  # captured: 3 eager warm-up steps, then the capture
            except (
                Exception
            ) as e:  # torch.compile makes no code for complex tensors (SHE, HE, WE)
                print(
                    f"  {m} {v} fails, no row: {type(e).__name__}: {str(e).strip()[:80]}",
                    flush=True,
                )
                continue
            steps[m, v] = functools.partial(step, x, y)
    t = interleaved(steps, s["step_rounds"] * (5 if cuda else 1), device)
    rows = []
    for (m, v), sec in sorted(t.items(), key=lambda kv: list(VARIANTS).index(kv[0][1])):
        row = dict(
            mixer=m,
            variant=v,
            params=params[m],
            step_ms=1e3 * sec,
            tokens_per_s=s["tokens"] / sec,
        )
        row.update(
            vs_sa=t["sa", v] / sec if ("sa", v) in t else None,
            paper_hours=PAPER_BATCHES * sec / 3600,
        )
        if floor:
            (flops, moved), rate, copy = (
                counts[m, VARIANTS[v][0]],
                rates[VARIANTS[v][0]],
                rates["copy"],
            )
            row.update(
                flops=flops,
                bytes=moved,
                flop_ms=1e3 * flops / rate,
                byte_ms=1e3 * moved / copy,
            )
            row["floor_ms"] = max(
                row["flop_ms"], row["byte_ms"]
            )  # compute and traffic overlapped at best
            row.update(
                vs_floor=row["step_ms"] / row["floor_ms"],
                flop_rate=rate,
                byte_rate=copy,
            )
        rows.append(row)
    rates = ", ".join(
        f"{k} {r / 1e12:.3g} T{'B' if k == 'copy' else 'FLOP'}/s"
        for k, r in rates.items()
    )
    s["rates"] = f"; rates measured: {rates}" if floor else ""
    return rows


def section_memory(s, args, device):
    B, half, MiB = s["batch"], max(1, s["batch"] // 2), 2**20
    rows, s["half"], budget = [], half, 2**30 * s["budget_gib"]
    for m in args.mixers:
        (state, saved, peak), (_, _, peak_half) = (
            memory_at_batch(s, args, m, b, device) for b in (B, half)
        )
        row = dict(mixer=m, state_mib=state / MiB, saved_mib=saved / MiB)
        if (
            peak is not None
        ):  # None where the high-water mark cannot be reset (MPS, macOS)
            per_seq = (peak - peak_half) / (
                B - half
            )  # on the line through both: activations grow with B
            most = (
                max(0, B + math.floor((budget - peak) / per_seq))
                if per_seq > 0
                else None
            )
            row.update(
                peak_mib=peak / MiB,
                peak_half_mib=peak_half / MiB,
                per_seq_mib=per_seq / MiB,
            )
            row.update(fits="yes" if peak <= budget else "no", max_batch=most)
        rows.append(row)
    return rows


def memory_at_batch(s, args, mixer, batch, device):
    """Bytes of (the parameters and AdamW's moments, the activations saved for backward,
    the peak of a step with the former) of a fresh model and AdamW at this batch; the
    first step makes AdamW's moments."""
    model, opt, x, y = new_model(s, args, mixer, batch, device)
    scaler, ctx = (
        torch.amp.GradScaler(device.type, enabled=False),
        train.precision(device, "float32")[0],
    )
    step = lambda: train.train_step(model, opt, scaler, ctx, x, y)
    saved = saved_for_backward(step, model.parameters())
    peak, state = peak_bytes(step, device), state_bytes(model, opt)
    return state, saved, None if peak is None else peak + state


# ---------- the paper's operation counts, Tables 3-7, in closed form: the tests check
# them against their sums


def complexity_training(d, l, n=1):
    """Tables 3 and 4: multiplications, additions, divisions, exponentiations, parameters.
    SHE's multiplications use the summand d*d*t + d*d + d + d*d (Notes on the paper,
    5)."""
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
    return {
        k: dict(zip(("mult", "add", "div", "exp", "params"), v))
        for k, v in counts.items()
    }


def complexity_inference(d, t, n=1):
    """Tables 5 and 6: the increment for one new token at sequence length t. SA's additions
    are the paper's own per-token sum, 2td + 4d^2 - 5d - n, whose sum over t = 1..l is
    Table 3's count; the printed closed form 2td - tn + t + 4d^2 - 5d - 1 undercounts it
    by (n-1)(t-1) (Notes, 6)."""
    return {
        "sa": dict(mult=2 * t * d + 4 * d * d, add=2 * t * d + 4 * d * d - 5 * d - n, div=2 * t * n,
                   exp=t * n),
        "she": dict(mult=t * d * d + 2 * d * d + d, add=t * d * d + 2 * d * d - 3 * d, div=0, exp=0),
        "he": dict(mult=t * d + 3 * d * d + d, add=t * d + 3 * d * d - 4 * d, div=0, exp=0),
        "we": dict(mult=t * d + 2 * d * d + d, add=t * d + 2 * d * d - 3 * d, div=0, exp=0),
        "me": dict(mult=t * d, add=t * d - d, div=0, exp=0),
    }  # fmt: skip


TABLE7 = {"1-head SA": ("sa", 1), "32-head SA": ("sa", 32), "SHE": ("she", 1), "HE": ("he", 1),
          "WE": ("we", 1), "ME": ("me", 1)}  # fmt: skip


def table7(d=128, l=128):
    """Table 7's columns: label -> the counts of Tables 3 and 4 with 'total', the four
    operations'.
    """
    out = {label: complexity_training(d, l, n)[m] for label, (m, n) in TABLE7.items()}
    return {
        label: dict(c, total=c["mult"] + c["add"] + c["div"] + c["exp"])
        for label, c in out.items()
    }


def measured(mixer, d, l, n=1):
    """(parameters, FLOPs of one forward of one sequence) of a sublayer, counted from the
    module: no mixer has biases; the FLOPs as FlopCounterMode counts them, completed
    (completed_flops)."""
    module = sublayer(Config(n_embd=d, block_size=l, n_head=n, mixer=mixer))
    with (
        torch.no_grad(),
        FlopCounterMode(display=False, custom_mapping=completed_flops()) as counter,
    ):
        module(torch.randn(1, l, d))  # (1, t, d)
    return sum(p.numel() for p in module.parameters()), counter.get_total_flops()


def print_table7(d=128, l=128):
    line = lambda name, values: print(
        f"{name:>8}" + "".join(f"{v:>14,}" for v in values)
    )
    print(
        f"Table 7 (d = l = {d}) from Tables 3 and 4; below it the modules' parameters and the FLOPs of"
    )
    print(
        "one forward (torch.utils.flop_counter, 2 per multiply-add; completed for SDPA, complex, FFTs)"
    )
    print(f"{'':>8}" + "".join(f"{label:>14}" for label in TABLE7))
    for r in ("mult", "add", "div", "exp", "params", "total"):
        line(r, [c[r] for c in table7(d, l).values()])
    params, flops = zip(*(measured(m, d, l, n) for m, n in TABLE7.values()))
    line("modules", params)
    line("flops", flops)
    print(f"\nTables 5 and 6 (d = {d}): one new token at t = {l}")
    for r in ("mult", "add", "div", "exp"):
        line(r, [complexity_inference(d, l, n)[m][r] for m, n in TABLE7.values()])


SECTIONS = {
    "sublayer": section_sublayer,
    "step": section_step,
    "memory": section_memory,
}  # --sections
TABLES = {  # section: title, columns (a row's keys, each with its format), notes; filled from the settings
    "sublayer": ("Sublayer forward+backward, d = l = {d}, batch {batch} (sa: {n_head} heads); median of "
                 "{rounds} rounds", "mixer path ms:.3f vs_sa:.3f", "path: what causal_fir computes (fir.py; "
                 "on CUDA each path, the default first); vs_sa: this time over sa's (below 1: faster)"),
    "step": ("Training step (train.train_step), m = {n_layer}, l = d = {d}, batch {batch}; median of "
             "{step_rounds} rounds{rates}", "mixer variant params:si step_ms:.2f tokens_per_s:.0f vs_sa:.2f "
             "flops:si bytes:si flop_ms:.3f byte_ms:.3f floor_ms:.3f vs_floor:.1f paper_hours:.2f",
             "vs_sa: sa's step time over this one (above 1: faster); bytes: parameters, gradients, AdamW's "
             "moments, saved activations, logits\nfloor_ms: the larger of flop_ms and byte_ms, at the rates "
             f"measured; paper_hours: the paper's {PAPER_BATCHES} batches at step_ms"),
    "memory": ("Memory of one training step (train.train_step), m = {n_layer}, l = d = {d}, batch {batch} "
               "(sa: {n_head} heads), MiB; does it fit a {gpu_gib:g} GiB GPU?", "mixer state_mib:.1f "
               "saved_mib:.1f peak_mib:.0f peak_half_mib:.0f per_seq_mib:.2f fits max_batch", "state: "
               "parameters and AdamW's moments; saved: the activations saved for backward; peak: with the "
               "state (CPU: VmHWM)\nfits: peak <= {budget_gib:g} GiB (1 GiB left to CUDA); max_batch: on "
               "the line through peak and peak_half (batch {half})"),
}  # fmt: skip


def show(name, rows, s):
    """One section's rows as a table: title, columns, dashes, rows, notes; format si:
    1234567 -> 1.23M.
    """
    si = lambda v: next(
        (f"{v / x:.2f}{u}" for u, x in zip("GMk", (1e9, 1e6, 1e3)) if v >= x), str(v)
    )
    cell = lambda v, spec: (
        "-" if v is None else si(v) if spec == "si" else format(v, spec)
    )
    title, columns, notes = TABLES[name]
    columns = [c.partition(":")[::2] for c in columns.split()]  # (key, format)
    table = [[key for key, _ in columns]] + [
        [cell(r.get(key), spec) for key, spec in columns] for r in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    line = lambda r: "  ".join(
        [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
    )
    print("\n" + title.format(**s))
    print(
        "\n".join(
            [line(table[0]), "  ".join("-" * w for w in widths)]
            + [line(r) for r in table[1:]]
        )
    )
    print("\n".join("  " + n.format(**s) for n in notes.split("\n")), flush=True)


def parse_args(argv):
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        description=__doc__.strip().split("\n")[0], formatter_class=fmt
    )
    p.error = lambda msg: fail(f"{msg} (see --help)")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma list of the sections"
    )
    p.add_argument(
        "--mixers",
        default="sa,she,he,we,me,he-ext",
        help="comma list or all (sa always)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes, few rounds: seconds"
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="section step against its floor also off CUDA",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="section step also with torch.compile(model)",
    )
    p.add_argument("--n_head", type=int, default=32, help="heads of sa, n (Table 1's)")
    p.add_argument(
        "--gpu_gib",
        type=float,
        default=6.0,
        help="section memory: the GPU's GiB (the paper's)",
    )
    p.add_argument(
        "--json",
        default=argparse.SUPPRESS,
        help="also write every table's rows to this file",
    )
    p.add_argument(
        "--table7",
        action="store_true",
        help="print Tables 3-7 and the FLOPs counted, and exit",
    )
    args = p.parse_args(argv)
    args.sections = [k.strip() for k in args.sections.split(",") if k.strip()]
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        fail(
            f"--sections takes a comma list of {', '.join(SECTIONS)}, got {','.join(args.sections)!r}"
        )
    names = args.mixers.split(",")
    if args.mixers.strip() == "all":
        names = [*extractor.MIXERS, *extractor.SYNTHESIZERS]
    args.mixers = list(dict.fromkeys(["sa"] + [m.strip() for m in names if m.strip()]))
    for m in args.mixers:
        try:
            Config(n_embd=SIZES["d"][args.quick], n_head=args.n_head, mixer=m)
        except ValueError as e:  # an unknown name, or --n_head not dividing d
            fail(str(e))
    if args.gpu_gib <= 1:
        fail(
            f"--gpu_gib must be above 1 (1 GiB is left to the CUDA context), got {args.gpu_gib}"
        )
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table7:
        return print_table7()
    device = train.pick_device(args.device)
    s = {k: v[args.quick] for k, v in SIZES.items()} | dict(
        n_head=args.n_head, gpu_gib=args.gpu_gib
    )
    s.update(tokens=s["batch"] * s["l"], budget_gib=args.gpu_gib - 1)
    train.precision(device, "float32")  # TF32 matmuls on CUDA, as train.py
    info = dict(
        device=str(device), threads=torch.get_num_threads(), torch=torch.__version__
    )
    print(
        "bench.py: "
        + ", ".join(f"{k} {v}" for k, v in info.items())
        + ", quick" * args.quick
    )
    results, t0 = dict(settings=s | info, sections={}), time.perf_counter()
    for name in args.sections:
        print(
            f"[{name}] {time.perf_counter() - t0:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
        torch.manual_seed(0)
        try:
            rows = results["sections"][name] = SECTIONS[name](s, args, device)
        except torch.OutOfMemoryError:
            fail(
                f"out of memory in section {name}; pick fewer --sections or --mixers, or use --quick"
            )
        show(name, rows, s)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    if "json" in args:
        try:
            atomic_write(args.json, json.dumps(results, indent=1))
        except OSError as e:
            fail(
                f"cannot write --json {args.json!r} ({e.strerror}); the tables above hold the results"
            )


if __name__ == "__main__":
    if hasattr(
        signal, "SIGPIPE"
    ):  # `bench.py | head` ends quietly, as a shell tool does
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
