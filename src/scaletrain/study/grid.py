"""A sweep's grid: --grid items parsed, every combination of their values as a cell, and each
cell's config and placement checked before the first one runs.

Shared by bench and the learning study; the performance model's `predict` gets its cells from
the command line's parse of the same --grid (it is below the study and does not import it).
"""

from __future__ import annotations

import itertools

from ..config import load_config
from ..errors import ConfigError, GridError, PlanError
from ..proc.env import plan_for


def parse_grid(items: list[str]) -> list[tuple[tuple[str, ...], list[tuple[str, ...]]]]:
    """Each item is KEY=V1,V2,... or, for keys that move together, K1+K2=A1:A2,B1:B2
    (e.g. strategy.name+cluster.num_ps=allreduce:0,sync:1). A key given twice is refused: each cell would
    take only its last value, so the first item's values were dropped and the last's each run twice."""
    grid, seen = [], set()
    for item in items:
        key, sep, values = item.partition("=")
        keys = tuple(k.strip() for k in key.split("+"))
        vals = [tuple(x.strip() for x in v.split(":")) for v in values.split(",")]
        if sep and values.strip() and not all(x for v in vals for x in v):
            raise GridError(f"--grid {item!r}: an empty value; every value between commas (and colons) needs one")
        if not sep or not all(keys) or not values.strip() or any(len(v) != len(keys) for v in vals):
            raise GridError(f"--grid {item!r}: write KEY=V1,V2,... (e.g. cluster.nodes=1,2,4) or "
                            "K1+K2=A1:A2,B1:B2 for keys that move together")
        twice = next((k for i, k in enumerate(keys) if k in seen or k in keys[:i]), None)
        if twice:
            raise GridError(f"--grid {item!r}: {twice} is already in the grid; give all its values in one item, "
                            f"e.g. {twice}=1,2,3")
        seen.update(keys)
        grid.append((keys, vals))
    return grid


def cells(grid) -> list[dict[str, str]]:
    """Every combination of the grid's entries, as {key: value}."""
    out = []
    for combo in itertools.product(*(vals for _, vals in grid)):
        cell = {}
        for (keys, _), values in zip(grid, combo):
            cell.update(zip(keys, values))
        out.append(cell)
    return out


def cell_sets(overrides: list[str], cell: dict[str, str], extra: list[str]) -> list[str]:
    """The --set list a cell runs with: the user's overrides, the cell's keys, then what the sweep sets."""
    return [*overrides, *(f"{k}={v}" for k, v in cell.items()), *extra]


def check_cells(recipe: str, overrides: list[str], todo: list[tuple[dict[str, str], list[str]]]) -> None:
    """GridError naming the first (cell, extra sets) whose config or placement (without this host's
    facts) is invalid, in ConfigError's or PlanError's own words: a bad value in the grid ends the
    sweep before any cell runs, not as a row after the others have trained."""
    for cell, extra in todo:
        try:
            plan_for(load_config(recipe, cell_sets(overrides, cell, extra)))
        except (ConfigError, PlanError) as e:
            raise GridError(f"--grid {', '.join(f'{k}={v}' for k, v in cell.items())}: {e}") from None
