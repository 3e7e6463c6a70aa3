"""One context rule for the five recipes (docs/protocol.md, "Context length"): cached
plus new tokens past the configured length (the rotary tables, the YaRN range) are a
ShapeError before any layer runs. SpikeWhale indexed past its rotary table (a raw
IndexError, a device assert on CUDA); Naylis and NeoLLM accepted any length."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from laminae.primitives import ShapeError
from laminae.recipes import naylis, neollm, shell_elastic, shram, spikewhale

CONTEXT = 6
RECIPES = {
    "spikewhale": (spikewhale, dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, nope_head_dim=4, qk_rope_head_dim=4,
                                    q_lora_rank=16, o_lora_rank=16, moe_intermediate_size=16,
                                    max_position_embeddings=CONTEXT)),
    "naylis": (naylis, dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=4, mem_size=16, mom_block_size=4, mom_router_rank=4,
                            max_position_embeddings=CONTEXT)),
    "neollm": (neollm, dict({k: False for k in neollm.UNSPECIFIED}, vocab_size=64, hidden_size=32,
                            intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, hidden_act="silu", attention_dropout=0.0, dropout_rate=0.0, stack_d_model=8,
                            num_mem_heads=2, stack_slots=4, laurel_lr_rank=4, use_token_generator=False,
                            use_spelling_bee_embeddings=False, max_position_embeddings=CONTEXT)),
    "shell_elastic": (shell_elastic, dict(vocab_size=64, num_hidden_layers=1, hidden_size=64, head_dim=16,
                                          base_width=16, mlp_base_width=32, widths=(1, 2, 4), tiers=("s", "m", "l"),
                                          mlp_output_divisor=2.0, max_position_embeddings=CONTEXT)),
    "shram": (shram, dict(vocab_size=64, embedding_width=32, mlp_width=48, num_decoder_layers=1,
                          num_sliding_window_heads=2, num_mosrah_heads=4, num_selected_heads=2, head_dim=8,
                          window_size=3, training_sequence_length=CONTEXT)),
}


@pytest.mark.parametrize("name", RECIPES)
def test_a_context_past_the_configured_length_is_a_shape_error(name):
    module, fields = RECIPES[name]
    model = module.build(dataclasses.replace(module.CONFIG(), **fields), backend="reference").eval()
    ids = torch.randint(0, 64, (2, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(ids[:, :CONTEXT]).logits.shape[:2] == (2, CONTEXT)      # the whole context is fine
        with pytest.raises(ShapeError, match=f"exceed the context max_positions={CONTEXT}"):
            model(ids)
        cache = model(ids[:, :CONTEXT], cache=model.empty_cache(ids.shape[0])).cache
        with pytest.raises(ShapeError, match=f"{CONTEXT} cached \\+ 1 new tokens exceed"):
            model(ids[:, CONTEXT:], cache=cache)
