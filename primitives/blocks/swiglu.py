"""SwiGLU MLP: ``down(silu(gate(x)) ⊙ up(x)) / output_divisor``.

Parameters (Llama/SpikeWhale names): ``gate_proj``, ``up_proj`` [I, H], ``down_proj``
[H, I], no biases. ``output_divisor`` (ShellElastic's e) defaults to 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_positive_float, check_positive_int

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """``x`` [..., hidden_size] → [..., hidden_size].

    Args:
        hidden_size: H.
        intermediate_size: I.
        output_divisor: the output is divided by it (1 = plain SwiGLU).
        initializer_range: std of the N(0, σ²) weight init; None keeps nn.Linear's default.

    Example::

        mlp = SwiGLU(512, 1408)
        y = mlp(x)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, output_divisor: float = 1.0,
                 initializer_range: float | None = None) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("intermediate_size", intermediate_size)
        check_positive_float("output_divisor", output_divisor)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.output_divisor = float(output_divisor)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        if initializer_range is not None:
            for lin in (self.gate_proj, self.up_proj, self.down_proj):
                nn.init.normal_(lin.weight, std=initializer_range)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, " \
               f"output_divisor={self.output_divisor}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y if self.output_divisor == 1.0 else y / self.output_divisor
