"""The GPU acceptance check: the GPU tests, then the benchmarks at ResNet-50 224 px, in one JSON.

    make gpu-check PY_GPU=python3    # a Python that has a CUDA build of torch (and pytest)
    make gpu-check                   # .venv's Python: install a CUDA build of torch in it first

PY_GPU names a Python that already has a CUDA build of torch (any 2.x from 2.4) and pytest, as a
stock CUDA PyTorch image has; make first installs from .gpu-bundle (`make gpu-bundle`, made
beforehand where pip reaches a package index: benchmarks/gpu_bundle.py) what else the check
imports and that Python lacks, into .gpu-site, with no package index, then runs this script
with PYTHONPATH=src:.gpu-site. That Python's torch and packages are left as they are.

It first imports everything it and what it runs would import (IMPORTS, the benchmarks, the GPU
tests): a missing package is one line naming it and the fix, on any machine. Then, without CUDA,
it prints one line (`gpu-check: skipped: ...`, naming torch's version and build) and exits 0
having run nothing. With CUDA it says which part runs, and runs:

1. pytest -m gpu tests/gpu: every CUDA path of scaletrain (tests/gpu/), 3 at a time where
   pytest-xdist is installed (the bundle brings it);
2. overhead.py: on one GPU, ResNet-50 at 224 px, bf16, channels_last, 4 loader processes:
   `scaletrain train`'s loop against a bare loop fed by the same loader (the overhead, goal
   >= 0.97), that bare loop against one reusing a batch already on the GPU (the input's cost),
   each loop's 10-step windows against their median (goal within 10%), and a torch.profiler
   summary of where the host waits in scaletrain's loop and in the bare one;
3. ps_path.py --device cuda: the PS path of ResNet-50's gradient from the GPU against bare
   send/recv pairs moving the same bytes (its compute is emulated, so neither the image size
   nor the precision enters).

Then it writes benchmarks/results/gpu-check-<UTC time>-<short commit>.json: the headline figures
(`figures`), each benchmark's own JSON, the tests' outcome counts and run_info. Its exit status is
0 when every test passed and every benchmark gave its JSON, else 1 (a figure short of its goal is
reported, not failed); the JSON is written either way. The whole check stops within BUDGET_S
(9 minutes on one GPU): a part still running then is ended and recorded as not finished. The jobs
run on this machine: a scheduler's or launcher's variables (SLURM_*, TORCHELASTIC_*) are left out
of their environment, CUDA_VISIBLE_DEVICES is kept.

At b5cc5ab on one H100 scaletrain's 10-step windows spread from 955 to 2,883 images/s while the
bare loop's three runs kept within 6% of each other: a host-side stall, which the windows and the
profile are there to find.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
RESULTS = HERE / "results"
BUDGET_S = 540  # the whole check, on one GPU
TESTS_TIMEOUT_S = 360
BENCH_TIMEOUT_S = 240
RESNET50 = ["--model", "resnet50", "--image-size", "224", "--batch", "64", "--device", "cuda", "--precision", "bf16",
            "--channels-last", "--workers", "4"]
# What the check and the processes it starts import beyond the standard library, torch and the
# benchmarks' and GPU tests' own imports (imported by path: scripts()): each package of
# gpu_bundle.PACKAGES, the modules that scaletrain imports only when a run gets there (a
# TensorBoard writer, a progress bar, an image decoder), and the entry points of every job.
IMPORTS = ["numpy", "PIL.Image", "simplejpeg", "safetensors.torch", "torch.utils.tensorboard", "tomli_w", "simpy",
           "rich.progress", "pytest", "pytest_timeout", "scaletrain.cli", "scaletrain.loop", "scaletrain.run",
           "scaletrain.launch.local", "scaletrain.data.loader"]


def skip_reason(torch_version: str, cuda_build: str | None, available: bool) -> str | None:
    """Why nothing can run here (None: a CUDA GPU is there)."""
    if available:
        return None
    if cuda_build is None:
        return (f"needs a CUDA GPU, and torch {torch_version} is a CPU build: run `make gpu-check PY_GPU=python3` "
                "with a Python that has a CUDA build of torch; nothing was run")
    return (f"needs a CUDA GPU, and torch {torch_version} (CUDA {cuda_build}) sees none (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES); nothing was run")


def scripts() -> list[Path]:
    """The Python files the check runs or pytest collects, whose imports must all resolve: the
    benchmarks it runs, the test suite's conftest and the GPU tests."""
    return [HERE / "overhead.py", HERE / "ps_path.py", ROOT / "tests" / "conftest.py",
            *sorted((ROOT / "tests" / "gpu").glob("*.py"))]


def import_everything() -> str | None:
    """Import IMPORTS and every module scripts() import at their top; None, or one line naming what
    failed and the fix. A missing package fails here, not minutes into the run on a GPU."""
    import ast
    import importlib

    sys.path.insert(1, str(ROOT / "tests"))  # as pytest puts it for the tests' own modules (conftest)
    names = [(name, ()) for name in IMPORTS]
    for path in scripts():
        for node in ast.parse(path.read_text(), str(path)).body:  # a function's own imports are optional ones
            if isinstance(node, ast.Import):
                names += [(a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append((node.module, tuple(a.name for a in node.names)))
    for name, parts in names:
        try:
            module = importlib.import_module(name)
            for part in parts:  # `from package import module` imports a submodule
                if not hasattr(module, part):
                    name = f"{module.__name__}.{part}"
                    importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - missing, or installed but broken: either is the same fix
            return (f"{sys.executable} cannot import {name} ({type(e).__name__}: {e}): run `make gpu-bundle` where pip "
                    "reaches a package index, then `make gpu-check PY_GPU=...` installs it from .gpu-bundle")
    return None


def tests_command(python: str, junit: Path, workers: int = 1) -> list[str]:
    """pytest's command for the GPU tests; workers > 1: that many at once (pytest-xdist)."""
    return [python, "-m", "pytest", "-m", "gpu", "tests/gpu", f"--junitxml={junit}",
            *(["-n", str(workers)] if workers > 1 else [])]


def test_workers() -> int:
    """GPU tests at once: 3 where pytest-xdist is installed (as CUDA images often have it). Each test
    checks what a run computes, never how fast, so they may share the GPU; one at a time they took
    4.7 of the check's minutes at b5cc5ab."""
    import importlib.util

    return 3 if importlib.util.find_spec("xdist") is not None else 1


def bench_commands(python: str) -> dict[str, list[str]]:
    """Each benchmark's command line, by name."""
    return {
        "overhead": [python, "benchmarks/overhead.py", *RESNET50, "--steps", "200", "--warmup", "20", "--window", "10",
                     "--repeats", "3", "--profile-steps", "20"],
        "ps_path": [python, "benchmarks/ps_path.py", "--device", "cuda", "--shards", "1", "2", "--repeats", "1"],
    }


def last_json(text: str) -> dict:
    """The last JSON object a benchmark printed (it starts a line; progress may come before)."""
    starts = [m.start() for m in re.finditer(r"^\{", text, re.MULTILINE)]
    for start in reversed(starts):
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise ValueError("no JSON object in its output")


def pytest_counts(junit_xml: str) -> dict[str, int]:
    """Outcome counts of a pytest run from its JUnit XML."""
    root = ET.fromstring(junit_xml)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "total": n["tests"]}


def figures(overhead: dict) -> dict | None:
    """The headline, like for like, from overhead.py's JSON (None when it gave none): images/s of
    scaletrain's loop and of a bare loop with the same loader (median of their runs) and their
    ratio; that bare loop against one with a resident batch (the input's cost); each loop's
    window spread; the goals; and where the host waits, from the profiles."""
    if "overhead_ratio" not in overhead:
        return None
    med = {k: statistics.median(overhead[f"{k}_images_per_sec"]) for k in ("scaletrain", "bare_loader", "bare_resident")}
    return {
        "overhead": {"scaletrain_images_per_sec": med["scaletrain"], "bare_same_loader_images_per_sec": med["bare_loader"],
                     "ratio": overhead["overhead_ratio"], "goal": overhead["goals"]["overhead_ratio"]},
        "input_cost": {"bare_same_loader_images_per_sec": med["bare_loader"],
                       "bare_resident_batch_images_per_sec": med["bare_resident"], "ratio": overhead["input_ratio"]},
        "window_spread": {**{k: v["spread"] for k, v in overhead["window_spread"].items()},
                          "goal": overhead["goals"]["window_spread"]},
        "goals_met": overhead["goals_met"],
        "host_waits": {k: {"host_wait_ms_per_step": p["host_wait_ms_per_step"], "waits": p["host_waits"],
                           "top_self_cpu": p["top_self_cpu"][:5]}
                       for k, p in overhead.get("host_profile", {}).items()},
        "loader_workers": overhead["loader_workers"],
    }


def assemble(run_info: dict, tests: dict, benchmarks: dict[str, dict], commands: dict[str, list[str]]) -> dict:
    """The check's one JSON object. A benchmark that failed holds {"error": ...}."""
    return {
        "benchmark": "gpu_check",
        "figures": figures(benchmarks.get("overhead", {})),
        "tests": tests,
        "benchmarks": benchmarks,
        "commands": {name: " ".join(cmd) for name, cmd in commands.items()},
        "run_info": run_info,
    }


def passed(result: dict) -> bool:
    t = result["tests"]
    return (t.get("exit_status") == 0 and t.get("failed") == 0 and t.get("errors") == 0
            and not any("error" in b for b in result["benchmarks"].values()))


def result_path(results: Path, utc_time: str, commit: str) -> Path:
    return results / f"gpu-check-{utc_time}-{commit}.json"


def summary(f: dict) -> str:
    """The headline figures in a line."""
    o, w = f["overhead"], f["window_spread"]
    return (f"scaletrain {o['scaletrain_images_per_sec']:.0f} images/s against {o['bare_same_loader_images_per_sec']:.0f} "
            f"for a bare loop with the same loader: {o['ratio']:.3f} (goal {o['goal']}); the input's cost: "
            f"{f['input_cost']['ratio']:.3f} of a resident batch; windows within {percent(w['scaletrain'])} of their "
            f"median (bare loop {percent(w['bare_loader'])}; goal {w['goal']:.0%})")


def percent(x: float | None) -> str:
    return "n/a (no window)" if x is None else f"{x:.0%}"


def say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


def child_env() -> dict[str, str]:
    """This checkout's scaletrain first, a local job's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def git(*args: str) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def run_tests(python: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        junit = Path(d) / "junit.xml"
        cmd = tests_command(python, junit, test_workers())
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest's session: it and the runs it started
            proc.wait()
            rc = None
        counts = pytest_counts(junit.read_text()) if junit.exists() else {}
    return {**counts, "exit_status": rc, "command": " ".join(cmd)}


def run_bench(cmd: list[str], timeout: float = BENCH_TIMEOUT_S) -> dict:
    """The benchmark's JSON (its stdout). Its progress (stderr) goes on to this terminal as it
    comes; the last lines of it stay with the error of a benchmark that failed. It runs in a
    session of its own, so that a timeout ends its processes and theirs."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    tail: deque[str] = deque(maxlen=20)
    out: list[str] = []

    def relay() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line)

    readers = [threading.Thread(target=relay, daemon=True),
               threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)]
    for r in readers:
        r.start()
    try:
        proc.wait(timeout=timeout)
        error = f"exited {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmark's session: it and the processes it started
        proc.wait()
        error = f"did not finish in {timeout:.0f} s"
    for r in readers:
        r.join(timeout=30)  # a process it left behind may hold the pipes open
    if error:
        return {"error": error, "stderr_tail": "".join(tail)}
    try:
        return last_json("".join(out))
    except ValueError as e:
        return {"error": str(e), "stdout_tail": "".join(out)[-2000:]}


def main() -> int:
    t0 = time.perf_counter()
    try:
        import torch
    except ImportError:
        print(f"gpu-check: error: {sys.executable} has no torch: install a CUDA build of torch, or name a Python "
              "that has one (make gpu-check PY_GPU=...)", flush=True)
        return 2
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's scaletrain, as its children get (child_env)
    if failed := import_everything():
        print(f"gpu-check: error: {failed}", flush=True)
        return 2
    why = skip_reason(torch.__version__, torch.version.cuda, torch.cuda.is_available())
    if why:
        print(f"gpu-check: skipped: {why}", flush=True)
        return 0

    from scaletrain.metrics import run_info

    left = lambda: BUDGET_S - (time.perf_counter() - t0)  # noqa: E731 - seconds of the check's budget
    gpus = torch.cuda.device_count()
    info = {**run_info(torch.device("cuda", 0)), "gpus": gpus, "cuda": torch.version.cuda,
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    say(f"{gpus} x {info['device']}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"commit {info['git_commit'][:12]}; at most {BUDGET_S} s")
    say("[1/3] GPU tests: pytest -m gpu tests/gpu")
    tests = run_tests(sys.executable, min(TESTS_TIMEOUT_S, left()))
    say(f"GPU tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('errors', 0)} "
        f"errors, {tests.get('skipped', 0)} skipped (exit status {tests['exit_status']})")
    commands = bench_commands(sys.executable)
    benchmarks = {}
    for i, (name, cmd) in enumerate(commands.items(), start=2):
        if left() < 30:
            benchmarks[name] = {"error": f"not run: the check's {BUDGET_S} s were spent"}
            say(f"[{i}/3] {name}: {benchmarks[name]['error']}")
            continue
        say(f"[{i}/3] {name}: {' '.join(cmd[1:])}")
        t = time.perf_counter()
        benchmarks[name] = run_bench(cmd, min(BENCH_TIMEOUT_S, left()))
        say(f"{name}: {benchmarks[name].get('error', 'done')} ({time.perf_counter() - t:.0f} s)")
    result = assemble(info, tests, benchmarks, commands)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = result_path(RESULTS, time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime()),  # a later run never overwrites
                      git("rev-parse", "--short", "HEAD") or "unknown")
    out.write_text(json.dumps(result, indent=1) + "\n")
    if result["figures"]:
        say(summary(result["figures"]))
    ok = passed(result)
    say(f"{'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
