"""nbval glue for `pytest notebooks --nbval`: compare every cell's outputs without its stderr."""


def without_stderr(outputs: list[dict]) -> list[dict]:
    """``outputs`` minus stderr stream outputs (torch.profiler's USDT lines on 2.13, warnings)."""
    return [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


def pytest_collection_modifyitems(items: list) -> None:
    """Make every nbval cell item compare its outputs without stderr."""
    for item in items:
        compare = getattr(item, "compare_outputs", None)
        if compare is None or not hasattr(item, "cell"):  # not an nbval IPyNbCell
            continue

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
