"""benchmarks/gpu_check.py where there is no GPU: its skip (after importing everything it would
use), the GPU tests' skip, the pure parts that assemble its JSON from the benchmarks' outputs, the
like-for-like loops of overhead.py, and the bundle of packages (gpu_bundle.py) that brings what it
imports to a GPU machine without a package index."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT



def script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check, gpu_bundle, overhead = script("gpu_check"), script("gpu_bundle"), script("overhead")


def no_gpu_env():
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "src"))


def test_without_a_gpu_it_says_so_in_one_line_and_runs_nothing(tmp_path):
    before = sorted((ROOT / "benchmarks").rglob("gpu-check-*.json"))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], env=no_gpu_env(),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: needs a CUDA GPU"), r.stdout
    assert f"torch {torch.__version__}" in lines[0]
    assert "Traceback" not in r.stderr
    assert sorted((ROOT / "benchmarks").rglob("gpu-check-*.json")) == before


def test_the_skip_names_the_build():
    assert "is a CPU build" in gpu_check.skip_reason("2.13.0+cpu", None, False)
    assert "(CUDA 12.4) sees none" in gpu_check.skip_reason("2.5.1+cu124", "12.4", False)
    assert gpu_check.skip_reason("2.5.1+cu124", "12.4", True) is None


def test_gpu_tests_are_all_marked_and_skipped_without_a_gpu(tmp_path):
    junit = tmp_path / "junit.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", f"--junitxml={junit}",
                        "-p", "no:cacheprovider"], env=no_gpu_env(), capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:]
    counts = gpu_check.pytest_counts(junit.read_text())
    assert counts["total"] >= 10 and counts["skipped"] == counts["total"], counts
    assert r.stdout.count("needs a CUDA GPU") >= 1 and "needs 2 CUDA GPUs" not in r.stdout
    # every test there carries the marker: none is left when it is deselected
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "not gpu", "tests/gpu", "--collect-only", "-q",
                        "-p", "no:cacheprovider"], env=no_gpu_env(), capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 5 and f"{counts['total']} deselected" in r.stdout, r.stdout[-2000:]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_with_py_gpu_leaves_the_venv_alone():
    # --no-print-directory: under `make test` this make is nested, and would say which directory it enters.
    r = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "PY_GPU=python3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [
        "python3 benchmarks/gpu_bundle.py install --bundle .gpu-bundle --target .gpu-site",
        f"PYTHONPATH={ROOT}/src:{ROOT}/.gpu-site python3 benchmarks/gpu_check.py"]


def test_a_package_that_does_not_import_is_one_line_naming_it_and_the_fix(tmp_path):
    """Checked before the skip: without a GPU too, the check stops at what it could not import."""
    blocked = "import runpy, sys; sys.modules['tomli_w'] = None; sys.argv = [sys.argv[1]]; " \
              "sys.exit(runpy.run_path(sys.argv[0], run_name='__main__'))"
    r = subprocess.run([sys.executable, "-c", blocked, str(ROOT / "benchmarks" / "gpu_check.py")], env=no_gpu_env(),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpu-check: error: {sys.executable} cannot import "), r.stdout
    assert "tomli_w" in lines[0] and "make gpu-bundle" in lines[0] and "Traceback" not in r.stderr


def test_the_check_imports_what_the_gpu_tests_and_benchmarks_import_at_their_top():
    scripts = [p.name for p in gpu_check.scripts()]
    assert {"overhead.py", "ps_path.py", "conftest.py", "test_gpu_resnet50.py", "runs.py"} <= set(scripts)
    assert gpu_check.import_everything() is None


def test_last_json_skips_progress_and_takes_the_object_printed_last():
    out = "{\"earlier\": 0}\n1 shards: floor 0.2 s\n{\n \"a\": {\n  \"b\": 1\n }\n}\n{oops\n"
    assert gpu_check.last_json(out) == {"a": {"b": 1}}
    with pytest.raises(ValueError):
        gpu_check.last_json("no json here\n")


def test_pytest_counts_from_junit_xml():
    xml = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" skipped="3" '
           'tests="10"></testsuite></testsuites>')
    assert gpu_check.pytest_counts(xml) == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3, "total": 10}


def overhead_json(scaletrain=(2400.0, 2500.0, 2450.0), loader=(2500.0, 2550.0, 2520.0),
                  resident=(2600.0, 2650.0, 2640.0)):
    """overhead.py's JSON as figures() makes it, from made-up runs of 3 windows each."""
    times = {"bare_resident": list(resident), "bare_loader": list(loader), "scaletrain": list(scaletrain)}
    windows = {k: [[v * 0.95, v, v * 1.04] for v in runs] for k, runs in times.items()}
    return {"benchmark": "overhead", "loader_workers": 4, **{f"{k}_images_per_sec": v for k, v in times.items()},
            **overhead.figures(times, windows),
            "host_profile": {"scaletrain": {"host_wait_ms_per_step": 1.5, "host_waits": {"aten::item": {}},
                                            "top_self_cpu": [{"op": "a"}] * 12}}}


def test_result_json_gives_like_for_like_figures(tmp_path):
    benches = {"overhead": overhead_json(), "ps_path": {"benchmark": "ps_path", "max_ratio": 1.2}}
    tests = {"passed": 13, "failed": 0, "errors": 0, "skipped": 1, "total": 14, "exit_status": 0}
    info = {"git_commit": "abc", "host": "h", "device": "NVIDIA H100 80GB HBM3", "torch_version": "2.5.1"}
    cmds = gpu_check.bench_commands("python3")
    result = json.loads(json.dumps(gpu_check.assemble(info, tests, benches, cmds)))
    f = result["figures"]
    # scaletrain against a bare loop with the SAME loader: the overhead; that loop against a resident batch:
    # the input's cost. Not scaletrain with a loader against a bare loop without one.
    assert f["overhead"] == {"scaletrain_images_per_sec": 2450.0, "bare_same_loader_images_per_sec": 2520.0,
                             "ratio": 2450.0 / 2520.0, "goal": 0.97}
    assert f["input_cost"] == {"bare_same_loader_images_per_sec": 2520.0, "bare_resident_batch_images_per_sec": 2640.0,
                               "ratio": 2520.0 / 2640.0}
    assert f["window_spread"] == {"bare_resident": pytest.approx(0.05), "bare_loader": pytest.approx(0.05),
                                  "scaletrain": pytest.approx(0.05), "goal": 0.10}
    assert f["goals_met"] == {"overhead_ratio": True, "window_spread": True}
    assert f["host_waits"]["scaletrain"]["host_wait_ms_per_step"] == 1.5
    assert len(f["host_waits"]["scaletrain"]["top_self_cpu"]) == 5
    assert gpu_check.summary(f) == ("scaletrain 2450 images/s against 2520 for a bare loop with the same loader: 0.972 "
                                    "(goal 0.97); the input's cost: 0.955 of a resident batch; windows within 5% of "
                                    "their median (bare loop 5%; goal 10%)")
    assert "images_per_sec_per_gpu" not in result and "ddp_parity" not in result["commands"]
    assert result["benchmarks"] == benches and result["tests"] == tests and result["run_info"] == info
    assert gpu_check.passed(result)
    # a goal missed is reported, not failed; a failed test or benchmark fails the check
    slow = gpu_check.assemble(info, tests, {**benches, "overhead": overhead_json(scaletrain=(2000.0,) * 3)}, cmds)
    assert slow["figures"]["goals_met"]["overhead_ratio"] is False and gpu_check.passed(slow)
    failed = gpu_check.assemble(info, tests, {**benches, "overhead": {"error": "exited 1"}}, cmds)
    assert failed["figures"] is None and not gpu_check.passed(failed)
    assert not gpu_check.passed(gpu_check.assemble(info, {**tests, "failed": 1, "exit_status": 1}, benches, cmds))
    assert gpu_check.result_path(tmp_path, "2031-01-02T030405Z", "abc1234").name == "gpu-check-2031-01-02T030405Z-abc1234.json"


def test_window_spread_is_the_farthest_window_from_their_median():
    s = overhead.spread([100.0, 90.0, 110.0, 100.0, 130.0])
    assert s["median"] == 100.0 and s["spread"] == pytest.approx(0.30)
    assert (s["slowest_fraction"], s["fastest_fraction"]) == (pytest.approx(0.9), pytest.approx(1.3))
    assert overhead.spread([])["spread"] is None
    # each loop's worst run is its figure
    f = overhead.figures({k: [1.0, 1.0] for k in overhead.LOOPS},
                         {k: [[100.0, 101.0], [100.0, 150.0, 100.0]] for k in overhead.LOOPS})
    assert f["window_spread"]["scaletrain"]["spread"] == pytest.approx(0.5)
    assert f["goals_met"]["window_spread"] is False


def test_host_waits_from_a_real_profile():
    """torch.profiler over real steps: each step's item() is a wait for the device, counted per step."""
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run():
        for _ in range(6):
            loss = model(torch.randn(4, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()  # a host-device sync on a GPU

    summary = overhead.profiled(run, warmup=2, steps=3)
    assert summary["profiled_steps"] == 3
    assert summary["host_waits"]["aten::item"]["calls_per_step"] == 1.0
    assert 0 < len(summary["top_self_cpu"]) <= overhead.TOP_OPS
    assert not any(op["op"].startswith("ProfilerStep") for op in summary["top_self_cpu"])


def test_the_bare_loop_takes_scaletrains_loader_or_a_resident_batch():
    cfg = overhead.build_config({"model": {"name": "resnet8", "num_classes": 10},
                                 "data": {"name": "synthetic", "image_size": 8, "batch_size": 4, "workers": 1,
                                          "augment": [], "synthetic_size": 64},
                                 "train": {"steps": 5, "device": "cpu", "threads": 1}})
    for source in ("loader", "resident"):
        rate, windows = overhead.bare_loop(cfg, steps=4, warmup=1, window=2, source=source)
        assert rate > 0 and len(windows) == 2


def test_benchmarks_run_at_resnet50_224_on_one_gpu_within_the_budget():
    cmds = gpu_check.bench_commands("py")
    assert set(cmds) == {"overhead", "ps_path"}
    cmd = " ".join(cmds["overhead"])
    assert "--model resnet50 --image-size 224" in cmd and "--device cuda" in cmd and "--workers 4" in cmd
    assert "--precision bf16 --channels-last" in cmd and "--window 10" in cmd and "--profile-steps" in cmd
    assert cmds["ps_path"][2:4] == ["--device", "cuda"]
    assert gpu_check.BUDGET_S <= 9 * 60


def test_the_gpu_tests_run_three_at_a_time_where_xdist_is_there(tmp_path):
    junit = tmp_path / "j.xml"
    assert gpu_check.tests_command("py", junit, 3)[-2:] == ["-n", "3"]
    assert gpu_check.tests_command("py", junit, 1) == ["py", "-m", "pytest", "-m", "gpu", "tests/gpu", f"--junitxml={junit}"]
    assert "pytest-xdist" in gpu_bundle.requirements(gpu_bundle.project_ranges())


def test_ps_path_has_no_floor():
    """Its bare send/recv script was beaten (ratio 0.66): a reference, named bare, not a floor."""
    text = (ROOT / "benchmarks" / "ps_path.py").read_text()
    assert '"floor_s"' not in text and '"bare_s"' in text and "data.name=synthetic" in text


def test_a_benchmark_that_fails_or_hangs_is_an_error_with_its_last_words():
    failing = [sys.executable, "-c", "import sys; print('working', file=sys.stderr); sys.exit('no GPU here')"]
    b = gpu_check.run_bench(failing)
    assert b["error"] == "exited 1" and "working" in b["stderr_tail"] and "no GPU here" in b["stderr_tail"]
    b = gpu_check.run_bench([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert b["error"] == "did not finish in 1 s"
    printing = "import json; print('progress'); print(json.dumps({'x': 1}))"
    assert gpu_check.run_bench([sys.executable, "-c", printing]) == {"x": 1}


def test_the_bundle_asks_for_the_projects_ranges_and_never_torch():
    ranges = gpu_bundle.project_ranges()
    reqs = gpu_bundle.requirements(ranges)
    assert ranges["tomli-w"] in reqs and ranges["simpy"] in reqs and ranges["pytest-timeout"] in reqs
    assert not any(gpu_bundle.canonical(r).startswith(("torch", "nvidia", "triton")) for r in reqs)
    # what the digits alone need (scikit-learn, scipy) and reports (matplotlib) stay out: 45 MB a Python
    assert not {"scikit-learn", "scipy", "matplotlib"} & set(gpu_bundle.PACKAGES)
    assert gpu_bundle.platforms("aarch64")[0] == "manylinux_2_28_aarch64"


def test_install_takes_only_what_the_python_lacks_and_keeps_the_bundle_small():
    wheels = ["numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
              "tomli_w-1.2.0-py3-none-any.whl", "pip-26.3-py3-none-any.whl", "Pillow-13.0.0-cp312-cp312-x.whl"]
    assert gpu_bundle.missing(wheels, {"numpy", "pillow", "torch"}) == ["tomli_w-1.2.0-py3-none-any.whl"]
    assert gpu_bundle.wheel_name(wheels[3]) == "pillow" and gpu_bundle.canonical("tomli_w") == "tomli-w"
    assert gpu_bundle.size_error({"a.whl": 30 << 20, "b.whl": 30 << 20}) is None
    err = gpu_bundle.size_error({"a.whl": 40 << 20, "b.whl": 30 << 20})
    assert err.startswith("70.0 MiB is over the bundle's 64 MiB; the largest: a.whl (40.0 MiB)"), err


def test_a_bundle_for_another_python_is_one_line_naming_the_make_command(tmp_path):
    (tmp_path / "bundle.json").write_text(json.dumps({"python_version": "3.9", "arch": "x86_64", "wheels": []}))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bundle.py"), "install", "--bundle",
                        str(tmp_path), "--target", str(tmp_path / "site")], capture_output=True, text=True, timeout=60)
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert r.returncode == 1 and r.stderr.strip().startswith("gpu-check: "), r.stderr
    assert f"make gpu-bundle GPU_PYTHON={mine}" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_install_into_env_names_the_torch_there_so_pip_keeps_it():
    """The whole install, run in a fresh environment, is benchmarks/install_paths.py (minutes)."""
    r = subprocess.run(["make", "--no-print-directory", "-n", "install-into-env", "PY=/opt/py/bin/python"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "/opt/py/bin/python -m pip install --disable-pip-version-check -e '.[test]' \"torch==$v\"" in r.stdout
    assert "constraints.txt" not in r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_install_into_env_without_torch_is_one_line(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    r = subprocess.run(["make", "--no-print-directory", "install-into-env", f"PY={bare}/bin/python"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stdout.strip() == (
        f"install-into-env: {bare}/bin/python has no torch that imports: install a build of torch in it first, "
        "or name the Python that has one (PY=...)"), (r.stdout, r.stderr)
