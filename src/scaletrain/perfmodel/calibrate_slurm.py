"""`scaletrain calibrate --slurm`: a calibration as a Slurm job of two nodes, its script written
and, with --submit, handed to sbatch and followed as `scaletrain slurm` does (launch/follow.py).

The job asks for two whole nodes (--exclusive: a measurement shares no node with other jobs) and
its batch step, on the first, runs `scaletrain calibrate` on the recipe as resolved here (paths
made absolute, written beside the script): the one-node figures (compute, optimizer, the input
rate from data.root) are that node's, and each round's network microbenchmark runs as an srun
step of one task on each node (net_where.py). The profile goes to --out, which must be on a file
system the first node writes to: the script names it by its absolute path.

Files: OUT's folder / OUT's stem + "-slurm" / job.sbatch, config.toml and logs/slurm-JOB.out.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

from ..config import Config, dump_toml, load_config
from ..errors import ConfigError, LaunchError
from ..launch import follow, preflight, slurm
from ..models import check_network


def fail(msg: str, code: int = 2) -> int:
    print(f"scaletrain: error: {msg}", file=sys.stderr)
    return code


def job_dir(out: Path) -> Path:
    return out.resolve().parent / f"{out.stem}-slurm"


def script(cfg: Config, folder: Path, out: Path, args: list[str], partition: str = "", time: str = "") -> str:
    """The sbatch script: two nodes, one batch slot each, then `scaletrain calibrate` in the batch step.
    args: calibrate's options other than --recipe and --out (--steps, --runs, --no-input)."""
    if time:
        slurm.time_seconds(time)  # a time Slurm reads, or one line now
    gpus = 0 if cfg.train.device == "cpu" else cfg.cluster.gpus_per_node
    opts = [f"--job-name=scaletrain-calibrate-{out.stem}", f"--output={folder}/logs/slurm-%j.out", "--nodes=2",
            "--ntasks-per-node=1", "--exclusive", *([f"--gpus-per-node={gpus}"] if gpus else []),
            *(f"--{k}={v}" for k, v in (("partition", partition), ("time", time)) if v)]
    cmd = [sys.executable, "-m", "scaletrain", "calibrate", "--recipe", str(folder / "config.toml"),
           "--out", str(out.resolve()), *args]
    return "\n".join([
        "#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
        "# Written by `scaletrain calibrate --slurm`. The batch step runs on the first node: it measures that",
        "# node's figures (compute, optimizer, input) with the local launcher, and in each round the network's",
        "# point-to-point microbenchmark as an srun step of one task on each of the two nodes.",
        f"# {slurm.network_words(cfg.cluster.ifname)}",
        f"mkdir -p {shlex.quote(str(folder / 'logs'))}",
        "exec " + shlex.join(cmd), ""])


def slurm_command(recipe: str | None, overrides: list[str], out: Path, steps: int, runs: int, no_input: bool,
                  partition: str = "", time: str = "", submit: bool = False, wait: bool = False) -> int:
    """Write the job's script (and config.toml) and, with `submit`, sbatch it; with `wait`, follow it
    to its end: its status, as `scaletrain slurm --submit --wait` gives."""
    try:
        cfg = load_config(recipe, overrides)
        check_network(cfg)  # a network that cannot be built here would fail on the node, after the queue
    except ConfigError as e:
        return fail(f"config error: {e}")
    try:
        if runs < 1 or steps < 1:
            raise LaunchError(f"--runs {runs} / --steps {steps}: must be >= 1")
        if wait and not submit:
            raise LaunchError("--wait goes with --submit")
        if cfg.cluster.network == "netns":
            raise LaunchError("calibrate --slurm measures the network between two Slurm nodes; cluster.network = "
                              "netns is the cluster twin, on one machine: drop one of the two")
        if submit and shutil.which("sbatch") is None:
            raise LaunchError("calibrate --slurm --submit: sbatch not found on PATH; run it on a Slurm login node, "
                              "or drop --submit and submit the script there")
        cfg = preflight.absolute_paths(cfg, Path.cwd())  # the job reads them on its node, from wherever it runs
        folder = job_dir(out)
        args = ["--steps", str(steps), "--runs", str(runs), *(["--no-input"] if no_input else [])]
        text = script(cfg, folder, out, args, partition, time)  # a refusal leaves nothing written
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(dump_toml(cfg))
        path = folder / "job.sbatch"
        path.write_text(text)
        print(f"wrote {path}")
        if not submit:
            print(f"submit it with: sbatch {path}")
            return 0
        rc = follow.submit(path, wait)
    except LaunchError as e:
        return fail(str(e))
    if wait and rc == 0:
        print(f"profile: {out}")
    return rc
