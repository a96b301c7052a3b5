"""launch/keep.py's pure parts: the job's budget of replacements, and the dropped ranks no keeper answered for."""

import os

from scaletrain.launch import keep
from scaletrain.launch.notes import write_ranks


def test_the_budget_is_the_jobs_one_file_each_and_another_job_has_its_own(tmp_path):
    (tmp_path / "logs").mkdir()
    assert [keep.take_one(tmp_path, "slurm-7", 2) for _ in range(3)] == [1, 2, 0]
    assert keep.take_one(tmp_path, "slurm-8", 2) == 1  # a requeued or new job id starts afresh
    assert keep.take_one(tmp_path, "slurm-8", 0) == 0


def test_orphans_are_the_dropped_ranks_no_keeper_answered_for_within_the_wait(tmp_path):
    """A keeper's answer (kept-R) counts when written after the drop it answers, both times the file system's."""
    logs = tmp_path / "logs"
    logs.mkdir()
    o = keep.Orphans(tmp_path, wait_s=5.0)
    assert o.poll(now=100.0) == []
    (logs / "kept-2").write_text("")  # an earlier loss's answer
    os.utime(logs / "kept-2", (50.0, 50.0))
    write_ranks(tmp_path, "dropped", [2, 3])
    os.utime(logs / "dropped", (100.5, 100.5))
    assert o.poll(now=101.0) == []  # seen dropped: its keeper has wait_s to answer
    (logs / "kept-3").write_text("")  # rank 3's keeper answered (it replaces or ends it)
    os.utime(logs / "kept-3", (100.7, 100.7))
    assert o.poll(now=106.5) == [2]  # no answer for rank 2 since its drop: gone with its keeper
    assert o.poll(now=107.0) == []  # handed to the launcher once
    write_ranks(tmp_path, "dropped", [3])  # rank 2's replacement admitted
    assert o.poll(now=110.0) == []
    write_ranks(tmp_path, "dropped", [2, 3])  # ... and lost again, with its keeper: a new orphan
    os.utime(logs / "dropped", (110.5, 110.5))
    assert o.poll(now=111.0) == [] and o.poll(now=116.5) == [2]
    (logs / "dropped").unlink()
    (logs / "dropped").mkdir()  # a read that fails now (as root, modes do not): nothing learnt or forgotten
    assert o.poll(now=120.0) == [] and set(o.seen) == {2, 3}


def test_a_killed_childs_status_is_a_shells():
    assert [keep.status(rc) for rc in (-9, -15, 0, 3, 75)] == [137, 143, 0, 3, 75]
