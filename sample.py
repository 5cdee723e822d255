"""
Generate text from a trained run, streaming it token by token (the paper's Table 2 uses top-p 0.6).

    python sample.py                                            # out/me, prompt "Once upon a time"
    python sample.py --out_dir out/she --prompt "Once upon a time there was a little princess who" --seed 1

The tokenizer is read from the run's data folder (stored in its checkpoint; --data_dir overrides) and
must be the one the run was trained with. Beyond l tokens each new token is predicted from the last
l (Eq. 2).
"""

import argparse
import codecs
import hashlib
import math
import os
import shlex
import sys
import time

import torch

import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
from common import check_seed, fail, one_line_errors, peak_memory, pick_device, plain_output
from extractor import Config, Transformer
from prepare_data import TOKENIZER_FILE, load_tokenizer


def build_parser():
    p = argparse.ArgumentParser(
        description="Sample text from a checkpoint written by train.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out_dir", default="out/me", help="run folder holding ckpt.pt")
    p.add_argument("--prompt", default="Once upon a time", help="text to continue (its last l tokens)")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this; 0 = greedy")
    p.add_argument("--top_k", type=int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--top_p", type=float, default=0.6, help="nucleus sampling (Table 2: 0.6); 1 = off")
    p.add_argument("--num_samples", type=int, default=1, help="number of samples")
    p.add_argument("--seed", type=int, default=1337, help="random seed, for reproducible samples")
    p.add_argument("--data_dir", default=None, help="folder with tokenizer.tiktoken; default: the run's")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, mps")
    return p


def check_args(args):
    if args.max_new_tokens < 0 or args.num_samples < 1:
        fail("--max_new_tokens must be >= 0 and --num_samples >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        fail(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        fail(f"--top_k must be at least 1, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1], got {args.top_p}")
    check_seed("seed", args.seed)


def load_model(out_dir, device):
    """The model of a run's ckpt.pt (plain dicts and tensors only: weights_only=True) and the checkpoint."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        fail(
            f"no checkpoint {path}: no run has reached one in that folder (train.py writes ckpt.pt at batch "
            f"10); train a run there first: python train.py --out_dir {shlex.quote(out_dir)} + its settings"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = Transformer(Config(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except Exception as e:
        fail(f"cannot load {path} ({type(e).__name__}); is it a checkpoint of train.py?")
    return model.to(device).eval(), ckpt


def run_data_dir(out_dir, ckpt):
    """The data folder train.py keeps in its checkpoint; one line if the checkpoint has none."""
    data_dir = ckpt.get("args", {}).get("data_dir")
    if data_dir is None:
        path = os.path.join(out_dir, "ckpt.pt")
        fail(f"{path} does not name the run's data folder; pass --data_dir, the folder with its tokenizer")
    return data_dir


def load_run_tokenizer(data_dir, ckpt):
    """The tokenizer, refused unless it is the one the run was trained with."""
    path = os.path.join(data_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
        fail(f"no tokenizer {path}; pass the run's --data_dir")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    want = ckpt.get("data", {}).get("tokenizer_sha256")  # (None for data made without prepare_data.py)
    if want and digest != want:
        fail(f"{path} is not the tokenizer the run was trained with (sha256 differs); pass its --data_dir")
    enc = load_tokenizer(data_dir)
    if enc.n_vocab != ckpt["config"]["vocab_size"]:
        fail(
            f"{path} has {enc.n_vocab} tokens, the model {ckpt['config']['vocab_size']}; pass its --data_dir"
        )
    return enc


def stream(model, idx, enc, args):
    """Print each new token as soon as it is sampled. A token may end inside a multi-byte UTF-8
    character, so bytes go through an incremental decoder that prints only what is complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    top_p = None if args.top_p >= 1 else args.top_p
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=top_p)
    for tok in model.generate_stream(idx, args.max_new_tokens, **kw):  # (1, 1) each
        print(decoder.decode(enc.decode_single_token_bytes(tok.item())), end="", flush=True)
    print(decoder.decode(b"", final=True))


def main(argv=None):
    plain_output()  # a character the terminal cannot show prints as '?', not a crash
    try:
        args = one_line_errors(build_parser(), "sample.py").parse_args(argv)
        check_args(args)
        device = pick_device(args.device)  # auto: cuda, then mps, then cpu
        model, ckpt = load_model(args.out_dir, device)
        enc = load_run_tokenizer(args.data_dir or run_data_dir(args.out_dir, ckpt), ckpt)
    except SystemExit as e:  # the message is already printed
        return e.code
    except OSError as e:  # an unreadable file
        print(
            f"error: cannot read {e.filename} ({e.strerror}); check --out_dir and --data_dir", file=sys.stderr
        )
        return 1

    ids = enc.encode(args.prompt, disallowed_special=()) or [enc.eot_token]  # empty: a new document
    l = model.cfg.block_size
    if len(ids) > l:
        print(
            f"note: the prompt has {len(ids)} tokens, more than l = {l}; keeping its last {l}",
            file=sys.stderr,
        )
        ids = ids[-l:]
    after = f" after {ckpt['iter']} batches" if "iter" in ckpt else ""  # (a checkpoint saved by hand)
    print(f"# {args.out_dir}{after}, seed {args.seed}", file=sys.stderr)
    torch.manual_seed(args.seed)
    t0 = time.time()
    try:
        for k in range(args.num_samples):
            print(("-" * 40 + "\n" if k else "") + args.prompt, end="", flush=True)
            stream(model, torch.tensor([ids], dtype=torch.long, device=device), enc, args)  # (1, t)
    except KeyboardInterrupt:  # Ctrl-C ends the sample, quietly
        print()
        return 130
    peak, what = peak_memory(device)
    n = args.num_samples * args.max_new_tokens
    print(f"# {n} tokens in {time.time() - t0:.1f} s; {what} {peak / 2**30:.2f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
