"""The package's layers, as docs/architecture.md draws them: imports point down, never round.

Every import counts, at module level or inside a function: a cycle hidden in a function is a
cycle. Layers, top to bottom: the entry points (cli, __main__); the study (study/); the
performance model (perfmodel/); the core (everything else). A module imports only from its own
layer or those below it. Inside a function only third-party modules are imported, and only with a
reason on the line (an optional extra, or a heavy library that most calls never need)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# The core has floors of its own: on top, what starts and joins a job (the orchestrators of launch/, run,
# and Job with its loop and tracker, which a launcher's processes enter); below, everything a job's
# processes are made of, process primitives (proc/) and communication (comm/) at the bottom of it.
LAYERS = [("scaletrain.cli", "scaletrain.cli_args", "scaletrain.__main__", "scaletrain.api"),
          ("scaletrain.study",),
          ("scaletrain.perfmodel",),
          ("scaletrain.run", "scaletrain.launch", "scaletrain.job", "scaletrain.job_env", "scaletrain.loop",
           "scaletrain.tracker", "scaletrain.doctor"),
          ("scaletrain",)]


def _modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for p in sorted((src / "scaletrain").rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(src: Path = SRC):
    """(importer, imported scaletrain module, line, inside a function, source line) for every import."""
    mods = _modules(src)
    for name, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods and t.startswith("scaletrain."):
                    t = t.rpartition(".")[0]  # `import scaletrain.x.y` of a name: its module
                yield name, t, node.lineno, id(node) in local, lines[node.lineno - 1]


def _layer(module: str) -> int:
    return next(i for i, prefixes in enumerate(LAYERS)
                if any(module == p or module.startswith(p + ".") for p in prefixes))


def _graph(src: Path = SRC) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in _modules(src)}
    for a, b, *_ in _imports(src):
        if b in g and b != a and not (a.startswith(b + ".") and _modules(src)[b].name == "__init__.py"):
            g[a].add(b)
    return g


def _cycle(g: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path a -> ... -> a, or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        stack.pop()
        return []

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
    up = [f"{a} imports {b} (line {n})" for a, b, n, _, _ in _imports()
          if b.startswith("scaletrain") and _layer(b) < _layer(a)]
    assert not up, "an import up the layers:\n" + "\n".join(up)


def test_function_local_imports_are_third_party_with_a_reason():
    """Except the command line's: it is the top (nothing imports it, so a late import there hides no
    cycle) and imports each command's modules where the command runs, so that `keys` and `plan` load
    no torch (test_cli_light.py)."""
    bad = [f"{a}:{n}: {line.strip()}" for a, b, n, inside, line in _imports()
           if inside and a != "scaletrain.cli" and (b.startswith("scaletrain") or "#" not in line)]
    assert not bad, "function-local imports of our own modules, or without a reason:\n" + "\n".join(bad)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The checks above run on the real package; here on a made-up one, so they are seen to fail."""
    pkg = tmp_path / "scaletrain"
    (pkg / "study").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "study" / "__init__.py").write_text("")
    (pkg / "study" / "bench.py").write_text("from ..train import loop\n")
    (pkg / "train.py").write_text("def loop():\n    from .study import bench  # lazy\n")
    assert _cycle(_graph(tmp_path)) == ["scaletrain.study.bench", "scaletrain.train", "scaletrain.study.bench"]
    found = [(a, b, inside) for a, b, _, inside, _ in _imports(tmp_path)]
    assert ("scaletrain.train", "scaletrain.study.bench", True) in found
    assert _layer("scaletrain.train") > _layer("scaletrain.study.bench")


def _loaded(statement: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{statement}; import sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True, env={"PYTHONPATH": str(SRC)})
    return set(out.stdout.split())


def test_the_training_path_loads_nothing_of_the_study():
    loaded = _loaded("import scaletrain.loop, scaletrain.job, scaletrain.run")
    assert not {m for m in loaded if m.startswith(("scaletrain.study", "scaletrain.perfmodel", "matplotlib"))}


def test_config_plan_and_strategy_traits_load_no_torch():
    """The launcher, `plan` and config validation read the strategies' traits without torch."""
    assert "torch" not in _loaded("import scaletrain.config, scaletrain.plan, scaletrain.strategies.traits")


def test_a_keeper_loads_no_torch():
    """A rank's keeper (launch/keep.py: a Slurm task's `python -m scaletrain.launch.keep`, or `scaletrain train`
    under torchrun before it trains) holds a node's memory for the whole job: it imports no torch."""
    assert "torch" not in _loaded("import scaletrain.launch.keep, scaletrain.cli")
