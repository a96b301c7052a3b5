"""The performance model's commands, `scaletrain calibrate` and `scaletrain predict` (with
--recommend or --validate): parsed values -> model -> tables and files, and an exit status.

cli.py parses the arguments (every parser is there) and expands --grid into cells: the grid
is the study's, above this layer. An error the user can fix is one line and status 2; a
calibration job that could not run, status 1.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ..config import Config, build_config, load_config
from ..errors import USER_ERRORS, ConfigError, LaunchError, ModelError, PlanError, ProfileError
from ..models import check_network
from .bands import band, field_spreads, no_spread
from .calibrate import calibrate
from .cluster import load_for
from .predict import add_time, predict, table
from .profile import Profile, dump_profile, fits, largest_batch, load_profile, memory_text
from .recommend import batch_candidates, recommend, recommend_table, shown_flags
from .setup import check_workload
from .statistical import Learning, add_target, read_learning
from .validate import speedup_errors, staleness_errors, validate_rows, validate_table


def fail(msg: str, code: int = 2) -> int:
    print(f"scaletrain: error: {msg}", file=sys.stderr)
    return code


def calibrate_command(recipe: str | None, overrides: list[str], out: Path, steps: int = 30, runs: int = 3,
                      no_input: bool = False) -> int:
    """`scaletrain calibrate`: measure a profile of this machine for the recipe into OUT; with
    `no_input`, without the input rate (it stays 0)."""
    try:
        cfg = load_config(recipe, overrides)
        check_network(cfg)  # before the first figure: a network that cannot be built measures nothing
    except ConfigError as e:
        return fail(f"config error: {e}")

    try:
        if runs < 1 or steps < 1:
            return fail(f"--runs {runs} / --steps {steps}: must be >= 1")
        prof, about = calibrate(cfg, steps=steps, runs=runs, measure_input=not no_input)
    except (PlanError, LaunchError, *USER_ERRORS) as e:  # a calibration job that could not run
        return fail(str(e), 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_profile(prof, about))
    print(f"profile: {out}")
    return 0


def workload(profile: str, recipe: str | None, overrides: list[str],
             spread: float) -> tuple[Profile, Config, list[str], dict]:
    """The profile and the recipe's config, checked against each other (check_workload), and the
    profile's flags (calibrate.py: what says its calibration cannot be true). A cluster description
    (cluster.py) is made the profile of the recipe's network on its nodes."""
    if not recipe:
        raise ConfigError("predict needs --recipe (or --validate BENCH_DIR)")
    if spread < 0:
        raise ConfigError(f"--spread {spread}: must be >= 0")
    cfg = load_config(recipe, overrides)
    prof, about = load_for(profile, cfg)
    check_workload(cfg, prof, profile)
    return prof, cfg, profile_flags(about), about


def profile_flags(about: dict) -> list[str]:
    """The [about] table's flags: one line each (a single string, written by hand, is one flag)."""
    flags = about.get("flags", [])
    return [flags] if isinstance(flags, str) else [str(f) for f in flags]


def warn_flags(profile: str, flags: list[str]) -> None:
    for flag in flags:
        print(f"scaletrain: warning: profile {profile} is flagged: {flag}", file=sys.stderr)


def refusal(profile: str, flags: list[str]) -> str:
    """Why --recommend will not choose from a flagged profile, in one line."""
    more = f" (and {len(flags) - 1} more)" if len(flags) > 1 else ""
    return (f"profile {profile} is flagged: {flags[0]}{more}; calibrate again on a quiet machine, or give --force "
            "to recommend from it anyway")


def predict_command(profile: str, recipe: str | None, overrides: list[str], cells: list[dict[str, str]],
                    fmt: str = "table", spread: float = 0.0, images: int | None = None,
                    epochs: float | None = None, target: tuple[str, float] | None = None,
                    learning: list[Path] | None = None) -> int:
    """`scaletrain predict`: the predicted figures of each cell of the grid (cells: {key: value}
    each; [{}] is the recipe alone), with seconds per epoch of `images` and hours to train
    `epochs` (defaults: the profile's, else the recipe's epochs), and with `target` (--until) the
    updates, images and hours to it from the measured run in `learning` (statistical.py). Status 1
    when a cell could not be predicted."""
    try:
        measured = learned(target, learning)
        prof, cfg, flags, about = workload(profile, recipe, overrides, spread)
        images = prof.dataset_images if images is None else images
        epochs = (prof.epochs or cfg.train.epochs) if epochs is None else epochs
        if images < 0 or epochs < 0:
            raise ConfigError(f"--images {images} / --epochs {epochs}: must be >= 0")
        spreads = field_spreads(about)
    except (ProfileError, ConfigError, ModelError) as e:
        return fail(str(e))
    warn_flags(profile, flags)  # a prediction from it may still say something; a recommendation is refused
    rows = []
    for cell in cells:
        label = ", ".join(f"{k}={v}" for k, v in cell.items()) or "recipe"
        try:
            c = build_config(cfg.to_dict(), [f"{k}={v}" for k, v in cell.items()])
            row = banded_row(c, prof, spreads, spread, images, epochs, measured)
        except (ConfigError, ModelError) as e:
            row = {"label": label, "error": str(e)}
        rows.append({"cell": cell, "label": label, **row})
    if fmt == "json":
        print(json.dumps(rows, indent=1))
    else:
        if not spreads:
            print(f"predict: {no_spread()}", file=sys.stderr)
        if measured:
            print(f"predict: to {measured.describe()}", file=sys.stderr)
            if cfg.optim.scale_lr != "noise":
                print(f"predict: updates to the target are those of optim.scale_lr = 'noise' (optim.noise_scale = "
                      f"{measured.noise_scale:.0f}); the recipe scales lr by {cfg.optim.scale_lr!r}", file=sys.stderr)
        print(table(rows))
    return 1 if any(r.get("error") for r in rows) else 0


def banded_row(c: Config, prof: Profile, spreads: dict[str, float], spread: float, images: int, epochs: float,
               measured: Learning | None) -> dict:
    """predict's row for c, with epoch and training time, the figures to the target where
    `measured`, and their bands (bands.py: the row predicted again with each uncertain field of
    the profile moved, and the learning runs' own half-width)."""
    def row_of(p: Profile) -> dict:
        row = add_time(predict(c, p, spread), images, epochs)
        return add_target(row, c, measured) if measured else row

    row = row_of(prof)
    row["band"] = band(row, prof, spreads, row_of, measured.band() if measured else 0.0)
    return row


def learned(target: tuple[str, float] | None, learning: list[Path] | None) -> Learning | None:
    """The measured runs that time to a target is predicted from; both --until and --learning, or neither."""
    if (target is None) != (learning is None) or (target and target[0] == "epochs"):
        raise ModelError("time to a target needs --until accuracy=A or loss=L and --learning RUN_DIR (a run that "
                         "reached it, measured on this workload)")
    return read_learning(learning, target) if target else None


def recommend_command(profile: str, recipe: str | None, overrides: list[str], fmt: str = "table",
                      spread: float = 0.0, max_nodes: int = 16, max_batch: int | None = None,
                      batches: str | None = None, objective: str = "throughput", min_efficiency: float = 0.0,
                      max_staleness: float | None = None, target: tuple[str, float] | None = None,
                      learning: list[Path] | None = None, force: bool = False) -> int:
    """`scaletrain predict --recommend`: the best configuration per node count up to max_nodes,
    trying the batches per replica `batches` ("16,32") or those up to max_batch (default: the
    recipe's batch only). A flagged profile is refused (status 2) unless `force`: a configuration
    chosen on figures that cannot be true is worse than none. Rows whose strategy's speedup falls
    with nodes are marked in the table and named on stderr."""
    try:
        measured = learned(target, learning)
        prof, cfg, flags, about = workload(profile, recipe, overrides, spread)
        if flags and not force:
            return fail(refusal(profile, flags))
        warn_flags(profile, flags)
        if max_nodes < 1:
            return fail(f"--max-nodes {max_nodes}: must be >= 1")
        try:
            tried = recommend_batches(batches, max_batch, cfg.data.batch_size, largest_batch(prof))
        except ValueError as e:
            return fail(str(e))
        if not any(fits(prof, b) for b in tried):
            return fail(f"no batch tried fits the device: {memory_text(prof, min(tried))}")
        print(f"recommend: up to {max_nodes} nodes of {prof.describe()}", file=sys.stderr)
        asked = batches is not None or max_batch is not None
        print(f"recommend: {batch_note(tried, cfg.data.batch_size, prof, asked)}", file=sys.stderr)
        if measured:
            left = ("asynchronous rounds left out" if measured.staleness_factor is not None else
                    "asynchronous strategies left out: give --learning an emulator run to predict them")
            print(f"recommend: to {measured.describe()}; {left}", file=sys.stderr)
        spreads = field_spreads(about)
        if not spreads:
            print(f"recommend: {no_spread()}", file=sys.stderr)
        entries = recommend(cfg, prof, max_nodes, objective, min_efficiency, max_staleness, spread, batches=tried,
                            learning=measured, spreads=spreads)
    except (ProfileError, ConfigError, ModelError) as e:
        return fail(str(e))
    falling = shown_flags(entries)
    if falling:
        print(f"recommend: flagged rows, outside what more nodes can do: {'; '.join(falling)}; a figure of the "
              "profile may be wrong", file=sys.stderr)
    if fmt == "json":
        print(json.dumps(entries, indent=1))
    else:
        print(recommend_table(entries, objective))
        close = [f"{e['nodes']} node{'s' if e['nodes'] > 1 else ''}: {e['overlap']}" for e in entries if e["overlap"]]
        print("\n" + "\n".join(close) if close else "", end="\n" if close else "")
    return 0


def recommend_batches(batches: str | None, max_batch: int | None, recipe: int, largest: int | None) -> list[int]:
    """The batches per replica --recommend tries: --batches, else batch_candidates up to
    --max-batch (default: the recipe's batch)."""
    if batches is not None and max_batch is not None:
        raise ValueError("give --batches or --max-batch, not both")
    if batches is not None:
        try:
            out = [int(b) for b in batches.split(",")]
        except ValueError:
            raise ValueError(f"--batches {batches}: expected whole numbers, e.g. 16,32,64") from None
        if not out or min(out) < 1:
            raise ValueError(f"--batches {batches}: each must be >= 1")
        return sorted(set(out))
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"--max-batch {max_batch}: must be >= 1")
    return batch_candidates(recipe, max_batch or recipe, largest)


def batch_note(batches: list[int], recipe: int, prof: Profile, asked: bool) -> str:
    """'batches per replica 32, 64 (128, 256 do not fit: the device holds up to 109)', or for the
    default (asked: whether --batches or --max-batch was given) 'batch per replica 32, the
    recipe's (the device holds up to 109: --max-batch ...)'."""
    largest = largest_batch(prof)
    holds = f"the device holds up to {largest}" if largest is not None else \
        f"device_memory {prof.device_memory / 1e9:.2f} GB"
    if not asked and batches == [recipe]:
        return f"batch per replica {recipe}, the recipe's ({holds + ': ' if holds else ''}--max-batch or " \
               f"--batches to try others)"
    ok, unfit = [b for b in batches if fits(prof, b)], [b for b in batches if not fits(prof, b)]
    text = f"batches per replica {', '.join(map(str, ok)) or 'none'}"
    if unfit:
        text += f" ({', '.join(map(str, unfit))} {'does' if len(unfit) == 1 else 'do'} not fit: {holds})"
    return text


def validate_command(profile: str, bench_dirs: list[Path], out: Path | None = None, fmt: str = "table") -> int:
    """`scaletrain predict --validate`: predicted against measured for every row of the bench
    outputs, written to OUT (default: the first bench directory, where `scaletrain report` finds
    them) as validate.md and validate-rows.json; the exit status."""
    try:
        prof, about = load_profile(profile)
        warn_flags(profile, profile_flags(about))
        rows = validate_rows(bench_dirs, prof, profile)
    except (ProfileError, ConfigError, ModelError) as e:
        return fail(str(e))
    if not rows:
        return fail("no measured rows in " + ", ".join(map(str, bench_dirs)))
    median = statistics.median(abs(r["rel_error"]) for r in rows)
    stale = staleness_errors(rows)
    stale_median = statistics.median(abs(e) for e in stale) if stale else None
    speed = speedup_errors(rows)
    speed_median = statistics.median(abs(e) for e in speed) if speed else None
    out = out or bench_dirs[0]
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
    (out / "validate-rows.json").write_text(json.dumps({"profile": str(profile), **summary}, indent=1) + "\n")
    if fmt == "json":
        print(json.dumps(summary, indent=1))
    else:
        print(text, end="")
    print(f"wrote {out / 'validate.md'} and {out / 'validate-rows.json'}", file=sys.stderr)
    return 0
