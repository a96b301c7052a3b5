"""Step timing, throughput with uncertainty, JSONL rows, TensorBoard, progress."""

from __future__ import annotations

import json
import logging
import math
import platform
import socket
import statistics
import subprocess
import sys
import time
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


def rate_stats(images: list[int], seconds: list[float]) -> dict[str, float]:
    """Images/s over timed steps: overall rate, standard error of the per-step
    rate's mean, and median absolute deviation of per-step rates (jitter)."""
    rates = [n / s for n, s in zip(images, seconds) if s > 0]
    if not rates:
        return {"images_per_sec": 0.0, "images_per_sec_stderr": 0.0, "images_per_sec_mad": 0.0, "timed_windows": 0}
    med = statistics.median(rates)
    stderr = statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else 0.0
    return {
        "images_per_sec": sum(images) / sum(seconds),
        "images_per_sec_stderr": stderr,
        "images_per_sec_mad": statistics.median(abs(r - med) for r in rates),
        "timed_windows": len(rates),
    }


class Recorder:
    """metrics.jsonl rows and TensorBoard scalars of one process."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, extra: dict[str, Any] | None = None) -> None:
        self.extra = extra or {}
        self.fh = open(run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: a crash keeps rows
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def row(self, kind: str, step: int, **values: Any) -> None:
        self.fh.write(json.dumps({"kind": kind, "step": step, "time": time.time(), **self.extra, **values}) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("epoch", "wall"):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rich progress bar on a terminal; plain log lines elsewhere (CI, Slurm)."""

    def __init__(self, total: int, start: int, enabled: bool = True, every: int = 10) -> None:
        self.total, self.every, self.bar = total, every, None
        self.tty = enabled and sys.stdout.isatty()
        if self.tty:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                       TimeRemainingColumn)

            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()
        self.enabled = enabled
        self.t0, self.s0 = time.perf_counter(), start

    def update(self, step: int, loss: float, ips: float) -> None:
        info = f"loss {loss:.4f}  {ips:,.1f} img/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.enabled and (step % self.every == 0 or step == self.total):
            done = step - self.s0
            eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done else 0.0
            print(f"step {step}/{self.total}  {info}  eta {eta:.0f}s", flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
