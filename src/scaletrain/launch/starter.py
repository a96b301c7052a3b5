"""The process starter: `python -m scaletrain.launch.starter RUN_DIR TO BACK`, started by the
local launcher (fork.Starter); launch/fork.py's docstring says why and how.

It imports, once, what every job process needs before it forks them: entry.py (torch and the
whole training code, at this module's top: that import is what the starter is for) and WARM,
the libraries job processes would import later on their own. Then it reads one JSON spec a
line from the pipe TO, forks a process for each and reports its pid on BACK; after `go`, it
reaps them and reports `pid status` for each.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import sys
import traceback
import warnings

from .entry import main
from .join import exit_now
from ..proc.parent import die_with_parent
from ..twin.netns import enter

# What job processes import later on their own: torch._dynamo (torch.optim imports it at an optimizer's
# first parameter group), the libraries the data sources read with (sklearn for the digits).
WARM = ("torch._dynamo", "sklearn.datasets", "PIL.Image", "simplejpeg")


def _child(spec: dict, starter: int) -> None:
    """In a forked process: become the job process the spec describes; never returns."""
    die_with_parent(starter)
    if spec.get("netns"):  # the cluster twin: this process's node's network (twin/netns.py)
        enter(spec["netns"])
    if spec["log"]:
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(spec["env"])
    try:
        rc = run_script(spec["script"]) if spec.get("script") else main(spec["argv"])
    except SystemExit as e:  # as the interpreter ends: None is 0, a message goes to stderr with status 1
        rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr, flush=True)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback to the log, status 1
        traceback.print_exc()
        rc = 1
    exit_now(rc)


def run_script(script: list[str]) -> int:
    """Run a user's script as `python SCRIPT ARGS...` would: as __main__, its folder first on sys.path."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as entry.main's
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    runpy.run_path(script[0], run_name="__main__")
    return 0


def serve(to: int, back: int) -> None:
    """The starter: import, fork a process per spec read from `to`, report pids then statuses to `back`."""
    for name in WARM:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - missing or broken: a job that needs it fails in its own process, saying so
            pass

    # Python 3.12 warns of any fork in a process with threads; the starter's are the BLAS pools,
    # which stop across a fork (the module doc).
    warnings.filterwarnings("ignore", message=".*fork", category=DeprecationWarning)
    me, started = os.getpid(), 0
    with os.fdopen(to, "r") as lines:
        for line in lines:
            if line.strip() == "go":
                break
            spec = json.loads(line)
            pid = os.fork()
            if pid == 0:
                lines.close()
                os.close(back)
                _child(spec, me)
            started += 1
            os.write(back, f"{pid}\n".encode())
    for _ in range(started):
        pid, status = os.wait()
        os.write(back, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    serve(int(sys.argv[2]), int(sys.argv[3]))
