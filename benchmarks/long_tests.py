"""The suite's long checks: the tests marked `long` (a minute or more each on two cores), which
`make test` leaves out to keep the suite well inside CI's time, run here with their outcome and
seconds.

    python benchmarks/long_tests.py [--save]

As root, after `make slurm`, for the one that starts an emulated Slurm cluster. Prints one JSON
object; --save also writes it to benchmarks/results/long-tests-<UTC time>-<short commit>.json.
Exits 1 when a test failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/long-tests-TIME-COMMIT.json")
    a = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "long", f"--junitxml={junit}"], cwd=ROOT,
                           stdout=sys.stderr)  # pytest's lines on stderr, the JSON alone on stdout
        cases = ET.parse(junit).getroot().iter("testcase") if junit.exists() else []
        tests = [{"test": f"{c.get('classname')}::{c.get('name')}", "seconds": round(float(c.get("time", 0)), 1),
                  "outcome": next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed")}
                 for c in cases]
    import torch

    from scaletrain.metrics import run_info

    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip() != ""
    out = {"benchmark": "long_tests", "command": "python " + " ".join(sys.argv), **run_info(torch.device("cpu")),
           "git_dirty": dirty, "pytest_exit": r.returncode, "tests": tests, "seconds": round(time.monotonic() - t0)}
    commit = out["git_commit"]
    print(json.dumps(out, indent=1))
    if a.save:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        path = ROOT / "benchmarks" / "results" / f"long-tests-{stamp}-{commit[:7]}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
