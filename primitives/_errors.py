"""Errors raised for bad input. Each is a subclass of the built-in exception a
caller would expect (ValueError/TypeError/RuntimeError), so ``except ValueError``
keeps working, while tests and users can match the precise kind."""


class ShapeError(ValueError):
    """A tensor has the wrong rank or a size that does not match another input."""


class DTypeError(TypeError):
    """A tensor has a dtype the operation does not support."""


class DeviceError(ValueError):
    """Tensors that must live together are on different devices."""


class ConfigError(ValueError):
    """A constructor or functional argument is out of its valid range."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on these inputs (e.g. Triton on CPU
    without ``TRITON_INTERPRET=1``)."""


class TokenIdError(ConfigError, IndexError):
    """A token id lies outside ``[0, vocab_size)`` (raised only when the block's
    ``validate_ids`` is on; also an ``IndexError``, as ``nn.Embedding`` raises)."""
