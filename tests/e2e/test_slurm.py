"""Real Slurm: an emulated 4-node cluster (slurmctld, 4 slurmd, munge) started here, real jobs.

Needs root (munged, slurmd) and the Debian packages `make slurm` installs. Without root these
tests are skipped with that reason; as root a missing package is an error, not a skip.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import RECIPES, ROOT, scaletrain_cmd

import slurm_cluster
from scaletrain.config import load_config
from scaletrain.proc import cpus
from scaletrain.proc.env import plan_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="not root: the emulated Slurm cluster needs root "
                                "to start munged and slurmd")
DIGITS = str(RECIPES / "digits.toml")
SMALL = ["train.device=cpu", "train.steps=20", "data.workers=0", "train.eval_every=0", "train.log_every=5",
         "cluster.timeout_s=30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.available()
    assert reason is None, reason
    with slurm_cluster.Cluster(cpus=16, gpus=4) as c:  # the study's nodes: 16 CPUs, 4 GPUs
        c.start(tmp_path_factory.mktemp("slurm"))
        yield c


def sets(*overrides):
    return [a for o in overrides for a in ("--set", o)]


def submit(cluster, run_dir, *overrides, args=()):
    r = subprocess.run(scaletrain_cmd("slurm", "--recipe", DIGITS, "--run-dir", str(run_dir), "--submit", "--wait",
                                      "--time", "00:10:00", *args, *sets(*SMALL, *overrides)),
                       cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*")) if p.suffix in (".out", ".log"))
    return r, logs


def placement(run_dir):
    """Each process's record of where it ran, by rank."""
    files = sorted((run_dir / "logs").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def expected_hosts(run_dir):
    return (run_dir / "logs").glob("hosts-*.txt").__next__().read_text().split()


def test_four_node_mixed_async_job(cluster, tmp_path):
    """Every process on the node the plan gives it, and allowed every CPU the job holds there. The
    cluster confines each step to its CPUs (slurm_cluster.binding) as a GPU cluster's cgroups do: a
    step that asks a CPU count a task (srun -c1) is exact and held a lone worker and its loader to one."""
    run_dir = tmp_path / "mixed"
    r, logs = submit(cluster, run_dir, "cluster.nodes=4", "cluster.num_ps=1", "strategy.name=mixed-async",
                     "data.workers=1")
    assert r.returncode == 0, r.stdout + r.stderr + logs
    assert "submitted batch job" in r.stdout and "test accuracy" in logs
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["nodes"], s["nodes_total"], s["num_ps"], s["strategy"], s["steps"]) == (4, 4, 1, "mixed-async", 20)
    procs = placement(run_dir)
    assert [(p["role"], p["node"]) for p in procs] == [("worker", 0), ("worker", 1), ("ps", 1), ("worker", 2),
                                                       ("worker", 3)]
    # Every process ran on the Slurm node the plan gave it: node k of the plan is the k-th allocated host.
    hosts = ["node1", "node2", "node3", "node4"]
    assert [p["SLURMD_NODENAME"] for p in procs] == [hosts[p["node"]] for p in procs]
    assert [int(p["SLURM_NODEID"]) for p in procs] == [p["node"] for p in procs]
    assert {p["launcher"] for p in procs} == {"slurm"} and len({p["job"] for p in procs}) == 1
    # The plan counts a worker 1 loader + 1 thread, node 2 a PS besides; the job holds each node's 16
    # CPUs (whole nodes). The four emulated nodes share this machine's CPUs, so each process should
    # be allowed all of them: as many as the job holds on its node, up to what the machine has.
    machine = len(os.sched_getaffinity(0))
    cfg = load_config(run_dir / "config.toml")
    needs = cpus.node_needs(plan_for(cfg), cfg)
    assert [n.cpus for n in needs] == [2, 3, 2, 2]
    allowed = [(p["rank"], p["node"], len(p["cpus_allowed"])) for p in procs]
    assert allowed == [(p["rank"], p["node"], min(cluster.cpus, machine)) for p in procs], allowed
    assert all(n >= min(needs[node].cpus, machine) for _, node, n in allowed)


def test_pipeline_stages_under_slurm(cluster, tmp_path):
    """2 nodes of one replica in 2 stages: each node's two tasks are its replica's stages, as the plan says."""
    run_dir = tmp_path / "stages"
    r, logs = submit(cluster, run_dir, "cluster.nodes=2", "cluster.gpus_per_node=2", "parallel.stages=2",
                     "model.name=resnet8")
    assert r.returncode == 0, r.stdout + r.stderr + logs
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["stages"], s["replicas"], s["steps"], len(s["pipeline"]["stages"])) == (2, 2, 20, 2)
    procs = placement(run_dir)
    assert [(p["node"], p["SLURMD_NODENAME"]) for p in procs] == [(0, "node1"), (0, "node1"), (1, "node2"),
                                                                 (1, "node2")]


def test_a_gpu_job_with_a_dedicated_ps_node(cluster, tmp_path):
    """A GPU job (the cluster's GPUs are counted by Slurm, backed by nothing) whose PS has a node of
    its own: a heterogeneous job, no GPU held on the PS node, which the PS takes whole; the set-up
    line runs first, and --wait says the job's states. This torch is a CPU build, so every worker
    refuses the GPUs Slurm gave it in one line naming the fix, rather than train on the CPU."""
    run_dir = tmp_path / "sync"
    r, logs = submit(cluster, run_dir, "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.num_ps=1",
                     "cluster.ps_placement=dedicated", "strategy.name=sync", "train.device=auto",
                     "cluster.timeout_s=5", args=("--setup", "echo set-up ran on $SLURMD_NODENAME"))
    assert r.returncode != 0 and "failed" in r.stderr, r.stdout + r.stderr + logs
    assert "#SBATCH hetjob" in (run_dir / "job.sbatch").read_text()
    assert re.search(r"^Slurm job \d+: running on node\[1-2\],node3$", r.stdout, re.M), r.stdout
    assert "set-up ran on node1" in logs
    refusal = (f"rank 0 (worker 0 on node 1) on node1: this Slurm allocation gives the node 2 GPUs but torch "
               f"{torch.__version__} is a CPU build: install a CUDA build of torch in the job's environment, or set "
               "train.device = 'cpu'")
    assert refusal in logs, logs
    procs = placement(run_dir)
    assert [(p["role"], p["node"], p["SLURMD_NODENAME"]) for p in procs] == [
        ("worker", 0, "node1"), ("worker", 0, "node1"), ("worker", 1, "node2"), ("worker", 1, "node2"),
        ("ps", 2, "node3")]
    assert [p.get("SLURM_STEP_GPUS") for p in procs] == ["0,1"] * 4 + [None]  # no GPU held for the PS
    assert procs[-1]["threads"] == 16  # the PS node's 16 CPUs are the PS's


def test_train_inside_an_allocation_uses_slurm(cluster, tmp_path):
    run_dir = tmp_path / "inside"
    cmd = " ".join(scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(run_dir), "--quiet",
                                  *sets(*SMALL, "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync")))
    r = subprocess.run(["sbatch", "--wait", "--nodes=2", f"--output={tmp_path}/out-%j.txt", f"--chdir={ROOT}",
                        "--wrap", cmd], env=cluster.env, capture_output=True, text=True, timeout=300)
    out = "\n".join(p.read_text() for p in tmp_path.glob("out-*.txt"))
    assert r.returncode == 0, r.stderr + out
    assert "Slurm job" in out and "test accuracy" in out
    procs = placement(run_dir)
    assert [(p["launcher"], p["SLURMD_NODENAME"]) for p in procs] == \
        [("slurm", h) for h in expected_hosts(run_dir)]
    assert procs[2]["role"] == "ps" and procs[2]["SLURMD_NODENAME"] == procs[1]["SLURMD_NODENAME"]


def test_a_custom_loop_inside_an_allocation_runs_as_one_srun_step(cluster, tmp_path):
    """examples/custom_loop.py started by sbatch: Job.from_env starts the job's srun step, whose tasks run
    the script again and join as the job's processes."""
    run_dir = tmp_path / "loop"
    cmd = " ".join([sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--recipe", DIGITS, "--run-dir",
                    str(run_dir), *sets(*SMALL, "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync")])
    r = subprocess.run(["sbatch", "--wait", "--nodes=2", f"--output={tmp_path}/out-%j.txt", f"--chdir={ROOT}",
                        "--wrap", cmd], env=cluster.env, capture_output=True, text=True, timeout=300)
    out = "\n".join(p.read_text() for p in tmp_path.glob("out-*.txt"))
    assert r.returncode == 0, r.stderr + out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "Slurm job" in out and f"test accuracy {summary['test_accuracy']:.4f}; " in out  # the script's own line
    procs = placement(run_dir)
    assert [(p["launcher"], p["role"], p["SLURMD_NODENAME"]) for p in procs] == \
        [("slurm", role, h) for role, h in zip(("worker", "worker", "ps"), expected_hosts(run_dir))]


def test_failed_job_returns_its_status(cluster, tmp_path):
    """A job that fails on its nodes: each process names its host and the interface it lacks."""
    run_dir = tmp_path / "bad"
    r, logs = submit(cluster, run_dir, "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync",
                     "cluster.ifname=nosuch0")
    assert r.returncode != 0
    assert "failed" in r.stderr, r.stderr
    assert "# Network: gloo and NCCL sockets on nosuch0 (cluster.ifname)" in (run_dir / "job.sbatch").read_text()
    errors = [line for line in logs.splitlines() if "nosuch0" in line]
    assert errors and all(line.startswith("scaletrain: error: rank ") and
                          f"no such interface with an IPv4 address on {socket.gethostname()}" in line
                          for line in errors), logs
    assert "Traceback" not in logs, logs


def test_study_recipe_fits_16_cpu_nodes_and_what_does_not_is_refused_before_sbatch(cluster, tmp_path):
    """The study's shape (4 nodes of 4 GPUs and 16 CPUs, 3 PS alongside): Slurm takes the script
    (sbatch --test-only: a ResNet-50 run is too heavy here), and refused the one asking every task
    for a worker's CPUs. What cannot run is refused in one line before sbatch, nothing written."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "resnet50-imagenet.safetensors").write_bytes(b"")
    (tmp_path / "data" / "anp").mkdir(parents=True)
    for name in ("train.csv", "test.csv"):
        (tmp_path / "data" / "anp" / name).write_text("")
    study = ["cluster.nodes=4", "cluster.gpus_per_node=4", "cluster.num_ps=3", "strategy.name=mixed-async"]

    def slurm(run, *extra, overrides=()):
        return subprocess.run(scaletrain_cmd("slurm", "--recipe", str(RECIPES / "anp-resnet50.toml"), "--run-dir",
                                             str(tmp_path / run), "--time", "12:00:00", *extra,
                                             *sets(*study, *overrides)),
                              cwd=tmp_path, env=cluster.env, capture_output=True, text=True, timeout=60)

    r = slurm("fits", "--exclusive")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "fits" / "job.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=13\n" in text and "# Fits partition debug's nodes (sinfo: 4 nodes of 16 CPUs" in text
    resolved = (tmp_path / "fits" / "config.toml").read_text()
    assert f'root = "{tmp_path}/data/anp/train.csv"' in resolved
    assert f'init_from = "{tmp_path}/weights/resnet50-imagenet.safetensors"' in resolved
    test_only = ["sbatch", "--test-only"]
    ok = subprocess.run([*test_only, str(tmp_path / "fits" / "job.sbatch")], env=cluster.env, capture_output=True,
                        text=True)
    assert ok.returncode == 0 and "to start" in ok.stderr, ok.stderr
    old = text.replace("#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=13",
                       "#SBATCH --ntasks=19\n#SBATCH --cpus-per-task=5")  # every task a worker's 4 + 1 CPUs
    (tmp_path / "old.sbatch").write_text(old)
    refused = subprocess.run([*test_only, str(tmp_path / "old.sbatch")], env=cluster.env, capture_output=True,
                             text=True)
    assert refused.returncode != 0 and "Requested node configuration is not available" in refused.stderr

    def refused_in_one_line(r, run, words):
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / run / "job.sbatch").exists()

    refused_in_one_line(slurm("wide", overrides=["data.workers=4"]), "wide",
                        "node 2 needs 21 CPUs (4 workers x (4 loaders + 1 thread) + PS 0 (1 thread at least)); "
                        "partition debug's nodes have 16: lower data.workers to 2")
    refused_in_one_line(slurm("mem", "--mem", "2G"), "mem", "--mem 2G is more than partition debug's nodes have")
    refused_in_one_line(slurm("path", overrides=["data.test_root=data/anp/missing.csv"]), "path",
                        f"data.test_root = 'data/anp/missing.csv': {tmp_path}/data/anp/missing.csv not found; it must "
                        "be on a shared file system")


def start(cluster, run_dir, *overrides, args=("--time", "00:10:00")):
    """`scaletrain slurm --submit --wait` in the background: (process, job id) once the job is submitted."""
    p = subprocess.Popen(scaletrain_cmd("slurm", "--recipe", DIGITS, "--run-dir", str(run_dir), "--submit", "--wait",
                                        *args, *sets(*SMALL, *overrides)),
                         cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("submitted batch job"):
            return p, line.split()[3].rstrip(";")
    raise AssertionError(f"not submitted: {p.communicate()}")


def wait_for_step(run_dir, step, p, timeout=120.0):
    """Until the chief has logged job step `step` (the job trains on every node by then); a job (`p`, start's
    `scaletrain slurm --wait`) that ended before fails at once, with its logs."""
    def reached():
        rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        return any(json.loads(r).get("step", 0) >= step for r in rows if r.strip())

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = p.poll() is not None  # before the read: a job that logged the step and then ended passes
        if reached():
            return
        if ended:
            break
        time.sleep(0.2)
    logs = "\n".join(f.read_text() for f in sorted((run_dir / "logs").glob("*.out")))
    raise AssertionError(f"no step {step} in {run_dir / 'metrics.jsonl'} after {timeout:.0f} s, or the job ended "
                         f"(status {p.poll()}):\n{logs[-4000:]}")


def job_field(cluster, job, key):
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=cluster.env, capture_output=True, text=True)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv).get(key)


def left_behind(run_dir):
    """Live processes whose command line names run_dir (the job's processes all do)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir) in cmd and state != "Z" and "pytest" not in cmd:
            pids.append((int(pid), cmd))
    return pids


def test_script_asks_for_cpus_warning_requeue_and_time(cluster, tmp_path):
    run_dir = tmp_path / "script"
    r = subprocess.run(scaletrain_cmd("slurm", "--recipe", DIGITS, "--run-dir", str(run_dir), "--time", "01:30:00",
                                      "--warn-before", "120", "--mem", "512M", *sets(*SMALL, "data.workers=3", "train.threads=2",
                                                                   "cluster.nodes=2")),
                       cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = (run_dir / "job.sbatch").read_text().splitlines()
    for opt in ("--cpus-per-task=5", "--signal=B:USR1@120", "--requeue", "--time=01:30:00", "--open-mode=append",
                "--mem=512M"):
        assert f"#SBATCH {opt}" in lines, (opt, lines)
    # Slurm takes them: the job as the controller holds it (held, so it never runs).
    job = subprocess.run(["sbatch", "--parsable", "--hold", str(run_dir / "job.sbatch")], env=cluster.env,
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        assert [job_field(cluster, job, k) for k in ("CPUs/Task", "Requeue", "TimeLimit", "MinMemoryNode")] == \
            ["5", "1", "01:30:00", "512M"]
    finally:
        subprocess.run(["scancel", job], env=cluster.env)
    # A warning that would come as the job starts is refused before anything is written.
    r = subprocess.run(scaletrain_cmd("slurm", "--recipe", DIGITS, "--run-dir", str(tmp_path / "short"), "--time",
                                      "5", *sets(*SMALL)), cwd=ROOT, env=cluster.env, capture_output=True, text=True)
    assert r.returncode == 2 and "--warn-before 300 s is not shorter than --time 5" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "short" / "job.sbatch").exists()
    # So is a warning the job would not stop on.
    r = subprocess.run(scaletrain_cmd("slurm", "--recipe", DIGITS, "--run-dir", str(tmp_path / "nowarn"),
                                      *sets(*SMALL, "cluster.stop_signals=SIGTERM")),
                       cwd=ROOT, env=cluster.env, capture_output=True, text=True)
    assert r.returncode == 2 and "lacks SIGUSR1" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cancelled_job_says_cancelled(cluster, tmp_path):
    run_dir = tmp_path / "cancel"
    p, job = start(cluster, run_dir, "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync", "train.steps=100000")
    wait_for_step(run_dir, 5, p)
    subprocess.run(["scancel", job], env=cluster.env, check=True)
    t0 = time.monotonic()
    out, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1, out + err
    assert f"Slurm job {job} cancelled; see {run_dir / 'logs'}/slurm-{job}.out" in err, err
    assert took < 15, took  # Slurm knew at once; the report is not a failure found much later
    assert not left_behind(run_dir)


def test_a_busy_rendezvous_port_is_named_at_once_or_gives_way(cluster, tmp_path):
    """The batch step checks the rendezvous port on its host before srun starts a task: a busy
    cluster.master_port ends the job at once, its output with one line naming the port and the fix,
    status 2 (srun killed the others with 137 after cluster.timeout_s); a busy port from the job id
    gives way to a free one."""
    from scaletrain.proc.env import slurm_port

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        run_dir = tmp_path / "given"
        r, logs = submit(cluster, run_dir, "cluster.nodes=2", f"cluster.master_port={port}")
        assert r.returncode == 2 and "failed (exit status 2)" in r.stderr, r.stdout + r.stderr + logs
        [out] = (run_dir / "logs").glob("slurm-*.out")
        assert out.read_text().strip().splitlines()[-1] == \
            f"scaletrain: error: cluster.master_port = {port}: cannot listen on node1:{port} (Address already in " \
            "use); choose another port or 0 for a free one", logs
        assert not list((run_dir / "logs").glob("rank*.json"))  # no task was started
    held = {}  # port -> socket: the ports of the next job ids
    try:
        for job in range(1, 300):
            sock = socket.socket()
            try:
                sock.bind(("", slurm_port(str(job))))
                sock.listen(1)
                held[slurm_port(str(job))] = sock
            except OSError:
                sock.close()
        run_dir = tmp_path / "default"
        r, logs = submit(cluster, run_dir, "cluster.nodes=2")
    finally:
        for sock in held.values():
            sock.close()
    assert r.returncode == 0, r.stdout + r.stderr + logs
    job = re.search(r"submitted batch job (\d+)", r.stdout).group(1)
    used = int(re.search(r"rendezvous node1:(\d+)", logs).group(1))
    assert slurm_port(job) in held and used != slurm_port(job), (job, used)


@pytest.mark.long  # benchmarks/long_tests.py
def test_job_past_its_time_limit_says_timed_out(cluster, tmp_path):
    run_dir = tmp_path / "timeout"
    # One minute is Slurm's shortest limit; with no warning signal the job runs into it.
    p, job = start(cluster, run_dir, "cluster.nodes=2", "train.steps=1000000",
                   args=("--time", "1", "--warn-before", "0"))
    out, err = p.communicate(timeout=200)
    assert p.returncode == 1, out + err
    assert f"Slurm job {job} timed out; see {run_dir / 'logs'}/slurm-{job}.out" in err, err
    assert not left_behind(run_dir)


def test_warning_signal_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """Preemption: the warning signal reaches the batch step; every process checkpoints at a sync
    point and exits 75; the job is requeued, resumes on its own and ends with an uninterrupted run's weights."""
    from safetensors.torch import load_file

    job_set = ["cluster.nodes=2", "strategy.name=allreduce", "train.deterministic=true", "train.steps=300",
               "train.log_every=1"]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "preempted"
    ref, _ = start(cluster, ref_dir, *job_set)
    p, job = start(cluster, run_dir, *job_set)
    wait_for_step(run_dir, 20, p)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env, check=True)
    out, err = p.communicate(timeout=240)
    logs = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert p.returncode == 0, out + err + logs
    assert f"Slurm job {job} completed after 1 requeue" in out, out + err
    assert ref.communicate(timeout=240) and ref.returncode == 0
    stopped = re.search(r"stopped by SIGUSR1 at step (\d+)", logs)
    assert stopped, logs
    assert f"requeueing Slurm job {job}" in logs
    # Steps lost = 0: the second run starts at the step the first one stopped at, and logs each step once.
    steps = [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(r).get("kind") == "train"]
    assert steps == list(range(1, 301)), steps
    assert 20 <= int(stopped.group(1)) < 300
    a, b = load_file(run_dir / "model.safetensors"), load_file(ref_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not left_behind(run_dir)


def test_an_asynchronous_job_goes_on_without_a_killed_worker_task(cluster, tmp_path):
    """kill -9 of one worker task of a mixed-async job: srun keeps the others; they reach the target."""
    run_dir = tmp_path / "lost"
    p, job = start(cluster, run_dir, "cluster.nodes=3", "cluster.num_ps=1", "strategy.name=mixed-async",
                   "train.steps=150", "cluster.timeout_s=5")
    wait_for_step(run_dir, 15, p)
    worker = next(d for d in placement(run_dir) if d["role"] == "worker" and d["index"] == 2)
    os.kill(worker["pid"], 9)  # the emulated nodes share this machine
    out, err = p.communicate(timeout=240)
    logs = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert p.returncode == 0, out + err + logs
    assert "the job goes on without node 3" in logs, logs
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["images_applied"] == 150 * 3 * 32 and s["lost_workers"][0]["nodes"] == [3], s
    assert not left_behind(run_dir)



@pytest.mark.parametrize("whole", [False, True])
def test_a_killed_worker_is_replaced_and_joins_the_running_job(cluster, tmp_path, whole):
    """cluster.replacements under Slurm: each task keeps its rank (launch/keep.py). Node 3's worker killed -9: its
    keeper starts a replacement once the chief has dropped it. Its task killed whole (the keeper with it, as when
    its node fails): no keeper answers for the rank, and the batch step starts it again in a step of its own on a
    host Slurm holds up (launch/keep.start_orphans). Either way the replacement joins the running job with a live
    replica's state, and the job completes with its three nodes and one model: no restart, no requeue."""
    run_dir = tmp_path / "replaced"
    p, job = start(cluster, run_dir, "cluster.nodes=3", "strategy.name=allreduce", "cluster.survive_loss=true",
                   "cluster.replacements=1", "cluster.max_restarts=0", "train.steps=200",
                   "train.emulate_compute_s=0.1", "train.checkpoint_every=10", "cluster.timeout_s=5")
    wait_for_step(run_dir, 15, p)
    worker = next(d for d in placement(run_dir) if d["role"] == "worker" and d["index"] == 2)
    keeper = int(Path(f"/proc/{worker['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(keeper if whole else worker["pid"], 9)  # a keeper's process dies with it (parent-death signal)
    out, err = p.communicate(timeout=240)
    logs = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert p.returncode == 0, out + err + logs
    who = f"rank {worker['rank']} (worker 2 on node 3)"
    said = f"{who}: no keeper answered for it (its task or its node is gone); started a replacement step on " \
        f"{worker['SLURMD_NODENAME']}" if whole else f"{who} was killed by signal SIGKILL; started a replacement on " \
        "this node (1/1)"
    assert said in logs, logs
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,), (joined,) = s["lost_workers"], s["joined_workers"]
    assert lost["nodes"] == [3] and joined["nodes"] == [3] and joined["images"] > lost["images"], s
    assert s["resumed_from"] is None and s["images_applied"] >= 200 * 3 * 32, s
    ends = s["per_worker"]
    assert [w["node"] for w in ends] == [0, 1, 2] and len({w["weights_sum"] for w in ends}) == 1, ends
    again = next(d for d in placement(run_dir) if d["rank"] == worker["rank"])
    assert again["pid"] != worker["pid"] and again["SLURMD_NODENAME"] == worker["SLURMD_NODENAME"], again
    assert not left_behind(run_dir)
