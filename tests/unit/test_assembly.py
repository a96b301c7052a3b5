"""assembly.py's pure parts: the straggler's compute (strategy.slow_node, slow_delay_s)."""

from scaletrain.assembly import Slowed, slowed
from scaletrain.config import load_config
from scaletrain.metrics import DeviceTimer

import torch

from conftest import RECIPES


def _cfg(*more):
    return load_config(RECIPES / "digits.toml", ["cluster.nodes=2", "strategy.slow_node=1",
                                                  "strategy.slow_delay_s=0.1", *more])


def test_only_the_slow_nodes_compute_is_slowed():
    timer = DeviceTimer(torch.device("cpu"))
    assert slowed(timer, _cfg(), 0) is timer
    assert isinstance(slowed(timer, _cfg(), 1), Slowed)
    assert slowed(timer, _cfg("strategy.slow_delay_s=0"), 1) is timer


def test_one_sleep_an_update_inside_the_timed_compute():
    """4 micro-batches, 2 to an update: two sleeps of 0.1 s, counted as compute (one a micro-batch: 0.4)."""
    timer = slowed(DeviceTimer(torch.device("cpu")), _cfg("train.grad_accum_steps=2"), 1)
    for _ in range(4):
        timer.start()
        timer.stop()
    assert 0.2 <= timer.seconds() < 0.35, timer.seconds()
