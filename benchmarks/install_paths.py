"""The install paths of a machine whose Python already has torch, tried in a fresh environment.

A new virtual environment gets only torch (this checkout's .venv's version) and pytest, as a
stock CUDA PyTorch image has them; then, as a cluster user runs them:

1. `make gpu-bundle`, then `make gpu-check PY_GPU=<that python>` with no package index (pip's
   configuration and find-links cleared, PIP_NO_INDEX=1): on a machine without CUDA it must print
   the bundle's install line and its one skip line, and exit 0, having imported everything;
2. what pip would do to that torch (pip install --dry-run): for `.[torchvision]` as it stands, and
   with the installed torch's own version as a requirement, as `make install-into-env` asks;
3. `make install-into-env PY=<that python>`: scaletrain and its dependencies installed, torch
   untouched.

torch is "untouched" when its version, its directory and its library files (their inodes, sizes
and modification times) are the same before and after. Prints one JSON object. Minutes: the
environment's torch alone is hundreds of MB to unpack, and step 3 installs the project's
dependencies (scikit-learn, scipy, matplotlib, tensorboard) from the package index.

    python benchmarks/install_paths.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.metrics import run_info

ROOT = Path(__file__).resolve().parents[1]
NO_INDEX = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
TORCH_STATE = ("import json, os, torch; d = os.path.dirname(torch.__file__); "
               "libs = sorted(f for f in os.listdir(os.path.join(d, 'lib')) if f.endswith('.so')); "
               "st = {f: os.stat(os.path.join(d, 'lib', f)) for f in libs}; "
               "print(json.dumps({'version': torch.__version__, 'dir': d, "
               "'libs': {f: [s.st_ino, s.st_size, s.st_mtime_ns] for f, s in st.items()}}))")


def run(cmd: list[str], env: dict | None = None, timeout: int = 900) -> tuple[int, str, str, float]:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       timeout=timeout)
    return r.returncode, r.stdout, r.stderr, round(time.perf_counter() - t, 1)


def torch_state(python: str) -> dict:
    rc, out, err, _ = run([python, "-c", TORCH_STATE])
    if rc:
        raise SystemExit(f"install_paths: torch does not import in {python}: {err.strip()[-300:]}")
    return json.loads(out)


def would_install(python: str, *reqs: str) -> list[str]:
    """name==version of what `pip install REQS` would install or replace there (pip's dry run)."""
    rc, out, err, _ = run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                           "--disable-pip-version-check", *reqs])
    if rc:
        return [f"error: {err.strip().splitlines()[-1] if err.strip() else rc}"]
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(out)["install"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="make the environment here and keep it (default: a temporary one)")
    a = ap.parse_args()
    where = a.keep or Path(tempfile.mkdtemp(prefix="install-paths-"))
    venv, out = where / "env", {"benchmark": "install_paths", "torch": torch.__version__.split("+")[0]}
    try:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        rc, _, err, _ = run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                             f"torch=={out['torch']}", "pytest"])
        if rc:
            raise SystemExit(f"install_paths: torch and pytest did not install: {err.strip()[-400:]}")
        out["fresh_env_s"] = round(time.perf_counter() - t, 1)
        rc, names, _, _ = run([py, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"])
        out["fresh_env"] = names.split()
        before = torch_state(py)

        rc, stdout, stderr, s = run(["make", "--no-print-directory", "gpu-bundle"])
        manifest = json.loads((ROOT / ".gpu-bundle" / "bundle.json").read_text()) if rc == 0 else {}
        out["gpu_bundle"] = {"exit_status": rc, "seconds": s, "stdout": stdout.strip().splitlines()[-1:],
                             "MiB": round(manifest.get("bytes", 0) / 2**20, 1), "wheels": manifest.get("wheels")}
        rc, stdout, stderr, s = run(["make", "--no-print-directory", "gpu-check", f"PY_GPU={py}"], env=NO_INDEX)
        out["gpu_check"] = {"exit_status": rc, "seconds": s, "stdout": stdout.strip().splitlines(),
                            "stderr_tail": stderr.strip().splitlines()[-5:],
                            "torch_untouched": torch_state(py) == before}

        out["pip_would_install"] = {
            "'.[torchvision]'": would_install(py, ".[torchvision]"),
            f"'.[torchvision]' 'torch=={before['version']}'": would_install(py, ".[torchvision]",
                                                                           f"torch=={before['version']}")}

        rc, stdout, stderr, s = run(["make", "--no-print-directory", "install-into-env", f"PY={py}"])
        imports, _, ierr, _ = run([py, "-c", "import scaletrain.cli, sklearn, matplotlib"])
        out["install_into_env"] = {"exit_status": rc, "seconds": s, "stdout_head": stdout.strip().splitlines()[:1],
                                   "stderr_tail": stderr.strip().splitlines()[-3:] if rc else [],
                                   "scaletrain_imports": imports == 0, "torch_untouched": torch_state(py) == before}
        out["torch_before"] = {"version": before["version"], "dir": before["dir"], "libs": len(before["libs"])}
    finally:
        if not a.keep:
            shutil.rmtree(where, ignore_errors=True)
    print(json.dumps({**out, **run_info(torch.device("cpu"))}, indent=1))


if __name__ == "__main__":
    main()
