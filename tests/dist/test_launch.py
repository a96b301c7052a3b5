"""Launch paths: the plan command, torchrun, and network hygiene of local jobs."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from scaletrain.cli import main
from scaletrain.proc.env import LaunchError, expand_nodelist, rendezvous, slurm_port
from scaletrain.plan import ClusterConfig, make_plan

from conftest import RECIPES, ROOT, free_port, scaletrain_cmd

DIGITS = str(RECIPES / "digits.toml")


def sets(*overrides):
    return [a for o in overrides for a in ("--set", o)]


# --- scaletrain plan ---------------------------------------------------------------------------

def test_plan_reads_as_the_study(capsys):
    assert main(["plan", "--recipe", DIGITS, *sets("cluster.nodes=2", "cluster.gpus_per_node=4", "train.device=auto",
                                                   "cluster.num_ps=1", "strategy.name=sync")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["2 nodes (2 with workers, 0 PS-only), 9 processes",
                       "node 1: worker 0 (GPUs 0-3)", "node 2: PS 0 (no GPU) and worker 1 (GPUs 0-3)"]


def test_plan_json_and_dedicated(capsys):
    assert main(["plan", "--recipe", DIGITS, "--format", "json",
                 *sets("cluster.nodes=2", "cluster.num_ps=2", "cluster.ps_placement=dedicated",
                       "strategy.name=mixed-async")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nodes_total"] == 4 and plan["world_size"] == 4
    assert [(p["role"], p["node"]) for p in plan["processes"]] == [("worker", 0), ("worker", 1), ("ps", 2), ("ps", 3)]


@pytest.mark.parametrize("overrides,pattern", [
    (["cluster.nodes=2", "cluster.num_ps=3", "strategy.name=sync"], r"num_ps = 3 > cluster.nodes = 2"),
    (["cluster.nodes=2", "cluster.num_ps=0", "strategy.name=sync"], r"at least one parameter server"),
    (["cluster.nodes=2", "cluster.num_ps=1", "strategy.name=allreduce"], r"uses no parameter server"),
    (["cluster.nodes=2", "cluster.num_ps=1", "strategy.name=backup", "strategy.backup_workers=2"],
     r"backup_workers"),
])
def test_plan_invalid_is_one_line(capsys, overrides, pattern):
    assert main(["plan", "--recipe", DIGITS, *sets(*overrides)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(pattern, err[0]), err


def test_sbatch_format_asks_for_the_plan(capsys, tmp_path):
    assert main(["plan", "--recipe", DIGITS, "--format", "sbatch", "--run-dir", str(tmp_path / "r"),
                 *sets("cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.num_ps=1", "strategy.name=sync",
                       "train.device=auto")]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --gpus-per-node=4\n" in text
    assert f"-m scaletrain train --recipe {DIGITS} --set cluster.nodes=2" in text
    # A requeued run of the job resumes from the run dir's checkpoint.
    assert text.rstrip().endswith(f"--run-dir {tmp_path / 'r'} ${{SLURM_RESTART_COUNT:+--resume}}")


# --- reading the launchers' environments ---------------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("node[1-4,7]", ["node1", "node2", "node3", "node4", "node7"]),
    ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[3]-ib,b1", ["a3-ib", "b1"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


def test_expand_nodelist_rejects_garbage():
    with pytest.raises(LaunchError, match="node\\[x-2\\]"):
        expand_nodelist("node[x-2]")


PLAN = make_plan(ClusterConfig(nodes=2, gpus_per_node=2, num_ps=1), ps_required=True)  # 2 + 3 processes


def test_torchrun_rank_comes_from_the_plan_node_not_join_order():
    env = {"TORCHELASTIC_RUN_ID": "j", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "5",
           "GROUP_RANK": "0", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    s = rendezvous(PLAN, "127.0.0.1", 0, node=1, env=env)
    assert (s.rank, s.launcher, s.job) == (4, "torchrun", "j")  # the PS of node 2
    with pytest.raises(LaunchError, match="without --plan-node"):
        rendezvous(PLAN, "127.0.0.1", 0, node=None, env=env)
    with pytest.raises(LaunchError, match="runs 2 processes in the plan but torchrun started 3"):
        rendezvous(PLAN, "127.0.0.1", 0, node=0, env=env)


def test_slurm_rendezvous():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "node[3-4]", "SLURM_JOB_ID": "4242"}
    s = rendezvous(PLAN, "127.0.0.1", 0, env=env)
    assert (s.rank, s.addr, s.port, s.job) == (3, "node3", slurm_port("4242"), "slurm-4242")
    with pytest.raises(LaunchError, match="on its node index 0, the plan on 1"):
        rendezvous(PLAN, "127.0.0.1", 0, env={**env, "SLURM_NODEID": "0"})
    with pytest.raises(LaunchError, match="SLURM_NTASKS = 4 but the plan has 5"):
        rendezvous(PLAN, "127.0.0.1", 0, env={**env, "SLURM_NTASKS": "4"})
    # A step of replacements (launch/keep.start_orphans): task i is the i-th rank given, on any node, late
    again = rendezvous(PLAN, "127.0.0.1", 0, env={**env, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
                                                  "SCALETRAIN_RANKS": "1,4", "SCALETRAIN_REPLACES": "1.0"})
    assert (again.rank, again.world, again.addr, again.late) == (4, 5, "node3", True)


# --- torchrun, for real ---------------------------------------------------------------------------

def test_two_torchrun_agents_run_a_sync_job(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = ["cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync", "train.steps=20", "data.workers=0",
                 f"cluster.master_port={free_port()}", "cluster.timeout_s=30", "train.eval_every=0"]
    assert main(["plan", "--recipe", DIGITS, "--format", "torchrun", "--run-dir", str(run_dir), *sets(*overrides)]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torchrun ")]
    assert len(commands) == 2 and "--nproc-per-node=1" in commands[0] and "--nproc-per-node=2" in commands[1]
    env = dict(os.environ, PATH=f"{os.path.dirname(os.sys.executable)}:{os.environ['PATH']}")
    # Node 2's agent joins first: torchrun's group ranks then disagree with the plan's nodes.
    agents = []
    for cmd in reversed(commands):
        agents.append(subprocess.Popen(cmd, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
        time.sleep(1.0)
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["nodes"], summary["num_ps"], summary["replicas"], summary["steps"]) == (2, 1, 2, 20)
    ranks = [json.loads((run_dir / "logs" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(r["role"], r["node"], r["launcher"]) for r in ranks] == \
        [("worker", 0, "torchrun"), ("worker", 1, "torchrun"), ("ps", 1, "torchrun")]
    assert len({r["job"] for r in ranks}) == 1
    # Node 2's agent joined first and torchrun made it group 0; the plan still put rank 0 on node 1.
    assert ranks[0]["GROUP_RANK"] == "1" and ranks[2]["GROUP_RANK"] == "0"


def test_a_torchrun_agent_runs_a_replica_in_two_stages(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = ["cluster.gpus_per_node=2", "parallel.stages=2", "model.name=resnet8", "train.steps=10",
                 "data.workers=0", f"cluster.master_port={free_port()}", "cluster.timeout_s=30", "train.eval_every=0"]
    assert main(["plan", "--recipe", DIGITS, "--format", "torchrun", "--run-dir", str(run_dir), *sets(*overrides)]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torchrun ")]
    assert len(commands) == 1 and "--nproc-per-node=2" in commands[0]
    env = dict(os.environ, PATH=f"{os.path.dirname(os.sys.executable)}:{os.environ['PATH']}")
    done = subprocess.run(commands[0], shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stages"], summary["replicas"], summary["steps"]) == (2, 1, 10)
    assert [json.loads((run_dir / "logs" / f"rank{r}.json").read_text())["launcher"] for r in range(2)] == \
        ["torchrun", "torchrun"]


# --- network hygiene of local jobs ------------------------------------------------------------------

def listening(pids):
    """(address, port) of every TCP socket these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                found.append((socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6,
                                               bytes.fromhex(addr)[::-1] if width == 8 else _v6(addr)), int(port, 16)))
    return found


def _v6(addr):
    raw = bytes.fromhex(addr)
    return b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))


def start_slow_job(run_dir, *extra):
    cmd = scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(run_dir), "--quiet",
                         *sets("cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync",
                               "data.workers=0", "train.eval_every=0", "strategy.slow_node=0",
                               "strategy.slow_delay_s=0.05", *extra))
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        files = list((run_dir / "logs").glob("rank*.json")) if (run_dir / "logs").exists() else []
        metrics = run_dir / "metrics.jsonl"
        if len(files) == 3 and metrics.exists() and metrics.read_text().count("\n") >= 2:
            return p, [json.loads(f.read_text()) for f in sorted(files)]
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    raise AssertionError("job did not start")


def test_local_job_listens_on_loopback_only_and_keeps_strangers_out(tmp_path):
    port = free_port()
    p, ranks = start_slow_job(tmp_path / "a", f"cluster.master_port={port}", "cluster.timeout_s=4",
                              "train.steps=300")
    try:
        socks = listening([p.pid] + [r["pid"] for r in ranks])
        assert (("127.0.0.1", port)) in socks
        assert socks and all(addr == "127.0.0.1" for addr, _ in socks), socks
        # A process of another job pointed at this job's rendezvous waits in its own
        # namespace and gives up with a clear error; the job is not disturbed.
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "config.toml").write_text((tmp_path / "a" / "config.toml").read_text())
        stranger = subprocess.run(
            [os.sys.executable, "-m", "scaletrain.launch.entry", str(tmp_path / "b")], cwd=ROOT, text=True,
            capture_output=True, timeout=120,
            env=dict(os.environ, RANK="1", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     SCALETRAIN_JOB="another-job"))
        assert stranger.returncode == 3  # it left because of peers: of its job, none came
        assert f"no rendezvous for job another-job at 127.0.0.1:{port}: rank 0 (worker 0 on node 1), rank 2 (" \
            in stranger.stderr, stranger.stderr
    finally:
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["steps"] == 300


def test_master_port_in_use_fails_fast_naming_it(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.time()
        r = subprocess.run(scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(tmp_path / "r"),
                                          *sets("cluster.nodes=2", f"cluster.master_port={port}")),
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.time() - t0 < 10
    assert f"cluster.master_port = {port}" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_slurm_time_limits():
    from scaletrain.launch.slurm import time_seconds

    assert [time_seconds(t) for t in ("5", "5:30", "1:00:00", "2-3", "2-3:04", "2-03:04:05", "UNLIMITED")] == \
        [300, 330, 3600, 2 * 86400 + 3 * 3600, 2 * 86400 + 3 * 3600 + 240, 2 * 86400 + 3 * 3600 + 245, None]
    with pytest.raises(LaunchError, match="--time '1h'"):
        time_seconds("1h")


def test_the_launcher_names_the_chief_when_every_process_ended_before_it_looked(tmp_path):
    """Killing the chief ends the others within a moment (its store is gone): the launcher's
    last look must still see the kill, not report a finished job."""
    from scaletrain.errors import EXIT_PEER
    from scaletrain.launch.local import _watch

    plan = make_plan(ClusterConfig(nodes=2, gpus_per_node=1, num_ps=1), ps_required=True)  # worker 0, PS, worker 1
    (tmp_path / "logs").mkdir()
    codes = ["import os, signal; os.kill(os.getpid(), signal.SIGKILL)", f"raise SystemExit({EXIT_PEER})",
             f"raise SystemExit({EXIT_PEER})"]
    procs = [subprocess.Popen([sys.executable, "-c", c]) for c in codes]
    for p in procs:
        p.wait()
    assert _watch(plan, procs, 5.0, tmp_path, ("SIGTERM",)) == 1
    failure = json.loads((tmp_path / "logs" / "failure.json").read_text())
    assert failure["rank"] == 0 and "worker 0 on node 1) was killed by signal SIGKILL" in failure["what"]


def test_local_launcher_gives_a_ps_its_ps_threads(tmp_path, env):
    """cluster.ps_threads takes effect without Slurm too: the PS's record shows its threads."""
    import json

    run_dir = tmp_path / "r"
    r = subprocess.run(scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(run_dir), "--quiet",
                                      *sets("cluster.num_ps=1", "strategy.name=sync", "cluster.ps_threads=3",
                                            "train.steps=2", "data.workers=0", "train.eval_every=0")),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ps = json.loads((run_dir / "logs" / "rank1.json").read_text())
    assert (ps["role"], ps["threads"]) == ("ps", 3)
    assert "start-up" not in r.stdout  # --quiet


def test_a_local_job_says_how_far_its_start_up_has_come(tmp_path, env):
    """A few lines from the launcher and the chief, before the first step: none from the other processes."""
    r = subprocess.run(scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(tmp_path / "r"),
                                      *sets("cluster.nodes=2", "cluster.gpus_per_node=2", "train.steps=2",
                                            "data.workers=0", "train.eval_every=0")),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("start-up: ")]
    assert [re.sub(r" \(\d+\.\d s\)$", "", x) for x in lines] == [
        "start-up: starting 4 processes", "start-up: 4/4 processes up", "start-up: process groups ready",
        "start-up: data ready, training"], r.stdout
    assert all(x.endswith(" s)") for x in lines[1:]), lines  # seconds since the launch
    assert r.stdout.index("start-up: data ready") < r.stdout.index("step 2/2"), r.stdout
