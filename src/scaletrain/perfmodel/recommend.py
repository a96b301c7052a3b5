"""The configuration to ask for: for each number of nodes, the best strategy, number of
PS, placement and batch per replica under the model, with the runners-up and why they lose.

Candidates for T nodes: every strategy of the registry; for those with
parameter servers, PS counts of 1, 2, 3, 5, 7, ... (odd counts spread tensors
better) up to T alongside the workers, or T - p workers with p dedicated PS
nodes; backup strategies with one backup node. The objective ranks them;
configurations below --min-efficiency or above --max-staleness are left out.
Images whose gradients a backup strategy drops count for nothing in the ranking.

Batches per replica: the recipe's by default. More images per replica amortise
communication and a step's fixed cost, but they grow the images of an update,
which changes the optimisation (learning rate, generalisation); so a larger
batch is tried only when asked (batch_candidates: powers of two up to
--max-batch, or --batches), and only those that fit the device's memory.
Near-ties (about 1%) keep the batch nearest the recipe's.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..config import Config
from .bands import band, edges, overlap, ratio_band, shown
from ..strategies import REGISTRY
from .predict import hours, human_time, predict, rate, signed_time, whole
from .profile import Profile, fits, memory_at
from .scaling import setup
from .setup import ModelError
from .statistical import Learning, add_target

def node_counts(max_nodes: int) -> list[int]:
    counts, n = [], 1
    while n < max_nodes:
        counts.append(n)
        n *= 2
    return counts + [max_nodes]


def ps_counts(limit: int) -> list[int]:
    return [p for p in (1, 2, 3, 5, 7, 9, 11, 13, 15, 16, 24, 32, 48, 64) if p <= limit]


def batch_candidates(recipe: int, max_batch: int, largest: int | None) -> list[int]:
    """The recipe's batch and the powers of two above it up to max_batch; when the recipe's
    batch does not fit the device (largest: the most it holds, None: no limit), the largest
    power of two that does."""
    out, b = [recipe], 1
    while b <= max_batch:
        if b > recipe:
            out.append(b)
        b *= 2
    if largest is not None and recipe > largest >= 1:
        out.append(1 << (largest.bit_length() - 1))
    return sorted(set(out))


def stages_to_fit(cfg: Config, p: Profile, batch: int) -> int | None:
    """The pipeline stages a replica needs for `batch` images to fit its devices' memory: 1 when one
    device holds them, else the fewest that divide cluster.gpus_per_node and the batch into
    parallel.microbatches whose stages each fit (memory_at); None when none does. More stages than
    needed only add their bubble and activation transfers."""
    par, g = cfg.parallel, cfg.cluster.gpus_per_node
    if fits(p, batch):
        return 1
    for s in range(2, g + 1):
        held = (par.microbatches if par.schedule == "gpipe" else min(par.microbatches, s)) / par.microbatches
        if g % s == 0 and batch % par.microbatches == 0 and fits(p, batch, s, held):
            return s
    return None


def candidates(cfg: Config, total: int) -> list[Config]:
    """Every strategy and PS shape on `total` nodes. Async-allreduce, local-sgd and diloco are left
    out: async-allreduce's updates average as many gradients as its rounds last steps, and local
    steps apply each replica's gradient alone between meetings, so their images per second buy
    updates of another kind than the others', which throughput alone cannot weigh."""
    out = []
    for name, e in REGISTRY.items():
        if e.rounds or e.local or (cfg.parallel.stages > 1 and e.uses_ps):  # stages: all-reduce only
            continue
        shapes = [(total, 0, "alongside")] if not e.uses_ps else \
            [(total, p, "alongside") for p in ps_counts(total)] + \
            [(total - p, p, "dedicated") for p in ps_counts(total - 1)]
        for workers, p, where in shapes:
            if e.backups and workers < 2:
                continue  # a backup needs a second node
            out.append(cfg.replace(**{"strategy.name": name, "strategy.backup_workers": 1 if e.backups else 0,
                                      "cluster.nodes": workers, "cluster.num_ps": p, "cluster.ps_placement": where}))
    return out




def value(row: dict[str, Any], objective: str) -> float:
    """The objective, higher is better, counting only gradients that are applied: for time to
    accuracy, targets reached per hour (statistical.py)."""
    if objective == "time-to-accuracy":
        return 1 / row["target_hours"]
    return row["images_per_sec" if objective == "throughput" else "efficiency"] * (1 - row["dropped_fraction"])


def compare(row: dict[str, Any], other: dict[str, Any], objective: str) -> str:
    """How row stands against other: '-17% throughput', or '+24 min to the target (2.10x the images)'."""
    if objective == "time-to-accuracy":
        return (f"{signed_time((row['target_hours'] - other['target_hours']) * 3600)} to the target "
                f"({row['target_images'] / other['target_images']:.2f}x the images)")
    return f"{value(row, objective) / value(other, objective) - 1:+.0%} {objective}"


def why(loser: dict[str, Any], best: dict[str, Any], objective: str) -> str:
    """'-17% throughput; PS CPU busy 0.83 of the step; mean staleness 7.0'."""
    others = {k: v for k, v in loser["busy"].items() if k != "compute"}
    limit = max(others, key=others.get)
    reason = f"{compare(loser, best, objective)}; {limit} busy {others[limit]:.2f} of the step"
    if loser["dropped_fraction"]:
        reason += f"; drops {loser['dropped_fraction']:.0%} of gradients"
    if loser.get("staleness_mean"):
        reason += f"; mean staleness {loser['staleness_mean']:.1f}"
    if loser["nodes_total"] > best["nodes_total"]:
        reason += f"; uses {loser['nodes_total']} nodes"
    return reason


def recommend(cfg: Config, p: Profile, max_nodes: int, objective: str = "throughput",
              min_efficiency: float = 0.0, max_staleness: float | None = None, spread: float = 0.0,
              runners_up: int = 3, progress: bool = True, batches: list[int] | None = None,
              learning: Learning | None = None, clock=time.monotonic,
              spreads: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One entry per node count: {"nodes": T, "best": row, "runners_up": [(row, reason), ...],
    "batch_reason": str, "considered": n, "batches": tried, "unfit": left out for memory};
    best is None when no candidate meets the limits. batches: the batches per replica to try
    (default: the recipe's); the runners-up are other configurations at the chosen batch. learning:
    the measured run that time to accuracy is predicted from (statistical.py), needed by that
    objective, which leaves out the strategies it cannot predict (asynchronous ones). A row whose
    strategy's speedup falls as nodes grow carries a `flag` (falling_speedups). The rows shown (the
    best and the runners-up) carry a `band` (bands.py, from the profile's `spreads` and the learning
    runs'), and `overlap` says when the best two are within each other's bands on the objective; a
    band predicts a row again per uncertain field, so only the rows shown get one."""
    if objective == "time-to-accuracy" and learning is None:
        raise ModelError("--objective time-to-accuracy needs --learning RUN_DIR and --until accuracy=A or loss=L")
    recipe = cfg.data.batch_size
    batches = sorted(set(batches or [recipe]))
    stages = {b: stages_to_fit(cfg, p, b) for b in batches}  # a batch one device cannot hold may fit in stages
    unfit = [b for b in batches if stages[b] is None]
    tried = [b for b in batches if b not in unfit]
    out, fastest = [], {}
    counts = node_counts(max_nodes)
    shapes = {t: [c for b in tried for c in candidates(cfg.replace(**{"data.batch_size": b,
                                                                     "parallel.stages": stages[b]}), t)]
              for t in counts}
    start = clock()
    for k, total in enumerate(counts):
        rows, made = [], {}
        for c in shapes[total]:
            try:
                row = predict(c, p, spread)
            except ModelError:
                continue  # a shape the profile's nodes cannot hold
            rows.append(add_target(row, c, learning) if learning else row)
            made[id(rows[-1])] = c
        fastest[total] = fastest_by_strategy(rows)
        ok = [r for r in rows if r["efficiency"] >= min_efficiency
              and (objective != "time-to-accuracy" or "target_hours" in r)
              and (max_staleness is None or (r["staleness_mean"] or 0.0) <= max_staleness)]
        top = max((value(r, objective) for r in ok), default=1.0)
        # Near-ties (within 1%) go to the fresher gradients, then to the batch nearest the recipe's
        # (the smaller of two as near), then to fewer PS.
        ok.sort(key=lambda r: (-round(value(r, objective) / top, 2), r["staleness_mean"] or 0.0,
                               abs(r["batch_per_replica"] - recipe), r["batch_per_replica"], r["num_ps"]))
        best = ok[0] if ok else None
        same = [r for r in ok[1:] if r["batch_per_replica"] == best["batch_per_replica"]] if best else []
        tops = {b: next((r for r in ok if r["batch_per_replica"] == b), None) for b in tried}
        for r in [best, *same[:runners_up]] if best else []:
            r["band"] = row_band(r, made[id(r)], p, spreads or {}, spread, learning)
        out.append({"nodes": total, "best": best, "considered": len(rows), "batches": tried, "unfit": unfit,
                    "overlap": within(best, same[0], objective, order(best, same[0], made, p, spreads or {},
                                                                      spread, learning, objective)) if same else None,
                    "batch_reason": batch_reason(best, tops, recipe, unfit, p, objective) if best else "",
                    "runners_up": [(r, why(r, best, objective)) for r in same[:runners_up]]})
        if progress:
            print(f"  {total} node{'s' if total > 1 else ''}: {len(rows)} configurations; "
                  f"{progress_note(shapes, counts[:k + 1], clock() - start)}", file=sys.stderr, flush=True)
    mark_falling(out, falling_speedups(fastest))
    return out


def row_band(row: dict[str, Any], c: Config, p: Profile, spreads: dict[str, float], spread: float,
             learning: Learning | None) -> dict[str, list[float]] | None:
    """The row's band (bands.band): c predicted again as recommend predicts it."""
    def row_of(q: Profile) -> dict[str, Any]:
        r = predict(c, q, spread)
        return add_target(r, c, learning) if learning else r
    return band(row, p, spreads, row_of, learning.band() if learning else 0.0)


def order(best: dict[str, Any], second: dict[str, Any], made: dict[int, Config], p: Profile,
          spreads: dict[str, float], spread: float, learning: Learning | None,
          objective: str) -> tuple[float, float] | None:
    """The band of value(best) / value(second) with both predicted from the same moved profile
    (bands.ratio_band): whether the order holds under the errors the two share."""
    def of(row):
        c = made[id(row)]

        def value_of(q: Profile) -> float:
            r = predict(c, q, spread)
            return value(add_target(r, c, learning) if learning else r, objective)
        return value_of
    return ratio_band(p, spreads, of(best), of(second)) if spreads else None


def objective_band(row: dict[str, Any], objective: str) -> tuple[float, float]:
    """The band of value(row, objective), or the point itself where the row has none."""
    if objective == "time-to-accuracy":
        b = edges(row, "target_hours")
        return (1 / b[1], 1 / b[0] if b[0] > 0 else float("inf")) if b else (value(row, objective),) * 2
    b = edges(row, "images_per_sec" if objective == "throughput" else "efficiency")
    kept = 1 - row["dropped_fraction"]
    return (b[0] * kept, b[1] * kept) if b else (value(row, objective),) * 2


def within(best: dict[str, Any], second: dict[str, Any], objective: str,
           ratio: tuple[float, float] | None = None) -> str | None:
    """'the best two are within each other's bands: A: 371-421 img/s; B: 360-409 img/s' when the
    bands of the best two on the objective overlap (a row with no band counts as its point); None
    when they do not, or neither has a band. With `ratio` (order()), whether the order holds when
    the errors they share move both alike: '...; moved together, A stays ahead (1.02-1.04x)'."""
    if not (best.get("band") or second.get("band")) or \
            not overlap(objective_band(best, objective), objective_band(second, objective)):
        return None

    def text(r: dict[str, Any]) -> str:
        if objective == "time-to-accuracy":
            lo, hi = edges(r, "target_hours") or (r["target_hours"],) * 2
            return f"{hours(lo)}-{hours(hi)} to the target"
        lo, hi = objective_band(r, objective)
        return f"{whole(lo)}-{whole(hi)} img/s" if objective == "throughput" else f"{lo:.2f}-{hi:.2f} efficiency"
    said = f"the best two are within each other's bands: {setup(best)}: {text(best)}; {setup(second)}: {text(second)}"
    if ratio is None:
        return said
    span = f"{ratio[0]:.2f}-{ratio[1]:.2f}x"
    return said + (f"; moved together by the profile's spread, the first stays ahead ({span})" if ratio[0] > 1 else
                   f"; moved together by the profile's spread, either may lead ({span})")


def progress_note(shapes: dict[int, list], done: list[int], elapsed: float) -> str:
    """'3 of 5 node counts done, 12 s in, about 1.5 min left': the time left from the time so far,
    each node count weighed by its candidates times its nodes (a simulation's events grow with both)."""
    weight = {t: len(cs) * t for t, cs in shapes.items()}
    did, left = sum(weight[t] for t in done), sum(w for t, w in weight.items() if t not in done)
    text = f"{len(done)} of {len(shapes)} node counts done, {human_time(elapsed)} in"
    return text + (f", about {human_time(elapsed * left / did)} left" if left and did else "")


# A strategy's speedup may level off as nodes grow; one that falls by more than this below its best
# at fewer nodes is flagged. A ring over n nodes gains while a replica's compute outweighs two of its
# latencies (n / (compute + 2(n - 1) latency) grows), and servers can be added with the nodes: a
# falling speedup says a figure of the profile is off (a calibration on a busy host: a job's bytes
# a thousand times as slow) or that the model is asked about a machine it was not measured on.
# 5% leaves room for the simulation's rounding of cycles.
FALL_BOUND = 0.05


def fastest_by_strategy(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each strategy's row with the highest speedup among `rows` (one node count's candidates)."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["strategy"] not in best or r["speedup"] > best[r["strategy"]]["speedup"]:
            best[r["strategy"]] = r
    return best


def falling_speedups(fastest: dict[int, dict[str, dict[str, Any]]],
                     bound: float = FALL_BOUND) -> dict[tuple[str, int], str]:
    """(strategy, nodes) -> a one-line flag where the strategy's best speedup at that node count
    (fastest[nodes][strategy], fastest_by_strategy's) falls below its peak at fewer nodes by more
    than `bound`, naming both, and the bottleneck there."""
    flags, peak = {}, {}
    for total in sorted(fastest):
        for name, r in fastest[total].items():
            top = peak.get(name)
            if top and r["speedup"] < top[0] * (1 - bound):
                flags[(name, total)] = (f"{name}'s speedup falls as nodes grow: {top[0]:.2f} at {top[1]} "
                                        f"node{'s' if top[1] > 1 else ''}, "
                                        f"{r['speedup']:.2f} at {total} ({r['bottleneck']} bound)")
            if not top or r["speedup"] > top[0]:
                peak[name] = (r["speedup"], total)
    return flags


def mark_falling(entries: list[dict[str, Any]], flags: dict[tuple[str, int], str]) -> None:
    """Give the recommended and runner-up rows of a flagged strategy and node count their flag."""
    for e in entries:
        for r in [e["best"], *(r for r, _ in e["runners_up"])]:
            if r is not None and (r["strategy"], e["nodes"]) in flags:
                r["flag"] = flags[(r["strategy"], e["nodes"])]


def batch_reason(best: dict[str, Any], tops: dict[int, dict | None], recipe: int, unfit: list[int],
                 p: Profile, objective: str) -> str:
    """Why the chosen batch per replica: its gain over the recipe's, and what stops the next
    larger one ('+18% throughput over the recipe's 32; 128 does not fit (13.8 GB > 12.0 GB)')."""
    b, said = best["batch_per_replica"], []
    if best.get("stages", 1) > 1:
        said.append(f"{best['stages']} stages a replica: {b} images need {memory_at(p, b) / 1e9:.1f} GB on one device "
                    f"> {p.device_memory / 1e9:.1f} GB; a stage needs {best['stage_memory'] / 1e9:.1f} GB")
    if b != recipe:
        if recipe in unfit:
            said.append(f"the recipe's {recipe} does not fit ({memory_at(p, recipe) / 1e9:.1f} GB > "
                        f"{p.device_memory / 1e9:.1f} GB)")
        elif tops.get(recipe) is None and recipe in tops:
            said.append(f"none at the recipe's {recipe} meets the limits")
        elif tops.get(recipe) is not None:
            said.append(f"{compare(best, tops[recipe], objective)} over the recipe's {recipe}")
    larger = sorted(c for c in tops if c > b)
    if larger:
        c = larger[0]
        if tops[c] is None:
            said.append(f"none at {c} meets the limits")
        else:
            if objective == "time-to-accuracy":
                said.append(f"{c}: {compare(tops[c], best, objective)}")
            else:
                gain = value(tops[c], objective) / value(best, objective) - 1
                said.append(f"{c} gains only {gain:+.1%}")  # a near-tie: see the sort above
    elif [c for c in unfit if c > b]:
        c = min(c for c in unfit if c > b)
        said.append(f"the largest tried that fits: {c} needs {memory_at(p, c) / 1e9:.1f} GB > "
                    f"{p.device_memory / 1e9:.1f} GB")
    return "; ".join(said) or ("the recipe's" if b == recipe else "")


def recommend_table(entries: list[dict[str, Any]], objective: str) -> str:
    """Markdown: one line per node count; a flagged row (falling_speedups) says so in its cell. The
    img/s, the objective's figure and the time to a target show their band where the row has one."""
    timed = objective == "time-to-accuracy"
    lines = [f"| Nodes | Recommended ({objective}) | Batch per replica | Images per update | img/s | Speedup | "
             "Efficiency |" + (" Time to target | Images to target |" if timed else "")
             + " Why this batch | Runners-up at that batch and why they lose |",
             "|---" * (9 + 2 * timed) + "|"]
    for e in entries:
        b = e["best"]
        if b is None:
            lines.append(f"| {e['nodes']} | none meets the limits ({e['considered']} considered) |" + " |" * (7 + 2 * timed))
            continue
        losers = "; ".join(f"{setup(r)}{marked(r)}: {reason}" for r, reason in e["runners_up"]) or "-"
        eff = shown(b, "efficiency", lambda x: f"{x:.2f}") if objective == "efficiency" else f"{b['efficiency']:.2f}"
        lines.append(f"| {e['nodes']} | {setup(b)}{marked(b)} | {b['batch_per_replica']} | {b['update_batch']} | "
                     f"{shown(b, 'images_per_sec', rate, whole)} | {b['speedup']:.2f} | {eff} | "
                     + (f"{shown(b, 'target_hours', hours)} | {b['target_images']:.3g} | " if timed else "")
                     + f"{e['batch_reason'] or '-'} | {losers} |")
    return "\n".join(lines)


def marked(row: dict[str, Any]) -> str:
    return " [flagged: speedup falls as nodes grow]" if row.get("flag") else ""


def shown_flags(entries: list[dict[str, Any]]) -> list[str]:
    """The flags of the rows the table shows, one a strategy: that of its most nodes."""
    rows = [r for e in entries for r in [e["best"], *(r for r, _ in e["runners_up"])] if r is not None]
    last = {r["strategy"]: r["flag"] for r in sorted(rows, key=lambda r: r["nodes_total"]) if r.get("flag")}
    return list(last.values())
