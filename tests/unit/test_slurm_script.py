"""The sbatch script and the checks before it, with no Slurm: CPU budget, components, refusals,
paths, set-up lines, memory, network, and the lines `--wait` prints."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import RECIPES, ROOT

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.launch import flags, preflight, slurm
from scaletrain.proc import cpus
from scaletrain.launch.join import launcher_threads
from scaletrain.proc.env import LaunchError, plan_for
from scaletrain.launch.follow import state_line

STUDY = ["cluster.nodes=4", "cluster.gpus_per_node=4", "cluster.num_ps=3", "strategy.name=mixed-async"]
NODES16 = [preflight.Node(f"n{i}", 16, 4, 128000) for i in range(1, 8)]


def study(*overrides):
    return load_config(RECIPES / "anp-resnet50.toml", [*STUDY, *overrides])


def test_cpu_budget_charges_loaders_to_workers_only_and_gives_a_ps_what_is_left():
    cfg = study()
    plan = plan_for(cfg)
    needs = cpus.node_needs(plan, cfg)
    assert [n.cpus for n in needs] == [12, 13, 13, 13]  # 4 x (2 loaders + 1 thread), + 1 for a PS
    assert needs[1].words() == "4 workers x (2 loaders + 1 thread) + PS 0 (1 thread at least)"
    by_rank = cpus.threads(plan, cfg, [16] * 4)
    assert [t for t, p in zip(by_rank, plan.procs) if p.role == "ps"] == [4, 4, 4]  # 16 - 12
    assert {t for t, p in zip(by_rank, plan.procs) if p.role == "worker"} == {1}
    assert [t for t, p in zip(cpus.threads(plan, cfg, [13] * 4), plan.procs) if p.role == "ps"] == [1, 1, 1]
    asked = study("cluster.ps_threads=3", "train.threads=2")
    assert [n.cpus for n in cpus.node_needs(plan, asked)] == [16, 19, 19, 19]
    with pytest.raises(LaunchError, match="node 2 needs 13 CPUs .*; Slurm gave it 12"):
        cpus.threads(plan, cfg, [12] * 4)
    assert cpus.expand_counts("16(x3),13") == [16, 16, 16, 13]
    assert launcher_threads("1,1,4", 2) == 4 and launcher_threads("3", 5) == 3 and launcher_threads("", 0) == 0


def test_study_script_asks_each_node_for_what_its_processes_need():
    text = slurm.script(study(), Path("/shared/runs/anp"), ["--recipe", "r.toml"], partition="gpu",
                        time="12:00:00", exclusive=True, checked="Fits partition gpu's nodes.", env={})
    lines = text.splitlines()
    for opt in ("--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=13", "--gpus-per-node=4", "--exclusive",
                "--partition=gpu"):
        assert f"#SBATCH {opt}" in lines, (opt, text)
    assert "#SBATCH hetjob" not in lines and not any("--mem" in line or "--ntasks=" in line for line in lines)
    assert "#   node 2: 4 workers x (2 loaders + 1 thread) + PS 0 (1 thread at least) = 13 CPUs" in lines
    assert "# Fits partition gpu's nodes." in lines
    mem = slurm.script(study(), Path("/r"), [], mem="120G", env={})
    assert "#SBATCH --mem=120G" in mem.splitlines() and "--exclusive" not in mem
    assert "# Memory: the partition's default" in slurm.script(study(), Path("/r"), [], env={})
    with pytest.raises(LaunchError, match="--mem '12 GB'"):
        slurm.script(study(), Path("/r"), [], mem="12 GB", env={})


def test_dedicated_ps_nodes_are_a_component_without_gpus():
    cfg = study("cluster.ps_placement=dedicated")
    text = slurm.script(cfg, Path("/r"), [], partition="gpu", env={})
    het = text.split("#SBATCH hetjob\n")
    assert len(het) == 2, text
    assert "#SBATCH --nodes=4\n" in het[0] and "#SBATCH --gpus-per-node=4" in het[0]
    assert "#SBATCH --nodes=3\n" in het[1] and "--gpus-per-node" not in het[1].split("\n#   ")[0]
    assert "#SBATCH --partition=gpu" in het[1] and "#SBATCH --cpus-per-task=1\n" in het[1]
    plan = plan_for(cfg)
    assert slurm.step_layout(plan, cfg, het=True) == [
        "--ntasks=16", "--nodes=4", "--ntasks-per-node=4", "--cpu-bind=none", ":",
        "--ntasks=3", "--nodes=3", "--ntasks-per-node=1", "--cpu-bind=none"]
    cpu_only = slurm.script(study("cluster.ps_placement=dedicated", "train.device=cpu"), Path("/r"), [], env={})
    assert "hetjob" not in cpu_only and "#SBATCH --nodes=7" in cpu_only.splitlines()


def test_what_does_not_fit_is_refused_in_one_line_with_the_way_out():
    cfg = study("data.workers=4")
    with pytest.raises(LaunchError) as e:
        preflight.check_fit(plan_for(cfg), cfg, "gpu", [preflight.Node(f"n{i}", 16, 4, 128000) for i in range(4)])
    assert str(e.value) == ("node 2 needs 21 CPUs (4 workers x (4 loaders + 1 thread) + PS 0 (1 thread at least)); "
                            "partition gpu's nodes have 16: lower data.workers to 2")
    cfg = study("data.workers=3")
    with pytest.raises(LaunchError, match="lower data.workers to 2 or use ps_placement = dedicated$"):
        preflight.check_fit(plan_for(cfg), cfg, "gpu", NODES16)
    cfg = study()
    preflight.check_fit(plan_for(cfg), cfg, "gpu", NODES16[:4], mem="100G")  # fits
    with pytest.raises(LaunchError, match="asks 4 GPUs a node .*nodes have 2"):
        preflight.check_fit(plan_for(cfg), cfg, "gpu", [preflight.Node("n", 16, 2, 1000)] * 4)
    with pytest.raises(LaunchError, match="--mem 200G is more than partition gpu's nodes have"):
        preflight.check_fit(plan_for(cfg), cfg, "gpu", NODES16, mem="200G")
    with pytest.raises(LaunchError, match="needs 4 nodes .* partition gpu has 3 such nodes of 3"):
        preflight.check_fit(plan_for(cfg), cfg, "gpu", NODES16[:3])
    dedicated = study("cluster.ps_placement=dedicated")
    with pytest.raises(LaunchError, match="needs 7 nodes"):
        preflight.check_fit(plan_for(dedicated), dedicated, "gpu", NODES16[:6])


def test_partition_nodes_from_sinfo_or_why_not():
    out = "n1|gpu*|16|gpu:4|128000\nn2|gpu*|16|gpu:a100:4(S:0-1)|128000\nc1|cpu|64|(null)|256000\n"

    def sinfo(cmd, **_):
        return subprocess.CompletedProcess(cmd, 0, out, "")

    name, nodes = preflight.partition_nodes("", run=sinfo)
    assert name == "gpu" and [(n.name, n.cpus, n.gpus) for n in nodes] == [("n1", 16, 4), ("n2", 16, 4)]

    def missing(cmd, **_):
        raise FileNotFoundError(cmd[0])

    assert preflight.partition_nodes("gpu", run=missing) == "sinfo not found"
    assert "no default partition" in preflight.partition_nodes("", run=lambda c, **_: subprocess.CompletedProcess(
        c, 0, "c1|cpu|64|(null)|256000\n", ""))


def test_paths_become_absolute_and_must_exist(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("a.jpg,x\n")
    (tmp_path / "w.safetensors").write_bytes(b"")
    cfg = load_config(RECIPES / "digits.toml", ["data.name=manifest", "data.root=data/train.csv",
                                                 "model.init_from=w.safetensors"])
    out = preflight.absolute_paths(cfg, tmp_path)
    assert (out.data.root, out.model.init_from) == (str(tmp_path / "data/train.csv"), str(tmp_path / "w.safetensors"))
    with pytest.raises(LaunchError) as e:
        preflight.absolute_paths(cfg.replace(**{"data.test_root": "data/test.csv"}), tmp_path)
    assert str(e.value) == (f"data.test_root = 'data/test.csv': {tmp_path}/data/test.csv not found; it must be on a "
                            "shared file system the job's nodes see, at the same path")


def test_setup_lines_come_before_the_command_and_network_is_shown():
    cfg = study("cluster.setup=[\"module load cuda/12.4\", \"conda activate st\"]", "cluster.ifname=ib0")
    lines = slurm.script(cfg, Path("/r"), [], env={}).splitlines()
    at = lines.index("module load cuda/12.4")
    assert lines[at + 1] == "conda activate st" and lines[at + 2] == "export SCALETRAIN_SETUP_DONE=1"
    assert lines[at + 3].startswith("mkdir -p")  # the job records cluster.setup as applied (device.not_applied)
    assert lines[-1].startswith("exec ") and "srun passes the environment" in lines[at - 1]
    assert any("sockets on ib0 (cluster.ifname)" in line for line in lines)
    shell = slurm.script(cfg, Path("/r"), [], env={"GLOO_SOCKET_IFNAME": "eth0"})
    assert "# Network: GLOO_SOCKET_IFNAME=eth0 from the shell that wrote this; it wins" in shell


def test_wait_says_each_change_of_the_jobs_state():
    seen, before, lines = [
        {"JobState": "PENDING", "Reason": "Resources"}, {"JobState": "PENDING", "Reason": "Resources"},
        {"JobState": "PENDING", "Reason": "Priority"}, {"JobState": "RUNNING", "NodeList": "n[1-4]"},
        {"JobState": "RUNNING", "NodeList": "n[1-4]"},
        {"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "1"},
        {"JobState": "RUNNING", "NodeList": "n[1-4]", "Restarts": "1"}, {"JobState": "COMPLETED"}], None, []
    for f in seen:
        line = state_line("7", f, before)
        if line:
            lines.append(line)
            before = f
    assert lines == ["Slurm job 7: pending, reason Resources", "Slurm job 7: pending, reason Priority",
                     "Slurm job 7: running on n[1-4]", "Slurm job 7: pending (requeued 1x), reason BeginTime",
                     "Slurm job 7: running (requeued 1x) on n[1-4]"]


def test_a_network_that_cannot_be_built_is_refused_before_the_script(tmp_path, capsys):
    """Checked where `scaletrain slurm` runs, not after the queue on every node: one line naming
    model.name, no job script written."""
    run_dir = tmp_path / "run"
    assert main(["slurm", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir),
                 "--set", "model.name=user_models:wrong_output"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("scaletrain: error: model.name = 'user_models:wrong_output'") and "has shape (2, 11)" in err, err
    assert not (run_dir / "job.sbatch").exists()


def test_the_step_holds_every_cpu_the_job_has_on_its_nodes():
    """srun -c (any value, and an inherited SLURM_CPUS_PER_TASK or SRUN_CPUS_PER_TASK) implies --exact
    since Slurm 21.08: under cgroups a node's step would then hold one CPU a task, its loaders and PS
    squeezed onto them. The step asks no CPU count, so it holds all of the job's CPUs on each node,
    and its tasks are bound to none of them in particular (they share them, threads from the plan)."""
    cfg = study()
    layout = slurm.step_layout(plan_for(cfg), cfg, het=False)
    assert layout == ["--ntasks=19", "--nodes=4", "--distribution=arbitrary", "--cpu-bind=none"]
    assert not any(o.startswith(("--cpus-per-task", "-c", "--exact")) for o in layout)
    batch = {"SLURM_CPUS_PER_TASK": "13", "SRUN_CPUS_PER_TASK": "13", "SLURM_EXACT": "1",
             "SLURM_TRES_PER_TASK": "cpu=13", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NTASKS_PER_NODE_PACK_GROUP_0": "1",
             "SLURM_JOB_ID": "7", "PATH": "/bin"}
    assert slurm.step_env(batch) == {"SLURM_JOB_ID": "7", "PATH": "/bin"}


def anp_dir(tmp_path, monkeypatch):
    """A working directory with the study recipe's paths, as a user's checkout would have them."""
    for name in ("weights/resnet50-imagenet.safetensors", "data/anp/train.csv", "data/anp/test.csv"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)


def slurm_cli(run_dir, *args, overrides=()):
    return main(["slurm", "--recipe", str(RECIPES / "anp-resnet50.toml"), "--run-dir", str(run_dir), *args,
                 *(a for o in [*STUDY, *overrides] for a in ("--set", o))])


def test_a_stated_node_shape_checks_the_script_away_from_the_cluster(tmp_path, monkeypatch, capsys):
    """No sinfo (none is asked): --node-cpus 16 --node-gpus 4 writes a script that fits those nodes, or
    refuses in one line naming the fix, nothing written; what the shape leaves out is said unchecked."""
    anp_dir(tmp_path, monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo on the way
    assert slurm_cli(tmp_path / "wide", "--node-cpus", "16", "--node-gpus", "4", overrides=["data.workers=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["scaletrain: error: node 2 needs 17 CPUs (4 workers x (3 loaders + 1 thread) + PS 0 (1 thread at "
                   "least)); the nodes stated have 16: lower data.workers to 2 or use ps_placement = dedicated"], err
    assert not (tmp_path / "wide" / "job.sbatch").exists()
    assert slurm_cli(tmp_path / "fits", "--node-cpus", "16", "--node-gpus", "4") == 0
    lines = (tmp_path / "fits" / "job.sbatch").read_text().splitlines()
    assert "#SBATCH --cpus-per-task=13" in lines and "#SBATCH --gpus-per-node=4" in lines
    assert ("# Fits the nodes stated (--node-cpus 16 --node-gpus 4); memory not stated, not checked; the "
            "partition's node count is not checked.") in lines
    assert "Partition's nodes unknown" not in capsys.readouterr().err
    assert slurm_cli(tmp_path / "gpus", "--node-cpus", "16", "--node-gpus", "2") == 2
    assert capsys.readouterr().err.strip().endswith("the job asks 4 GPUs a node (cluster.gpus_per_node); the nodes "
                                                    "stated have 2: lower cluster.gpus_per_node")
    assert slurm_cli(tmp_path / "mem", "--node-mem", "100G", "--mem", "200G") == 2
    assert capsys.readouterr().err.strip().endswith("--mem 200G is more than the nodes stated have (102400 MB): lower "
                                                    "--mem, or use --exclusive")
    assert slurm_cli(tmp_path / "bad", "--node-mem", "lots") == 2
    assert "--node-mem 'lots': give a size such as 120G" in capsys.readouterr().err
    # Neither stated nor listed: said, and how to state them.
    assert slurm_cli(tmp_path / "unknown") == 0
    assert ("scaletrain: Partition's nodes unknown (sinfo not found): CPUs, GPUs and memory not checked; "
            "--node-cpus, --node-gpus and --node-mem state them.") in capsys.readouterr().err


def test_a_run_directory_each_node_has_its_own_of_is_flagged(tmp_path):
    mounts = ("/dev/vda1 / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\n10.0.0.1@o2ib:/scratch /scratch lustre rw 0 0\n"
              "tmpfs /scratch/local tmpfs rw 0 0\nserver:/x /mnt/my\\040share nfs rw 0 0\n")
    assert flags.node_local(Path("/home/u/runs/a"), mounts) == ""
    assert flags.node_local(Path("/scratch/u/runs"), mounts) == ""
    assert flags.node_local(Path("/mnt/my share/runs"), mounts) == ""
    assert flags.node_local(Path("/scratch/local/runs"), mounts) == \
        "it is on a tmpfs file system (/scratch/local), local to this machine"
    assert flags.node_local(Path("/srv/runs"), mounts) == "it is on a ext4 file system (/), local to this machine"
    for top in ("/tmp", "/var/tmp", "/dev/shm"):
        assert flags.node_local(Path(top) / "runs", mounts) == f"it is under {top}, which each node has its own of"
    [flag] = flags.run_dir_flag(Path("/srv/runs/a"), mounts)
    assert flag.startswith("run directory /srv/runs/a: it is on a ext4 file system (/), local to this machine; the "
                           "job's nodes read its config.toml") and "shared file system" in flag
    assert flags.run_dir_flag(Path("/home/u/runs"), mounts) == []


def test_flags_are_printed_and_in_the_scripts_header(tmp_path, capsys):
    """`scaletrain slurm` warns (exit 0, script written) of a run directory under /tmp and of too few
    loaders a GPU, on stderr and in the script's header."""
    run_dir = tmp_path / "run"
    assert main(["slurm", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--node-cpus", "8",
                 "--set", "data.workers=0"]) == 0
    err = capsys.readouterr().err
    text = (run_dir / "job.sbatch").read_text()
    flag = f"run directory {run_dir}: it is under /tmp, which each node has its own of"
    assert f"scaletrain: warning: {flag}" in err and f"# Warning: {flag}" in text
    assert "loader" not in err  # digits: no JPEG decoded on the host; the recipe trains on the CPU


def test_loaders_a_gpu_below_what_the_network_needs_are_flagged_with_the_figure():
    cfg = study()  # 2 loaders a GPU, ResNet-50 at 224 px from JPEG files
    plan = plan_for(cfg)
    busiest = cpus.node_needs(plan, cfg)[1]
    [flag] = flags.loader_flag(cfg, 4, busiest, flags.RESNET50_FLOPS)
    assert flag == ("data.workers = 2 loader processes a GPU, below the 5 a current GPU needs: resnet50 at 224 px, "
                    "trains at about 2,500 img/s a GPU, and one loader core decodes 595 img/s from files: 4.2 cores' "
                    f"worth ({flags.INPUT_BENCHMARK}); raise data.workers to 5 (its busiest node then needs 25 CPUs) "
                    "or set data.decode = device")
    assert flags.loaders_needed(study("data.name=shards", "data.root=/s"), flags.RESNET50_FLOPS)[0] == 4  # 3.4
    heavy = flags.loaders_needed(cfg, 2 * flags.RESNET50_FLOPS)  # half the GPU's rate: 2.1 cores
    assert heavy[0] == 3 and flags.loader_flag(study("data.workers=3"), 4, busiest, 2 * flags.RESNET50_FLOPS) == []
    assert flags.loaders_needed(cfg, flags.RESNET50_FLOPS / 4)[0] == 5  # a lighter network: at least as fast
    for quiet in (study("data.workers=5"), study("data.decode=device"), study("data.name=synthetic", "data.root=",
                                                                              "data.test_root=")):
        assert flags.loader_flag(quiet, 4, busiest, flags.RESNET50_FLOPS) == []
    assert flags.loader_flag(cfg, 0, busiest, flags.RESNET50_FLOPS) == []  # no GPU
    dirs, said = flags.job_flags(cfg, plan, Path("/home/u/run"), gpus=4, mounts="nfs:/home /home nfs rw 0 0\n")
    assert dirs == [] and len(said) == 1 and said[0].startswith("data.workers = 2 loader processes a GPU")


def test_the_loader_figures_are_the_input_benchmarks():
    """The constants behind the flag are the file's figures, and ResNet-50's FLOPs are counted as for
    the recipe's network."""
    bench = json.loads((ROOT / flags.INPUT_BENCHMARK).read_text())
    per_core = bench["images_per_sec_per_core"]
    assert flags.LOADER_RATE == {"files": per_core["files/resized-crop+flip"]["median"],
                                 "shards": per_core["shards/resized-crop+flip"]["median"]}
    assert bench["cores_per_replica"][f"{flags.GPU_RATE:.0f} img/s"] == {
        "files": round(flags.GPU_RATE / flags.LOADER_RATE["files"], 2),
        "shards": round(flags.GPU_RATE / flags.LOADER_RATE["shards"], 2)}
    counted = flags.network_flops(study())
    assert abs(counted / flags.RESNET50_FLOPS - 1) < 0.005, counted


def test_an_import_path_network_s_directory_is_on_the_scripts_pythonpath(tmp_path, capsys):
    """tests/ holds user_models.py (importable here through the test's path, as a user's through
    PYTHONPATH): the script exports it before it starts the job, after the set-up lines, and says
    when that directory is this machine's own."""
    run_dir = tmp_path / "run"
    assert main(["slurm", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--node-cpus", "8",
                 "--setup", "module load x", "--set", "model.name=user_models:plain"]) == 0
    lines = (run_dir / "job.sbatch").read_text().splitlines()
    at = lines.index(f"export PYTHONPATH={ROOT / 'tests'}${{PYTHONPATH:+:$PYTHONPATH}}")
    assert lines.index("module load x") < at < len(lines) - 1 and lines[-1].startswith("exec ")
    local = flags.node_local(ROOT / "tests")
    said = f"model.name = 'user_models:plain' imports from {ROOT / 'tests'}: {local}; put it on a shared file system"
    assert (said in capsys.readouterr().err) == bool(local)
    cfg = load_config(RECIPES / "digits.toml", ["data.name=nosuchmodule_xyz:make"])
    dirs, said = flags.import_dirs(cfg)
    assert dirs == [] and said == ["data.name = 'nosuchmodule_xyz:make': module nosuchmodule_xyz is not found here; "
                                   "it must import on every node (installed in the job's environment, or its "
                                   "directory on PYTHONPATH)"]
    assert flags.import_dirs(load_config(RECIPES / "digits.toml", ["model.name=torch.nn:Identity"])) == ([], [])


def test_a_job_that_goes_on_without_a_lost_node_asks_slurm_not_to_end_it_when_one_fails():
    """--no-kill where the job goes on without a lost process (mixed-async; allreduce with survive_loss): a
    failed node would otherwise end the allocation, and the job with it."""
    script = slurm.script(study(), Path("/r"), [], env={})
    assert "#SBATCH --no-kill" in script.splitlines()
    sync = slurm.script(study("strategy.name=sync"), Path("/r"), [], env={})
    assert "--no-kill" not in sync
    kept = slurm.script(study("strategy.name=allreduce", "cluster.num_ps=0", "cluster.survive_loss=true"), Path("/r"),
                        [], env={})
    assert "#SBATCH --no-kill" in kept.splitlines()
