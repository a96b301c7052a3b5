"""The job clock (throughput with uncertainty), run facts, progress (the rows' loggers: loggers.py)."""

from __future__ import annotations

import logging
import math
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("scaletrain")


def run_info(device: torch.device) -> dict[str, Any]:
    """What every result row records about where it was measured."""
    return {
        "git_commit": git_commit(),
        "host": socket.gethostname(),
        "device": device_name(device),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so the clock measures it (a host-device sync)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned(device: torch.device) -> bool:
    """Whether host copies of `device`'s tensors go through page-locked memory, queued (non_blocking)
    and waited for once: from a GPU, which then copies without a staging copy through pageable memory
    and without holding the host per tensor. Page-locked memory cannot be swapped out, so not for
    host tensors, which need no such copy."""
    return device.type == "cuda"


def peak_memory(device: torch.device) -> int:
    """Bytes at this process's peak: tensors the caching allocator held on a GPU, else the process's
    resident set (the host's figure: libraries and loaders included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts it in KiB


class DeviceTimer:
    """Seconds of a replica's work of one kind (compute, communication), summed over steps, with no
    host-device sync per step.

    On a GPU, a pair of CUDA events on the current stream around each piece of work: what the
    interval holds is the device's time from the work's start to its end, queued kernels and
    collectives included (an NCCL call returns once it is queued; its wait shows on the stream,
    not on the host's clock), and a host wait inside it (gloo, a flag) where the device idles
    through it. Pairs whose end has passed are folded in as new ones start (a query, no sync), so
    the list stays short between log points; `seconds` reads the rest (a sync, at log points,
    which sync anyway). On a CPU the host clock: the work is done when its call returns."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.total, self.t0 = device.type == "cuda", 0.0, 0.0
        self.pending: deque = deque()  # (start, end) events not yet read, oldest first

    def start(self) -> None:
        if self.cuda:
            self._fold(done_only=True)
            self.pending.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.pending[-1][0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.pending[-1][1].record()
        else:
            self.total += time.perf_counter() - self.t0

    @contextmanager
    def timing(self):
        """Count the work started inside the block (on a GPU, queued inside it)."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def seconds(self) -> float:
        self._fold(done_only=False)
        return self.total

    def _fold(self, done_only: bool) -> None:
        """Add the intervals read so far: those whose end event has passed (a query), or all of them
        (waiting for the last: a host-device sync, up to the last piece of work queued)."""
        while self.pending:
            a, b = self.pending[0]
            if done_only and not b.query():
                return
            b.synchronize()  # host-device sync from seconds() (log points); at once after a query said done
            self.total += a.elapsed_time(b) / 1e3
            self.pending.popleft()


class JobClock:
    """The job's training time and throughput, on one clock: the chief's.

    Progress is the images the job has applied (what the strategy's ticks
    report), so every strategy is measured in the same unit, and a figure is of
    the whole job rather than a sum of per-process rates. Evaluation is left
    out of the time (pause/resume). The rate is measured from the first tick
    past `warmup_images` to the last, over windows closed at log points: the
    overall rate is their images over their seconds, its standard error comes
    from the spread of the windows' rates, and the median absolute deviation
    of those rates is the jitter.

    A window closed with timed=False is left out: under shards that apply each
    push as it comes (async), the job reaches its target at another pusher's
    push and the chief learns it only at its own next exchange, so the window
    that ends the job also holds the drain after it, up to one step of the
    chief's, in which nothing is applied. It counts only when no other window
    was timed (a job of one window: its rate is then a lower bound).
    """

    def __init__(self, images: int, warmup_images: int) -> None:
        self.t0, self.paused, self.pause_t = time.perf_counter(), 0.0, None
        self.start_images, self.skip_until = images, images + warmup_images
        self.mark = (0.0, images) if warmup_images == 0 else None  # start of the open window
        self.windows: list[tuple[int, float, float]] = []  # (images, seconds, data-wait seconds)
        self.untimed: tuple[int, float, float] | None = None  # the last window closed with timed=False
        self.wait = 0.0  # data-wait seconds in the open window
        self.images, self.t = images, 0.0

    def now(self) -> float:
        """Training seconds so far: since the start, evaluations left out."""
        return time.perf_counter() - self.t0 - self.paused

    def wall(self) -> float:
        """Seconds since the start, evaluations included."""
        return time.perf_counter() - self.t0

    def pause(self) -> None:
        self.pause_t = time.perf_counter()

    def resume(self) -> None:
        self.paused += time.perf_counter() - self.pause_t

    def tick(self, images: int, close: bool, timed: bool = True) -> tuple[int, float, float] | None:
        """The job has applied `images` by now; close a window when asked (a log point), left out of
        the rate when not `timed` (see the class doc). Returns the closed window (images, seconds,
        data-wait seconds), if one was closed and timed."""
        self.images, self.t = images, self.now()
        if self.mark is None:
            if images >= self.skip_until:
                self.mark, self.wait = (self.t, images), 0.0
            return None
        if not close or self.t <= self.mark[0] or images <= self.mark[1]:
            return None
        window = (images - self.mark[1], self.t - self.mark[0], self.wait)
        self.mark, self.wait = (self.t, images), 0.0
        if not timed:
            self.untimed = window
            return None
        self.windows.append(window)
        return window

    def summary(self) -> dict[str, float | None]:
        """images_per_sec with its standard error, jitter and window count; the slowest window's
        rate over the median window's (a stall shows there); train_seconds (to the last tick);
        images_applied, the job's progress: what the checkpoint this part resumed from had applied
        and this part's, as steps and epochs count; part_images_applied, this part's alone (warm-up
        included). The times and rates are this part's, measured on its clock: a resumed part's
        images_per_sec x train_seconds is part_images_applied. With no timed window the rate figures
        are None (JSON null): nothing was measured, which a 0.0 would pass off as a measurement."""
        out = {"train_seconds": self.t, "images_applied": self.images,
               "part_images_applied": self.images - self.start_images}
        windows = self.windows or ([self.untimed] if self.untimed else [])
        rates = [n / s for n, s, _ in windows]
        if not rates:
            return {**out, "images_per_sec": None, "images_per_sec_stderr": None, "images_per_sec_mad": None,
                    "slowest_window_fraction": None, "timed_windows": 0, "data_wait_fraction": None}
        med = statistics.median(rates)
        seconds = sum(s for _, s, _ in windows)
        return {**out,
                "images_per_sec": sum(n for n, _, _ in windows) / seconds,
                "images_per_sec_stderr": statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else 0.0,
                "images_per_sec_mad": statistics.median(abs(r - med) for r in rates),
                "slowest_window_fraction": min(rates) / med,
                "timed_windows": len(rates),
                "data_wait_fraction": sum(w for _, _, w in windows) / seconds}


LAUNCHED = "SCALETRAIN_LAUNCHED"  # environment: when the launcher started the job (time.time())


def start_up(what: str, launched: float | None = None) -> str:
    """A line of a distributed job's start-up progress (the launcher's and the chief's, a few a job),
    with the seconds since the launch where the launcher said when (`launched`, or LAUNCHED)."""
    at = launched or os.environ.get(LAUNCHED)
    return f"start-up: {what}" + (f" ({time.time() - float(at):.1f} s)" if at else "")


class Progress:
    """A rich progress bar on a terminal; plain log lines elsewhere (CI, Slurm)."""

    def __init__(self, total: int, start: int, enabled: bool = True, every: int = 10, label: str = "train",
                 unit: str = "step") -> None:
        self.total, self.every, self.bar = total, every, None
        self.tty = enabled and sys.stdout.isatty()
        if self.tty:
            from rich import progress as rp  # only a terminal shows a bar; elsewhere plain lines (CI, Slurm)
            self.bar = rp.Progress(rp.TextColumn(label), rp.BarColumn(), rp.MofNCompleteColumn(),
                                   rp.TextColumn("{task.fields[info]}"), rp.TimeRemainingColumn())
            self.task = self.bar.add_task(label, total=total, completed=start, info="")
            self.bar.start()
        self.enabled, self.unit = enabled, unit
        self.t0, self.s0 = time.perf_counter(), start

    def update(self, step: int, loss: float, ips: float) -> None:
        self.show(step, f"loss {loss:.4f}  {ips:,.1f} img/s")

    def show(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.enabled and (step % self.every == 0 or step == self.total):
            done = step - self.s0
            eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done else 0.0
            print(f"{self.unit} {step}/{self.total}  {info}  eta {eta:.0f}s", flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
