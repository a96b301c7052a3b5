"""`python -m scaletrain` (what a Slurm job's script runs) and the `scaletrain` command."""

import sys

from .launch import early


def main() -> int:
    early.hold()  # before the command line's imports, which take seconds (torch): a stop then is a stop
    from .cli import main as command  # heavy, and after the hold

    return command()


if __name__ == "__main__":
    sys.exit(main())
