"""benchmarks/twin.py's choice of time scale: the links' load and, second bound, the host's own work,
which the twin does not dilate; and the host time a measured row implies (pure parts, no twin)."""

import importlib.util

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("twin_bench", ROOT / "benchmarks" / "twin.py")
twin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(twin)


def test_the_time_scale_keeps_the_host_work_under_its_share_of_the_step():
    # load alone: 80 Gbit/s over 16 -> 5; host 0.68 s of a 1.15 s step at 4% -> 0.68 / k <= 0.046 -> 20
    assert twin.time_scale(80, 16) == 5
    assert twin.time_scale(80, 16, 0.68, 1.15) == 20
    assert twin.time_scale(2, 16, 0.17, 1.84) == 5  # the host bound alone: 0.17 / k <= 0.074
    assert twin.time_scale(2, 16, 0.0, 1.84) == 1


def test_a_rows_host_work_is_its_processes_cpu_over_the_cores(monkeypatch):
    monkeypatch.setattr(twin.os, "cpu_count", lambda: 2)
    assert twin.host_s({"nodes": 8, "num_ps": 0}) == pytest.approx(8 * twin.HOST_CPU_S / 2)
    assert twin.host_s({"nodes": 2, "num_ps": 1}) == pytest.approx(3 * twin.HOST_CPU_S / 2)


def test_the_host_time_a_row_implies(monkeypatch):
    """2 nodes of 32 images at 32 img/s measured, 40 predicted: a step 0.4 s longer, at k = 5 2 s of the
    host's, over 2 processes a core: 2 CPU-seconds a process."""
    monkeypatch.setattr(twin.os, "cpu_count", lambda: 2)
    row = {"nodes": 2, "num_ps": 0, "time_scale": 5, "images_per_sec": 32.0,
           "predicted_network_only": {"images_per_sec": 40.0}}
    assert twin.host_implied(row, 32) == pytest.approx(2.0)
    assert twin.host_implied({**row, "images_per_sec": None}, 32) is None


def test_a_refused_row_runs_again_only_at_a_higher_time_scale(monkeypatch):
    """Refused at 20 the row runs at 50; refused at the series' top (or a k above it, --time-scale)
    it is kept with its error, never run again at the same or a lower k."""
    ran = []

    def run_group(rate, k, rows, a, study, runs):
        ran.append(k)
        return [{**r, "error": "links below the set rate: raise cluster.time_scale"} for r in rows], {"k": k}

    monkeypatch.setattr(twin, "run_group", run_group)
    row = {"nodes": 6, "strategy": "mixed-async", "link_gbps": 2.5}
    done, _ = twin.measure([{**row, "time_scale": 20}], None, {}, None)
    assert ran == [20, 50, 100] and done[0]["refused_at"] == [20, 50] and twin.refused(done[0])
    for k in (100, 200):
        ran.clear()
        done, _ = twin.measure([{**row, "time_scale": k}], None, {}, None)
        assert ran == [k] and twin.refused(done[0]), (k, ran)
