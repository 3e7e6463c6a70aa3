"""Naylis: a Llama decoder with a Mixture-of-Memory read between attention and MLP.

    embed_tokens
    └─ × num_hidden_layers
       ├─ x += self_attn(input_layernorm(x))            causal GQA, RoPE over the head
       ├─ x += mom(mom_norm(x), M_blocks=M_blocks)       MoM read of the shared bank
       └─ x += mlp(post_attention_layernorm(x))          SwiGLU
    norm → lm_head (tied to embed_tokens by default of the reference run)

Loss: summed CE over valid shifted labels / their count (or ``num_items``); in
training + ``mom_aux_weight`` · mean over layers of the MoM load-balance loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from laminae.primitives import ConfigError, MoMRead
from laminae.recipes.assembly.decoder import Branch, CausalLM, DecoderModel, ResidualBlock
from laminae.primitives.blocks.gqa import GroupedQueryAttention
from laminae.primitives.blocks.losses import cross_entropy, shift_labels
from laminae.primitives.mom_read import collect_mom_aux_loss
from laminae.primitives.blocks.norms import RMSNorm
from laminae.primitives.blocks.rotary import RotaryEmbedding
from laminae.primitives.blocks.swiglu import SwiGLU

from ._config import config_from_seed
from ._keymap import KeyMap, load_state_dict, reference_tensors

__all__ = ["CONFIG", "NaylisConfig", "build", "loss", "load_reference_state_dict", "reference_parameters", "KEYMAP"]


@dataclass
class NaylisConfig:
    """Defaults: the reference run (configs/naylisMoM.toml, cosmo2 tokenizer) where it
    pins a value, Hugging Face ``LlamaConfig`` otherwise."""

    vocab_size: int = 49152
    hidden_size: int = 1024
    intermediate_size: int = 1024
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None       # None: = num_attention_heads (MHA)
    head_dim: int | None = None                  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    mem_size: int = 1024
    mom_block_size: int = 128
    mom_top_blocks: int = 2
    mom_router_rank: int = 32
    mom_aux_weight: float = 0.01
    mom_noise_scale: float = 1.0
    hidden_act: str = "silu"

    @classmethod
    def from_seed_config(cls, seed: Mapping[str, Any]) -> "NaylisConfig":
        """``LlamaConfig`` keys plus the MoM keys of the seed's configuration."""
        if seed.get("attn_implementation", "sdpa") not in ("sdpa", "flash_attention_2"):
            raise ConfigError(f"Naylis: attn_implementation={seed['attn_implementation']!r} is not supported: "
                              "the seed passes no causal mask, so only its SDPA/flash paths are causal")
        no_effect = "no numerical effect"
        return config_from_seed(
            cls, seed,
            ignored={"use_cache": no_effect, "use_liger": "fused CE: same loss", "use_kernel": "backend choice",
                     "mom_grad_ckpt": "recompute is exact", "attn_implementation": "checked above",
                     "model_type": no_effect, "torch_dtype": no_effect, "bos_token_id": no_effect,
                     "eos_token_id": no_effect, "pad_token_id": no_effect, "pretraining_tp": no_effect},
            allowed={"hidden_act": ("silu",)})


def _layer(c: NaylisConfig, kv_heads: int, head_dim: int, backend: str) -> ResidualBlock:
    def norm():
        return RMSNorm(c.hidden_size, c.rms_norm_eps, upcast=True)

    attn = GroupedQueryAttention(c.hidden_size, c.num_attention_heads, kv_heads, head_dim,
                                 rope=RotaryEmbedding(head_dim, c.rope_theta), bias=c.attention_bias,
                                 initializer_range=c.initializer_range, backend=backend)
    mom = MoMRead(c.hidden_size, c.num_attention_heads, c.mem_size, c.mom_block_size, c.mom_top_blocks,
                  c.mom_router_rank, c.initializer_range, c.mom_noise_scale, backend=backend)
    mlp = SwiGLU(c.hidden_size, c.intermediate_size, initializer_range=c.initializer_range)
    return ResidualBlock([[Branch("self_attn", attn, norm(), "input_layernorm")],
                          [Branch("mom", mom, norm())],
                          [Branch("mlp", mlp, norm(), "post_attention_layernorm")]])


def build(config: NaylisConfig, backend: str = "auto") -> CausalLM:
    c = config
    kv_heads = c.num_key_value_heads or c.num_attention_heads
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    embed = nn.Embedding(c.vocab_size, c.hidden_size)
    nn.init.normal_(embed.weight, std=c.initializer_range)
    bank = nn.Parameter(MoMRead.init_bank(c.mem_size // c.mom_block_size, c.mom_block_size, c.hidden_size))
    model = DecoderModel(embed, [_layer(c, kv_heads, head_dim, backend) for _ in range(c.num_hidden_layers)],
                         RMSNorm(c.hidden_size, c.rms_norm_eps, upcast=True), shared={"M_blocks": bank},
                         max_positions=c.max_position_embeddings)
    lm = CausalLM(model, c.vocab_size, tie_word_embeddings=c.tie_word_embeddings,
                  initializer_range=c.initializer_range)
    lm.config = c
    return lm


def loss(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
         attention_mask: torch.Tensor | None = None, num_items: int | None = None) -> tuple[torch.Tensor, Any]:
    """The seed's objective for ``labels`` in its convention (``labels = input_ids``;
    the shift is done here). Returns ``(loss, LMOutput)``."""
    out = model(input_ids, attention_mask)
    labels = input_ids if labels is None else labels
    value = cross_entropy(out.logits, shift_labels(labels), num_items=num_items)
    if model.training:
        value = value + model.config.mom_aux_weight * collect_mom_aux_loss(model.modules(), value.device)
    return value, out


KEYMAP = KeyMap(legacy=[(r"\.graph_mem\.", ".mom."), (r"\.graph_norm\.", ".mom_norm."),
                        (r"graph_scale$", "mom_scale")],
                tied={"lm_head.weight": "model.embed_tokens.weight"})


def load_reference_state_dict(model: CausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a ``NaylisLlamaForCausalLM`` state dict (legacy ``graph_*`` names remapped;
    ``lm_head.weight`` may be absent when tied). Strict."""
    sd = dict(state_dict)
    keymap = KEYMAP if model.tie_word_embeddings else KeyMap(KEYMAP.legacy)
    load_state_dict(model, sd, keymap)


def reference_parameters(model: CausalLM, seed_keys) -> dict:
    keymap = KEYMAP if model.tie_word_embeddings else KeyMap(KEYMAP.legacy)
    return reference_tensors(model, seed_keys, keymap)


CONFIG = NaylisConfig
