from tests_header import *  # noqa: F403
# ruff: noqa: F405, I001  (a section of tests.py: the names of tests_header.py, which comes first)

import csv
import glob
import gzip
import random
import shlex
from statistics import median  # the tests' own medians, not numpy's, which plot.py takes

import plot
import taps


# ======== tools: plots and CSVs (plot.py), what the mixers learned (taps.py), results/ ========
def _run(folder, mixer, losses, n_head=1, val_every=5, seed=1, data_seed=1, start=1, data=None, **config):
    """A run folder as train.py writes it, of made-up costs from batch `start` on (validation: cost - 0.5)."""
    cfg = {"mixer": mixer, "n_head": n_head, "n_layer": 2, "block_size": 32, "vocab_size": 50} | config
    run = {"config": cfg, "args": dict(seed=seed, data_seed=data_seed), "params": {"mixers": 7}, "data": data}
    os.makedirs(folder)
    json.dump(run, open(f"{folder}/run.json", "w"))
    val = lambda i, x: repr(x - 0.5) if i % val_every == 0 else ""
    rows = [f"{i},{x!r},{val(i, x)},0.001,{1000 + i % 3},{i / 10}" for i, x in enumerate(losses, start)]
    header = "iter,train_loss,val_loss,lr,tokens_per_s,elapsed_s"
    open(f"{folder}/log.csv", "w").write("\n".join([header, *rows, "7"]))  # 7: a row half-written, as it runs
    return str(folder)


_csv = lambda path: list(csv.reader(open(path, newline="")))
_lines = lambda ax: {line.get_label(): line.get_xydata().T.tolist() for line in ax.lines}  # label: [x, y]
_random = lambda seed, *ns: [[random.Random(seed + n).uniform(3, 6) for _ in range(n)] for n in ns]


@pytest.fixture
def figures(monkeypatch):
    """The figures plot.py and taps.py draw, titled and kept for the test instead of written."""
    drawn, keep = [], lambda fig, path, title=None: drawn.append(fig) or title and fig.suptitle(title)
    for module in (plot, taps):
        monkeypatch.setattr(module, "save", keep)
    yield drawn
    plot.plt.close("all")


@pytest.mark.slow
def test_plot_imports_without_torch():
    code = "import sys, plot; assert 'torch' not in sys.modules, 'plot.py imported torch'"
    assert subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "experiments")).returncode == 0


def test_plot_csvs_are_the_window_medians_of_the_logs_and_the_paths_paste_back(tmp_path, capsys, figures):
    (sa, she), out = _random(0, 2500, 2100), tmp_path / "my results"
    runs = [_run(tmp_path / "b", "she", she, 1, 500), _run(tmp_path / "a", "sa", sa, 32, 500)]  # named order
    seed = _run(tmp_path / "c", "she", she[:1200], 1, 500, 2)  # another seed, 1200 batches: seeds.csv
    argv = runs + ["--window", "400", "--results", str(out), "-o", str(out / "f 1.png"), "--seeds", seed]
    written = [str(out / f) for f in ("f 1.png", "medians.csv", "val_loss.csv", "summary.csv", "seeds.csv")]
    assert plot.main(argv) == 0 and shlex.split(capsys.readouterr().out) == ["wrote", *written]  # all of it
    med = lambda x, b: repr(median(x[b - 400 : b])) if b <= len(x) else ""  # she: 5 windows, sa-32: 6
    rows = [[str(b), med(sa, b), med(she, b)] for b in range(400, 2401, 400)]
    assert _csv(out / "medians.csv") == [["batches", "sa-32", "she"]] + rows
    v = lambda x, b: repr(x[b - 1] - 0.5) if b <= len(x) else ""
    assert _csv(out / "val_loss.csv")[1:] == [[str(b), v(sa, b), v(she, b)] for b in range(500, 3000, 500)]
    last = [repr(median(she[-n:])) for n in (1000, 2000)]  # tokens/s: 1001, 1002, 1000, 1001, ...
    assert _csv(out / "summary.csv")[2] == ["she", "2100", *last, v(she, 2000), "2000", "7", "", "1001"]
    at = lambda m, s, x: [m, s, "1", "1200", repr(median(x[200:1200])), v(x, 1000)]  # the shortest run's
    assert _csv(out / "seeds.csv")[1:] == [at("sa-32", "1", sa), at("she", "1", she), at("she", "2", she)]
    assert plot.main(argv + ["--batches", "1600"]) == 0  # the runs at one length
    assert _csv(out / "summary.csv")[2][1:3] == ["1600", repr(median(she[600:1600]))]


def test_plot_one_run_without_o_draws_its_chart_in_its_folder(tmp_path, capsys, monkeypatch):
    run, drawn, save = _run(tmp_path / "me", "me", [5 - i / 100 for i in range(90)], 1, 30), [], plot.save
    monkeypatch.setattr(plot, "save", lambda fig, path: drawn.append(_lines(fig.axes[0])) or save(fig, path))
    monkeypatch.chdir(tmp_path)
    assert plot.main([run]) == 0 and os.listdir(tmp_path) == ["me"]  # nothing in the working folder
    assert capsys.readouterr().out == f"wrote {run}/loss.png\n" and os.path.getsize(f"{run}/loss.png") > 1000
    assert [x for x, _ in drawn[0].values()] == [[*range(1, 91)], [*range(3, 91, 3)], [30, 60, 90]]
    assert "name it with -o" in error_line(capsys, plot.main, [run, _run(tmp_path / "he", "he", [5] * 90)])


def test_plot_gap_panel_subtracts_sa_32s_medians_and_raw_draws_batch_numbers(tmp_path, figures):
    logs = dict(zip(("sa-32", "me", "he"), _random(7, 12, 12, 8)))
    runs = [_run(tmp_path / n, n[:2], x, 32, 4, 1337, 1337) for n, x in logs.items()]
    assert plot.main(runs + ["--window", "4", "-o", str(tmp_path / "f.png")]) == 0
    assert figures[0]._suptitle.get_text() == "m = 2, l = 32, 8, 12 batches, seed 1337"
    med = lambda n: [median(logs[n][i : i + 4]) for i in range(0, len(logs[n]), 4)]
    gaps = {n: [[4, 8, 12][: len(logs[n]) // 4], [a - b for a, b in zip(med(n), med("sa-32"))]] for n in logs}
    assert _lines(figures[0].axes[1]) == gaps | {"sa-32": [[0, 1], [0, 0]]}  # the windows both runs have
    resumed = _run(tmp_path / "resumed", "me", logs["me"], start=31)  # a log of batches 31-42
    assert plot.main([resumed, runs[2], "--raw", "-o", str(tmp_path / "f.png")]) == 0
    raw = {"he": [[*range(1, 9)], logs["he"]], "me": [[*range(31, 43)], logs["me"]]}  # every batch
    assert _lines(figures[1].axes[0]) == raw


def test_plot_sweep_csv_is_named_after_the_figure_and_keeps_earlier_points(tmp_path, capsys, figures):
    res, keys = tmp_path / "res", [(m, l) for m in ("she", "he") for l in (64, 128)]  # in the paper's order
    logs = dict(zip(keys, _random(3, *[2500] * 4)))
    runs = {(m, l): _run(tmp_path / f"{m}{l}", m, logs[m, l], block_size=l) for m, l in keys}
    argv = ["--sweep", "block_size", "--results", str(res), "-o", str(res / "fig10.png")]
    assert plot.main([runs[k] for k in keys[:0:-1]] + argv) == 0  # she at 128, he at 128 and 64
    point = lambda k: [k[0], str(k[1]), "2500", repr(median(logs[k][-2000:])), repr(logs[k][-1] - 0.5)]
    rows = [["mixer", "l", "batches", "median_last_2000", "val_loss"], *map(point, keys[1:])]
    assert os.listdir(res) == ["fig10.csv"] and _csv(res / "fig10.csv") == rows
    assert _lines(figures[0].axes[0])["he"] == [[64, 128], [float(p[3]) for p in rows[2:]]]  # the paper's
    assert _lines(figures[0].axes[1])["she"] == [[128], [float(rows[1][4])]]  # the validation loss beside
    os.rename(res / "fig10.csv", tmp_path / "earlier.csv")  # she 128, he 128 stay; a new run replaces he 64
    new = _run(tmp_path / "new", "he", [4.0] * 2500, block_size=64)
    assert plot.main([runs[keys[0]], new, str(tmp_path / "earlier.csv")] + argv) == 0
    he64 = ["he", "64", "2500", "4.0", "3.5"]  # the new run's point
    assert _csv(res / "fig10.csv") == [rows[0], point(keys[0]), rows[1], he64, rows[3]]
    short = [runs[keys[2]], _run(tmp_path / "s", "me", [4] * 2400)]
    assert "have 2400 to 2500 batches" in error_line(capsys, plot.main, short + argv)
    assert "both he at l = 64;" in error_line(capsys, plot.main, [runs[keys[2]], new] + argv)
    heads = [_run(tmp_path / f"{m}{n}", m, [4] * 30, n_head=n) for m, n in (("sa", 1), ("sa", 8), ("he", 1))]
    assert "one mixer" in error_line(capsys, plot.main, heads + ["--sweep", "n_head"] + argv[-2:])


def test_plot_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    run, out = _run(tmp_path / "run", "me", [5.0] * 10), ["-o", str(tmp_path / "f.png")]
    shas = [_run(tmp_path / c, "me", [5.0] * 10, data={"train_sha256": c * 64}) for c in "ab"]
    cases = {
        "nope/run.json: No such file or directory": [str(tmp_path / "nope")],
        f"{run} and {run}/ are one run folder; pass each run once": [run, run + "/"],
        "has 10 batches, fewer than a window of 50; pass --window 10 or drop it": [run, "--window", "50"],
        f"{run} has 10 batches, fewer than a window of 34": [run, _run(tmp_path / "long", "he", [4] * 1020)],
        "no number 'colour' in its run.json; sweep one of block_size, data_seed,": [run, "--sweep", "colour"],
        "--window and --batches must be at least 1": [run, "--window", "0"],
        "must be mixer,l,batches,median_last_10,val_loss": [run, run + "/log.csv", "--sweep", "block_size"],
        "cannot write a .xyz image": [run, "-o", str(tmp_path / "f.xyz")],
        f"cannot write {tmp_path}: Is a directory": [run, "-o", str(tmp_path)],
        "(vocabulary 50; vocabulary 60)": [run, _run(tmp_path / "other", "he", [5.0] * 10, vocab_size=60)],
        "(vocabulary 50, train.bin aaaaaaaaaaaa; vocabulary 50, train.bin bbbbbbbbbbbb)": shas,
    }
    for err, argv in cases.items():
        assert err in error_line(capsys, plot.main, out + argv), argv
    log = gzip.compress(open(f"{run}/log.csv", "rb").read())
    os.remove(f"{run}/log.csv")
    for garbage in (log[:60], b"\x00" * 99, gzip.compress(b"\xff" * 9), gzip.compress(b"a\n")):
        open(f"{run}/log.csv.gz", "wb").write(garbage)  # cut, not gzip, gzip of bytes, gzip of text
        assert error_line(capsys, plot.main, [run] + out).startswith(f"error: {run}/log.csv.gz ")
    for damaged, why in (('{"config": {"mixer"', "JSONDecodeError"), ("{}", "KeyError")):
        open(f"{run}/run.json", "w").write(damaged)
        assert f"{run}/run.json is damaged ({why}" in error_line(capsys, plot.main, [run] + out)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "long", "other", "run"]


def test_taps_tap_profile_is_each_taps_norm_per_layer():
    c = torch.tensor([0.5, -0.25, 0.0, 2.0])  # a tap per distance back k = 1..4; d = 4
    norms = {"me": (c, 1.0), "we": (c[:, None] * torch.ones(4), 2.0), "he": (c[:, None] * torch.ones(4), 2.0)}
    norms["she"] = (c[:, None, None] * torch.eye(4), 2.0)  # ||c I||_F = ||c (1, 1, 1, 1)||_2 = 2|c|
    for mixer, (w, norm) in norms.items():
        model = tiny_model(mixer, l=4, d=4, n_head=1, vocab=16)
        with torch.no_grad():
            for i, layer in enumerate(model.layers):  # layer 2's taps are twice layer 1's
                (layer.mixer.W_ext if mixer == "she" else layer.mixer.w_ext).copy_(w * (i + 1))
        profile = {k: v.tolist() for k, v in taps.tap_profile(model).items()}
        assert profile == {n: [norm * n * abs(v) for v in c.tolist()] for n in (1, 2)}, mixer


def test_taps_attention_weights_give_the_mixers_output_and_their_mean_by_distance_by_hand():
    model = tiny_model("sa", l=5, d=8, n_head=2, vocab=16).double()
    for layer in model.layers:
        torch.nn.init.normal_(layer.mixer.W_QKV.weight)  # far from uniform attention
    x, mixer = torch.randn(3, 5, 8, dtype=torch.float64), model.layers[0].mixer
    a = taps.attention_weights(mixer, x)  # (3, 2, 5, 5); a wrong scale or head split gives another output
    v = mixer.W_QKV(x)[..., 16:].view(3, 5, 2, 4).transpose(1, 2)  # (B, n, t, h)
    assert torch.allclose(mixer.W_out_att((a @ v).transpose(1, 2).reshape(3, 5, 8)), mixer(x), rtol=1e-12)
    windows = torch.randint(0, 16, (40, 5))  # two chunks of 32 and 8
    profile = taps.tap_profile(model, windows)
    with torch.no_grad():
        h = (model.emb_tok(windows) + model.emb_pos(torch.arange(5))) * 8**0.5  # no dropout in eval
        for i, layer in enumerate(model.layers, 1):
            a = taps.attention_weights(layer.mixer, layer.ln1(h))  # (40, 2, 5, 5)
            mean = lambda k: np.mean([a[:, :, j + k, j] for j in range(5 - k)])  # over windows, heads, i
            np.testing.assert_allclose(profile[i], [mean(k) for k in range(5)], rtol=1e-12)
            h = layer(h)
        model.layers[0].mixer.W_QKV.weight.zero_()  # q = k = 0: row i weighs each j <= i by 1 / (i + 1)
    uniform = [sum(1 / i for i in range(k, 6)) / (6 - k) for k in range(1, 6)]  # (1 + ... + 1/5) / 5, ...
    np.testing.assert_allclose(taps.tap_profile(model, windows)[1], uniform, rtol=1e-12)
    np.testing.assert_allclose(taps.uniform_by_distance(5), uniform, rtol=1e-15)


def test_taps_draws_a_panel_per_run_from_its_ckpt_on_its_own_val_bin(tmp_path, capsys, figures):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")  # starts 0, 47.5 -> 48, 95 = 100 - 4 - 1
    assert taps.val_windows(str(tmp_path), 4, n=3).tolist() == [[*range(s, s + 4)] for s in (0, 48, 95)]
    sha, models = hashlib.sha256((tmp_path / "val.bin").read_bytes()).hexdigest(), {}
    moved = {"iter": 10, "args": {"data_dir": str(tmp_path / "gone")}}  # their data has moved since
    for mixer in ("me", "sa"):
        models[mixer] = model = tiny_model(mixer, l=4, d=8, n_head=2, vocab=100)
        ckpt = {"model": model.state_dict(), "config": vars(model.cfg), "data": {"val_sha256": sha}}
        os.makedirs(tmp_path / mixer)
        torch.save(ckpt | moved, tmp_path / mixer / "ckpt.pt")
    argv = [str(tmp_path / "me"), str(tmp_path / "sa"), "-o", str(tmp_path / "taps.png")]
    assert f"{tmp_path}/gone/val.bin not found; pass --data_dir" in error_line(capsys, taps.main, argv)
    np.arange(1, 101, dtype=np.uint16).tofile(tmp_path / "me" / "val.bin")  # another val.bin
    err = error_line(capsys, taps.main, argv + ["--data_dir", str(tmp_path / "me")])
    assert err.endswith("me/val.bin is not the run's val.bin (sha256 differs); pass its --data_dir")
    assert taps.main(argv + ["--data_dir", str(tmp_path)]) == 0
    panels = [ax for ax in figures[0].axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["sa-2, batch 10", "me, batch 10"]  # in the paper's order
    windows = torch.from_numpy(taps.val_windows(str(tmp_path), 4))
    for ax, p in zip(panels, (taps.tap_profile(models["sa"], windows), taps.tap_profile(models["me"]))):
        assert [_lines(ax)[f"layer {n}"] for n in (1, 2)] == [[[1, 2, 3, 4], q.tolist()] for q in p.values()]
    assert taps.main([str(tmp_path / "me")]) == 0 and capsys.readouterr().out.endswith("/me/taps.png\n")


# ---- results/: every committed CSV is what plot.py makes of the committed logs (where they are committed)
def test_results_csvs_are_what_plot_makes_of_the_committed_logs(tmp_path, figures):
    results = os.path.join(ROOT, "results")

    def redraw(out, figure, *argv):  # an argument with a / is a path under results/
        argv = [os.path.join(results, a) if "/" in a else a for a in argv]
        assert plot.main(argv + ["--results", str(out), "-o", str(out / figure)]) == 0
        return out

    logs = lambda group: glob.glob(f"logs/{group}/*", root_dir=results)
    redraw(tmp_path, "fig7_heads.png", *logs("fig7"), "--sweep", "n_head", "--batches", "10000")
    redraw(tmp_path / "table1", "f.png", *logs("table1"), "--window", "2000")
    seeds = ["--seeds", "30000/seeds.csv", "logs/fig7/sa-32", "--batches", "10000", "--window", "500"]
    redraw(tmp_path / "data-order", "f.png", *logs("data-order"), *seeds)
    for name, key in (("fig10_l_sweep", "block_size"), ("fig11_m_sweep", "n_layer")):  # earlier runs' points
        redraw(tmp_path, f"{name}.png", f"./{name}.csv", "--sweep", key)
    csvs = [f"{d}/{f}.csv" for d in ("table1", "data-order") for f in ("medians", "val_loss", "summary")]
    for name in ["fig7_heads.csv", "fig10_l_sweep.csv", "fig11_m_sweep.csv", "data-order/seeds.csv", *csvs]:
        assert (tmp_path / name).read_text() == open(os.path.join(results, name)).read(), name
    out = redraw(tmp_path / "30000", "f.png", "logs/fig7/sa-1", "logs/fig7/sa-32", "--window", "500")
    committed = lambda name: _csv(os.path.join(results, "30000", name))  # its logs are gone but these two
    for name in ("medians.csv", "val_loss.csv"):  # the seed-1337 runs of sa-1 and sa-32, to batch 10000
        assert [row[:3] for row in committed(name)[:21]] == _csv(out / name)
    for run, n, m, _, val, *_ in _csv(out / "summary.csv")[1:]:
        assert [run, "1337", "1337", n, m, val] in committed("seeds.csv")
