"""nbval glue for `pytest notebooks --nbval`: import path, kernel environment, stderr not compared."""

import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "ema_lab").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from ema_lab.notebooks import drop_stderr_from_comparison, kernel_env  # noqa: E402

# nbval starts each notebook's kernel with this process's environment: give it `import ema_lab`.
os.environ["PYTHONPATH"] = kernel_env()["PYTHONPATH"]


def pytest_collection_modifyitems(items: list) -> None:
    """Compare every notebook cell without its stderr (torch.profiler's USDT lines, warnings)."""
    drop_stderr_from_comparison(items)
