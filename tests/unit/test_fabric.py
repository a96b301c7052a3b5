"""The interface of gloo's and NCCL's sockets (proc/fabric.py): pure choices on made-up hosts."""
import pytest

from scaletrain.errors import LaunchError
from scaletrain.proc import fabric

HPC = {"lo": "127.0.0.1", "eno1": "10.1.0.7", "ib0": "10.2.0.7"}


def test_named_interface_is_used_and_a_missing_one_is_one_line():
    assert fabric.choose("eno1", HPC, loopback_job=False) == "eno1"
    with pytest.raises(LaunchError, match=r"cluster.ifname = 'ib1'.*it has lo \(127.0.0.1\), eno1.*ib0"):
        fabric.choose("ib1", HPC, loopback_job=False)


def test_auto_prefers_infiniband_then_loopback_for_local_jobs_else_leaves_it():
    assert fabric.choose("", HPC, loopback_job=False) == "ib0"
    assert fabric.choose("", HPC, loopback_job=True) == "lo"
    assert fabric.choose("", {"lo": "127.0.0.1", "eth0": "192.0.2.2"}, loopback_job=False) is None


def test_user_variables_win():
    env = {"GLOO_SOCKET_IFNAME": "eth9"}
    assert fabric.socket_env("", loopback_job=True, env=env) == {"NCCL_SOCKET_IFNAME": "lo"}


def test_this_host_has_loopback():
    assert fabric.interfaces()["lo"] == "127.0.0.1"
