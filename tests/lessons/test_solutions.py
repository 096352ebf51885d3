"""Solutions out of sight until asked for, and every one of them runs (issue 46).

One format in every lesson: an exercise is a markdown cell ``**Exercise N.** ... *Predict* ...``, an empty
code cell ``# Exercise N: your code here``, and a markdown cell ``<details><summary>Solution N</summary>``
holding the code (a ```` ```python ```` block) and what it prints. No code cell holds a solution: a
repository browser shows every code cell and output, whatever JupyterLab's collapse metadata says.

The run costs no second run of the notebooks: nbval's own run (`dev.py test`, quick mode) puts every
solution's code into its exercise cell (notebooks/conftest.py), as a student would paste it after running
the notebook top to bottom, so any error in a solution fails that cell; its outputs are not compared.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (the notebooks extra)")

from ..helpers import load_file  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


# What nbval's run recognises as an exercise cell:
EXERCISE_CELL = load_file(NOTEBOOKS / "conftest.py", "nb_conftest").EXERCISE_CELL
EXERCISE = re.compile(r"^\*\*Exercise (\d+)\.\*\*", re.MULTILINE)
PREDICT = re.compile(r"\*[Pp]redict\*")
SOLUTION = re.compile(
    r"<details><summary>Solution (\d+)</summary>\n\n```python\n(.*?)\n```\n\n(.+?)\n\n</details>", re.DOTALL
)
SOLUTION_START = re.compile(r"<summary>\s*Solution")


def exercises(nb: nbformat.NotebookNode) -> list[tuple[int, int, int, str]]:
    """(number, index of the exercise's code cell, index of its solution cell, the solution's code)."""
    found = []
    for i, cell in enumerate(nb.cells):
        for n in EXERCISE.findall(cell.source if cell.cell_type == "markdown" else ""):
            code, answer = nb.cells[i + 1], nb.cells[i + 2]
            match = SOLUTION.fullmatch(answer.source.strip()) if answer.cell_type == "markdown" else None
            assert code.cell_type == "code" and EXERCISE_CELL.fullmatch(code.source.strip()), (
                f"cell {i + 1} after exercise {n} is not the empty cell '# Exercise {n}: your code here'"
            )
            assert match and match[1] == n, (
                f"cell {i + 2} after exercise {n} is not one '<details><summary>Solution {n}</summary>' "
                "block of a ```python code block, then what it prints, then </details>"
            )
            found.append((int(n), i + 1, i + 2, match[2]))
    return found


def lesson(path: Path) -> nbformat.NotebookNode:
    """The committed notebook, skipped while it is still in the old format."""
    return nbformat.read(path, as_version=4)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_every_exercise_has_one_hidden_solution(path: Path) -> None:
    """Exercises 1..N in order, each with a prediction, its empty cell and one <details> solution."""
    nb = lesson(path)
    found = exercises(nb)
    numbers = [n for n, *_ in found]
    assert found and numbers == list(range(1, len(found) + 1)), f"{path.stem}: exercises {numbers}"
    texts = [c.source for c in nb.cells if c.cell_type == "markdown" and EXERCISE.search(c.source)]
    assert all(PREDICT.search(t) for t in texts), f"{path.stem}: an exercise asks for no *predict*ion"
    summaries = [s for c in nb.cells for s in SOLUTION_START.findall(c.source)]
    assert len(summaries) == len(found), f"{path.stem}: {len(summaries)} solutions for {len(found)} exercises"
    for *_, code in found:
        ast.parse(code)  # what the student pastes is Python


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_no_code_cell_shows_a_solution(path: Path) -> None:
    """No code cell holds, folds or prints an answer; the exercise cells are empty and have no outputs."""
    nb = lesson(path)
    cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    shown = [i for i, c in cells if re.search(r"^# Solution", c.source, re.MULTILINE)]
    shown += [i for i, c in cells if "solution" in c.metadata.get("tags", []) or c.metadata.get("jupyter")]
    assert not shown, f"{path.stem}: code cells holding, folding or tagging a solution: {sorted(set(shown))}"
    filled = [i for _, i, _, _ in exercises(nb) if nb.cells[i].outputs]
    assert not filled, f"{path.stem}: exercise cells with committed outputs: {filled}"


def _exercise_notebook() -> nbformat.NotebookNode:
    """A committed notebook: a lesson cell; exercise 1, whose solution makes ``x`` 6 and prints, then a cell
    that prints ``x * 7`` (committed: 42); exercise 2, whose solution raises."""
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    after = code("print(x * 7)")
    after.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    solution = "<details><summary>Solution {}</summary>\n\n```python\n{}\n```\n\nIt prints {}.\n\n</details>"
    cells = [
        code("x = 5"),
        md("**Exercise 1.** Make `x` 6. *Predict* what the next cell prints."),
        code("# Exercise 1: your code here"),
        md(solution.format(1, "x = 3\nprint('anything: not compared')\nx *= 2", "42")),
        after,
        md("**Exercise 2.** Divide by zero. *Predict* the error."),
        code("# Exercise 2: your code here"),
        md(solution.format(2, "x = 1 / 0", "a ZeroDivisionError")),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for i, cell in enumerate(c for c in cells if c.cell_type == "code"):
        cell.execution_count = i + 1
    return nb


def test_nbvals_run_runs_every_solution_in_its_exercise_cell(tmp_path: Path) -> None:
    """End to end with the real conftest: the next cell sees what a solution did; one that raises fails."""
    shutil.copy(NOTEBOOKS / "conftest.py", tmp_path / "conftest.py")
    nbformat.write(_exercise_notebook(), tmp_path / "lesson.ipynb")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "--nbval",
         "--nbval-current-env", "-o", "addopts=", "lesson.ipynb"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "lesson.ipynb ...F" in out and "1 failed, 3 passed" in out, out  # cells 0-2 pass, cell 3 fails
    assert "FAILED lesson.ipynb::Cell 3 - " in out and "ZeroDivisionError" in out, out


def test_the_format_check_finds_what_it_should() -> None:
    """A solution in a code cell, a missing solution and an answer in the summary line are each caught."""
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    solution = "<details><summary>Solution {}</summary>\n\n```python\nprint(1 + 1)\n```\n\n2.\n\n</details>"
    good = [
        md("**Exercise 1.** Add. *Predict* the sum."),
        code("# Exercise 1: your code here"),
        md(solution.format(1)),
    ]
    assert exercises(nbformat.v4.new_notebook(cells=good)) == [(1, 1, 2, "print(1 + 1)")]
    for bad in (
        [good[0], code("# Solution 1\nprint(2)"), good[2]],
        [good[0], good[1], md(solution.format(2))],
        [good[0], good[1], md("<details><summary>Solution 1: it prints 2</summary>\n\n2\n</details>")],
    ):
        with pytest.raises(AssertionError):
            exercises(nbformat.v4.new_notebook(cells=bad))
