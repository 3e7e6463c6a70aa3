from typing import NamedTuple

import pytest
import torch
from torch import nn

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.recipes.assembly.decoder import (Branch, CausalLM, DecoderModel, ResidualBlock,
                                        layer_plan)
from laminae.primitives.blocks.gqa import GroupedQueryAttention
from laminae.primitives.blocks.hyper_connections import HCOutputMix, HyperConnection, expand_streams
from laminae.primitives.blocks.norms import RMSNorm
from laminae.primitives.blocks.rotary import RotaryEmbedding
from laminae.primitives.blocks.swiglu import SwiGLU

from ..._decoding import prefill_then_decode


def test_layer_plans():
    assert layer_plan(3) == [(0, None), (1, None), (2, None)]
    assert layer_plan(2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert layer_plan(4, 2, "middle_split") == [(0, None), (1, 0), (2, 0), (1, 1), (2, 1), (3, None)]
    with pytest.raises(ConfigError, match="loop_middle_layers"):
        layer_plan(4, 2, "middle_split", 3)
    with pytest.raises(ConfigError, match="loop_mode"):
        layer_plan(4, 2, "spiral")


def test_hyper_connections_start_as_a_plain_residual_on_identical_streams():
    x = torch.randn(2, 3, 5)
    streams = expand_streams(x, 4)
    hc = HyperConnection(4)
    torch.testing.assert_close(hc.pre(streams), x)
    delta = torch.randn(2, 3, 5)
    torch.testing.assert_close(HCOutputMix(4)(hc.post(streams, delta)), x + delta / 4)


def tiny_llama(layers=2, tie=True, plan=None):
    torch.manual_seed(0)
    norm = lambda: RMSNorm(16)  # noqa: E731
    blocks = [ResidualBlock([[Branch("attn", GroupedQueryAttention(16, 4, 2, 4, rope=RotaryEmbedding(4)), norm())],
                             [Branch("mlp", SwiGLU(16, 24), norm())]]) for _ in range(layers)]
    return CausalLM(DecoderModel(nn.Embedding(50, 16), blocks, norm(), plan=plan), 50, tie_word_embeddings=tie)


def test_residual_block_is_pre_norm_residual():
    lm = tiny_llama(1)
    block = lm.model.layers[0]
    x = torch.randn(1, 4, 16)
    from laminae.recipes.assembly.decoder import BlockContext

    ctx = BlockContext(torch.arange(4)[None])
    h = x + block.attn(block.attn_norm(x), position_ids=ctx.positions).output
    want = h + block.mlp(block.mlp_norm(h))
    torch.testing.assert_close(block(x, ctx)[0], want)
    assert {"attn_norm.weight", "mlp_norm.weight"} <= set(block.state_dict())


def test_looped_plan_decodes_like_the_full_forward_and_ties_weights():
    lm = tiny_llama(2, plan=layer_plan(2, 2)).eval()
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    ids = torch.randint(50, (2, 7))
    with torch.no_grad():
        full = lm(ids).logits
        steps, cache = prefill_then_decode(lm, ids, cache=lm.empty_cache(ids.shape[0]), prefill=2, field="logits")
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    cache.reset()
    assert cache.length == 0 and cache.slots is None


def test_empty_cache_dtype_reaches_every_layer_cache():
    """The layers' caches start in ``empty_cache``'s dtype; None leaves each layer its own."""
    lm = tiny_llama().double().eval()
    ids = torch.randint(50, (2, 3))
    with torch.no_grad():
        slots = lm(ids, cache=lm.empty_cache(2)).cache.slots
        assert {c.dtype for slot in slots for c in slot.values() if c is not None} == {torch.float64}
        with pytest.raises(DTypeError, match="`cache` holds float32"):
            lm(ids, cache=lm.empty_cache(2, dtype=torch.float32))


def test_padded_rows_equal_unpadded_rows():
    lm = tiny_llama().eval()
    ids = torch.randint(50, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    keep = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    # positions restart after the padding only if the caller says so; compare with right padding instead
    right = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    keep_right = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    torch.testing.assert_close(lm(right, keep_right).logits[:, :5], lm(ids).logits, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lm(padded, keep).logits).all()


def test_named_errors():
    lm = tiny_llama()
    with pytest.raises(ShapeError, match="`input_ids` must hold at least one token"):
        lm(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ShapeError, match="`input_ids` must hold at least one token"):
        lm(torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids"):
        lm(torch.zeros(2, 3))
    with pytest.raises(DTypeError, match="attention_mask"):
        lm(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0.0, -float("inf"), 0.0]]))
    with pytest.raises(DeviceError, match="input_ids on meta"):
        lm(torch.zeros(1, 3, dtype=torch.long, device="meta"))
    other = tiny_llama(3)
    with torch.no_grad():
        cache = other(torch.zeros(1, 2, dtype=torch.long), cache=other.empty_cache(1)).cache
        with pytest.raises(ConfigError, match="cache"):
            lm(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ConfigError, match="plan"):
        DecoderModel(nn.Embedding(5, 4), [], RMSNorm(4), plan=[(0, None)])


def test_injection_stays_in_the_stream_without_hyper_connections_and_not_with_them():
    from laminae.recipes.assembly.decoder import BlockContext

    torch.manual_seed(0)
    x, emb = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    ctx = BlockContext(torch.arange(3)[None], shared={"token_embed": emb})

    def block(hc):
        b = ResidualBlock([[Branch("mlp", SwiGLU(8, 8))]], hyper_connections=["hc"] if hc else None, hc_mult=2,
                          injection=("ve_gate", "token_embed"))
        with torch.no_grad():
            b.ve_gate.fill_(0.5)
        return b

    plain = block(False)
    h = x + torch.tanh(torch.tensor(0.5)) * emb
    torch.testing.assert_close(plain(x, ctx)[0], h + plain.mlp(h))       # the injection stays in x
    hyper = block(True)
    streams = expand_streams(x, 2)
    out = hyper.mlp(hyper.hc.pre(streams) + torch.tanh(torch.tensor(0.5)) * emb)
    torch.testing.assert_close(hyper(streams, ctx)[0], hyper.hc.post(streams, out))   # only the branch input


class _Probe(nn.Module):
    """A branch type the decoder has never seen: what reaches it is what its names ask for."""

    class Output(NamedTuple):
        output: torch.Tensor
        cache: object
        load_balance_loss: torch.Tensor
        max_vio: torch.Tensor

    def __init__(self, vio):
        super().__init__()
        self.vio, self.seen, self.started = vio, [], 0

    def empty_cache(self, batch, *, dtype=None, device=None):
        self.started += 1
        return ("empty", batch)

    def forward(self, x, attention_mask=None, cache=None, *, position_ids, M_blocks, scale=2.0):
        self.seen.append({"attention_mask": attention_mask, "cache": cache, "position_ids": position_ids,
                          "M_blocks": M_blocks, "scale": scale})
        return self.Output(x * M_blocks, ("after", cache), torch.tensor(0.25), torch.tensor(self.vio))


def test_branches_are_called_by_their_parameter_names():
    """No table of types: a new module gets the mask, its own cache (its empty_cache on
    the first decoding call), the positions and the shared tensors it names; its
    NamedTuple is read by field: output, cache, the aux loss and MaxVio."""
    from laminae.recipes.assembly.decoder import BRANCH_CALLS, BlockContext
    from laminae.recipes.assembly.hybrid_attention import HybridAttention

    assert set(BRANCH_CALLS) <= {HybridAttention}
    a, b = _Probe(0.5), _Probe(0.75)
    block = ResidualBlock([[Branch("a", a)], [Branch("b", b)]])
    x, keep, bank = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), torch.full((1,), 3.0)
    ctx = BlockContext(torch.arange(3)[None], keep, shared={"M_blocks": bank}, decoding=True)
    out, state = block(x, ctx)
    h = x + x * 3
    torch.testing.assert_close(out, h + h * 3)
    seen = a.seen[0]
    assert seen["attention_mask"] is keep and seen["position_ids"] is ctx.positions and seen["M_blocks"] is bank
    assert seen["cache"] == ("empty", 2) and seen["scale"] == 2.0 and a.started == 1
    assert state == {"a": ("after", ("empty", 2)), "b": ("after", ("empty", 2))}
    assert [float(t) for t in ctx.aux_losses] == [0.25, 0.25] and float(ctx.metrics["max_vio"]) == 0.75
    ctx = BlockContext(torch.arange(3)[None], shared={"M_blocks": bank}, decoding=True)
    block(x, ctx, state)                                            # the next step continues each branch's cache
    assert a.seen[1]["cache"] == ("after", ("empty", 2)) and a.started == 1
    training = BlockContext(torch.arange(3)[None], shared={"M_blocks": bank})
    assert block(x, training)[1] == {"a": None, "b": None} and a.seen[2]["cache"] is None
    with pytest.raises(ConfigError, match="needs `M_blocks`"):
        block(x, BlockContext(torch.arange(3)[None]))
