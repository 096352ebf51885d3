"""docs/api.md lists every public name of ema_lab and of its public modules, each with its signature."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MODULES = ("ema_lab", "ema_lab.schedules", "ema_lab.posthoc", "ema_lab.snapshots")
HEADING = re.compile(r"^### `(?P<name>[\w.]+)(?:\((?P<params>.*)\))?`$", re.MULTILINE)


def _entries() -> dict[str, str | None]:
    """Each listed dotted name -> the parameters written beside it (None for a constant)."""
    return {m["name"]: m["params"] for m in HEADING.finditer(PAGE.read_text())}


def _resolve(dotted: str) -> object:
    """The object a dotted name on the page stands for: a public module's attribute."""
    module, _, attr = dotted.rpartition(".")
    assert module in MODULES, f"{dotted}: {module} is not one of the public modules {MODULES}"
    return getattr(importlib.import_module(module), attr)


def _split_top_level(params: str) -> list[str]:
    """The parameters written in a heading, split at the commas outside brackets."""
    out, depth, current = [], 0, ""
    for ch in params:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    return [*out, current.strip()] if current.strip() else out


def _written_names(params: str) -> list[str]:
    return [p.split("=")[0].strip() for p in _split_top_level(params)]


def _code_names(obj: object) -> list[str]:
    names, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            names.append("*")
            star = True
        names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return names


def test_every_public_name_is_on_the_page() -> None:
    listed = {id(_resolve(name)) for name in _entries()}
    missing = [
        f"{module}.{name}"
        for module in MODULES
        for name in importlib.import_module(module).__all__
        if id(getattr(importlib.import_module(module), name)) not in listed
    ]
    assert not missing, f"docs/api.md misses {missing}"


@pytest.mark.parametrize("name", sorted(_entries()))
def test_every_listed_name_exists_with_the_signature_written(name: str) -> None:
    obj = _resolve(name)
    params = _entries()[name]
    if params is None:
        return  # a constant or a type: its existence is the check
    assert _written_names(params) == _code_names(obj), name
