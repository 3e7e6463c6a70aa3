import pytest
import torch

from laminae.primitives import BackendUnavailableError, ConfigError, resolve_backend


def test_reference_always_allowed():
    assert resolve_backend("reference", torch.zeros(1)) == "reference"


def test_auto_uses_reference_on_cpu():
    assert resolve_backend("auto", torch.zeros(1)) == "reference"


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.zeros(1)) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.zeros(1))


def test_unknown_backend_is_rejected():
    with pytest.raises(ConfigError, match="backend"):
        resolve_backend("cuda", torch.zeros(1))
