"""Checkpoints and weights under real faults, through the command line in real processes: a full
disk (a small tmpfs), damaged and unsafe files, a chief killed in the middle of a write."""

import json
import os
import pickle
import re
import select
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT, scaletrain_cmd

SMALL = ["data.workers=0", "train.eval_every=0", "train.log_every=2"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


class Evil:
    def __reduce__(self):
        return (print, ("unsafe code ran",))


def cmd(run_dir, *sets, resume=False):
    args = ["train", "--recipe", "recipes/digits.toml", "--run-dir", str(run_dir), "--quiet",
            *(["--resume"] if resume else [])]
    for s in [*SMALL, *sets]:
        args += ["--set", s]
    return scaletrain_cmd(*args)


def cli(run_dir, *sets, env, resume=False):
    return subprocess.run(cmd(run_dir, *sets, resume=resume), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def error_line(r):
    """The one error line of a failed command (and no traceback)."""
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("scaletrain: error")]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.fixture
def tmpfs():
    """mount(DIR, size): a small tmpfs at DIR, unmounted at the end of the test."""
    mounted = []

    def mount(d, size="3m"):
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
        mounted.append(d)
        return d

    try:
        yield mount
    finally:
        for d in reversed(mounted):
            subprocess.run(["umount", "-l", str(d)], check=False)


def fill(d, leave):
    """A file taking all but about `leave` bytes of d's file system."""
    st = os.statvfs(d)
    (d / "filler").write_bytes(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
    return d / "filler"


def needed_and_free(line):
    m = re.search(r"needs ([\d,]+) bytes, ([\d,]+) bytes free", line)
    assert m, line
    return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))


@needs_root
def test_full_disk_warns_training_goes_on_and_a_last_checkpoint_that_does_not_fit_fails(tmp_path, tmpfs, env):
    disk = tmpfs(tmp_path / "disk")
    filler = fill(disk, leave=400_000)  # room for the run's small files, not for a checkpoint (~660 kB)
    run_dir = disk / "run"
    r = cli(run_dir, "train.steps=6", "train.checkpoint_every=2", env=env)
    assert r.returncode == 1, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING") and "cannot write" in line]
    assert len(warnings) == 2, r.stderr
    for step, line in zip((2, 4), warnings):
        assert f"{run_dir}/checkpoints/ckpt-{step:08d}.pt: cannot write the checkpoint (No space left" in line
        needed, free = needed_and_free(line)
        assert needed > free and "training goes on" in line
    error = error_line(r)
    assert f"{run_dir}/checkpoints/ckpt-00000006.pt" in error and "No space left" in error, error
    assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob("*.pt"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(row["step"] for row in rows) == 6  # training went on past the failed writes
    assert not (run_dir / "summary.json").exists()
    # The bytes each message says a checkpoint needs are those of the same run's checkpoints
    # written where there is room (the last one, with the final evaluation's figure, may be larger).
    room = tmp_path / "room" / "run"
    assert cli(room, "train.steps=6", "train.checkpoint_every=2", env=env).returncode == 0
    sizes = {p.name: p.stat().st_size for p in (room / "checkpoints").glob("*.pt")}
    assert sizes["ckpt-00000004.pt"] == needed and sizes["ckpt-00000006.pt"] == needed_and_free(error)[0], sizes

    # A later checkpoint is tried: room made while a run goes on lets the next one be written.
    run2 = disk / "run2"
    p = subprocess.Popen(cmd(run2, "train.steps=40", "train.checkpoint_every=2"), cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    warned = False
    try:
        for line in p.stderr:
            if "cannot write the checkpoint" in line:
                warned = True
                filler.unlink()
                break
        rest = p.communicate(timeout=300)[1]
    finally:
        p.kill()
    assert warned and p.returncode == 0, rest
    assert [s for s, _ in checkpoint_files(run2)] == [38, 40]
    assert (run2 / "model.safetensors").exists()


def checkpoint_files(run_dir):
    from scaletrain.checkpoint import list_complete

    return list_complete(run_dir / "checkpoints")


@needs_root
def test_final_weights_that_do_not_fit_are_one_line_and_a_finished_run_is_not_rewritten(tmp_path, tmpfs, env):
    disk = tmpfs(tmp_path / "disk")
    run_dir = disk / "run"
    ckpts = tmpfs(run_dir / "checkpoints")  # the checkpoints have a disk of their own; the weights do not fit
    filler = fill(disk, leave=150_000)  # model.safetensors of resnet8 needs ~320 kB
    r = cli(run_dir, "train.steps=2", env=env)
    assert r.returncode == 1, r.stderr
    error = error_line(r)
    assert f"{run_dir}/model.safetensors: cannot write the final weights (No space left" in error, error
    needed, free = needed_and_free(error)
    assert needed > free
    assert not (run_dir / "model.safetensors.tmp").exists() and not (run_dir / "model.safetensors").exists()
    [(step, final)] = checkpoint_files(run_dir)
    assert step == 2
    # Resuming the finished run on a checkpoint disk with no room for another checkpoint:
    # its complete final checkpoint stays as it is, and the weights are written now.
    fill(ckpts, leave=100_000)
    filler.unlink()
    before = final.stat()
    r = cli(run_dir, "train.steps=2", env=env, resume=True)
    assert r.returncode == 0, r.stderr
    after = final.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (run_dir / "model.safetensors").exists()


def test_damaged_and_unsafe_newest_checkpoints_warn_naming_them_and_the_steps_lost(tmp_path, env):
    run_dir = tmp_path / "run"
    keep = ["train.checkpoint_every=2", "train.keep_checkpoints=3"]
    r = cli(run_dir, "train.steps=6", *keep, env=env)
    assert r.returncode == 0, r.stderr
    ck = run_dir / "checkpoints"
    c4 = ck / "ckpt-00000004.pt"
    c4.write_bytes(c4.read_bytes()[: c4.stat().st_size // 2])  # truncated
    torch.save({"step": 6, "config": {}, "model": {}, "extra": Evil()}, ck / "ckpt-00000006.pt")  # unsafe pickle
    r = cli(run_dir, "train.steps=8", *keep, env=env, resume=True)
    assert r.returncode == 0, r.stderr
    [warning] = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert "ckpt-00000006.pt: holds Python objects other than tensors" in warning, warning
    assert "ckpt-00000004.pt: truncated" in warning, warning
    assert "resuming from ckpt-00000002.pt (step 2) instead: 4 steps lost" in warning, warning
    assert "weights_only=False" not in r.stderr and "unsafe code ran" not in r.stdout + r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["steps"] == 8
    # the damaged ones were written again as the run passed their steps
    from scaletrain.checkpoint import read

    assert [read(p)["step"] for _, p in checkpoint_files(run_dir)] == [4, 6, 8]


def test_chief_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, env):
    """A write held open halfway (its .tmp is a FIFO the test reads nothing more from), then kill -9."""
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    p = subprocess.Popen(cmd(run_dir, "train.steps=100000", "train.checkpoint_every=2"), cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    fds = {}
    try:
        deadline = time.time() + 120
        while not checkpoint_files(run_dir):  # the first write is done (stale files were cleared before it)
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        newest = checkpoint_files(run_dir)[-1][0]
        for step in range(newest + 2, newest + 42, 2):
            tmp = ck / f"ckpt-{step:08d}.pt.tmp"
            try:
                os.mkfifo(tmp)
            except FileExistsError:  # being written right now
                continue
            fds[os.open(tmp, os.O_RDONLY | os.O_NONBLOCK)] = step
        ready, _, _ = select.select(list(fds), [], [], 120)  # the writer has begun one of them
        assert ready, "no write began"
        writing = fds[ready[0]]
        os.read(ready[0], 1000)  # part of it arrived; the rest waits for room in the pipe
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        for fd in fds:
            os.close(fd)
    complete = [s for s, _ in checkpoint_files(run_dir)]
    assert complete and complete[-1] == writing - 2, (complete, writing)
    r = cli(run_dir, f"train.steps={writing + 2}", "train.checkpoint_every=2", env=env, resume=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_step"] == writing - 2, summary
    assert summary["resumed_from"].endswith(f"ckpt-{writing - 2:08d}.pt")
    assert not list(ck.glob("*.tmp"))


def test_corrupt_or_unsafe_init_from_is_one_line_naming_the_file(tmp_path, env):
    good = {"w": torch.ones(1000)}
    save_file(good, str(tmp_path / "w.safetensors"))
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    torch.save({"conv1.weight": Evil()}, tmp_path / "evil.pt")
    with open(tmp_path / "raw.pkl", "wb") as fh:  # torch warned of its pickle protocol before refusing it
        pickle.dump({"conv1.weight": torch.ones(2)}, fh)
    for name, says in (("cut.safetensors", "is not a readable safetensors file (truncated or corrupt)"),
                       ("evil.pt", "holds Python objects other than tensors"),
                       ("raw.pkl", "a raw pickle, or one holding Python objects other than tensors; refused")):
        r = cli(tmp_path / f"run-{name}", "train.steps=2", f"model.init_from={tmp_path / name}", env=env)
        assert r.returncode == 1, r.stderr
        error = error_line(r)
        assert f"model.init_from: {tmp_path / name}" in error and says in error, error
        assert r.stderr.splitlines() == [error], r.stderr  # scaletrain's line alone
        assert "unsafe code ran" not in r.stdout
        assert not (tmp_path / f"run-{name}").exists()  # refused before the run directory was made
