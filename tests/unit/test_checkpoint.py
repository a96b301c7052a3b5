import pytest
import torch
from safetensors.torch import load_file

from scaletrain import checkpoint, resume
from scaletrain.checkpoint import CheckpointError
from scaletrain.loop import train


def state(step, value=1.0):
    """A checkpoint as the run writes it, small."""
    return {"step": step, "config": {}, "model": {"w": torch.full((3,), value)}}


class Evil:
    def __reduce__(self):
        return (print, ("unsafe code ran",))


def test_partial_file_of_a_killed_write_is_never_loaded_and_removed(tmp_path):
    d = tmp_path / "ckpt"
    checkpoint.save(d, 10, state(10), keep=2)
    whole = (d / "ckpt-00000010.pt").read_bytes()
    (d / "ckpt-00000020.pt.tmp").write_bytes(whole[: len(whole) // 2])  # what a kill -9 mid-write leaves
    loaded, path = checkpoint.load_latest(d)
    assert loaded["step"] == 10 and path.name == "ckpt-00000010.pt"
    assert not list(d.glob("*.tmp"))


def test_unreadable_newest_falls_back_naming_it_and_the_steps_lost(tmp_path, caplog):
    d = tmp_path / "ckpt"
    for s in (50, 100, 150):
        checkpoint.save(d, s, state(s), keep=2)
    assert [s for s, _ in checkpoint.list_complete(d)] == [100, 150]
    newest = d / "ckpt-00000150.pt"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    loaded, path = checkpoint.load_latest(d)
    assert loaded["step"] == 100
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "ckpt-00000150.pt: truncated" in warning and "50 steps lost" in warning, warning
    assert "\n" not in warning


def test_unsafe_pickle_is_refused_in_one_line_of_our_own(tmp_path, capfd):
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({**state(5), "extra": Evil()}, d / "ckpt-00000005.pt")
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_latest(d)
    msg = str(e.value)
    assert "ckpt-00000005.pt: holds Python objects other than tensors" in msg, msg
    assert "\n" not in msg and "weights_only=False" not in msg
    assert "unsafe code ran" not in capfd.readouterr().out


def test_writer_snapshots_at_submit_and_reports_a_failed_last_write(tmp_path, caplog):
    d = tmp_path / "ckpt"
    w = checkpoint.Writer(d, keep=2)
    st = state(2)
    w.submit(2, st)
    st["model"]["w"].fill_(7.0)  # training goes on in place while the file is written
    w.finish()
    assert torch.equal(checkpoint.read(d / "ckpt-00000002.pt")["model"]["w"], torch.ones(3))
    # a directory that cannot be made: a warning, then the last write's failure is an error
    bad = checkpoint.Writer(tmp_path / "file" / "ckpt", keep=2)
    (tmp_path / "file").write_text("not a directory")
    bad.submit(4, state(4))
    bad.join()
    assert any("cannot create the checkpoint directory" in r.getMessage() and "training goes on" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    with pytest.raises(CheckpointError, match="last checkpoint was not written: .*file/ckpt"):
        bad.finish()


def test_complete_checkpoint_of_the_same_step_is_not_written_again(tmp_path):
    d = tmp_path / "ckpt"
    p = checkpoint.save(d, 4, state(4, 1.0), keep=2)
    before = p.stat()
    checkpoint.save(d, 4, state(4, 2.0), keep=2)
    after = p.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert torch.equal(checkpoint.read(p)["model"]["w"], torch.ones(3))
    p.write_bytes(p.read_bytes()[:-10])  # a damaged one of that step is replaced
    checkpoint.save(d, 4, state(4, 2.0), keep=2)
    assert torch.equal(checkpoint.read(p)["model"]["w"], torch.full((3,), 2.0))


def test_exact_resume_equals_straight_run(digits_cfg, tmp_path):
    # The schedule must not depend on train.steps, which the first half changes
    # to stop at step 6 (a cosine schedule would be stretched over 6 steps).
    cfg = digits_cfg("train.steps=12", "train.deterministic=true", "data.augment=crop+flip",
                     "optim.schedule=step", "optim.step_size=4", "optim.warmup_steps=3",
                     "train.checkpoint_every=6", "data.workers=1")
    train(cfg, tmp_path / "straight", progress=False)
    train(cfg.replace(**{"train.steps": 6}), tmp_path / "resumed", progress=False)
    s = train(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert s["start_step"] == 6 and s["resumed_from"].endswith("ckpt-00000006.pt")
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and the comparison can tell runs apart: a different seed differs
    train(cfg.replace(**{"train.seed": 1}), tmp_path / "other", progress=False)
    c = load_file(str(tmp_path / "other" / "model.safetensors"))
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_resume_without_checkpoint_starts_fresh(digits_cfg, tmp_path):
    s = train(digits_cfg("train.steps=2"), tmp_path / "r", resume=True, progress=False)
    assert s["start_step"] == 0 and s["resumed_from"] is None


def test_incompatible_checkpoint_refused_naming_keys(digits_cfg, tmp_path):
    train(digits_cfg("train.steps=2"), tmp_path / "r", progress=False)
    with pytest.raises(CheckpointError, match=r"differing keys: model\.width \(16 -> 8\), optim\.lr"):
        train(digits_cfg("train.steps=4", "model.width=8", "optim.lr=0.2"), tmp_path / "r", resume=True,
              progress=False)
    # without --resume too, and the config the run was written with stays
    config = (tmp_path / "r" / "config.toml").read_text()
    with pytest.raises(CheckpointError, match=r"differing keys: model\.width .*choose another --run-dir"):
        train(digits_cfg("train.steps=4", "model.width=8"), tmp_path / "r", progress=False)
    assert (tmp_path / "r" / "config.toml").read_text() == config


def test_same_config_resumes_on_its_own(digits_cfg, tmp_path, caplog):
    train(digits_cfg("train.steps=2"), tmp_path / "r", progress=False)
    caplog.set_level("INFO", logger="scaletrain")
    (tmp_path / "r" / "model.safetensors.tmp").write_bytes(b"half")  # a killed run's weights, half written
    s = train(digits_cfg("train.steps=4"), tmp_path / "r", progress=False)  # steps may change; nothing else did
    assert not list((tmp_path / "r").rglob("*.tmp"))
    assert s["start_step"] == 2 and s["resumed_from"].endswith("ckpt-00000002.pt")
    assert any("resuming from ckpt-00000002.pt (step 2)" in r.getMessage() for r in caplog.records)


def test_run_dir_that_is_a_file_is_bad_input(tmp_path, capsys):
    """Exit 2 and one line, as for any bad input; nothing is created."""
    from scaletrain.cli import main

    from conftest import RECIPES

    (tmp_path / "r").write_text("")
    for run_dir, says in ((tmp_path / "r", f"--run-dir {tmp_path / 'r'} is a file, not a directory"),
                          (tmp_path / "r" / "sub", f"--run-dir {tmp_path / 'r' / 'sub'}: cannot create it "
                                                   f"({tmp_path / 'r'} is a file)")):
        for nodes in (1, 2):
            rc = main(["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
                       "--set", "train.steps=2", "--set", f"cluster.nodes={nodes}"])
            assert (rc, capsys.readouterr().err) == (2, f"scaletrain: error: {says}\n")
    assert (tmp_path / "r").read_text() == ""


def test_refused_resume_leaves_config_toml_as_it_was(digits_cfg, tmp_path, capsys):
    """Another cluster shape: refused before any launcher writes RUN_DIR/config.toml, with
    --resume or without."""
    from scaletrain.cli import main

    from conftest import RECIPES

    run_dir = tmp_path / "r"
    train(digits_cfg("train.steps=2"), run_dir, progress=False)
    config = (run_dir / "config.toml").read_text()
    for resume in ([], ["--resume"]):
        rc = main(["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet", *resume,
                   "--set", "data.workers=0", "--set", "train.log_every=5", "--set", "train.steps=2",
                   "--set", "cluster.gpus_per_node=2"])
        err = capsys.readouterr().err
        assert rc == 1, err
        [line] = [x for x in err.splitlines() if x.startswith("scaletrain")]
        assert "differing keys: cluster.gpus_per_node (1 -> 2); to start a new run, choose another --run-dir" \
            in line, line
        assert (run_dir / "config.toml").read_text() == config
    assert not (run_dir / "logs").exists()  # no process was started


def test_node_count_may_change_on_resume_under_allreduce_only():
    from scaletrain.config import build_config

    def flat(strategy, nodes):
        return build_config({"cluster": {"nodes": nodes, "num_ps": int(strategy != "allreduce")},
                             "strategy": {"name": strategy}}).flat()

    assert resume.config_differences(flat("allreduce", 3), flat("allreduce", 2)) == []
    assert resume.config_differences(flat("sync", 3), flat("sync", 2)) == ["cluster.nodes"]
    with pytest.raises(CheckpointError, match=r"cluster.nodes \(3 -> 2\); a resume at another node count is "
                                              r"not defined for strategy.name = 'mixed-async'"):
        resume.check_config("ckpt-20.pt", flat("mixed-async", 3), flat("mixed-async", 2))


def test_decode_may_move_between_loader_and_device_on_resume():
    """A job decoding in its loaders may resume decoding on its GPU (and back): the same images."""
    from scaletrain.config import build_config

    def flat(decode):
        return build_config({"data": {"decode": decode}}).flat()

    assert resume.config_differences(flat("loader"), flat("device")) == []
