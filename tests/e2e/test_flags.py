"""Figures that cannot be true of the job are flagged, with their reason, in the table, the JSON
rows and the report; a run that timed nothing says "not measured", never 0.0."""

import json
import os
import signal
import subprocess
import time
from html.parser import HTMLParser

import pytest

from scaletrain.perfmodel import scaling
from scaletrain.study import bench, figures, flags
from scaletrain.cli import main
from scaletrain.metrics import JobClock
from scaletrain.study.report import write_report
from scaletrain.study.figures import add_improvement, study_table

from conftest import ROOT, scaletrain_cmd
from test_study import DIGITS, check_report, row


def scaled(*rows):
    return flags.add_flags(scaling.add_scaling(list(rows)))


def cells_of(html: str) -> dict[str, str]:
    """Each table cell's text with its class ('flag' or '')."""
    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.cells, self.cls = {}, None

        def handle_starttag(self, tag, attrs):
            self.cls = dict(attrs).get("class", "") if tag == "td" else None

        def handle_data(self, data):
            if self.cls is not None:
                self.cells[data] = self.cls

    page = Cells()
    page.feed(html)
    return page.cells


NOISY = "efficiency 3.43 ± 1.71 > 1: baseline unsteady (±50%); rerun with --repeats 3"


def test_an_efficiency_above_1_from_a_noisy_baseline_is_flagged_everywhere(tmp_path):
    # the loaded baseline: 0.4 ± 0.2 img/s; the 2-node cell steady
    rows = scaled(row("allreduce", 1, 1, 0.4, 0.2), row("allreduce", 2, 2, 2.74, 0.02))
    base, two = rows
    assert two["efficiency"] == pytest.approx(3.425) and two["flag"] == NOISY
    assert two["flagged"] == ["speedup", "efficiency", "speedup_own"]  # its own smallest is the baseline
    assert base["flag"] == "unsteady (±50%); rerun with --repeats 3" and base["flagged"] == ["images_per_sec"]
    out = tmp_path / "bench"
    out.mkdir()
    bench.publish(out, "bench", rows, figures.scaling_table(rows), progress=False)
    table = (out / "bench.md").read_text().splitlines()
    assert table[0].endswith("| Flag |")
    assert table[3] == ("| allreduce, 2 nodes (2 workers) | 2.7 ± 0.0 | 6.85 ± 3.43 ⚠ | 3.43 ⚠ | 6.85 ± 3.43 ⚠ | "
                        f"{NOISY} |")
    assert "| 0.4 ± 0.2 ⚠ |" in table[2]
    saved = json.loads((out / "bench-rows.json").read_text())
    assert [r["flag"] for r in saved] == [base["flag"], NOISY]
    cells = cells_of((out / "report" / "report.html").read_text())
    assert cells[NOISY] == "flag" and cells["3.43 ⚠"] == "flag" and cells["2.7 ± 0.0"] == ""
    md = (out / "report" / "report.md").read_text()
    assert NOISY in md and "unsteady" in md.split("## Plots")[0]
    # rows written before flags: the report figures them again
    old = tmp_path / "old"
    old.mkdir()
    (old / "bench-rows.json").write_text(json.dumps([{k: v for k, v in r.items() if "flag" not in k} for r in saved]))
    write_report([old], old / "report")
    assert cells_of((old / "report" / "report.html").read_text())[NOISY] == "flag"


def test_a_steady_cell_is_not_flagged_and_one_past_its_bound_is():
    steady = scaled(row("allreduce", 1, 1, 100.0, 1.0), row("allreduce", 2, 2, 180.0, 2.0))
    assert steady[1]["efficiency"] == pytest.approx(0.9)
    assert [r["flag"] for r in steady] == [None, None] and [r["flagged"] for r in steady] == [[], []]
    table = figures.scaling_table(steady)
    assert "⚠" not in table and table.splitlines()[3].endswith(" | 0.90 | 1.80 ± 0.03 |  |")
    # 1.03 within its uncertainty is an efficiency of 1 measured; 1.40 ± 0.02 is not
    assert scaled(row("allreduce", 1, 1, 100.0, 2.5), row("allreduce", 2, 2, 206.0, 5.0))[1]["flag"] is None
    past = scaled(row("allreduce", 1, 1, 100.0, 1.0), row("allreduce", 2, 2, 280.0, 2.0))[1]
    assert past["flag"] == "efficiency 1.40 ± 0.02 > 1; rerun with --repeats 3"
    # with dedicated PS nodes efficiency stays under 1, but the speedup passes the replicas' ratio
    ps = scaled(row("allreduce", 1, 1, 100.0, 1.0), row("sync", 2, 4, 260.0, 2.0, ps=2, placement="dedicated"))[1]
    assert ps["flag"] == "speedup 2.60 ± 0.03 > 2 (the replicas' ratio); rerun with --repeats 3"
    # the suggestion grows with the repeats already run
    three = {**row("allreduce", 1, 1, 100.0, 30.0), "images_per_sec_runs": [50.0, 100.0, 150.0]}
    assert scaled(three)[0]["flag"] == "unsteady (±30%); rerun with --repeats 6"


def test_a_stall_in_the_windows_is_flagged():
    clock = JobClock(0, 0)
    clock.windows = [(320, 0.2, 0.0)] * 39 + [(320, 4.0, 0.0)]  # one window at 5% of the others' rate
    s = clock.summary()
    assert s["slowest_window_fraction"] == pytest.approx(0.05)
    base = {**row("allreduce", 1, 1, s["images_per_sec"], s["images_per_sec_stderr"]), **s}
    assert flags.rate_doubts(base) == ["stalled (a log window at 5% of the median rate)"]
    two = scaled(base, row("allreduce", 2, 2, 2900.0, 10.0))[1]
    assert two["flag"] == ("efficiency 1.34 ± 0.05 > 1: baseline stalled (a log window at 5% of the median rate); "
                           "rerun with --repeats 3")
    steady = JobClock(0, 0)
    steady.windows = [(320, 0.2 + 0.01 * (i % 3), 0.0) for i in range(10)]
    assert steady.summary()["slowest_window_fraction"] > 0.9
    assert flags.rate_doubts({**row("allreduce", 1, 1, 1.0, 0.0), **steady.summary()}) == []


def test_repeats_keep_a_stall_and_a_run_that_timed_nothing():
    run = {"images_per_sec": 100.0, "images_per_sec_stderr": 1.0, "slowest_window_fraction": 0.9, "timed_windows": 8}
    parts = [{"run_dir": f"cells/c-run{j}", "wall_seconds": 1.0} for j in (1, 2)]
    r = {}
    s = bench.combine(list(zip(parts, [run, {**run, "slowest_window_fraction": 0.1}])), 2, r)
    assert s["slowest_window_fraction"] == 0.1 and s["images_per_sec"] == 100.0
    untimed = {**run, "images_per_sec": None, "images_per_sec_stderr": None, "timed_windows": 0}
    r = {}
    s = bench.combine(list(zip(parts, [run, untimed])), 2, r)
    assert s["images_per_sec"] is None and r["images_per_sec_runs"] == [100.0, None]


def test_an_improvement_on_a_noisy_baseline_is_flagged():
    def study_row(replicas, ips, se, seconds, epochs=1.0):
        return {**row("allreduce", replicas, replicas, ips, se), "replicas": replicas, "label": f"{replicas}",
                "steps": 100, "epochs": epochs, "train_seconds": seconds, "test_accuracy": 0.9,
                "best_test_accuracy": 0.9, "final_train_loss": 0.1}

    until = ("epochs", 1.0)
    base, two = add_improvement([study_row(1, 0.4, 0.2, 823.0), study_row(2, 2.74, 0.02, 100.0)], until)
    assert two["improvement"] == pytest.approx(8.23)
    assert two["flag"] == ("improvement 8.23x > 2x (the replicas' ratio): baseline unsteady (±50%); "
                           "rerun the study on a quiet host")
    assert two["flagged"] == ["improvement"] and base["flagged"] == ["time"]
    table = study_table([base, {**two, "noise_scale": 212.4}], until).splitlines()
    assert table[0].endswith("| Improvement | Noise scale (images) | Flag |") and "823.0 s ⚠" in table[2]
    assert "| 8.23x ⚠ | 212 |" in table[3] and "| 1.00x | - | unsteady" in table[2]  # none measured with one replica
    ok = add_improvement([study_row(1, 100.0, 1.0, 100.0), study_row(2, 190.0, 2.0, 52.0)], until)
    assert [r["flag"] for r in ok] == [None, None]
    # no target, the same epochs: an improvement past the replicas' ratio is not the job's however steady
    fast = add_improvement([study_row(1, 100.0, 1.0, 300.0), study_row(2, 190.0, 2.0, 100.0)], until)[1]
    assert fast["flag"] == "improvement 3.00x > 2x (the replicas' ratio); rerun the study on a quiet host"
    # to a target it may be (fewer images may do): flagged only on a doubted throughput
    target = add_improvement([{**study_row(1, 100.0, 1.0, 0), "time_to_target": 300.0},
                              {**study_row(2, 190.0, 2.0, 0), "time_to_target": 100.0}], ("accuracy", 0.9))
    assert target[1]["improvement"] == 3.0 and target[1]["flag"] is None


def test_an_untimed_window_counts_only_when_no_other_was_timed():
    clock = JobClock(0, 0)
    clock.now = iter([1.0, 2.0, 5.0]).__next__  # seconds at each tick
    clock.tick(100, close=True)
    clock.tick(200, close=True)
    assert clock.tick(300, close=True, timed=False) is None  # a drain: 100 images in 3 s
    s = clock.summary()
    assert s["images_per_sec"] == 100.0 and s["timed_windows"] == 2 and s["images_applied"] == 300
    alone = JobClock(0, 0)
    alone.now = iter([4.0]).__next__
    alone.tick(100, close=True, timed=False)
    assert alone.summary()["images_per_sec"] == 25.0  # the job's one window, its drain included


def test_a_cell_not_measured_is_null_and_says_so(tmp_path):
    s = JobClock(0, 64).summary()  # nothing past the warm-up
    assert s["images_per_sec"] is None and s["images_per_sec_stderr"] is None and s["timed_windows"] == 0
    base, two = scaled({**row("allreduce", 1, 1, None, None), "timed_windows": 0},
                       row("allreduce", 2, 2, 200.0, 1.0))
    assert base["speedup"] is None and two["speedup"] is None and two["flag"] is None
    assert base["flag"] == "not measured: no log window after the warm-up; raise --steps"
    assert "| not measured ⚠ | - | - | - |" in figures.scaling_table([base, two])
    old = scaled({**row("allreduce", 1, 1, 0.0, 0.0), "timed_windows": 0})[0]  # 0.0 from before nulls
    assert figures.throughput_text(old) == "not measured"
    made = []
    from scaletrain.study.plots import bench_plots

    bench_plots([base, two], tmp_path, made)
    assert [n for n, _ in made] == ["speedup.png", "throughput.png"]


def test_a_stopped_process_shows_as_a_stall(tmp_path, env):
    """A real run frozen by SIGSTOP for a second: its window shows it, and the report flags it."""
    run = tmp_path / "run"
    p = subprocess.Popen(scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(run), "--quiet",
                                        *sum((["--set", s] for s in ["data.workers=0", "train.steps=120",
                                                                     "train.eval_every=0", "train.log_every=5",
                                                                     "train.threads=1"]), [])),
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"))
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and "images_per_sec" in metrics.read_text()):  # timing has begun
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 120 and s["slowest_window_fraction"] < flags.STALL, s["slowest_window_fraction"]
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    cells = cells_of((tmp_path / "rep" / "report.html").read_text())
    assert any("stalled (a log window at" in c and cls == "flag" for c, cls in cells.items()), cells
    check_report(tmp_path / "rep" / "report.html")


def test_a_study_on_a_profiles_clock_ranks_by_its_time_and_keeps_the_wall_time_beside():
    """On two shared cores 2 replicas take longer than 1 (wall), while on the profile's clock they halve
    the time: the improvement is the profile's, labelled so; the wall time stays in its own column."""
    def study_row(replicas, wall, on_profile):
        return {**row("allreduce", replicas, replicas, 100.0, 1.0), "replicas": replicas, "label": f"{replicas}",
                "steps": 100, "epochs": 1.0, "train_seconds": wall, "test_accuracy": 0.9, "best_test_accuracy": 0.9,
                "final_train_loss": 0.1, "clock": "profile toy (predicted)", "clock_seconds": on_profile}

    until = ("epochs", 1.0)
    base, two = add_improvement([study_row(1, 10.0, 200.0), study_row(2, 14.0, 100.0)], until)
    assert two["improvement"] == pytest.approx(2.0) and two["flag"] is None
    table = study_table([base, two], until).splitlines()
    assert table[0].startswith("| Setup | Workers (GPUs) | Test accuracy (best) | Training time on profile toy (predicted) | "
                               "Training time here | Steps | Improvement |")
    assert "| 100.0 s | 14.0 s | 100 | 2.00x |" in table[3]
