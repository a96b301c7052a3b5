"""A frozen chief (SIGSTOP of rank 0: on a cluster an NFS stall, swapping, a hung driver) is named
within the liveness bound under every strategy, and the job ends, as a frozen worker or PS does.

Rank 0 serves the job's store, where every heartbeat is read: frozen, it answers no one, and a
request to it waits for ever (comm/liveness.py's _StoreWatch)."""

import os
import signal
import time

import pytest

from scaletrain.strategies.traits import REGISTRY
from test_faults import no_orphans, start, wait_training

TIMEOUT_S = 3


@pytest.mark.parametrize("strategy", sorted(REGISTRY))
def test_a_frozen_chief_is_named_and_the_job_ends_within_the_bound(tmp_path, env, strategy):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, f"strategy.name={strategy}", f"cluster.num_ps={int(REGISTRY[strategy].uses_ps)}",
              f"cluster.timeout_s={TIMEOUT_S}", "train.steps=100000")
    procs = wait_training(p, run_dir, 2 + REGISTRY[strategy].uses_ps)
    os.kill(procs[0], signal.SIGSTOP)
    t0 = time.time()
    try:
        _, err = p.communicate(timeout=60)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)  # a hung job: its processes must not outlive the test
        raise
    elapsed = time.time() - t0
    assert p.returncode == 1, err
    # The others give the store as long as a silent peer (3 s + cluster.timeout_s), then the launcher kills
    # the frozen one and every process ends: 9 s here on an idle host, 14 s at a load of 5 on 2 cores.
    assert elapsed <= TIMEOUT_S + 15, (elapsed, err)
    assert err.splitlines()[-1] == ("scaletrain: error: the job failed: rank 0 (worker 0 on node 1) stopped "
                                    f"answering (frozen or hung) and was killed; logs in {run_dir / 'logs'}"), err
    no_orphans(procs)
