"""
Continue a prompt with a trained run's model, token by token (Eq. 2; the paper's Table 2
samples with top-p 0.6), in the tokenizer it was trained with (from its data folder).

    python sample.py --prompt "Once upon a time"                           # out/me
    python sample.py --out_dir out/she --seed 1 \\
        --prompt "Once upon a time there was a little princess who"
"""

import argparse
import codecs
import hashlib
import os
import sys
import time

import torch

import machinery
from extractor import Config, Transformer, check_sampling
from machinery import COUNT, NATURAL, SEED, fail


def load_model(out_dir, device):
    """(model in eval mode, checkpoint) of out_dir/ckpt.pt, or of out_dir if a file."""
    path = out_dir if os.path.isfile(out_dir) else os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        first = f"train a run there first (python train.py --out_dir {out_dir} ...)"
        if machinery.in_results(out_dir):  # (train.py refuses)
            first = "results/ keeps runs' logs, not their ckpt.pt: pass a run of yours"
        fail(f"no checkpoint {path}: {first}")
    ckpt = machinery.load_checkpoint(path)
    try:  # fails for an unknown mixer or the weights of another model
        model = Transformer(Config(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except (ValueError, ImportError, RuntimeError) as e:
        why = " ".join(str(e).split())  # (torch's lines as one)
        fail(f"cannot build the model of {path}: {why}")
    return model.to(device).eval(), ckpt


def load_run_tokenizer(data_dir, ckpt):
    """The tokenizer of data_dir, refused unless the run was trained with it."""
    path = os.path.join(data_dir, machinery.TOKENIZER_FILE)
    if not os.path.isfile(path):
        fail(f"no tokenizer {path}; pass the run's --data_dir")
    with open(path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != ckpt["data"]["tokenizer_sha256"]:
            fail(f"{path} is not the run's tokenizer; pass the run's --data_dir")
    return machinery.load_tokenizer(data_dir)


def main(argv=None):
    p = argparse.ArgumentParser(description="Sample text from a run of train.py.")
    p.error = lambda msg: fail(f"{msg} (see python sample.py --help)")
    p.add_argument("--out_dir", default="out/me", help="a run or its ckpt.pt (out/me)")
    p.add_argument("--prompt", default="Once upon a time", help="the text to continue")
    p.add_argument("--max_new_tokens", type=NATURAL, default=200, help="each (200)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (1.0)")
    p.add_argument("--top_k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top_p", type=float, default=0.6, help="nucleus, 1 is off (0.6)")
    p.add_argument("--num_samples", type=COUNT, default=1, help="how many samples (1)")
    p.add_argument("--seed", type=SEED, default=1337, help="same seed, same samples")
    p.add_argument("--data_dir", help="the run's tokenizer (the run's --data_dir)")
    p.add_argument("--device", default="auto", help="auto (cuda, else cpu), cpu, mps")
    args = p.parse_args(argv)
    top_p = None if args.top_p == 1 else args.top_p  # p = 1 keeps every token
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=top_p)
    try:
        check_sampling(**kw)
    except ValueError as e:
        p.error(str(e))
    device = machinery.pick_device(args.device)
    model, ckpt = load_model(args.out_dir, device)
    enc = load_run_tokenizer(args.data_dir or ckpt["args"]["data_dir"], ckpt)
    # no prompt: a new document
    ids = enc.encode(args.prompt, disallowed_special=()) or [enc.eot_token]
    if len(ids) > model.cfg.block_size:
        note = f"{len(ids)} prompt tokens, more than l: it goes on from the last l"
        print(f"note: {note}", file=sys.stderr)
    run = f"{args.out_dir} after {ckpt['iter']} batches"
    print(f"# {run}, seed {args.seed}", file=sys.stderr)
    torch.manual_seed(args.seed)  # once: each sample goes on with the stream
    sys.stdout.reconfigure(errors="replace")  # what the terminal cannot show is '?'
    t0 = time.time()
    for k in range(args.num_samples):
        if k > 0:
            print("-" * 40)
        print(args.prompt, end="", flush=True)
        idx = torch.tensor([ids], device=device)
        # each token printed as sampled, decoded incrementally: it may end mid-character
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for tok in model.generate(idx, args.max_new_tokens, **kw):  # (1, 1) each
            piece = text.decode(enc.decode_single_token_bytes(tok.item()))
            print(piece, end="", flush=True)
        print(text.decode(b"", final=True))
    peak, what = machinery.peak_memory(device)
    n = args.num_samples * args.max_new_tokens
    dt = time.time() - t0
    print(f"# {n} tokens in {dt:.1f} s; {what} {peak / 2**30:.2f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C ends the sample, quietly
        sys.exit(130)
    except BrokenPipeError:  # | head: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
