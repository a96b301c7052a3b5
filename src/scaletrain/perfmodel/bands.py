"""Bands on predicted figures: how far each moves with what it rests on.

A profile's [about] spread table holds, per figure, (max - min) / median over the calibrations
or rounds it came from. It is keyed either by profile fields (`compute_s = 0.12`: a median of
several calibrations, calibrate.median_profile, or a catalogue's held-out error) or by the
measurement a single `calibrate` took ("job1.step_s": rounds.py), which MEASURE_FIELDS maps to
the fields derived from it. A field derived from several measurements takes the largest of
their spreads: the spreads of the rounds are all we keep, and the largest does not claim a
precision the others lack.

Each uncertain field is set, one at a time, to median x (1 - spread/2) and median x
(1 + spread/2), the extremes of the rounds about their median, and the configuration predicted
again. The relative deviations of a figure from the separate fields are combined in quadrature,
downwards and upwards apart (sqrt of the sum of squares), as for independent errors: the
fields come from separate measurements, and adding them outright would assume every one off
the same way at once. A field of value 0 (input not modelled, no fixed compute) moves nothing
and is not predicted again.

Learning runs add their own (statistical.py): the seeds' spread of the updates to the target
and the test set's sampling error on accuracy, each a relative half-width on the updates,
images and hours to the target, combined with the profile's in quadrature.

No spread, no band: a profile set from published figures (profiles/study-k80.toml) gives
point figures, and the row says `band: null` rather than carry a band invented here.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any, Callable

from .profile import Profile

# The figures of predict's rows that carry a band, where the row has them.
BANDED = ("images_per_sec", "speedup", "efficiency", "step_s", "epoch_s", "train_hours",
          "target_updates", "target_images", "target_hours")
TARGET = ("target_updates", "target_images", "target_hours")

# A single calibration's measurements (rounds.py: NAME.FIGURE) and the profile fields
# calibrate.derive makes of them. p2p's and allreduce's figures are named by message size
# (p2p_1: 4 bytes, p2p_N: the big message): measure_field reads the size.
MEASURE_FIELDS = {
    "cpu.optimizer_s": ("optimizer_s", "ps_apply_rate"),
    "cpu.accumulate_s": ("ps_accumulate_rate",),
    "cpu.copy_s": ("host_copy_bandwidth",),
    "job1.step_s": ("compute_s",),
    "job1_other_batch.step_s": ("compute_base_s",),
    "job2.step_s": ("intra_bandwidth",),  # the 2-replica job's load on the all-reduce's bytes
    "ps_job.step_s": ("net_bandwidth", "local_bandwidth"),  # the PS job's load on the transfers
    "input.images_per_s": ("input_rate",),
}
SIZED = {("p2p", "p2p"): ("net_latency", ("net_bandwidth", "local_bandwidth")),
         ("net", "p2p"): ("net_latency", ("net_bandwidth",)),
         ("allreduce", "ar"): ("intra_latency", ("intra_bandwidth",))}


def measure_fields(key: str, ring_measured: bool, net_measured: bool = False) -> tuple[str, ...]:
    """The profile fields derived from the measurement `key` (NAME.FIGURE). The 2-process
    pair also times an all-reduce, which sets the intra-node figures only where no all-reduce
    over more processes was measured (`ring_measured`). Where the pair was also placed across
    the network (`net_measured`: the twin's link, two Slurm nodes; net_where.py), the network's
    figures come from that pair ("net.p2p_N") and the loopback pair keeps only local_bandwidth."""
    if key in MEASURE_FIELDS:
        return MEASURE_FIELDS[key]
    name, _, figure = key.partition(".")
    kind, _, size = figure.partition("_")
    if name == "p2p" and kind == "ar" and not ring_measured:
        name = "allreduce"
    if (name, kind) not in SIZED or not size.isdigit():
        return ()
    small, big = SIZED[(name, kind)]
    if name == "p2p" and net_measured:
        return () if int(size) == 1 else ("local_bandwidth",)
    return (small,) if int(size) == 1 else big


def field_spreads(about: dict) -> dict[str, float]:
    """Profile field -> its spread, from the [about] spread table (field-keyed, or a single
    calibration's measurement-keyed one mapped by measure_fields); only float fields with a
    spread above 0."""
    table = about.get("spread") or {}
    floats = {f.name for f in fields(Profile) if f.type in (float, "float")}
    ring = any(k.startswith("allreduce.") for k in table)
    net = any(k.startswith("net.") for k in table)
    out: dict[str, float] = {}
    for key, spread in table.items():
        if not isinstance(spread, (int, float)) or isinstance(spread, bool) or spread <= 0:
            continue
        for name in (measure_fields(key, ring, net) if "." in key else (key,)):
            if name in floats:
                out[name] = max(out.get(name, 0.0), float(spread))
    return out


# A spread of 2 or more would put the lower extreme at or below 0; a figure of a profile is
# positive, so the lower factor stops here (a spread that large is flagged by calibrate anyway).
LOWEST = 0.05


def perturbed(p: Profile, name: str, factor: float) -> Profile:
    """The profile with field `name` times `factor`. compute_s carries compute_base_s along (the
    measured step moved as a whole, its fixed part with it); compute_base_s stays below compute_s."""
    value = getattr(p, name) * factor
    if name == "compute_s":
        return replace(p, compute_s=value, compute_base_s=p.compute_base_s * factor)
    if name == "compute_base_s":
        value = min(value, 0.999 * p.compute_s)
    return replace(p, **{name: value})


def profile_deviations(row: dict[str, Any], p: Profile, spreads: dict[str, float],
                       row_of: Callable[[Profile], dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Figure -> one (down, up) relative deviation per uncertain field: the row predicted again
    (row_of) with that field at median x (1 -/+ spread/2). A figure a perturbed row lacks (a
    target past the emulator's staleness) adds nothing for that field."""
    out: dict[str, list[tuple[float, float]]] = {}
    for name, spread in sorted(spreads.items()):
        if not getattr(p, name):
            continue
        moved = [row_of(perturbed(p, name, f)) for f in (max(LOWEST, 1 - spread / 2), 1 + spread / 2)]
        for key in BANDED:
            x = row.get(key)
            if not x:
                continue
            rel = [m[key] / x - 1 for m in moved if m.get(key) is not None]
            out.setdefault(key, []).append((max([0.0, *(-r for r in rel)]), max([0.0, *rel])))
    return out


def learning_deviations(row: dict[str, Any], half_width: float) -> dict[str, list[tuple[float, float]]]:
    """The learning runs' relative half-width (statistical.Learning.band) on the figures to the
    target: the updates, and the images and hours in proportion to them."""
    if not half_width:
        return {}
    return {key: [(half_width, half_width)] for key in TARGET if row.get(key)}


def quadrature(devs: list[tuple[float, float]]) -> tuple[float, float]:
    """(down, up) of independent relative deviations: each side the root of the sum of squares."""
    return math.hypot(*(d for d, _ in devs)), math.hypot(*(u for _, u in devs))


def band(row: dict[str, Any], p: Profile, spreads: dict[str, float], row_of: Callable[[Profile], dict[str, Any]],
         learning_half_width: float = 0.0) -> dict[str, list[float]] | None:
    """{figure: [low, high]} for the row's banded figures, or None when nothing it rests on has
    a spread (no band is invented). A lower edge stays at or above 0."""
    if row.get("error"):
        return None
    devs = profile_deviations(row, p, spreads, row_of) if spreads else {}
    for key, more in learning_deviations(row, learning_half_width).items():
        devs.setdefault(key, []).extend(more)
    if not devs:
        return None
    out = {}
    for key in BANDED:
        if key in devs:
            down, up = quadrature(devs[key])
            out[key] = [row[key] * max(0.0, 1 - down), row[key] * (1 + up)]
    return out


def ratio_band(p: Profile, spreads: dict[str, float], value_a: Callable[[Profile], float],
               value_b: Callable[[Profile], float]) -> tuple[float, float] | None:
    """(low, high) of value_a / value_b when both come from the same moved profile, each uncertain
    field at its two extremes in turn, combined in quadrature as band() does. Two configurations
    on one cluster share its errors: a GPU 10% slower than calibrated slows both, so their bands
    may overlap while their order holds; this says whether it does. None without a spread."""
    r0 = value_a(p) / value_b(p)
    devs = []
    for name, spread in sorted(spreads.items()):
        if not getattr(p, name):
            continue
        moved = [perturbed(p, name, f) for f in (max(LOWEST, 1 - spread / 2), 1 + spread / 2)]
        rel = [value_a(q) / value_b(q) / r0 - 1 for q in moved]
        devs.append((max([0.0, *(-r for r in rel)]), max([0.0, *rel])))
    if not devs:
        return None
    down, up = quadrature(devs)
    return r0 * max(0.0, 1 - down), r0 * (1 + up)


def edges(row: dict[str, Any], key: str) -> tuple[float, float] | None:
    """The row's band on `key`, or None."""
    b = (row.get("band") or {}).get(key)
    return (b[0], b[1]) if b else None


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def coverage(pairs: list[tuple[float | None, tuple[float, float] | list[float] | None]],
             no_band: str = "") -> dict[str, Any]:
    """Whether measured figures lie inside their predicted bands: pairs of (measured, [low,
    high] or None). {"coverage": the fraction inside, "inside", "rows"} over the pairs with a
    band and a measurement; coverage None with the reason (`no_band`, or a default) when none has."""
    banded = [(m, b) for m, b in pairs if m is not None and b]
    if not banded:
        return {"coverage": None, "inside": 0, "rows": 0,
                "reason": no_band or "no row has both a band and a measured figure"}
    inside = sum(b[0] <= m <= b[1] for m, b in banded)
    return {"coverage": round(inside / len(banded), 4), "inside": inside, "rows": len(banded)}


def no_spread(source: str = "") -> str:
    """The line said where a profile gives no spread (naming it where the line stands alone)."""
    return (f"{f'profile {source}' if source else 'the profile'} gives no spread ([about] spread): its figures "
            "are points, with no band (a median of several calibrations, or one calibrate, records one)")


def shown(row: dict[str, Any], key: str, fmt: Callable[[float], str],
          edge: Callable[[float], str] | None = None) -> str:
    """'396.2 (371-421)': the figure (fmt) with its band's edges (edge, default fmt) where it has
    one, else the figure alone."""
    b, edge = edges(row, key), edge or fmt
    text = fmt(row[key])
    return text if b is None else f"{text} ({edge(b[0])}-{edge(b[1])})"
