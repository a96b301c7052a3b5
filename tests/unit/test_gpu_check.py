"""benchmarks/gpu_check.py where there is no GPU: its skip, the GPU tests' skip, and the pure
parts that assemble its JSON from the benchmarks' outputs."""

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

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


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
    assert r.stdout.strip() == f"PYTHONPATH={ROOT}/src python3 benchmarks/gpu_check.py"


def test_last_json_skips_progress_and_takes_the_object_printed_last():
    out = "{\"earlier\": 0}\n1 shards: floor 0.2 s\n{\n \"a\": {\n  \"b\": 1\n }\n}\n{oops\n"
    assert gpu_check.last_json(out) == {"a": {"b": 1}}
    with pytest.raises(ValueError):
        gpu_check.last_json("no json here\n")


def test_pytest_counts_from_junit_xml():
    xml = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" skipped="3" '
           'tests="10"></testsuite></testsuites>')
    assert gpu_check.pytest_counts(xml) == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3, "total": 10}


DDP = {"benchmark": "ddp_parity", "rows": [
    {"replicas": 1, "bare_ddp_images_per_sec": [3000.0, 2900.0, 3100.0],
     "scaletrain_images_per_sec": [2800.0, 2700.0, 2900.0], "ratio": 2800.0 / 3000.0},
    {"replicas": 2, "bare_ddp_images_per_sec": [5000.0, 6000.0, 5800.0],
     "scaletrain_images_per_sec": [5600.0, 5400.0, 5700.0], "ratio": 5600.0 / 5800.0}]}


def test_result_json_from_the_benchmarks_outputs(tmp_path):
    benches = {"overhead": {"benchmark": "overhead", "ratio": 0.97}, "ddp_parity": DDP,
               "ps_path": {"benchmark": "ps_path", "max_ratio": 1.2}}
    tests = {"passed": 13, "failed": 0, "errors": 0, "skipped": 1, "total": 14, "exit_status": 0}
    info = {"git_commit": "abc", "host": "h", "device": "NVIDIA H100 80GB HBM3", "torch_version": "2.5.1"}
    cmds = gpu_check.bench_commands("python3", gpus=1)
    result = json.loads(json.dumps(gpu_check.assemble(info, tests, benches, cmds)))
    assert result["images_per_sec_per_gpu"] == {"replicas": 2, "scaletrain": 2800.0, "bare_ddp": 2900.0,
                                                "ratio": 5600.0 / 5800.0}
    assert result["benchmarks"] == benches and result["tests"] == tests and result["run_info"] == info
    assert gpu_check.passed(result)
    # a failed test or benchmark fails the check, and the figures it could not give are null
    failed = gpu_check.assemble(info, tests, {**benches, "ddp_parity": {"error": "exited 1"}}, cmds)
    assert failed["images_per_sec_per_gpu"] is None and not gpu_check.passed(failed)
    assert not gpu_check.passed(gpu_check.assemble(info, {**tests, "failed": 1, "exit_status": 1}, benches, cmds))
    assert gpu_check.result_path(tmp_path, "2031-01-02T030405Z", "abc1234").name == "gpu-check-2031-01-02T030405Z-abc1234.json"


def test_benchmarks_run_at_resnet50_224_on_the_gpus_there_are():
    one, four = gpu_check.bench_commands("py", 1), gpu_check.bench_commands("py", 4)
    assert one["ddp_parity"][one["ddp_parity"].index("--replicas") + 1] == "1"
    assert four["ddp_parity"][four["ddp_parity"].index("--replicas") + 1] == "2"
    for name in ("overhead", "ddp_parity"):
        cmd = " ".join(four[name])
        assert "--model resnet50 --image-size 224" in cmd and "--device cuda" in cmd
        assert "--precision bf16 --channels-last" in cmd
    assert four["ps_path"][-2:] == ["--device", "cuda"]


def test_a_benchmark_that_fails_or_hangs_is_an_error_with_its_last_words(monkeypatch):
    failing = [sys.executable, "-c", "import sys; print('working', file=sys.stderr); sys.exit('no GPU here')"]
    b = gpu_check.run_bench(failing)
    assert b["error"] == "exited 1" and "working" in b["stderr_tail"] and "no GPU here" in b["stderr_tail"]
    monkeypatch.setattr(gpu_check, "BENCH_TIMEOUT_S", 1)
    b = gpu_check.run_bench([sys.executable, "-c", "import time; time.sleep(60)"])
    assert b["error"] == "did not finish in 1 s"
    printing = "import json; print('progress'); print(json.dumps({'x': 1}))"
    assert gpu_check.run_bench([sys.executable, "-c", printing]) == {"x": 1}
