"""The report's plots, one PNG each: small multiples, one panel per strategy.

Strategies side by side on shared axes, rather than every line on one axis,
so a reader compares one strategy's node counts within a panel and the
strategies across panels at a glance; legends stay short (the node counts of
one panel). A node count keeps its colour in every panel.
matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..perfmodel import scaling
from .figures import MARK

PANEL_IN = 3.3  # inches of one panel's width; the figure grows with the number of strategies


def _plt():
    import matplotlib  # heavy, and needed only when a report draws a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display is needed or opened

    return plt


def _save(fig, out: Path, name: str, made: list[tuple[str, str]], title: str) -> None:
    fig.tight_layout()
    _legend(fig)
    fig.savefig(out / name, dpi=110, bbox_inches="tight")  # "tight" keeps the legend below the panels
    _plt().close(fig)
    made.append((name, title))


def _panels(n: int, title: str, sharex: bool = True):
    fig, axes = _plt().subplots(1, n, sharey=True, sharex=sharex, squeeze=False,
                                figsize=(max(4.8, PANEL_IN * n + 0.8), 3.5))
    fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def by_strategy(rows: list[dict]) -> dict[str, list[dict]]:
    """Measured rows by strategy (and data kind), sorted by nodes used."""
    groups = defaultdict(list)
    for r in rows:
        if not r.get("error"):
            key = r["strategy"] + ("" if r.get("data") in (None, "real") else f" ({r['data']})") + \
                scaling.emulated_compute(r)
            groups[key].append(r)
    return {k: sorted(v, key=lambda r: (r["nodes_total"], r["nodes"])) for k, v in groups.items()}


def variant(row: dict) -> str:
    """What tells a row apart from others of its strategy besides the node count:
    its PS, replicas per node and the grid's other keys."""
    ps, dedicated = row.get("num_ps") or 0, row.get("ps_placement") == "dedicated"
    parts = [f"{ps} {'dedicated ' if dedicated else ''}PS{'' if dedicated else ' alongside'}"] if ps else []
    if (row.get("gpus_per_node") or 1) > 1:
        parts.append(f"x {row['gpus_per_node']} replicas")
    parts += [f"{k.split('.')[-1]}={v}" for k, v in scaling.rest(row.get("cell", {})).items()
              if k != "cluster.gpus_per_node"]
    if "cell" not in row and row.get("label"):  # a run directory of its own: its name tells it apart
        parts.append(row["label"])
    return ", ".join(parts)


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for r in rows:
        groups[variant(r)].append(r)
    return dict(groups)


def _titled(ax, name: str, series: dict[str, list[dict]]) -> None:
    """Panel title: the strategy, and its one variant when there is only one (then no legend)."""
    only = next(iter(series)) if len(series) == 1 else ""
    ax.set_title(name + (f"\n{only}" if only else ""), fontsize=9)


def _legend(fig) -> None:
    """One legend for the figure, below the panels, so it hides no data: a node count (or a
    variant) keeps its colour in every panel, so each label is listed once."""
    entries: dict[str, object] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(len(entries), 4), fontsize=8, frameon=False)


def _nodes_colours(rows: list[dict]) -> dict[int, str]:
    counts = sorted({r["nodes"] for r in rows})
    return {n: f"C{i % 10}" for i, n in enumerate(counts)}


def _variant_colours(groups: dict[str, list[dict]]) -> dict[str, str]:
    """A colour per variant, the same in every panel (the legend lists each once); one colour
    when no panel has two variants (each panel's title names its own)."""
    names = list(dict.fromkeys(variant(r) for g in groups.values() for r in g))
    several = any(len({variant(r) for r in g}) > 1 for g in groups.values())
    return {v: f"C{i % 10}" if several else "C0" for i, v in enumerate(names)}


def bench_plots(rows: list[dict], out: Path, made: list) -> None:
    # A strategy present only as the bench's added baseline is a dot at 1 by definition:
    # it is drawn as the reference line of the throughput panels instead of a panel of its own.
    groups = {k: g for k, g in by_strategy(rows).items() if not all(r.get("added_baseline") for r in g)}
    if not groups:
        return
    top = max(r["nodes_total"] for g in groups.values() for r in g)
    vc = _variant_colours(groups)
    fig, axes = _panels(len(groups), "Speedup against nodes used (vs 1 node, no distribution)")
    for ax, (name, g) in zip(axes, groups.items()):
        ax.plot([1, top], [1, top], "k--", lw=1, label="ideal")
        series = _series(g)
        for label, s in series.items():
            pts = [r for r in s if r.get("speedup") is not None]
            if pts:
                ax.errorbar([r["nodes_total"] for r in pts], [r["speedup"] for r in pts], color=vc[label],
                            yerr=[r["speedup_stderr"] for r in pts], marker="o", capsize=3,
                            label=label if len(series) > 1 else None)
                _flagged(ax, pts, "nodes_total", "speedup")
        _titled(ax, name, series)
        ax.set_xlabel("nodes used (dedicated PS incl.)")
        if top <= 8:
            ax.set_xticks(range(1, top + 1))
    axes[0].set_ylabel("speedup")
    _save(fig, out, "speedup.png", made, "Speedup against nodes used, one panel per strategy, with the ideal line")
    fig, axes = _panels(len(groups), "Throughput against worker nodes")
    for ax, (name, g) in zip(axes, groups.items()):
        series = _series(g)
        bases = {}  # the baseline of each series that is not its own (one line for series sharing one)
        for label, s in series.items():
            pts = [r for r in s if scaling.measured(r)]  # a run with no timed window has no point
            ax.errorbar([r["nodes"] for r in pts], [r["images_per_sec"] for r in pts], color=vc[label],
                        yerr=[scaling.throughput_se(r) for r in pts], marker="o", capsize=3,
                        label=label if len(series) > 1 else None)
            _flagged(ax, pts, "nodes", "images_per_sec")
            base = scaling.baseline(s[0], rows)
            if base is not None and scaling.measured(base) and all(base is not r for r in s):
                bases.setdefault(id(base), (base, vc[label]))
        for base, colour in bases.values():
            ax.axhline(base["images_per_sec"], color=colour if len(bases) > 1 else "0.35", ls=":", lw=1.2,
                       label="1 node, no distribution")
        _titled(ax, name, series)
        ax.set_xlabel("worker nodes")
        ax.set_xticks(sorted({r["nodes"] for r in g}))
    # Once every panel is drawn: the panels share the y axis, and a limit set from the first would
    # freeze its top there and cut the higher points of the others.
    axes[0].set_ylim(bottom=0)
    axes[0].set_ylabel("images/s (all replicas)")
    _save(fig, out, "throughput.png", made, "Throughput against worker nodes, one panel per strategy; dotted: "
          "the baseline, 1 node with no distribution")


def _flagged(ax, rows: list[dict], x: str, y: str) -> None:
    """A red ring around each point whose figure is flagged (flags.add_flags): the table says why."""
    pts = [r for r in rows if y in (r.get("flagged") or ())]
    if pts:
        ax.plot([r[x] for r in pts], [r[y] for r in pts], "o", ms=13, mfc="none", mec="red", mew=1.8,
                label=f"flagged {MARK} (see the table)")


def curves(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The chief's train and eval rows from metrics.jsonl, each with `t` = training seconds
    since the run began (time spent evaluating left out, so evaluation cadence does not count)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("rank", 0) == 0]
    t0 = next((r["time"] - r["wall"] for r in rows if "wall" in r), rows[0]["time"] if rows else 0.0)
    for r in rows:
        r["t"] = r.get("train_wall", r["time"] - t0)  # runs written before train_wall: wall clock
    return {"train": [r for r in rows if r["kind"] == "train"], "eval": [r for r in rows if r["kind"] == "eval"]}


def _node_label(r: dict, series_count: int) -> str:
    n = r["nodes"]
    text = f"{n} node{'s' if n > 1 else ''}"
    return text if series_count == 1 else f"{text}, {variant(r)}"


def learning_plots(rows: list[dict], out: Path, made: list, prefix: str,
                   target: tuple[str, float] | None = None) -> None:
    rows = [r for r in rows if not r.get("error") and (Path(r["run_dir"]) / "metrics.jsonl").exists()]
    if not rows:
        return
    by_run = {id(r): curves(Path(r["run_dir"])) for r in rows}
    clock = next((r["clock"] for r in rows if r.get("clock")), None)
    if clock:  # the study's times on another clock (learning.Clock): a point's images over its rate
        for r in rows:
            for p in (p for c in by_run[id(r)].values() for p in c):
                p["t"] = p["images"] / r["clock_images_per_sec"]
    seconds = f"seconds on {clock}" if clock else "training seconds"
    groups, colour = by_strategy(rows), _nodes_colours(rows)
    plots = [(prefix + "loss-time.png", "train", "t", "loss", seconds, "train loss",
              "Train loss against training time"),
             (prefix + "loss-steps.png", "train", "step", "loss", "step", "train loss", "Train loss against steps")]
    if any(by_run[id(r)]["eval"] for r in rows):
        plots.append((prefix + "accuracy-time.png", "eval", "t", "test_accuracy", seconds,
                      "test accuracy", "Test accuracy against training time"))
    for name, kind, x, y, xlabel, ylabel, title in plots:
        fig, axes = _panels(len(groups), title)
        for ax, (strategy, g) in zip(axes, groups.items()):
            series = _series(g)
            for r in g:
                c = by_run[id(r)][kind]
                ax.plot([p[x] for p in c], [p[y] for p in c], color=colour[r["nodes"]],
                        marker="." if kind == "eval" else None, lw=1.2,
                        ls="-" if len(series) == 1 else ["-", "--", ":", "-."][list(series).index(variant(r)) % 4],
                        label=_node_label(r, len(series)))
            _titled(ax, strategy, series)
            ax.set_xlabel(xlabel)
        axes[0].set_ylabel(ylabel)
        _save(fig, out, name, made, title + ", one panel per strategy, a line per node count")
    acc = by_strategy([r for r in rows if r.get("test_accuracy") is not None])
    if acc:
        _per_nodes(acc, "test_accuracy", "final test accuracy", "Final test accuracy against worker nodes",
                   out, prefix + "accuracy-nodes.png", made)
    to_target = "clock_time_to_target" if clock else "time_to_target"
    if target and any(r.get(to_target) for r in rows):
        reached = {k: [r for r in g if r.get(to_target)] for k, g in groups.items()}
        _per_nodes({k: g for k, g in reached.items() if g}, to_target, seconds,
                   f"Time to {target[0]} {target[1]:g} against worker nodes", out, prefix + "time-to-target.png",
                   made)


def _per_nodes(groups: dict[str, list[dict]], y: str, ylabel: str, title: str, out: Path, name: str,
               made: list) -> None:
    fig, axes = _panels(len(groups), title)
    vc = _variant_colours(groups)
    for ax, (strategy, g) in zip(axes, groups.items()):
        series = _series(g)
        for label, s in series.items():
            ax.plot([r["nodes"] for r in s], [r[y] for r in s], marker="o", color=vc[label],
                    label=label if len(series) > 1 else None)
        _titled(ax, strategy, series)
        ax.set_xlabel("worker nodes")
        ax.set_xticks(sorted({r["nodes"] for r in g}))
    axes[0].set_ylabel(ylabel)
    _save(fig, out, name, made, title + ", one panel per strategy")


def predicted_plot(rows: list[dict], out: Path, made: list) -> None:
    """One axis on purpose: predicted against measured is read against the diagonal."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    top = 1.1 * max(max(r["measured"], r["predicted"]) for r in rows)
    ax.plot([0, top], [0, top], "k--", lw=1, label="predicted = measured")
    ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="0.9", label="±15%")
    for name, g in by_strategy(rows).items():
        ax.plot([r["measured"] for r in g], [r["predicted"] for r in g], "o", label=name)
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured images/s", ylabel="predicted images/s",
           title="Performance model against the bench")
    _save(fig, out, "predicted-measured.png", made, "Predicted against measured throughput")


HISTOGRAMS = {  # summary key -> (its mean's key, what is counted, x axis, file)
    "staleness_hist": ("staleness_mean", "Staleness of applied gradients", "staleness (updates)", "staleness.png"),
    "gradients_per_update_hist": ("gradients_per_update_mean", "Gradients averaged by each update",
                                  "gradients per update", "gradients-per-update.png"),
}


def staleness_plot(summaries: list[dict], out: Path, made: list, key: str = "staleness_hist") -> None:
    """One of HISTOGRAMS (staleness by default), one panel per strategy. Summaries carry a
    `source` (bench, study, run) so the same configuration measured twice stays two lines with
    different names."""
    mean_key, title, xlabel, name = HISTOGRAMS[key]
    stale = [s for s in summaries if s.get(key) and sum(s[key][1:])]
    if not stale:
        return
    groups, colour = by_strategy(stale), _nodes_colours(stale)
    fig, axes = _panels(len(groups), title)
    for ax, (strategy, g) in zip(axes, groups.items()):
        series = _series(g)
        sources = sorted({s.get("source") or "" for s in g})
        for s in g:
            hist = s[key]
            last = max(j for j, v in enumerate(hist) if v) + 1
            total = sum(hist)
            source = s.get("source") or ""
            label = _node_label(s, len(series)) + (f" ({source})" if len(sources) > 1 else "") + \
                f", mean {s[mean_key]:.2f}"
            ax.plot(range(last), [v / total for v in hist[:last]], marker="o", color=colour[s["nodes"]],
                    ls=["-", "--", ":"][sources.index(source) % 3], label=label)
        _titled(ax, strategy, series)
        ax.set_xlabel(xlabel)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("fraction of " + ("updates" if key != "staleness_hist" else "gradients"))
    _save(fig, out, name, made, f"{title}, one panel per strategy")

