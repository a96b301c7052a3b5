"""The suite as pytest finds it: every test file under tests/ is collected by a plain `pytest`
(a folder pytest skips by default, as it does one named dist, would drop its tests silently)."""

import subprocess
import sys

from conftest import ROOT


def test_every_test_file_is_collected():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()
    assert {f.split("/")[1] for f in collected} == {"unit", "dist", "faults", "e2e", "gpu"}
