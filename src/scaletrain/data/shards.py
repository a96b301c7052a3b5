"""Shards: a data set packed into large tar files for a shared parallel file system
(`scaletrain pack`), and read back with each replica streaming its own stretch of an epoch.

A parallel file system serves large sequential reads well and per-file metadata (an open
and a stat for each of 1.2 million small files, every epoch, from every node) badly. A
pack is WebDataset's layout, so webdataset, DALI's reader or tar itself open it:
  DIR/train-000000.tar ...  members KEY.jpg (the file's bytes, as they were) and KEY.cls
                            (the label index as text); KEY is the sample's number
  DIR/test-000000.tar ...   the held-out split (data.test_root or data.test_fraction)
  DIR/index.json            classes, per split the samples, images per class and shards,
                            and the files skipped as unreadable
  DIR/offsets.npz           per split: each sample's shard, byte offset and size, and label
  DIR/sources-SPLIT.txt     the file each sample came from, a line per sample
Samples go into the shards in a seeded random order: a shard per class would leave a
shuffle window holding one class. Every image is decoded at pack time (at 1/8 scale for
JPEGs), so unreadable files are found and named then (data.on_bad_image).

Reading (`epoch_order`): epoch e shuffles the order of the shards with (seed, e), lays
their samples end to end, and gives replica r the r-th of W equal stretches (the last
n mod W samples sit the epoch out); the replica reads its stretch front to back and
shuffles within a window of data.shuffle_buffer samples, drawn with (seed, e, r). So
the replicas of an epoch read disjoint samples, mostly whole shards each; the order is a
function of (seed, epoch) alone, and a resumed run continues exactly. Reads are
positional (pread) at the offsets of the index: no tar parsing, no per-sample open.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataError
from ..metrics import Progress
from . import decode
from .sources import IMAGENET, file_lists

FORMAT = "scaletrain-shards 1"
PACK_SEED = 0  # the order samples are packed in; reading shuffles again each epoch
# The names a pack writes (an unfinished one leaves some of them, and a new pack may write over those).
_PACK_NAMES = re.compile(r"(train|test)-\d{6}\.tar(\.part)?|index\.json|offsets\.npz|sources-(train|test)\.txt")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'1GB', '512MiB', '100000' -> bytes; ValueError naming the form expected."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size; write e.g. 1GB, 512MB or 256MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def check(path: str) -> tuple[bytes, str | None]:
    """A file's bytes, and why it cannot be used as an image (None when it decodes)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        decode.decode(data, (1, 1))  # JPEGs at 1/8 scale: enough to find a corrupt stream, for a fraction of the work
        return data, None
    except Exception as e:  # noqa: BLE001 - anything a decoder raises makes the file unusable
        return b"", f"{type(e).__name__}: {e}"


class _Writer:
    """Tar shards of at most `limit` bytes (a lone larger sample gets its own), with each image's offset."""

    def __init__(self, out: Path, split: str, limit: int) -> None:
        self.out, self.split, self.limit = out, split, limit
        self.tar, self.shards, self.rows = None, [], []

    def add(self, key: str, ext: str, data: bytes, label: int) -> None:
        if self.tar is None or self.tar.offset + len(data) > self.limit and self.shards[-1]["samples"]:
            self._next()
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mode = len(data), 0o644
        # the image starts after its header (and any extended header the name needs)
        start = self.tar.offset + len(info.tobuf(self.tar.format, self.tar.encoding, self.tar.errors))
        self.tar.addfile(info, io.BytesIO(data))
        cls = str(label).encode()
        meta = tarfile.TarInfo(f"{key}.cls")
        meta.size, meta.mode = len(cls), 0o644
        self.tar.addfile(meta, io.BytesIO(cls))
        self.rows.append((len(self.shards) - 1, start, len(data), label))
        self.shards[-1]["samples"] += 1

    def _next(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self.shards.append({"name": name, "samples": 0, "bytes": 0})
        self.tar = tarfile.open(self.out / (name + ".part"), "w", format=tarfile.USTAR_FORMAT)

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            part = self.out / (self.shards[-1]["name"] + ".part")
            self.shards[-1]["bytes"] = part.stat().st_size
            part.rename(self.out / self.shards[-1]["name"])
            self.tar = None


def pack(cfg, out: str | Path, shard_bytes: int, workers: int = 0, progress: bool = True) -> dict:
    """Write the recipe's image folder or manifest into shards under `out`; returns the index."""
    if cfg.data.name not in ("imagefolder", "manifest"):
        raise DataError(f"data.name = {cfg.data.name!r}: scaletrain pack reads an image folder or a manifest "
                        "(data.name = 'imagefolder' or 'manifest', with data.root)")
    out = Path(out)
    check_out(out)
    train, test, classes = file_lists(cfg)
    out.mkdir(parents=True, exist_ok=True)
    index = {"format": FORMAT, "classes": classes, "source": cfg.data.root, "skipped": [], "splits": {}}
    arrays, total = {}, len(train[0]) + len(test[0])
    bar = Progress(total, 0, enabled=progress, every=max(1, total // 20), label="pack", unit="packed image")
    done, nbytes, t0 = 0, 0, time.perf_counter()
    with Pool(workers or os.cpu_count()) as pool:
        for split, (paths, labels) in (("train", train), ("test", test)):
            order = np.random.RandomState(PACK_SEED).permutation(len(paths))
            writer, sources = _Writer(out, split, shard_bytes), []
            for j, (data, why) in zip(order, pool.imap(check, [paths[j] for j in order], chunksize=8)):
                done += 1
                if why is not None:
                    if cfg.data.on_bad_image == "error":
                        raise DataError(f"{paths[j]}: cannot read image ({why}); set data.on_bad_image = "
                                        "'skip' to leave such files out of the pack")
                    print(f"scaletrain: warning: skipping unreadable image {paths[j]} ({why})", file=sys.stderr)
                    index["skipped"].append({"path": paths[j], "reason": why})
                else:
                    ext = Path(paths[j]).suffix.lower().lstrip(".") or "img"
                    writer.add(f"{len(sources):09d}", ext, data, labels[j])
                    sources.append(paths[j])
                    nbytes += len(data)
                bar.show(done, f"{nbytes / 1e6:,.0f} MB  {done / (time.perf_counter() - t0):,.0f} img/s")
            writer.close()
            rows = np.array(writer.rows, dtype=np.int64).reshape(-1, 4)
            arrays[split] = rows
            counts = np.bincount(rows[:, 3], minlength=len(classes)).tolist()
            index["splits"][split] = {"samples": len(rows), "counts": dict(zip(classes, counts)),
                                      "shards": writer.shards}
            (out / f"sources-{split}.txt").write_text("".join(p + "\n" for p in sources))
    bar.close()
    np.savez(out / "offsets.npz", **arrays)
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")  # last: its presence marks a finished pack
    return index


def check_out(out: Path) -> None:
    """Refuse an --out that is not a new or empty directory, before anything is written: a file,
    a directory with shards in it, or one holding files a pack does not write (a user's, which
    the shards would be mixed with). What an unfinished pack left may be written over. Each is a
    ConfigError: an --out to change, bad input (exit status 2), not data that failed."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if (out / "index.json").exists() or any(out.glob("*.tar")):
        raise ConfigError(f"--out {out}: already holds shards; choose an empty directory")
    other = sorted(p.name for p in out.iterdir() if not _PACK_NAMES.fullmatch(p.name)) if out.exists() else []
    if other:
        n = "1 file that is" if len(other) == 1 else f"{len(other)} files that are"
        raise ConfigError(f"--out {out} holds {n} not shards of a pack (e.g. {other[0]}): give a new or empty directory")


def buffer_shuffle(seq: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """`seq` as a stream read in order through a shuffle window of `size`: each output is drawn
    from the window, whose slot the next input fills. No output comes from more than `size`
    inputs ahead of the reading front."""
    size = max(1, min(size, len(seq)))
    window, out = list(seq[:size]), []
    for v, j in zip(seq[size:].tolist(), rng.integers(0, size, len(seq) - size).tolist()):
        out.append(window[j])
        window[j] = v
    return np.concatenate([np.array(out, dtype=np.int64), rng.permutation(np.array(window, dtype=np.int64))])


class ShardDataset(torch.utils.data.Dataset):
    """One split of a pack: index -> (the image's bytes, label), read at its offset."""

    stats = IMAGENET

    def __init__(self, root: Path, split: str, info: dict, rows: np.ndarray, buffer: int) -> None:
        self.root, self.split, self.rows, self.buffer = root, split, rows, buffer
        self.files = [str(root / s["name"]) for s in info["shards"]]
        self.first = np.concatenate([[0], np.cumsum([s["samples"] for s in info["shards"]])]).astype(np.int64)
        self.labels = rows[:, 3]
        self._fds, self._pid, self._sources = {}, None, None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        shard, offset, size, label = self.rows[i].tolist()
        if self._pid != os.getpid():  # descriptors are per process: loader processes open their own
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise OSError(f"{self.files[shard]} ends before byte {offset + size} (truncated shard)")
        return data, label

    def name(self, i: int) -> str:
        if self._sources is None:
            self._sources = (self.root / f"sources-{self.split}.txt").read_text().splitlines()
        return f"{self.files[self.rows[i, 0]]} sample {i:09d} ({self._sources[i]})"

    def epoch_order(self, seed: int, epoch: int, world: int, rank: int) -> torch.Tensor:
        """Replica `rank`'s samples of the epoch, in the order it reads them."""
        rng = np.random.default_rng([seed, epoch])
        seq = np.concatenate([np.arange(self.first[s], self.first[s + 1]) for s in rng.permutation(len(self.files))])
        m = len(seq) // world
        mine = seq[rank * m:(rank + 1) * m]
        return torch.from_numpy(buffer_shuffle(mine, self.buffer, np.random.default_rng([seed, epoch, rank, 1])))


def open_shards(root: str, num_classes: int, buffer: int) -> tuple[ShardDataset, ShardDataset, list[str]]:
    """(train, test, class names) of a pack; DataError naming what is missing or does not fit."""
    r = Path(root)
    if not (r / "index.json").is_file():
        raise DataError(f"data.root: {root} has no index.json; write shards with scaletrain pack "
                        "(an interrupted pack leaves none)")
    index = json.loads((r / "index.json").read_text())
    if index.get("format") != FORMAT:
        raise DataError(f"{r / 'index.json'}: format {index.get('format')!r}, expected {FORMAT!r}")
    classes = index["classes"]
    if len(classes) > num_classes:
        raise DataError(f"{r / 'index.json'}: {len(classes)} classes, more than model.num_classes = {num_classes}")
    missing = [s["name"] for sp in index["splits"].values() for s in sp["shards"] if not (r / s["name"]).is_file()]
    if missing:
        raise DataError(f"data.root: shard {r / missing[0]} is missing ({len(missing)} of the index's shards are)")
    with np.load(r / "offsets.npz") as rows:
        sets = [ShardDataset(r, split, index["splits"][split], rows[split], buffer) for split in ("train", "test")]
    if not len(sets[0]):
        raise DataError(f"data.root: {root} holds no training images")
    return sets[0], sets[1], classes
