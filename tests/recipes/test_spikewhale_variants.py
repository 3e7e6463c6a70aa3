"""SpikeWhale beyond the two fixtures: any combination of the seed's flags builds,
trains (finite loss, gradients) and decodes through the cache exactly as the full
forward; the seed's own freezing rules and config checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from laminae.primitives import ConfigError
from laminae.recipes import spikewhale as sw

from ._harness import decode_in_steps

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, nope_head_dim=4, qk_rope_head_dim=4, q_lora_rank=16, o_lora_rank=16,
            max_position_embeddings=32, moe_intermediate_size=16, n_routed_experts=4, engram_compress_dim=8,
            engram_num_heads=2, engram_table_size=32, engram_fusion_dim=8, mc_num_heads=2, mc_head_dim=4,
            mc_segment_len=3, mc_gate_dim=4, hrm_refine_dim=8)

flags = st.fixed_dictionaries({
    "use_qk_norm": st.booleans(), "use_xsa": st.booleans(), "use_derf": st.booleans(), "use_elo": st.booleans(),
    "use_depth_attention": st.booleans(), "depth_attention_stride": st.sampled_from([1, 2]),
    "use_engram": st.booleans(), "engram_fusion_layers": st.sampled_from([[], [1], [0, 1]]),
    "engram_legacy_hash": st.booleans(), "use_hyper_connections": st.booleans(), "hc_mult": st.sampled_from([2, 3]),
    "use_moe": st.booleans(), "moe_layers": st.sampled_from([[0], [0, 1]]), "num_hash_layers": st.integers(0, 1),
    "scoring_func": st.sampled_from(["softmax", "sqrtsoftplus"]), "n_shared_experts": st.integers(0, 2),
    "norm_topk_prob": st.booleans(), "use_memory_cache": st.booleans(), "use_value_embed": st.booleans(),
    "use_hrm_refine": st.booleans(), "hrm_deep_supervision": st.booleans(), "loop_count": st.integers(1, 2),
    "loop_mode": st.sampled_from(["full", "middle_split"]), "num_nextn_predict_layers": st.integers(0, 2),
    "use_abstain_head": st.booleans(), "tie_word_embeddings": st.booleans(),
    "nope_head_dim": st.sampled_from([0, 4]),
})


def perturbed(model):
    """Random non-zero values everywhere, so zero-initialised gates take part."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@settings(max_examples=12)
@given(f=flags)
def test_any_flag_combination_trains_and_decodes_like_the_full_forward(f):
    f = dict(f, qk_rope_head_dim=8 - f["nope_head_dim"])
    config = dataclasses.replace(sw.SpikeWhaleConfig(), **{**TINY, **f})
    model = perturbed(sw.build(config, backend="reference"))
    ids = torch.randint(64, (2, 7))
    model.train()
    loss, _ = sw.loss(model, ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(decode_in_steps(model, ids, 3), full, atol=2e-5, rtol=2e-5)


def test_first_pre_mix_is_frozen_only_when_layer_0_runs_once():
    base = dict(TINY, num_hidden_layers=4, use_hyper_connections=True, loop_count=2)
    split = sw.build(dataclasses.replace(sw.SpikeWhaleConfig(), **base, loop_mode="middle_split"))
    full = sw.build(dataclasses.replace(sw.SpikeWhaleConfig(), **base, loop_mode="full"))
    assert not split.model.layers[0].hc_attn.pre_weight.requires_grad
    assert full.model.layers[0].hc_attn.pre_weight.requires_grad


def test_hash_routed_routers_and_the_engram_projection_are_frozen():
    c = dataclasses.replace(sw.SpikeWhaleConfig(), **TINY, use_moe=True, moe_layers=[0, 1], num_hash_layers=1,
                            use_engram=True)
    model = sw.build(c)
    assert not model.model.layers[0].ffn.router.weight.requires_grad
    assert model.model.layers[1].ffn.router.weight.requires_grad
    assert not model.model.engram.compressor.proj.weight.requires_grad


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="scoring_func"):
        sw.SpikeWhaleConfig.from_seed_config({"scoring_func": "sigmoid"})
    with pytest.raises(ConfigError, match="loop_mode"):
        sw.SpikeWhaleConfig.from_seed_config({"loop_mode": "spiral"})
    with pytest.raises(ConfigError, match="head_dim"):
        sw.build(dataclasses.replace(sw.SpikeWhaleConfig(), **dict(TINY, nope_head_dim=3)))
    with pytest.raises(ConfigError, match="attention_dropout"):
        sw.build(dataclasses.replace(sw.SpikeWhaleConfig(), **TINY, use_elo=True, attention_dropout=0.1))


def test_engram_input_stage_receives_the_padding_mask():
    """The model's keep mask reaches Engram: a left-padded row's n-gram read equals
    the unpadded row's (pads read zero, never enter a kept token's n-gram)."""
    c = dataclasses.replace(sw.SpikeWhaleConfig(), **TINY, use_engram=True, engram_fusion_layers=[1])
    model = perturbed(sw.build(c, backend="reference")).eval()
    reads = []
    model.model.engram.register_forward_hook(lambda m, args, out: reads.append(out.retrieved))
    ids = torch.randint(1, 64, (1, 5))
    keep = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        model(torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1), keep)
        model(ids)
    assert (reads[0][:, :3] == 0).all()
    torch.testing.assert_close(reads[0][:, 3:], reads[1])
