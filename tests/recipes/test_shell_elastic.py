"""ShellElastic against seed 003 (tests/data/seed_parity/elastic_*): every tier's logits
and loss, gradients at the smallest and widest tier, on both backends; cached decoding
per tier, forks, padding, dense extraction, strict loading and the named errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.recipes import shell_elastic as se

from .._fixtures import SEED_FIXTURES, load_fixture
from ._harness import GRAD_ATOL, LOGIT_ATOL, decode_in_steps, relative_gradient_errors, tier_gradient_errors

FIXTURES = [name for name, module in SEED_FIXTURES.items() if module == "shell_elastic"]


def _load(fixture):
    seed_config, *tensors = load_fixture(fixture)
    return se.CONFIG.from_seed_config(seed_config), *tensors


def _built(fixture, backend="reference"):
    config, weights, inputs, expected = _load(fixture)
    model = se.build(config, backend=backend)
    se.load_reference_state_dict(model, weights)
    return model.eval(), inputs, expected


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_tier_matches_the_seed(fixture, backend):
    model, inputs, expected = _built(fixture, backend)
    for tier in model.config.tiers:
        model.zero_grad(set_to_none=True)
        loss, out = se.loss(model, inputs["input_ids"], inputs["labels"], tier=tier)
        assert (out.logits - expected[f"logits.{tier}"]).abs().max().item() <= LOGIT_ATOL, tier
        assert abs(loss.item() - expected[f"loss.{tier}"].item()) <= LOGIT_ATOL, tier
        if f"grad.{tier}.embed_tokens.weight" in expected:
            loss.backward()
            errors = tier_gradient_errors(se, model, expected, tier)
            assert len(errors) == len(dict(model.named_parameters()))
            bad = {k: v for k, v in errors.items() if v > GRAD_ATOL}
            assert not bad, f"{tier}: gradients off the seed's: {bad}"
            rel = relative_gradient_errors(se, model, expected, f"grad.{tier}.")
            assert max(rel.values()) < 1e-4, f"{tier}: {max(rel, key=rel.get)} off by {max(rel.values()):.1e}"


@pytest.mark.parametrize("fixture", FIXTURES)
def test_cached_decoding_matches_the_full_forward_in_every_tier(fixture):
    model, inputs, _ = _built(fixture)
    ids = inputs["input_ids"]
    with torch.no_grad():
        for tier in model.config.tiers:
            full = model(ids, tier=tier).logits
            assert (decode_in_steps(model, ids, 3, tier=tier) - full).abs().max().item() <= 1e-5, tier


def test_cached_steps_on_the_triton_backend_run_the_split_k_decoding_kernel(monkeypatch):
    """A left-padded prompt, then one-token steps on backend="triton" (each on
    ``flash_decode`` over the cache and its keep mask) equal the full forward, in
    the smallest tier; the kernel gets the cache's views of its storage, uncopied."""
    import laminae.triton_ops._flash as flash

    calls = []
    real = flash.flash_decode
    monkeypatch.setattr(flash, "flash_decode", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    model, inputs, _ = _built("elastic_fully", "triton")
    ids = inputs["input_ids"][:, :6]
    tier = model.config.tiers[0]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, :2] = False
    with torch.no_grad():
        full = model(ids, keep, tier=tier).logits
        out = model(ids[:, :3], keep[:, :3], cache=model.empty_cache(ids.shape[0]), tier=tier)
        steps, cache = [out.logits], out.cache
        for t in range(3, ids.shape[1]):
            out = model(ids[:, t:t + 1], keep[:, t:t + 1], cache=cache, tier=tier)
            steps.append(out.logits)
            cache = out.cache
    assert len(calls) == 4 * len(model.layers)          # the 3-token prompt and 3 steps, every layer
    assert not all(k.is_contiguous() for k in calls)    # a cache shorter than its storage: a strided view
    torch.testing.assert_close(torch.cat(steps, 1)[keep], full[keep], atol=1e-5, rtol=0)


def test_two_continuations_of_one_cache_are_both_right():
    model, inputs, _ = _built("elastic_fully")
    ids = inputs["input_ids"]
    other = (ids[:, 4:5] + 1) % model.vocab_size
    with torch.no_grad():
        root = model(ids[:, :4], cache=model.empty_cache(ids.shape[0]), tier="medium").cache
        a = model(ids[:, 4:5], cache=root, tier="medium").logits
        b = model(other, cache=root, tier="medium").logits
        a_again = model(ids[:, 4:5], cache=root, tier="medium").logits
        full_a = model(ids[:, :5], tier="medium").logits[:, -1:]
        full_b = model(torch.cat([ids[:, :4], other], 1), tier="medium").logits[:, -1:]
    assert root.length == 4
    torch.testing.assert_close(a, full_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, full_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(a_again, a, atol=0, rtol=0)
    root.reset()
    assert root.length == 0 and root.slots is None


@pytest.mark.parametrize("fixture", FIXTURES)
def test_extracted_tier_is_a_dense_model_with_the_tier_logits(fixture):
    from tests.primitives._elastic_model import dense_logits

    model, inputs, expected = _built(fixture)
    c = model.config
    for tier in c.tiers:
        state = model.extract(tier)
        assert all(k.endswith(".weight") for k in state)
        dense = dict(hidden_size=model.tiers.width(tier), head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=c.rope_theta, rope_precision=c.rope_precision, num_hidden_layers=c.num_hidden_layers)
        with torch.no_grad():
            got = dense_logits(state, dense, inputs["input_ids"])
        assert (got - expected[f"logits.{tier}"]).abs().max().item() <= LOGIT_ATOL, tier


def test_left_padding_leaves_the_kept_positions_as_without_it():
    model, inputs, _ = _built("elastic_fully")
    ids = inputs["input_ids"][:1, :6]
    padded = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids], 1)
    keep = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        plain = model(ids, tier="low").logits
        # the positions shift by 3 with left padding; compare against the same shift
        shifted = model(padded, attention_mask=keep, tier="low").logits[:, 3:]
        ref = model(torch.cat([torch.full((1, 3), 7, dtype=ids.dtype), ids], 1),
                    attention_mask=keep, tier="low").logits[:, 3:]
    assert torch.isfinite(shifted).all()
    torch.testing.assert_close(shifted, ref, atol=0, rtol=0)   # padding contents never reach kept rows
    assert plain.shape == shifted.shape


def test_multi_tier_loss_is_the_sum_and_its_gradients_add():
    model, inputs, _ = _built("elastic_matformer")
    ids, labels = inputs["input_ids"], inputs["labels"]
    both, _ = se.loss(model, ids, labels, tiers=["low", "max"])
    both.backward()
    summed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    parts = [se.loss(model, ids, labels, tier=t)[0] for t in ("low", "max")]
    torch.testing.assert_close(both, parts[0] + parts[1])
    (parts[0] + parts[1]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(summed[n], p.grad, atol=1e-6, rtol=1e-5)


def test_loading_is_strict():
    config, weights, _, _ = _load("elastic_fully")
    model = se.build(config, backend="reference", base_init=False)
    with pytest.raises(ConfigError, match="unexpected"):
        se.load_reference_state_dict(model, dict(weights, **{"layers.0.extra.weight": torch.zeros(1)}))
    with pytest.raises(ConfigError, match="norm.weight"):
        se.load_reference_state_dict(model, {k: v for k, v in weights.items() if k != "norm.weight"})


def test_seed_config_and_model_errors():
    seed = load_fixture("elastic_fully")[0]
    with pytest.raises(ConfigError, match="not_a_seed_key"):
        se.CONFIG.from_seed_config(dict(seed, not_a_seed_key=1))
    with pytest.raises(ConfigError, match="rope_precision"):
        se.CONFIG.from_seed_config(dict(seed, rope_precision="float16"))
    with pytest.raises(ConfigError, match="base_width"):
        se.build(se.CONFIG.from_seed_config(dict(seed, base_width=8)))
    model, inputs, _ = _built("elastic_fully")
    ids = inputs["input_ids"]
    with pytest.raises(ConfigError, match="unknown tier"):
        model(ids, tier="huge")
    cache = model(ids[:, :2], cache=model.empty_cache(ids.shape[0]), tier="low").cache
    with pytest.raises(ConfigError, match="belongs to"):
        model(ids[:, 2:3], cache=cache, tier="max")
    with pytest.raises(ShapeError, match="max_positions"):
        model(torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long))
    with pytest.raises(DTypeError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ShapeError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(1, 3, dtype=torch.bool))


def test_training_from_scratch_starts_every_tier_at_unit_scale():
    c = se.CONFIG(vocab_size=64, num_hidden_layers=1, hidden_size=64, head_dim=16, base_width=16, mlp_base_width=32,
                  widths=(1, 2, 4), tiers=("s", "m", "l"), mlp_output_divisor=2.0, max_position_embeddings=16)
    model = se.build(c, backend="reference")
    ids = torch.randint(0, 64, (2, 8))
    for tier in c.tiers:
        logits = model(ids, tier=tier).logits
        assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 3.0, tier


@pytest.mark.parametrize("fixture", FIXTURES)
def test_runs_under_cpu_autocast(fixture):
    model, inputs, expected = _built(fixture)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, out = se.loss(model, inputs["input_ids"], inputs["labels"], tier="low")
    assert torch.isfinite(loss) and out.logits.dtype == torch.float32
    assert abs(loss.item() - expected["loss.low"].item()) < 0.05
    loss.backward()
    ce = F.cross_entropy(out.logits.flatten(0, 1), inputs["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(ce, loss)


def test_tour_parity_line_covers_every_tier():
    from laminae.recipes.parity import check

    r = check("elastic_matformer", "reference")
    assert r["ok"] and r["grad_margin"] <= GRAD_ATOL and r["decode"] <= 1e-5


def test_triton_backend_attends_with_the_flash_kernel_and_padding(monkeypatch):
    import laminae.triton_ops._flash as flash

    calls = []
    real = flash.flash_attention
    monkeypatch.setattr(flash, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, inputs, _ = _built("elastic_fully", "triton")
    ids = inputs["input_ids"]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, :4] = False
    got = model(ids, keep, tier="medium").logits
    model.backend = "reference"
    want = model(ids, keep, tier="medium").logits
    assert calls, "the Triton backend did not run the flash kernel"
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)
