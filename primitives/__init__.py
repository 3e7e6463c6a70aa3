"""laminae.primitives: each mechanism's nn.Module and its plain-PyTorch reference.

Importing this package never imports Triton; the kernels load lazily on first use
of ``backend="triton"`` (or "auto" on CUDA)."""
from ._backend import BACKENDS, resolve_backend
from ._errors import BackendUnavailableError, ConfigError, DeviceError, DTypeError, ShapeError
from .laurel import LAuReL, LAuReLBlock, laurel_reference

__all__ = [
    "BACKENDS", "resolve_backend",
    "BackendUnavailableError", "ConfigError", "DeviceError", "DTypeError", "ShapeError",
    "LAuReL", "LAuReLBlock", "laurel_reference",
]
