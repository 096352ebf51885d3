"""The core's import graph stays shallow: each file of ema_lab/ above all it imports, at most 7 levels."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import ema_lab

CORE = Path(ema_lab.__file__).parent
MAX_LEVELS = 7


def _imports() -> dict[str, set[str]]:
    """Each core module -> the core modules it imports (relative imports, anywhere in the file)."""
    files = {p.stem: p for p in CORE.glob("*.py")}
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found |= {alias.name for alias in node.names}
        graph[name] = (found & files.keys()) - {name}
    return graph


def test_the_core_import_graph_is_at_most_seven_levels_deep() -> None:
    graph = _imports()

    @functools.cache
    def level(module: str) -> int:
        return 1 + max((level(m) for m in graph[module]), default=0)

    levels = {m: level(m) for m in graph}
    assert max(levels.values()) <= MAX_LEVELS, sorted(levels.items(), key=lambda item: item[1])
    assert levels["checks"] == levels["gates"] == levels["buffers"] == 1  # the floor: torch alone
