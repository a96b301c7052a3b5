"""ResNet-50 bf16 images/s on one GPU with JPEGs decoded on the GPU (data.decode = "device": nvJPEG)
against decoded by the loader processes (data.decode = "loader": libjpeg-turbo), from image files.

Writes --count JPEGs (benchmarks/input.py's: 500x375 crops of scikit-learn's two photographs at
quality 90) into an image folder, then runs `scaletrain train` on GPU 0 once per decode, the same
job otherwise: ResNet-50 at 224 px, bf16 autocast, channels_last, resized-crop + flip, --batch
images a step, --workers loader processes, --steps steps of which --warmup are left out of the
figures. Both runs read the same files from the page cache, so the difference is the decode's
place, not the disk. Prints one JSON object: per decode the run's images/s (summary.json's, with
its standard error, jitter and slowest window) and the share of step time it waited for data, the
ratio device / loader, the command of each run and run_info. Without a CUDA GPU it prints one line,
`gpu-decode: skipped: ...`, and exits 0 having run nothing.

    python benchmarks/gpu_decode.py [--count 2048 --batch 128 --steps 200 --warmup 20 --workers 4]
    python benchmarks/gpu_decode.py --save       # also benchmarks/results/gpu-decode-<UTC time>-<commit>.json
    python benchmarks/gpu_decode.py --cpu-smoke  # the script's own check on a CPU: ResNet-8, 32 px, no figure

About 2 minutes on a current GPU at the defaults (two runs of 200 steps, and their start-up).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return f"no CUDA GPU visible (torch {torch.__version__}, {build})"
    return None


def write_images(root: Path, count: int) -> tuple[dict, int]:
    """input.py's image folder and its class count (loaded by path: benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_input", ROOT / "benchmarks" / "input.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_images(root, count), mod.CLASSES


def job_sets(root: Path, classes: int, decode: str, a) -> list[str]:
    if a.cpu_smoke:
        model = ["model.name=resnet8", "model.width=8", "data.image_size=32", "train.device=cpu", "train.threads=1"]
    else:
        model = ["model.name=resnet50", "data.image_size=224", "train.device=cuda", "train.precision=bf16",
                 "train.channels_last=true"]
    return model + [f"model.num_classes={classes}", "data.name=imagefolder", f"data.root={root}",
                    "data.test_fraction=0", "data.augment=resized-crop+flip", f"data.batch_size={a.batch}",
                    f"data.workers={a.workers}", f"data.decode={decode}", f"train.steps={a.steps}",
                    f"train.warmup_log_steps={a.warmup}", f"train.log_every={1 if a.cpu_smoke else 10}", "train.eval_every=0",
                    "train.checkpoint_every=0", "optim.warmup_steps=0"]


def run(run_dir: Path, sets: list[str]) -> tuple[dict, str]:
    # digits.toml for the optimizer; every setting of the job's input, network and device is set here
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--recipe", str(ROOT / "recipes" / "digits.toml"),
           "--run-dir", str(run_dir), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    # a local job on this machine's GPU: a scheduler's or launcher's rank variables are left out
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"gpu-decode: the data.decode run in {run_dir.name} exited {p.returncode}: {last}")
    return json.loads((run_dir / "summary.json").read_text()), " ".join(cmd)


FIGURES = ("images_per_sec", "images_per_sec_stderr", "images_per_sec_mad", "slowest_window_fraction",
           "timed_windows", "data_wait_fraction", "device", "not_applied")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2048, help="JPEGs written")
    ap.add_argument("--batch", type=int, default=128, help="images a step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="first steps left out of the figures")
    ap.add_argument("--workers", type=int, default=4, help="loader processes (data.workers), the same for both")
    ap.add_argument("--cpu-smoke", action="store_true", help="check the script on a CPU (no figure)")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/gpu-decode-TIME-COMMIT.json")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.count, a.batch, a.steps, a.warmup, a.workers = 32, 8, 4, 1, 1
    elif (why := skip_reason()) is not None:
        print(f"gpu-decode: skipped: {why}")
        return 0
    from scaletrain.metrics import git_commit, run_info  # after the skip: a CPU machine needs none of it

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        images, classes = write_images(root, a.count)
        runs, commands = {}, {}
        for decode in ("loader", "device"):
            summary, commands[decode] = run(Path(tmp) / decode, job_sets(root, classes, decode, a))
            runs[decode] = {k: summary.get(k) for k in FIGURES}
    rates = [runs[d]["images_per_sec"] for d in ("device", "loader")]
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    result = {"benchmark": "gpu-decode", "smoke": a.cpu_smoke, "images": images, "batch": a.batch,
              "steps": a.steps, "warmup_steps": a.warmup, "loader_processes": a.workers, "cpus": os.cpu_count(),
              "runs": runs, "device_over_loader": rates[0] / rates[1] if all(rates) else None,
              "commands": commands, **run_info(device)}
    print(json.dumps(result, indent=1))
    if a.save and not a.cpu_smoke:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        out = ROOT / "benchmarks" / "results" / f"gpu-decode-{stamp}-{git_commit()[:7]}.json"
        out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), **result}, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
