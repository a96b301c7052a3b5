"""A local job that asks more GPUs than this host has fails before anything starts, in one line."""

import subprocess

import pytest
import torch

from .runs import ROOT, local_env, train_cmd

pytestmark = pytest.mark.gpu


def test_more_gpus_than_the_host_has_fails_before_starting_in_one_line(tmp_path):
    gpus = torch.cuda.device_count()
    run_dir = tmp_path / "run"
    r = subprocess.run(train_cmd(run_dir, f"cluster.nodes={gpus + 1}", "cluster.gpus_per_node=1", "train.device=cuda"),
                       env=local_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("scaletrain: error: "), lines[0]
    assert f"need {gpus + 1} GPUs but {gpus} {'is' if gpus == 1 else 'are'} visible here" in lines[0], lines[0]
    assert "cluster.backend = 'gloo'" in lines[0]
    assert not run_dir.exists()  # refused before the run directory, or any process
