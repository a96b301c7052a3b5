"""The GPU acceptance check: the GPU tests, then the benchmarks at ResNet-50 224 px, in one JSON.

    make gpu-check                   # .venv's Python: install a CUDA build of torch in it first
    make gpu-check PY_GPU=python3    # a Python that already has a CUDA build of torch
    PYTHONPATH=src python3 benchmarks/gpu_check.py

`make gpu-check` installs .venv from constraints.txt, whose torch 2.13.0 is the CPU build; a
GPU machine without internet cannot install another. PY_GPU names a Python that already has a
CUDA build of torch (any 2.x from 2.4), the project's dependencies (pyproject.toml) and pytest;
make runs this script with it and PYTHONPATH=src, and leaves .venv alone.

Without CUDA it prints one line (`gpu-check: skipped: ...`, naming torch's version and build)
and exits 0 having run nothing. With CUDA it says which part runs, and runs:

1. pytest -m gpu tests/gpu: every CUDA path of scaletrain (tests/gpu/);
2. overhead.py: `scaletrain train` against a bare loop on one GPU, ResNet-50 at 224 px, bf16,
   channels_last;
3. ddp_parity.py: allreduce against a bare DDP loop over NCCL, min(2, GPUs) replicas, the same;
4. ps_path.py --device cuda: the PS path of ResNet-50's gradient from the GPU (its compute is
   emulated, so neither the image size nor the precision enters).

Then it writes benchmarks/results/gpu-check-<UTC time>-<short commit>.json: the images/s per
GPU of scaletrain and of the bare DDP loop and their ratio (ddp_parity's), each benchmark's own
JSON, the tests' outcome counts and run_info. Its exit status is 0 when every test passed and
every benchmark gave its JSON, else 1; the JSON is written either way. The jobs run on this
machine: a scheduler's or launcher's variables (SLURM_*, TORCHELASTIC_*) are left out of their
environment, CUDA_VISIBLE_DEVICES is kept. About 10 minutes on one H100 (4.7 of them the tests).

A run of 50 steps (1.5 s on an H100) spread the bare loop from 1,783 to 2,453 images/s; 300
steps after 30 of warm-up kept the bare loops' three runs within 6%. scaletrain's own runs still
spread from 2,046 to 2,546 (its 10-step windows from 955 to 2,883, the loader's wait 2% in each):
a host-side stall that the next GPU run should find.
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
RESULTS = ROOT / "benchmarks" / "results"
TESTS_TIMEOUT_S = 1800
BENCH_TIMEOUT_S = 1200
RESNET50 = ["--model", "resnet50", "--image-size", "224", "--batch", "64", "--steps", "300", "--warmup", "30",
            "--device", "cuda", "--precision", "bf16", "--channels-last", "--workers", "4"]


def skip_reason(torch_version: str, cuda_build: str | None, available: bool) -> str | None:
    """Why nothing can run here (None: a CUDA GPU is there)."""
    if available:
        return None
    if cuda_build is None:
        return (f"needs a CUDA GPU, and torch {torch_version} is a CPU build: install a CUDA build of torch in "
                ".venv, or run `make gpu-check PY_GPU=python3` with a Python that has one; nothing was run")
    return (f"needs a CUDA GPU, and torch {torch_version} (CUDA {cuda_build}) sees none (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES); nothing was run")


def tests_command(python: str, junit: Path) -> list[str]:
    return [python, "-m", "pytest", "-m", "gpu", "tests/gpu", f"--junitxml={junit}"]


def bench_commands(python: str, gpus: int) -> dict[str, list[str]]:
    """Each benchmark's command line, by name."""
    return {
        "overhead": [python, "benchmarks/overhead.py", *RESNET50, "--repeats", "3"],
        "ddp_parity": [python, "benchmarks/ddp_parity.py", "--replicas", str(min(2, gpus)), *RESNET50,
                       "--repeats", "3"],
        "ps_path": [python, "benchmarks/ps_path.py", "--device", "cuda"],
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


def per_gpu(ddp_parity: dict) -> dict | None:
    """Images/s per GPU of scaletrain and of the bare DDP loop (medians of their runs), and
    their ratio, from ddp_parity's row with the most replicas; None when it gave none."""
    rows = ddp_parity.get("rows") or []
    if not rows:
        return None
    row = max(rows, key=lambda r: r["replicas"])
    ours = statistics.median(row["scaletrain_images_per_sec"]) / row["replicas"]
    bare = statistics.median(row["bare_ddp_images_per_sec"]) / row["replicas"]
    return {"replicas": row["replicas"], "scaletrain": ours, "bare_ddp": bare, "ratio": row["ratio"]}


def assemble(run_info: dict, tests: dict, benchmarks: dict[str, dict], commands: dict[str, list[str]]) -> dict:
    """The check's one JSON object. A benchmark that failed holds {"error": ...}."""
    return {
        "benchmark": "gpu_check",
        "images_per_sec_per_gpu": per_gpu(benchmarks.get("ddp_parity", {})),
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


def run_tests(python: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        junit = Path(d) / "junit.xml"
        cmd = tests_command(python, junit)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=TESTS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest's session: it and the runs it started
            proc.wait()
            rc = None
        counts = pytest_counts(junit.read_text()) if junit.exists() else {}
    return {**counts, "exit_status": rc, "command": " ".join(cmd)}


def run_bench(cmd: list[str]) -> dict:
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
        proc.wait(timeout=BENCH_TIMEOUT_S)
        error = f"exited {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmark's session: it and the processes it started
        proc.wait()
        error = f"did not finish in {BENCH_TIMEOUT_S} s"
    for r in readers:
        r.join(timeout=30)  # a process it left behind may hold the pipes open
    if error:
        return {"error": error, "stderr_tail": "".join(tail)}
    try:
        return last_json("".join(out))
    except ValueError as e:
        return {"error": str(e), "stdout_tail": "".join(out)[-2000:]}


def main() -> int:
    try:
        import torch
    except ImportError:
        print(f"gpu-check: error: {sys.executable} has no torch: install a CUDA build of torch, or name a Python "
              "that has one (make gpu-check PY_GPU=...)", flush=True)
        return 2
    why = skip_reason(torch.__version__, torch.version.cuda, torch.cuda.is_available())
    if why:
        print(f"gpu-check: skipped: {why}", flush=True)
        return 0

    sys.path.insert(0, str(ROOT / "src"))  # this checkout's scaletrain, as its children get (child_env)
    from scaletrain.metrics import run_info

    gpus = torch.cuda.device_count()
    info = {**run_info(torch.device("cuda", 0)), "gpus": gpus, "cuda": torch.version.cuda,
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    say(f"{gpus} x {info['device']}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"commit {info['git_commit'][:12]}")
    t0 = time.perf_counter()
    say("[1/4] GPU tests: pytest -m gpu tests/gpu")
    tests = run_tests(sys.executable)
    say(f"GPU tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('errors', 0)} "
        f"errors, {tests.get('skipped', 0)} skipped (exit status {tests['exit_status']})")
    commands = bench_commands(sys.executable, gpus)
    benchmarks = {}
    for i, (name, cmd) in enumerate(commands.items(), start=2):
        say(f"[{i}/4] {name}: {' '.join(cmd[1:])}")
        t = time.perf_counter()
        benchmarks[name] = run_bench(cmd)
        b = benchmarks[name]
        ratio = b.get("ratio", b.get("min_ratio", b.get("max_ratio")))
        figure = b["error"] if "error" in b else f"ratio {ratio:.3f}" if ratio is not None else "done"
        say(f"{name}: {figure} ({time.perf_counter() - t:.0f} s)")
    result = assemble(info, tests, benchmarks, commands)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = result_path(RESULTS, time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime()),  # a later run never overwrites
                      git("rev-parse", "--short", "HEAD") or "unknown")
    out.write_text(json.dumps(result, indent=1) + "\n")
    g = result["images_per_sec_per_gpu"]
    if g:
        say(f"images/s per GPU: scaletrain {g['scaletrain']:.1f}, bare DDP {g['bare_ddp']:.1f}, ratio {g['ratio']:.3f} "
            f"({g['replicas']} replica{'s' * (g['replicas'] > 1)})")
    ok = passed(result)
    say(f"{'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
