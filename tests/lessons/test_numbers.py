"""Every number a sentence states is printed by a cell or stands in a results file the text links (issue 63).

Read: the markdown cells of every committed notebook (``.ipynb``), README.md and docs/*.md. A number
stated there must be found

- for a notebook cell: in the text outputs of the notebook's code cells (stdout, a result's
  ``text/plain``; images are not read), in its code (a literal the code sets: sizes, rounds, steps; the
  code of the exercises' solutions counts, see ``code_text``), or in a file the cell links or names: a
  committed results file (``results/``, ``docs/results/``), or another notebook's outputs (``notebook 04``);
- for README.md and docs/*.md: in a file the same section (from one heading to the next) links or names,
  as above, or in a fenced block of that section (a program and what it printed, shown on the page).

So a change to the library, followed by a re-execution of the notebooks, names every sentence whose
number no output prints any more, and no sentence quotes a figure that nothing committed holds. To fix
one: print the number in a cell, link the results file that holds it (with its date and the library it
measured), or drop it; a definition goes into ``DEFINITIONS`` with the reason.

A stated number is a decimal (``0.296``, ``1.5x``, ``4.4e-02``), a number with a thousands separator
(``1,416``), a whole number of two or more digits (``64 tensors``), or any number with a unit of time,
size, rate, a ratio or a count of ops, kernels or bits (``5 ms``, ``8 GB``, ``7x``, ``3 %``, ``8 kernels``).
A one-digit count without a unit (``3 lines``, ``2 ranks``) is ordinary prose: too common to check.
Not read: code (fenced and indented blocks, inline code spans), link targets, paths and URLs, math
(``$...$``, ``2^18``, ``1/2``), versions (``torch 2.13``, ``2.1.2+cu121``), dates, times of day and years,
issue and PR numbers (``#25315``, ``issue 29``), and what numbers a notebook, cell, section, exercise,
algorithm, step or list item.

Matching: separators and signs are dropped (``1,799`` is ``1799``), and a found number matches a stated
one that it rounds to at the stated number's last digit (``0.296`` is backed by ``0.29612``, ``0.30`` by
``0.3``, ``78x`` by ``78.39``). A number written with one significant digit (``4x``, ``0.3``) must be
found as written: a window of 3.5 to 4.5 would find something in any output. Every number in a backing
text counts, whichever field or line holds it. So a changed figure is caught when its new value is
nowhere in what backs it: a figure of two significant digits in a section that links a large JSON file
(hundreds of values) is often found there by chance, which is why a text should link the smallest file
that holds its figure (a study's ``.md``, a run's ``.log``) and quote it at the precision printed there.
A ratio of two printed numbers is not computed: it must be printed itself. Nothing here depends on a
tool's version or wording: the test reads only the committed files.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = (ROOT / "results", ROOT / "docs" / "results")  # where committed results files live

# Definitions: numbers chosen or fixed elsewhere, not measured here, so no output need print them. A key is
# the number with its unit as written, separators dropped ("4.8 TB/s"); one without a unit matches only a
# number written without one.
DEFINITIONS = {
    "0.9999",  # ModelEMA's (and ultralytics') default decay
    "2000",  # ModelEMA's default tau; the zoo's tiny_tensors model holds 2,000 tensors
    "2048",  # ModelEMA's default cat_max_numel: a tensor under it is gathered by torch.cat
    "32768",  # ATen's grain size: an element-wise CPU op splits over threads only above it
    "0.289",  # 1/sqrt(12): the longest power-function EMA (gamma 0, the running mean), MAX_SIGMA_REL
    # The models' sizes, as their code builds them: float tensors of the zoo's yolo and ultralytics'
    # yolo26n (594; yolo's state_dict has 708 entries), yolo-like (495), resnet50 (267), gpt2 (144).
    "594",
    "708",
    "495",
    "267",
    "144",
    "4.8 TB/s",  # the H200's memory bandwidth, NVIDIA's figure
    "10000",  # the window 1 / (1 - d) of the default decay 0.9999, in steps
    # The floating-point formats: significand bits stored (and with the implicit leading 1) by
    # bfloat16, float16, float32; float32's ulp at 1 (2^-23)
    *("7 bits", "8 bits", "10 bits", "11 bits", "23 bits", "24 bits", "1.2e-7"),
}

# A unit after a number makes it a measurement, whatever its size.
UNITS = (
    r"(?:ns|us|µs|ms|s|min|h|[KMGT]i?B(?:/s)?|[KMGT]B/s|MHz|GHz|%|x|×|"
    r"bits?|bytes?|kernels?|launch(?:es)?|ops)"
)
NUMBER = re.compile(
    r"(?<![\w.,^/*+=#])(?<![A-Za-z_]-)"  # not inside a word, path, version, exponent or #123
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"(?![\w.]*\d)(?P<unit>\s?" + UNITS + r"(?![\w/]))?"
    r"(?![\w(])"  # not followed by a letter (yolo26n, 3rd) or a call
)
# Contexts whose numbers are names or definitions (each group: the words before the number).
NAMING = re.compile(
    r"(?:@|\b(?:notebooks?|cells?|sections?|exercises?|issues?|PRs?|pytorch|algorithm|"
    r"step|part|lesson|table|figure|rows?|column|v|versions?|torch|Python|CUDA|"
    r"timm|ultralytics|ultralytics-thop|thop|Lightning|accelerate|jupytext|safetensors|ema-pytorch|"
    r"diffusers|numpy|torchvision|nbval|nbmake|pytest|JupyterLab|playwright|chromium|ema_lab|NeMo|"
    r"driver|Debian))\s?$|(?:>=|<=|==|<|>)\s?$",
    re.IGNORECASE,
)
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:?\d{2}(?::?\d{2})?Z?)?\b|\b\d{1,2}:\d{2}(?::\d{2})?\b")
VERSION = re.compile(r"\b\d+\.\d+\.\d+[\w.+-]*|\b\d+\.\d+\+\w+")  # 2.13.0, 0.1.1.post22, 2.11+cu130
YEAR = re.compile(r"^20[1-3]\d$")


def normal(text: str) -> Decimal | None:
    """``1,799`` -> 1799, ``0.30`` -> 0.30 (precision kept), ``4.4e-02`` -> 0.044; None if no number."""
    try:
        return abs(Decimal(text.replace(",", "")))
    except InvalidOperation:
        return None


def matches(stated: Decimal, found: Decimal) -> bool:
    """Whether ``found`` rounds to ``stated`` at its last digit; a one-digit number only if equal."""
    if found == stated:
        return True
    sign, digits, exponent = stated.as_tuple()
    if len(digits) < 2:
        return False  # "4x" is not any 3.5-4.49 printed somewhere: too wide a window
    try:
        return found.quantize(Decimal(1).scaleb(exponent)) == stated
    except InvalidOperation:
        return False


FOUND = re.compile(r"\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def found_numbers(text: str) -> set[Decimal]:
    """Every number in a backing text: with separators read both ways (1,799 and 1 and 799)."""
    found = {normal(m) for m in FOUND.findall(text)}
    found |= {normal(m) for m in re.findall(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text)}
    return {n for n in found if n is not None}


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"(?:(?<=\n\n)|^)(?:(?: {4}|\t)[^\n]*\n?)+")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK_TARGET = re.compile(r"\]\(([^)\s]*)[^)]*\)")
URL = re.compile(r"https?://\S+")
MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.DOTALL)
HTML = re.compile(r"<!--.*?-->|<[^>\n]+>", re.DOTALL)
PATHLIKE = re.compile(
    r"(?<!\S)(?![KMGT]i?B/s\b)\S*[/\\]\S*|\S+\.(?:py|md|json|png|svg|log|txt|ipynb|pt|toml|yml|cfg)\b"
)
ENUMERATOR = re.compile(r"^(\s*)(?:#+\s*)?\d+\s?[.)·]\s", re.MULTILINE)  # "1. ", "## 2) ", "# 01 · "
POWER = re.compile(r"\d+(?:\.\d+)?\s?(?:\^|\*\*)\s?[-+]?\d+(?:\.\d+)?|\d+\s?/\s?\d+")


def prose(markdown: str) -> str:
    """The sentences of a markdown text: code, links' targets, URLs, math, HTML tags and paths removed."""
    text = FENCE.sub(" ", markdown)
    text = INDENTED.sub(" ", text)
    text = CODE_SPAN.sub(" ", text)
    text = LINK_TARGET.sub("]", text)
    text = URL.sub(" ", text)
    text = MATH.sub(" ", text)
    text = HTML.sub(" ", text)
    text = ENUMERATOR.sub(r"\1", text)
    text = DATE.sub(" ", text)
    text = VERSION.sub(" ", text)
    text = PATHLIKE.sub(" ", text)
    text = POWER.sub(" ", text)
    return text


def stated_numbers(markdown: str) -> list[tuple[str, str]]:
    """(number as written, its sentence's surroundings) for every number the text states."""
    text = prose(markdown)
    stated = []
    for m in NUMBER.finditer(text):
        num, unit = m["num"], m["unit"]
        digits = num.replace(",", "")
        before = text[max(0, m.start() - 30) : m.start()]
        if NAMING.search(before) and not unit:
            continue
        if YEAR.match(digits) and not unit:
            continue
        simple = "." not in num and "," not in num and "e" not in num.lower()
        if simple and len(digits) < 2 and not unit:
            continue  # a one-digit count in prose
        if (f"{digits} {unit.strip()}" if unit else digits) in DEFINITIONS:
            continue
        context = " ".join(text[max(0, m.start() - 50) : m.end() + 30].split())
        stated.append((num, context))
    return stated


# --- where the backing numbers come from ------------------------------------------------------------------

REF = re.compile(r"(?:\.\./)*(?:docs/)?results/[\w.+{},/-]*|(?:\.\.\.)?[\w.+-]+\.(?:json|md|log|txt|ipynb)\b")


def _expand(ref: str) -> list[str]:
    """``a-{x,y}.md`` -> ``a-x.md``, ``a-y.md``."""
    m = re.search(r"\{([^}]*)\}", ref)
    if not m:
        return [ref]
    return [x for part in m[1].split(",") for x in _expand(ref[: m.start()] + part + ref[m.end() :])]


@functools.cache
def _all_results_files() -> tuple[Path, ...]:
    """The results files git tracks (a reader's own runs back nothing); every file where git cannot say."""
    tops = [str(top.relative_to(ROOT)) for top in RESULTS]
    listed = subprocess.run(["git", "ls-files", "-z", *tops], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return tuple(ROOT / name for name in listed.stdout.split("\0") if name)
    return tuple(p for top in RESULTS for p in top.rglob("*") if p.is_file())


def linked_files(markdown: str, where: Path) -> set[Path]:
    """The committed results files a text links or names: by path, by a run's folder, or by file name."""
    files: set[Path] = set()
    everything = _all_results_files()
    candidates = LINK_TARGET.findall(markdown) + REF.findall(markdown)
    for ref in candidates:
        for one in _expand(ref.split("#")[0]):
            if not one:
                continue
            for base in (where, ROOT):
                path = (base / one).resolve()
                if path in everything:
                    files.add(path)
                elif path.is_dir() and any(top in path.parents for top in RESULTS):  # a run's folder
                    files |= {p for p in everything if p.parent == path}
            name = one.rsplit("/", 1)[-1]
            if name.startswith("..."):
                files |= {p for p in everything if p.name.endswith(name[3:])}
            elif "." in name:
                files |= {p for p in everything if p.name == name}
    return {p for p in files if p.suffix != ".png"}


MENTION = re.compile(r"\bnotebooks?((?:[\s,]+(?:and\s+)?\d{2}\b)+)", re.IGNORECASE)


def linked_notebooks(markdown: str) -> set[Path]:
    """The notebooks a text links (``05_name.ipynb``) or names (``notebook 05``, ``notebooks 01 and 04``)."""
    numbers = set(re.findall(r"\b(\d{2})_\w+\.ipynb", markdown))
    numbers |= {n for m in MENTION.finditer(markdown) for n in re.findall(r"\d{2}", m[1])}
    return {p for p in NOTEBOOKS if p.name[:2] in numbers}


@functools.cache
def file_numbers(path: Path) -> frozenset[Decimal]:
    """The numbers a committed file backs: a notebook's outputs, any other file's whole text."""
    text = path.read_text(errors="replace")
    return frozenset(found_numbers(output_text(json.loads(text)) if path.suffix == ".ipynb" else text))


def backing(markdown: str, where: Path) -> set[Decimal]:
    """Every number in the results files and notebooks' outputs that a text links or names."""
    files = linked_files(markdown, where) | linked_notebooks(markdown)
    return {n for f in files for n in file_numbers(f)}


# --- notebooks -----------------------------------------------------------------------------------------


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def output_text(nb: dict) -> str:
    """The text of every code cell's outputs: streams and results' text/plain (images are not read)."""
    parts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            parts.append("".join(text) if isinstance(text, list) else text)
    return "\n".join(parts)


def _solution_code() -> re.Pattern:
    """notebooks/conftest.py's pattern of a solution's code: what nbval's run puts in its exercise cell."""
    spec = importlib.util.spec_from_file_location("nb_conftest_numbers", ROOT / "notebooks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOLUTION_CODE


SOLUTION_CODE = _solution_code()


def code_text(nb: dict) -> str:
    """The notebook's code, comments left out: the numbers it sets (sizes, rounds, steps) are definitions.

    The code of each exercise's solution (the ```python block of its ``<details>`` cell) counts too: it is
    code the notebook runs (nbval's run puts it into the exercise cell, notebooks/conftest.py) and the
    reader runs, so a literal there (``every=500``, ``make(2000, total=2000 * 136)``) is a size the exercise
    sets, like one in a code cell. What a solution prints is committed nowhere: it backs nothing.
    """
    sources = [_source(c) for c in nb["cells"] if c["cell_type"] == "code"]
    sources += [
        code
        for c in nb["cells"]
        if c["cell_type"] == "markdown"
        for _, code in SOLUTION_CODE.findall(_source(c))
    ]
    lines = [line for source in sources for line in source.splitlines()]
    return "\n".join(line.split("#")[0] for line in lines)


def unbacked_in_notebook(path: Path, nb: dict | None = None) -> list[str]:
    """'cell N: number (its surroundings)' for each number a markdown cell states that nothing backs.

    ``nb``: the notebook's JSON, if not the file's (a test plants a stale number in a copy).
    """
    nb = json.loads(path.read_text()) if nb is None else nb
    own = found_numbers(output_text(nb)) | found_numbers(code_text(nb))
    missing = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        source = _source(cell)
        pool = own | backing(source, path.parent)
        for num, context in stated_numbers(source):
            if not any(matches(normal(num), n) for n in pool):
                missing.append(f"cell {i}: {num} ({context})")
    return missing


# --- README.md and docs/*.md -----------------------------------------------------------------------------

HEADING = re.compile(r"^#{1,6} ", re.MULTILINE)


def sections(markdown: str) -> list[str]:
    """The text from each heading to the next (the first: before any heading), code blocks kept whole."""
    fences = [(m.start(), m.end()) for m in FENCE.finditer(markdown)]
    starts = [0] + [
        m.start() for m in HEADING.finditer(markdown) if not any(a < m.start() < b for a, b in fences)
    ]
    return [markdown[a:b] for a, b in zip(starts, [*starts[1:], len(markdown)])]


def unbacked_in_doc(path: Path, text: str | None = None) -> list[str]:
    """'heading: number (its surroundings)' for each number a section states that nothing backs."""
    missing = []
    for section in sections(path.read_text() if text is None else text):
        pool = backing(section, path.parent)
        pool |= {n for m in FENCE.finditer(section) for n in found_numbers(m[0])}
        title = section.splitlines()[0] if section.startswith("#") else "(top)"
        for num, context in stated_numbers(section):
            if not any(matches(normal(num), n) for n in pool):
                missing.append(f"{title}: {num} ({context})")
    return missing


# --- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_number_in_a_notebook_is_printed_or_linked(path: Path) -> None:
    missing = unbacked_in_notebook(path)
    assert not missing, f"{path.name}: numbers that no output, code or linked file holds:\n" + "\n".join(
        missing
    )


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_in_the_docs_stands_in_a_linked_results_file(path: Path) -> None:
    missing = unbacked_in_doc(path)
    assert not missing, (
        f"{path.relative_to(ROOT)}: numbers that no file linked in their section holds:\n"
        + "\n".join(missing)
    )


def _stale(stated: str, pool: set[Decimal]) -> str:
    """A number written like ``stated`` (same decimals) that nothing in ``pool`` backs: a stale edit."""
    value = normal(stated)
    for factor in range(2, 100):
        candidate = value * factor + Decimal(1).scaleb(value.as_tuple().exponent) * 7
        if not any(matches(candidate, n) for n in pool):
            return str(candidate)
    raise AssertionError(f"no stale stand-in for {stated}")


def test_a_stale_number_planted_in_a_notebook_cell_is_caught() -> None:
    """Each notebook: a backed number of its markdown (a decimal if any), changed to one nothing holds."""
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        before = unbacked_in_notebook(path, nb)
        backed = [
            (i, n)
            for i, cell in enumerate(nb["cells"])
            if cell["cell_type"] == "markdown"
            for n, _ in stated_numbers(_source(cell))
            if not any(line.startswith(f"cell {i}: {n} ") for line in before)
        ]
        assert backed, f"{path.name}: no backed number to change"
        i, number = min(backed, key=lambda b: "." not in b[1])  # the first decimal, else the first
        cell = nb["cells"][i]
        pool = (
            found_numbers(output_text(nb))
            | found_numbers(code_text(nb))
            | backing(_source(cell), path.parent)
        )
        stale = _stale(number, pool)
        cell["source"] = re.sub(rf"(?<![\d.,]){re.escape(number)}(?![\d])", stale, _source(cell), count=1)
        after = unbacked_in_notebook(path, nb)
        assert [line for line in after if line not in before and line.startswith(f"cell {i}: {stale} ")], (
            path.name,
            i,
            number,
            stale,
        )


def test_a_solutions_code_backs_the_sizes_its_exercise_sets() -> None:
    """A literal of a solution's code backs its exercise's text; its comments, and what it prints, do not."""
    solution = (
        "<details><summary>Solution 1</summary>\n\n```python\nprint(fit(every=500))  # not 250\n```\n\n"
        "It prints 34 errors.\n\n</details>"
    )
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": "**Exercise 1.** Snapshots every 500 steps. *Predict* it."},
            {"cell_type": "code", "source": "# Exercise 1: your code here", "outputs": []},
            {"cell_type": "markdown", "source": solution},
        ]
    }
    path = ROOT / "notebooks" / "lesson.ipynb"
    assert [line.split(" (")[0] for line in unbacked_in_notebook(path, nb)] == ["cell 2: 34"]
    nb["cells"][0]["source"] = nb["cells"][0]["source"].replace("500", "250")
    assert [line.split(" (")[0] for line in unbacked_in_notebook(path, nb)] == ["cell 0: 250", "cell 2: 34"]


def test_a_stale_number_planted_in_the_docs_is_caught() -> None:
    """README's first backed figure, and one in docs/benchmarks.md, each changed to one no file holds."""
    for path in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md"):
        text = path.read_text()
        for section in sections(text):
            backed = [n for n, _ in stated_numbers(section) if "." in n]
            if backed:
                pool = backing(section, path.parent) | found_numbers(section)
                stale = _stale(backed[0], pool)
                changed = section.replace(backed[0], stale, 1)
                assert unbacked_in_doc(path, text) == []
                found = unbacked_in_doc(path, text.replace(section, changed, 1))
                assert any(f": {stale} (" in line for line in found), (path.name, backed[0], stale, found)
                break


@pytest.mark.parametrize(
    ("markdown", "stated"),
    [
        ("took 0.296 ms, 1.5x the floor, 4.4e-02 apart", ["0.296", "1.5", "4.4e-02"]),
        ("watches 1,416 slots; 64 share one launch; 3 lines, 8 kernels, 4x", ["1,416", "64", "8", "4"]),
        ("1.3-1.5 ms and 10-50 %", ["1.3", "1.5", "10", "50"]),
        ("torch 2.13.0, torch 2.11+cu130, Python 3.12, 2026-12-04T15:44Z, in 2025", []),
        ("notebook 05, cell 16, issue 29, PR #25315, Exercise 12, section 3, step 1000", []),
        ("`decay=0.85`, [a 0.7 link](results/x-0.5.json), 2^18 and 1/12, yolo26n, H200, bf16, 3rd", ["0.7"]),
        ("## 1. Same numbers\n\n1. first item at 12 ms", ["12"]),
        ("the default 0.9999, the H200's 4.8 TB/s, and 4.8 ms", ["4.8"]),
    ],
)
def test_what_counts_as_a_stated_number(markdown: str, stated: list[str]) -> None:
    assert [n for n, _ in stated_numbers(markdown)] == stated


@pytest.mark.parametrize(
    ("stated", "found", "expected"),
    [
        ("0.296", "0.29612", True),
        ("0.30", "0.3", True),
        ("1,799", "1799", True),
        ("78", "78.39", True),
        ("2.2e-7", "2.24e-07", True),
        ("0.296", "0.2966", False),
        ("4", "3.8", False),
        ("0.3", "0.296", False),
        ("1416", "1,417", False),
    ],
)
def test_how_a_found_number_backs_a_stated_one(stated: str, found: str, expected: bool) -> None:
    assert matches(normal(stated), normal(found)) is expected
