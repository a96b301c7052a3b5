"""The warning that a run's input, not its devices, set its pace: judged on the whole run, once."""

import logging

import pytest

from scaletrain.run import SLOW_INPUT, warn_slow_input


@pytest.mark.parametrize("wait, warned", [(0.3, True), (SLOW_INPUT, True), (0.11, False), (0.0, False),
                                          (None, False)])
def test_slow_input_warns_once_past_a_quarter_of_the_run(digits_cfg, caplog, wait, warned):
    caplog.set_level(logging.WARNING, "scaletrain")
    warn_slow_input({"data_wait_fraction": wait}, digits_cfg())
    lines = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert f"{100 * wait:.0f}% of the run's timed training" in lines[0] and "data.workers = 0" in lines[0]


def test_the_job_itself_never_warns_its_command_does(digits_cfg, caplog, monkeypatch, tmp_path):
    """A job whose every batch comes late: run_training, what bench and calibrate run to measure, says
    nothing; the API's train, a user's run, warns once. Each batch is counted as a second's wait on
    the job's clock rather than slept for, so the share is past the bound however busy the machine."""
    from scaletrain import api, run, tracker

    given = tracker.Tracker.inputs

    def late(self, batch):
        self.clock.wait += 1.0
        return given(self, batch)

    monkeypatch.setattr(tracker.Tracker, "inputs", late)
    caplog.set_level(logging.WARNING, "scaletrain")
    cfg = digits_cfg("train.steps=8", "train.log_every=1", "train.warmup_log_steps=1", "train.eval_every=0",
                     "train.checkpoint_every=0", "data.batch_size=8", "model.width=4")
    summary = run.run_training(cfg, tmp_path / "measured", progress=False)
    assert summary["data_wait_fraction"] > SLOW_INPUT
    assert "waited for data" not in caplog.text
    api.train(cfg, run_dir=tmp_path / "asked", progress=False)
    assert caplog.text.count("waited for data") == 1
