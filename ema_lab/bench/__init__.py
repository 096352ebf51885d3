"""Instruments: op and kernel-launch counting, device-aware timing, the cost model and the bench sweep.

Needs the ``bench`` extra (numpy, matplotlib, tqdm). ``python -m ema_lab bench`` is :func:`run_bench`
plus :func:`write_results`; the modules beside this one hold the pieces (``counting``, ``timing``,
``costmodel``, ``results``, ``plots``, ``environment``, ``demo``, ``cli``), the model zoo (``models``),
the PR's own before- and after-code (``seed``) and a float64 reference (``reference``).
"""

__all__ = ["DEFAULT_MODELS", "compare", "run_bench", "write_results"]


def __getattr__(name: str) -> object:
    # The sweep (numpy, matplotlib) loads on first use: ``ema_lab.bench.counting`` needs torch alone.
    if name in __all__:
        from . import sweep

        return getattr(sweep, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
