"""Tests: python -m pytest tests.py  (CPU, no network; loopback servers only).

TEST_DEVICE=cuda (or cuda:N, mps) runs the model, FIR, generation and training tests on that device; the
literal references stay on the CPU in float64. `-m device` selects the tests that only mean something on
a GPU (they skip elsewhere)."""

import copy
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))  # the scripts run here in subprocesses
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from extractor import Config, Transformer  # noqa: E402


def _test_device():
    """The device named by TEST_DEVICE (default cpu), and why it cannot be used (None if it can)."""
    name = os.environ.get("TEST_DEVICE", "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        return torch.device("cpu"), f"TEST_DEVICE={name!r} is not a device name; use cpu, cuda, cuda:N or mps"
    there = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": torch.backends.mps.is_available(),
    }
    if not there.get(device.type, False):
        return torch.device("cpu"), f"TEST_DEVICE={name}: torch sees no such device here; unset it"
    if device.type == "cuda":  # the same numbers every time, so "bit for bit" means what it does on the CPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    return device, None


DEVICE, _NO_DEVICE = _test_device()
FLOAT = torch.float32 if DEVICE.type == "mps" else torch.float64  # MPS has no float64
TOL = 1e-9 if FLOAT == torch.float64 else 1e-4
on_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA device test: TEST_DEVICE=cuda")


@pytest.fixture(autouse=True, scope="session")
def _test_device_is_there():
    if _NO_DEVICE:  # one line, before any test runs
        pytest.exit(_NO_DEVICE, returncode=4)


def dev(obj):
    """A copy of a CPU tensor or module on the test device in FLOAT; the original stays the reference."""
    return (copy.deepcopy(obj) if isinstance(obj, torch.nn.Module) else obj).to(DEVICE, FLOAT)


def cpu64(*tensors):
    return [t.detach().cpu().double() for t in tensors]


def error_line(capsys, fn, *args, **kw):
    """fn(*args, **kw), a script's main or one of its functions, must end with exit status 1 (returned or
    raised as SystemExit) and one line "error: ..." on stderr, no traceback; returns that line."""
    capsys.readouterr()
    try:
        rc = fn(*args, **kw)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: ") and "\n" not in err, (rc, err)
    return err


def run_script(*argv, **kw):
    """python <argv> from the project's root, as a user runs it: (exit status, stdout, stderr)."""
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, **kw)
    return r.returncode, r.stdout, r.stderr


def tiny_model(mixer, l=16, d=16, n_head=4, n_layer=2, vocab=50, n_hidden=32, seed=0):
    """A small Transformer on the CPU in float32, with the paper's initialisation, in eval mode."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=vocab, block_size=l, n_embd=d, n_hidden=n_hidden, n_layer=n_layer, n_head=n_head)
    return Transformer(Config(**sizes, mixer=mixer)).eval()


def scrambled(module, std):
    """module in float64 with every parameter and buffer drawn again ~ N(0, std²): larger than the paper's
    init, so that every term matters and greedy choices are not ties."""
    module = module.double()
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.normal_(0, std)
    return module


def make_data(path, vocab=64, n_words=5000, seed=0):
    """A data folder as prepare_data.py writes it (train.bin, val.bin, meta.json with token counts and
    sha256), from made-up 'words': fixed random token strings, so that there is something to learn."""
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, vocab - 1, size=rng.integers(2, 6)) for _ in range(40)]
    ids = np.concatenate([words[i] for i in rng.integers(0, 40, size=n_words)]).astype(np.uint16)
    os.makedirs(path, exist_ok=True)
    meta, cut = {"vocab_size": vocab}, int(0.9 * len(ids))
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        part.tofile(os.path.join(path, f"{split}.bin"))
        meta[f"{split}_tokens"], meta[f"{split}_sha256"] = (
            len(part),
            hashlib.sha256(part.tobytes()).hexdigest(),
        )
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "data")
