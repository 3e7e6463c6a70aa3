"""Every recipe against what its seed computed (tests/data/seed_parity): logits, the
full training objective and every parameter gradient, on both backends (Triton through
the interpreter on CPU), plus cached decoding."""
from __future__ import annotations

import pytest
import torch


from .._fixtures import DATA, SEED_FIXTURES, load_fixture
from ._harness import FIXTURES, GRAD_ATOL, LOGIT_ATOL, build_loaded, decode_in_steps, gradient_errors, load

BACKENDS = ["reference", "triton"]


def test_every_fixture_folder_is_declared_once():
    """One list of the fixtures: a folder nobody declares is a seed nobody checks."""
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(SEED_FIXTURES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_logits_loss_and_gradients_match_the_seed(fixture, backend):
    mod, model, inputs, expected = build_loaded(fixture, backend)
    loss, out = mod.loss(model, inputs["input_ids"], inputs["labels"])
    assert (out.logits - expected["logits"]).abs().max().item() <= LOGIT_ATOL
    assert abs(loss.item() - expected["loss"].item()) <= LOGIT_ATOL
    loss.backward()
    errors = gradient_errors(mod, model, expected)
    bad = {k: v for k, v in errors.items() if v > GRAD_ATOL}
    assert not bad, f"gradients off the seed's: {bad}"


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_parameters_the_seed_freezes_get_no_gradient(fixture):
    mod, model, inputs, expected = build_loaded(fixture)
    weights = load(fixture)[2]
    mod.loss(model, inputs["input_ids"], inputs["labels"])[0].backward()
    refs = mod.reference_parameters(model, list(weights))
    trained = {id(p) for k, (p, _) in refs.items() if f"grad.{k}" in expected}   # tied aliases share one
    for name, (param, _) in refs.items():
        if f"grad.{name}" in expected or id(param) in trained:
            continue
        assert param.grad is None or param.grad.abs().max() == 0, f"{name} got a gradient the seed has not"


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_cached_decoding_matches_the_full_forward(fixture):
    mod, model, inputs, expected = build_loaded(fixture)
    ids = inputs["input_ids"]
    with torch.no_grad():
        full = model(ids).logits
    incremental = decode_in_steps(model, ids, 3)
    assert (incremental - full).abs().max().item() <= 1e-5
    if "incremental_logits.prefill3" in expected:
        assert (incremental - expected["incremental_logits.prefill3"]).abs().max().item() <= LOGIT_ATOL


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_two_continuations_of_one_cache_are_both_right(fixture):
    mod, model, inputs, _ = build_loaded(fixture)
    ids = inputs["input_ids"]
    other = (ids[:, 4:5] + 1) % model.lm_head.weight.shape[0]
    with torch.no_grad():
        root = model(ids[:, :4], cache=model.empty_cache(ids.shape[0])).cache
        a = model(ids[:, 4:5], cache=root).logits
        b = model(other, cache=root).logits
        a_again = model(ids[:, 4:5], cache=root).logits
        full_a = model(ids[:, :5]).logits[:, -1:]
        full_b = model(torch.cat([ids[:, :4], other], 1)).logits[:, -1:]
    assert root.length == 4
    torch.testing.assert_close(a, full_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, full_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(a_again, a, atol=0, rtol=0)


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_loading_is_strict(fixture):
    mod, config, weights, _, _ = load(fixture)
    model = mod.build(config, backend="reference")
    extra = dict(weights, **{"model.unexpected.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected"):
        mod.load_reference_state_dict(model, extra)
    dropped = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        mod.load_reference_state_dict(model, dropped)


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_seed_config_rejects_unknown_keys(fixture):
    from ._harness import recipe

    seed = dict(load_fixture(fixture)[0], not_a_seed_key=1)
    with pytest.raises(ValueError, match="not_a_seed_key"):
        recipe(fixture).CONFIG.from_seed_config(seed)


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_runs_under_cpu_autocast(fixture):
    mod, model, inputs, _ = build_loaded(fixture)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, out = mod.loss(model, inputs["input_ids"], inputs["labels"])
    assert torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_padding_never_reaches_kept_positions(fixture):
    mod, model, inputs, _ = build_loaded(fixture)
    ids = inputs["input_ids"]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, 9:] = False                                    # row 0: 9 tokens, right-padded
    junk = ids.clone()
    junk[0, 9:] = (ids[0, 9:] * 7 + 3) % model.lm_head.weight.shape[0]
    with torch.no_grad():
        a = model(ids, keep).logits
        b = model(junk, keep).logits
        alone = model(ids[:1, :9]).logits
    torch.testing.assert_close(b[keep], a[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(a[0, :9], alone[0], atol=1e-5, rtol=0)
