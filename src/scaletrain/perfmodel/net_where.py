"""calibrate's point-to-point and all-reduce microbenchmarks, and where the network's pair runs.

One microbenchmark, run by each rank (comm_figures): two processes send a 4-byte message and a
big one back and forth (latency and bandwidth of one way), and N processes all-reduce the same
two sizes. calibrate runs it here, over loopback: that pair gives the bandwidth between two
processes of one node (local_bandwidth), and the all-reduce the figures inside a node. The
network's figures (net_latency, net_bandwidth) are those of the same pair placed where the
nodes will talk (place):

- in the cluster twin (the recipe's cluster.network = netns): its two ranks in the namespaces of
  two emulated nodes, over a link shaped to cluster.link_gbps, made and removed by the twin's own
  code (twin.for_job: its self-test included; a killed calibrate leaves a record that the next
  twin, or `scaletrain twin clean`, acts on). The all-reduce stays on loopback: it times the
  replicas of one node, which share its memory, not a link;
- between two Slurm nodes, where calibrate runs in the batch step of an allocation of two or
  more nodes: each round is an srun step of one task on each of the first two nodes, placed
  and met as the project's Slurm jobs are (proc/env.py, launch/slurm.py). calibrate's jobs,
  the one-node parts, then run on the batch step's node with the local launcher: it takes the
  allocation's variables out of its own environment, or run.py would start them as srun steps;
- anywhere else the loopback pair is the network too, as it is for the local launcher's nodes.

The big message of a placed pair is sized to take about a quarter of a second on a twin's link
(5 timed round trips): a 16 MB message over a 0.2 Gbit/s link would take over a second each
way, and 20 of them half a minute a round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from .. import twin as twins
from ..config import Config, load_config
from ..errors import LaunchError
from ..launch import slurm
from ..proc import fabric
from ..proc.env import allocation_hosts, in_slurm_allocation, in_slurm_step, plan_for, rendezvous
from ..proc.parent import die_with_parent
from ..launch.local import free_port
from ..twin.netns import enter

SMALL = 1  # elements of the latency message (4 bytes)
# Elements of the bandwidth message, at least: a small gradient's transfer takes about as long
# as the 4-byte message, and the difference of the two is noise. The PS job's fit (calibrate.py)
# puts the transfers of the gradient's real size in their place.
BIG_MIN = 4_000_000
LINK_S = 0.25  # seconds one big message takes on a twin's link
LINK_REPS = 5  # timed round trips of each size on a twin's link
WAIT = datetime.timedelta(seconds=300)  # for a peer that never comes: a pair that cannot meet fails
LOOPBACK = "this host's loopback"


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs, after two unmeasured ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def comm_figures(rank: int, world: int, numel: int, backend: str, reps: int = 20,
                 allreduce: bool = True) -> dict[str, float]:
    """Each rank's part of the microbenchmark, in a process group made already: p2p_N (a pair's one
    way) and ar_N (an all-reduce over the group), seconds, for N = SMALL and `numel` elements."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    result = {}
    for n in (SMALL, numel):
        t = torch.zeros(n, device=device)
        if world == 2 and backend == "gloo":
            def ping_pong():  # point-to-point: rank 0 sends, rank 1 answers
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
            result[f"p2p_{n}"] = timed(ping_pong, reps) / 2  # one way
        if allreduce:
            def reduce():
                dist.all_reduce(t)  # collective over every process
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # host-device sync: the collective is over when the clock stops
            result[f"ar_{n}"] = timed(reduce, reps)
    return result


def _comm_worker(rank: int, world: int, addr: str, port: int, numel: int, out: str, backend: str,
                 reps: int = 20, allreduce: bool = True, namespaces: tuple[str, ...] = (), parent: int = 0) -> None:
    """One rank: into its node's namespace of the twin where `namespaces` names them (before any
    socket, with gloo on the twin's interface), meet the others at addr:port, run comm_figures;
    rank 0 writes them to `out` as JSON."""
    torch.set_num_threads(1)
    if namespaces:
        die_with_parent(parent)  # a killed calibrate leaves no rank waiting in the twin
        enter(namespaces[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = twins.IFNAME
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world, timeout=WAIT)
    try:
        result = comm_figures(rank, world, numel, backend, reps, allreduce)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_comm(world: int, numel: int, backend: str = "gloo") -> dict[str, float]:
    """comm_figures of `world` processes on this host, over loopback."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(world, "127.0.0.1", free_port("127.0.0.1"), numel, out, backend), nprocs=world)
        return json.loads(Path(out).read_text())


def alpha_beta(t_small: float, t_big: float, nbytes: float) -> tuple[float, float]:
    """Latency and bandwidth of one message from the time of a tiny and of an nbytes one."""
    return t_small, nbytes / max(t_big - t_small, 1e-12)


@dataclass
class Where:
    """Where the network's pair runs (place): words for the profile's [about] table, the elements of
    its big message, how it is run (a function returning comm_figures' p2p figures), the factor its
    bandwidth is multiplied by to stand for the cluster (a twin's time scale) and whether the nodes
    are machines of their own (shared_cores = 0)."""

    text: str
    elements: int
    run: Callable[[], dict[str, float]]
    scale: float = 1.0
    separate: bool = False

    def host(self) -> dict:
        """What derive needs of it, kept in the profile's [about.host] for rederive."""
        return {"network": self.text, "net_elements": self.elements, "net_scale": self.scale,
                "net_separate": self.separate}


def net_figures(prof, about: dict, m: dict[str, dict[str, float]], host: dict, say=print) -> tuple:
    """The profile with its network figures from the placed pair's measurement (m["net"], where
    host["network"] says it ran), and [about] saying where they come from; unchanged (the loopback
    pair's) where there is none. The loopback pair's bandwidth stays local_bandwidth, between the
    processes of one node, which talk over their node's memory in the twin as on a cluster."""
    about["network"] = host.get("network", LOOPBACK)
    if "net" not in m:
        return prof, about
    n, k = host["net_elements"], host["net_scale"]
    lat, bw = alpha_beta(m["net"][f"p2p_{SMALL}"], m["net"][f"p2p_{n}"], 4 * n)
    lat, bw = lat / k, bw * k  # a twin's time scale: its link ran k times slower than the cluster's
    say(f"  network ({host['network']}): latency {lat * 1e6:.0f} us, {bw / 1e6:.1f} MB/s "
        f"({bw * 8 / 1e9:.3g} Gbit/s of payload)")
    separate = host["net_separate"] and prof.shared_cores
    if separate:  # two machines: every node has its own cores, as on a GPU cluster
        say(f"  nodes are machines of their own: shared_cores 0 (was {prof.shared_cores})")
    return replace(prof, net_latency=lat, net_bandwidth=bw, **({"shared_cores": 0} if separate else {})), about


def place(cfg: Config, numel: int, env=os.environ) -> tuple[Where | None, Config]:
    """Where the network's pair runs for this recipe and this process (module docstring; None: the
    loopback pair), and the config calibrate's jobs and one-node figures run with (the twin's keys
    taken out: those jobs measure this host). Refuses at once, in one line, what cannot run here."""
    if cfg.cluster.network == "netns":
        if in_slurm_allocation(env):
            raise LaunchError("calibrate: cluster.network = netns is the cluster twin, on one machine; in a Slurm "
                              "allocation the network is measured between its nodes: set it to loopback")
        why = twins.privileges()
        if why:
            raise LaunchError(f"calibrate in the cluster twin: {why}")
        host_cfg = cfg.replace(**{"cluster.network": "loopback", "cluster.time_scale": 1.0,
                                  "cluster.slow_link_node": -1})
        return _twin_where(cfg), host_cfg
    if in_slurm_allocation(env) and not in_slurm_step(env) and len(allocation_hosts(env)) >= 2:
        where = _nodes_where(cfg, max(numel, BIG_MIN), dict(env))
        for key in [k for k in env if k.startswith("SLURM_")]:  # calibrate's jobs: this node's, local launcher
            del env[key]
        return where, cfg
    return None, cfg


def _twin_where(cfg: Config) -> Where:
    """The pair in two namespaces of a twin of the recipe's links (nodes 1 and 2: a slow link there
    counts), made afresh each round."""
    c = cfg.cluster
    gbps = min(c.slow_link_gbps if k == c.slow_link_node else c.link_gbps for k in (0, 1))
    elements = min(4 * BIG_MIN, max(SMALL + 1, int(gbps / c.time_scale * 1e9 / 8 * LINK_S / 4)))
    scaled = f", run at {gbps / c.time_scale:g} Gbit/s (cluster.time_scale {c.time_scale:g})" \
        if c.time_scale != 1 else ""
    return Where(f"twin link {gbps:g} Gbit/s{scaled}, between namespaces of two emulated nodes", elements,
                 lambda: _in_twin(c, elements), scale=c.time_scale)


def _in_twin(cluster, elements: int) -> dict[str, float]:
    """The pair's figures in a 2-node twin of `cluster`'s links; the twin removed on every way out
    (a SIGTERM too: it is raised as SystemExit here, so that the twin's close runs)."""
    with tempfile.TemporaryDirectory() as tmp, _term_raises():
        (Path(tmp) / "logs").mkdir()
        made = twins.for_job(cluster, 2, Path(tmp), lambda line: print(f"  {line}", flush=True))
        try:
            out = os.path.join(tmp, "comm.json")
            _spawn_pair((2, twins.address(0), twins.PORT, elements, out, "gloo", LINK_REPS, False,
                         (made.node_ns(0), made.node_ns(1)), os.getpid()))
            return json.loads(Path(out).read_text())
        finally:
            made.close()


def _spawn_pair(args: tuple) -> None:
    """Two _comm_worker ranks; both killed when this process stops waiting for them (an error, a
    signal), before the twin they run in is removed: a rank left waiting would hold its namespace."""
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:  # no resolver knows the twin's addresses: c10d would warn that it cannot name its client
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # read by the ranks as they import torch, as the launcher's
    try:
        ctx = mp.start_processes(_comm_worker, args=args, nprocs=2, join=False, start_method="spawn")
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    try:
        while not ctx.join():
            pass
    except BaseException as e:
        for p in ctx.processes:
            p.kill()
            p.join()
        if isinstance(e, ProcessException):  # a rank's traceback: its last line says what went wrong
            raise LaunchError(f"calibrate: the network microbenchmark in the cluster twin failed: "
                              f"{str(e).strip().splitlines()[-1]}") from None
        raise


class _term_raises:
    """SIGTERM raises SystemExit(143) while inside (main thread only; elsewhere nothing changes)."""

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def _nodes_where(cfg: Config, elements: int, env: dict[str, str]) -> Where:
    hosts, job = allocation_hosts(env)[:2], env.get("SLURM_JOB_ID", "0")
    return Where(f"between Slurm nodes {hosts[0]} and {hosts[1]} (job {job})", elements,
                 lambda: _between_nodes(cfg, elements, env, hosts), separate=True)


def _between_nodes(cfg: Config, elements: int, env: dict[str, str], hosts: list[str]) -> dict[str, float]:
    """The pair as an srun step of one task on each of the allocation's first two nodes (main() below),
    with the rendezvous on the first at the port a Slurm job of the project would use there."""
    job = env.get("SLURM_JOB_ID", "0")
    port = slurm.rendezvous_port(cfg, job, hosts[0], env)
    with tempfile.TemporaryDirectory() as tmp:  # rank 0 runs here, on the batch step's node
        cmd = ["srun", f"--job-name=scaletrain-calibrate-{job}", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
               "--cpu-bind=none", sys.executable, "-m", "scaletrain.perfmodel.net_where", "--elements", str(elements),
               "--out", tmp, "--ifname", cfg.cluster.ifname]
        r = subprocess.run(cmd, env={**slurm.step_env(env), "SCALETRAIN_PORT": str(port)}, capture_output=True,
                           text=True)
        out = Path(tmp) / "comm.json"
        if r.returncode or not out.exists():
            said = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").splitlines()[-1]
            raise LaunchError(f"calibrate: the network microbenchmark between {hosts[0]} and {hosts[1]} (srun) "
                              f"failed: {said}")
        return json.loads(out.read_text())


def pair_config(ifname: str = "") -> Config:
    """The plan of the pair between two nodes: one process on each, rank k on node k."""
    return load_config(None, ["cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.num_ps=0",
                              "strategy.name=allreduce", "train.device=cpu", f"cluster.ifname={ifname}"])


def main(argv: list[str] | None = None) -> int:
    """A task of the srun step: its rank and the rendezvous from Slurm's environment, as a task of a
    project's job finds them (launch/env.rendezvous), gloo on the interface such a job uses."""
    ap = argparse.ArgumentParser(prog="python -m scaletrain.perfmodel.net_where")
    ap.add_argument("--elements", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ifname", default="")
    a = ap.parse_args(argv)
    cfg = pair_config(a.ifname)
    try:
        rv = rendezvous(plan_for(cfg), cfg.cluster.master_addr, cfg.cluster.master_port)
        os.environ.update(fabric.socket_env(a.ifname, loopback_job=False))
    except LaunchError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    _comm_worker(rv.rank, rv.world, rv.addr, rv.port, a.elements, os.path.join(a.out, "comm.json"), "gloo",
                 allreduce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
