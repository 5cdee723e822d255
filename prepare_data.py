"""
Prepare the paper's corpus: download the top 100 children's books from gutenberg.org, strip
Project Gutenberg's header, licence and footer, train a byte-level BPE tokenizer (vocab_size 5000)
on the training books, and write the token files.

    python prepare_data.py                                   # gutenberg.org -> data/
    python prepare_data.py --mirror http://127.0.0.1:8765 --pause 0   # a mirror with the same paths
    python prepare_data.py --source DIR                      # local <ID>.txt or pg<ID>.txt files

Writes to --data_dir (default data/):
    train.bin, val.bin   uint16 token ids, np.memmap(path, dtype=np.uint16, mode='r'); every book
                         is followed by <|endoftext|> (id vocab_size - 1); train.py reads them
                         with load_data(data_dir, ...), which checks them against meta.json
    tokenizer.tiktoken   tiktoken's text format: one "base64(token) rank" line for each of the
                         vocab_size - 1 learned tokens (<|endoftext|> is the next id, implied);
                         load it with load_tokenizer(data_dir)
    meta.json            vocab size, token counts, book ids per split, source, checksums
    raw/<ID>.txt         the downloaded files, byte for byte; never fetched twice

Validation split: whole books, held out by a fixed rule that depends only on the ebook ids and the
texts: take the books in order of sha256(str(ebook id)) until they hold at least --val_fraction
(default 5%) of the stripped characters; every other book is training text, and the tokenizer is
trained on the training books only. On the default list this holds out 6 books, 5.6% of the
tokens: ebooks 55 The Wonderful Wizard of Oz, 146 A Little Princess, 51 Anne of the Island,
2726 Eight Cousins, 2557 Old Mother West Wind and 1154 The Voyages of Doctor Dolittle.
"""

import argparse
import base64
import collections
import hashlib
import heapq
import http.client
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import regex  # comes with tiktoken; unlike re it knows \p{L} and \p{N}
import tiktoken

# -----------------------------------------------------------------------------
# settings
DATA_DIR = "data"
MIRROR = "https://www.gutenberg.org"
# where gutenberg.org keeps the plain text of ebook <id>, tried in this order
URL_PATTERNS = ("/cache/epub/{id}/pg{id}.txt", "/ebooks/{id}.txt.utf-8", "/files/{id}/{id}-0.txt")
USER_AGENT = (
    'extractors-reimplementation/prepare_data.py (reproduction of "Attention Is Not All '
    'You Need Anymore"; downloads 100 books once, one request at a time)'
)
PAUSE = 1.0  # seconds between downloads, to be polite to gutenberg.org (--pause)
TIMEOUT = 30.0  # seconds per request (connect and each read)
RETRIES = 3  # extra attempts per URL after a timeout, 5xx, 429 or broken transfer
BACKOFF = 1.0  # seconds before the first retry, doubled for each further one
VOCAB_SIZE = 5000  # 256 bytes + 4743 merges + <|endoftext|>, as in the paper (u = 5000)
VAL_FRACTION = 0.05
MIN_CHARS = 5000  # a book shorter than this after stripping is an error page, not a book
EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.tiktoken"
# GPT-2's pre-tokenizer split pattern (the same one tiktoken's gpt2 encoding uses)
SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The corpus, books.tsv beside this file: the top 100 of gutenberg.org's "Children's Literature"
# bookshelf (bookshelf 20) by downloads, from a 2025/26 snapshot of that page with poems, readers and
# audio-only entries left out (ebooks 47 and 54 are the text editions of two audio entries).
BOOKS_TSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "books.tsv")


def fail(msg):
    """Bad input: one line on stderr saying what is wrong and what to do, exit status 1, no traceback."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def fmt_time(s):
    """Seconds for progress lines and ETAs: 4.2s, 3m05s, 1h02m."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


UMASK = os.umask(0o022)
os.umask(UMASK)  # (reading the umask means setting it)


def atomic_write(path, data):
    """Write data (bytes, str, or a function that writes to a binary file object, such as
    `lambda f: torch.save(obj, f)`) to path through a temp file `.<name>*.tmp` of this process in the
    same folder, then rename: path is never half-written, and two processes never share a temp file.
    An OSError names path, the file the user asked for, not the temp file."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(
            dir=os.path.dirname(path) or ".", prefix="." + os.path.basename(path), suffix=".tmp"
        )
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes it private; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:  # PermissionError(13, ..., path) and the like
            raise OSError(e.errno, e.strerror, path) from e
        raise


# -----------------------------------------------------------------------------
# the book list


def read_books_tsv(path):
    """A book list in books.tsv's format: rank, id, title, author (tab-separated, header optional)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        fail(f"cannot read --books {path}: {e.strerror}")
    try:  # a spreadsheet's "Unicode text" export is UTF-16 with a byte-order mark
        lines = raw.decode("utf-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8-sig").splitlines()
    except UnicodeDecodeError:
        fail(f"--books {path} is not UTF-8 text; save it as UTF-8 (tab-separated) and try again")
    books, seen = [], set()
    for n, line in enumerate(lines, 1):
        fields = line.split("\t")
        if not line.strip() or (n == 1 and not is_number(fields[0])):
            continue  # blank line or header
        if len(fields) < 2 or not is_number(fields[1]):
            fail(f'{path} line {n}: expected "rank<TAB>ebook id<TAB>title<TAB>author", got {line[:60]!r}')
        book_id = int(fields[1])
        if book_id in seen:
            fail(f"{path} line {n}: ebook {book_id} is listed twice")
        seen.add(book_id)
        title = fields[2].strip() if len(fields) > 2 else ""
        author = fields[3].strip() if len(fields) > 3 else ""
        books.append((book_id, title, author))
    if len(books) < 2:
        fail(f"{path} lists {len(books)} book(s); need at least 2 (one for training, one for validation)")
    return books


def is_number(field):
    """0-9 digits only (str.isdigit also takes '²', which int() refuses)."""
    return field.strip().isascii() and field.strip().isdigit()


# -----------------------------------------------------------------------------
# download: one request at a time, each book saved in data_dir/raw as soon as it arrives


class FetchError(Exception):
    """A failed request; .then says what to try: "retry" the same URL after a wait (no answer in time,
    5xx, 429, a cut transfer), the "next" of URL_PATTERNS (404 or another 4xx, an HTML page), or, if
    the host is "down" (no connection, no answer), the same URL a few times and then nothing more."""

    def __init__(self, why, then):
        super().__init__(why)
        self.then = then


def fetch(url):
    """One GET request: the body, or FetchError saying why not and what to try next."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            data = r.read()  # raises IncompleteRead if the body is shorter than Content-Length
    except urllib.error.HTTPError as e:
        raise FetchError(f"HTTP {e.code}", "retry" if e.code >= 500 or e.code == 429 else "next")
    except urllib.error.URLError as e:  # refused, no DNS, no route, connect timeout
        raise FetchError(f"cannot connect ({e.reason})", "down")
    except TimeoutError:
        raise FetchError(f"no answer within {TIMEOUT:g} s", "down")
    except http.client.IncompleteRead as e:
        raise FetchError(f"truncated after {len(e.partial)} bytes", "retry")
    except (http.client.HTTPException, ConnectionError) as e:  # e.g. connection reset
        raise FetchError(f"transfer broken off ({type(e).__name__})", "retry")
    if not data.strip():
        raise FetchError("empty file", "retry")
    if data.lstrip()[:15].lower().startswith((b"<!doctype", b"<html")):
        raise FetchError("got an HTML page, not plain text", "next")
    return data


def download_book(book_id, mirror):
    """One book from the first of URL_PATTERNS that gives plain text. A URL is tried up to RETRIES
    more times, BACKOFF s later and doubling, unless the failure says "next"; a host that stays down
    is given up at once. Raises FetchError naming each URL tried, .then "down" if the host was."""
    why = []
    for pattern in URL_PATTERNS:
        url = mirror.rstrip("/") + pattern.format(id=book_id)
        for attempt in range(RETRIES + 1):
            try:
                return fetch(url)
            except FetchError as e:
                err = e
            if err.then == "next" or attempt == RETRIES:
                break
            wait = BACKOFF * 2**attempt
            print(f"    {url}: {err}; retry {attempt + 1}/{RETRIES} in {wait:g} s", flush=True)
            time.sleep(wait)
        why.append(f"{url}: {err}")
        if err.then == "down":
            break  # the other paths on a host that cannot be reached will not work either
    raise FetchError("; ".join(why), err.then)


def download_books(books, mirror, raw_dir, pause):
    """The path of every book's file in raw_dir. Files already there are used (they were written
    whole); the others are downloaded one at a time, `pause` s apart, and saved at once, so a rerun
    resumes. Books that fail are reported once the others are in; a host that is down stops it."""
    os.makedirs(raw_dir, exist_ok=True)
    paths = [os.path.join(raw_dir, f"{book_id}.txt") for book_id, _, _ in books]
    todo = [(book, path) for book, path in zip(books, paths) if not os.path.exists(path)]
    print(f"books: {len(books) - len(todo)} in {raw_dir} already, {len(todo)} to download")
    failed, not_tried, t0 = [], [], time.time()
    for n, ((book_id, title, _), path) in enumerate(todo):
        if n:
            time.sleep(pause)  # politeness: one request at a time, with a pause
        try:
            data = download_book(book_id, mirror)
        except FetchError as e:
            failed.append(f"  ebook {book_id} ({title}): {e}")
            if e.then == "down":  # the other books would wait for the same unreachable host
                not_tried = [str(b) for (b, _, _), _ in todo[n + 1 :]]
                break
            continue
        atomic_write(path, data)
        per_book = (time.time() - t0 + pause) / (n + 1)  # each book left costs a pause and a download
        eta = fmt_time(per_book * (len(todo) - n - 1))
        kb, name = f"{len(data) / 1e3:6.0f} kB", f"{title[:44]:44s}"
        print(f"  [{n + 1:3d}/{len(todo)}] ebook {book_id:<6d} {kb}  {name}  eta {eta}", flush=True)
    if not_tried:
        failed.append(f"  not tried, as the server could not be reached: ebooks {', '.join(not_tried)}")
    if failed:
        n_have = sum(map(os.path.exists, paths))
        kept = f"the {n_have} books downloaded are kept in {raw_dir}; " if n_have else ""
        fail(
            f"could not download {len(books) - n_have} of {len(books)} books from {mirror}:\n"
            + "\n".join(failed)
            + f"\nWhat to do: {kept}re-run to resume (when online), or use "
            "--mirror URL (another Gutenberg mirror) or --source DIR (a folder of <ID>.txt files)."
        )
    return paths


def source_books(books, source):
    """The path of every book in a local folder: <id>.txt, pg<id>.txt or gutenberg.org's tree."""
    paths, missing = [], []
    for book_id, _, _ in books:
        names = (f"{book_id}.txt", f"pg{book_id}.txt", f"cache/epub/{book_id}/pg{book_id}.txt")
        path = next((p for p in (os.path.join(source, n) for n in names) if os.path.isfile(p)), None)
        if path is None:
            missing.append(book_id)
        paths.append(path)
    if missing:
        fail(
            f"{len(missing)} book(s) not found in --source {source} (looked for <ID>.txt, "
            f"pg<ID>.txt, cache/epub/<ID>/pg<ID>.txt): ebooks {', '.join(map(str, missing))}"
        )
    return paths


# -----------------------------------------------------------------------------
# strip: the book without Project Gutenberg's header, licence and footer


CONTROL_BYTES = bytes(range(9)) + bytes(range(14, 32))  # not tab, newline, vertical tab, form feed, CR


def book_text(raw, where):
    """The text of one raw book file; a binary file (NUL bytes, or more than 1% control bytes in its
    first 100 kB) is refused with its name."""
    head = raw[:100_000]
    if b"\0" in raw or len(head) - len(head.translate(None, CONTROL_BYTES)) > 0.01 * len(head):
        fail(f"{where} is not a text file (NUL or control bytes); replace it with the book's plain text")
    return decode_book(raw)


def decode_book(raw):
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        # old Windows files; 5 byte values are undefined in cp1252 and become U+FFFD
        return raw.decode("cp1252", errors="replace")


# "*** START OF THE/THIS PROJECT GUTENBERG EBOOK <title> ***": the words may be split over lines
_MARKER = r"^[ \t]*\*{{3}}\s*{}\s+OF\s+(?:THE|THIS)\s+PROJECT\s+GUTENBERG\s+E-?(?:BOOK|TEXT)"
START_RE = re.compile(_MARKER.format("START"), re.I | re.M)
END_RE = re.compile(_MARKER.format("END"), re.I | re.M)
# old files: licence ending "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*..." and no START marker
SMALL_PRINT_END_RE = re.compile(r"^[ \t]*\*END\*?\s*THE\s+SMALL\s+PRINT", re.I | re.M)
# "End of the Project Gutenberg EBook of <title>, by <author>", just before the END marker
FOOTER_RE = re.compile(r"^[ \t]*End\s+of\s+(?:the\s+|this\s+)?Project\s+Gutenberg", re.I | re.M)
# paragraphs opening the body that are Project Gutenberg's, not the book's: transcriber credits
# ("Produced by ...", "E-text prepared by ...") and notes such as "Project Gutenberg also has an
# HTML version of this file ..."
CREDIT_RE = re.compile(
    r"(?:(?:Produced|Prepared|Transcribed|Scanned)\s+(?:by|from)|E-?text\s+(?:was\s+)?prepared"
    r"|This\s+e-?(?:text|book)\s+was\s+(?:produced|prepared|transcribed)"
    r"|\(?This\s+file\s+was\s+produced|.*Project\s+Gutenberg)",
    re.I | re.S,
)
PARA_RE = re.compile(r"\s*(\S.*?)(?:\n[ \t]*\n|\Z)", re.S)  # the first paragraph, after blank lines


def _line_after(text, pos):
    """Index of the start of the line after the one holding pos."""
    nl = text.find("\n", pos)
    return len(text) if nl == -1 else nl + 1


def strip_gutenberg(text):
    """The book's own text without Project Gutenberg's header, licence and footer.
    Returns (body, warning or None); line endings become \\n."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start, end, found = 0, len(text), False
    m = START_RE.search(text)
    if m:
        # the marker ends with "***", which may come a line or two later when the title is long
        para = text[m.end() : m.end() + 400].split("\n\n")[0]
        close = para.find("***")
        start = _line_after(text, m.end() + close + 3 if close != -1 else m.end())
        found = True
    m = SMALL_PRINT_END_RE.search(text, start)
    if m and (not found or m.start() < start + (len(text) - start) // 2):
        start, found = _line_after(text, m.start()), True  # the old licence ends here
    m = END_RE.search(text, start)
    if m:
        end, found = m.start(), True
    footers = list(FOOTER_RE.finditer(text, start, end))
    if footers:
        end, found = footers[-1].start(), True
    body = text[start:end]
    for _ in range(3):
        m = PARA_RE.match(body)
        if not (m and CREDIT_RE.match(m.group(1)) and len(m.group(1)) < 600 and m.end() < len(body)):
            break
        body = body[m.end() :]
    body = re.sub(r"^(?:[ \t]*\n)+", "", body).rstrip() + "\n"  # keep the first line's indent
    if not found:
        return body, "no Project Gutenberg markers found; kept the whole file"
    if end == len(text):  # a header but no END marker or footer: a download cut short?
        return body, "no END marker or footer after the START: the file may be cut short; kept it all"
    return body, None


def book_body(book, path, min_chars, downloaded):
    """The text of one book's raw file without Project Gutenberg's header, licence and footer; refused
    when what is left is too short to be the book (an error page, an empty file). A bad downloaded file
    is to be deleted (a rerun fetches it again), a bad one of the user's --source replaced."""
    book_id, title, _ = book
    fix = f"delete {path} and re-run to download it again" if downloaded else f"replace {path} with the book"
    with open(path, "rb") as f:
        body, warning = strip_gutenberg(book_text(f.read(), path))
    if warning:
        print(f"  warning: ebook {book_id} ({title}): {warning}; if it is damaged, {fix}")
    if len(body.strip()) < min_chars:
        fail(
            f"ebook {book_id} ({title}) has only {len(body.strip())} characters after stripping Project "
            f"Gutenberg's header and licence (need {min_chars}); it is probably not the book: "
            f"{fix}, or fix --books"
        )
    return body


# -----------------------------------------------------------------------------
# validation split


def split_books(book_ids, texts, val_fraction):
    """Whole books for validation: in order of sha256(id), until they hold val_fraction of the text."""
    order = sorted(range(len(book_ids)), key=lambda i: hashlib.sha256(str(book_ids[i]).encode()).hexdigest())
    target = val_fraction * sum(len(t) for t in texts)
    val, n_val = set(), 0
    for i in order:
        if n_val >= target or len(val) == len(book_ids) - 1:
            break
        val.add(i)
        n_val += len(texts[i])
    return sorted(set(range(len(book_ids))) - val), sorted(val)


# -----------------------------------------------------------------------------
# byte-level BPE


def count_words(texts):
    """How often each pre-tokenized piece (GPT-2 split pattern) occurs in texts."""
    split = regex.compile(SPLIT_PATTERN)
    counts = collections.Counter()
    for t in texts:
        counts.update(split.findall(t))
    return counts


def merge(word, pair, new):
    """word (a list of token ids) with every occurrence of pair, left to right, replaced by new."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe_reference(word_counts, n_tokens):
    """Byte-pair encoding as its definition reads: start from the 256 bytes, then again and again
    merge the most frequent pair of adjacent tokens into a new token, until there are n_tokens
    tokens. word_counts: {pre-tokenized piece: how often it occurs}. Returns the tokens' bytes;
    index = rank = id. Ties go to the smallest (left id, right id), so training is deterministic. A
    merge that rebuilds bytes we already have (x+yz after xy+z) reuses that token.

    A worked example, words {"aaab": 2, "ab": 1} as bytes:
      pairs (a,a) 2*2 = 4, (a,b) 2 + 1 = 3        -> merge (a,a) into 256 = "aa": "aaab" is [256,a,b]
      pairs (256,a) 2, (a,b) 2 + 1 = 3            -> merge (a,b) into 257 = "ab": "aaab" is [256,257]
      pairs (256,257) 2                            -> merge it into 258 = "aaab"
    The reading copy: it counts every pair again before every merge. train_bpe gives the same tokens
    faster, and tests.py checks that they agree."""
    vocab = [bytes([b]) for b in range(256)]
    ids = {t: i for i, t in enumerate(vocab)}
    words = {tuple(w.encode("utf-8")): c for w, c in word_counts.items()}  # token ids: count
    while len(vocab) < n_tokens:
        pairs = collections.Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        pair = min(pairs, key=lambda p: (-pairs[p], p))  # the most frequent; of ties, the smallest ids
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in ids:
            ids[merged] = len(vocab)
            vocab.append(merged)
        words = {tuple(merge(list(w), pair, ids[merged])): c for w, c in words.items()}
    return vocab


def train_bpe(word_counts, n_tokens, log_every=500):
    """train_bpe_reference, fast: the same tokens in the same order. Counting is incremental: pair
    counts are kept over the unique words (each weighted by its count) and updated only for the
    words that hold the merged pair, and a heap with lazy updates finds the most frequent pair. On
    the 94 training books the 4743 merges took 4 s, where a recount takes 0.3 s per merge, about
    25 minutes in all (measured once). Fails with one line when the text runs out of pairs."""
    vocab = [bytes([b]) for b in range(256)]
    ids = {t: i for i, t in enumerate(vocab)}
    words = [list(w.encode("utf-8")) for w in word_counts]
    counts = list(word_counts.values())
    pair_count = collections.defaultdict(int)
    where = collections.defaultdict(set)  # pair -> words that (may) contain it
    for wi, (w, c) in enumerate(zip(words, counts)):
        for pair in zip(w, w[1:]):
            pair_count[pair] += c
            where[pair].add(wi)
    heap = [(-c, pair) for pair, c in pair_count.items()]  # max-heap with lazy updates
    heapq.heapify(heap)
    t0, n_start = time.time(), len(vocab)
    while len(vocab) < n_tokens:
        while heap:  # pop until an entry is current; stale ones are re-pushed with their count
            neg, pair = heapq.heappop(heap)
            c = pair_count.get(pair, 0)
            if c == -neg:
                break
            if c > 0:
                heapq.heappush(heap, (-c, pair))
        else:
            fail(
                f"the training text allows only {len(vocab) + 1} tokens, fewer than --vocab_size "
                f"{n_tokens + 1}: use a smaller --vocab_size or more books"
            )
        merged = vocab[pair[0]] + vocab[pair[1]]
        added = merged not in ids
        if added:
            ids[merged] = len(vocab)
            vocab.append(merged)
        new = ids[merged]
        del pair_count[pair]
        touched = set()
        for wi in where.pop(pair):
            w, c = words[wi], counts[wi]
            out = merge(w, pair, new)
            if len(out) == len(w):
                continue  # stale entry: the pair left this word in an earlier merge
            for q in zip(w, w[1:]):
                if q != pair:
                    pair_count[q] -= c
            for q in zip(out, out[1:]):
                pair_count[q] += c
                if new in q:
                    where[q].add(wi)
                    touched.add(q)
            words[wi] = out
        for q in touched:  # only pairs with the new token can have grown
            heapq.heappush(heap, (-pair_count[q], q))
        done = len(vocab) - n_start
        if added and log_every and done % log_every == 0 and len(vocab) < n_tokens:
            # no ETA: the first merges touch most words and take most of the time (~4 s in all)
            print(f"  merges {done}/{n_tokens - n_start} ({fmt_time(time.time() - t0)})", flush=True)
    return vocab


def make_encoding(vocab):
    """A tiktoken Encoding from the learned tokens (rank = id), <|endoftext|> taking the next id."""
    n = len(vocab)
    enc = tiktoken.Encoding(
        f"bpe{n + 1}",
        pat_str=SPLIT_PATTERN,
        mergeable_ranks={t: i for i, t in enumerate(vocab)},
        special_tokens={EOT: n},
        explicit_n_vocab=n + 1,
    )
    if enc.n_vocab != n + 1 or enc.eot_token != n:
        raise ValueError(f"tokenizer has {enc.n_vocab} tokens, expected {n + 1}")
    return enc


def tokenizer_bytes(vocab):
    """tiktoken's .tiktoken text format: "base64(token) rank" per line, in rank order."""
    return b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(vocab))


# -----------------------------------------------------------------------------
# encode


def encode_books(enc, texts):
    """Token ids of the books, each followed by <|endoftext|>, as one uint16 array."""

    def encode(text):  # a literal "<|endoftext|>" in a book is encoded as plain text
        return enc.encode_to_numpy(text, disallowed_special=())

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # tiktoken releases the GIL
        parts = list(pool.map(encode, texts))
    eot = np.array([enc.eot_token], dtype=np.uint32)
    ids = np.concatenate([x for p in parts for x in (p, eot)])
    return ids.astype(np.uint16)


# -----------------------------------------------------------------------------
# write


def write_outputs(data_dir, vocab, source, books, texts, tokens):
    """train.bin, val.bin, tokenizer.tiktoken and meta.json, each written whole, meta.json last (it
    vouches for the others). books, texts, tokens: {"train": ..., "val": ...}. Returns meta."""
    files = {"train.bin": tokens["train"].tobytes(), "val.bin": tokens["val"].tobytes()}
    files[TOKENIZER_FILE] = tokenizer_bytes(vocab)
    sha256 = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    meta = {
        "vocab_size": len(vocab) + 1,
        "eot_token": len(vocab),
        "dtype": "uint16",
        "train_tokens": int(tokens["train"].size),
        "val_tokens": int(tokens["val"].size),
        "train_books": books["train"],
        "val_books": books["val"],
        "train_chars": sum(map(len, texts["train"])),
        "val_chars": sum(map(len, texts["val"])),
        "source": source,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": sha256[TOKENIZER_FILE],
        "train_sha256": sha256["train.bin"],
        "val_sha256": sha256["val.bin"],
        "split_pattern": SPLIT_PATTERN,
    }
    files["meta.json"] = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    os.makedirs(data_dir, exist_ok=True)
    for name, data in files.items():
        atomic_write(os.path.join(data_dir, name), data)
    return meta


# -----------------------------------------------------------------------------
# the pipeline


@contextmanager
def stage(times, name):
    """Time a stage of prepare() into times[name]."""
    t = time.time()
    yield
    times[name] = time.time() - t


def check_data_dir(data_dir):
    """Fail now, not after the downloads and the BPE, if the outputs cannot be written to data_dir."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        fail(f"--data_dir {data_dir} is a file, not a folder; check --data_dir")
    try:
        os.makedirs(data_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=data_dir, prefix=".write-check", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        fail(f"cannot write to --data_dir {data_dir} ({e.strerror}); pick a folder you can write to")


def prepare(args):
    """Book list -> download (or --source) -> strip -> split -> BPE -> encode -> write; prints each stage."""
    books, times = read_books_tsv(args.books), {}
    check_data_dir(args.data_dir)
    source = os.path.abspath(args.source) if args.source else args.mirror
    with stage(times, "download"):
        print(f"getting {len(books)} books from {source}")
        try:
            if args.source:
                paths = source_books(books, source)
            else:
                paths = download_books(books, source, os.path.join(args.data_dir, "raw"), args.pause)
        except KeyboardInterrupt:
            fail("interrupted; the books downloaded so far are kept: re-run to resume")

    with stage(times, "strip"):
        bodies = [book_body(book, path, args.min_chars, not args.source) for book, path in zip(books, paths)]
        train_idx, val_idx = split_books([b for b, _, _ in books], bodies, args.val_fraction)
    split = {"train": train_idx, "val": val_idx}
    ids = {s: [books[i][0] for i in idx] for s, idx in split.items()}
    texts = {s: [bodies[i] for i in idx] for s, idx in split.items()}
    print(
        f"stripped {len(books)} books: {sum(map(len, bodies)):,} characters "
        f"({fmt_time(times['strip'])}); validation: ebooks {', '.join(map(str, ids['val']))}"
    )

    print(f"training a byte-level BPE with {args.vocab_size} tokens on {len(texts['train'])} books")
    with stage(times, "pre-tokenize"):
        words = count_words(texts["train"])
    print(f"  {sum(words.values()):,} words, {len(words):,} distinct ({fmt_time(times['pre-tokenize'])})")
    with stage(times, "train BPE"):
        vocab = train_bpe(words, args.vocab_size - 1)
        enc = make_encoding(vocab)
    with stage(times, "encode"):
        tokens = {s: encode_books(enc, t) for s, t in texts.items()}
    with stage(times, "write"):
        meta = write_outputs(args.data_dir, vocab, source, ids, texts, tokens)

    n_train, n_val = meta["train_tokens"], meta["val_tokens"]
    offline = sum(v for k, v in times.items() if k != "download")
    print(f"\nwrote {args.data_dir}/: train.bin, val.bin, {TOKENIZER_FILE}, meta.json")
    print(f"books       {len(ids['train'])} train + {len(ids['val'])} val")
    print(f"characters  {meta['train_chars']:,} train + {meta['val_chars']:,} val")
    share = f"{n_val / (n_train + n_val):.1%} val; the paper: 8.4M with Hugging Face's BPE"
    print(f"tokens      {n_train:,} train + {n_val:,} val = {n_train + n_val:,} ({share})")
    took = ", ".join(f"{k} {fmt_time(v)}" for k, v in times.items())
    print(f"time        {took}; offline {fmt_time(offline)}")
    return 0


# -----------------------------------------------------------------------------
# reading the prepared data back: the tokenizer (sample.py) and the token files (train.py)


def load_tokenizer(data_dir):
    """The tokenizer that prepare_data.py wrote to data_dir, as a tiktoken.Encoding.
    Reads the file fresh on every call (no pickle, no cache, no network); <|endoftext|> is id
    vocab_size - 1. Checks the file against meta.json's checksum when that is there."""
    path = os.path.join(data_dir, TOKENIZER_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        fail(f"{path} not found: run `python prepare_data.py --data_dir {data_dir}` first")
    meta_path = os.path.join(data_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            expected = json.load(f).get("tokenizer_sha256")
        if expected and hashlib.sha256(data).hexdigest() != expected:
            fail(
                f"{path} does not match {meta_path} (checksum differs): "
                f"run `python prepare_data.py --data_dir {data_dir}` again"
            )
    vocab = []
    for n, line in enumerate(data.splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or parts[1] != b"%d" % (n - 1):
            fail(
                f'{path} line {n}: expected "base64(token) {n - 1}"; the file is damaged: '
                "run prepare_data.py again"
            )
        vocab.append(base64.b64decode(parts[0]))
    if len(set(vocab)) != len(vocab) or set(vocab[:256]) != {bytes([b]) for b in range(256)}:
        fail(f"{path} is damaged (repeated tokens or missing bytes): run prepare_data.py again")
    return make_encoding(vocab)


def load_data(data_dir, block_size, batch_size):
    """For train.py: train.bin and val.bin, memory-mapped and checked against meta.json, and the
    data's fingerprint (vocab size and sha256 of the token files and the tokenizer) for its checkpoint."""
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        fail(f"{meta_path} is missing; run `python prepare_data.py --data_dir {data_dir}` or pass --data_dir")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        meta["vocab_size"] = int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{meta_path} has no valid vocab_size ({e}); re-run prepare_data.py")
    train = token_file(data_dir, "train", meta, need=block_size + batch_size)  # a batch of windows of l+1
    val = token_file(data_dir, "val", meta, need=block_size + 1)
    keys = ("vocab_size", "train_sha256", "val_sha256", "tokenizer_sha256")
    return train, val, {k: meta.get(k) for k in keys}


def token_file(data_dir, split, meta, need):
    """One split's uint16 tokens, memory-mapped, once its size, sha256 (0.05 s for 19 MB) and largest
    token agree with meta.json."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        fail(f"{path} is missing; run `python prepare_data.py --data_dir {data_dir}` or pass --data_dir")
    with open(path, "rb") as f:
        raw = f.read()
    n, digest = len(raw) // 2, hashlib.sha256(raw).hexdigest()
    if len(raw) % 2:
        fail(f"{path} has an odd number of bytes ({len(raw)}): not uint16 tokens; re-run prepare_data.py")
    if meta.get(f"{split}_tokens", n) != n or meta.get(f"{split}_sha256", digest) != digest:
        fail(f"{path} is not the file meta.json describes (size or sha256 differ); re-run prepare_data.py")
    if n < need:
        fail(f"{path} holds {n} tokens, fewer than one batch needs ({need}); use more data or a smaller l")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if int(tokens.max()) >= meta["vocab_size"]:
        fail(f"{path} holds token {int(tokens.max())}, beyond meta.json's vocab_size; re-run prepare_data.py")
    return tokens


# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.error = lambda msg: fail(f"{msg} (see python prepare_data.py --help)")
    p.add_argument("--data_dir", default=DATA_DIR, help="outputs and the raw/ cache")
    p.add_argument(
        "--books", default=BOOKS_TSV, help="book list: rank, ebook id, title, author (tab-separated)"
    )
    p.add_argument("--mirror", default=MIRROR, help="host with gutenberg.org's paths")
    p.add_argument("--source", help="read <ID>.txt or pg<ID>.txt from this folder instead of downloading")
    p.add_argument("--vocab_size", type=int, default=VOCAB_SIZE, help="tokens, <|endoftext|> included")
    p.add_argument("--val_fraction", type=float, default=VAL_FRACTION, help="share held out as whole books")
    p.add_argument("--pause", type=float, default=PAUSE, help="seconds between downloads")
    p.add_argument("--min_chars", type=int, default=MIN_CHARS, help="refuse a shorter book (after stripping)")
    args = p.parse_args(argv)
    if not 257 <= args.vocab_size <= 65536:
        fail(f"--vocab_size {args.vocab_size}: need 256 bytes + <|endoftext|> (>= 257) in uint16 (<= 65536)")
    if not 0 < args.val_fraction < 1:
        fail(f"--val_fraction {args.val_fraction} must be between 0 and 1, e.g. 0.05")
    if args.pause < 0:
        fail(f"--pause {args.pause} must be >= 0 (seconds between downloads)")
    if not args.mirror.startswith(("http://", "https://")):
        fail(f"--mirror {args.mirror!r} must start with http:// or https://")
    if args.source and not os.path.isdir(args.source):
        fail(f"--source {args.source} is not a folder")
    return args


def main(argv=None):
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(
            errors="replace"
        )  # "The Nürnberg Stove" on an ASCII terminal prints as "N?rnberg", not a crash
    args = parse_args(argv)
    try:
        return prepare(args)
    except OSError as e:  # unwritable --data_dir, full disk, ...
        fail(f"{e.filename}: {e.strerror}; check --data_dir" if e.filename else str(e))


if __name__ == "__main__":
    sys.exit(main())
