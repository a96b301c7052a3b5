"""Commands that need no torch load none: `keys`, `plan` (table, json, torchrun) and --help answer
without importing torch or the training code, in a fraction of a second where importing
scaletrain's trainer takes seconds."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys, contextlib, io
from scaletrain.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        rc = main({argv!r})
    except SystemExit as e:  # --help
        rc = e.code
heavy = sorted(m for m in ('torch', 'scaletrain.job', 'scaletrain.run', 'scaletrain.perfmodel.predict') if m in sys.modules)
print(rc, heavy)
"""


@pytest.mark.parametrize("argv", [
    ["keys"],
    ["--help"],
    ["plan", "--recipe", "recipes/digits.toml", "--set", "cluster.nodes=2"],
    ["plan", "--recipe", "recipes/digits.toml", "--format", "json"],
    ["plan", "--recipe", "recipes/digits.toml", "--format", "torchrun", "--set", "cluster.nodes=2",
     "--run-dir", "runs/x"],
])
def test_light_commands_import_no_torch(argv):
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "0" and out.stdout.strip().endswith("[]"), out.stdout
