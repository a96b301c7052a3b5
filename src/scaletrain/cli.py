"""Command line: parse -> config -> call. No training logic lives here."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .checkpoint import CheckpointError
from .config import ConfigError, field_docs, load_config
from .data import DataError
from .models import PretrainedError
from .plan import PlanError

# Errors the user can act on: printed as one line, never as a traceback.
USER_ERRORS = (DataError, PretrainedError, CheckpointError)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a recipe")
    t.add_argument("--recipe", required=True, help="TOML recipe (see recipes/)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.steps=100 (repeatable)")
    t.add_argument("--run-dir", help="output directory (default runs/RECIPE-TIME)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    t.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_parser("keys", help="list every config key with its meaning, unit and range")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "keys":
        for k, doc in field_docs().items():
            print(f"{k:28s} {doc}")
        return 0
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"scaletrain: config error: {e}", file=sys.stderr)
        return 2
    if args.resume and not args.run_dir:
        print("scaletrain: --resume needs --run-dir (the run to continue)", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/{Path(args.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    from .train import RunError, prepare_run_dir, train  # torch is imported only once the config is valid

    try:
        if cfg.distributed:
            from .launch.local import LaunchError, launch

            try:
                prepare_run_dir(run_dir, args.resume, cfg)
                rc = launch(cfg, run_dir, resume=args.resume, progress=not args.quiet)
            except (PlanError, LaunchError) as e:
                print(f"scaletrain: error: {e}", file=sys.stderr)
                return 2
            if rc:
                return rc
            summary = json.loads((run_dir / "summary.json").read_text())
        else:
            summary = train(cfg, run_dir, resume=args.resume, progress=not args.quiet)
    except (RunError, *USER_ERRORS) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"scaletrain: interrupted; the newest checkpoint in {run_dir / 'checkpoints'} is complete",
              file=sys.stderr)
        return 130
    acc = summary.get("test_accuracy")
    print(f"run dir: {run_dir}")
    print(f"steps {summary['steps']}  {summary['images_per_sec']:.1f} img/s  "
          f"final train loss {summary['final_train_loss']:.4f}  "
          + (f"test accuracy {acc:.4f}" if acc is not None else "no test set"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
