"""mkdocs hook: every test the pages name (`test_file.py::test_name`) exists under tests/,
and every relative link of README.md (which is not a page of the site) finds its file.

A page that says a behaviour is tested names the test; a test renamed or removed must not
leave that claim behind. The test is looked for in every folder under tests/ (files move
between tests/unit, tests/dist, ...; their names stay), and README.md is checked as well as
the pages. A missing test is a warning, which `mkdocs build --strict` (make docs) fails on.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("references")
ROOT = Path(__file__).resolve().parents[2]
REF = re.compile(r"\b(test_\w+\.py)::(test_\w+)")
DEF = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")

_known: dict[str, set[str]] = {}


def _missing(text: str) -> list[str]:
    """The tests `text` names that are not under tests/ (the form itself, test_file.py::test_name, aside)."""
    return [f"{f}::{t}" for f, t in REF.findall(text)
            if (f, t) != ("test_file.py", "test_name") and t not in _known.get(f, set())]


def on_pre_build(config) -> None:
    _known.clear()
    for path in (ROOT / "tests").rglob("test_*.py"):
        _known.setdefault(path.name, set()).update(DEF.findall(path.read_text()))
    readme = ROOT / "README.md"
    text = readme.read_text() if readme.exists() else ""
    for ref in _missing(text):
        log.warning("README.md names %s, which is not a test under tests/", ref)
    for target in LINK.findall(text):
        if "://" not in target and not target.startswith("mailto:") and not (ROOT / target).exists():
            log.warning("README.md links to %s, which does not exist", target)


def on_page_markdown(markdown: str, page, config, files) -> str:
    for ref in _missing(markdown):
        log.warning("%s names %s, which is not a test under tests/", page.file.src_path, ref)
    return markdown
