"""The errors a user can act on. str() of each is one line for the user, never a traceback.

They live here, apart from the modules that raise them, so that any entry
point (cli, bench, calibrate, a launched process) can catch them without
importing another entry point or anything heavy: this module imports nothing.
The raising modules re-export their own, so `from .config import ConfigError`
keeps working.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe or override that cannot be used; str() is one line for the user."""


class ModelNameError(ConfigError):
    """A model.name (an import path) whose network cannot be built, or does not fit the data: a
    module that does not import, no such factory, a factory that raises or returns no nn.Module, an
    output of another shape. str() is one line naming model.name."""


class PlanError(ValueError):
    """A cluster shape that cannot be placed; str() is one line for the user."""


class LaunchError(RuntimeError):
    """A job that cannot start as launched; str() says why in one line."""


class DataError(ValueError):
    """Input data that cannot be used; str() names the file (and line)."""


class PretrainedError(ValueError):
    """Weights that cannot be loaded into the model; str() names the tensor."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed from; str() names it."""


class RunError(RuntimeError):
    """A run that cannot start or continue (a run directory in use, too little data, a failed job)."""


class GridError(ValueError):
    """A --grid (or --steps/--warmup/--repeats) that cannot be swept; str() shows the form to write."""


class UntilError(ValueError):
    """A --until that is not epochs=E, loss=L or accuracy=A."""


class ProfileError(ValueError):
    """A hardware profile that cannot be used; str() is one line naming the file and key."""


class ModelError(ValueError):
    """A configuration the performance model cannot predict with this profile; str() is one line."""


EXIT_STOPPED = 75  # a job stopped on request after its checkpoint (EX_TEMPFAIL: run the same command again)
EXIT_PEER = 3  # a job process that left because a peer failed or went silent (comm/liveness.py)


class Stopped(Exception):
    """The job stopped on request (a stop signal) after checkpointing at a sync point; str() says
    where it stands in one line. `status` is the exit status that says so: 130 for Ctrl-C, else 75
    (EX_TEMPFAIL: run the same command again to continue)."""

    def __init__(self, message: str, status: int = 75) -> None:
        super().__init__(message)
        self.status = status


class Finished(Exception):
    """The run directory holds a run that is over for this config (its final checkpoint reached the
    job's target and its summary.json was written): nothing was run and no file was touched. Not an
    error; str() says in one line where the results are."""


# Raised while a job runs, from inputs the user controls: printed as one line with exit status 1.
# ModelNameError is among them for a job process (a node where the user's module does not import);
# before the job starts it is a ConfigError, status 2 (the launcher builds the network first).
USER_ERRORS = (RunError, DataError, PretrainedError, CheckpointError, ModelNameError)


# What a job's starter (the command line, a script that starts its job) reports in one line:
# launch/supervise.report.
REPORTED = (PlanError, LaunchError, ConfigError, *USER_ERRORS, Stopped, Finished, KeyboardInterrupt)
