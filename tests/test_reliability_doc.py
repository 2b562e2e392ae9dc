"""docs/reliability.md names, for each guarantee, the tests that hold it: every test it names must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _references(text: str) -> list[tuple[str, str | None]]:
    """(test file, test name or None) for every `tests/...py[::name]` and every `::name` continuing the last file."""
    found, current = [], None
    for token in re.findall(r"`((?:tests/[\w/]+\.py)?(?:::\w+)?)`", text):
        path, _, name = token.partition("::")
        current = path or current
        found.append((current, name or None))
    return found


def test_every_test_the_reliability_page_names_exists():
    references = _references((ROOT / "docs" / "reliability.md").read_text())
    assert len(references) > 40
    missing = []
    for path, name in references:
        source = ROOT / path
        if not source.is_file():
            missing.append(path)
            continue
        if name is not None:
            tree = ast.parse(source.read_text())
            names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
            if name not in names:
                missing.append(f"{path}::{name}")
    assert not missing, missing
