"""
Prepare the paper's corpus: download the 100 children's books of books.tsv from gutenberg.org, strip
Project Gutenberg's header, licence and footer, hold out whole books for validation (in order of
sha256(str(ebook id)) until they hold --val_fraction of the text: ebooks 55, 146, 51, 2726, 2557 and 1154),
train a byte-level BPE tokenizer (vocab_size 5000) on the others, and write the token files.

    python prepare_data.py                                            # gutenberg.org -> data/
    python prepare_data.py --mirror http://127.0.0.1:8765 --pause 0   # a mirror with the same paths
    python prepare_data.py --source DIR                               # <ID>.txt or pg<ID>.txt files

Writes to --data_dir (default data/): train.bin and val.bin, uint16 token ids, each book followed by
<|endoftext|> (id vocab_size - 1); tokenizer.tiktoken, one "base64(token) rank" line per learned token;
meta.json, the vocab size, the books of each split and the files' sha256; raw/<ID>.txt, the downloads (a
rerun fetches only what is missing). train.py and sample.py read them with load_data and load_tokenizer.
"""

import argparse
import base64
import collections
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
URL_PATTERNS = (
    "/cache/epub/{id}/pg{id}.txt",
    "/ebooks/{id}.txt.utf-8",
    "/files/{id}/{id}-0.txt",
)  # in turn
USER_AGENT = "extractors-reimplementation/prepare_data.py (downloads 100 books once, one request at a time)"
TIMEOUT, RETRIES, BACKOFF = (
    30.0,
    3,
    1.0,
)  # s per request; more tries of a URL, the first BACKOFF s later
EOT, TOKENIZER_FILE = "<|endoftext|>", "tokenizer.tiktoken"
SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # GPT-2's


def fail(msg):
    """Bad input: one line on stderr saying what is wrong and what to do, exit status
    1, no traceback.
    """
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def fmt_time(s):
    """Seconds for progress lines and ETAs: 4.2s, 3m05s, 1h02m."""
    s, m, h = max(0.0, s), int(s) // 60, int(s) // 3600
    return (
        f"{s:.1f}s"
        if s < 60
        else f"{m}m{int(s) % 60:02d}s"
        if s < 3600
        else f"{h}h{m % 60:02d}m"
    )


def atomic_write(path, data):
    """Write data (bytes, str, or a function of a binary file) to a temporary file,
    then rename it to path.
    """
    tmp = os.path.join(
        os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp"
    )
    try:
        with open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(
                data.encode() if isinstance(data, str) else data
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


def read_books_tsv(path):
    """[(ebook id, title, author)] of books.tsv: a header line, then rank, id, title,
    author (by tabs).
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            rows = [
                (line + "\t\t\t").split("\t")
                for line in f.read().splitlines()[1:]
                if line.strip()
            ]
        books = [(int(r[1]), r[2].strip(), r[3].strip()) for r in rows]
    except (
        OSError,
        ValueError,
    ) as e:  # no such file, not UTF-8, an id that is no number
        fail(
            f"cannot read --books {path} ({e}): give UTF-8 lines rank<TAB>ebook id<TAB>title<TAB>author"
        )
    if len(books) < 2 or len({i for i, _, _ in books}) < len(books):
        fail(
            f"--books {path} lists {len(books)} books, some twice: need 2 or more different ones"
        )
    return books


def fetch(url):
    """Text at url, None if there is none (4xx, HTML); no answer, 5xx, 429: retries,
    then ConnectionError.
    """
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    for attempt in range(RETRIES + 1):
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
                data = r.read()  # IncompleteRead if cut short
            if data.strip():
                return (
                    None
                    if data.lstrip()[:15].lower().startswith((b"<!doctype", b"<html"))
                    else data
                )
            why = "an empty file"
        except urllib.error.HTTPError as e:
            if e.code < 500 and e.code != 429:
                return None
            why = f"HTTP {e.code}"
        except (
            OSError,
            http.client.HTTPException,
        ) as e:  # refused, timeout, reset, cut short
            why = str(e) or type(e).__name__
        if attempt < RETRIES:
            print(f"    {url}: {why}; retry {attempt + 1} of {RETRIES}", flush=True)
            time.sleep(BACKOFF * 2**attempt)
    raise ConnectionError(f"{url}: {why}")


def download_books(books, mirror, raw_dir, pause):
    """Each book's file in raw_dir; the missing ones are downloaded one at a time: a
    rerun resumes.
    """
    os.makedirs(raw_dir, exist_ok=True)
    paths = [os.path.join(raw_dir, f"{book_id}.txt") for book_id, _, _ in books]
    todo = [
        (book, path) for book, path in zip(books, paths) if not os.path.exists(path)
    ]
    print(
        f"books: {len(books) - len(todo)} in {raw_dir} already, {len(todo)} to download from {mirror}"
    )
    missing, t0 = [], time.time()
    then = f"the others are kept in {raw_dir}: re-run, or use --mirror or --source"
    for n, ((book_id, title, _), path) in enumerate(todo):
        time.sleep(pause if n else 0)  # one request at a time, with a pause
        try:
            urls = (mirror.rstrip("/") + p.format(id=book_id) for p in URL_PATTERNS)
            data = next((d for d in map(fetch, urls) if d is not None), None)
        except ConnectionError as e:
            fail(f"cannot download ebook {book_id} ({e}); {then}")
        if data is None:
            missing.append(str(book_id))
            continue
        atomic_write(path, data)
        eta = fmt_time((time.time() - t0 + pause) / (n + 1) * (len(todo) - n - 1))
        print(
            f"  [{n + 1}/{len(todo)}] ebook {book_id}, {len(data) >> 10} kB, {title[:50]}; eta {eta}"
        )
    if missing:
        fail(
            f"ebooks {', '.join(missing)} not found at {mirror} (no plain text at their URLs); {then}"
        )
    return paths


def source_books(books, source):
    """Each book's file in the folder source or below it: <id>.txt or pg<id>.txt."""
    found = {
        name: os.path.join(d, name) for d, _, names in os.walk(source) for name in names
    }
    paths = [found.get(f"{i}.txt") or found.get(f"pg{i}.txt") for i, _, _ in books]
    if None in paths:
        missing = ", ".join(str(i) for (i, _, _), p in zip(books, paths) if p is None)
        fail(
            f"ebooks {missing} not found in --source {source} (as <ID>.txt or pg<ID>.txt)"
        )
    return paths


START_RE = re.compile(r"^\*\*\* ?START OF TH(?:E|IS) PROJECT GUTENBERG EBOOK", re.M)
END_RE = re.compile(r"^\*\*\* ?END OF TH(?:E|IS) PROJECT GUTENBERG EBOOK", re.M)
# the 1990s files have no START marker; their licence ends "*END THE SMALL PRINT! FOR
# PUBLIC DOMAIN ..."
SMALL_PRINT_END_RE = re.compile(r"^\*END THE SMALL PRINT", re.M)
FOOTER_RE = re.compile(r"^End of (?:the )?Project Gutenberg", re.I | re.M)
# paragraphs opening the text that are Project Gutenberg's: "Produced by ...", "Note:
# Project Gutenberg ..."
CREDIT_RE = re.compile(
    r"(?is)(?:Produced by|Transcribed from|E-text prepared|This etext was)\s|.*Gutenberg"
)
PARA_RE = re.compile(r"\s*(\S.*?)(?:\n[ \t]*\n|\Z)", re.S)  # the first paragraph


def strip_gutenberg(text):
    """The book without Gutenberg's header, licence, credits and footer, \\n line ends;
    a warning or None.
    """
    text = text.replace("\r\n", "\n")
    m = START_RE.search(text)
    start = (
        text.find("\n", m.end()) + 1 or len(text) if m else 0
    )  # the line after the marker
    m = END_RE.search(text, start)
    end = m.start() if m else len(text)
    m = SMALL_PRINT_END_RE.search(text, start, end)
    start = text.find("\n", m.start()) + 1 or len(text) if m else start
    end = ([m.start() for m in FOOTER_RE.finditer(text, start, end)] or [end])[
        -1
    ]  # the last footer
    body = text[start:end]
    while (m := PARA_RE.match(body)) and CREDIT_RE.match(m.group(1)):
        body = body[m.end() :]
    body = (
        re.sub(r"^(?:[ \t]*\n)+", "", body).rstrip() + "\n"
    )  # keeps the first line's indent
    return body, None if end < len(
        text
    ) else "no END marker or footer: the file may be cut short"


def book_body(book, path, min_chars):
    """The stripped text of one book's file; refused if binary or too short to be the
    book.
    """
    raw = Path(path).read_bytes()
    fix = (
        f"replace {path} with the book's text (or delete a download to fetch it again)"
    )
    if b"\0" in raw:
        fail(f"ebook {book[0]}: {path} is not a text file (NUL bytes); {fix}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("cp1252", errors="replace")  # old Windows files
    body, warning = strip_gutenberg(text)
    if warning:
        print(f"  warning: ebook {book[0]} ({book[1]}): {warning}; if it is, {fix}")
    if len(body.strip()) < min_chars:
        fail(
            f"ebook {book[0]} ({book[1]}) has {len(body.strip())} characters after stripping; {fix}"
        )
    return body


def split_books(book_ids, texts, val_fraction):
    """(train, val) indices: books by sha256(id) go to validation until they hold
    val_fraction (not all).
    """
    order = sorted(
        range(len(book_ids)),
        key=lambda i: hashlib.sha256(str(book_ids[i]).encode()).hexdigest(),
    )
    ahead = itertools.accumulate(
        (len(texts[i]) for i in order), initial=0
    )  # characters of the books before
    target = val_fraction * sum(map(len, texts))
    val = [i for i, n in zip(order[:-1], ahead) if n < target]
    return sorted(set(range(len(book_ids))) - set(val)), sorted(val)


def count_words(texts):
    return collections.Counter(
        w for t in texts for w in regex.findall(SPLIT_PATTERN, t)
    )


def merge(word, pair, new):
    """word (token ids) with each occurrence of pair, left to right, replaced by new."""
    out = []
    for t in word:
        if out and (out[-1], t) == pair:
            out[-1] = new
        else:
            out.append(t)
    return out


def train_bpe_reference(word_counts, n_tokens):
    """Byte-pair encoding as its definition reads: from the 256 bytes, merge the most
    frequent pair of adjacent tokens into a new token until there are n_tokens; ties go
    to the smallest (left id, right id), and a merge making known bytes (x+yz after
    xy+z) reuses that token. word_counts: {piece: count}; returns the tokens' bytes
    (index = rank = id). Worked example, words {"aaab": 2, "ab": 1}:
      pairs (a,a) 2*2 = 4, (a,b) 2 + 1 = 3   -> 256 = "aa";   "aaab" is [256, a, b]
      pairs (256,a) 2, (a,b) 2 + 1 = 3       -> 257 = "ab";   "aaab" is [256, 257]
      pairs (256,257) 2                       -> 258 = "aaab"
    It counts every pair again before each merge; train_bpe gives the same tokens
    fast."""
    vocab = [bytes([b]) for b in range(256)]
    words = {tuple(w.encode("utf-8")): c for w, c in word_counts.items()}
    while len(vocab) < n_tokens:
        pairs = collections.Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        pair = min(
            pairs, key=lambda p: (-pairs[p], p)
        )  # the most frequent; of ties, the smallest ids
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in vocab:
            vocab.append(merged)
        new = vocab.index(merged)
        words = {tuple(merge(list(w), pair, new)): c for w, c in words.items()}
    return vocab


def train_bpe(word_counts, n_tokens):
    """train_bpe_reference's tokens, fast: only the words holding the merged pair update
    the pair counts, and a lazy heap finds the most frequent pair (4 s for the 94
    training books, not 25 minutes of recounting)."""
    vocab = [bytes([b]) for b in range(256)]
    words, counts = (
        [list(w.encode("utf-8")) for w in word_counts],
        list(word_counts.values()),
    )
    pair_count, where = (
        collections.Counter(),
        collections.defaultdict(set),
    )  # pair -> the words holding it
    for wi, (w, c) in enumerate(zip(words, counts)):
        for pair in zip(w, w[1:]):
            pair_count[pair] += c
            where[pair].add(wi)
    heap = sorted(
        (-c, pair) for pair, c in pair_count.items()
    )  # a sorted list is a heap
    while len(vocab) < n_tokens:
        while (
            heap and pair_count[heap[0][1]] != -heap[0][0]
        ):  # a stale entry goes back with its count
            pair = heapq.heappop(heap)[1]
            if pair_count[pair] > 0:
                heapq.heappush(heap, (-pair_count[pair], pair))
        if not heap:
            fail(
                f"the books allow only {len(vocab) + 1} tokens: use a smaller --vocab_size or more books"
            )
        pair = heap[0][1]  # the most frequent pair; of ties, the smallest ids
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in vocab:
            vocab.append(merged)
        new, touched = vocab.index(merged), set()
        for wi in where.pop(pair):  # the pair's count drops to 0
            w, c, out = words[wi], counts[wi], merge(words[wi], pair, new)
            if len(out) == len(w):
                continue  # the pair left this word in an earlier merge
            for q in zip(w, w[1:]):
                pair_count[q] -= c
            for q in zip(out, out[1:]):
                pair_count[q] += c
                if new in q:
                    where[q].add(wi)
                    touched.add(q)
            words[wi] = out
        for q in touched:  # only pairs with the new token can have grown
            heapq.heappush(heap, (-pair_count[q], q))
    return vocab


def make_encoding(vocab):
    ranks, eot = {t: i for i, t in enumerate(vocab)}, {EOT: len(vocab)}
    return tiktoken.Encoding(
        "bpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=eot
    )


def encode_books(enc, texts):
    """The books' token ids, each followed by <|endoftext|> (one written in a book is
    text), as uint16.
    """
    books = [
        np.append(enc.encode_to_numpy(t, disallowed_special=()), enc.eot_token)
        for t in texts
    ]
    return np.concatenate(books).astype(np.uint16)


def write_outputs(data_dir, vocab, source, ids, texts, tokens):
    """train.bin, val.bin, tokenizer.tiktoken, then meta.json, which vouches for them."""
    files = {f"{s}.bin": tokens[s].tobytes() for s in ("train", "val")}
    files[TOKENIZER_FILE] = b"".join(
        base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(vocab)
    )
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    meta = {"vocab_size": len(vocab) + 1, "eot_token": len(vocab), "dtype": "uint16"}
    meta |= {f"{s}_tokens": int(tokens[s].size) for s in ("train", "val")}
    meta |= {f"{s}_books": ids[s] for s in ("train", "val")}
    meta |= {f"{s}_chars": sum(map(len, texts[s])) for s in ("train", "val")}
    meta |= {
        "source": source,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": sha[TOKENIZER_FILE],
    }
    meta |= {
        "train_sha256": sha["train.bin"],
        "val_sha256": sha["val.bin"],
        "split_pattern": SPLIT_PATTERN,
    }
    files["meta.json"] = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode(
        "utf-8"
    )
    for name, data in files.items():
        atomic_write(os.path.join(data_dir, name), data)


def prepare(args):
    """Book list -> download (or --source) -> strip -> split -> BPE -> encode -> write."""
    books, t0 = read_books_tsv(args.books), time.time()
    try:  # now, not after the downloads and the BPE
        os.makedirs(args.data_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.data_dir).close()
    except OSError as e:
        fail(
            f"cannot write to --data_dir {args.data_dir} ({e.strerror}); pick a folder you can write to"
        )
    source, raw_dir = (
        os.path.abspath(args.source) if args.source else args.mirror,
        f"{args.data_dir}/raw",
    )
    paths = (
        source_books(books, source)
        if args.source
        else download_books(books, source, raw_dir, args.pause)
    )
    bodies = [book_body(book, path, args.min_chars) for book, path in zip(books, paths)]
    split = dict(
        zip(
            ("train", "val"),
            split_books([i for i, _, _ in books], bodies, args.val_fraction),
        )
    )
    ids = {s: [books[i][0] for i in idx] for s, idx in split.items()}
    texts = {s: [bodies[i] for i in idx] for s, idx in split.items()}
    print(
        f"validation: ebooks {', '.join(map(str, ids['val']))}; the BPE learns from the others"
    )
    vocab = train_bpe(count_words(texts["train"]), args.vocab_size - 1)
    tokens = {s: encode_books(make_encoding(vocab), t) for s, t in texts.items()}
    write_outputs(args.data_dir, vocab, source, ids, texts, tokens)
    n_train, n_val = tokens["train"].size, tokens["val"].size
    print(
        f"wrote {args.data_dir}: {n_train:,} + {n_val:,} tokens (train, val), {fmt_time(time.time() - t0)}"
    )
    return 0


def checked_file(data_dir, name, key):
    """data_dir/name: its path and bytes, and meta.json's dict, once its sha256 is
    meta.json's [key].
    """
    path, meta_path = os.path.join(data_dir, name), os.path.join(data_dir, "meta.json")
    try:
        meta, data = json.loads(Path(meta_path).read_text()), Path(path).read_bytes()
    except (OSError, ValueError) as e:  # no such file, not JSON
        fail(
            f"{getattr(e, 'filename', None) or meta_path} is missing or damaged: run prepare_data.py first"
        )
    if hashlib.sha256(data).hexdigest() != meta.get(key):
        fail(
            f"{path} is not the file meta.json describes (size or sha256 differ): re-run prepare_data.py"
        )
    return path, data, meta


def load_tokenizer(data_dir):
    """The tokenizer in data_dir as a tiktoken.Encoding, read fresh (no cache), checked
    against meta.json.
    """
    _, data, _ = checked_file(data_dir, TOKENIZER_FILE, "tokenizer_sha256")
    return make_encoding(
        [base64.b64decode(line.split()[0]) for line in data.splitlines()]
    )


def load_data(data_dir, block_size, batch_size):
    """For train.py: (train, val) tokens memory-mapped, checked against meta.json, and
    their fingerprint.
    """
    tokens = []
    for split, need in (
        ("train", block_size + batch_size),
        ("val", block_size + 1),
    ):  # windows of l + 1
        path, raw, meta = checked_file(data_dir, f"{split}.bin", f"{split}_sha256")
        if len(raw) // 2 < need:
            fail(
                f"{path} holds {len(raw) // 2} tokens, fewer than a batch needs ({need}): use a smaller l"
            )
        tokens.append(np.memmap(path, dtype=np.uint16, mode="r"))
        if int(tokens[-1].max()) >= meta.get("vocab_size", 0):
            fail(
                f"{path} holds token {int(tokens[-1].max())} >= meta.json's vocab_size: run prepare_data.py"
            )
    return *tokens, {
        k: meta.get(k)
        for k in ("vocab_size", "train_sha256", "val_sha256", "tokenizer_sha256")
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.error = lambda msg: fail(f"{msg} (see python prepare_data.py --help)")
    p.add_argument(
        "--data_dir", default="data", help="outputs and the raw/ cache (%(default)s)"
    )
    p.add_argument(
        "--books", default=BOOKS_TSV, help="rank, ebook id, title, author (books.tsv)"
    )
    p.add_argument(
        "--mirror",
        default="https://www.gutenberg.org",
        help="host with gutenberg.org's paths",
    )
    p.add_argument(
        "--source",
        default="",
        help="read <ID>.txt or pg<ID>.txt from this folder, not the web",
    )
    p.add_argument(
        "--vocab_size",
        type=int,
        default=5000,
        help="tokens with <|endoftext|>, u (%(default)s)",
    )
    p.add_argument(
        "--val_fraction",
        type=float,
        default=0.05,
        help="share held out as whole books (0.05)",
    )
    p.add_argument(
        "--pause",
        type=float,
        default=1.0,
        help="seconds between downloads (%(default)s)",
    )
    p.add_argument(
        "--min_chars",
        type=int,
        default=5000,
        help="refuse a shorter book, an error page (5000)",
    )
    args = p.parse_args(argv)
    for bad, msg in (
        (
            not 257 <= args.vocab_size <= 65536,
            "--vocab_size: 256 bytes + <|endoftext|> to 65536 (uint16)",
        ),
        (
            not (0 < args.val_fraction < 1 and args.pause >= 0),
            "need 0 < --val_fraction < 1 and --pause >= 0",
        ),
        (
            not args.mirror.startswith(("http://", "https://")),
            "--mirror must start with http:// or https://",
        ),
        (
            args.source and not os.path.isdir(args.source),
            f"--source {args.source} is not a folder",
        ),
    ):
        if bad:
            p.error(msg)
    return args


def main(argv=None):
    sys.stdout.reconfigure(
        errors="replace"
    )  # "The Nürnberg Stove" prints as "N?rnberg" on an ASCII terminal
    try:
        return prepare(parse_args(argv))
    except KeyboardInterrupt:
        fail("interrupted; the books downloaded are kept: re-run to resume")
    except OSError as e:  # a full disk, ...
        fail(f"{e.filename}: {e.strerror}" if e.filename else str(e))


if __name__ == "__main__":
    sys.exit(main())
