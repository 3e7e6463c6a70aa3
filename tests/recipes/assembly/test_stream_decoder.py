"""StreamDecoderModel: the wiring rules raise named errors; bad inputs are refused by
name; a one-stream stack equals the hand-written pre-norm loop."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from laminae.primitives import (ConfigError, DTypeError, GroupedQueryAttention, RMSNorm, ShapeError,
                                SiameseNormFinal, SiameseNormLayer, StackMemory, SwiGLU)
from laminae.recipes.assembly.stream_decoder import AttentionSublayer, PreNormLayer, ScaledSublayer, StreamDecoderModel

D = 16


def attn(i, stack=None):
    return AttentionSublayer(GroupedQueryAttention(D, 2, 1, 8), i, stack)


def prenorm(i):
    return PreNormLayer(attn(i), ScaledSublayer(SwiGLU(D, 24)), RMSNorm(D), RMSNorm(D))


def test_wiring_errors():
    embed = ("embed_tokens", nn.Embedding(10, D))
    siamese = SiameseNormLayer(D, 1, attn(1), ScaledSublayer(SwiGLU(D, 24)))
    with pytest.raises(ConfigError, match="all SiameseNormLayer or all PreNormLayer"):
        StreamDecoderModel(embed, [prenorm(0), siamese], RMSNorm(D), D)
    with pytest.raises(ConfigError, match="SiameseNormFinal"):
        StreamDecoderModel(embed, [prenorm(0)], SiameseNormFinal(D), D)
    with pytest.raises(ConfigError, match="depth-mode"):
        attn(0, StackMemory(D, 4, 2, 3, mode="temporal"))


def test_bad_inputs():
    model = StreamDecoderModel(("embed_tokens", nn.Embedding(10, D)), [prenorm(0)], RMSNorm(D), D)
    with pytest.raises(DTypeError, match="input_ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ShapeError, match="input_ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ShapeError, match="attention_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="DecoderCache"):
        model(torch.zeros(1, 3, dtype=torch.long), cache={})


def test_one_stream_equals_the_plain_loop():
    torch.manual_seed(0)
    layers = [prenorm(0), prenorm(1)]
    embed, final = nn.Embedding(10, D), RMSNorm(D)
    model = StreamDecoderModel(("embed_tokens", embed), layers, final, D)
    ids = torch.randint(10, (2, 5))
    x = embed(ids)
    pos = torch.arange(5)[None]
    for layer in layers:
        x = x + layer.attention.attention(layer.attn_norm(x), position_ids=pos)[0]
        x = x + layer.mlp.module(layer.mlp_norm(x))
    torch.testing.assert_close(model(ids).hidden, final(x))
