"""Instruments: op and kernel-launch counting, device-aware timing, the cost model and the bench sweep.

Needs the ``bench`` extra (numpy, matplotlib, tqdm). ``python -m ema_lab bench`` is :func:`run_bench`
plus :func:`write_results`; the modules beside this one hold the pieces (``counting``, ``timing``,
``costmodel``, ``roofline``, ``results``, ``plots``, ``environment``, ``demo``, ``cli``). ``roofline``
is named for the roofline idea (time against the best the memory allows); its ceiling is the floor,
one ``lerp_`` over two flat buffers of the same elements, not a bandwidth figure.
"""

from .sweep import DEFAULT_MODELS, compare, count_candidate_ops, run_bench, write_results

__all__ = ["DEFAULT_MODELS", "compare", "count_candidate_ops", "run_bench", "write_results"]
