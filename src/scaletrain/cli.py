"""Command line: parse -> config -> call. No training logic lives here."""

from __future__ import annotations

if __name__ == "__main__":  # `python -m scaletrain.cli`: stop signals held through the imports below
    from .proc import early

    early.hold()

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from .config import field_docs, load_config
from .errors import REPORTED, ConfigError, GridError, LaunchError, UntilError
from .launch import torchrun
from .proc import early, env as launch_env
from .proc.env import plan_for, run_dir_for
from .perfmodel import OBJECTIVES
from .plan import format_table, node_line
from .study.grid import cells, parse_grid

# Everything else a command needs is imported where the command runs: torch and most of the
# package load only for commands that train, measure or model (`keys`, `plan` and --help load
# neither, and answer in a fraction of a second).


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a recipe")
    _recipe_args(t)
    t.add_argument("--run-dir", help="output directory (default runs/RECIPE-TIME)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    t.add_argument("--quiet", action="store_true", help="no progress output")
    t.add_argument("--plan-node", type=int, help="under torchrun: this agent's node index in the plan "
                   "(`scaletrain plan --format torchrun` writes it)")
    pl = sub.add_parser("plan", help="show where every process of a cluster config runs")
    _recipe_args(pl)
    pl.add_argument("--format", choices=("table", "json", "torchrun", "sbatch"), default="table")
    pl.add_argument("--run-dir", help="run directory the torchrun/sbatch commands write to")
    sl = sub.add_parser("slurm", help="write (and submit) an sbatch script for a recipe")
    _recipe_args(sl)
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
    _recipe_args(b)
    _grid_arg(b)
    b.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput (default 10)")
    b.add_argument("--steps", type=int, default=40, help="measured steps (default 40)")
    b.add_argument("--repeats", type=int, default=1,
                   help="passes over the grid, each cell run once a pass (default 1); with more, the table shows "
                        "the spread across runs too")
    b.add_argument("--out", help="output directory (default runs/bench-TIME)")
    b.add_argument("--pair-synthetic", action="store_true",
                   help="also run each cell on synthetic data, to show what the input pipeline costs")
    st = sub.add_parser("study", help="train every configuration of a grid; accuracy, time and time to target")
    _recipe_args(st)
    _grid_arg(st)
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
    _recipe_args(pk)
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


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="TOML recipe (see recipes/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (repeatable)")


def _grid_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", action="extend", nargs="+", default=[], metavar="KEY=V1,V2",
                   help="keys and their values; every combination is a cell. Several after one --grid "
                        "(or several --grid) multiply; K1+K2=A1:A2,B1:B2 moves keys together")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "train":  # a stop signal that came during the imports acts now; train's job takes it
        early.release()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "keys":
        for k, doc in field_docs().items():
            print(f"{k:28s} {doc}")
        return 0
    if args.command == "doctor":
        from . import doctor
        return doctor.main(args)
    if args.command == "twin":
        return _twin(args)
    if args.command == "report":
        from .study import report
        return report.main(args)
    if args.command == "calibrate" and (args.slurm or args.partition or args.time or args.submit or args.wait):
        if not args.slurm:
            print("scaletrain: error: --partition, --time, --submit and --wait go with --slurm", file=sys.stderr)
            return 2
        from .perfmodel import calibrate_slurm
        return calibrate_slurm.slurm_command(args.recipe, args.overrides, args.out, args.steps, args.runs,
                                             args.no_input, args.partition, args.time, args.submit, args.wait)
    if args.command == "calibrate":
        from .perfmodel import commands
        return commands.calibrate_command(args.recipe, args.overrides, args.out, args.steps, args.runs,
                                          args.no_input)
    if args.command == "predict":
        return _predict(args)
    if _ignored_flag(args):
        print(f"scaletrain: error: {_ignored_flag(args)}", file=sys.stderr)
        return 2
    try:
        imposed: tuple[str, ...] = ()
        if args.command == "bench":
            from .study.bench import IMPOSED as imposed
        cfg = load_config(args.recipe, [*args.overrides, *imposed])
    except ConfigError as e:
        print(f"scaletrain: config error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "resume", False) and not args.run_dir:
        print("scaletrain: --resume needs --run-dir (the run to continue)", file=sys.stderr)
        return 2
    if args.command in ("bench", "study"):
        from .study import bench, learning
        return (bench if args.command == "bench" else learning).main(args)

    run_dir = None
    try:
        if args.command == "pack":
            return _pack(args, cfg)
        run_dir = run_dir_for(args.recipe, args.run_dir, cfg)
        if args.command == "plan":
            return _plan(args, cfg, run_dir)
        if args.command == "slurm":
            return _slurm(args, cfg, run_dir)
        from .run import run_training
        summary = run_training(cfg, run_dir, resume=args.resume, progress=not args.quiet, plan_node=args.plan_node)
    except REPORTED as e:
        from .launch import supervise
        return supervise.report(e, run_dir)
    if summary:  # a worker of a torchrun or srun job other than the chief has none: the chief reports
        print(f"run dir: {run_dir}")
        print(summary_line(summary))
        from .run import warn_slow_input
        warn_slow_input(summary, cfg)
    if launch_env.in_torchrun() or launch_env.in_slurm_step():
        from .launch.join import exit_now
        exit_now(0)  # a job's process, its work done: no interpreter teardown (launch/join.exit_now)
    return 0


def _ignored_flag(args) -> str | None:
    """Why a flag given would do nothing here, in one line; None when each takes effect. A flag
    silently ignored lets a user believe it acted: --wait that waited for nothing, a --plan-node
    that placed nothing."""
    if args.command == "slurm" and args.wait and not args.submit:
        return "--wait waits for a submitted job: give --submit too (without it the script is only written)"
    if args.command == "train" and args.plan_node is not None and not launch_env.in_torchrun():
        return (f"--plan-node {args.plan_node}: for a process torchrun started (`scaletrain plan --format torchrun` "
                "writes the commands); this one places its processes itself")
    return None


def _predict(args) -> int:
    """`predict`, `predict --recommend` or `predict --validate`; only the first reads --grid."""
    from .perfmodel import commands
    from .study.learning import parse_until
    if args.validate:
        return commands.validate_command(args.profile, args.validate, args.out, args.format)
    try:
        target = parse_until(args.until)
        grid = cells(parse_grid(args.grid))
    except (GridError, UntilError) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    if args.recommend:
        return commands.recommend_command(args.profile, args.recipe, args.overrides, args.format, args.spread,
                                          args.max_nodes, args.max_batch, args.batches, args.objective,
                                          args.min_efficiency, args.max_staleness, target, args.learning,
                                          args.force)
    return commands.predict_command(args.profile, args.recipe, args.overrides, grid, args.format, args.spread,
                                    args.images, args.epochs, target, args.learning)


def _twin(args) -> int:
    """`twin clean`: what killed jobs' twins left, removed; `twin test`: a 2-node twin's measured link, as JSON;
    `twin down|up|slow RUN_DIR --node K`: a running job's network fault (twin/faults.py)."""
    from . import twin
    if twin.privileges():
        print(f"scaletrain: error: {twin.privileges()}", file=sys.stderr)
        return 2
    if args.action == "clean":
        removed = twin.clean()
        print(f"removed {len(removed)} namespaces of twins whose launcher is gone" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    if args.gbps is None and args.action == "test":
        args.gbps = 10.0
    try:
        if args.action in ("down", "up", "slow"):
            print(_twin_fault(args))
            return 0
        with twin.Twin.make(2, args.gbps) as made:
            got = twin.measure(made, [(0, 1)], args.seconds)[0]
            print(json.dumps({"set_gbps": args.gbps, "measured_gbps": round(got, 4), "seconds": args.seconds}))
    except LaunchError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    return 0


def _twin_fault(args) -> str:
    """`twin down|up|slow`: what was done, in one line; LaunchError for what it lacks."""
    missing = [what for what, given in (("RUN_DIR", args.run_dir), ("--node K", args.node),
                                        ("--gbps G", args.gbps if args.action == "slow" else 0)) if given is None]
    if missing:
        raise LaunchError(f"twin {args.action} needs {' and '.join(missing)}")
    from .twin import faults
    if args.action == "slow":
        return faults.slow(args.run_dir, args.node, args.gbps)
    return faults.link(args.run_dir, args.node, up=args.action == "up")


def _plan(args, cfg, run_dir: Path) -> int:
    plan = plan_for(cfg)
    c = cfg.cluster
    if args.format == "table":
        print(format_table(plan, c.master_addr, c.master_port))
        if cfg.parallel.stages > 1:
            from .pipeline import planned_split
            print("\n" + planned_split(cfg))
    elif args.format == "json":
        print(json.dumps({"nodes_total": plan.nodes_total, "world_size": plan.world_size,
                          "nodes": [node_line(plan, n) for n in range(plan.nodes_total)],
                          "processes": [asdict(p) for p in plan.procs]}, indent=2))
    elif args.format == "torchrun":
        print("\n".join(torchrun.commands(cfg, plan, args.recipe, args.overrides, run_dir)))
        if plan.nodes_total > 1 and c.master_addr in ("127.0.0.1", "localhost"):
            print("# on separate machines, set cluster.master_addr to node 1's host name", file=sys.stderr)
    else:
        from .launch import slurm
        train_args = ["--recipe", str(Path(args.recipe).resolve()), *(a for o in args.overrides for a in ("--set", o))]
        print(slurm.script(cfg, run_dir, train_args), end="")
    return 0


def _pack(args, cfg) -> int:
    from .data.shards import pack, parse_size
    try:
        size = parse_size(args.shard_size)
    except ValueError as e:
        raise ConfigError(f"--shard-size {e}") from None
    index = pack(cfg, args.out, size, args.workers, progress=not args.quiet)
    tr, te = index["splits"]["train"], index["splits"]["test"]
    shards = tr["shards"] + te["shards"]
    print(f"packed {tr['samples']:,} training and {te['samples']:,} test images of {len(index['classes'])} classes "
          f"into {len(shards)} shards ({sum(s['bytes'] for s in shards) / 1e6:,.1f} MB) in {args.out}"
          + (f"; skipped {len(index['skipped'])} unreadable (listed in index.json)" if index["skipped"] else ""))
    print(f"train from them with: --set data.name=shards --set data.root={args.out}")
    return 0


def _slurm(args, cfg, run_dir: Path) -> int:
    from .launch import flags, preflight, slurm
    from .models import check_network
    from .rundir import prepare_run_dir
    cfg = preflight.absolute_paths(cfg, Path.cwd())  # every node reads them, from wherever the job runs
    if args.setup:
        cfg = cfg.replace(**{"cluster.setup": [*cfg.cluster.setup, *args.setup]})
    plan = plan_for(cfg)
    checked, known = preflight.check_nodes(plan, cfg, args.partition, args.mem, args.node_cpus, args.node_gpus,
                                           args.node_mem)
    if not known:
        print(f"scaletrain: {checked}", file=sys.stderr)
    run_dir = run_dir.resolve()
    check_network(cfg)  # a network by import path that fails here would fail on every node, after the queue
    pythonpath, warnings = flags.job_flags(cfg, plan, run_dir, preflight.parts(plan, cfg)[0].gpus)
    prepare_run_dir(run_dir, args.resume, cfg)
    path = slurm.write(cfg, run_dir, partition=args.partition, time=args.time, account=args.account,
                       warn_before=args.warn_before, requeue=not args.no_requeue, resume=args.resume,
                       mem=args.mem, exclusive=args.exclusive, checked=checked, pythonpath=pythonpath,
                       warnings=warnings)
    for line in warnings:  # the script's header has them too
        print(f"scaletrain: warning: {line}", file=sys.stderr)
    print(f"wrote {path}")
    if not args.submit:
        print(f"submit it with: sbatch {path}")
        return 0
    return slurm.submit(path, wait=args.wait)


def summary_line(summary: dict) -> str:
    acc, emulated = summary.get("test_accuracy"), summary.get("emulated_compute_s")
    ips = summary.get("images_per_sec")
    rate = "img/s not measured (no log window after the warm-up)" if ips is None else f"{ips:.1f} img/s"
    if emulated:
        return (f"steps {summary['steps']}  {rate}  "
                f"emulated compute {emulated:g} s a step: no loss, not evaluated")
    return (f"steps {summary['steps']}  {rate}  "
            f"final train loss {summary['final_train_loss']:.4f}  "
            + (f"test accuracy {acc:.4f}" if acc is not None else "no test set"))


if __name__ == "__main__":
    sys.exit(main())
