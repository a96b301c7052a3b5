"""The GPU check's Python packages, brought to a GPU machine that has no package index.

    python benchmarks/gpu_bundle.py write [--out .gpu-bundle] [--python-version 3.12] [--arch x86_64]
    python3 benchmarks/gpu_bundle.py install [--bundle .gpu-bundle] [--target .gpu-site]

`write` (make gpu-bundle, where pip reaches a package index) downloads as wheels every package
that benchmarks/gpu_check.py and what it runs import, beside torch and pytest, for the GPU
machine's Python and processor: numpy, Pillow, simplejpeg, safetensors, tensorboard (and the
protobuf and absl-py it imports), rich (and its parts), tomli-w, simpy, pytest-timeout and
pytest-xdist, at versions pip resolves together within pyproject.toml's ranges, and pip itself. Never torch, CUDA
or anything that depends on them: the GPU machine's own CUDA build of torch is the one tested.
At most 64 MiB (MAX_BYTES), so that it travels with a checkout; bundle.json lists it.

`install` (make gpu-check PY_GPU=...; standard library only, run by that Python) installs, with
no package index, the bundle's wheels of the packages that Python lacks into --target, which
make then puts on PYTHONPATH behind this checkout's src. A package the Python has, at any
version, is left as it is and not shadowed: the image's numpy is the one its torch was built
against. Nothing is installed into the Python's own environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 64 * 1024 * 1024
MANIFEST = "bundle.json"
# Distribution -> the module the check imports of it. The first group is pyproject.toml's own
# (their ranges come from there); the second, what those import of their dependencies. Left out:
# scikit-learn and scipy (45 MB a Python; only the digits data set needs them, and the GPU tests
# train on synthetic images), matplotlib (reports only), and tensorboard's server parts (grpcio,
# tensorboard-data-server, werkzeug, markdown), which writing event files does not import.
PACKAGES = {
    "numpy": "numpy", "pillow": "PIL", "simplejpeg": "simplejpeg", "safetensors": "safetensors",
    "tensorboard": "tensorboard", "rich": "rich", "tomli-w": "tomli_w", "simpy": "simpy",
    "pytest-timeout": "pytest_timeout", "pytest-xdist": "xdist",
    "protobuf": "google.protobuf", "execnet": "execnet", "absl-py": "absl", "pygments": "pygments", "markdown-it-py": "markdown_it",
    "mdurl": "mdurl",
}


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them (Pillow, pillow; tomli_w, tomli-w)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """The canonical distribution name of a wheel's file name (name-version-...whl)."""
    return canonical(filename.split("-")[0])


def project_ranges(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """Canonical name -> requirement string, from pyproject.toml's dependencies and test extra."""
    p = tomllib.loads(pyproject.read_text())["project"]
    reqs = [*p["dependencies"], *p.get("optional-dependencies", {}).get("test", [])]
    return {canonical(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]): r for r in reqs}


# Not the project's own: the check runs the GPU tests 3 at a time with it (gpu_check.test_workers).
HELPERS = ["pytest-xdist"]


def requirements(ranges: dict[str, str]) -> list[str]:
    """What `write` asks pip for: the project's packages the check imports, with their ranges, and HELPERS."""
    return [ranges[name] for name in PACKAGES if name in ranges] + HELPERS


def platforms(arch: str) -> list[str]:
    """manylinux tags a current Linux GPU machine takes, newest first (pip matches each exactly)."""
    return [f"manylinux_2_{n}_{arch}" for n in (28, 27, 17)] + [f"manylinux2014_{arch}"]


def missing(wheels: list[str], installed: set[str]) -> list[str]:
    """The bundle's wheels (file names) of the packages not among `installed` (canonical names)."""
    return [w for w in wheels if wheel_name(w) not in installed and wheel_name(w) != "pip"]


def size_error(files: dict[str, int], limit: int = MAX_BYTES) -> str | None:
    """None, or the one line saying that the bundle is over its limit, with its largest files."""
    total = sum(files.values())
    if total <= limit:
        return None
    largest = ", ".join(f"{n} ({b / 2**20:.1f} MiB)" for n, b in sorted(files.items(), key=lambda f: -f[1])[:3])
    return f"{total / 2**20:.1f} MiB is over the bundle's {limit / 2**20:.0f} MiB; the largest: {largest}"


def write(out: Path, python_version: str, arch: str) -> dict:
    """Download the bundle into `out` (emptied first) and write its manifest."""
    reqs = requirements(project_ranges())
    with tempfile.TemporaryDirectory() as d:
        # With dependencies, so that the versions pip picks fit together; only PACKAGES' are kept.
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               *sum((["--platform", p] for p in platforms(arch)), []), "--dest", d, *reqs, "pip"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            tail = [line for line in r.stderr.splitlines() if line.startswith("ERROR")] or r.stderr.splitlines()[-1:]
            raise SystemExit(f"gpu-bundle: pip download failed for Python {python_version} on {arch}: "
                             f"{' '.join(tail)[:600]}")
        got = {f.name: f for f in Path(d).glob("*.whl") if wheel_name(f.name) in {*PACKAGES, "pip"}}
        lacking = sorted(set(PACKAGES) - {wheel_name(n) for n in got})
        if lacking:
            raise SystemExit(f"gpu-bundle: pip resolved no wheel of {', '.join(lacking)} for Python {python_version}")
        files = {n: f.stat().st_size for n, f in got.items()}
        if err := size_error(files):
            raise SystemExit(f"gpu-bundle: {err}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for n, f in got.items():
            shutil.copy2(f, out / n)
    manifest = {"python_version": python_version, "arch": arch, "wheels": sorted(files),
                "bytes": sum(files.values())}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def installed_names() -> set[str]:
    """Canonical names of the distributions this Python has (its environment, not PYTHONPATH's extras)."""
    return {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions() if d.metadata["Name"]}


def pip_command(bundle: Path, wheels: list[str]) -> list[str]:
    """This Python's pip, or the bundle's pip wheel run as pip where it has none (a wheel of pip is
    runnable: python pip-X.whl/pip)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    own = [w for w in wheels if wheel_name(w) == "pip"]
    if not own:
        raise SystemExit(f"gpu-check: {sys.executable} has no pip, and {bundle} holds no pip wheel: "
                         "make gpu-bundle again")
    return [sys.executable, str(bundle / own[0] / "pip")]


def install(bundle: Path, target: Path) -> list[str]:
    """Install into `target` (made anew) the bundle's wheels of what this Python lacks; returns them."""
    if target.exists():
        shutil.rmtree(target)
    if not (bundle / MANIFEST).is_file():
        return []  # no bundle: the check says what does not import, and how to bring it
    manifest = json.loads((bundle / MANIFEST).read_text())
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != mine or manifest["arch"] != platform.machine():
        raise SystemExit(f"gpu-check: {bundle} holds wheels for Python {manifest['python_version']} on "
                         f"{manifest['arch']}, and {sys.executable} is Python {mine} on {platform.machine()}: "
                         f"run `make gpu-bundle GPU_PYTHON={mine}` where pip reaches a package index")
    todo = missing(manifest["wheels"], installed_names())
    if todo:
        cmd = [*pip_command(bundle, manifest["wheels"]), "install", "--quiet", "--disable-pip-version-check",
               "--no-index", "--no-deps", "--target", str(target), *(str(bundle / w) for w in todo)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"gpu-check: installing {bundle}'s wheels failed: {r.stderr.strip()[-600:]}")
    return todo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="download the bundle (needs a package index)")
    w.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle")
    w.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the GPU machine's Python, e.g. 3.12 (default: this one's)")
    w.add_argument("--arch", default=platform.machine(), help="the GPU machine's processor (default: this one's)")
    i = sub.add_parser("install", help="install what this Python lacks from the bundle (no package index)")
    i.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle")
    i.add_argument("--target", type=Path, default=ROOT / ".gpu-site")
    a = ap.parse_args()
    if a.command == "write":
        m = write(a.out, a.python_version, a.arch)
        print(f"gpu-bundle: {len(m['wheels'])} wheels for Python {m['python_version']} on {m['arch']}, "
              f"{m['bytes'] / 2**20:.1f} MiB (at most {MAX_BYTES / 2**20:.0f}) in {a.out}")
    else:
        done = install(a.bundle, a.target)
        if done:
            names = ", ".join(w.split("-")[0] for w in done)
            print(f"gpu-check: installed from {a.bundle} into {a.target}: {names}", flush=True)


if __name__ == "__main__":
    main()
