"""NeoLLM recipe: every implemented mechanism trains and decodes like the full forward,
parameter counts match the seed's figures, both backends agree, and the seed's config
rules (plus the refusal of unimplemented flags) raise ConfigError naming the keys."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from laminae.primitives import ConfigError
from laminae.primitives.leviathan import LeviathanGenerator
from laminae.recipes import neollm as nl

from ._harness import decode_in_steps

OFF = {k: False for k in nl.UNSPECIFIED}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, hidden_act="silu", generator_d_seed=8, generator_num_modes=2,
            generator_num_knots=4, generator_krank=4, attention_dropout=0.0, dropout_rate=0.0, stack_d_model=8,
            num_mem_heads=2, stack_slots=4, laurel_lr_rank=4, **OFF)
# every implemented mechanism, in the two residual flows the seed allows them in
ALL_SIAMESE = dict(use_stack_memory=True, use_spelling_bee_embeddings=True, use_lucid_attention=True)
ALL_LAUREL = dict(use_siamesenorm=False, use_laurel=True, use_laurel_rw=True, use_laurel_lr=True,
                  use_spelling_bee_embeddings=True, use_affine_scaled_attention=True)


def make(backend="reference", **extra):
    config = dataclasses.replace(nl.NeoLLMConfig(), **{**TINY, **extra})
    model = nl.build(config, backend=backend)
    if config.use_spelling_bee_embeddings:
        model.model.spelling_bee.set_byte_table_from_strings([bytes([i, 97 + i % 7]) for i in range(64)])
    return model


def perturbed(model, seed=1):
    """Non-zero values everywhere, so zero-initialised pieces (LAuReL B) take part."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("extra", [ALL_SIAMESE, ALL_LAUREL], ids=["siamese", "laurel"])
def test_every_mechanism_trains(extra):
    torch.manual_seed(0)
    model = make(**extra)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(64, (4, 12))
    history = []
    for _ in range(30):
        value, _ = nl.loss(model, ids)
        opt.zero_grad()
        value.backward()
        opt.step()
        history.append(value.item())
    assert history[-1] < history[0] - 1.0, history


flows = st.sampled_from([ALL_SIAMESE, ALL_LAUREL, dict(use_siamesenorm=False, use_stack_memory=True),
                         dict(use_siamesenorm=False, use_laurel=True, use_laurel_rw=True)])


@settings(max_examples=12, deadline=None)
@given(flow=flows, core=st.sampled_from(["sdpa", "lucid", "affine"]), xsa=st.booleans(), lns=st.booleans(),
       generator=st.booleans(), input_norm=st.booleans(), prefill=st.integers(1, 5), seed=st.integers(0, 99))
def test_cached_decode_equals_full_forward(flow, core, xsa, lns, generator, input_norm, prefill, seed):
    extra = {**flow, "use_lucid_attention": core == "lucid", "use_affine_scaled_attention": core == "affine",
             "use_xsa": xsa, "use_lns": lns, "use_token_generator": generator, "use_embedding_input_norm": input_norm}
    model = perturbed(make(**extra), seed).eval()
    ids = torch.randint(64, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(decode_in_steps(model, ids, prefill), full, atol=2e-5, rtol=1e-5)


def test_two_continuations_of_one_cache():
    model = perturbed(make(**ALL_SIAMESE)).eval()
    ids = torch.randint(64, (2, 6))
    with torch.no_grad():
        cache = model(ids[:, :4], cache=model.empty_cache(ids.shape[0])).cache
        a = model(torch.full((2, 1), 3), cache=cache).logits
        b = model(torch.full((2, 1), 9), cache=cache).logits
        full_a = model(torch.cat([ids[:, :4], torch.full((2, 1), 3)], 1)).logits[:, -1:]
        full_b = model(torch.cat([ids[:, :4], torch.full((2, 1), 9)], 1)).logits[:, -1:]
    torch.testing.assert_close(a, full_a, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(b, full_b, atol=2e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="cache"):
        make(**ALL_LAUREL)(ids, cache=cache)


def test_padding_never_reaches_kept_positions():
    model = perturbed(make(**ALL_SIAMESE)).eval()
    ids = torch.randint(64, (2, 6))
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 4:] = False
    other = ids.clone()
    other[0, 4:] = (ids[0, 4:] + 5) % 64
    with torch.no_grad():
        a, b = model(ids, keep).logits, model(other, keep).logits
    torch.testing.assert_close(a[0, :4], b[0, :4], atol=0, rtol=0)
    assert torch.isfinite(a).all()


def test_parameter_counts_match_the_seed():
    # Leviathan at NeoLLM's defaults (spec/leviathan.md)
    assert sum(p.numel() for p in LeviathanGenerator(64402, 512).parameters()) == 1_459_584
    D, r = TINY["hidden_size"], TINY["laurel_lr_rank"]
    model = make(**ALL_LAUREL)
    layer = model.model.layers[0]
    assert sum(p.numel() for p in model.model.spelling_bee.parameters()) == 256 * D
    assert sum(p.numel() for p in layer.attn_laurel.parameters()) == 2 + 2 * r * D          # RW+LR per sublayer
    rw = make(use_siamesenorm=False, use_laurel=True, use_laurel_rw=True).model.layers[0]
    assert sum(p.numel() for p in rw.attn_laurel.parameters()) + sum(p.numel() for p in rw.mlp_laurel.parameters()) == 4
    stack = make(**ALL_SIAMESE).model.layers[0].attention.stack
    H, d = TINY["num_mem_heads"], TINY["stack_d_model"] // TINY["num_mem_heads"]
    assert sum(p.numel() for p in stack.parameters()) == 2 * D * H * d + 3 * H * D + d + 1
    # untied head: lm_head is its own [V, D] matrix
    assert model.lm_head.weight.data_ptr() != model.model.token_generator.codebooks.data_ptr()
    assert not model.tie_word_embeddings


@pytest.mark.parametrize("extra", [ALL_SIAMESE, ALL_LAUREL], ids=["siamese", "laurel"])
def test_backends_agree(extra):
    torch.manual_seed(0)
    ref = perturbed(make("reference", **extra))
    tri = make("triton", **extra)
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(64, (2, 5))
    lr, out_r = nl.loss(ref, ids)
    lt, out_t = nl.loss(tri, ids)
    lr.backward()
    lt.backward()
    torch.testing.assert_close(out_t.logits, out_r.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lt, lr, atol=1e-5, rtol=1e-5)
    for (name, pr), pt in zip(ref.named_parameters(), tri.parameters()):
        torch.testing.assert_close(pt.grad, pr.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("extra", [dict(ALL_SIAMESE, use_lucid_attention=False), ALL_LAUREL], ids=["siamese", "laurel"])
def test_autocast_bf16(extra):
    # (LUCID itself cannot run under CPU bf16 autocast: torch has no bf16 triangular solve on CPU)
    model = make(**extra)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value, out = nl.loss(model, torch.randint(64, (2, 5)))
    value.backward()
    assert torch.isfinite(value)


def test_loss_terms():
    model = make(use_mile_loss=False, use_mu_loss=False).eval()
    ids = torch.randint(64, (2, 5))
    base, out = nl.loss(model, ids)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(base, ce)
    model.config = dataclasses.replace(model.config, use_mu_loss=True)
    mu = nl.loss(model, ids)[0]
    torch.testing.assert_close(mu - base, 1e-4 * model.lm_head.weight.mean(0).pow(2).sum())
    # right padding: the loss of the kept prefix, whatever the padded ids are
    padded = torch.cat([ids, torch.randint(64, (2, 3))], 1)
    keep = torch.cat([torch.ones(2, 5), torch.zeros(2, 3)], 1).bool()
    torch.testing.assert_close(nl.loss(model, padded, attention_mask=keep)[0], mu)
    # MiLe weights: mean 1 over valid labels, larger where the prediction is less certain
    logits = torch.tensor([[[5.0, 0, 0], [0, 0, 0], [1, 1, 1]]])
    labels = torch.tensor([[0, 1, -100]])
    w = nl.mile_weights(logits, labels, 1.0)
    assert w[0, 2] == 0 and torch.isclose(w[0, :2].mean(), torch.tensor(1.0)) and w[0, 1] > w[0, 0]



def test_default_config_fails_once_listing_every_change_and_the_preset_builds():
    with pytest.raises(ConfigError) as caught:
        nl.build(nl.NeoLLMConfig())
    message = str(caught.value)
    for change in [f"{k}=False" for k in nl.unsupported(nl.NeoLLMConfig())] + ["hidden_act='silu'"]:
        assert change in message, change
    assert "(9 to fix)" in message and "NeoLLMConfig.buildable" in message
    sizes = {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                                  "generator_d_seed", "generator_krank")}
    config = nl.NeoLLMConfig.buildable(**sizes)
    nl.build(config)
    # only what the toolkit lacks is changed; every other setting keeps the seed's default
    changed = {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(nl.NeoLLMConfig(), f.name)}
    assert changed == set(nl.required_changes(nl.NeoLLMConfig())) | set(sizes)


def test_embedding_multipliers_warn_that_they_are_inactive():
    with pytest.warns(UserWarning, match="use_embedding_multipliers=True is inactive because use_learnable_multipliers"):
        make(use_embedding_multipliers=True)


def test_config_rules():
    with pytest.raises(ConfigError, match="unknown seed configuration keys.*'bogus'"):
        nl.NeoLLMConfig.from_seed_config({"bogus": 1})
    with pytest.raises(ConfigError, match="hidden_act"):
        nl.NeoLLMConfig.from_seed_config({"hidden_act": "xielu"})
    assert not nl.NeoLLMConfig.from_seed_config({"tie_word_embeddings": True}).tie_word_embeddings
    for bad, match in [(dict(use_laurel=True, use_laurel_rw=True), "residual-flow.*use_laurel.*use_siamesenorm"),
                       (dict(use_siamesenorm=False, use_laurel=True, use_laurel_rw=True, use_stack_memory=True),
                        "residual-flow"),
                       (dict(use_siamesenorm=False, use_laurel=True), "use_laurel_rw"),
                       (dict(use_lucid_attention=True, use_affine_scaled_attention=True), "one attention core"),
                       (dict(use_token_generator=True, tie_word_embeddings=True), "untied"),
                       (dict(partial_rotary_factor=0.3), "partial_rotary_factor"),
                       (dict(hidden_act="xielu"), "hidden_act")]:
        with pytest.raises(ConfigError, match=match):
            make(**bad)
    make(use_stack_memory=True)   # the one pair the seed allows


def test_load_reference_generator():
    model = make()
    gen = model.model.token_generator
    sd = {f"model.token_generator.{k}": torch.randn_like(getattr(gen, k)) for k in nl.GENERATOR_KEYS}
    nl.load_reference_state_dict(model, sd)
    torch.testing.assert_close(gen.head_out_weight, sd["model.token_generator.head_out_weight"])
    with pytest.raises(ConfigError, match="lm_head.weight"):
        nl.load_reference_state_dict(model, {**sd, "lm_head.weight": model.lm_head.weight})
    with pytest.raises(ConfigError, match="head_norm_bias"):
        nl.load_reference_state_dict(model, {k: v for k, v in sd.items() if not k.endswith("head_norm_bias")})
