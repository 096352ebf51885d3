"""Installed, not checked out: the wheel works from another folder, and the core needs torch alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout, installed with --no-deps into a folder outside it."""
    tmp = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(ROOT)], cwd=tmp)
    (wheel,) = (tmp / "dist").glob("ema_lab-*.whl")
    _run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)], cwd=tmp)
    return tmp / "site"


def _env(site: Path) -> dict[str, str]:
    # Only the installed copy is importable: not the checkout (no PYTHONPATH to it, cwd elsewhere).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return env


def test_the_installed_copy_is_the_one_imported(installed: Path, tmp_path: Path) -> None:
    code = "import ema_lab, ema_lab.bench, ema_lab.lessons; print(ema_lab.__file__)"
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env=_env(installed))
    assert Path(out.strip()).is_relative_to(installed)


def test_core_needs_torch_alone(installed: Path, tmp_path: Path) -> None:
    """``import ema_lab`` and a ModelEMA update with every extra's package made unimportable."""
    code = textwrap.dedent(
        """
        import sys
        blocked = ("numpy", "matplotlib", "tqdm", "thop", "jupyterlab", "jupytext", "nbformat", "IPython")

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in blocked:
                    raise ImportError(f"blocked in this test: {name}")

        import torch  # torch itself may use numpy if present; import it before blocking
        sys.meta_path.insert(0, Block())
        for name in list(sys.modules):
            if name.split(".")[0] in blocked:
                del sys.modules[name]
        import ema_lab
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        ema = ema_lab.ModelEMA(model)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ema.update(model)
        print(ema.updates, sorted(ema_lab.__all__))
        """
    )
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env=_env(installed))
    assert out.startswith("1 [")


def test_bench_demo_and_distributed_demo_run_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    env = _env(installed)
    bench = _run(
        [sys.executable, "-m", "ema_lab", "bench", "--quick", "--models", "tiny_tensors", "--no-progress",
         "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert "tiny_tensors" in bench and list((tmp_path / "out").glob("*.json"))
    demo = _run(
        [sys.executable, "-m", "ema_lab", "demo", "--model", "tiny_cnn", "--steps", "3"], tmp_path, env
    )
    assert "max |ema - float64 ref|" in demo
    dist = _run([sys.executable, "-m", "ema_lab.lessons.distributed", "--world-size", "2"], tmp_path, env)
    assert "result: OK" in dist
