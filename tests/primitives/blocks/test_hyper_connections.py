import pytest
import torch

from laminae.primitives import ShapeError
from laminae.primitives.blocks.hyper_connections import HCOutputMix, HyperConnection, expand_streams


def test_read_write_and_output_mix_match_their_formulas():
    hc, mix = HyperConnection(3), HCOutputMix(3)
    with torch.no_grad():
        mix.weight.copy_(torch.tensor([0.5, -1.0, 2.0]))
    x = torch.randn(2, 3, 4, 5)
    pre, post, out = (torch.softmax(w, 0) for w in (hc.pre_weight, hc.post_weight, mix.weight))
    torch.testing.assert_close(hc.pre(x), torch.einsum("m,bmsh->bsh", pre, x))
    delta = torch.randn(2, 4, 5)
    torch.testing.assert_close(hc.post(x, delta), x + post[None, :, None, None] * delta[:, None])
    torch.testing.assert_close(mix(x), torch.einsum("m,bmsh->bsh", out, x))
    assert torch.equal(expand_streams(x[:, 0], 3), x[:, :1].expand(-1, 3, -1, -1))


def test_zero_output_weights_are_the_mean_and_streams_are_checked():
    x = torch.randn(2, 4, 3, 5)
    torch.testing.assert_close(HCOutputMix(4)(x), x.mean(1))
    with pytest.raises(ShapeError, match="streams"):
        HCOutputMix(4)(torch.randn(2, 3, 3, 5))
