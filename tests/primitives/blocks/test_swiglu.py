import torch
import torch.nn.functional as F

from laminae.primitives.blocks.swiglu import SwiGLU


def test_swiglu_formula_and_divisor():
    mlp = SwiGLU(6, 10, output_divisor=2.0)
    x = torch.randn(3, 6)
    want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)) / 2
    torch.testing.assert_close(mlp(x), want)
