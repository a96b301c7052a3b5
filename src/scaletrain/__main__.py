"""`python -m scaletrain` (what a Slurm job's script runs) and the `scaletrain` command, which both
import this module first: it holds the stop signals through the command line's imports, which take
seconds (torch), so that a stop signal then is a stop (proc/early.py)."""

import sys

from .proc import early

early.hold()

from .cli import main  # noqa: E402 - after the hold

if __name__ == "__main__":
    sys.exit(main())
