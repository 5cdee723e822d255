from tests_header import *  # noqa: F403
# ruff: noqa: F405, I001  (a section of tests.py: the names of tests_header.py, which comes first)

import collections
import contextlib
import http.server
import io
import random
import threading
import time

import prepare_data

# ======== the data (prepare_data.py): Gutenberg's wrappers, download, split, BPE, loaders ========

# A made-up book with what stripping must keep: the first line's indent, a chapter "END OF ...", an ornament
# of asterisks, a paragraph opening like a credit and a line holding a footer's words, inside the text.
BODY = """\
      THE LANTERN

CHAPTER I. END OF THE FERRY

      *       *       *       *       *

Produced by the mill, the flour crossed on "Tuesdays". The End of Project Gutenberg's
ferry was the willow bank.
"""
# What the 100 books put around their text, each form with how many use it (a survey of the mirror). The START
# marker (or the 1990s licence) and the END marker: 91, 8, 1 books; none splits a marker over two lines.
MARKERS = {
    "THIS": ("*** START OF THIS PROJECT GUTENBERG EBOOK {T} ***",
             "*** END OF THIS PROJECT GUTENBERG EBOOK {T} ***"),
    "THE": ("***START OF THE PROJECT GUTENBERG EBOOK {T}***", "***END OF THE PROJECT GUTENBERG EBOOK {T}***"),
    "small print": ("***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\nA stand-in licence.\n"
                    "*END THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.07.00*END*", ""),
}  # fmt: skip
CREDITS = {  # paragraphs opening the text
    "Produced by": "Produced by Jane Roe\n\n\n",  # 63 books
    "Produced by, 2-5 lines": "Produced by Jane Roe, Rick Poe and the Online Distributed\nProofreading "
    "Team at http://www.pgdp.net (from scans a library\nlent for the purpose.)\n\n\n\n",  # 21 books
    "Transcribed from": "Transcribed from the 1899 Hollow Press edition by Ann Example.\n\n",  # 3 books
    "E-text prepared, Note": "E-text prepared by Ann Example and the Project Gutenberg Online\nTeam\n\n\n"
    "Note: Project Gutenberg also has an HTML version of this\n      file, with pictures.\n\n",
    "E-text prepared": "E-text prepared by Al Example\n\n\n\n",  # 1 book; the one above: 3 books
    "This etext": "This etext was prepared by A Scanner, typed and\nproofread by A Reader.\n\n\n\n\n",  # 1
    "none": "",  # 8 books
}
FOOTERS = {  # the line(s) just before the END marker (no file has one after it)
    "the EBook of": "End of the Project Gutenberg EBook of The Lantern, by Ada Quill\n\n",  # 57 books
    "Gutenberg's": "End of Project Gutenberg's The Lantern, by Ada Quill\n\n",  # 23 books
    "Gutenberg\u2019s": "End of Project Gutenberg\u2019s The Lantern, by Ada Quill\n\n",  # 10 books
    "The Etext of": "End of The Project Gutenberg Etext of The Lantern by Ada Quill\n\n",  # 2 books
    "two lines": "End of the Project Gutenberg EBook of The Lantern, by\nAda Quill\n\n",  # 8 of the above
    "none": "",  # 8 books (those of "***START OF THE")
}
# each form at least once, mixed as the books mix them
FORMS = [("THIS", "Produced by", "the EBook of"), ("THIS", "Produced by, 2-5 lines", "Gutenberg's"),
         ("THIS", "none", "Gutenberg\u2019s"), ("THIS", "Produced by", "The Etext of"),
         ("THIS", "Produced by, 2-5 lines", "two lines"), ("THE", "E-text prepared, Note", "none"),
         ("THE", "Transcribed from", "none"), ("THE", "E-text prepared", "none"), ("THE", "none", "none"),
         ("small print", "This etext", "two lines")]  # fmt: skip


def gutenberg_file(markers, credits, footer, body=BODY, title="The Lantern"):
    """body with a header, credits, footer and licence of the forms above, as text."""
    start, end = (m.format(T=title.upper()) for m in MARKERS[markers])
    head = f"The Project Gutenberg EBook of {title}, by Ada Quill\n\nTitle: {title}\n\nRelease Date: 2008\n\n"
    tail = f"{end}\n\n***** This file should be named 1.txt or 1.zip *****\n\nA licence.\n" if end else ""
    return f"{head}{start}\n\n\n\n{CREDITS[credits]}{body}\n\n\n\n{FOOTERS[footer]}{tail}"


@pytest.mark.parametrize("markers, credits, footer", FORMS)
def test_strip_keeps_the_book_and_drops_header_credits_footer_and_licence(markers, credits, footer):
    assert prepare_data.strip_gutenberg(gutenberg_file(markers, credits, footer)) == (BODY, None)


def test_strip_warns_of_a_file_cut_short_and_reads_a_bom_crlf_or_cp1252_the_same(tmp_path):
    """None of the 100 files is cut short, has a byte-order mark or CRLF or is not UTF-8."""
    cut = gutenberg_file("THIS", "none", "none").split("*** END")[0]  # no END marker, no footer: all kept
    warning = "no END marker or footer: the file may be cut short"
    assert prepare_data.strip_gutenberg(cut) == (BODY, warning)
    assert prepare_data.strip_gutenberg("\n  plain text \n\n") == ("  plain text\n", warning)
    body = BODY.replace('"Tuesdays"', "\u201cTuesdays\u201d")
    text = gutenberg_file("THIS", "Produced by", "Gutenberg's", body)
    bom_crlf = ("\ufeff" + text.replace("\n", "\r\n")).encode()
    for raw in bom_crlf, text.encode("cp1252"), ("\ufeff" + body).encode():  # the last without markers
        (tmp_path / "1.txt").write_bytes(raw)
        assert prepare_data.book_body((1, "The Lantern", ""), str(tmp_path / "1.txt"), 100) == body


# ---- a run: the outputs, the download's faults, retries and pauses, the raw/ cache, --source
def fake_book(seed):
    """Made-up prose: 239 lines of words of syllables (a few letters not ASCII), a paragraph every 6."""
    rng, syllables = random.Random(seed), "ka lo mi ren tho va quil sa ne dor bri el tü ça wy".split()
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(200)]
    lines = [" ".join(rng.choices(words, k=9)) + ("." if k % 6 else ".\n") for k in range(1, 240)]
    return "\n".join(lines) + "\n"


BOOKS = [(9001, "Mossy Dell"), (9002, "Brass Kite"), (9003, "Oddly Far"), (9004, "Quince Hall"),
         (9005, "Lark Rise"), (9006, "Tin Fern"), (9007, "N\u00fcrnberg Stove")]  # fmt: skip
BODIES = {i: fake_book(i) for i, _ in BOOKS}
RAW = {i: gutenberg_file(*FORMS[k], BODIES[i], t).encode() for k, (i, t) in enumerate(BOOKS)}  # their files
VOCAB = 400
outputs = lambda d: {n: (d / n).read_bytes() for n in ("train.bin", "val.bin", "tokenizer.tiktoken")}


class Handler(http.server.BaseHTTPRequestHandler):
    """server.files; faults[path] used up one per request: a status, html, timeout (1 s), truncate (half)."""

    def do_GET(self):
        self.server.log.append((self.path, self.headers["User-Agent"]))
        fault = (self.server.faults.get(self.path) or [""]).pop(0)
        body = b"<!DOCTYPE html><p>Captcha</p>" if fault == "html" else self.server.files.get(self.path)
        time.sleep(1.0 if fault == "timeout" else 0)
        if fault.isdigit() or body is None:
            return self.send_error(int(fault or 404))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if fault == "truncate" else body)

    log_message = lambda *args: None


@contextlib.contextmanager
def serve(raws):
    """A loopback mirror with each book ({ebook id: bytes}) at gutenberg.org's three paths."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.log, srv.faults, srv.handle_error, srv.daemon_threads = [], {}, lambda *a: None, True
    srv.files = {p.format(id=i): raw for i, raw in raws.items() for p in prepare_data.URL_PATTERNS}
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def prepare(data_dir, *flags, tsv, mirror="http://127.0.0.1:9", timeout=0.5):
    """prepare_data.main with a 0.5 s timeout, retries 0.01 s and 0.02 s later, no pause; its exit status."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("no_proxy", "127.0.0.1")  # a user's proxy must not see loopback requests
        for name, value in (("TIMEOUT", timeout), ("RETRIES", 2), ("BACKOFF", 0.01)):
            mp.setattr(prepare_data, name, value)
        argv = ["--data_dir", str(data_dir), "--books", tsv, "--mirror", mirror, "--pause", "0"]
        return prepare_data.main([*argv, "--vocab_size", str(VOCAB), *flags])


def folder(src, raws, names=("{}.txt",)):
    """raws ({ebook id: bytes}) written to the folder src, a --source, the names taken in turn."""
    for k, (i, raw) in enumerate(raws.items()):
        (src / names[k % len(names)].format(i)).parent.mkdir(parents=True, exist_ok=True)
        (src / names[k % len(names)].format(i)).write_bytes(raw)
    return str(src)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    (root / "books.tsv").write_text("id\n" + "".join(f"{r}\t{i}\t{t}\n" for r, (i, t) in enumerate(BOOKS)))
    with serve(RAW) as srv:
        assert prepare(root / "data", tsv=str(root / "books.tsv"), mirror=srv.url) == 0
    return root / "data", str(root / "books.tsv")


def test_a_run_writes_the_books_tokens_and_tokenizer_the_same_from_a_source_folder(clean, tmp_path, capsys):
    data_dir, _ = clean
    meta, enc = json.loads((data_dir / "meta.json").read_text()), prepare_data.load_tokenizer(data_dir)
    assert (meta["vocab_size"], enc.n_vocab, enc.decode([VOCAB - 1])) == (VOCAB, VOCAB, "<|endoftext|>")
    assert sorted(meta["train_books"] + meta["val_books"]) == [i for i, _ in BOOKS] and meta["val_books"]
    for split in ("train", "val"):
        tokens = np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16)
        books = [i for i, _ in BOOKS if i in meta[f"{split}_books"]]  # in the list's order
        assert enc.decode(tokens.tolist()) == "".join(BODIES[i] + "<|endoftext|>" for i in books)
        assert (tokens == VOCAB - 1).sum() == len(books) and meta[f"{split}_tokens"] == len(tokens)
        assert meta[f"{split}_sha256"] == hashlib.sha256(tokens.tobytes()).hexdigest()
    ranks = [int(line.split()[1]) for line in (data_dir / "tokenizer.tiktoken").read_bytes().splitlines()]
    assert ranks == list(range(VOCAB - 1))
    assert {i: (data_dir / f"raw/{i}.txt").read_bytes() for i, _ in BOOKS} == RAW  # byte for byte
    texts = ["", "\n\t \r\n", "e\u0301\u0308", "<|endoftext|>", "\U0001f468\u200d\U0001f469 \u4f60\u597d"]
    ids = prepare_data.encode_books(enc, [*texts, "".join(map(chr, range(32, 0x800, 7)))]).tolist()
    ends = [k for k, t in enumerate(ids) if t == enc.eot_token]  # a written "<|endoftext|>" is text
    assert [enc.decode(ids[a + 1 : b]) for a, b in zip([-1] + ends, ends)][:-1] == texts
    src = folder(tmp_path / "src", RAW, ("{}.txt", "pg{}.txt", "cache/epub/{0}/pg{0}.txt"))
    for vocab in (VOCAB, 300):  # the same path, a new file: nothing cached survives
        assert prepare(tmp_path, "--source", src, "--vocab_size", str(vocab), tsv=clean[1]) == 0
        enc = prepare_data.load_tokenizer(tmp_path)
        assert (enc.n_vocab, enc.decode(enc.encode(BODIES[9002]))) == (vocab, BODIES[9002])
        assert vocab != VOCAB or outputs(tmp_path) == outputs(clean[0])
    assert json.loads((tmp_path / "meta.json").read_text())["source"] == src
    (tok := tmp_path / "tokenizer.tiktoken").write_bytes(tok.read_bytes().replace(b" 298\n", b" 297\n"))
    assert f"{tok} is not the file meta.json" in error_line(capsys, prepare_data.load_tokenizer, tmp_path)
    assert "none/meta.json is missing" in error_line(capsys, prepare_data.load_tokenizer, tmp_path / "none")


def test_download_retries_skips_pauses_names_a_missing_book_resumes(clean, tmp_path, monkeypatch, capsys):
    sleeps, sleep = [], time.sleep  # the main thread's (the server's threads sleep too)
    mine = lambda s: threading.current_thread() is threading.main_thread() and sleeps.append(s)
    monkeypatch.setattr(time, "sleep", lambda s: (mine(s), sleep(s)))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))  # an ASCII terminal
    first, second = (lambda i, p=p: p.format(id=i) for p in prepare_data.URL_PATTERNS[:2])
    faults = {9001: "500 500", 9002: "timeout", 9004: "truncate", 9005: "html", 9007: "429"}
    with serve({i: raw for i, raw in RAW.items() if i != 9003}) as srv:  # 9003: 404 at its three paths
        srv.faults = {first(i): f.split() for i, f in faults.items()}
        err = error_line(capsys, prepare, tmp_path, "--pause", "0.03", tsv=clean[1], mirror=srv.url)
        n, kept = collections.Counter(p for p, _ in srv.log), sorted(os.listdir(tmp_path / "raw"))
        assert not os.path.exists(tmp_path / "train.bin")
        srv.files.update({p.format(id=9003): RAW[9003] for p in prepare_data.URL_PATTERNS})
        for _ in range(2):  # the first downloads 9003 alone, the second nothing
            assert prepare(tmp_path, "--pause", "0.03", tsv=clean[1], mirror=srv.url) == 0
    assert f"ebooks 9003 not found at {srv.url} (no plain text at their URLs); the others are kept" in err
    assert kept == [f"{i}.txt" for i in RAW if i != 9003]
    assert [n[first(i)] for i, _ in BOOKS] == [3, 2, 1, 2, 1, 1, 2]  # 5xx, 429, no answer, cut short: again
    assert [n[second(i)] for i, _ in BOOKS] == [0, 0, 1, 0, 1, 0, 0]  # 404, an HTML page: the next path
    assert [p for p, _ in srv.log[sum(n.values()) :]] == [first(9003)]
    assert {agent for _, agent in srv.log} == {prepare_data.USER_AGENT}
    assert sorted(s for s in sleeps if s) == [0.01] * 4 + [0.02] + [0.03] * 6  # backoff doubling; pauses
    sys.stdout.flush()
    assert "N?rnberg Stove" in sys.stdout.buffer.getvalue().decode("ascii")
    assert outputs(tmp_path) == outputs(clean[0])


def test_a_server_down_is_one_line_at_once_and_leaves_nothing(clean, tmp_path, capsys):
    err = error_line(capsys, prepare, tmp_path, tsv=clean[1], timeout=30)  # port 9: nobody listens
    assert err.startswith("error: cannot download ebook 9001 (http://127.0.0.1:9/cache/epub/9001/pg9001.txt:")
    assert err.endswith("re-run, or use --mirror or --source") and os.listdir(tmp_path / "raw") == []


def test_load_data_checks_each_file_against_meta(tmp_path, capsys):
    data, err = make_data(tmp_path, vocab=64), lambda *a: error_line(capsys, prepare_data.load_data, *a)
    train, val, fp = prepare_data.load_data(data, 8, 4)
    for tokens, split in ((train, "train"), (val, "val")):
        assert np.array_equal(tokens, np.fromfile(f"{data}/{split}.bin", dtype=np.uint16))
    meta, n = json.loads(open(f"{data}/meta.json").read()), len(val)
    assert fp == {k: meta.get(k) for k in ("vocab_size", "train_sha256", "val_sha256", "tokenizer_sha256")}
    assert len(prepare_data.load_data(data, n - 1, 1)[1]) == n  # windows of l + 1 = n tokens: just enough
    assert f"val.bin holds {n} tokens, fewer than a batch needs ({n + 1})" in err(data, n, 1)
    assert f"train.bin holds {len(train)} tokens, fewer than a batch needs" in err(data, 1, len(train))
    for change in (lambda b: b[:-2], lambda b: b[:-2] + b"\1\0"):  # a token fewer, a token changed
        open(f"{data}/val.bin", "wb").write(change(open(f"{data}/val.bin", "rb").read()))
        assert "val.bin is not the file meta.json describes" in err(data, 8, 4)
    json.dump({**meta, "vocab_size": int(train.max())}, open(f"{data}/meta.json", "w"))  # train.bin first
    assert f"train.bin holds token {int(train.max())} >= meta.json's vocab_size" in err(data, 8, 4)


def test_bpe_worked_by_hand_and_the_fast_one_against_the_reference():
    for words, tokens in [
        ({"aaab": 2, "ab": 1}, [b"aa", b"ab", b"aaab"]),  # the docstring's example
        ({"ba": 2, "zy": 2, "ab": 1, "ac": 1}, [b"ba", b"zy", b"ab", b"ac"]),  # ties: ba < zy, ab < ac
    ]:  # fmt: skip
        for train_bpe in (prepare_data.train_bpe_reference, prepare_data.train_bpe):
            assert train_bpe(words, 256 + len(tokens)) == [bytes([b]) for b in range(256)] + tokens
    for seed, letters in enumerate(["ab", "abc", "abcde", "xyz\u00e9\u4e00"]):  # few letters: many ties
        rng = random.Random(seed)
        words = collections.Counter("".join(rng.choices(letters, k=rng.randint(1, 12))) for _ in range(400))
        assert prepare_data.train_bpe(words, 316) == prepare_data.train_bpe_reference(words, 316)
    words = prepare_data.count_words([BODIES[9001]])
    assert prepare_data.train_bpe(words, 336) == prepare_data.train_bpe_reference(words, 336)


def test_split_holds_out_whole_books_in_the_order_of_sha256_of_their_ids():
    held_out = lambda ids, texts, f: sorted(ids[i] for i in prepare_data.split_books(ids, texts, f)[1])
    # sha256 of "1".."6", worked out once with hashlib: 4 (4b227777...), 3 (4e074085...), 1 (6b86b273...),
    # 2 (d4735e3a...), 6 (e7f6c011...), 5 (ef2d127d...); six books of 100 characters, 300 = half of them
    cases = {
        0.01: [4],
        0.17: [3, 4],
        0.5: [1, 3, 4],
        0.51: [1, 2, 3, 4],
        1: [1, 2, 3, 4, 6],
    }  # 0.5: exactly 300
    assert {f: held_out([1, 2, 3, 4, 5, 6], ["x" * 100] * 6, f) for f in cases} == cases
    assert prepare_data.split_books([5, 4, 3], ["x" * 10, "x", "x" * 10], 0.5) == ([0], [1, 2])  # 4, then 3
    books = prepare_data.read_books_tsv(
        prepare_data.parse_args([]).books
    )  # the default list, beside the script
    assert len(books) == 100 and books[0] == (11, "Alice's Adventures in Wonderland", "Lewis Carroll")
    # by sha256: 2726 (00f3ca2e...), 55 (02d20bbd...), 51 (031b4af5...), 1154 (06ec44cc...), 2557
    # (0844b610...), 146 (0a5b046d...), 520 (0b35b06a...); the real books' lengths stop after six
    first = [2726, 55, 51, 1154, 2557, 146, 520]
    for k in range(1, len(first) + 1):  # books of equal length: k - 0.5 of 100 books' text takes k
        assert held_out([i for i, _, _ in books], ["x"] * 100, (k - 0.5) / 100) == sorted(first[:k])


# ---- bad input: one line saying what to do, before any work, nothing half-written
def test_bad_input_is_one_line_and_writes_nothing(clean, tmp_path, capsys):
    src = folder(tmp_path / "src", RAW)
    (tmp_path / "e").mkdir()
    cases = {  # books.tsv's text, or flags: what the line says
        "id\n1\t11\n2\televen\n": "cannot read --books", "id\n1\t11\n2\t\u00b2\n": "cannot read --books",
        "id\n1\t11\n2\t11\n": "lists 2 books, some twice", "id\n1\t11\n": "lists 1 books",
        b"id\n1\t11\tCaf\xe9\n": "can't decode byte 0xe9", "--books no": "cannot read --books no ([Errno 2]",
        "--vocab_size 256": "--vocab_size: 256 bytes + <|endoftext|>", "--vocab_size 65537": "--vocab_size:",
        "--vocab_size many": "invalid int value: 'many'", "--val_fraction 1": "need 0 < --val_fraction < 1",
        "--pause -1": "and --pause >= 0", "--mirror ftp://x": "--mirror must start with http",
        "--source none": "--source none is not a folder", f"--source {tmp_path}/e": "ebooks 9001, 9002, 9003",
        f"--source {src} --data_dir {clean[1]}/x": f"cannot write to --data_dir {clean[1]}/x (Not a dir",
        f"--vocab_size 60000 --source {src}": "the books allow only ",
    }  # fmt: skip
    for case, says in cases.items():
        (tmp_path / "bad.tsv").write_bytes(case if isinstance(case, bytes) else case.encode())
        argv = case.split() if str(case).startswith("--") else ["--books", str(tmp_path / "bad.tsv")]
        assert says in error_line(capsys, prepare, tmp_path / "out", *argv, tsv=clean[1]), case
        assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == [], case


def test_short_empty_binary_books_are_one_line_naming_the_file_a_cut_one_a_warning(clean, tmp_path, capsys):
    src, short = tmp_path / "src", RAW[9006].replace(BODIES[9006].encode(), b"A short error page.")
    for raw, says in [(short, "(Tin Fern) has 19 characters"), (b"", "(Tin Fern) has 0 characters"),
                      (bytes(range(256)) * 9, f"{src}/9006.txt is not a text file (NUL bytes)")]:  # fmt: skip
        folder(src, {**RAW, 9006: raw})
        err = error_line(capsys, prepare, tmp_path / "out", "--source", str(src), tsv=clean[1])
        assert says in err and f"replace {src}/9006.txt with the book's text (or delete a download" in err
        assert (src / "9006.txt").read_bytes() == raw and not os.path.exists(tmp_path / "out/train.bin")
    folder(src, {**RAW, 9001: RAW[9001].split(b"End of the Project")[0]})  # a download cut short
    assert prepare(tmp_path / "out", "--source", str(src), tsv=clean[1]) == 0
    out = capsys.readouterr().out  # the warning names the file
    assert "ebook 9001 (Mossy Dell): no END marker or footer: the file may be cut short" in out
    assert f"if it is, replace {src}/9001.txt with the book's text" in out


@pytest.mark.slow
def test_prepare_data_from_the_command_line_is_one_line_without_traceback(tmp_path):
    rc, out, err = run_script("prepare_data.py", "--books", "none.tsv", "--data_dir", str(tmp_path))
    assert rc == 1 and err.startswith("error: cannot read --books") and err.count("\n") == 1 and out == ""
