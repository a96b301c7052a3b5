"""`scaletrain predict` and `scaletrain calibrate`: arguments -> model -> tables and files."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from ..config import build_config, load_config
from ..errors import USER_ERRORS, ConfigError, GridError, LaunchError, ModelError, PlanError, ProfileError
from .profile import dump_profile, fits, largest_batch, load_profile
from .setup import check_workload


def add_parsers(sub) -> None:
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
    pr.add_argument("--objective", choices=("throughput", "efficiency"), default="throughput")
    pr.add_argument("--min-efficiency", type=float, default=0.0)
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


def _fail(msg: str, code: int = 2) -> int:
    print(f"scaletrain: error: {msg}", file=sys.stderr)
    return code


def calibrate_main(args) -> int:
    from .calibrate import calibrate

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        return _fail(f"config error: {e}")

    try:
        if args.runs < 1 or args.steps < 1:
            return _fail(f"--runs {args.runs} / --steps {args.steps}: must be >= 1")
        prof, about = calibrate(cfg, steps=args.steps, runs=args.runs)
    except (PlanError, LaunchError, *USER_ERRORS) as e:  # a calibration job that could not run
        return _fail(str(e), 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump_profile(prof, about))
    print(f"profile: {args.out}")
    return 0


def predict_main(args) -> int:
    from ..study.grid import cells, parse_grid

    try:
        prof, _ = load_profile(args.profile)
        if args.validate:
            return validate_main(args, prof)
        if not args.recipe:
            return _fail("predict needs --recipe (or --validate BENCH_DIR)")
        if args.spread < 0:
            return _fail(f"--spread {args.spread}: must be >= 0")
        cfg = load_config(args.recipe, args.overrides)
        check_workload(cfg, prof, args.profile)
        if args.recommend:
            return _recommend(args, cfg, prof)
        grid = parse_grid(args.grid)
        images = prof.dataset_images if args.images is None else args.images
        epochs = (prof.epochs or cfg.train.epochs) if args.epochs is None else args.epochs
        if images < 0 or epochs < 0:
            raise ConfigError(f"--images {images} / --epochs {epochs}: must be >= 0")
    except (ProfileError, ConfigError, ModelError, GridError) as e:
        return _fail(str(e))
    from .predict import add_time

    rows = []
    for cell in cells(grid):
        label = ", ".join(f"{k}={v}" for k, v in cell.items()) or "recipe"
        try:
            row = add_time(predict_cell(cfg, cell, prof, args.spread), images, epochs)
        except (ConfigError, ModelError) as e:
            row = {"label": label, "error": str(e)}
        rows.append({"cell": cell, "label": label, **row})
    if args.format == "json":
        print(json.dumps(rows, indent=1))
    else:
        from .predict import table

        print(table(rows))
    return 1 if any(r.get("error") for r in rows) else 0


def predict_cell(cfg, cell: dict[str, str], prof, spread: float) -> dict[str, Any]:
    from .predict import predict

    return predict(build_config(cfg.to_dict(), [f"{k}={v}" for k, v in cell.items()]), prof, spread)


def _recommend(args, cfg, prof) -> int:
    from .recommend import recommend, recommend_table

    if args.max_nodes < 1:
        return _fail(f"--max-nodes {args.max_nodes}: must be >= 1")
    try:
        batches = recommend_batches(args, cfg.data.batch_size, largest_batch(prof))
    except ValueError as e:
        return _fail(str(e))
    if not any(fits(prof, b) for b in batches):
        from .profile import memory_text

        return _fail(f"no batch tried fits the device: {memory_text(prof, min(batches))}")
    print(f"recommend: up to {args.max_nodes} nodes of {prof.describe()}", file=sys.stderr)
    print(f"recommend: {batch_note(args, batches, cfg.data.batch_size, prof)}", file=sys.stderr)
    entries = recommend(cfg, prof, args.max_nodes, args.objective, args.min_efficiency, args.max_staleness,
                        args.spread, batches=batches)
    if args.format == "json":
        print(json.dumps(entries, indent=1))
    else:
        print(recommend_table(entries, args.objective))
    return 0


def recommend_batches(args, recipe: int, largest: int | None) -> list[int]:
    """The batches per replica --recommend tries: --batches, else batch_candidates up to
    --max-batch (default: the recipe's batch)."""
    from .recommend import batch_candidates

    if args.batches is not None and args.max_batch is not None:
        raise ValueError("give --batches or --max-batch, not both")
    if args.batches is not None:
        try:
            out = [int(b) for b in args.batches.split(",")]
        except ValueError:
            raise ValueError(f"--batches {args.batches}: expected whole numbers, e.g. 16,32,64") from None
        if not out or min(out) < 1:
            raise ValueError(f"--batches {args.batches}: each must be >= 1")
        return sorted(set(out))
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch {args.max_batch}: must be >= 1")
    return batch_candidates(recipe, args.max_batch or recipe, largest)


def batch_note(args, batches: list[int], recipe: int, prof) -> str:
    """'batches per replica 32, 64 (128, 256 do not fit: the device holds up to 109)', or for the
    default 'batch per replica 32, the recipe's (the device holds up to 109: --max-batch ...)'."""
    largest = largest_batch(prof)
    holds = f"the device holds up to {largest}" if largest is not None else \
        f"device_memory {prof.device_memory / 1e9:.2f} GB"
    if args.batches is None and args.max_batch is None and batches == [recipe]:
        return f"batch per replica {recipe}, the recipe's ({holds + ': ' if holds else ''}--max-batch or " \
               f"--batches to try others)"
    ok, unfit = [b for b in batches if fits(prof, b)], [b for b in batches if not fits(prof, b)]
    text = f"batches per replica {', '.join(map(str, ok)) or 'none'}"
    if unfit:
        text += f" ({', '.join(map(str, unfit))} {'does' if len(unfit) == 1 else 'do'} not fit: {holds})"
    return text


def validate_rows(bench_dirs: list[Path], prof, profile_path: str) -> list[dict[str, Any]]:
    """Every measured bench row with its prediction and relative error, and the measured and
    predicted speedups: both against scaling.BASELINE (the bench's measured baseline row, the
    model's prediction of that baseline), so they are the same quantity."""
    from . import scaling
    from .predict import predict

    out = []
    for d in bench_dirs:
        path = d / "bench-rows.json"
        if not path.exists():
            raise ProfileError(f"{d}: no bench-rows.json (a `scaletrain bench` output directory)")
        for row in scaling.add_scaling(json.loads(path.read_text())):  # figured again: older outputs too
            if row.get("error") or row.get("data") not in (None, "real") or not scaling.measured(row):
                continue
            nested: dict[str, dict] = {}
            for k, v in row["config"].items():
                sec, key = k.split(".", 1)
                nested.setdefault(sec, {})[key] = v
            cfg = build_config(nested, origin=str(path))
            check_workload(cfg, prof, profile_path)
            pred = predict(cfg, prof)
            measured = row["images_per_sec"]
            out.append({**{k: row.get(k) for k in ("strategy", "nodes", "nodes_total", "gpus_per_node", "num_ps",
                                                   "ps_placement", "cell", "label")},
                        "baseline": scaling.is_baseline(cfg.flat()),
                        "measured": measured, "predicted": pred["images_per_sec"],
                        "rel_error": pred["images_per_sec"] / measured - 1, "bottleneck": pred["bottleneck"],
                        "measured_speedup": row["speedup"], "measured_speedup_stderr": row["speedup_stderr"],
                        "predicted_speedup": pred["speedup"],
                        **{f"{k}_{side}": src.get(k) for k in ("staleness_mean", "staleness_p95", "dropped_fraction")
                           for side, src in (("measured", row), ("predicted", pred))},
                        "method": pred["method"], "bench_dir": str(d)})
    return out


def validate_table(rows: list[dict[str, Any]]) -> str:
    from .scaling import setup

    def pair(r: dict[str, Any], key: str, fmt: str) -> str:
        m, p = r.get(f"{key}_measured"), r.get(f"{key}_predicted")
        return "-" if m is None and p is None else \
            " / ".join("-" if v is None else format(v, fmt) for v in (m, p))

    lines = ["| Setup | Measured (img/s) | Predicted (img/s) | Error | Speedup measured | Speedup predicted | "
             "Staleness mean | Staleness p95 | Dropped | Bottleneck (predicted) |", "|---" * 10 + "|"]
    for r in rows:
        measured = "-" if r.get("measured_speedup") is None else \
            f"{r['measured_speedup']:.2f} ± {r['measured_speedup_stderr']:.2f}"
        predicted = "-" if r.get("predicted_speedup") is None else f"{r['predicted_speedup']:.2f}"
        lines.append(f"| {setup(r)} | {r['measured']:.1f} | {r['predicted']:.1f} | {r['rel_error']:+.1%} | "
                     f"{measured} | {predicted} | {pair(r, 'staleness_mean', '.2f')} | "
                     f"{pair(r, 'staleness_p95', '.0f')} | {pair(r, 'dropped_fraction', '.1%')} | {r['bottleneck']} |")
    return "\n".join(lines)


def staleness_errors(rows: list[dict[str, Any]]) -> list[float]:
    """Relative error of the predicted mean staleness, over the rows where gradients were stale."""
    return [r["staleness_mean_predicted"] / r["staleness_mean_measured"] - 1 for r in rows
            if r.get("staleness_mean_measured") and r.get("staleness_mean_predicted") is not None]


def speedup_errors(rows: list[dict[str, Any]]) -> list[float]:
    """Relative error of the predicted speedup over the rows other than the baselines (1 on both
    sides by definition). Each speedup is over the baseline of its own bench, measured in the same
    sweep: unlike throughput, it does not follow a host that runs slower or faster than it did
    when the profile was calibrated."""
    return [r["predicted_speedup"] / r["measured_speedup"] - 1 for r in rows
            if not r.get("baseline") and r.get("measured_speedup") and r.get("predicted_speedup") is not None]


def validate_main(args, prof) -> int:
    try:
        rows = validate_rows(args.validate, prof, args.profile)
    except (ProfileError, ConfigError, ModelError) as e:
        return _fail(str(e))
    if not rows:
        return _fail("no measured rows in " + ", ".join(map(str, args.validate)))
    median = statistics.median(abs(r["rel_error"]) for r in rows)
    stale = staleness_errors(rows)
    stale_median = statistics.median(abs(e) for e in stale) if stale else None
    speed = speedup_errors(rows)
    speed_median = statistics.median(abs(e) for e in speed) if speed else None
    out = args.out or args.validate[0]
    out.mkdir(parents=True, exist_ok=True)
    text = validate_table(rows) + "\n\nStaleness, p95 and dropped gradients: measured / predicted.\n" + \
        f"Median absolute throughput error over {len(rows)} configurations: {median:.1%}\n" + \
        ("" if speed_median is None else
         f"Median absolute error of the speedup over {len(speed)} beside the baselines: {speed_median:.1%}\n") + \
        ("" if stale_median is None else
         f"Median absolute error of the mean staleness over {len(stale)} with stale gradients: {stale_median:.1%}\n")
    summary = {"median_abs_error": median, "speedup_median_abs_error": speed_median,
               "staleness_median_abs_error": stale_median, "rows": rows}
    (out / "validate.md").write_text(text)
    (out / "validate-rows.json").write_text(json.dumps({"profile": str(args.profile), **summary}, indent=1) + "\n")
    if args.format == "json":
        print(json.dumps(summary, indent=1))
    else:
        print(text, end="")
    print(f"wrote {out / 'validate.md'} and {out / 'validate-rows.json'}", file=sys.stderr)
    return 0
