"""nbval glue for `pytest notebooks --nbval`: compare every cell's outputs without its stderr, and run
every exercise cell with its solution's code in it, as a student would paste it
(tests/lessons/test_solutions.py).
"""

import copy
import re

EXERCISE_CELL = re.compile(r"# Exercise (\d+): your code here")
SOLUTION_CODE = re.compile(r"<details><summary>Solution (\d+)</summary>\n\n```python\n(.*?)\n```", re.DOTALL)


def without_stderr(outputs: list[dict]) -> list[dict]:
    """``outputs`` minus stderr stream outputs (torch.profiler's USDT lines on 2.13, warnings)."""
    return [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


def solution_code(nb) -> dict[str, str]:
    """{exercise number: the code of its solution}, from the ```python block of each Solution <details>."""
    return {
        n: code for c in nb.cells if c.cell_type == "markdown" for n, code in SOLUTION_CODE.findall(c.source)
    }


def pytest_collection_modifyitems(items: list) -> None:
    """Make every nbval cell item compare its outputs without stderr; give each exercise cell its solution.

    The exercise cells are committed empty: run with the solution in them, their outputs are not compared
    (they print what the student's machine prints), and the cells after them run after the solution, in
    the same kernel, as in the student's notebook.
    """
    for item in items:
        compare = getattr(item, "compare_outputs", None)
        if compare is None or not hasattr(item, "cell"):  # not an nbval IPyNbCell
            continue
        exercise = EXERCISE_CELL.fullmatch(item.cell.source.strip())
        code = exercise and solution_code(item.parent.nb).get(exercise[1])
        if code:
            item.cell = copy.deepcopy(item.cell)
            item.cell.source = code
            item.options["check"] = False  # nbval's options: a defaultdict(bool) of this one cell

        def compare_without_stderr(test, ref, skip_compare=None, _compare=compare):
            return _compare(without_stderr(test), without_stderr(ref), skip_compare)

        item.compare_outputs = compare_without_stderr


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """The jupytext .py sources and execute.py are not test modules (their .ipynb pairs are checked).

    Elsewhere no opinion (None): a False would override pytest's own rules, and nbval would collect the
    lab's .ipynb_checkpoints/ copies, which ``norecursedirs`` (``.*``) leaves out.
    """
    if collection_path.suffix == ".py" and collection_path.name != "conftest.py":
        return True
    return None
