"""The lessons stay short and written for the learner (issue 23): word limits, no developer talk, no stderr.

Words are counted in markdown cells of the committed ``.ipynb`` (the same cells as the jupytext ``.py``,
see test_notebooks.py), with link targets and HTML tags left out. Text inside a ``<details>`` block is an
expert aside: it is left out of the per-cell limit and the median, and counted in the notebook's total.
"""

from __future__ import annotations

import ast
import re
import statistics
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (the notebooks extra)")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))

MAX_CELL_WORDS = 150  # a cell says one thing; more is a section or an aside
MAX_MEDIAN_WORDS = 60  # (exclusive) the reference chapters' median cell is 16-26 words
MAX_NOTEBOOK_WORDS = 1500  # (exclusive) one sitting, with time to run and change the cells
MAX_TAKEAWAYS = 3
MAX_HEADER_WORDS = 100  # (exclusive) the first markdown cell: a title and three one-line take-aways
# One sitting, one story (issue 56): a notebook keeps to MAX_SECTIONS main sections (every "## " heading,
# summary and exercises included) or to MAX_CELLS cells in all; a side topic goes into <details> or docs/.
MAX_SECTIONS = 6
MAX_CELLS = 40
MAX_EMA_LAB_NAMES = 8  # names imported from ema_lab in visible (code) cells: few new names to learn
# The one header under "## Exercises", the same in every lesson:
EXERCISE_HEADER = (
    "Try each exercise in the empty cell below it before you open its solution; "
    "to run a solution, paste it into that cell."
)
FIGURE = re.compile(r"!\[[^\]]*\]\((figures/[^)]+\.svg)\)")  # a diagram committed beside the notebooks
MAX_NAMES_BEFORE_PACKAGING = 3  # the learner builds the idea before meeting ema_lab's version of it
# The cell that introduces the packaged version says so in its markdown: "`x` is this, packaged",
# "`x` packages it".
PACKAGING = re.compile(r"\bpackag(?:ed|es)\b", re.IGNORECASE)

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


def test_all_seven_lessons_are_checked() -> None:
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_", "06_", "07_"]


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


def test_the_header_is_short(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    name, nb = notebook
    header = words(markdown_cells(nb)[0])
    assert header < MAX_HEADER_WORDS, f"{name}: the header (first markdown cell) is {header} words"


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


def ema_lab_names(source: str) -> list[str]:
    """Names a code cell imports from ema_lab: ``from ema_lab.x import a, b`` -> a, b; ``import ema_lab``."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ema_lab":
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.split(".")[0] == "ema_lab"]
    return names


def names_before_packaging(nb: nbformat.NotebookNode) -> tuple[int | None, list[str]]:
    """(index of the first markdown cell that says "packaged"/"packages", ema_lab names imported before it).

    Without such a cell every name imported in the notebook counts.
    """
    names: list[str] = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and PACKAGING.search(DETAILS.sub(" ", cell.source)):
            return i, names
        if cell.cell_type == "code":
            names += [n for n in ema_lab_names(cell.source) if n not in names]
    return None, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_lesson_builds_before_it_imports(path: Path) -> None:
    """At most three ema_lab names are imported before the first cell that says what ema_lab packages."""
    at, names = names_before_packaging(read(path))
    assert at is not None, (
        f"{path.stem}: no markdown cell says which ema_lab function packages what was built"
    )
    assert len(names) <= MAX_NAMES_BEFORE_PACKAGING, (
        f"{path.stem}: {len(names)} ema_lab names imported before the packaging cell (index {at}): {names}"
    )


def test_one_story_with_a_diagram(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    """At most MAX_SECTIONS "## " sections or at most MAX_CELLS cells, and a diagram that exists."""
    name, nb = notebook
    text = "\n".join(markdown_cells(nb))
    sections = len(re.findall(r"^## ", text, re.MULTILINE))
    assert sections <= MAX_SECTIONS or len(nb.cells) <= MAX_CELLS, (
        f"{name}: {sections} sections (max {MAX_SECTIONS}) and {len(nb.cells)} cells (max {MAX_CELLS})"
    )
    figures = FIGURE.findall(text)
    assert figures, f"{name}: no diagram (![...](figures/....svg)) in its markdown"
    missing = [f for f in figures if not (NOTEBOOKS[0].parent / f).is_file()]
    assert not missing, f"{name}: {missing} not in notebooks/figures/"


def test_few_ema_lab_names(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    """The code cells import at most MAX_EMA_LAB_NAMES names from ema_lab (solutions are not counted)."""
    name, nb = notebook
    names = sorted({n for c in nb.cells if c.cell_type == "code" for n in ema_lab_names(c.source)})
    assert len(names) <= MAX_EMA_LAB_NAMES, f"{name}: {len(names)} ema_lab names imported: {names}"


def test_one_exercise_header(notebook: tuple[str, nbformat.NotebookNode]) -> None:
    """One "## Exercises" cell, and the same header under it in every lesson."""
    name, nb = notebook
    heads = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Exercises")]
    assert len(heads) == 1, f"{name}: {len(heads)} '## Exercises' cells"
    header = " ".join(heads[0].removeprefix("## Exercises").strip().split("\n\n")[0].split())
    assert header == EXERCISE_HEADER, f"{name}: the exercise header is {header!r}"


def test_names_before_packaging_counts_imports_until_the_marker() -> None:
    cells = [
        nbformat.v4.new_code_cell(
            "%matplotlib inline\nimport ema_lab\nfrom ema_lab.bench import models, seed"
        ),
        nbformat.v4.new_code_cell("from ema_lab.bench import models\nimport torch"),
        nbformat.v4.new_markdown_cell("`ema_lab.bench.count_ops` is this counter, packaged."),
        nbformat.v4.new_code_cell("from ema_lab import ModelEMA"),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    assert names_before_packaging(nb) == (2, ["ema_lab", "models", "seed"])
    nb.cells[2] = nbformat.v4.new_markdown_cell("<details>ema_lab packages it</details> not here")
    assert names_before_packaging(nb) == (None, ["ema_lab", "models", "seed", "ModelEMA"])


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
