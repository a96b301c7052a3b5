"""assembly.py's pure parts: the straggler's compute timer (strategy.slow_node, slow_delay_s)."""

import torch

from scaletrain.assembly import Slowed, compute_timer
from scaletrain.config import load_config
from scaletrain.metrics import DeviceTimer

from conftest import RECIPES

CPU = torch.device("cpu")


def _cfg(*more):
    return load_config(RECIPES / "digits.toml", ["cluster.nodes=2", "strategy.slow_node=1",
                                                  "strategy.slow_delay_s=0.1", *more])


def test_only_the_slow_nodes_compute_is_slowed():
    assert type(compute_timer(_cfg(), 0, CPU, lambda: True)) is DeviceTimer
    assert isinstance(compute_timer(_cfg(), 1, CPU, lambda: True), Slowed)
    assert type(compute_timer(_cfg("strategy.slow_delay_s=0"), 1, CPU, lambda: True)) is DeviceTimer


def test_one_sleep_an_update_inside_the_timed_compute():
    """4 micro-batches, 2 to an update: two sleeps of 0.1 s, counted as compute (one a micro-batch: 0.4),
    by start/stop as job.batches() and job.step() call them, and by timing() alike."""
    micro = [0]
    timer = compute_timer(_cfg(), 1, CPU, lambda: micro[0] % 2 == 0)
    for i in range(4):
        micro[0] = i
        if i < 2:
            timer.start()
            timer.stop()
        else:
            with timer.timing():
                pass
    assert 0.2 <= timer.seconds() < 0.35, timer.seconds()
