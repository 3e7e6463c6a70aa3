"""What blocks return. A decoding block returns a NamedTuple whose first two fields are
``output, cache``; this one when it has nothing more to return. ``cache`` is None when
the call was given none (``cache=None`` means "no decoding")."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["BlockOutput"]


class BlockOutput(NamedTuple):
    output: torch.Tensor
    cache: Any = None
