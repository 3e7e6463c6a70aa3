"""laminae.primitives: each mechanism's nn.Module and its plain-PyTorch reference, and (in
blocks/) the generic building blocks models wire them with.

Importing this package never imports Triton; the kernels load lazily on first use
of ``backend="triton"`` (or "auto" on CUDA)."""
from ._backend import BACKENDS, resolve_backend, set_backend, use_backend
from ._cache import AppendBuffer, DecodingCache, KVCache
from ._outputs import BlockOutput
from ._errors import BackendUnavailableError, ConfigError, DeviceError, DTypeError, ShapeError, TokenIdError
from . import blocks
from ._mechanisms import MECHANISMS as _MECHANISMS
from .blocks import *  # noqa: F403 (the building blocks keep their own list)


def _import_mechanisms() -> list[str]:
    """Every declared name of every mechanism (primitives/_mechanisms.py), bound here."""
    from importlib import import_module

    names = []
    for mechanism in _MECHANISMS:
        module = import_module(f".{mechanism.stem}", __name__)
        globals().update({name: getattr(module, name) for name in mechanism.names})
        names += mechanism.names
    return names


__all__ = [
    "BACKENDS", "resolve_backend", "set_backend", "use_backend",
    "AppendBuffer", "BlockOutput", "DecodingCache", "KVCache",
    "BackendUnavailableError", "ConfigError", "DeviceError", "DTypeError", "ShapeError", "TokenIdError",
    *_import_mechanisms(),
    *blocks.__all__,
]
