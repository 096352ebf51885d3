"""A skip names its true cause: a package that is not installed is not a torch that lacks an API."""

from __future__ import annotations

import importlib

import pytest
import torch

from ema_lab.lessons import distributed


def _without_numpy(real):
    """import_module as in a venv without numpy: CommDebugMode's module fails on its import."""

    def import_module(name, *args):
        if name == "torch.distributed.tensor.debug":
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real(name, *args)

    return import_module


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed")
def test_a_missing_package_is_named_as_not_installed(monkeypatch, capsys) -> None:
    monkeypatch.setattr(importlib, "import_module", _without_numpy(importlib.import_module))
    monkeypatch.setattr(distributed, "FSDP2_CPU_MIN", "2.0")
    assert distributed.main(["--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "skipped: numpy (not installed; torch.distributed.tensor.debug imports it)\n" in out
    assert "lacks" not in out


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed")
def test_a_missing_package_and_a_missing_api_are_both_named(monkeypatch, capsys) -> None:
    monkeypatch.setattr(importlib, "import_module", _without_numpy(importlib.import_module))
    monkeypatch.setattr(distributed, "FSDP2_CPU_MIN", "2.0")
    monkeypatch.setattr(distributed, "REQUIRED_APIS", (*distributed.REQUIRED_APIS, ("torch", "no_such_api")))
    assert distributed.main(["--world-size", "2"]) == 0
    assert (
        f"skipped: this torch ({torch.__version__}) lacks torch.no_such_api; "
        "numpy (not installed; torch.distributed.tensor.debug imports it)\n"
    ) in capsys.readouterr().out
