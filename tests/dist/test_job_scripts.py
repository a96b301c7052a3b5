"""A user's own loop (examples/custom_loop.py, on scaletrain.Job) as every process of real jobs: the
local launcher started by the script itself, torchrun's agents, a stop signal and a resume, and a
loop that forgets job.step. The outcome is checked, not only the exit status."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, scaletrain_cmd

LOOP = ROOT / "examples" / "custom_loop.py"
DIGITS = str(ROOT / "recipes" / "digits.toml")
SYNC_2X2 = ["strategy.name=sync", "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.num_ps=1"]


def sets(*overrides):
    return [a for o in overrides for a in ("--set", o)]


def script(*args, **kw):
    return subprocess.run([sys.executable, str(LOOP), "--recipe", DIGITS, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=kw.pop("timeout", 300), **kw)


@pytest.mark.long  # benchmarks/long_tests.py
def test_custom_loop_under_the_local_launcher_matches_the_command_line(tmp_path):
    """The acceptance run: 2 nodes x 2 replicas and a sync PS on digits, the script's loop against
    `scaletrain train` of the same config."""
    mine = script(*sets(*SYNC_2X2), "--run-dir", str(tmp_path / "mine"))
    assert mine.returncode == 0, mine.stderr[-3000:]
    cli = subprocess.run(scaletrain_cmd("train", "--recipe", DIGITS, *sets(*SYNC_2X2), "--run-dir",
                                        str(tmp_path / "cli"), "--quiet"), cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    a, b = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("mine", "cli"))
    assert (a["replicas"], a["num_ps"], a["strategy"], a["steps"]) == (4, 1, "sync", 400)
    assert abs(a["test_accuracy"] - b["test_accuracy"]) <= 0.01, (a["test_accuracy"], b["test_accuracy"])
    assert a["test_accuracy"] > 0.9
    # The job's figures: images applied over the job's training time (its timed windows, after the
    # warm-up steps), as metrics.jsonl's rows count them; not a sum of the replicas' rates.
    assert a["images_applied"] == 400 * 4 * 32
    # Each timed row closes a window at its rate; the first window opens where the warm-up ends
    # (train.warmup_log_steps = 2 job steps of 4 x 32 images), the others at the row before.
    rows = [json.loads(r) for r in (tmp_path / "mine" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["kind"] == "train" and "images_per_sec" in r]
    windows = [r["images"] - start for r, start in zip(timed, [2 * 4 * 32] + [r["images"] for r in timed[:-1]])]
    seconds = sum(n / r["images_per_sec"] for n, r in zip(windows, timed))
    assert a["images_per_sec"] == pytest.approx(sum(windows) / seconds, rel=1e-6)
    assert sum(windows) == a["images_applied"] - 2 * 4 * 32
    assert f"test accuracy {a['test_accuracy']:.4f}; {a['images_per_sec']:.0f} images/s" in mine.stdout
    roles = [json.loads((tmp_path / "mine" / "logs" / f"rank{r}.json").read_text())["role"] for r in range(5)]
    assert roles == ["worker"] * 4 + ["ps"]
    assert not any("Traceback" in (tmp_path / "mine" / "logs" / f"rank{r}.log").read_text() for r in range(1, 5))


def test_custom_loop_under_two_torchrun_agents_with_a_parameter_server(tmp_path):
    """Each agent's processes take their plan node from SCALETRAIN_PLAN_NODE; the PS's process serves
    its shard inside Job.from_env and exits there."""
    run_dir = tmp_path / "run"
    overrides = ["cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync", "train.steps=20", "data.workers=0",
                 "train.eval_every=10", "cluster.timeout_s=30"]
    port, agents = free_port(), []
    for node, procs in ((1, 2), (0, 1)):  # node 2's agent joins first
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes=2", f"--nproc-per-node={procs}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=loop-{port}",
               "--max-restarts=0", str(LOOP), "--recipe", DIGITS, *sets(*overrides), "--run-dir", str(run_dir)]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, SCALETRAIN_PLAN_NODE=str(node)),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(1.0)
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["nodes"], summary["num_ps"], summary["replicas"], summary["steps"]) == (2, 1, 2, 20)
    assert summary["test_accuracy"] is not None and "test accuracy" in outs[1]
    ranks = [json.loads((run_dir / "logs" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(r["role"], r["node"], r["launcher"]) for r in ranks] == \
        [("worker", 0, "torchrun"), ("worker", 1, "torchrun"), ("ps", 1, "torchrun")]


def test_a_stopped_custom_loop_checkpoints_and_its_resume_ends_the_job(tmp_path):
    run_dir = tmp_path / "run"
    args = [*sets("cluster.gpus_per_node=2", "train.steps=400", "train.eval_every=0", "train.log_every=10"),
            "--run-dir", str(run_dir)]
    p = subprocess.Popen([sys.executable, str(LOOP), "--recipe", DIGITS, *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step 30/"):
            break
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 75, err[-2000:]
    saved = sorted((run_dir / "checkpoints").glob("*.pt"))
    assert len(saved) == 1 and not (run_dir / "summary.json").exists()
    step = int(saved[0].stem.split("-")[1])
    assert 30 <= step < 400 and "checkpoint" in err
    again = script(*args, "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["start_step"], summary["steps"]) == (step, 400)


FORGETS = """
import sys
import scaletrain

cfg = scaletrain.load_config(sys.argv[1], ["cluster.gpus_per_node=2", "train.steps=50", "cluster.timeout_s=20"])
with scaletrain.Job.from_env(cfg, run_dir=sys.argv[2]) as job:
    model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
    for x, y in job.batches():
        optimizer.zero_grad()
        job.loss(model(x), y).backward()  # and no job.step(loss)
"""


def test_a_distributed_loop_that_forgets_the_step_fails_in_one_line_not_a_hang(tmp_path):
    path = tmp_path / "forgets.py"
    path.write_text(FORGETS)
    start = time.time()
    r = subprocess.run([sys.executable, str(path), DIGITS, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "asked for the next batch before job.step(loss)" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and time.time() - start < 60


TRAINS = """
import json, os, sys
import scaletrain

summary = scaletrain.train(sys.argv[1], {"cluster.gpus_per_node": 2, "train.steps": 10, "data.workers": 0,
                                         "train.eval_every": 10}, run_dir=sys.argv[2], progress=False)
with open(os.path.join(sys.argv[3], f"after{os.environ['LOCAL_RANK']}.json"), "w") as f:
    json.dump(summary, f)  # the script goes on after the job
"""


def test_scaletrain_train_under_torchrun_returns_the_summary_to_the_script(tmp_path):
    path = tmp_path / "trains.py"
    path.write_text(TRAINS)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(path), DIGITS, str(tmp_path / "run"),
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    chief, other = (json.loads((tmp_path / f"after{k}.json").read_text()) for k in (0, 1))
    assert chief == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (chief["replicas"], chief["steps"]) == (2, 10) and other == {}


GRADS = """
import json, sys
import torch
import scaletrain

def main():
    cfg = scaletrain.load_config(sys.argv[1], ["cluster.gpus_per_node=2", "train.steps=1", "train.emulate_compute_s=0.01",
                                               "optim.momentum=0", "train.eval_every=0"])
    with scaletrain.Job.from_env(cfg, run_dir=sys.argv[2]) as job:
        model, _ = job.wrap(torch.nn.Linear(4, 10))
        before = [p.detach().clone() for p in model.parameters()]
        for batch in job.batches():
            assert batch is None  # emulated compute: no data read
            for p in model.parameters():  # gradients written without a backward, one value a replica
                p.grad = torch.full_like(p, 1.0 + job.ctx.me.index)
            job.step(0.0, lr=0.1)
        moved = [(b - p.detach()).flatten().tolist() for b, p in zip(before, model.parameters())]
        with open(f"{sys.argv[2]}/moved{job.ctx.me.index}.json", "w") as f:
            json.dump(moved, f)

sys.exit(main())  # None: status 0, as the interpreter says
"""


def test_emulated_gradients_are_averaged_by_the_step_and_sys_exit_none_is_success(tmp_path):
    """No backward runs under train.emulate_compute_s: the strategy averages in its step (no DDP, whose
    averaging rides on backward, is built). Replicas with gradients 1 and 2 both move by lr x 1.5."""
    path, run_dir = tmp_path / "grads.py", tmp_path / "run"
    path.write_text(GRADS)
    r = subprocess.run([sys.executable, str(path), DIGITS, str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for index in (0, 1):
        moved = json.loads((run_dir / f"moved{index}.json").read_text())
        assert all(m == pytest.approx(0.15) for values in moved for m in values), (index, moved)


def test_a_script_under_torchrun_without_a_run_dir_says_so_in_one_line(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(LOOP), "--recipe", DIGITS,
                        *sets("cluster.gpus_per_node=2")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("scaletrain:")]
    # torchrun stops the other process once one has failed: one line or two, each the same
    assert lines and set(lines) == {"scaletrain: error: under torchrun or srun every process must be given the same "
                                    "run_dir"}, r.stderr[-2000:]
    # torchrun's own traceback (its ChildFailedError) follows; none from the script's processes
    assert "custom_loop.py\", line" not in r.stderr and not (tmp_path / "runs").exists(), r.stderr[-3000:]


BYPASS = """
import sys
import scaletrain

cfg = scaletrain.load_config(sys.argv[1], ["cluster.gpus_per_node=2", "train.steps=5"])
with scaletrain.Job.from_env(cfg, run_dir=sys.argv[2]) as job:
    network = scaletrain.build_model(cfg.model)
    model, optimizer = job.wrap(network)
    for x, y in job.batches():
        optimizer.zero_grad()
        job.loss(network(x), y).backward()  # the network itself, not the module wrap() returned
        job.step(0.0)
"""


def test_a_forward_around_the_wrapped_module_is_an_error_not_unaveraged_gradients(tmp_path):
    """Under allreduce the replicas' gradients are averaged in the backward of a forward through the
    module job.wrap() returned (DistributedDataParallel): a loop that calls the network itself would
    train every replica on its own gradient, silently."""
    path = tmp_path / "bypass.py"
    path.write_text(BYPASS)
    r = subprocess.run([sys.executable, str(path), DIGITS, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "the batch's forward did not run through the module job.wrap() returned" in r.stderr, r.stderr[-2000:]
