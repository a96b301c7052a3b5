"""Checkpoints you can trust and afford: atomic, written in the background; safe load.

A checkpoint is serialised in memory (so a failed write knows the bytes it
needed), written to `ckpt-STEP.pt.tmp`, flushed to disk, then renamed to
`ckpt-STEP.pt`; rename is atomic on POSIX file systems, so a crash leaves
either the old set of complete checkpoints or the new one, never a partial
file under a loadable name. The training loop only pays for a copy of the
state (`Writer`); a thread does the rest. A write that fails (a full disk)
removes its partial file and training goes on; the run's last one must be
written. Partial files of killed writes are removed at the next save or
resume. Loading uses weights_only=True only, and a refused file is named with
its reason in one line; a resume that passes over it renames it NAME.damaged,
which rotation never deletes. What a resumed run continues from is resume.py's.

A disk the checkpoints fill is full for the rest of the job too: the processes' last lines, the
notes through which the launcher learns who failed first and its failure record. The writer keeps
a small reserve file (RESERVE) beside the checkpoints while the run lasts and deletes it when a
write finds the disk full, so that a chief failing for a full disk is still named as such, not
taken for a frozen process by peers and a launcher that could not write what they saw.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import re
import shutil
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save as to_bytes

from .config import Config
from .errors import CheckpointError
from .metrics import pinned, sync

log = logging.getLogger("scaletrain")
PATTERN = re.compile(r"^ckpt-(\d{8,})\.pt$")
RESERVE = ".space-reserve"  # in the checkpoint directory while a run writes there (Writer)
RESERVE_BYTES = 256 * 1024  # a page or two a process for its last lines and notes, for jobs of dozens
FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it
DAMAGED = ".damaged"  # suffix of a checkpoint that does not load, set aside: out of PATTERN, no rotation deletes it


def path_for(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt-{step:08d}.pt"


def list_complete(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (temporary files are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := PATTERN.match(p.name))]
    return sorted(found)


def remove_stale(ckpt_dir: Path) -> None:
    """Remove the partial files of writes that were killed; they are never loaded."""
    if ckpt_dir.is_dir():
        for p in ckpt_dir.glob("ckpt-*.pt.tmp"):
            p.unlink(missing_ok=True)
            log.info("removed %s, left by a checkpoint write that was interrupted", p)


def write_file(path: Path, data: bytes | memoryview, what: str) -> None:
    """Write data to path atomically (tmp, fsync, rename). On any error the partial file is
    removed and CheckpointError names the path and the bytes it needed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        # a partial file would keep the disk full for the writes that follow
        tmp.unlink(missing_ok=True)
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        err = CheckpointError(f"{path}: cannot write {what} ({e.strerror or e}): it needs {len(data):,} bytes, "
                              f"{free}; the partial file was removed")
        err.errno = e.errno  # a full disk (FULL) frees the writer's reserve
        raise err from None


def write_weights(path: Path, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Weights as a safetensors file beside model.safetensors (model-ema.safetensors: the average of the
    weights, train.ema_decay), written atomically as write_file does; names as in the model's state_dict."""
    write_file(path, to_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()}), what)


def save(ckpt_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ckpt-STEP.pt and keep the newest `keep`. A complete file of that step is left as it
    is (a run resumed where it had ended). CheckpointError (one line) when it cannot be written."""
    final = path_for(ckpt_dir, step)
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{ckpt_dir}: cannot create the checkpoint directory ({e.strerror})") from None
    if final.exists():
        try:
            read(final)
            log.info("%s is complete already; not written again", final)
            return final
        except CheckpointError as e:  # damaged: kept for a look, and a new one written in its place
            log.warning("%s; %s", e, set_aside(final))
    # Serialised in memory first, so a failed write can say how many bytes it needed.
    buf = io.BytesIO()
    torch.save(state, buf)
    write_file(final, buf.getbuffer(), "the checkpoint")
    for _, old in list_complete(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def snapshot(obj: Any) -> Any:
    """A copy of a state on the CPU that later training steps cannot change (they update the
    model's and the optimizer's tensors in place). From a GPU every tensor is copied into
    page-locked memory, queued, and the device is waited for once: one wait instead of one per
    tensor (metrics.pinned). Freed page-locked blocks stay cached by torch for the next checkpoint:
    host memory of the state's size, kept for the run."""
    devices: set[torch.device] = set()
    out = _copied(obj, devices)
    for d in devices:
        sync(d)  # host-device sync, once a checkpoint: the copies are whole before the writer thread reads them
    return out


def _copied(obj: Any, devices: set) -> Any:
    if isinstance(obj, torch.Tensor):
        return to_host(obj, devices)
    if isinstance(obj, dict):
        return {k: _copied(v, devices) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_copied(v, devices) for v in obj)
    return obj


def to_host(t: torch.Tensor, devices: set) -> torch.Tensor:
    """A host copy of `t`; from a device whose copies are queued (metrics.pinned), adds it to
    `devices`, which the caller syncs before reading the copy."""
    if not pinned(t.device):
        return t.detach().to("cpu", copy=True)
    devices.add(t.device)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)


class Writer:
    """Writes checkpoints in a background thread, so that training does not wait for the file
    system. The state is copied when submitted (a consistent snapshot of the sync point); at
    most one write is in flight, a new one waits for the previous. A write that fails is a
    warning and training goes on; `finish` says whether the last one was written."""

    def __init__(self, ckpt_dir: Path, keep: int) -> None:
        self.dir, self.keep = ckpt_dir, keep
        self.failed: str | None = None  # the newest write's error
        self._thread: threading.Thread | None = None
        self._first = True
        self.ended = False  # the run's last checkpoint was submitted: the reserve is kept for the weights' write

    def submit(self, step: int, state: dict[str, Any], final: bool = False) -> None:
        """Snapshot `state` now and write it in the background. final: the run's last
        checkpoint, whose failure `finish` reports (and no warning here)."""
        self.join()
        self.ended = final
        snap = snapshot(state)  # the cost the training loop pays: a copy, not a write
        self._thread = threading.Thread(target=self._write, args=(step, snap, final), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _write(self, step: int, state: dict[str, Any], final: bool) -> None:
        try:
            if self._first:
                remove_stale(self.dir)
                self._first = False
                self._reserve()
            save(self.dir, step, state, self.keep)
            self.failed = None
        except Exception as e:  # noqa: BLE001 - reported on the main thread, never lost with the thread
            if final and getattr(e, "errno", None) in FULL:
                self.release()  # the job ends on it: room for every process's last words (training goes on else)
            self.failed = str(e) if isinstance(e, CheckpointError) else \
                f"{path_for(self.dir, step)}: cannot write the checkpoint ({type(e).__name__}: {e})"
            if not final:
                log.warning("%s; training goes on", self.failed)

    def join(self) -> None:
        """Wait for the write in flight, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _reserve(self) -> None:
        """Take RESERVE_BYTES of the disk while there is room (a disk already too full for it has none to
        keep: the run goes on without one). Written, not a sparse file, so the blocks are taken."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / RESERVE).write_bytes(bytes(RESERVE_BYTES))
        except OSError:
            self.release()

    def release(self) -> None:
        """Give the reserve back to the disk."""
        try:
            (self.dir / RESERVE).unlink(missing_ok=True)
        except OSError:
            pass

    def finish(self) -> None:
        """Wait for the write in flight; CheckpointError when the newest checkpoint was not written."""
        self.join()
        if self.failed:
            raise CheckpointError(f"the run's last checkpoint was not written: {self.failed}")


def set_aside(path: Path) -> str:
    """Rename a checkpoint that does not load to NAME.damaged; a few words saying where it went.
    Rotation deletes the oldest complete checkpoints by name: under its own name a damaged one
    counted among the kept, so a good older one went first, and it was deleted in its turn, when the
    user may want to see what damaged it. A rename that fails leaves it where it is, and says so."""
    aside = path.with_name(path.name + DAMAGED)
    try:
        os.replace(path, aside)
    except OSError as e:
        return f"{path.name} could not be set aside ({e.strerror or e})"
    return f"kept as {aside.name}"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unreadable_reason(path: Path, e: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, in a few words (torch's own text is
    pages long and may advise loading with weights_only=False)."""
    if isinstance(e, OSError):
        return f"cannot be read ({e.strerror or e})"
    if isinstance(e, pickle.UnpicklingError) and not zipfile.is_zipfile(path):  # pickle.dump, torch's old format
        return ("a raw pickle, or one holding Python objects other than tensors; refused, since loading it "
                "could run code")
    if not zipfile.is_zipfile(path):
        return "truncated, or not written by torch.save (no complete zip archive)"
    if isinstance(e, pickle.UnpicklingError):
        return "holds Python objects other than tensors; refused, since loading them could run code"
    return "corrupt (torch cannot read the data in its archive)"


def read(path: Path, mmap: bool = False) -> Any:
    """torch.load with weights_only=True; CheckpointError naming the file and why it was refused.
    mmap: the tensors are mapped, not read (for a look at a checkpoint's step)."""
    try:
        with warnings.catch_warnings():
            # torch warns of a pickle protocol it did not write before refusing a raw pickle: the
            # line below says why the file is refused; its warning would come first, in torch's words.
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any refusal is one line naming the file
        raise CheckpointError(f"{path}: {unreadable_reason(path, e)}") from None


def _read_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    state = read(path, mmap)
    if not isinstance(state, dict) or not {"step", "config", "model"} <= state.keys():
        raise CheckpointError(f"{path}: not a scaletrain checkpoint (no step, config or model)")
    return state


def newest(ckpt_dir: Path) -> tuple[dict[str, Any], Path, list[tuple[int, str]]] | None:
    """The newest checkpoint that loads, its path, and the (step, reason) of each newer one that
    does not; None when there is none. Partial files of interrupted writes are removed first."""
    remove_stale(ckpt_dir)
    bad: list[tuple[int, str]] = []
    for step, p in reversed(list_complete(ckpt_dir)):
        try:
            return _read_checkpoint(p), p, bad
        except CheckpointError as e:
            bad.append((step, str(e)))
    if bad:
        raise CheckpointError(f"no checkpoint in {ckpt_dir} could be read: " + "; ".join(r for _, r in bad))
    return None


def position(ckpt_dir: Path) -> tuple[int, int] | None:
    """The step and images applied of the newest checkpoint that loads (what a resume starts from),
    read without loading its tensors; None when there is none."""
    for _, p in reversed(list_complete(ckpt_dir)):
        try:
            state = _read_checkpoint(p, mmap=True)
        except CheckpointError:
            continue
        return state["step"], images_of(state)
    return None


def images_of(state: dict[str, Any]) -> int:
    """The images the job had applied at a checkpoint; one written before they were kept: its
    step x its config's job step (replicas x data.batch_size)."""
    if "images" in state:
        return state["images"]
    saved = {**Config().flat(), **state["config"]}
    return state["step"] * saved["cluster.nodes"] * saved["cluster.gpus_per_node"] // saved["parallel.stages"] * \
        saved["data.batch_size"]


def load_latest(ckpt_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads; None when there is none. Falling back to an older one
    is a warning naming the newer ones, why they were refused, and the steps lost; each refused
    one is then set aside (set_aside). When none loads, all stay as they are (CheckpointError)."""
    found = newest(ckpt_dir)
    if found is None:
        return None
    state, path, bad = found
    if bad:
        kept = "; ".join(set_aside(path_for(ckpt_dir, step)) for step, _ in bad)
        log.warning("%s; resuming from %s (step %d) instead: %d steps lost; %s", "; ".join(r for _, r in bad),
                    path.name, state["step"], bad[0][0] - state["step"], kept)
    return state, path


def load_agreed(ckpt_dir: Path, distributed: bool) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint, the same file in every process of a job: rank 0 chooses
    it and broadcasts its step (a collective: every process, PS included, calls this
    once when resuming), so a file another node cannot see yet, or a fallback to an
    older one on a single node, cannot split the job."""
    if not distributed:
        return load_latest(ckpt_dir)
    choice, found, err = torch.tensor([-1]), None, None
    if dist.get_rank() == 0:
        try:
            found = load_latest(ckpt_dir)
            choice[0] = -1 if found is None else found[0]["step"]
        except CheckpointError as e:
            err, choice[0] = e, -2
    dist.broadcast(choice, src=0)
    step = int(choice[0])
    if err is not None:
        raise err
    if step == -2:
        raise CheckpointError(f"rank 0 could read no checkpoint in {ckpt_dir}; its log says why")
    if step == -1 or found is not None:
        return found
    path = path_for(ckpt_dir, step)
    try:
        return _read_checkpoint(path), path
    except CheckpointError as e:
        raise CheckpointError(f"chosen by rank 0 but not readable here: {e}") from None
