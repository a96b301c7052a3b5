"""A scheduler's stop is a stop: SIGTERM to every process of a job, loader processes included, as
Slurm sends it (scancel, preemption, requeue, a time limit without the warning signal), ends with
a complete checkpoint and exit 75, naming no rank and printing no traceback."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_faults import cmd, descendants, no_orphans, start, wait_training


def tracebacks(run_dir, err):
    logs = "".join(f.read_text() for f in (run_dir / "logs").glob("*.log"))
    return [text for text in (err, logs) if "Traceback" in text or "Error" in text]


@pytest.mark.parametrize("sets", [["strategy.name=allreduce"], ["strategy.name=sync", "cluster.num_ps=1"],
                                  ["strategy.name=local-sgd", "strategy.sync_every=64"],
                                  ["strategy.name=allreduce", "cluster.survive_loss=true"]],
                         ids=["allreduce", "sync", "local-sgd", "allreduce-survive"])
def test_sigterm_to_every_process_of_a_job_with_loaders_is_a_stop(tmp_path, env, sets):
    run_dir = tmp_path / "run"
    sets = [*sets, "data.workers=1"]
    p = start(run_dir, env, *sets, "train.steps=100000")
    procs = wait_training(p, run_dir, 2 + ("cluster.num_ps=1" in sets))
    tree = descendants(p.pid)
    assert len(tree) >= len(procs) + 2, tree  # the two workers' loader processes among them
    os.killpg(p.pid, signal.SIGTERM)  # every process of the job, as Slurm signals a step
    _, err = p.communicate(timeout=90)
    assert p.returncode == 75, err
    no_orphans(procs)
    assert not tracebacks(run_dir, err), err
    assert "rank" not in err.splitlines()[-1], err
    steps = sorted(int(f.stem[5:]) for f in (run_dir / "checkpoints").glob("ckpt-*.pt"))
    assert f"stopped at step {steps[-1]}; its checkpoint is complete" in err, err
    if "strategy.name=local-sgd" in sets:  # the replicas met at the stop, not at the next multiple of 64
        assert steps[-1] % 64, steps
    # The checkpoint resumes: the run goes on from it to its end.
    r = subprocess.run(cmd(run_dir, *sets, f"train.steps={steps[-1] + 5}") + ["--resume"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads((run_dir / "summary.json").read_text())["start_step"] == steps[-1]


def children(pid):
    """The processes whose parent is pid."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return out


def importing_torch(pid):
    """Whether the process has begun to load torch's libraries (and so is past its entry point's top)."""
    try:
        return "libtorch" in (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return False


ENTRIES = {"python -m scaletrain": [sys.executable, "-m", "scaletrain"],  # what a Slurm job's script runs
           "python -m scaletrain.cli": [sys.executable, "-m", "scaletrain.cli"],
           "scaletrain": [str(Path(sys.executable).parent / "scaletrain")]}  # the installed command


@pytest.mark.parametrize("entry", ENTRIES)
def test_sigterm_while_importing_is_a_stop_before_training(tmp_path, env, entry):
    """A stop signal in the seconds Python spends importing torch: exit 75 and one line, not 143 and
    nothing, so that a wrapper that requeues on 75 does."""
    run_dir = tmp_path / "run"
    args = cmd(run_dir, "strategy.name=allreduce")[3:]  # the arguments after `python -m scaletrain.cli`
    p = subprocess.Popen(ENTRIES[entry] + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    while not importing_torch(p.pid):
        assert p.poll() is None, p.communicate()
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 75, (out, err)
    assert err.splitlines() == ["scaletrain: stopped by SIGTERM before training began: nothing to checkpoint"], err
    assert not (run_dir / "logs").exists()  # no process of the job was started


def test_sigterm_to_a_job_process_still_starting_stops_the_job(tmp_path, env):
    """A job process of the local launcher signalled before it can act on it (forked, not yet joined): it
    holds the signal until its handlers are in place, and the whole job stops at its first sync point."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "train.steps=100000")
    while not (forked := [pid for starter in children(p.pid) for pid in children(starter)]):  # the starter's forks
        assert p.poll() is None, p.communicate()
        time.sleep(0.005)
    os.kill(forked[0], signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    assert "stopped" in err.splitlines()[-1] and "failed" not in err and "Traceback" not in err, err
