"""
What every script of the project shares: the settings' symbols, one-line errors, files written whole or
not at all, times for progress lines, output that never crashes on a terminal's encoding, the device and
its peak memory, glibc's allocator setting for training on a CPU. Only the standard library at import
(plot.py runs without torch).
"""

import ctypes
import sys

from prepare_data import atomic_write, fail, fmt_time  # noqa: F401  (moving)

# The settings that name a run, each written once: symbol and help here, the default here for training
# and in extractor.Config (Table 1) for the model. A symbol is the paper's (Table 1), or a short name
# where it gives none: train.py's --help leads with it, plot.py labels sweeps with it, and a default
# run folder is named by the settings that differ from their defaults, symbol then value
# (out/me-m2-l64-b32; max_iters has none, so a longer run continues in the same folder). Symbols are
# letters only and values start with a digit, so a name reads back one way only (b1 for beta_1 once
# named both --batch_size 10 and --beta1 0 "-b10").
MODEL_SETTINGS = {  # extractor.Config's fields: name -> (symbol, help)
    "n_layer": ("m", "number of layers"),
    "block_size": ("l", "context length"),
    "n_embd": ("d", "dimension of the model"),
    "n_hidden": ("c", "nodes in the FFN"),
    "n_head": ("n", "heads (mixers with heads)"),
    "dropout": ("p", "dropout rate"),
}
TRAINING_SETTINGS = {  # name -> (symbol, help, default)
    "batch_size": ("b", "batch size (over all ranks)", 64),
    "lr": ("lr", "AdamW learning rate gamma, constant", 1e-3),
    "weight_decay": ("wd", "AdamW weight decay", 0.01),
    "grad_clip": ("clip", "clip the grad norm; 0 = off", 0.0),
    "seed": ("seed", "seed of initialisation and dropout", 1337),
    "data_seed": ("dseed", "seed of the batch order", 1337),
    "beta1": ("bm", "AdamW beta_1, the decay of the gradients' mean", 0.9),
    "beta2": ("bv", "AdamW beta_2, the decay of their squares' mean (variance)", 0.999),
}
SYMBOLS = {name: row[0] for name, row in (MODEL_SETTINGS | TRAINING_SETTINGS).items()}


def check_seed(name, value):
    """A seed that torch, numpy and random all accept: 0 .. 2**63 - 1."""
    if not 0 <= value < 2**63:
        fail(f"--{name} must be in 0 .. 2**63 - 1, got {value}")


def one_line_errors(parser, script):
    """argparse's errors as one fail() line instead of the usage block and a message."""
    parser.error = lambda msg: fail(f"{msg} (see python {script} --help)")
    return parser


def plain_output():
    """A character the terminal cannot encode (a curly quote on an ASCII terminal) prints as '?'
    instead of ending the script with UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def keep_freed_memory():
    """CPU on Linux: let glibc keep freed memory instead of mmapping and unmapping every large tensor.
    Each training step frees and reallocates the same big buffers (the logits alone are B*l*u floats)
    and every fresh mmapped page faults: 1.4x more tokens/s at m = 2. Memory stays flat only if no
    tensor outlives its step (train.py's losses go into a preallocated buffer), as tests.py checks."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # from glibc's malloc.h
    mallopt(M_MMAP_MAX, 0)  # big blocks come from the heap too, so they can be reused
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # and the heap is not shrunk after each step
    mallopt(M_TOP_PAD, 2**28)


def pick_device(name, local_rank=0):
    """A torch.device from a --device flag: auto is cuda, then mps, then cpu; one clear line if absent."""
    import torch  # here, so that scripts without torch (prepare_data.py) can use the rest

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"unknown --device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            fail("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
        device = torch.device("cuda", local_rank) if device.index is None else device
        torch.cuda.set_device(device)
    if device.type == "mps" and not torch.backends.mps.is_available():
        fail("--device mps asked for, but MPS is not available; use --device cpu")
    return device


def device_name(device):
    """The device's model, for run.json: the GPU's name on CUDA, else the CPU's (/proc/cpuinfo's model
    name, or what the platform module says)."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def peak_memory(device):
    """(bytes, what) of this process's peak memory so far: on CUDA the most the tensors ever held
    (max_memory_allocated), elsewhere the peak resident memory of the whole process (ru_maxrss)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak CUDA memory allocated"
    import resource  # Unix; ru_maxrss is in kB on Linux, in bytes on macOS

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "peak resident memory"
