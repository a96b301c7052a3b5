"""The command line's parser: every command, its arguments and their help. cli.py runs them."""

from __future__ import annotations

import argparse
from pathlib import Path

from .perfmodel import OBJECTIVES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain", description="Train CNN image classifiers data-parallel on one "
                                "machine, under torchrun or Slurm, and study how the training scales.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a recipe")
    recipe_args(t)
    t.add_argument("--run-dir", help="output directory (default runs/RECIPE-TIME)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    t.add_argument("--quiet", action="store_true", help="no progress output")
    t.add_argument("--plan-node", type=int, help="under torchrun: this agent's node index in the plan "
                   "(`scaletrain plan --format torchrun` writes it)")
    pl = sub.add_parser("plan", help="show where every process of a cluster config runs")
    recipe_args(pl)
    pl.add_argument("--format", choices=("table", "json", "torchrun", "sbatch"), default="table")
    pl.add_argument("--run-dir", help="run directory the torchrun/sbatch commands write to")
    sl = sub.add_parser("slurm", help="write (and submit) an sbatch script for a recipe")
    recipe_args(sl)
    sl.add_argument("--run-dir", help="run directory (default runs/RECIPE-TIME); must be on a shared file system")
    sl.add_argument("--partition", default="")
    sl.add_argument("--time", default="", help="time limit, e.g. 02:00:00")
    sl.add_argument("--account", default="")
    sl.add_argument("--warn-before", type=int, default=300, metavar="SECONDS",
                    help="send the job SIGUSR1 this long before --time runs out: it checkpoints and is "
                         "requeued (default 300; 0 = no warning)")
    sl.add_argument("--no-requeue", action="store_true", help="a job stopped by the warning ends (no requeue)")
    sl.add_argument("--mem", default="", help="memory a node, e.g. 120G (default: the partition's default)")
    sl.add_argument("--exclusive", action="store_true", help="whole nodes: every CPU and all memory of each node")
    sl.add_argument("--node-cpus", type=int, metavar="N", help="the cluster's nodes have N CPUs: check the job "
                    "against that shape instead of sinfo's (away from the cluster)")
    sl.add_argument("--node-gpus", type=int, metavar="G", help="the cluster's nodes have G GPUs (as --node-cpus)")
    sl.add_argument("--node-mem", default="", metavar="SIZE", help="the cluster's nodes have SIZE memory, e.g. 500G")
    sl.add_argument("--setup", action="append", default=[], metavar="LINE",
                    help="a shell line the job runs before it starts, e.g. 'module load cuda/12.4' (repeatable; "
                         "after cluster.setup's; srun passes the environment on to every process)")
    sl.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    sl.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    sl.add_argument("--wait", action="store_true", help="with --submit: wait for the job, exit with its status")
    b = sub.add_parser("bench", help="throughput, speedup and efficiency over a grid of configurations")
    recipe_args(b)
    grid_arg(b)
    b.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput (default 10)")
    b.add_argument("--steps", type=int, default=40, help="measured steps (default 40)")
    b.add_argument("--repeats", type=int, default=1,
                   help="passes over the grid, each cell run once a pass (default 1); with more, the table shows "
                        "the spread across runs too")
    b.add_argument("--out", help="output directory (default runs/bench-TIME)")
    b.add_argument("--pair-synthetic", action="store_true",
                   help="also run each cell on synthetic data, to show what the input pipeline costs")
    st = sub.add_parser("study", help="train every configuration of a grid; accuracy, time and time to target")
    recipe_args(st)
    grid_arg(st)
    st.add_argument("--until", help="epochs=E (run length), accuracy=A or loss=L (target for the time to target)")
    st.add_argument("--out", help="output directory (default runs/study-TIME)")
    st.add_argument("--profile", help="hardware profile (TOML): each cell's time also on its clock, the cell's images "
                    "over the profile's predicted throughput, for the table, the improvement and the time plots")
    st.add_argument("--bench", help="a bench's output directory: each cell's time also on its clock, the cell's "
                    "images over the throughput the bench measured for the same configuration")
    rp = sub.add_parser("report", help="write report.html and report.md from bench/study/run directories")
    rp.add_argument("dirs", nargs="+", type=Path)
    rp.add_argument("--out", type=Path, help="output directory (default: report/ in the first DIR)")
    pk = sub.add_parser("pack", help="pack a recipe's image folder or manifest into tar shards (data.name = shards)")
    recipe_args(pk)
    pk.add_argument("--out", required=True, type=Path, help="directory for the shards (new or empty)")
    pk.add_argument("--shard-size", default="1GB", help="bytes per shard, e.g. 1GB, 512MB, 256MiB (default 1GB)")
    pk.add_argument("--workers", type=int, default=0, help="processes that read and check images (default: all cores)")
    pk.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_parser("keys", help="list every config key with its meaning, unit and range")
    tw = sub.add_parser("twin", help="the cluster twin (cluster.network = netns, root): test its links, remove "
                        "what a killed job's twin left, or cut or slow a running job's link")
    tw.add_argument("action", choices=("test", "clean", "down", "up", "slow"),
                    help="test: make a 2-node twin and measure its link; clean: delete the namespaces of twins whose "
                    "launcher is gone; down/up: set node K's link of the job running in RUN_DIR down (a partition: "
                    "it reaches no other node) or up; slow: set node K's link to --gbps each way")
    tw.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR", help="down, up, slow: the running job's "
                    "run directory (its logs/twin.json)")
    tw.add_argument("--node", type=int, metavar="K", help="down, up, slow: the node, numbered as the job's messages "
                    "number them: 1 is the chief's node (cluster.slow_link_node counts from 0)")
    tw.add_argument("--gbps", type=float, help="test: the link's rate, Gbit/s (default 10); slow: the node's new "
                    "rate at the cluster's speed, Gbit/s (divided by the run's cluster.time_scale in the twin)")
    tw.add_argument("--seconds", type=float, default=2.0, help="test: seconds of traffic (default 2)")
    dr = sub.add_parser("doctor", help="check this machine before a long job: torch, GPUs, network, Slurm, "
                        "and with a recipe what would not work here")
    dr.add_argument("--recipe", help="TOML recipe to check against this machine (optional)")
    dr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe key (repeatable)")
    dr.add_argument("--format", choices=("human", "json"), default="human")
    pr = sub.add_parser("predict", help="predicted throughput, speedup, efficiency and bottleneck of configurations")
    pr.add_argument("--profile", required=True, help="hardware profile (TOML, see profiles/)")
    pr.add_argument("--recipe", help="TOML recipe (not needed with --validate)")
    pr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pr.add_argument("--grid", action="extend", nargs="+", default=[], metavar="KEY=V1,V2",
                    help="as for bench: several KEY=VALUES after one --grid, or several --grid")
    pr.add_argument("--format", choices=("table", "json"), default="table")
    pr.add_argument("--spread", type=float, default=0.0,
                    help="coefficient of variation of replica step times (0 = equal speeds)")
    pr.add_argument("--images", type=int, help="training images per epoch: adds seconds per epoch (default: the "
                    "profile's dataset_images)")
    pr.add_argument("--epochs", type=float, help="epochs to train: adds hours to train (default: the profile's "
                    "epochs, else the recipe's train.epochs)")
    pr.add_argument("--recommend", action="store_true",
                    help="best strategy, PS count, placement and batch per replica per node count")
    pr.add_argument("--max-nodes", type=int, default=16)
    pr.add_argument("--max-batch", type=int, help="--recommend: also try the powers of two above the recipe's "
                    "data.batch_size up to this many images per replica, those that fit the device (default: "
                    "the recipe's batch only, as a larger one grows the images per update and so changes "
                    "the optimisation)")
    pr.add_argument("--batches", metavar="B1,B2,...", help="--recommend: the batches per replica to try "
                    "(instead of --max-batch)")
    pr.add_argument("--objective", choices=OBJECTIVES, default="throughput",
                    help="--recommend: rank by throughput, efficiency, or the hours to --until's target")
    pr.add_argument("--until", metavar="accuracy=A|loss=L", help="the target to predict updates, images and hours to "
                    "(with --learning)")
    pr.add_argument("--learning", type=Path, nargs="+", metavar="RUN_DIR",
                    help="runs on this workload that reached --until's target: one synchronous run with its gradient "
                    "noise scale (2 or more replicas, or train.noise_every), and for asynchronous parameter servers "
                    "emulator runs (strategy.emulate_workers); what time to accuracy is predicted from")
    pr.add_argument("--min-efficiency", type=float, default=0.0)
    pr.add_argument("--force", action="store_true", help="--recommend: recommend from a profile its calibration "
                    "flagged (its [about] flags, printed as warnings) instead of refusing it")
    pr.add_argument("--max-staleness", type=float, help="leave out configurations with more mean staleness")
    pr.add_argument("--validate", nargs="+", type=Path, metavar="BENCH_DIR",
                    help="predicted against measured for every row of these bench outputs")
    pr.add_argument("--out", type=Path, help="--validate: where validate.md and validate-rows.json go "
                    "(default: the first BENCH_DIR, where `scaletrain report` finds them)")
    ca = sub.add_parser("calibrate", help="measure a hardware profile on this machine")
    ca.add_argument("--recipe", help="TOML recipe whose model and batch to measure (default: built-in defaults)")
    ca.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ca.add_argument("--out", type=Path, default=Path("profiles/local.toml"))
    ca.add_argument("--steps", type=int, default=30, help="measured training steps (default 30)")
    ca.add_argument("--runs", type=int, default=3, help="rounds, each measuring every figure once; the profile "
                    "holds the medians (default 3)")
    ca.add_argument("--no-input", action="store_true", help="skip the input rate (images/s a loader core reads, "
                    "decodes and augments from the recipe's data.root; measured by default where that holds "
                    "image files): input_rate stays 0 and predictions leave loading out")
    ca.add_argument("--slurm", action="store_true", help="write a Slurm job of 2 nodes that calibrates: the one-node "
                    "figures on its first node, the network's between its two (srun); script and logs in OUT's "
                    "folder, OUT-slurm/ (run it where the recipe's data.root and OUT's folder are on every node)")
    ca.add_argument("--partition", default="", help="--slurm: the job's partition")
    ca.add_argument("--time", default="", help="--slurm: the job's time limit, e.g. 01:00:00")
    ca.add_argument("--submit", action="store_true", help="--slurm: submit the script with sbatch")
    ca.add_argument("--wait", action="store_true", help="with --submit: wait for the job, exit with its status")
    return p


def recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="TOML recipe (see recipes/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (repeatable)")


def grid_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", action="extend", nargs="+", default=[], metavar="KEY=V1,V2",
                   help="keys and their values; every combination is a cell. Several after one --grid "
                        "(or several --grid) multiply; K1+K2=A1:A2,B1:B2 moves keys together")
