from tests_header import *  # noqa: F403

import math
import signal

import bench
import extractor
import fir

# ======== computational complexity (Section 7, Tables 3-7): bench.py's closed forms against the paper ====


def per_token_counts(d, t, n):
    """Tables 5-6 summed for one new token at t (h = d/n): SA adds Table 3's t - 1, SHE d*d (ERRATA)."""
    h, Z = d // n, dict(div=0, exp=0)
    return {
        "sa": dict(mult=(3 * d * h + t * h + t * h) * n + d * d, div=(t + t) * n, exp=t * n,
                   add=(3 * (d - 1) * h + t * (h - 1) + (t - 1) * h + (t - 1)) * n + (d - 1) * d),
        "she": dict(Z, mult=d * d * t + d * d + d + d * d,
                    add=(d - 1) * d * t + (t - 1) * d + (d - 1) * d + (d - 1) * d),
        "he": dict(Z, mult=d * t + d * d + d * d + d + d * d, add=(t - 1) * d + (d - 1) * d + (d - 1) * d
                   + (d - 1) * d),
        "we": dict(Z, mult=d * t + d * d + d + d * d, add=(t - 1) * d + (d - 1) * d + (d - 1) * d),
        "me": dict(Z, mult=d * t, add=(t - 1) * d),
    }  # fmt: skip


OPS = ("mult", "add", "div", "exp", "params", "total")  # Table 7's rows


@pytest.mark.parametrize("d,l,n", [(128, 128, 1), (128, 128, 32), (64, 32, 4), (12, 9, 3), (30, 7, 5)])
def test_tables_5_6_closed_forms_are_their_sums_and_add_up_to_tables_3_4(d, l, n):
    for t in range(1, l + 1):
        assert bench.complexity_inference(d, t, n) == per_token_counts(d, t, n), t
        misprint = 2 * t * d - t * n + t + 4 * d * d - 5 * d - 1  # Table 5's printed SA additions
        assert per_token_counts(d, t, n)["sa"]["add"] - misprint == (n - 1) * (t - 1)
    params = dict(sa=3 * d * (d // n) * n + d * d, she=d * d * l + d * d + d * d, we=d * l + d * d + d * d,
                  he=d * l + d * d + d * d + d * d, me=l)  # fmt: skip
    for mixer, counts in bench.complexity_training(d, l, n).items():  # Tables 3 and 4: the sums over t
        summed = {k: sum(per_token_counts(d, t, n)[mixer][k] for t in range(1, l + 1)) for k in OPS[:4]}
        assert counts == dict(summed, params=params[mixer]), mixer


TABLE7 = {  # the paper's Table 7 (d = l = 128): mult, add, div, exp, params, total
    "1-head SA": (10502144, 10420096, 16512, 8256, 65536, 20947008),
    "32-head SA": (10502144, 10416128, 528384, 264192, 65536, 21710848),
    "SHE": (139476992, 139411456, 0, 0, 2129920, 278888448), "HE": (7364608, 7282688, 0, 0, 65536, 14647296),
    "WE": (5267456, 5201920, 0, 0, 49152, 10469376), "ME": (1056768, 1040384, 0, 0, 128, 2097152),
}  # fmt: skip


def test_table7_from_the_closed_forms_and_the_modules(capsys):
    assert {label: tuple(c[k] for k in OPS) for label, c in bench.table7(128, 128).items()} == TABLE7
    bench.main(["--table7"])
    out = capsys.readouterr().out.split("\n\n")
    assert out[0].splitlines()[2].split() == "1-head SA 32-head SA SHE HE WE ME".split()
    parse = lambda lines: {ln.split()[0]: [int(v.replace(",", "")) for v in ln.split()[1:]] for ln in lines}
    rows, d, l = parse(out[0].splitlines()[3:]), 128, 128
    for key, i in zip(OPS + ("modules",), (0, 1, 2, 3, 4, 5, 4)):  # the modules' parameters: column 4
        assert rows[key] == [numbers[i] for numbers in TABLE7.values()], key
    # FLOPs: SA four d x d maps, and QK^T and AV over all t x t (SDPA's kernel, counted so); ME T (t x t) x
    assert [rows["flops"][i] for i in (0, 1, 5)] == [8 * l * d * d + 4 * l * l * d] * 2 + [2 * l * l * d]
    # Tables 5 and 6 at t = l = d = 128: SA 2td + 4d^2 - 5d - n, SHE td^2 + 2d^2 - 3d, HE td + 3d^2 - 4d, ...
    assert parse(out[1].splitlines()[1:])["add"] == [97663, 97632, 2129536, 65024, 48768, 16256]


# ======== tools: the benchmark (bench.py): every section in quick mode, the arithmetic of each row ========
def test_bench_quick_prints_a_row_per_mixer_and_each_rows_arithmetic(tmp_path, capsys):
    out, dev = tmp_path / "b.json", str(DEVICE)  # on CUDA: a row per FIR path (sublayer), per variant (step)
    bench.main(["--quick", "--floor", "--mixers", "me,he", "--device", dev, "--json", str(out)])
    blocks, res = capsys.readouterr().out.split("\n\n")[1:4], json.loads(out.read_text())["sections"]
    for block, name, (key, spec) in zip(blocks, res, (("vs_sa", ".3f"), ("vs_floor", ".1f"), ("fits", ""))):
        rows = [ln.split() for ln in block.splitlines()]  # title, columns, ----, the rows, "name: ..." notes
        assert [row[0] for row in rows[3:] if not row[0].endswith(":")] == [r["mixer"] for r in res[name]]
        printed = [row[rows[1].index(key)] for row in rows[3 : 3 + len(res[name])]]
        assert printed == [format(r[key], spec) for r in res[name]], name
        assert list(dict.fromkeys(r["mixer"] for r in res[name])) == ["sa", "me", "he"], name
    close = lambda got, want: math.isclose(got, want, rel_tol=1e-12)
    sa_ms = res["sublayer"][0]["ms"]  # sa's row comes first
    sa_step = {r["variant"]: r["step_ms"] for r in res["step"] if r["mixer"] == "sa"}
    assert all(close(r["vs_sa"], r["ms"] / sa_ms) for r in res["sublayer"])
    for r in res["step"]:
        ms, sa = r["step_ms"], sa_step[r["variant"]]  # below: --quick's batch of 4 x 32 = 128 tokens
        pairs = [(r["vs_sa"], sa / ms), (r["vs_floor"], ms / r["floor_ms"]), (r["tokens_per_s"], 128e3 / ms),
                 (r["paper_hours"], 60 * ms / 3600), (r["flop_ms"], 1e3 * r["flops"] / r["flop_rate"]),
                 (r["byte_ms"], 1e3 * r["bytes"] / r["byte_rate"])]  # fmt: skip
        assert r["floor_ms"] == max(r["flop_ms"], r["byte_ms"]) and all(close(a, b) for a, b in pairs), r
    params = {r["mixer"]: r["params"] for r in res["step"]}
    for r in res["memory"]:  # float32 parameters and AdamW's two moments, as large each
        assert close(r["state_mib"], 12 * params[r["mixer"]] / 2**20) and r["saved_mib"] > 0, r
        if "peak_mib" in r:  # Linux
            per_seq = (r["peak_mib"] - r["peak_half_mib"]) / (4 - 2)  # --quick: batches 4 and 2
            assert close(r["per_seq_mib"], per_seq) and r["fits"] == "yes", r
            assert r["max_batch"] == 4 + math.floor((5 * 1024 - r["peak_mib"]) / per_seq), r  # 6 GiB less 1


def test_bench_counts_a_known_steps_flops_bytes_and_peak():
    lin, x = torch.nn.Linear(8, 8, bias=False), torch.randn(6, 8, requires_grad=True)  # 256 and 192 bytes
    opt = torch.optim.AdamW(lin.parameters())

    def step():  # forward (6, 8) @ (8, 8) and (8, 6) @ (6, 8); backward two products for each
        h = lin(x)  # saves x (for the weight's gradient) and the weight (a parameter: no activation)
        (h.t() @ h).sum().backward()  # saves h and its view h.t(): one storage, 192 bytes
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's moments: 2 x 256 bytes
    flops, moved = bench.step_counts(lin, opt, step, logits=1000)
    assert flops == 3 * (2 * 6 * 8 * 8) + 3 * (2 * 8 * 6 * 8)
    assert moved == 2 * (256 + 256 + 512 + 192 + 192 + 1000)  # parameters, gradients, moments, saved, logits
    if os.path.exists("/proc/self/clear_refs"):  # Linux: the high-water mark is reset, not an earlier one
        torch.ones(2**26).sum()  # 256 MiB, freed
        peak = bench.peak_bytes(lambda: torch.ones(2**24).add_(1), torch.device("cpu"))  # 64 MiB
        assert 2**26 - 2**20 <= peak < 2**26 + 2**24, peak  # (freed heap it reused: under 1 MiB)


def test_bench_sublayer_times_every_fir_path_on_cuda_each_forced(monkeypatch, capsys):
    cuda, module = torch.device("cuda"), lambda m: bench.sublayer(Config(n_embd=8, n_head=2, mixer=m))
    paths = {m: bench.sublayer_paths(module(m), 16, cuda) for m in ("sa", "me", "we", "she")}
    for m, dim in (("me", 1), ("we", 2), ("she", 3)):  # the default first, then every path for these taps
        want = sorted(p for p, dims in fir.PATHS.items() if dim in dims)
        assert paths[m][0] == fir.default_path("cuda", dim, 16) and sorted(paths[m]) == want, m
        assert bench.sublayer_paths(module(m), 16, torch.device("cpu")) == [fir.default_path("cpu", dim, 16)]
    assert paths["sa"] == ["sdpa"] and len(paths["me"]) == 3 and len(paths["she"]) == 2
    sublayer_paths, forcing, forced = bench.sublayer_paths, fir.forcing, []
    monkeypatch.setattr(bench, "sublayer_paths", lambda mod, t, _: sublayer_paths(mod, t, cuda))  # run here
    monkeypatch.setattr(fir, "forcing", lambda path: forced.append(path) or forcing(path))
    bench.main(["--quick", "--sections", "sublayer", "--mixers", "me,she", "--device", str(DEVICE)])
    out = capsys.readouterr().out.split("\n\n")[1]  # the table: title, columns, ----, rows, notes
    rows = [ln.split()[:2] for ln in out.splitlines()[3:] if ln[0] != " "]
    assert rows == [[m, p] for m in ("sa", "me", "she") for p in paths[m]]
    assert sorted(forced) == sorted(p for _, p in rows[1:] for _ in range(3 + 2))  # 3 warm-up rounds, 2 timed


def test_bench_bad_flags_give_one_line_and_exit_1(capsys):
    for argv in (["--mixers", "nope"], ["--sections", "x"], ["--n_head", "5"], ["--gpu_gib", "1"], ["--x"]):
        error_line(capsys, bench.main, argv + ["--quick"])


@pytest.mark.slow
def test_bench_quick_as_users_run_it_every_mixer_and_a_closed_pipe():
    rc, out, err = run_script("experiments/bench.py", "--quick", "--mixers", "all")
    names = list(extractor.MIXERS)  # sa first; the Synthesizers too (bench.py imports them)
    for block in out.split("\n\n")[1:4]:
        assert rc == 0 and [ln.split()[0] for ln in block.splitlines()[3:]][: len(names)] == names, err
    r, w, argv = *os.pipe(), [sys.executable, "experiments/bench.py", "--table7"]
    os.close(r)  # `bench.py --table7 | head -1`: the reader is gone before the first line
    p = subprocess.run(argv, cwd=ROOT, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    assert p.returncode == -signal.SIGPIPE and b"Traceback" not in p.stderr, p.stderr[-300:]
