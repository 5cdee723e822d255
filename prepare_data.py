"""
Prepare the paper's corpus: download the 100 children's books of books.tsv from
gutenberg.org, strip Project Gutenberg's header, licence and footer, hold out whole
books for validation (in order of sha256(str(ebook id)) until they hold --val_fraction
of the text: ebooks 55, 146, 51, 2726, 2557 and 1154), train a byte-level BPE tokenizer
(vocab_size 5000) on the others, and write the token files.

    python prepare_data.py                              # gutenberg.org -> data/
    python prepare_data.py --mirror http://127.0.0.1:8765 --pause 0   # a mirror
    python prepare_data.py --source DIR                 # <ID>.txt or pg<ID>.txt files

Writes to --data_dir: train.bin and val.bin, uint16 token ids, each book followed by
<|endoftext|> (id vocab_size - 1); tokenizer.tiktoken, "base64(token) rank" lines;
meta.json, the books of each split and the files' sha256; raw/<ID>.txt, the downloads (a
rerun fetches only what is missing). train.py and sample.py read them with machinery.py,
checking each file against meta.json; this script imports nothing of the project.
"""

import argparse
import base64
import collections
import contextlib
import hashlib
import heapq
import http.client
import itertools
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import regex  # comes with tiktoken; unlike re it knows \p{L} and \p{N}
import tiktoken

BOOKS_TSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "books.tsv")
URL_PATTERNS = (  # tried in turn
    "/cache/epub/{id}/pg{id}.txt",
    "/ebooks/{id}.txt.utf-8",
    "/files/{id}/{id}-0.txt",
)
USER_AGENT = "extractors-reimplementation/prepare_data.py (one request at a time)"
TIMEOUT = 30.0  # seconds per request
RETRIES = 3  # more tries of a URL: the first BACKOFF seconds later, then twice as long
BACKOFF = 1.0
SPLITS = ("train", "val")
EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.tiktoken"
# GPT-2's: how text is cut into words, which the BPE never merges across
SPLIT_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def fail(msg):
    """Bad input: one line on stderr, what is wrong and what to do; exit 1, no trace."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def atomic_write(path, data):
    """The bytes data whole at path or none of it: a temporary file, then a rename."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        Path(tmp).write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:  # (named as the file it was for)
        raise OSError(e.errno, e.strerror, path) from e
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_books_tsv(path):
    """[(ebook id, title, author)]: rank, id, title, author by tabs, a line a book,
    after a header line if there is one (a first line with no number for rank or id)."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
        rows = [(line + "\t\t\t").split("\t") for line in lines if line.strip()]
        if rows and not any(f.strip().isdigit() for f in rows[0][:2]):
            rows = rows[1:]  # the header
        books = [(int(r[1]), r[2].strip(), r[3].strip()) for r in rows]
    except (OSError, ValueError) as e:  # no such file, not UTF-8, an id not a number
        fail(
            f"cannot read --books {path} ({e}):"
            " give UTF-8 lines rank<TAB>ebook id<TAB>title<TAB>author"
        )
    if len(books) < 2:
        fail(f"--books {path} lists {len(books)} books: it needs 2 or more")
    counts = collections.Counter(book_id for book_id, _, _ in books)
    twice = [str(book_id) for book_id, n in counts.items() if n > 1]
    if twice:
        fail(f"--books {path} lists ebook {', '.join(twice)} twice: list each once")
    return books


def fetch(url):
    """Text at url; None for 4xx or HTML; no answer, 5xx, 429: retries, then error."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    for attempt in range(RETRIES + 1):
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
                data = r.read()  # IncompleteRead if cut short
            if data.lstrip()[:15].lower().startswith((b"<!doctype", b"<html")):
                return None  # an error page
            if data.strip():
                return data
            why = "an empty file"
        except urllib.error.HTTPError as e:
            if e.code < 500 and e.code != 429:
                return None
            why = f"HTTP {e.code}"
        except (OSError, http.client.HTTPException) as e:  # no answer, reset, cut short
            why = str(e) or type(e).__name__
        if attempt < RETRIES:
            print(f"    {url}: {why}; retry {attempt + 1} of {RETRIES}", flush=True)
            time.sleep(BACKOFF * 2**attempt)
    raise ConnectionError(f"{url}: {why}")


def download_books(books, mirror, raw_dir, pause):
    """Each book's file in raw_dir; the missing downloaded one at a time (resumes)."""
    os.makedirs(raw_dir, exist_ok=True)
    paths = [os.path.join(raw_dir, f"{book_id}.txt") for book_id, _, _ in books]
    todo = [(b, path) for b, path in zip(books, paths) if not os.path.exists(path)]
    have = len(books) - len(todo)
    print(f"books: {have} in {raw_dir} already, {len(todo)} to download from {mirror}")
    missing = []
    t0 = time.time()
    then = f"the others are kept in {raw_dir}: re-run, or use --mirror or --source"
    for n, ((book_id, title, _), path) in enumerate(todo):
        time.sleep(pause if n else 0)  # one request at a time, with a pause
        urls = [mirror.rstrip("/") + p.format(id=book_id) for p in URL_PATTERNS]
        try:  # the first path that has the book, or None
            data = next(filter(None, map(fetch, urls)), None)
        except ConnectionError as e:
            fail(f"cannot download ebook {book_id} ({e}); {then}")
        if data is None:
            missing.append(str(book_id))
            continue
        atomic_write(path, data)
        eta = (time.time() - t0 + pause) / (n + 1) * (len(todo) - n - 1)
        print(f"  [{n + 1}/{len(todo)}] ebook {book_id}, {title[:40]}; eta {eta:.0f} s")
    if missing:
        fail(
            f"ebooks {', '.join(missing)} not found at {mirror}"
            f" (no plain text at their URLs); {then}"
        )
    return paths


def source_books(books, source):
    """Each book's file in the folder source or below it: <id>.txt or pg<id>.txt."""
    found = {p.name: str(p) for p in Path(source).rglob("*") if p.is_file()}
    paths = [found.get(f"{i}.txt") or found.get(f"pg{i}.txt") for i, _, _ in books]
    if None in paths:
        missing = ", ".join(str(i) for (i, _, _), p in zip(books, paths) if p is None)
        fail(f"ebooks {missing} not in --source {source} as <ID>.txt or pg<ID>.txt")
    return paths


# a marker or the licence's end, to the line after it
START_RE = re.compile(r"^\*{3} ?START OF TH(?:E|IS) PROJECT GUTENBERG EBOOK.*\n?", re.M)
END_RE = re.compile(r"^\*{3} ?END OF TH(?:E|IS) PROJECT GUTENBERG EBOOK", re.M)
# the 1990s files have no START marker: their licence ends "*END THE SMALL PRINT! ..."
SMALL_PRINT_END_RE = re.compile(r"^\*END THE SMALL PRINT.*\n?", re.M)
FOOTER_RE = re.compile(r"^End of (?:the )?Project Gutenberg", re.I | re.M)
# Gutenberg's paragraphs opening the text: "Produced by ...", "Note: Project Gutenberg"
CREDIT_RE = re.compile(
    r"(?is)(?:Produced by|Transcribed from|E-text prepared|This etext was)\s"
    r"|.*Gutenberg"
)
PARA_RE = re.compile(r"\s*(\S.*?)(?:\n[ \t]*\n|\Z)", re.S)  # the first paragraph


def strip_gutenberg(text):
    """The book without Gutenberg's header, licence, credits, footer; a warning."""
    text = text.replace("\r\n", "\n")
    m = START_RE.search(text)
    start = m.end() if m else 0
    m = END_RE.search(text, start)
    end = m.start() if m else len(text)
    m = SMALL_PRINT_END_RE.search(text, start, end)
    start = m.end() if m else start
    footers = [m.start() for m in FOOTER_RE.finditer(text, start, end)]
    end = footers[-1] if footers else end  # the last footer
    body = text[start:end]
    while (m := PARA_RE.match(body)) and CREDIT_RE.match(m.group(1)):
        body = body[m.end() :]
    # no blank lines before or after; the first line keeps its indent
    body = re.sub(r"^(?:[ \t]*\n)+", "", body).rstrip() + "\n"
    if end < len(text):
        return body, None
    return body, "no END marker or footer: the file may be cut short"


def book_body(book, path, min_chars):
    """The stripped text of a book's file; refused if binary or too short for a book."""
    book_id, title, _ = book
    raw = Path(path).read_bytes()
    fix = f"replace {path} with the book's text (or delete a download to get it again)"
    if b"\0" in raw:
        fail(f"ebook {book_id}: {path} is not a text file (NUL bytes); {fix}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("cp1252", errors="replace")  # old Windows files
    body, warning = strip_gutenberg(text)
    if warning:
        print(f"  warning: ebook {book_id} ({title}): {warning}; if it is, {fix}")
    n_chars = len(body.strip())
    if n_chars < min_chars:
        fail(
            f"ebook {book_id} ({title}) has {n_chars} characters after stripping,"
            f" fewer than --min_chars {min_chars}; {fix}"
        )
    return body


def split_books(book_ids, texts, val_fraction):
    """(train, val) indices: books by sha256(id) are held out until val_fraction is."""
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in book_ids]
    order = sorted(range(len(book_ids)), key=lambda i: digests[i])
    # the characters of the books before each
    ahead = itertools.accumulate((len(texts[i]) for i in order), initial=0)
    target = val_fraction * sum(map(len, texts))
    val = [i for i, n in zip(order[:-1], ahead) if n < target]
    return [i for i in range(len(book_ids)) if i not in val], sorted(val)


def merge(word, pair, new):
    """word (token ids) with each occurrence of pair, left to right, replaced by new."""
    out = []
    for t in word:
        if out and (out[-1], t) == pair:
            out[-1] = new
        else:
            out.append(t)
    return out


def train_bpe(word_counts, n_tokens):
    """Byte-pair encoding, tests.py's literal_bpe fast: only the words holding the
    merged pair update the pair counts, and a lazy heap finds the most frequent pair (4
    s for the 94 training books, not 25 minutes of counting every pair at each merge).
    word_counts: {piece: count}; returns the tokens' bytes (index = rank = id)."""
    vocab = [bytes([b]) for b in range(256)]
    words = [list(w.encode("utf-8")) for w in word_counts]
    counts = list(word_counts.values())
    pair_count = collections.Counter()
    where = collections.defaultdict(set)  # pair -> the words holding it
    for wi, (w, c) in enumerate(zip(words, counts)):
        for pair in zip(w, w[1:]):
            pair_count[pair] += c
            where[pair].add(wi)
    # (-count, pair): a sorted list is a heap
    heap = sorted((-c, pair) for pair, c in pair_count.items())
    while len(vocab) < n_tokens:
        # a stale entry goes back with its count
        while heap and pair_count[heap[0][1]] != -heap[0][0]:
            pair = heapq.heappop(heap)[1]
            if pair_count[pair] > 0:
                heapq.heappush(heap, (-pair_count[pair], pair))
        if not heap:
            fail(
                f"the books allow only {len(vocab) + 1} tokens, not {n_tokens + 1}:"
                " use a smaller --vocab_size or more books"
            )
        pair = heap[0][1]  # the most frequent pair; of ties, the smallest ids
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in vocab:
            vocab.append(merged)
        new = vocab.index(merged)
        touched = set()
        for wi in where.pop(pair):  # the pair's count drops to 0
            w = words[wi]
            out = merge(w, pair, new)
            if len(out) == len(w):
                continue  # the pair left this word in an earlier merge
            for q in zip(w, w[1:]):
                pair_count[q] -= counts[wi]
            for q in zip(out, out[1:]):
                pair_count[q] += counts[wi]
                if new in q:
                    where[q].add(wi)
                    touched.add(q)
            words[wi] = out
        for q in touched:  # only pairs with the new token can have grown
            heapq.heappush(heap, (-pair_count[q], q))
    return vocab


def encode_books(enc, texts):
    """uint16 token ids, each book followed by <|endoftext|> (one in a book is text)."""
    books = [enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
    books = [np.append(b, enc.eot_token) for b in books]
    return np.concatenate(books).astype(np.uint16)


def write_outputs(data_dir, vocab, source, ids, texts, tokens, overwrite):
    """train.bin, val.bin, tokenizer.tiktoken, then meta.json, vouching for them."""
    lines = [base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(vocab)]
    files = {f"{s}.bin": tokens[s].tobytes() for s in SPLITS}
    files[TOKENIZER_FILE] = b"".join(lines)
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    meta = {
        "vocab_size": len(vocab) + 1,
        "eot_token": len(vocab),
        "dtype": "uint16",
        **{f"{s}_tokens": int(tokens[s].size) for s in SPLITS},
        **{f"{s}_books": ids[s] for s in SPLITS},
        **{f"{s}_chars": sum(map(len, texts[s])) for s in SPLITS},
        "source": source,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": sha[TOKENIZER_FILE],
        **{f"{s}_sha256": sha[f"{s}.bin"] for s in SPLITS},
        "split_pattern": SPLIT_PATTERN,
    }
    meta_text = json.dumps(meta, indent=2, ensure_ascii=False) + "\n"
    files["meta.json"] = meta_text.encode("utf-8")
    # other files that data_dir's meta.json vouches for: runs trained on them need them
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none there
        old = json.loads(Path(data_dir, "meta.json").read_text())
        if not overwrite and any(old[k] != meta[k] for k in meta if "sha256" in k):
            fail(
                f"--data_dir {data_dir} holds other data, which runs trained on it"
                " need: pass another --data_dir, or --overwrite to replace it"
            )
    for name, data in files.items():
        atomic_write(os.path.join(data_dir, name), data)


def prepare(args):
    """Book list -> download (or --source) -> strip -> split -> BPE -> encode, write."""
    books = read_books_tsv(args.books)
    t0 = time.time()
    try:  # now, not after the downloads and the BPE
        os.makedirs(args.data_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.data_dir).close()
    except OSError as e:
        fail(
            f"cannot write to --data_dir {args.data_dir} ({e.strerror}):"
            " pick a folder you can write to"
        )
    if args.source:
        source = os.path.abspath(args.source)
        paths = source_books(books, source)
    else:
        source = args.mirror
        paths = download_books(books, source, f"{args.data_dir}/raw", args.pause)
    bodies = [book_body(book, path, args.min_chars) for book, path in zip(books, paths)]
    book_ids = [book_id for book_id, _, _ in books]
    split = split_books(book_ids, bodies, args.val_fraction)  # (train, val) indices
    ids = {s: [book_ids[i] for i in idx] for s, idx in zip(SPLITS, split)}
    texts = {s: [bodies[i] for i in idx] for s, idx in zip(SPLITS, split)}
    held_out = ", ".join(map(str, ids["val"]))
    print(f"validation: ebooks {held_out}; the BPE learns from the others")
    words = collections.Counter()
    for text in texts["train"]:
        words.update(regex.findall(SPLIT_PATTERN, text))
    vocab = train_bpe(words, args.vocab_size - 1)
    ranks = {token: rank for rank, token in enumerate(vocab)}
    special = {EOT: len(vocab)}
    enc = tiktoken.Encoding(
        "bpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )
    tokens = {s: encode_books(enc, t) for s, t in texts.items()}
    write_outputs(args.data_dir, vocab, source, ids, texts, tokens, args.overwrite)
    sizes = f"{tokens['train'].size:,} + {tokens['val'].size:,} tokens (train, val)"
    print(f"wrote {args.data_dir}: {sizes}, {time.time() - t0:.0f} s")
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.error = lambda msg: fail(f"{msg} (see python prepare_data.py --help)")
    p.add_argument("--data_dir", default="data", help="outputs, raw/ cache (data)")
    p.add_argument("--books", default=BOOKS_TSV, help="the list of books (books.tsv)")
    mirror = "https://www.gutenberg.org"
    p.add_argument("--mirror", default=mirror, help="a host with gutenberg.org's paths")
    p.add_argument("--source", help="a folder of <ID>.txt or pg<ID>.txt, not the web")
    p.add_argument("--vocab_size", type=int, default=5000, help="u tokens (5000)")
    p.add_argument("--val_fraction", type=float, default=0.05, help="held out (0.05)")
    p.add_argument("--pause", type=float, default=1.0, help="s between downloads (1)")
    p.add_argument("--min_chars", type=int, default=5000, help="min chars/book (5000)")
    p.add_argument("--overwrite", action="store_true", help="replace other data there")
    args = p.parse_args(argv)
    if not 257 <= args.vocab_size <= 65536:
        p.error(
            f"--vocab_size {args.vocab_size}: give 257 (256 bytes and <|endoftext|>)"
            " to 65536 (uint16)"
        )
    if not 0 < args.val_fraction < 1:
        p.error(f"--val_fraction {args.val_fraction}: give a share between 0 and 1")
    if not args.pause >= 0:
        p.error(f"--pause {args.pause}: give 0 or more seconds")
    if not args.mirror.startswith(("http://", "https://")):
        p.error(f"--mirror {args.mirror} must start with http:// or https://")
    if args.source and not os.path.isdir(args.source):
        p.error(f"--source {args.source} is not a folder")
    return args


def main(argv=None):
    sys.stdout.reconfigure(errors="replace")  # "N?rnberg" on an ASCII terminal
    try:
        return prepare(parse_args(argv))
    except KeyboardInterrupt:
        fail("interrupted; the books downloaded are kept: re-run to resume")
    except OSError as e:  # a full disk, ...
        fail(f"{e.filename}: {e.strerror}" if e.filename else str(e))


if __name__ == "__main__":
    sys.exit(main())
