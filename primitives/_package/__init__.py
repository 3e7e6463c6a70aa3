"""laminae: research mechanisms for transformer language models.

``laminae.primitives`` (modules and references), ``laminae.triton_ops`` (kernels),
``laminae.recipes`` (model assemblies). This top-level package only carries the
version; it imports neither torch nor triton."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("laminae")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
