"""SHRAM beyond the shared seed-parity harness: the loss parts and MaxVio against the
seed, padding and mask holes through the cache (errata E1/E3 resolutions), semantic
positions, tied embeddings and the config rules (the local window itself:
tests/primitives/blocks/test_sliding_window.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from laminae.primitives import ConfigError
from laminae.recipes import shram

from .._fixtures import load_fixture
from ._harness import LOGIT_ATOL, build_loaded, decode_in_steps, relative_gradient_errors

TINY = dict(vocab_size=64, embedding_width=32, mlp_width=48, num_decoder_layers=2, num_sliding_window_heads=2,
            num_mosrah_heads=4, num_selected_heads=2, head_dim=8, window_size=3, training_sequence_length=16,
            inference_sequence_length=64, beta=8.0)


@pytest.mark.parametrize("fixture", ["shram_tiny", "shram_tiny_yarn"])
def test_loss_parts_and_max_vio_match_the_seed(fixture):
    mod, model, inputs, expected = build_loaded(fixture)
    loss, out = mod.loss(model, inputs["input_ids"], inputs["labels"])
    assert abs(out.aux_loss.item() - expected["load_balance_loss"].item()) <= LOGIT_ATOL
    assert abs(out.metrics["max_vio"].item() - expected["max_vio"].item()) <= LOGIT_ATOL
    ce = loss - 0.01 * out.aux_loss
    assert abs(ce.item() - expected["ce_loss"].item()) <= LOGIT_ATOL
    loss.backward()
    rel = relative_gradient_errors(mod, model, expected)
    assert max(rel.values()) < 1e-4, f"{max(rel, key=rel.get)} off by {max(rel.values()):.1e}"


@pytest.mark.parametrize("fixture", ["shram_tiny", "shram_tiny_yarn"])
def test_left_padding_and_holes_decode_like_the_full_forward(fixture):
    _, model, inputs, _ = build_loaded(fixture)
    ids = inputs["input_ids"]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, :3] = False          # left padding
    keep[1, 4:6] = False         # a hole inside the prefill
    keep[1, 8] = False           # a hole among the steps
    with torch.no_grad():
        full = model(ids, keep).logits
    inc = decode_in_steps(model, ids, 6, keep)
    torch.testing.assert_close(inc[keep], full[keep], atol=1e-5, rtol=0)


def test_left_padding_gives_kept_tokens_their_unpadded_positions():
    _, model, inputs, _ = build_loaded("shram_tiny_yarn")
    ids = inputs["input_ids"][:1, :8]
    padded = torch.cat([torch.full((1, 3), 5, dtype=ids.dtype), ids], 1)
    keep = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool)], 1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, keep).logits[:, 3:], model(ids).logits, atol=1e-5, rtol=0)


def test_padding_nan_never_reaches_kept_positions():
    torch.manual_seed(0)
    model = shram.build(shram.CONFIG(**TINY), backend="reference").eval()
    ids = torch.randint(0, 64, (2, 7))
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, :2] = False
    attn = model.model.layers[0].attention
    x = torch.randn(2, 7, 32)
    x_nan = torch.where(keep[..., None], x, torch.full_like(x, float("nan")))
    with torch.no_grad():
        a = attn(x, keep)[0]
        b = attn(x_nan, keep)[0]
    torch.testing.assert_close(b[keep], a[keep], atol=0, rtol=0)
    assert torch.isfinite(model(ids, keep).logits).all()


def test_hybrid_attention_positions_and_empty_cache():
    """Both paths default to the live rank J (continuing their caches); explicit
    position_ids reach both; decoding starts from empty_cache."""
    torch.manual_seed(0)
    attn = shram.build(shram.CONFIG(**TINY), backend="reference").model.layers[0].attention.eval()
    x = torch.randn(2, 7, 32)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, :2] = False
    rank = (torch.cumsum(keep.long(), 1) - 1).clamp_min(0)
    with torch.no_grad():
        out = attn(x, keep)
        assert out.cache is None
        torch.testing.assert_close(attn(x, keep, position_ids=rank).output, out.output, atol=0, rtol=0)
        x0, spread = torch.where(keep[..., None], x, 0.0), 2 * rank
        both = (attn.local_attention(x0, keep, position_ids=spread).output
                + attn.sparse_attention(x0, keep, position_ids=spread).output)
        torch.testing.assert_close(attn(x, keep, position_ids=spread).output, both, atol=0, rtol=0)
        assert (both - out.output).abs().max() > 1e-4
        cache = attn.empty_cache(2, dtype=torch.float64)
        assert (cache.length, cache.local.dtype, cache.sparse.dtype) == (0, torch.float64, torch.float64)
        first = attn(x[:, :4], keep[:, :4], attn.empty_cache(2))
        step = attn(x[:, 4:], keep[:, 4:], first.cache)
    assert first.cache.length == 4 and step.cache.length == 7
    torch.testing.assert_close(torch.cat([first.output, step.output], 1)[keep], out.output[keep], atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope_mode", ["main_sequence", "semantic_sequence"])
def test_both_position_modes_train_and_decode(rope_mode):
    torch.manual_seed(0)
    model = shram.build(shram.CONFIG(**TINY, rope_mode=rope_mode), backend="reference")
    ids = torch.randint(0, 64, (2, 9))
    loss, out = shram.loss(model, ids)
    loss.backward()
    assert torch.isfinite(loss) and out.metrics["max_vio"].requires_grad is False
    bias = model.model.layers[0].attention.sparse_attention.router.expert_bias
    assert bias.grad is not None and bias.grad.abs().max() > 0
    model.eval()
    with torch.no_grad():
        full = model(ids).logits
    inc = decode_in_steps(model, ids, 4, torch.ones_like(ids, dtype=torch.bool))
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=0)


def test_tied_embeddings_load_from_one_tensor():
    seed, weights, inputs, _ = load_fixture("shram_tiny")
    config = shram.CONFIG.from_seed_config(dict(seed, tie_word_embeddings=True))
    model = shram.build(config, backend="reference")
    tied = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    shram.load_reference_state_dict(model, tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, weights["embed_tokens.weight"])


def test_seed_config_aliases_and_errors():
    seed = dict(load_fixture("shram_tiny")[0])
    config = shram.CONFIG.from_seed_config(dict(seed, hidden_size=999, num_hidden_layers=7))
    assert config.embedding_width == seed["embedding_width"] and config.num_decoder_layers == 2   # E9
    renamed = {k: v for k, v in seed.items() if k != "mlp_width"}
    assert shram.CONFIG.from_seed_config(dict(renamed, intermediate_size=40)).mlp_width == 40
    with pytest.raises(ConfigError, match="rope_mode"):
        shram.CONFIG.from_seed_config(dict(seed, rope_mode="absolute"))
    with pytest.raises(ConfigError, match="attention_dropout"):
        shram.CONFIG.from_seed_config(dict(seed, attention_dropout=0.1))
    with pytest.raises(ConfigError, match="num_selected_heads"):
        shram.build(dataclasses.replace(shram.CONFIG(**TINY), num_selected_heads=5))


def test_cache_of_another_model_is_rejected_and_reset_empties_it():
    _, model, inputs, _ = build_loaded("shram_tiny")
    other = shram.build(shram.CONFIG(**TINY), backend="reference")
    with torch.no_grad():
        ids = inputs["input_ids"]
        cache = model(ids[:, :3], cache=model.empty_cache(ids.shape[0])).cache
        with pytest.raises(ConfigError, match="cache"):
            other(ids[:, 3:4] % 64, cache=cache)
    cache.reset()
    assert cache.length == 0 and cache.slots is None


def test_tour_parity_line():
    from laminae.recipes.parity import check

    r = check("shram_tiny_yarn", "reference")
    assert r["ok"] and r["logits"] <= LOGIT_ATOL and r["decode"] <= 1e-5


def test_tour_recipes_option_prints_the_parity_lines(monkeypatch, capsys):
    import functools

    import laminae.recipes.parity as parity
    from laminae.triton_ops import tour

    monkeypatch.setattr(parity, "report", functools.partial(parity.report, backends=("reference",),
                                                            fixtures=["shram_tiny"]))
    assert tour.main(["--recipes"]) == 0
    out = capsys.readouterr().out
    assert "shram_tiny" in out and "| ok" in out
