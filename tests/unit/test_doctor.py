"""`scaletrain doctor`: this machine as it is, made-up GPU clusters (pure functions), and a real
Slurm allocation on the emulated cluster."""
import json
import os
import subprocess

import pytest

from conftest import RECIPES, ROOT, scaletrain_cmd
from scaletrain import doctor
from scaletrain.cli import main
from scaletrain.config import load_config


CPU_TORCH = {"version": "2.13.0+cpu", "cuda": None, "hip": None, "nccl": None, "cudnn": None, "gpus": [],
             "error": None}
HOST = {"name": "gpu1", "hostname_ifname": "eno1", "cpu_count": 64, "affinity": 64, "memory_bytes": 512 * 2**30,
        "memory_available_bytes": 500 * 2**30, "sbatch": "/usr/bin/sbatch", "srun": "/usr/bin/srun"}
IFACES = {"lo": "127.0.0.1", "eno1": "10.1.0.7", "ib0": "10.2.0.7"}
ALLOCATION = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURMD_NODENAME": "gpu1",
              "SLURM_NTASKS": "8", "SLURM_CPUS_ON_NODE": "32", "SLURM_GPUS_ON_NODE": "4",
              "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_JOB_PARTITION": "gpu"}


def cuda_torch(n):
    return dict(CPU_TORCH, version="2.13.0+cu126", cuda="12.6", nccl="2.26.2", cudnn=91002,
                gpus=[{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30} for i in range(n)])


def cfg(*overrides):
    return load_config(RECIPES / "digits.toml", ["train.device=auto", *overrides])


def warnings(rep):
    return [(w["text"], w["fails"]) for w in rep["warnings"]]


def test_this_machine_says_no_gpu_cpu_torch_and_no_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    human = subprocess.run(scaletrain_cmd("doctor"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert human.returncode == 0, human.stderr
    first = human.stdout.splitlines()[0]
    assert first.startswith("this machine: no GPU visible, CPU build of torch, not in a Slurm allocation"), first
    assert "not in a Slurm allocation" in human.stdout and "gloo " in human.stdout
    r = subprocess.run(scaletrain_cmd("doctor", "--format", "json"), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    rep = json.loads(r.stdout)
    assert (rep["torch"]["build"], rep["torch"]["cuda"], rep["gpus"]["visible"]) == ("cpu", None, [])
    assert rep["slurm"]["allocation"] is False and rep["warnings"] == []
    assert rep["network"]["interfaces"]["lo"] == "127.0.0.1" and rep["host"]["cpu_count"] >= 1


def test_a_missing_recipe_is_one_line_and_status_2(capsys):
    assert main(["doctor", "--recipe", "no-such-recipe.toml"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "no-such-recipe.toml not found" in err


def test_cpu_build_in_a_gpu_allocation_names_the_fix():
    rep = doctor.report(CPU_TORCH, ALLOCATION, IFACES, HOST, cfg("train.device=auto"))
    assert warnings(rep) == [("this Slurm allocation gives the node 4 GPUs but torch 2.13.0+cpu is a CPU build: "
                              "install a CUDA build of torch in the job's environment, or set train.device = 'cpu'",
                              True)]  # the job's processes refuse it (device.resolve): exit status 1
    assert warnings(doctor.report(CPU_TORCH, ALLOCATION, IFACES, HOST, cfg("train.device=cuda")))[0][1] is True
    assert not doctor.report(CPU_TORCH, ALLOCATION, IFACES, HOST, cfg("train.device=cpu"))["warnings"]
    assert doctor.human(rep).splitlines()[-1].startswith("warning: this Slurm allocation gives the node 4 GPUs")


def test_more_gpus_per_node_than_visible_names_both_numbers():
    rep = doctor.report(cuda_torch(2), {}, IFACES, HOST, cfg("cluster.gpus_per_node=4"))
    (text, fails), = warnings(rep)
    assert "cluster.gpus_per_node = 4 needs 4 GPUs on each node but 2 are visible" in text and fails
    assert rep["summary"].startswith("this machine: 2 GPUs visible (NVIDIA H100 80GB HBM3), CUDA 12.6 build")
    assert not doctor.report(cuda_torch(4), {}, IFACES, HOST, cfg("cluster.gpus_per_node=4"))["warnings"]


def test_bf16_on_a_cpu_is_said():
    (text, fails), = warnings(doctor.report(CPU_TORCH, {}, IFACES, HOST, cfg("train.precision=bf16")))
    assert text.startswith("train.precision = bf16: bf16 autocast runs on CUDA only") and not fails
    assert not doctor.report(cuda_torch(1), {}, IFACES, HOST, cfg("train.precision=bf16"))["warnings"]


def test_missing_data_root_is_said(tmp_path):
    missing = tmp_path / "no-such-dir"
    rep = doctor.report(CPU_TORCH, {}, IFACES, HOST, cfg("data.name=imagefolder", f"data.root={missing}"))
    assert warnings(rep) == [(f"data.root = '{missing}': not found from {os.getcwd()}", True)]
    missing.mkdir()
    assert not doctor.report(CPU_TORCH, {}, IFACES, HOST, cfg("data.name=imagefolder", f"data.root={missing}"))[
        "warnings"]


def test_a_network_that_does_not_import_here_is_said():
    """Each node's doctor finds a module of model.name that the job's processes there could not import."""
    rep = doctor.report(CPU_TORCH, {}, IFACES, HOST, cfg("model.name=no_such_package.nets:vgg"))
    (text, fails), = warnings(rep)
    assert text.startswith("model.name = 'no_such_package.nets:vgg': module no_such_package.nets does not import") and fails
    assert not doctor.report(CPU_TORCH, {}, IFACES, HOST, cfg("model.name=user_models:plain"))["warnings"]


def test_allocation_and_interfaces_are_read_from_made_up_facts():
    env = dict(ALLOCATION, NCCL_SOCKET_IFNAME="eno1")
    rep = doctor.report(cuda_torch(4), env, IFACES, HOST,
                        cfg("cluster.nodes=2", "cluster.gpus_per_node=4", "data.workers=8"))
    s = rep["slurm"]
    assert (s["job_id"], s["nodes"], s["node"], s["gpus"], s["cpus_on_node"]) == ("4242", ["gpu1", "gpu2"], "gpu1",
                                                                                     4, "32")
    assert (rep["network"]["gloo"]["ifname"], rep["network"]["nccl"]["ifname"]) == ("ib0", "eno1")
    # 4 workers x (8 loaders + 1 thread) = 36 CPUs on gpu1, which has 32: srun would refuse the step.
    (text, fails), = warnings(rep)
    assert text.startswith("node 1 of the plan (gpu1) needs 36 CPUs (4 workers x (8 loaders + 1 thread)) but Slurm "
                           "gave this job 32 here") and fails


def fake_command(folder, name):
    """An executable `name` in folder that does nothing: its presence on PATH is the fact."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_what_this_machine_is_to_a_job_from_its_variables_and_commands(tmp_path):
    bare, login = tmp_path / "bare", tmp_path / "login"
    bare.mkdir()
    sinfo = fake_command(login, "sinfo")
    found = doctor.commands({"PATH": str(login)})
    assert found == {"sbatch": None, "srun": None, "sinfo": str(sinfo), "squeue": None}
    assert doctor.machine({}, found) == "login"
    assert doctor.machine({}, doctor.commands({"PATH": str(bare)})) == "local"
    assert doctor.machine({"SLURM_JOB_ID": "7"}, found) == "allocation"  # salloc's shell on a login node, or a node
    assert doctor.machine({"TORCHELASTIC_RUN_ID": "x"}, found) == "torchrun"
    fake_command(bare, "squeue")
    assert doctor.machine({}, doctor.commands({"PATH": str(bare)})) == "login"


LOGIN = dict(HOST, name="login1", sinfo="/usr/bin/sinfo", squeue="/usr/bin/squeue")


def test_a_login_node_checks_a_node_of_a_multi_node_recipe_not_the_whole_job():
    """4 nodes x 4 GPUs on a cluster: the login node (4 GPUs of its own, or none) runs no process of
    the job; the local launcher's check (16 GPUs on this machine) does not apply there."""
    recipe = cfg("cluster.nodes=4", "cluster.gpus_per_node=4", "train.precision=bf16")
    for gpus in (4, 0):
        rep = doctor.report(cuda_torch(gpus), {}, IFACES, LOGIN, recipe)
        assert warnings(rep) == [], (gpus, warnings(rep))
        assert rep["machine"]["kind"] == "login" and "a login node of a Slurm cluster" in rep["summary"]
        assert "`scaletrain slurm` checks its script" in doctor.human(rep).splitlines()[1]
        assert rep["network"]["gloo"]["why"] != "loopback: every process on this machine"
    # the same recipe where the local launcher would run every process: 16 GPUs on this machine
    (text, fails), = warnings(doctor.report(cuda_torch(4), {}, IFACES, HOST, recipe))
    assert text.startswith("4 emulated nodes x 4 replicas on this machine need 16 GPUs but 4 are visible") and fails


def test_a_login_node_still_says_what_would_fail_on_every_node(tmp_path):
    """A CPU build of torch is the job's too (unless cluster.setup makes its environment); a missing
    data root is missing on a shared file system; a cluster.ifname the login node lacks is only said."""
    for device, fails_there in (("cuda", True), ("auto", False)):  # auto: on nodes with no GPU it computes on CPUs
        (text, fails), = warnings(doctor.report(CPU_TORCH, {}, IFACES, LOGIN, cfg(
            "cluster.nodes=2", "cluster.gpus_per_node=4", f"train.device={device}")))
        assert text.startswith("torch 2.13.0+cpu here is a CPU build: the job's processes would refuse the nodes' "
                               "GPUs") and fails is fails_there
    assert not warnings(doctor.report(CPU_TORCH, {}, IFACES, LOGIN, cfg(
        "cluster.nodes=2", "cluster.gpus_per_node=4", 'cluster.setup=["module load pytorch/2.13-cuda"]')))
    missing = tmp_path / "no-such-dir"
    assert warnings(doctor.report(cuda_torch(0), {}, IFACES, LOGIN, cfg("data.name=imagefolder", f"data.root={missing}"))
                    ) == [(f"data.root = '{missing}': not found from {os.getcwd()}", True)]
    (text, fails), = warnings(doctor.report(cuda_torch(0), {}, IFACES, LOGIN, cfg("cluster.ifname=ib1")))
    assert "cluster.ifname = 'ib1'" in text and "`srun scaletrain doctor` checks the job's nodes" in text
    assert not fails


def test_a_login_node_with_a_multi_node_recipe_exits_0(tmp_path, monkeypatch, capsys):
    """The command as a user runs it on a login node: a fake sinfo on PATH, no Slurm variables."""
    fake_command(tmp_path, "sinfo")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    assert main(["doctor", "--recipe", str(RECIPES / "digits.toml"), "--set", "cluster.nodes=4",
                 "--set", "cluster.gpus_per_node=4", "--set", "train.device=auto"]) == 0
    out = capsys.readouterr().out
    assert "a login node of a Slurm cluster" in out.splitlines()[0]
    assert "the job would fail" not in out and "emulated nodes" not in out, out
