"""A job's start-up over a large manifest of small files, by process count: launch to first step.

Writes --files tiny PNGs (16x16, a few hundred bytes each) and a manifest of --rows
`path,label` rows over them (one file a row when --files equals --rows; else the rows
cycle over the files), plus a --small-row manifest over the same files as the baseline:
what starting the processes costs without the manifest (imports, rendezvous, model). Then
it runs `scaletrain train` with the local launcher on emulated nodes (2 replicas a node:
--procs 2 = 1 node, 8 = 4 nodes), resnet8, data.workers = 0, one torch thread a process,
--steps steps, no test set. start_s is launch -> the first train row of metrics.jsonl
(its `time`), so it holds the launcher, every process's start, reading the manifest,
checking its files, the rendezvous and one step. cpu_s is the CPU time of the whole job
(launcher and processes: user + system), which the load of other jobs blurs less. manifest_s is start_s over the large
manifest less over the small one, medians of --repeats runs, made round-robin over the
rows so a change in machine load hits all of them; paired_manifest_s is the median of
each repeat's difference (its two runs were made one after the other), manifest_cpu_s
the same of cpu_s.

--count-stats adds one run a row under strace: image_stats counts the metadata calls on the
image files (stat, access: everything but opens) in the whole job, stat_processes the
processes that made them, image_opens the files the steps read.

--before REV runs the same rows with the scaletrain of commit REV too (its src/ from git
archive), so one file holds both. Prints one JSON object; --save also writes it to
benchmarks/results/manifest-startup-<UTC>-<commit>.json.

    python benchmarks/manifest_startup.py [--rows 200000 --files 200000 --procs 2 8 --repeats 2]
    python benchmarks/manifest_startup.py --before b17e701 --save
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 10


def write_data(root: Path, rows: int, files: int, small: int) -> dict:
    """root/img/DDD/NNNNNN.png (1,000 a directory), root/large.csv and root/small.csv; seconds taken."""
    t0 = time.perf_counter()
    rng = np.random.RandomState(0)
    blobs = []
    for _ in range(CLASSES):  # a few distinct images, written over and over: only the files' count matters
        buf = io.BytesIO()
        Image.fromarray(rng.randint(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    names = [f"img/{i // 1000:03d}/{i:06d}.png" for i in range(files)]
    for i, name in enumerate(names):
        if i % 1000 == 0:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(blobs[i % CLASSES])
    for csv, n in (("large.csv", rows), ("small.csv", small)):
        (root / csv).write_text("path,label\n" + "".join(f"{names[i % files]},{i % files % CLASSES}\n"
                                                         for i in range(n)))
    return {"write_s": round(time.perf_counter() - t0, 1)}


def source_tree(rev: str, into: Path) -> Path:
    """src/ of commit rev, unpacked under into."""
    tar = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / "src"


def git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


def count_calls(trace: Path, images: str) -> dict:
    """Calls on the image files in an strace -f log (lines: PID syscall(args) = result)."""
    calls = [line.split(None, 2)[:2] for line in trace.read_text().splitlines() if images in line]
    stats = [(pid, call) for pid, call in calls if not call.startswith("open")]
    return {"image_stats": len(stats), "stat_processes": len({pid for pid, _ in stats}),
            "image_opens": len(calls) - len(stats)}


def one_run(src: Path, manifest: Path, procs: int, steps: int, run_dir: Path, trace: Path | None = None) -> dict:
    sets = {"model.num_classes": CLASSES, "model.width": 8, "data.name": "manifest", "data.root": manifest,
            "data.image_size": 16, "data.batch_size": 8, "data.augment": "[]", "data.workers": 0,
            "data.test_fraction": 0.0, "train.steps": steps, "train.log_every": 1, "train.warmup_log_steps": 0,
            "train.eval_every": 0, "train.checkpoint_every": 0, "train.threads": 1,
            "cluster.nodes": max(1, procs // 2), "cluster.gpus_per_node": min(procs, 2)}
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--recipe", str(ROOT / "recipes" / "digits.toml"),
           "--quiet", "--run-dir", str(run_dir)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    if trace:  # every file call of the job's processes, the launcher's included
        cmd = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(trace), *cmd]
    cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))  # noqa: E731
    c0, t0 = cpu(), time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    total, cpu_s = time.time() - t0, cpu() - c0  # the launcher waited for its processes: their time is in
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
    first = min(r["time"] for r in rows if r["kind"] == "train")
    out = {"start_s": round(first - t0, 2), "total_s": round(total, 2), "cpu_s": round(cpu_s, 2)}
    return {**out, **count_calls(trace, str(manifest.parent / "img") + "/")} if trace else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--files", type=int, default=0, help="image files written (0 = one a row)")
    ap.add_argument("--small", type=int, default=2_000, help="rows of the baseline manifest")
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--before", metavar="REV", help="also run the scaletrain of this commit")
    ap.add_argument("--count-stats", action="store_true", help="also count calls on the image files (strace)")
    ap.add_argument("--save", action="store_true", help="write the JSON under benchmarks/results/ too")
    a = ap.parse_args()
    files = a.files or a.rows
    commit = git("rev-parse", "HEAD")
    with tempfile.TemporaryDirectory(prefix="manifest-startup-") as tmp:
        tmp = Path(tmp)
        (tmp / "data").mkdir()
        written = write_data(tmp / "data", a.rows, files, a.small)
        print(f"manifest_startup: wrote {files} files and {a.rows} rows in {written['write_s']} s", file=sys.stderr)
        trees = {"after": (ROOT / "src", commit)}
        if a.before:
            trees = {"before": (source_tree(a.before, tmp / "before"), git("rev-parse", a.before)), **trees}
        cells = [(tree, procs, which) for procs in a.procs for tree in trees for which in ("large", "small")]
        got: dict = {c: [] for c in cells}
        for rep in range(a.repeats):
            for c in cells:
                tree, procs, which = c
                r = one_run(trees[tree][0], tmp / "data" / f"{which}.csv", procs, a.steps,
                            tmp / f"run-{tree}-{procs}-{which}-{rep}")
                got[c].append(r)
                print(f"manifest_startup: {tree} {procs} processes, {which} manifest: {r}", file=sys.stderr)
        counted = {}
        for tree, procs in ((t, n) for n in a.procs for t in trees) if a.count_stats else ():
            counted[(tree, procs)] = one_run(trees[tree][0], tmp / "data" / "large.csv", procs, a.steps,
                                             tmp / f"run-{tree}-{procs}-strace", trace=tmp / "trace")
            print(f"manifest_startup: {tree} {procs} processes under strace: {counted[(tree, procs)]}",
                  file=sys.stderr)
    results = []
    for tree in trees:
        for procs in a.procs:
            runs = {w: got[(tree, procs, w)] for w in ("large", "small")}
            med = {w: statistics.median(r["start_s"] for r in runs[w]) for w in runs}
            paired = {k: statistics.median(l[k] - s[k] for l, s in zip(runs["large"], runs["small"]))
                      for k in ("start_s", "cpu_s")}
            results.append({"tree": tree, "commit": trees[tree][1], "procs": procs,
                            "start_s": med["large"], "start_small_s": med["small"],
                            "manifest_s": round(med["large"] - med["small"], 2), "paired_manifest_s": round(paired["start_s"], 2),
                            "manifest_cpu_s": round(paired["cpu_s"], 2),
                            **({"strace": counted[(tree, procs)]} if (tree, procs) in counted else {}), "runs": runs})
    from scaletrain.metrics import run_info  # torch: only once the jobs are done
    import torch

    out = {"benchmark": "manifest_startup", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "rows": a.rows, "files": files, "small_rows": a.small, "steps": a.steps, "repeats": a.repeats,
           "cpus": os.cpu_count(), **written, "results": results, "run_info": run_info(torch.device("cpu"))}
    text = json.dumps(out, indent=1)
    print(text)
    if a.save:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        path = ROOT / "benchmarks" / "results" / f"manifest-startup-{stamp}-{commit[:7]}.json"
        path.write_text(text + "\n")
        print(f"manifest_startup: saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
