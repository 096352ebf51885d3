"""The lessons stay short and written for the learner (issue 23): word limits, no developer talk, no stderr.

Words are counted in markdown cells of the committed ``.ipynb`` (the same cells as the jupytext ``.py``,
see test_notebooks.py), with link targets and HTML tags left out. Text inside a ``<details>`` block is an
expert aside: it is left out of the per-cell limit and the median, and counted in the notebook's total.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))

MAX_CELL_WORDS = 150  # a cell says one thing; more is a section or an aside
MAX_MEDIAN_WORDS = 60  # (exclusive) the reference chapters' median cell is 16-26 words
MAX_NOTEBOOK_WORDS = 1500  # (exclusive) one sitting, with time to run and change the cells
MAX_TAKEAWAYS = 3

# Talk meant for the people who build ema_lab, never for the reader (case-sensitive where an
# ordinary word would match otherwise).
DEVELOPER_TERMS = {
    "CI": re.compile(r"\bCI\b"),
    "load average": re.compile(r"load average", re.IGNORECASE),
    "nbval": re.compile(r"nbval", re.IGNORECASE),
    "tests/": re.compile(r"\btests/"),
    "this machine": re.compile(r"this machine", re.IGNORECASE),
    "NBVAL_ marker": re.compile(r"NBVAL_"),
    "git revision": re.compile(
        r"\b(?:git revision|commit [0-9a-f]{7,40})\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
    ),
}

DETAILS = re.compile(r"<details>.*?</details>", re.DOTALL)
LINK_TARGET = re.compile(r"\]\([^)]*\)")  # the (url) of [text](url) and ![alt](path)
HTML_TAG = re.compile(r"<[^>]+>")
WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")


def words(text: str) -> int:
    """Words a reader reads in ``text`` (markdown): link targets and HTML tags are not words."""
    return len(WORD.findall(HTML_TAG.sub(" ", LINK_TARGET.sub("]", text))))


def markdown_cells(nb: nbformat.NotebookNode) -> list[str]:
    """The source of every markdown cell, in order."""
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def read(path: Path) -> nbformat.NotebookNode:
    """The committed notebook."""
    return nbformat.read(path, as_version=4)


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def notebook(request: pytest.FixtureRequest) -> tuple[str, nbformat.NotebookNode]:
    """(name, committed notebook) of each lesson."""
    return request.param.stem, read(request.param)


def test_all_six_lessons_are_checked() -> None:
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_", "06_"]


def test_no_markdown_cell_is_over_the_limit(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    name, nb = notebook
    long = [
        (i, words(DETAILS.sub(" ", c.source)))
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and words(DETAILS.sub(" ", c.source)) > MAX_CELL_WORDS
    ]
    assert not long, f"{name}: markdown cells over {MAX_CELL_WORDS} words (cell index, words): {long}"


def test_the_median_markdown_cell_is_short(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    name, nb = notebook
    median = statistics.median(words(DETAILS.sub(" ", s)) for s in markdown_cells(nb))
    assert median < MAX_MEDIAN_WORDS, f"{name}: median markdown cell is {median} words"


def test_the_notebook_reads_in_one_sitting(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    name, nb = notebook
    total = sum(words(s) for s in markdown_cells(nb))
    assert total < MAX_NOTEBOOK_WORDS, f"{name}: {total} words of markdown"


def test_no_developer_talk(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    """Markdown and code comments (what the reader reads) name no CI, test files, revisions, markers."""
    name, nb = notebook
    found = []
    for i, cell in enumerate(nb.cells):
        text = cell.source
        if cell.cell_type == "code":  # the comments, and any marker comment nbval would read
            text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
        found += [(i, term) for term, pattern in DEVELOPER_TERMS.items() if pattern.search(text)]
    assert not found, f"{name}: developer talk (cell index, term): {found}"


def test_no_stderr_in_committed_outputs(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    name, nb = notebook
    stderr = [
        (i, o.text[:80])
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream" and o.name == "stderr"
    ]
    assert not stderr, f"{name}: stderr in committed outputs (cell index, start): {stderr}"


def test_it_opens_fast(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    """A title, at most three one-line take-aways, and a code cell within the first three cells."""
    name, nb = notebook
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{name}: the first cell is not the title"
    lines = [line for line in first.source.splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"{name}: the first cell does not start with a '# ' title"
    takeaways = lines[1:]
    assert len(takeaways) <= MAX_TAKEAWAYS, f"{name}: {len(takeaways)} lines after the title, want <= 3"
    not_bullets = [t for t in takeaways if not re.match(r"(?:[-*]|\d+\.)\s", t)]
    assert not not_bullets, f"{name}: after the title only one-line take-aways, found {not_bullets}"
    assert any(c.cell_type == "code" for c in nb.cells[:3]), f"{name}: no code cell in the first three"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("# Title\n\nTwo `words`.", 3),
        ("See [the PR](https://github.com/x/y/pull/1) and ![a figure](figures/a.svg).", 6),
        ("<details><summary>Why</summary>\n\nBecause.\n</details>", 2),
        ("d(n) = decay * (1 - exp(-n / tau))", 7),
    ],
)
def test_words_counts_what_a_reader_reads(text: str, expected: int) -> None:
    assert words(text) == expected


def test_developer_terms_catch_what_they_should_and_not_ordinary_words() -> None:
    samples = {
        "CI": "as measured on CI",
        "load average": "a load average near 4",
        "nbval": "under nbval",
        "tests/": "asserted in tests/test_training.py",
        "this machine": "on this machine",
        "NBVAL_ marker": "# NBVAL_IGNORE_OUTPUT",
        "git revision": "ema_lab 0.1.0 (daa5a08)",
    }
    assert {t: bool(DEVELOPER_TERMS[t].search(s)) for t, s in samples.items()} == dict.fromkeys(samples, True)
    ordinary = "Circle, CIFAR, your machine, a decade, 1e-6, 2^18 numbers, 0.999900, defaced, 1234567"
    assert [t for t, p in DEVELOPER_TERMS.items() if p.search(ordinary)] == []
