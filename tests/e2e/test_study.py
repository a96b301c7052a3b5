"""Bench, study and report: the figures' math, a real two-cell bench, a report from real runs."""

import json
import math
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.perfmodel import scaling
from scaletrain.perfmodel.predict import predict
from scaletrain.perfmodel.profile import Profile, dump_profile, load_profile
from scaletrain.study import figures
from scaletrain.errors import GridError
from scaletrain.study.grid import cells, parse_grid
from scaletrain.cli import main
from scaletrain.study.learning import UntilError, parse_until

import user_models
from conftest import RECIPES, ROOT

DIGITS = str(RECIPES / "digits.toml")


def row(strategy, nodes, total, ips, se, ps=0, placement="alongside", gpus=1, **cell):
    return {"strategy": strategy, "nodes": nodes, "nodes_total": total, "num_ps": ps, "ps_placement": placement,
            "gpus_per_node": gpus, "images_per_sec": ips, "images_per_sec_stderr": se, "data": "real",
            "cell": {"cluster.nodes": str(nodes), "cluster.num_ps": str(ps), **cell}}


def test_speedup_and_efficiency_follow_the_study():
    # The study's 4-worker figures (REFERENCE.md), against 1 node with no distribution;
    # efficiency counts dedicated PS nodes.
    rows = scaling.add_scaling([
        row("allreduce", 1, 1, 124.18, 1.0),
        row("mixed-async", 4, 7, 396.62, 2.0, ps=3, placement="dedicated"),
        row("mixed-async", 4, 4, 374.73, 2.0, ps=3),
        row("mixed-async", 4, 4, 292.22, 0.0, ps=1),
    ])
    assert [round(r["speedup"], 2) for r in rows] == [1.00, 3.19, 3.02, 2.35]
    assert [round(r["efficiency"], 2) for r in rows] == [1.00, 0.46, 0.75, 0.59]
    assert rows[0]["speedup_stderr"] == 0.0
    # Relative errors add in quadrature.
    s = 396.62 / 124.18
    assert rows[1]["speedup_stderr"] == pytest.approx(s * math.hypot(2.0 / 396.62, 1.0 / 124.18))
    assert rows[3]["speedup_stderr"] == pytest.approx(292.22 / 124.18 * math.hypot(0.0, 1.0 / 124.18))
    assert scaling.setup(rows[1]) == "mixed-async, 7 nodes (4 workers + 3 dedicated PS)"
    assert scaling.setup(rows[3]) == "mixed-async, 4 nodes (4 workers + 1 PS alongside)"
    # The second figure: against mixed-async's smallest configuration (4 nodes used, the first of them).
    assert [r["own_baseline"] for r in rows[1:]] == ["mixed-async, 4 nodes (4 workers + 3 PS alongside)"] * 3
    assert rows[1]["speedup_own"] == pytest.approx(396.62 / 374.73) and rows[2]["speedup_own"] == 1.0
    table = figures.scaling_table(rows).splitlines()
    assert table[0] == "| Setup | Throughput (img/s) | Speedup | Efficiency | Speedup vs own smallest | Flag |"
    assert table[2] == ("| allreduce, 1 node (1 worker) (baseline) | 124.2 ± 1.0 | 1.00 ± 0.00 | 1.00 | "
                        "1.00 ± 0.00 |  |")
    assert table[3] == ("| mixed-async, 7 nodes (4 workers + 3 dedicated PS) | 396.6 ± 2.0 | 3.19 ± 0.03 | 0.46 | "
                        "1.06 ± 0.01 |  |")


def test_baseline_is_one_allreduce_node_with_the_other_keys_the_same():
    b64 = {"data.batch_size": "64"}
    rows = scaling.add_scaling([
        row("allreduce", 1, 1, 100.0, 0.0, **{"data.batch_size": "32"}),
        row("allreduce", 1, 1, 150.0, 0.0, **b64),
        row("sync", 1, 1, 120.0, 0.0, ps=1, **b64),
        row("sync", 2, 2, 240.0, 0.0, ps=1, **b64),
        row("mixed-async", 2, 3, 270.0, 0.0, ps=1, placement="dedicated", **b64),
        row("allreduce", 2, 2, 500.0, 0.0, **{"data.batch_size": "128"}),
        row("allreduce", 1, 1, 90.0, 0.0, gpus=2, **b64),
        row("sync", 2, 2, 144.0, 0.0, ps=1, gpus=2, **b64),
    ])
    sync1, sync2, mixed, lone, two_gpus = rows[2], rows[3], rows[4], rows[5], rows[7]
    # A PS strategy on one node is not its own baseline: its PS's cost shows.
    assert sync1["speedup"] == pytest.approx(0.8) and sync1["efficiency"] == pytest.approx(0.8)
    assert sync1["baseline"] == "allreduce, 1 node (1 worker), data.batch_size=64"
    assert sync2["speedup"] == pytest.approx(1.6) and sync2["efficiency"] == pytest.approx(0.8)
    assert sync2["speedup_own"] == pytest.approx(2.0) and sync2["own_baseline"] == scaling.setup(sync1)
    assert mixed["speedup"] == pytest.approx(1.8) and mixed["efficiency"] == pytest.approx(0.6)
    assert two_gpus["speedup"] == pytest.approx(1.6)  # against the node of 2 replicas, not of 1
    assert lone["speedup"] is None and lone["efficiency"] is None and lone["baseline"] is None
    assert lone["speedup_own"] == 1.0  # its own smallest is itself
    table = figures.scaling_table(rows)
    assert "| allreduce, 1 node (1 worker), data.batch_size=64 (baseline) |" in table
    assert "| sync, 1 node (1 worker + 1 PS alongside), data.batch_size=64 | 120.0 ± 0.0 | 0.80 ± 0.00 |" in table


def test_bench_adds_the_baseline_cells_the_grid_lacks():
    from scaletrain.study.bench import baseline_cells

    sync = [({"strategy.name": "sync", "cluster.num_ps": "1", "cluster.nodes": n, "optim.lr": lr}, "real")
            for lr in ("0.1", "0.2") for n in ("1", "2")]
    extra = baseline_cells(DIGITS, [], sync)  # once per learning rate, settings of scaling.BASELINE
    assert extra == [({"optim.lr": lr, "strategy.name": "allreduce", "cluster.nodes": "1", "cluster.num_ps": "0",
                       "strategy.backup_workers": "0", "strategy.slow_node": "-1"}, "real") for lr in ("0.1", "0.2")]
    with_it = [({"strategy.name": "allreduce", "cluster.num_ps": "0", "cluster.nodes": "1", "optim.lr": "0.1"},
                "real"), *sync]
    assert [c["optim.lr"] for c, _ in baseline_cells(DIGITS, [], with_it)] == ["0.2"]
    # the recipe's own settings count: sync set with --set, the grid over nodes only
    assert len(baseline_cells(DIGITS, ["strategy.name=sync", "cluster.num_ps=1"], [({"cluster.nodes": "2"}, "real")])) == 1
    assert baseline_cells(DIGITS, [], [({"cluster.nodes": "1"}, "real"), ({"cluster.nodes": "2"}, "real")]) == []


def test_grid_and_until_parsing():
    grid = parse_grid(["cluster.nodes=1,2", "strategy.name+cluster.num_ps=allreduce:0,sync:1"])
    assert cells(grid) == [
        {"cluster.nodes": "1", "strategy.name": "allreduce", "cluster.num_ps": "0"},
        {"cluster.nodes": "1", "strategy.name": "sync", "cluster.num_ps": "1"},
        {"cluster.nodes": "2", "strategy.name": "allreduce", "cluster.num_ps": "0"},
        {"cluster.nodes": "2", "strategy.name": "sync", "cluster.num_ps": "1"},
    ]
    for bad in ("cluster.nodes", "cluster.nodes=", "a+b=1:2,3"):
        with pytest.raises(GridError):
            parse_grid([bad])
    assert parse_until("accuracy=0.9") == ("accuracy", 0.9)
    with pytest.raises(UntilError):
        parse_until("speed=3")



@pytest.mark.parametrize("command, grid, says", [
    ("study", "cluster.nodes=1,x", "--grid cluster.nodes=x: cluster.nodes = 'x': expected int"),
    ("bench", "foo.bar=1,2", "--grid foo.bar=1: "),
    ("bench", "cluster.nodes=1,,2", "--grid 'cluster.nodes=1,,2': an empty value"),
    ("bench", "cluster.num_ps=0,1", "--grid cluster.num_ps=1: cluster.num_ps = 1: this strategy uses no parameter"),
])
def test_a_bad_grid_value_fails_before_any_cell_runs(tmp_path, capsys, command, grid, says):
    out = tmp_path / "sweep"
    assert main([command, "--recipe", DIGITS, "--set", "data.workers=0", "--set", "train.steps=2",
                 "--grid", grid, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"scaletrain: error: {says}") and err.count("\n") == 1, err
    assert not (out / "cells").exists() and not list(out.glob("*.jsonl"))


def test_check_cells_names_the_first_cell_whose_relations_fail():
    from scaletrain.study.grid import check_cells

    backup = ["strategy.name=backup", "cluster.num_ps=1", "strategy.backup_workers=1"]
    check_cells(DIGITS, backup, [({"cluster.nodes": "2"}, [])])
    with pytest.raises(GridError, match=r"^--grid cluster.nodes=1: strategy.backup_workers = 1: must be below"):
        check_cells(DIGITS, backup, [({"cluster.nodes": "2"}, []), ({"cluster.nodes": "1"}, [])])


@pytest.mark.parametrize("command", ["bench", "study", "predict"])
def test_several_grid_entries_after_one_flag(command):
    from scaletrain.cli_args import parser

    need = ["--recipe", DIGITS] + (["--profile", "p.toml"] if command == "predict" else [])
    one = parser().parse_args([command, *need, "--grid", "cluster.nodes=1,2", "strategy.name+cluster.num_ps=a:0,b:1",
                               "--set", "data.workers=0"])
    two = parser().parse_args([command, *need, "--grid", "cluster.nodes=1,2",
                               "--grid", "strategy.name+cluster.num_ps=a:0,b:1", "--set", "data.workers=0"])
    assert one.grid == two.grid == ["cluster.nodes=1,2", "strategy.name+cluster.num_ps=a:0,b:1"]
    assert one.overrides == ["data.workers=0"]  # the next flag ends the list


def test_predict_grid_in_one_flag_predicts_every_cell(capsys):
    common = ["predict", "--profile", str(RECIPES.parent / "profiles/study-k80.toml"),
              "--recipe", str(RECIPES / "anp-resnet50.toml"), "--format", "json"]
    assert main([*common, "--grid", "cluster.nodes=1,2", "strategy.name+cluster.num_ps=allreduce:0,sync:1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*common, "--grid", "cluster.nodes=1,2", "--grid", "strategy.name+cluster.num_ps=allreduce:0,sync:1"]) == 0
    assert one == json.loads(capsys.readouterr().out)
    assert [(r["nodes"], r["strategy"]) for r in one] == [(1, "allreduce"), (1, "sync"), (2, "allreduce"), (2, "sync")]


def test_bench_plots_are_one_panel_per_strategy_on_shared_axes(tmp_path, monkeypatch):
    from scaletrain.study import plots

    figs = {}
    real_save = plots._save

    def keep(fig, out, name, made, title):
        real_save(fig, out, name, made, title)
        figs[name] = fig

    monkeypatch.setattr(plots, "_save", keep)
    # the later panels reach higher than the first: the shared y axis must show all of them
    gain = {"allreduce": 1.0, "sync": 1.2, "mixed-async": 1.4}
    rows = scaling.add_scaling([row(s, n, n, gain[s] * 100.0 * n ** 0.5, 1.0, ps=0 if s == "allreduce" else 1, gpus=2)
                                for n in (1, 2, 4) for s in ("allreduce", "sync", "mixed-async")])
    made = []
    plots.bench_plots(rows, tmp_path, made)
    assert [name for name, _ in made] == ["speedup.png", "throughput.png"]
    for name, fig in figs.items():
        axes = fig.axes
        assert [ax.get_title().splitlines()[0] for ax in axes] == ["allreduce", "sync", "mixed-async"]
        assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes[1:])
        (legend,) = fig.legends  # one legend for the figure, listing each entry once
        assert len(legend.get_texts()) <= 2
        assert (tmp_path / name).stat().st_size > 1000
    speedup = figs["speedup.png"].axes
    assert all("ideal" in [line.get_label() for line in ax.get_lines()] for ax in speedup)
    # the PS panels draw the baseline (the 1-node all-reduce row) as a reference line
    thr = figs["throughput.png"].axes
    assert [any(line.get_label() == "1 node, no distribution" for line in ax.get_lines()) for ax in thr] == \
        [False, True, True]
    assert thr[0].get_ylim()[0] == 0 and thr[0].get_ylim()[1] >= max(r["images_per_sec"] for r in rows)


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.images, self.cells = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        if self.tags and self.tags[-1] in ("td", "th"):
            self.cells.append(data)


def check_report(html_path: Path) -> Page:
    page = Page()
    page.feed(html_path.read_text())
    page.close()
    assert page.images and all(src.startswith("data:image/png;base64,") for src in page.images)
    md = (html_path.parent / "report.md").read_text()
    refs = [line[line.index("](") + 2:-1] for line in md.splitlines() if line.startswith("![")]
    assert refs and all((html_path.parent / r).stat().st_size > 1000 for r in refs)
    assert len(refs) == len(page.images)
    return page


def test_two_cell_bench_end_to_end(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--recipe", DIGITS, "--set", "data.workers=0", "--grid", "cluster.nodes=1,2",
                 "--warmup", "3", "--steps", "16", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["nodes"] for r in rows] == [1, 2] and all(r["images_per_sec"] > 0 for r in rows)
    assert all(r["config"]["train.steps"] == 19 and r["git_commit"] and r["torch_version"] for r in rows)
    assert rows[1]["timed_windows"] >= 2 and rows[1]["images_per_sec_stderr"] >= 0
    assert not any("images_per_sec_runs" in r or "run_dirs" in r for r in rows)  # one run: as ever
    scaled = json.loads((out / "bench-rows.json").read_text())
    assert scaled[1]["speedup"] == pytest.approx(rows[1]["images_per_sec"] / rows[0]["images_per_sec"])
    assert scaled[1]["efficiency"] == pytest.approx(scaled[1]["speedup"] / 2)
    assert all("flag" in r and 0 < r["slowest_window_fraction"] <= 1 for r in scaled)  # judged, with its windows
    page = check_report(out / "report" / "report.html")
    assert "allreduce, 2 nodes (2 workers)" in page.cells

    # A study on this bench's clock: each cell's images over the images/s the bench measured for it.
    study = tmp_path / "study"
    sets = ["--set", "data.workers=0", "--set", "train.steps=6", "--set", "train.eval_every=6"]
    assert main(["study", "--recipe", DIGITS, *sets, "--grid", "cluster.nodes=1,2", "--bench", str(out),
                 "--out", str(study)]) == 0
    timed = json.loads((study / "study-rows.json").read_text())
    for r, b in zip(timed, rows):
        assert r["clock"] == f"bench {out} (measured)" and r["clock_images_per_sec"] == b["images_per_sec"]
        assert r["clock_seconds"] == pytest.approx(r["images_applied"] / b["images_per_sec"])
    assert timed[1]["improvement"] == pytest.approx(timed[0]["clock_seconds"] / timed[1]["clock_seconds"])
    assert main(["study", "--recipe", DIGITS, *sets, "--grid", "cluster.nodes=4", "--bench", str(out),
                 "--out", str(tmp_path / "no")]) == 2  # no row of 4 nodes: refused before any run
    assert not (tmp_path / "no").exists()


def test_bench_runs_the_missing_baseline_first(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--recipe", DIGITS, "--set", "data.workers=0", "--grid", "strategy.name+cluster.num_ps=sync:1",
                 "--warmup", "2", "--steps", "8", "--out", str(out)]) == 0
    base, sync = json.loads((out / "bench-rows.json").read_text())
    assert base["added_baseline"] and "added_baseline" not in sync
    assert (base["strategy"], base["nodes"], base["num_ps"], base["config"]["cluster.num_ps"]) == ("allreduce", 1, 0, 0)
    assert sync["strategy"] == "sync" and sync["nodes_total"] == 1
    assert sync["speedup"] == pytest.approx(sync["images_per_sec"] / base["images_per_sec"])
    assert sync["baseline"] == "allreduce, 1 node (1 worker)" and sync["speedup_own"] == 1.0
    table = (out / "bench.md").read_text()
    assert "| allreduce, 1 node (1 worker) (baseline, not in the grid) |" in table


def test_bench_repeats_report_the_spread_across_runs(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["bench", "--recipe", DIGITS, "--set", "data.workers=0", "--grid", "optim.lr=0.05,0.1",
                 "--warmup", "2", "--steps", "8", "--repeats", "3", "--out", str(out)]) == 0
    r, other = json.loads((out / "bench-rows.json").read_text())
    order = sorted(r["run_dirs"] + other["run_dirs"], key=lambda d: (out / d / "summary.json").stat().st_mtime_ns)
    assert order == [d for j in range(3) for d in (r["run_dirs"][j], other["run_dirs"][j])]  # pass after pass
    runs = [json.loads((out / d / "summary.json").read_text()) for d in r["run_dirs"]]
    assert len({*r["run_dirs"]}) == 3 and r["run_dir"] == r["run_dirs"][0]
    assert r["images_per_sec_runs"] == [s["images_per_sec"] for s in runs]
    assert r["images_per_sec"] == pytest.approx(sum(r["images_per_sec_runs"]) / 3)
    ips = r["images_per_sec_runs"]
    mean = sum(ips) / 3
    assert r["images_per_sec_run_stderr"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in ips) / 2 / 3))
    assert r["images_per_sec_stderr"] == pytest.approx(math.sqrt(sum(s["images_per_sec_stderr"] ** 2 for s in runs)) / 3)
    line = (out / "bench.md").read_text().splitlines()[2]
    assert f"{r['images_per_sec']:.1f} ± {r['images_per_sec_stderr']:.1f} (3 runs: ± {r['images_per_sec_run_stderr']:.1f})" in line
    assert main(["bench", "--recipe", DIGITS, "--repeats", "0", "--out", str(tmp_path / "no")]) == 2
    assert "repeats >= 1" in capsys.readouterr().err


def test_report_from_run_dirs(tmp_path, capsys):
    runs = []
    for name, sets in (("single", []), ("mixed", ["cluster.nodes=2", "cluster.num_ps=1", "strategy.name=mixed-async"]),
                       ("untimed", ["train.steps=2", "train.warmup_log_steps=2"])):  # no window past the warm-up
        runs.append(tmp_path / name)
        assert main(["train", "--recipe", DIGITS, "--run-dir", str(runs[-1]), "--quiet",
                     *sum((["--set", s] for s in ["data.workers=0", "train.steps=30", "train.eval_every=10",
                                                  "train.log_every=5", *sets]), [])]) == 0
    assert "img/s not measured" in capsys.readouterr().out
    untimed = json.loads((runs[-1] / "summary.json").read_text())
    assert untimed["images_per_sec"] is None and untimed["timed_windows"] == 0  # null, not 0.0
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "rep")]) == 0
    page = check_report(tmp_path / "rep" / "report.html")
    assert "single" in page.cells and "mixed" in page.cells
    assert page.cells[page.cells.index("untimed") + 4] == "not measured"
    names = {p.name for p in (tmp_path / "rep").glob("*.png")}
    assert {"runs-loss-time.png", "runs-loss-steps.png", "runs-accuracy-time.png", "staleness.png"} <= names
    assert main(["report", str(tmp_path / "nothing-here")]) == 2
    assert "neither a bench, a study nor a run directory" in capsys.readouterr().err


# --- staleness emulation ----------------------------------------------------------------------------

EMU = ["model.norm=group", "optim.schedule=constant", "optim.warmup_steps=0", "data.augment=none",
       "train.deterministic=true", "train.steps=40", "data.workers=0", "train.eval_every=20", "train.log_every=10"]


def train_run(tmp_path, name, *sets, resume=False):
    from safetensors.torch import load_file

    run_dir = tmp_path / name
    assert main(["train", "--recipe", DIGITS, "--run-dir", str(run_dir), "--quiet", *(["--resume"] if resume else []),
                 *sum((["--set", s] for s in sets), [])]) == 0
    return json.loads((run_dir / "summary.json").read_text()), load_file(str(run_dir / "model.safetensors"))


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_emulated_workers_staleness_is_k_minus_1(tmp_path):
    s, _ = train_run(tmp_path, "k8", *EMU, "strategy.emulate_workers=8")
    # The first 7 gradients have no older version to be computed on; every later one is 7 updates stale.
    assert s["staleness_hist"][:9] == [1, 1, 1, 1, 1, 1, 1, 33, 0]
    assert s["emulated_workers"] == 8 and s["staleness_max"] == 7
    assert s["staleness_mean"] == pytest.approx((sum(range(7)) + 33 * 7) / 40)


def test_one_emulated_worker_is_plain_training_exactly(tmp_path):
    _, plain = train_run(tmp_path, "plain", *EMU)
    s, one = train_run(tmp_path, "k1", *EMU, "strategy.emulate_workers=1")
    assert max_diff(plain, one) == 0.0 and s["staleness_max"] == 0
    _, four = train_run(tmp_path, "k4", *EMU, "strategy.emulate_workers=4")
    assert max_diff(plain, four) > 1e-3  # and staleness changes the result


def test_emulated_run_resumes_exactly(tmp_path):
    _, straight = train_run(tmp_path, "straight", *EMU, "strategy.emulate_workers=4")
    train_run(tmp_path, "split", *EMU, "strategy.emulate_workers=4", "train.steps=20")
    s, resumed = train_run(tmp_path, "split", *EMU, "strategy.emulate_workers=4", resume=True)
    assert s["start_step"] == 20 and max_diff(straight, resumed) == 0.0


def test_emulated_async_allreduce_is_k_gradients_one_update_stale(tmp_path):
    """K = 4 replicas whose rounds take a step: each update the mean of 4 batches' gradients on the
    values one update back, i.e. 2 asynchronous workers at 4 times the batch; and it resumes exactly
    from a checkpoint taken in the middle of an update."""
    rounds = [*EMU, "strategy.name=async-allreduce", "strategy.emulate_workers=4", "data.batch_size=8"]
    s, emulated = train_run(tmp_path, "rounds", *rounds)
    _, two = train_run(tmp_path, "two", *EMU, "strategy.emulate_workers=2", "data.batch_size=32", "train.steps=10")
    # the same up to the order of float sums (4 batch means averaged against one mean of 32), over 10 updates
    assert max_diff(emulated, two) <= 1e-4
    _, fresh = train_run(tmp_path, "fresh", *EMU, "data.batch_size=32", "train.steps=10")
    assert max_diff(emulated, fresh) > 1e-2  # and not plain training at 4 times the batch: the update is stale
    assert s["staleness_hist"][:3] == [4, 36, 0] and s["gradients_per_update_mean"] == 4.0
    train_run(tmp_path, "split", *rounds, "train.steps=22")
    _, resumed = train_run(tmp_path, "split", *rounds, resume=True)
    assert max_diff(emulated, resumed) == 0.0


def test_emulation_is_single_process_only(capsys):
    assert main(["train", "--recipe", DIGITS, "--set", "strategy.emulate_workers=4", "--set", "cluster.nodes=2"]) == 2
    assert "runs in one process" in capsys.readouterr().err


def test_bench_pairs_synthetic_data(tmp_path):
    out = tmp_path / "pair"
    assert main(["bench", "--recipe", DIGITS, "--set", "data.workers=0", "--grid", "optim.name=sgd",
                 "--warmup", "2", "--steps", "8", "--out", str(out), "--pair-synthetic"]) == 0
    rows = json.loads((out / "bench-rows.json").read_text())
    assert [r["data"] for r in rows] == ["real", "synthetic"]
    assert rows[0]["config"]["data.name"] == "digits" and rows[1]["config"]["data.name"] == "synthetic"
    assert rows[1]["speedup"] == 1.0  # each data kind is its own baseline


def test_study_end_to_end(tmp_path):
    """--until accuracy=A stops each run at its first evaluation that reaches A, every process
    of it at the same point (mixed-async: the nodes progress at their own pace)."""
    out = tmp_path / "study"
    assert main(["study", "--recipe", DIGITS, "--set", "data.workers=0", "--set", "train.steps=100",
                 "--set", "train.eval_every=10", "--set", "train.log_every=10", "--set", "cluster.nodes=2",
                 "--set", "cluster.num_ps=1", "--set", "strategy.name=mixed-async", "--set", "optim.warmup_steps=0",
                 "--grid", "optim.lr=0.001,0.1", "--until", "accuracy=0.35", "--out", str(out)]) == 0
    rows = json.loads((out / "study-rows.json").read_text())
    slow, fast = rows
    assert fast["time_to_target"] is not None and fast["best_test_accuracy"] >= 0.35
    assert fast["steps"] < 100 and fast["steps"] % 10 == 0 and fast["test_accuracy"] >= 0.35  # stopped early
    assert fast["images_to_target"] == fast["steps"] * 2 * 32
    cell = json.loads((out / fast["run_dir"] / "summary.json").read_text())
    assert {w["stopped_at_images"] for w in cell["per_worker"]} == {fast["images_to_target"]}
    assert 0 < fast["time_to_target"] <= fast["train_seconds"] <= fast["wall_seconds"]
    # The baseline (the first cell of the fewest replicas, lr 0.001) never reaches 0.35 in 100 steps:
    # it runs its whole length and no improvement is claimed for anyone.
    assert slow["best_test_accuracy"] < 0.35 and slow["time_to_target"] is None and slow["steps"] == 100
    assert [r["baseline"] for r in rows] == [None, None] and [r["improvement"] for r in rows] == [None, None]
    table = (out / "study.md").read_text().splitlines()
    assert table[0].startswith("| Setup | Workers (GPUs) | Test accuracy (best) | Time to accuracy >= 0.35 | "
                               "Images to target |")
    assert table[2].startswith("| mixed-async, 2 nodes (2 workers + 1 PS alongside), optim.lr=0.001 | 2 |")
    assert "not reached | - | 100 |" in table[2]
    page = check_report(out / "report" / "report.html")
    assert {"study-loss-time.png", "study-accuracy-time.png"} <= {p.name for p in (out / "report").glob("*.png")}
    assert len(set(page.images)) == len(page.images)  # no plot twice


def test_study_target_without_evaluations_fails_before_any_run(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["study", "--recipe", DIGITS, "--set", "train.eval_every=0", "--until", "accuracy=0.9",
                 "--out", str(out)]) == 2
    assert "set train.eval_every > 0" in capsys.readouterr().err and not out.exists()


def test_a_stop_signal_stops_the_sweep_not_only_its_cell(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "bench"
    p = subprocess.Popen([sys.executable, "-m", "scaletrain", "bench", "--recipe", DIGITS, "--set", "data.workers=0",
                          "--set", "train.eval_every=0", "--grid", "cluster.nodes=1,2", "--warmup", "2",
                          "--steps", "100000", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    first = None
    deadline = time.time() + 120
    while first is None and time.time() < deadline:  # the first cell has trained a few steps
        assert p.poll() is None, p.communicate()
        first = next((m for m in out.glob("cells/*/metrics.jsonl") if m.read_text().count('"train"') >= 2), None)
        time.sleep(0.2)
    assert first is not None, "the first cell did not train"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    assert "sweep stopped" in err and first.parent.name in err and "stopped by SIGTERM at step" in err, err
    assert [d.name for d in (out / "cells").iterdir()] == [first.parent.name]  # no cell after it started


def test_bench_and_report_of_a_users_network(tmp_path, monkeypatch):
    """A network by import path (tests/user_models.py) through bench, its rows and the report, as the
    built-in ResNets go: the rows name it and count its own parameters."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "bench"
    assert main(["bench", "--recipe", DIGITS, "--set", "data.workers=0", "--set", "model.name=user_models:batchnorm",
                 "--grid", "cluster.nodes=1,2", "--warmup", "2", "--steps", "8",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "bench-rows.json").read_text())
    params = sum(p.numel() for p in user_models.batchnorm(10).parameters())
    assert [(r["nodes"], r["model"], r["parameters"]) for r in rows] == \
        [(1, "user_models:batchnorm", params), (2, "user_models:batchnorm", params)]
    assert rows[1]["speedup"] == pytest.approx(rows[1]["images_per_sec"] / rows[0]["images_per_sec"])
    page = check_report(out / "report" / "report.html")
    assert "allreduce, 2 nodes (2 workers)" in page.cells


def test_a_study_on_a_profiles_clock(tmp_path):
    """--profile: every cell's time on the profile's clock is its images over the profile's predicted
    throughput for that cell's configuration; the table says whose clock it is."""
    profile = tmp_path / "toy.toml"
    profile.write_text(dump_profile(Profile(
        model="resnet8", image_size=16, batch_per_replica=32, gradient_bytes=1_000_000, replicas_per_node=2,
        compute_s=1.0, optimizer_s=0.01, intra_bandwidth=1e9, intra_latency=1e-4, net_bandwidth=1e8,
        net_latency=1e-3, local_bandwidth=1e9, ps_apply_rate=1e9), {}))
    out = tmp_path / "study"
    sets = ["data.workers=0", "train.steps=10", "train.eval_every=10"]
    assert main(["study", "--recipe", DIGITS, *[a for s in sets for a in ("--set", s)], "--grid",
                 "cluster.gpus_per_node=1,2", "--profile", str(profile), "--out", str(out)]) == 0
    rows = json.loads((out / "study-rows.json").read_text())
    prof = load_profile(str(profile))[0]
    for r, gpus in zip(rows, (1, 2)):
        want = predict(load_config(DIGITS, [*sets, f"cluster.gpus_per_node={gpus}"]), prof)["images_per_sec"]
        assert r["clock"] == "profile toy (predicted)" and r["clock_images_per_sec"] == pytest.approx(want)
        assert r["clock_seconds"] == pytest.approx(r["images_applied"] / want)
        assert r["images_applied"] == 10 * gpus * 32
    assert rows[1]["improvement"] == pytest.approx(rows[0]["clock_seconds"] / rows[1]["clock_seconds"])
    assert "| Training time on profile toy (predicted) | Training time here |" in (out / "study.md").read_text()
