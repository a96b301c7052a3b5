"""An emulated 4-node Slurm cluster on this one machine, for tests that submit real jobs.

Install (Debian 12: Slurm 22.05.8, munge 0.5.15; needs root), e.g. as a `make slurm` target:
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge

Use:     with Cluster() as c: c.start(tmp_path); subprocess.run(["sbatch", "--wait", ...], env=c.env)
By hand: python tests/slurm_cluster.py up DIR; SLURM_CONF=DIR/slurm.conf sinfo; ... down DIR

node1..node4 are four slurmd processes on 127.0.0.1, slurmctld on the port below theirs: five
consecutive ports free when the cluster starts (free_ports), so a cluster already up (a user's,
another test's) is left alone. Each declares Cluster(cpus=...) CPUs (8 unless told) whatever the
hardware has, and Cluster(gpus=...) GPUs that Slurm counts and hands out (CUDA_VISIBLE_DEVICES,
SLURM_STEP_GPUS) with nothing behind them; the partition hands out whole nodes, so
`sbatch --nodes=N` alone is enough for `srun --ntasks-per-node=k`. Config, munge key and socket, state, spool and logs all live in
the work directory; outside it: one /etc/hosts line (node1..node4 -> 127.0.0.1), and where cgroups
bind the steps, slurmd's cpusets /sys/fs/cgroup/cpuset/slurm_node1..4, removed by stop().
"""
import os, shutil, signal, socket, stat, subprocess, sys, time
from pathlib import Path

NODES = ["node1", "node2", "node3", "node4"]
HOSTS_LINE = "127.0.0.1 node1 node2 node3 node4  # tests/slurm_cluster.py"
CONF = """\
ClusterName=emulated
SlurmctldHost={host}
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may run again (default 120 s).
AuthInfo=socket={wd}/munge/socket,cred_expire=10
StateSaveLocation={wd}/state
SlurmdSpoolDir={wd}/spool/%n
SlurmctldPidFile={wd}/run/slurmctld.pid
SlurmdPidFile={wd}/run/slurmd-%n.pid
SlurmctldLogFile={wd}/log/slurmctld.log
SlurmdLogFile={wd}/log/slurmd-%n.log
# Track processes by /proc parentage (proctrack/pgid here adds 3 s to every job that runs srun:
# it waits on a zombie in the batch process group). Steps are confined to their CPUs as on a GPU
# cluster: a cpuset cgroup per step (task/cgroup, ConstrainCores) where cgroup v1's cpuset is
# mounted, else affinity masks (task/affinity); see binding().
ProctrackType=proctrack/linuxproc
TaskPlugin={task_plugin}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=2
# Schedule a submitted job at once (the default batches them for up to 3 s), and look at pending
# jobs every second (default 60 s): a requeued job runs as soon as it may.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1
# `sbatch --wait` polls every 2 s only while MinJobAge/2 <= 2 (else 2, 8, 32 s); 5 s still keeps
# a finished job long enough for that poll to read its exit code.
MinJobAge=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# slurmd takes CPUs/RealMemory from this file even though the machine has fewer cores.
SlurmdParameters=config_overrides
{gres_types}NodeName=node[1-4] NodeHostname={host} NodeAddr=127.0.0.1 Port={port1}-{port4} CPUs={cpus} RealMemory=1024{gres}
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
"""


CPUSET = Path("/sys/fs/cgroup/cpuset")  # cgroup v1's cpuset hierarchy, where Slurm 22.05's cgroup/v1 works


def binding():
    """(TaskPlugin, cgroup.conf text): cgroups confine each step to the CPUs Slurm gave it where a
    writable cgroup v1 cpuset is mounted (slurmd then makes CPUSET/slurm_NODE); elsewhere task/affinity
    binds each task to them (cgroup/v2 in 22.05 needs systemd). Both confine a step the same way: a
    task sees the step's CPUs on its node, no more."""
    if (CPUSET / "cpuset.cpus").exists() and os.access(CPUSET, os.W_OK):
        return "task/cgroup,task/affinity", "CgroupPlugin=cgroup/v1\nConstrainCores=yes\n"
    return "task/affinity", ""


def free_ports(first=17000, last=27000, span=5):
    """The lowest of `span` consecutive TCP ports on 127.0.0.1 that nothing listens on or holds,
    searched upwards from `first`: bound one by one to be sure, then released for the daemons."""
    base = first
    while base + span <= last:
        socks = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            base = port + 1  # past the port that is taken
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} consecutive free ports between {first} and {last}")


def available():
    """None when the emulated cluster can run here, else a one-line reason why not."""
    if os.geteuid() != 0:
        return "not root: the emulated Slurm cluster needs root to start munged and slurmd"
    for prog in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scancel"):
        if shutil.which(prog) is None:
            return f"{prog} not installed: run `make slurm`"
    return None


class Cluster:
    def __init__(self, cpus=8, gpus=0):
        """cpus: CPUs each node declares; gpus: GPUs each node declares (gres gpu with no device
        files: Slurm counts and hands them out, nothing on this machine backs them)."""
        self.workdir, self.procs, self.cpus, self.gpus = None, [], cpus, gpus

    @property
    def env(self):
        """Environment for sbatch/srun/sinfo/...: SLURM_CONF points them at this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.workdir / "slurm.conf"))

    def start(self, workdir, timeout=60.0):
        wd = self.workdir = Path(workdir).resolve()
        port = free_ports()
        for d in ["munge", "state", "run", "log"] + [f"spool/{n}" for n in NODES]:
            (wd / d).mkdir(parents=True, exist_ok=True)
        key = wd / "munge" / "key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        gres = dict(gres_types="GresTypes=gpu\n", gres=f" Gres=gpu:{self.gpus}") if self.gpus else \
            dict(gres_types="", gres="")
        task_plugin, cgroup = binding()
        (wd / "slurm.conf").write_text(CONF.format(host=socket.gethostname().split(".")[0], wd=wd, cpus=self.cpus,
                                                   task_plugin=task_plugin, port=port, port1=port + 1,
                                                   port4=port + 4, **gres))
        (wd / "cgroup.conf").write_text(cgroup)  # read from slurm.conf's directory
        # slurmd 22.05 drops a GPU with no File= ("Removing file-less GPU") and logs an error for a
        # File= that is no device: so each fake GPU is a character device node like /dev/null's.
        for i in range(self.gpus):
            dev = wd / "dev" / f"gpu{i}"
            if not dev.exists():
                dev.parent.mkdir(exist_ok=True)
                os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (wd / "gres.conf").write_text(f"Name=gpu File={wd}/dev/gpu[0-{self.gpus - 1}]\n" if self.gpus else "")
        hosts = Path("/etc/hosts")  # idempotent append; other lines are never touched
        if HOSTS_LINE not in hosts.read_text():
            with hosts.open("a") as f:
                f.write(("" if hosts.read_text().endswith("\n") else "\n") + HOSTS_LINE + "\n")
        # Daemons run in the foreground (-F/-D) as our children, each in its own session.
        # munged --force: accept the socket and key in a work dir with any permissions (it wants
        # o+x on the socket dir otherwise); in the foreground it logs to stderr: log/munged.out.
        try:
            self._spawn("munged", "-F", "--force", f"--socket={wd}/munge/socket", f"--key-file={key}",
                        f"--pid-file={wd}/run/munged.pid", f"--seed-file={wd}/munge/seed")
            self._wait(lambda: (wd / "munge" / "socket").exists(), 10, "munged socket")
            self._spawn("slurmctld", "-D", "-i", "-f", f"{wd}/slurm.conf")
            for n in NODES:
                self._spawn("slurmd", "-D", "-N", n, "-f", f"{wd}/slurm.conf")
            self._wait(lambda: self._idle() == len(NODES), timeout, "4 idle nodes in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        """Cancel all jobs, then kill every process of this cluster; leaves nothing running."""
        if self.workdir is None:
            return
        try:  # slurm ends its jobs best (a job's slurmstepd ignores SIGTERM); wait <= 10 s
            self._run("scancel", "--quiet", "--partition=debug")
            deadline = time.monotonic() + 10
            while self._run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        except (OSError, subprocess.SubprocessError):
            pass  # controller gone already: the kills below still clean up
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _cluster_pids(self.workdir):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while any(p.poll() is None for p in self.procs) or _cluster_pids(self.workdir):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)  # poll() above also reaps our children: no zombies left
        self.procs = [p for p in self.procs if p.poll() is None]
        _remove_cgroups()

    __enter__ = lambda self: self
    __exit__ = lambda self, *exc: self.stop()

    def _spawn(self, prog, *args):
        name = prog + (f"-{args[2]}" if prog == "slurmd" else "")
        with open(self.workdir / "log" / f"{name}.out", "ab") as out:  # also marks it as ours
            self.procs.append(subprocess.Popen([prog, *args], stdin=subprocess.DEVNULL, stdout=out,
                                               stderr=out, start_new_session=True))

    def _run(self, *argv):
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=15)

    def _idle(self):
        lines = self._run("sinfo", "-h", "-N", "-o", "%N %t").stdout.splitlines()
        return sum(line.split()[1:] == ["idle"] for line in lines)

    def _wait(self, cond, timeout, what):
        """Wait for cond(); on timeout or a dead daemon raise with the tail of every log."""
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = [f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-8:])
                         for log in sorted((self.workdir / "log").iterdir())]
                why = f"{', '.join(dead)} exited" if dead else f"not after {timeout:.0f} s"
                raise RuntimeError(f"Slurm cluster in {self.workdir}: no {what}: {why}\n" + "\n".join(tails))
            time.sleep(0.2)


def _remove_cgroups():
    """The cpusets slurmd made (CPUSET/slurm_NODE/...; slurmd leaves its own behind), deepest first.
    A cgroup with a live process in it stays (rmdir fails); nothing else is touched."""
    for top in (CPUSET / f"slurm_{n}" for n in NODES):
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            try:
                d.rmdir()
            except OSError:
                pass


def _cluster_pids(wd):
    """Live pids of the cluster in wd. Every daemon and every slurmstepd holds a file in wd/log
    open and leads its own session (slurmstepd calls setsid); a job's tasks stay in their
    slurmstepd's session. So: all the processes in the sessions of the holders of wd/log files."""
    stat, sids = {}, set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:  # /proc/PID/stat after "(comm)": state ppid pgrp session ...
            stat[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{wd}/log/")
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                sids.add(stat[pid][3])
        except OSError:
            continue  # it ended meanwhile
    sids -= {"0", "1", str(os.getsid(0))}  # never our own session
    return [int(p) for p, s in stat.items() if s[3] in sids and s[0] != "Z" and int(p) != os.getpid()]


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("up", "down") or available():
        sys.exit(available() or "usage: python tests/slurm_cluster.py up|down DIR")
    c = Cluster()
    if sys.argv[1] == "up":
        c.start(sys.argv[2])
    else:
        c.workdir = Path(sys.argv[2]).resolve()
        c.stop()
