# ruff: noqa: F403, F405
import csv
import functools
import gzip
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import prepare_data
import sample
import train
from extractor import Config, Transformer
from tests_header import *

# ======== training (train.py): batches, settings, the step, run folders, checkpoints, stopping ========

TINY = "--mixer me --n_layer 2 --n_embd 16 --n_hidden 32 --block_size 8 --batch_size 4 --n_head 4".split()
TINY += f"--eval_batches 2 --eval_interval 5 --log_interval 5 --device {DEVICE}".split()


def run(tmp_path, data, *flags, name="run"):
    """train.main on the tiny settings into tmp_path/name: its exit status."""
    return train.main(TINY + ["--data_dir", data, "--out_dir", str(tmp_path / name), *flags])


def log_rows(out):
    with open(os.path.join(out, "log.csv")) as f:
        return list(csv.DictReader(f))


def losses(out):
    """The log's (batch, training cost, validation loss) as written: the same strings are the same floats."""
    return [(r["iter"], r["train_loss"], r["val_loss"]) for r in log_rows(out)]


def ckpt_iter(out):
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter"]


def files(folder):
    """Every file of a folder with its bytes: a refused command must change none."""
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


# ---- the batches: a seeded order per epoch, the same for every mixer
def test_batch_order_is_a_seeded_permutation_per_epoch():
    n, b = 50, 8  # 6 full batches per epoch; the 2 leftover starts of each epoch are skipped
    batches = [train.batch_starts(i, n, b, 3) for i in range(18)]
    assert all(len(x) == b for x in batches)
    epochs = [torch.cat(batches[e * 6 : (e + 1) * 6]) for e in range(3)]
    assert all(len(set(e.tolist())) == 48 and 0 <= e.min() and e.max() < n for e in epochs)
    assert not torch.equal(epochs[0], epochs[1])  # a new permutation for the next epoch
    assert torch.equal(train.batch_starts(2, n, b, 3), batches[2])
    assert not torch.equal(train.batch_starts(0, n, b, 4), batches[0])  # another data seed


def test_every_mixer_sees_the_same_batches_and_validation_windows(data, tmp_path, monkeypatch):
    seen, get_batch = {}, train.get_batch
    for name, flags in {"sa": ["--mixer", "sa", "--seed", "1"], "me": ["--dropout", "0"]}.items():
        spy = lambda *a, name=name: seen.setdefault(name, []).append(get_batch(*a)) or seen[name][-1]  # noqa: E731
        monkeypatch.setattr(train, "get_batch", spy)
        train.epoch_permutation.cache_clear()  # (each run computes its order anew, as in its own process)
        assert run(tmp_path, data, "--max_iters", "10", *flags, name=name) == 0
    assert len(seen["sa"]) == len(seen["me"]) == 10 + 2 * 2  # 10 batches, 2 validations of 2 batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(seen["sa"], seen["me"]))
    x, y = seen["sa"][0]
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert torch.equal(seen["sa"][5][0], seen["sa"][12][0])  # the same validation windows each time
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16).astype(np.int64)
    starts = [round(k * (len(val) - 9) / 7) for k in range(8)]  # 8 windows of l+1 spread from first to last
    assert torch.equal(
        torch.cat([seen["sa"][5][0], seen["sa"][6][0]]),
        torch.tensor(np.stack([val[s : s + 8] for s in starts])),
    )


# ---- settings and bad input
def test_help_gives_each_setting_its_symbol_and_table1_value(capsys):
    assert train.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    table1 = {
        "n_layer": "m: number of layers (18)", "block_size": "l: context length (128)",
        "n_embd": "d: dimension of the model (128)", "n_hidden": "c: nodes in the FFN's hidden layer (512)",
        "n_head": "n: heads of self-attention (and of the Synthesizers) (32)",
        "dropout": "p: dropout rate (0.1)",
        "batch_size": "b: batch size, over all processes (64)",
        "lr": "lr: AdamW's learning rate gamma, constant (0.001)",
        "beta1": "bm: AdamW's beta_1 (0.9)", "beta2": "bv: AdamW's beta_2 (0.999)",
    }  # fmt: skip
    for flag, text in table1.items():
        assert f"--{flag} {flag.upper()} {text}" in out, flag
    assert "(default: None)" not in out
    defaults = vars(train.build_parser().parse_args([]))  # the flags' defaults are the model's, Table 1's
    assert {k: defaults[k] for k in ("n_layer", "block_size", "n_embd", "n_hidden", "n_head", "dropout")} == {
        k: getattr(Config, k) for k in ("n_layer", "block_size", "n_embd", "n_hidden", "n_head", "dropout")
    }
    assert (defaults["lr"], defaults["batch_size"], defaults["max_iters"], defaults["weight_decay"]) == (
        1e-3, 64, 60000, 0.01)  # fmt: skip


@pytest.mark.parametrize("flags, says", [
    ("--batch_size 0", "--batch_size must be at least 1"), ("--lr 0", "need --lr > 0"),
    ("--beta2 1", "--beta2 in [0, 1)"), ("--grad_clip nan", "--grad_clip must be a finite number"),
    ("--seed 9223372036854775808", "--seed in [0, 2**63)"), ("--time_limit 5x", "'5x' is not a time"),
    ("--mixer nope", "unknown mixer 'nope'"), ("--n_head 5", "n_head=5 must divide n_embd=16"),
    ("--resume --overwrite", "pass one of them"), ("--eval_batches 500", "use fewer --eval_batches"),
    ("--device cuda:99", "torch sees no such device"), ("--max_iters x", "invalid int value: 'x'"),
    ("--dtype half", "invalid choice: 'half'"),
])  # fmt: skip
def test_bad_input_is_one_line_and_writes_nothing(flags, says, data, tmp_path, capsys):
    assert says in error_line(capsys, run, tmp_path, data, "--mixer=sa", "--max_iters=3", *flags.split())
    assert not os.path.exists(tmp_path / "run")


def test_missing_or_damaged_data_is_one_line(data, tmp_path, capsys):
    assert "meta.json is missing" in error_line(capsys, run, tmp_path, str(tmp_path / "none"))
    bad = make_data(tmp_path / "bad")
    with open(os.path.join(bad, "train.bin"), "r+b") as f:
        f.write(b"\x01\x02")  # a changed token: no longer the file meta.json describes
    assert "re-run prepare_data.py" in error_line(capsys, run, tmp_path, bad)


@pytest.mark.slow
def test_bad_input_from_the_command_line_has_no_traceback():
    rc, out, err = run_script("train.py", "--n_layer", "0")
    assert rc == 1 and err.startswith("error: n_layer must be a positive integer") and err.count("\n") == 1


# ---- the step: AdamW written out from its definition, with Table 1's settings
def literal_adamw(params, grads, state, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, decay=0.01):
    """One AdamW step (Loshchilov and Hutter), as written: decoupled decay, then the bias-corrected
    moments, on every parameter."""
    for p, g, (m, v) in zip(params, grads, state):
        p.mul_(1 - lr * decay)
        m.mul_(b1).add_((1 - b1) * g)
        v.mul_(b2).add_((1 - b2) * g * g)
        p.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_training_step_is_adamw_with_table1_settings_written_out(clip):
    """Three of train.py's steps against AdamW written out, on the same model in float64 without dropout:
    the same parameters to float64 precision. With clipping, the gradients are first scaled so that
    their global norm is at most clip."""
    args = train.build_parser().parse_args(["--dropout", "0", "--grad_clip", str(clip), "--seed", "3"])
    cfg = Config(
        vocab_size=30, block_size=8, n_embd=8, n_hidden=16, n_layer=1, n_head=2, dropout=0.0, mixer="he"
    )
    model, adamw = train.build_model(cfg, args, torch.device("cpu"))
    model.double()
    reference = copy.deepcopy(model)
    params = list(reference.parameters())
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    ctx, scaler = train.precision(torch.device("cpu"), "float32")
    for t in range(1, 4):
        x, y = torch.randint(0, 30, (2, 2, 8), generator=torch.Generator().manual_seed(t))
        loss = train.train_step(model, adamw, scaler, ctx, x, y, grad_clip=clip)
        ref_loss = reference(x, y)[1]
        grads = torch.autograd.grad(ref_loss, params)
        assert abs(loss.item() - ref_loss.item()) < 1e-12  # the loss before the step, Eq. (3)
        norm = math.sqrt(sum((g**2).sum().item() for g in grads))
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        with torch.no_grad():
            literal_adamw(params, [g * scale for g in grads], state, t)
        assert clip == 0 or scale < 1  # the clip binds at least in this test
    for p, q in zip(model.parameters(), params):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), (p - q).abs().max()


# ---- resume: bit for bit after Ctrl-C, with the run's own settings, on the same data only
def test_ctrl_c_checkpoints_and_resume_continues_bit_for_bit(data, tmp_path, monkeypatch, capsys):
    assert run(tmp_path, data, "--max_iters", "14", name="whole") == 0
    get_batch, calls = train.get_batch, []

    def ctrl_c(*a):  # during the validation at batch 5 (calls 6 and 7): the run stops after batch 6
        calls.append(1)
        if len(calls) == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return get_batch(*a)

    monkeypatch.setattr(train, "get_batch", ctrl_c)
    rc, out = run(tmp_path, data, "--max_iters", "14", "--lr", "0.001"), str(tmp_path / "run")
    assert rc == 130 and ckpt_iter(out) == 6 and "SIGINT: stopped at batch 6" in capsys.readouterr().out
    monkeypatch.setattr(train, "get_batch", get_batch)
    with open(os.path.join(out, "log.csv"), "a") as f:
        f.write("7,1.5,,0.001,1.0,1.0\n8,2.")  # rows logged after the checkpoint, one cut: dropped
    assert train.main(["--out_dir", out, "--resume", "--max_iters", "14"]) == 0  # the rest from ckpt.pt
    assert losses(out) == losses(str(tmp_path / "whole")) and len(losses(out)) == 14


def test_resume_keeps_the_runs_settings_and_data(data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters", "5", "--lr", "0.003") == 0
    assert train.main(["--out_dir", out, "--resume", "--max_iters", "10", "--log_interval", "2"]) == 0
    info = json.load(open(os.path.join(out, "run.json")))
    assert (
        info["args"]["lr"] == 0.003 and info["args"]["log_interval"] == 2 and info["config"]["n_layer"] == 2
    )
    for flags, says in (
        (["--dtype", "bfloat16"], "trained with --dtype float32"),
        (["--lr", "0.001"], "--lr 0.003"),
    ):
        assert says in error_line(capsys, train.main, ["--out_dir", out, "--resume", *flags])
    other = make_data(tmp_path / "other", seed=1)
    said = error_line(
        capsys, train.main, ["--out_dir", out, "--resume", "--max_iters", "20", "--data_dir", other]
    )
    assert "trained on other data (train_sha256, val_sha256 differ)" in said and ckpt_iter(out) == 10
    assert "nothing to train" in (train.main(["--out_dir", out, "--resume"]) or capsys.readouterr().out)


# ---- the run folder: one run each
def test_a_folder_holds_one_run(data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters", "5") == 0
    before = files(out)
    assert "holds a run: --resume continues it" in error_line(capsys, run, tmp_path, data, "--max_iters", "5")
    assert files(out) == before
    with train.locked(out):  # a train.py working in the folder
        said = error_line(capsys, run, tmp_path, data, "--max_iters", "9", "--resume")
    assert "another train.py is running in" in said and files(out) == before
    assert run(tmp_path, data, "--max_iters", "3", "--overwrite") == 0 and ckpt_iter(out) == 3
    assert len(log_rows(out)) == 3  # the old run's log is gone with it
    os.remove(os.path.join(out, "ckpt.pt"))  # now the folder holds no run: a plain command starts it
    assert "drop --resume" in error_line(capsys, run, tmp_path, data, "--resume")
    assert run(tmp_path, data, "--max_iters", "4") == 0 and ckpt_iter(out) == 4


def test_checkpoints_are_written_whole_or_not_at_all(data, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters", "5") == 0
    save = torch.save

    def full_disk(obj, f):
        save(obj, f)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    said = error_line(capsys, train.main, ["--out_dir", out, "--resume", "--max_iters", "10"])
    assert said == f"error: cannot write {out}/ckpt.pt (No space left on device); the last checkpoint is kept"
    assert ckpt_iter(out) == 5 and [n for n in os.listdir(out) if n.endswith(".tmp")] == []


def test_a_cost_that_is_not_finite_ends_the_run_keeping_the_last_checkpoint(data, tmp_path, capsys):
    said = error_line(
        capsys, run, tmp_path, data, "--lr", "1e30", "--max_iters", "50", "--ckpt_interval", "1"
    )
    assert "the training cost became nan at batch" in said and "--grad_clip" in said
    bad = int(said.split("at batch ")[1].split(";")[0])
    assert ckpt_iter(str(tmp_path / "run")) < bad


def test_time_limit_stops_at_a_checkpoint_before_the_time_is_up(data, tmp_path, monkeypatch, capsys):
    clock, get_batch = [1000.0], train.get_batch
    monkeypatch.setattr(train.time, "time", lambda: clock[0])
    monkeypatch.setattr(train, "get_batch", lambda *a: clock.__setitem__(0, clock[0] + 1) or get_batch(*a))
    rc = run(tmp_path, data, "--max_iters", "100", "--time_limit", "0.5m", "--eval_batches", "0")
    assert rc == 0 and "--time_limit: stopped at batch 24 with a checkpoint" in capsys.readouterr().out
    assert ckpt_iter(str(tmp_path / "run")) == 24  # 24 s + 2 x the slowest batch + 5 s (a guess at a
    # checkpoint's time, before one was measured) > 30 s: the checkpoint is written with time to spare


# ---- what a run writes: log.csv, run.json, the console
def test_log_run_json_and_console(data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert run(tmp_path, data, "--max_iters", "12", "--mixer", "sa", "--n_layer", "1") == 0
    console = capsys.readouterr().out
    rows = log_rows(out)
    assert [int(r["iter"]) for r in rows] == list(range(1, 13)) and rows[0]["lr"] == "0.001"
    assert [r["iter"] for r in rows if r["val_loss"]] == ["5", "10", "12"]  # every 5 and at the end
    assert [line.split(" |")[0] for line in console.splitlines() if line.startswith("iter")] == [
        "iter 5/12", "iter 10/12", "iter 12/12"]  # fmt: skip
    mean = sum(float(r["train_loss"]) for r in rows[5:10]) / 5
    assert f"iter 10/12 | loss {mean:.4f} | val {float(rows[9]['val_loss']):.4f} |" in console
    info = json.load(open(os.path.join(out, "run.json")))
    assert info["config"] == dict(vocab_size=64, block_size=8, n_embd=16, n_hidden=32, n_layer=1, n_head=4,
                                  dropout=0.1, mixer="sa")  # fmt: skip
    assert info["params"]["mixers"] == 4 * 16 * 16 and info["data"]["train_sha256"] == json.load(
        open(os.path.join(data, "meta.json")))["train_sha256"]  # fmt: skip
    assert info["computed"]["device"] == str(DEVICE) and info["computed"]["torch"] == torch.__version__
    assert info["computed"]["step"] == ("CapturedStep" if DEVICE.type == "cuda" else "eager")
    assert info["peak_memory_mb"] > 0 and f"{info['peak_memory_is']}: " in console


@pytest.mark.parametrize("flags, name", [
    ([], "sa-32"), (["--mixer", "me"], "me"), (["--mixer", "sa", "--n_head", "4"], "sa-4"),
    (["--mixer", "me", "--n_layer", "2", "--block_size", "64", "--batch_size", "32"], "me-m2-l64-b32"),
    (["--lr", "3e-4", "--dropout", "0"], "sa-32-p0-lr0.0003"),
    (["--beta1", "0", "--batch_size", "10"], "sa-32-b10-bm0"), (["--seed", "12345678"], "sa-32-seed12345678"),
    (["--weight_decay", "0.1", "--data_seed", "7"], "sa-32-wd0.1-dseed7"),
])  # fmt: skip
def test_default_run_folders_name_the_settings_that_are_not_table_1s(flags, name):
    assert train.default_out_dir(train.build_parser().parse_args(flags)) == os.path.join("out", name)


# ---- stopping from outside: a signal, a closed stdout; DDP
def start_run(tmp_path, data, *more):
    """train.py in a subprocess, its console in a pipe, once its first progress line has come."""
    out = str(tmp_path / "sub")
    flags = TINY + [
        "--data_dir",
        data,
        "--out_dir",
        out,
        "--max_iters",
        "100000",
        "--log_interval",
        "10",
        *more,
    ]
    p = subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, text=True, stdout=subprocess.PIPE)
    while not p.stdout.readline().startswith("iter "):
        assert p.poll() is None
    return p, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_kill_and_hangup_stop_with_a_checkpoint(sig, data, tmp_path):
    p, out = start_run(tmp_path, data)
    p.send_signal(sig)
    rest = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + sig and f"{signal.Signals(sig).name}: stopped at batch" in rest
    assert [int(r["iter"]) for r in log_rows(out)] == list(range(1, ckpt_iter(out) + 1))


@pytest.mark.slow
def test_a_closed_stdout_stops_like_a_signal_and_kill_9_resumes_from_the_checkpoint(data, tmp_path):
    p, out = start_run(tmp_path, data, "--log_interval", "1")
    p.stdout.close()  # | head: the reader has gone
    assert p.wait(timeout=60) == 128 + signal.SIGPIPE and ckpt_iter(out) >= 2  # a batch or two later
    p, out = start_run(tmp_path, data, "--ckpt_interval", "10", "--resume")
    time.sleep(0.5)
    p.kill()  # kill -9: no checkpoint now; the last one stands
    p.wait()
    done = ckpt_iter(out)
    assert train.main(["--out_dir", out, "--resume", "--max_iters", str(done + 5)]) == 0
    assert [int(r["iter"]) for r in log_rows(out)] == list(range(1, done + 6))


@pytest.mark.slow
def test_ddp_with_two_processes_trains_as_one(data, tmp_path):
    """torchrun with 2 CPU processes (gloo) splits each batch; the log holds each whole batch's loss."""
    flags = TINY + ["--data_dir", data, "--max_iters", "6", "--device", "cpu", "--dropout", "0"]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
    ]
    r = subprocess.run(torchrun + flags + ["--out_dir", str(tmp_path / "ddp")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0 and r.stdout.count("iter 6/6") == 1, r.stdout + r.stderr[-2000:]
    assert train.main(flags + ["--out_dir", str(tmp_path / "one")]) == 0
    for a, b in zip(losses(str(tmp_path / "ddp")), losses(str(tmp_path / "one")), strict=True):
        assert a[0] == b[0] and abs(float(a[1]) - float(b[1])) < 1e-5 and bool(a[2]) == bool(b[2])


# ---- on a GPU: the captured step is the eager step
@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("mixer", ["sa", "she", "he", "we", "me", "he-ext"])
def test_captured_step_equals_the_eager_step_bit_for_bit(mixer):
    """3 eager warm-up steps, the capture, 5 replays, with dropout and clipping on, in float32 and bf16:
    the same losses, parameters and AdamW moments to the bit, and the CUDA generator where the eager steps
    leave it (so a checkpoint's RNG state continues the run)."""
    cfg = Config(vocab_size=50, block_size=16, n_embd=16, n_hidden=32, n_layer=2, n_head=4, mixer=mixer)
    batches = torch.randint(0, 50, (9, 4, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for dtype in ("float32", "bfloat16"):
        ends = []
        for captured in (False, True):
            torch.manual_seed(0)
            model = Transformer(cfg).to(DEVICE)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
            ctx, scaler = train.precision(DEVICE, dtype)
            step = functools.partial(train.train_step, model, opt, scaler, ctx, grad_clip=0.5)
            step = train.CapturedStep(step) if captured else step
            loss = torch.stack([step(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches])
            moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
            ends.append((loss, list(model.parameters()) + moments, torch.cuda.get_rng_state(DEVICE)))
        (loss_e, tensors_e, rng_e), (loss_g, tensors_g, rng_g) = ends
        assert torch.equal(loss_g, loss_e) and torch.equal(rng_g, rng_e), dtype
        assert all(torch.equal(a, b) for a, b in zip(tensors_g, tensors_e)), dtype


# ======== sampling (sample.py), and end to end ========

WORDS = "the a little old fox owl hen miller river garden moon sang found carried over under once upon"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepare_data.py's outputs for three made-up books, and a tiny sa run trained on them."""
    root = tmp_path_factory.mktemp("prepared")
    rng, books, ids = np.random.default_rng(0), root / "books", (101, 102, 103)
    books.mkdir()
    for i in ids:
        text = " ".join(rng.choice(WORDS.split() + ["—", "naïve", "café"], 3000))
        marker = "*** {} OF THE PROJECT GUTENBERG EBOOK TALES ***\n"
        (books / f"{i}.txt").write_text(marker.format("START") + text + "\n" + marker.format("END"))
    (root / "books.tsv").write_text("".join(f"{k}\t{i}\tTales {i}\n" for k, i in enumerate(ids)))
    argv = ["--source", str(books), "--books", str(root / "books.tsv"), "--data_dir", str(root / "data")]
    assert prepare_data.main(argv + ["--vocab_size", "300", "--min_chars", "1000"]) == 0
    out, data = str(root / "run"), f"--data_dir={root / 'data'}"
    assert train.main(TINY + ["--mixer=sa", data, f"--out_dir={out}", "--max_iters=30"]) == 0
    return str(root / "data"), out


def test_sample_prints_a_character_split_over_tokens_once_it_is_whole(prepared, monkeypatch, capsys):
    enc = prepare_data.load_tokenizer(prepared[0])
    ids = [enc.encode_single_token(bytes([c])) for c in "é€ ok".encode()]  # a token for each byte
    model, ckpt = sample.load_model(prepared[1], torch.device("cpu"))
    monkeypatch.setattr(model, "generate_stream", lambda *a, **kw: (torch.tensor([[i]]) for i in ids))
    monkeypatch.setattr(sample, "load_model", lambda *a: (model, ckpt))
    assert sample.main(["--out_dir", prepared[1], "--prompt", "", "--max_new_tokens", "7"]) == 0
    assert capsys.readouterr().out == "é€ ok\n"


def test_sample_continues_a_long_prompt_from_its_last_l_tokens(prepared, tmp_path, capsys):
    enc, l, ckpt = prepare_data.load_tokenizer(prepared[0]), 8, torch.load(prepared[1] + "/ckpt.pt")
    g = torch.Generator().manual_seed(0)
    for w in ckpt["model"].values():
        w.normal_(0, 0.3, generator=g)  # distinct logits: greedy choices are no ties
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ids = enc.encode("the little old fox sang over the river and the miller found the moon under a garden")
    head, tail = enc.decode(ids[:l]), enc.decode(ids[-l:])  # the first and the last l tokens, as text
    assert len(ids) > l and enc.encode(head) == ids[:l] and enc.encode(tail) == ids[-l:]

    def greedy(prompt):  # the new text of a greedy sample, and what was said on stderr
        argv = ["--out_dir", str(tmp_path), "--prompt", prompt, "--temperature=0", "--max_new_tokens=8"]
        assert sample.main(argv) == 0
        said = capsys.readouterr()
        return said.out[len(prompt) :], said.err

    (new, err), (from_tail, _), (from_head, _) = greedy(enc.decode(ids)), greedy(tail), greedy(head)
    assert "it goes on from the last l" in err and from_head != from_tail  # the windows differ: it can fail
    assert new == from_tail


def test_sample_is_reproducible_and_refuses_what_it_cannot_use(prepared, tmp_path, capsys):
    data, out = prepared
    texts = []
    for flags in (["--seed=1"], ["--seed=1"], ["--temperature=0", "--seed=2"], ["--temperature=0"]):
        assert sample.main(["--out_dir", out + "/ckpt.pt", "--max_new_tokens=20", *flags]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    other = tmp_path / "other"
    other.mkdir()
    with open(os.path.join(data, "tokenizer.tiktoken"), "rb") as f:
        (other / "tokenizer.tiktoken").write_bytes(f.read()[:-20])
    said = error_line(capsys, sample.main, ["--out_dir", out, "--data_dir", str(other)])
    assert "not the tokenizer the run was trained with" in said
    assert "no checkpoint" in error_line(capsys, sample.main, ["--out_dir", str(tmp_path / "none")])
    assert "finite number" in error_line(capsys, sample.main, ["--out_dir", out, "--temperature=inf"])
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    assert "it is damaged" in error_line(capsys, sample.main, ["--out_dir", str(tmp_path / "bad.pt")])


def test_a_mixer_of_your_own_module_trains_and_samples_by_its_name(prepared, tmp_path, monkeypatch):
    (tmp_path / "mymixers.py").write_text(
        "import torch\n\nclass Mean(torch.nn.Module):  # each position: the mean of the inputs so far\n"
        "    uses_heads = False\n\n    def __init__(self, cfg):\n        super().__init__()\n\n"
        "    def forward(self, x, cache=None):\n"
        "        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = str(tmp_path / "mean")
    assert run(tmp_path, prepared[0], "--mixer", "mymixers.Mean", "--max_iters", "3", "--out_dir", out) == 0
    assert sample.main(["--out_dir", out, "--max_new_tokens", "5"]) == 0


@pytest.mark.slow
def test_end_to_end_the_readmes_commands(prepared, tmp_path):
    data = prepared[0]
    for mixer in ("sa", "me"):
        flags = [f"--mixer={mixer}", f"--data_dir={data}", "--max_iters=60", "--lr=3e-3"]
        rc, out, err = run_script(
            "-X", "importtime", "train.py", *TINY, *flags, f"--out_dir={tmp_path / mixer}"
        )
        imported = {
            line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")
        }
        assert {"extractor", "fir", "prepare_data"} <= imported and not {
            "synthesizer",
            "matplotlib",
        } & imported
        costs = [float(r["train_loss"]) for r in log_rows(str(tmp_path / mixer))]
        assert rc == 0 and len(costs) == 60 and np.mean(costs[-10:]) < np.mean(costs[:10]) - 0.3  # it learns
    command = f"{sys.executable} sample.py --out_dir {tmp_path / 'me'} --max_new_tokens 500 | head -c 20"
    r = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
    assert r.stdout.startswith("Once upon a time") and len(r.stdout) == 20 and "Traceback" not in r.stderr


# ======== experiments/reproduce.py: Table 1's runs side by side, the same-experiment check ========
SIZES = TINY[2:16]  # TINY's sizes, without its mixer and device


@pytest.mark.slow
def test_reproduce_goes_on_where_it_stopped_and_checks_against_the_cpu_runs(data, tmp_path, monkeypatch):
    import reproduce

    results, work = tmp_path / "results", str(tmp_path / "work")
    argv = ["--device=cpu", f"--data_dir={data}", f"--work={work}", f"--results={results}"]
    for n in (20, 40):  # a second call goes on from the first's checkpoints
        runs = {
            "sa-1": ["--mixer=sa", "--n_head=1", *SIZES, f"--max_iters={n}"],
            "me": ["--mixer=me", *SIZES],
        }
        monkeypatch.setattr(reproduce, "RUNS", {k: v + [f"--max_iters={n}"] for k, v in runs.items()})
        assert reproduce.main(argv) == 0
    for name in ("sa-1", "me"):
        with gzip.open(results / "logs" / "table1" / name / "log.csv.gz", "rt") as f:
            assert [int(r["iter"]) for r in csv.DictReader(f)] == list(range(1, 41))
        assert "training from batch 20 to 40" in open(os.path.join(work, name, "console.txt")).read()
    for name in ("sa-1", "me"):  # the "CPU runs": these models trained here, 100 batches each
        cpu = results / "logs" / "table1-cpu" / name
        flags = reproduce.RUNS[name] + [
            "--max_iters=100",
            f"--data_dir={data}",
            f"--out_dir={tmp_path / name}",
        ]
        assert train.main(flags + ["--device=cpu"]) == 0
        os.makedirs(cpu)
        with open(tmp_path / name / "log.csv", "rb") as f, gzip.open(cpu / "log.csv.gz", "wb") as g:
            g.write(f.read())
    assert reproduce.main(argv + ["--check"]) == 0
    assert "passed: every 10-batch window within 0.05" in (results / "gpu" / "check.txt").read_text()
    with gzip.open(results / "logs" / "table1-cpu" / "me" / "log.csv.gz", "rt") as f:
        rows = list(csv.reader(f))
    rows[35][1] = str(float(rows[35][1]) - 0.6)  # batch 35: its window's mean 0.06 lower on the "CPU"
    with gzip.open(results / "logs" / "table1-cpu" / "me" / "log.csv.gz", "wt") as f:
        csv.writer(f).writerows(rows)
    assert reproduce.main(argv + ["--check"]) == 1
    table = (results / "gpu" / "check.txt").read_text().splitlines()
    assert table[-2].startswith("me ") and "+0.0600" in table[-2] and table[-1].startswith("FAILED")
