"""The trainer's configurations: per recipe, named presets of config fields, merged
over the recipe's defaults and under the command line's ``--set`` overrides."""
from __future__ import annotations

import dataclasses
import difflib

# Presets (config fields) per recipe. "tiny": a few seconds per dozen steps on 2 CPU
# cores. "tiny-full": the same sizes with every optional mechanism of the recipe on.
_SPIKEWHALE_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, nope_head_dim=8, qk_rope_head_dim=8, q_lora_rank=32,
                        o_lora_rank=32, max_position_embeddings=256, moe_intermediate_size=64, use_moe=True,
                        moe_layers=[1], n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        num_nextn_predict_layers=1, zloss_coef=1e-4)
PRESETS = {
    "naylis": {"tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=256, mem_size=32, mom_block_size=4,
                            mom_top_blocks=2, mom_router_rank=16)},
    "spikewhale": {
        "tiny": _SPIKEWHALE_TINY,
        # Elo core (DERF runs as Engram's context gate; `--set use_elo=false --set use_derf=true`
        # makes it the attention core), XSA, depth attention, Engram + fusion, hyper-connections,
        # hash-routed and routed MoE, memory cache, value embedding, HRM with deep supervision,
        # a looped stack, MTP and the abstain head
        "tiny-full": dict(_SPIKEWHALE_TINY, use_elo=True, use_xsa=True, use_depth_attention=True,
                          depth_attention_stride=1, use_engram=True, engram_compress_dim=16, engram_num_heads=2,
                          engram_table_size=256, engram_fusion_layers=[1], engram_fusion_dim=16,
                          engram_gate_init_bias=-1.0, use_hyper_connections=True, moe_layers=[0, 1],
                          num_hash_layers=1, use_memory_cache=True, mc_num_heads=2, mc_head_dim=8,
                          mc_segment_len=16, mc_gate_dim=8, use_value_embed=True, use_hrm_refine=True,
                          hrm_refine_dim=16, hrm_refine_steps=2, hrm_deep_supervision=True, loop_count=2,
                          use_abstain_head=True),
    },
    "shell_elastic": {"tiny": dict(vocab_size=256, num_hidden_layers=2, hidden_size=64, head_dim=16, base_width=16,
                                   mlp_base_width=32, widths=(1, 2, 4), tiers=("low", "medium", "max"),
                                   mlp_output_divisor=2.0, max_position_embeddings=256)},
    "shram": {"tiny": dict(vocab_size=256, embedding_width=64, mlp_width=128, num_decoder_layers=2,
                           num_sliding_window_heads=2, num_mosrah_heads=4, num_selected_heads=2, head_dim=16,
                           window_size=16, training_sequence_length=256)},
    "neollm": {"tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                            generator_d_seed=16, generator_num_modes=2, generator_num_knots=8, generator_krank=8,
                            attention_dropout=0.0, dropout_rate=0.0, use_stack_memory=True,
                            use_lucid_attention=True, use_momentum_attention=False,
                            use_learnable_multipliers=False, use_jtok=False, use_hadamard_o_proj=False,
                            use_repo=False, use_repo_grape=False, use_tweo=False, use_nitp=False)},
}
TINY = {name: presets["tiny"] for name, presets in PRESETS.items()}


def make_config(recipe, name: str, preset: str, overrides: dict):
    """The recipe's config: its defaults, then the preset's fields, then ``overrides``
    (which may change any of them). ValueError for an unknown preset or field."""
    presets = PRESETS[name]
    if preset not in presets:
        raise ValueError(f"--preset {preset!r}: recipe {name} has presets {sorted(presets)}")
    fields = {f.name for f in dataclasses.fields(recipe.CONFIG)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        hints = {k: difflib.get_close_matches(k, fields, n=2) for k in unknown}
        raise ValueError(f"--set: {recipe.CONFIG.__name__} has no field {', '.join(unknown)}"
                         + "".join(f" ({k}: did you mean {' or '.join(h)}?)" for k, h in hints.items() if h))
    return dataclasses.replace(recipe.CONFIG(), **{**presets[preset], **overrides})
