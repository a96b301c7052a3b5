"""Command line: parse -> config -> call. No training logic lives here."""

from __future__ import annotations

if __name__ == "__main__":  # `python -m scaletrain.cli`: stop signals held through the imports below
    from .proc import early

    early.hold()

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from .cli_args import parser
from .config import field_docs, load_config
from .errors import REPORTED, ConfigError, GridError, LaunchError, UntilError
from .launch import torchrun
from .proc import early, env as launch_env
from .proc.env import plan_for, run_dir_for
from .plan import format_table, node_line
from .study.grid import cells, parse_grid

# Everything else a command needs is imported where the command runs: torch and most of the
# package load only for commands that train, measure or model (`keys`, `plan` and --help load
# neither, and answer in a fraction of a second).


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
        from .launch import keep
        if keep.wanted(cfg):  # under torchrun or srun: this process keeps its rank; its child, this command
            return keep.kept(cfg, run_dir, args.plan_node)  # again, trains (torch loads there only)
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
