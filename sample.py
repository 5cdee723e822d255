"""
Generate text from a trained run, streaming it token by token (the paper's Table 2 uses top-p 0.6).

    python sample.py                                            # out/me, prompt "Once upon a time"
    python sample.py --out_dir out/she --prompt "Once upon a time there was a little princess who" --seed 1
The tokenizer is read from the run's data directory (the one stored in its checkpoint; --data_dir overrides).
"""
import argparse
import codecs
import os
import sys

import torch

from extractor import Config, Transformer
import synthesizer  # noqa: F401  (adds the Synthesizer mixers to MIXERS)
from train import pick_device


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(1)


def build_parser():
    p = argparse.ArgumentParser(description="Sample text from a checkpoint written by train.py.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out_dir", default="out/me", help="run folder holding ckpt.pt")
    p.add_argument("--prompt", default="Once upon a time", help="text to continue (its last l tokens are used)")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this")
    p.add_argument("--top_k", type=int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--top_p", type=float, default=0.6, help="nucleus sampling: the smallest set of tokens "
                                                             "with probability >= p (Table 2: 0.6); 1 = off")
    p.add_argument("--num_samples", type=int, default=1, help="number of samples")
    p.add_argument("--seed", type=int, default=1337, help="random seed, for reproducible samples")
    p.add_argument("--data_dir", default=None, help="folder with tokenizer.tiktoken; default: the run's")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, mps")
    return p


def check_args(args):
    if args.max_new_tokens < 0 or args.num_samples < 1:
        fail("--max_new_tokens must be >= 0 and --num_samples >= 1")
    if not args.temperature > 0:
        fail(f"--temperature must be positive, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        fail(f"--top_k must be at least 1, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1], got {args.top_p}")


def load_model(out_dir, device):
    """The model of a run's ckpt.pt (plain dicts and tensors only: weights_only=True) and its settings."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        fail(f"no checkpoint {path}; train one first (python train.py --out_dir {out_dir}) or pass --out_dir")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        cfg = Config(**ckpt["config"])
        model = Transformer(cfg)
        model.load_state_dict(ckpt["model"])
    except Exception as e:
        fail(f"cannot load {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
             f"is it from this version of train.py?")
    return model.to(device).eval(), cfg, ckpt["args"], ckpt["iter"]


def stream(model, idx, enc, args):
    """Print each new token as soon as it is sampled. A token may end inside a multi-byte UTF-8
    character, so bytes go through an incremental decoder that prints only what is complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for tok in model.generate_stream(idx, args.max_new_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=None if args.top_p >= 1 else args.top_p):  # (1, 1)
        print(decoder.decode(enc.decode_single_token_bytes(tok.item())), end="", flush=True)
    print(decoder.decode(b"", final=True))


def main(argv=None):
    parser = build_parser()
    parser.error = lambda msg: fail(f"{msg} (see python sample.py --help)")
    try:
        args = parser.parse_args(argv)
        check_args(args)
        device = pick_device(args.device, local_rank=0)  # auto: cuda, then mps, then cpu
        model, cfg, run_args, iters = load_model(args.out_dir, device)
        data_dir = args.data_dir or run_args["data_dir"]
        if not os.path.isfile(os.path.join(data_dir, "tokenizer.tiktoken")):
            fail(f"no tokenizer {os.path.join(data_dir, 'tokenizer.tiktoken')}; pass the run's --data_dir")
        from prepare_data import load_tokenizer
        enc = load_tokenizer(data_dir)
        if enc.n_vocab != cfg.vocab_size:
            fail(f"the tokenizer in {data_dir} has {enc.n_vocab} tokens, the model {cfg.vocab_size}; "
                 f"pass the run's --data_dir")
    except SystemExit as e:  # the message is already printed, or is the exit code (prepare_data's fail)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code

    ids = enc.encode(args.prompt, disallowed_special=())  # "<|endoftext|>" in a prompt is plain text
    if not ids:  # an empty prompt starts a new document, as after a book boundary
        ids = [enc.eot_token]
    l = cfg.block_size
    if len(ids) > l:
        print(f"note: the prompt has {len(ids)} tokens, more than l = {l}; keeping its last {l}", file=sys.stderr)
        ids = ids[-l:]
    print(f"# {args.out_dir} after {iters} batches, seed {args.seed}", file=sys.stderr)
    torch.manual_seed(args.seed)
    for k in range(args.num_samples):
        if k:
            print("-" * 40)
        print(args.prompt, end="", flush=True)
        stream(model, torch.tensor([ids], dtype=torch.long, device=device), enc, args)  # (1, t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
