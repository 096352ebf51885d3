"""The foreach gate as a pure function of (torch version, device type): every branch."""

import pytest
import torch

from ema_lab.gates import foreach_lerp_supported, parse_version


@pytest.mark.parametrize(
    ("version", "device", "expected"),
    [
        ("1.13.1", "cpu", False),  # no torch._foreach_lerp_ before 2.0
        ("1.13.1", "cuda", False),
        ("2.0.0", "cpu", True),
        ("2.0.1+cu118", "cuda", True),
        ("2.2.2", "mps", False),  # the PR gates MPS at 2.4
        ("2.3.1", "mps", False),
        ("2.4.0", "mps", True),
        ("2.4.0a0+git1234abc", "mps", True),  # a pre-release counts as its release
        ("2.13.0+cpu", "mps", True),
        ("2.0.0", "npu", False),  # Ascend NPU excluded by the later gate
        ("2.13.0", "npu", False),
        ("2.13.0", "xpu", True),
        ("10.0", "cpu", True),
    ],
)
def test_gate_table(version: str, device: str, expected: bool) -> None:
    assert foreach_lerp_supported(version, device) is expected


def test_parse_version() -> None:
    assert parse_version("2.13.0+cpu") == (2, 13)
    assert parse_version("v2.4.0a0") == (2, 4)
    with pytest.raises(ValueError, match="cannot parse torch version 'nightly'"):
        parse_version("nightly")


def test_default_version_is_installed_torch() -> None:
    assert foreach_lerp_supported(None, "cpu") is foreach_lerp_supported(torch.__version__, "cpu")
    assert foreach_lerp_supported(device_type="cpu") is True  # this project's CI runs torch >= 2.0
