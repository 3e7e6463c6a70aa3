"""Every recipe model starts decoding from ``empty_cache(batch, *, dtype=None,
device=None)`` (docs/protocol.md, "Decoding"), as every decoding block does: the cache
records its batch and device, ``cache=None`` decodes nothing, a prefill followed by
one-token steps from it equals the full forward, and a call of another batch or
device is refused by name."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from laminae.primitives import DeviceError, ShapeError
from laminae.recipes.assembly.decoder import DecoderCache

from ._harness import decode_in_steps
from .test_context_length import CONTEXT, RECIPES

CONTRACT = [("batch", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
            ("dtype", inspect.Parameter.KEYWORD_ONLY, None), ("device", inspect.Parameter.KEYWORD_ONLY, None)]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_model_decodes_from_its_empty_cache(name):
    module, fields = RECIPES[name]
    model = module.build(dataclasses.replace(module.CONFIG(), **fields), backend="reference").eval()
    params = list(inspect.signature(type(model).empty_cache).parameters.values())[1:]
    assert [(p.name, p.kind, p.default) for p in params] == CONTRACT
    ids = torch.randint(0, 64, (2, CONTEXT), generator=torch.Generator().manual_seed(1))
    cache = model.empty_cache(2)
    assert isinstance(cache, DecoderCache)
    assert (cache.length, cache.batch, cache.dtype, cache.device) == (0, 2, None, torch.device("cpu"))
    with torch.no_grad():
        full = model(ids)
        assert full.cache is None                                   # no cache, no decoding
        first = model(ids[:, :3], cache=cache)
        assert cache.length == 0 and first.cache.length == 3        # the empty cache is left as it was
        torch.testing.assert_close(decode_in_steps(model, ids, 3), full.logits, atol=2e-5, rtol=1e-5)
        with pytest.raises(ShapeError, match="batch size 2"):           # before any layer starts its cache
            model(ids[:1, :3], cache=model.empty_cache(2))
        with pytest.raises(DeviceError, match="cache"):
            model(ids[:, :3], cache=model.empty_cache(2, device="meta"))
