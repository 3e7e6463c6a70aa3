"""SHRAM: a Llama-3-style decoder whose every attention sub-layer is the hybrid
H(x) = h_l(x) + h_s(x): sliding-window local heads plus MoSRAH routed sparse heads.

    embed_tokens
    └─ × num_decoder_layers
       ├─ x += attention(attn_norm(x))     local: sliding-window MHA, RoPE θ_local,
       │                                   visibility by live rank (window W)
       │                                   sparse: MoSRAH router → pack → BEA with
       │                                   YaRN-capable RoPE → unpack → weighted sum
       └─ x += mlp(mlp_norm(x))            SwiGLU
    norm → lm_head

Positions J = cumulative live count − 1 ("main_sequence" feeds them to BEA;
"semantic_sequence" uses the slot index). Loss: ce_weight·CE (shifted, mean) +
load_balance_weight·Σ_layers LB, LB driving only ``expert_bias`` (custom gradient);
MaxVio (max over layers) in ``out.metrics["max_vio"]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from laminae.primitives import ConfigError, MoSRAH
from laminae.recipes.assembly.decoder import Branch, CausalLM, DecoderModel, ResidualBlock
from laminae.recipes.assembly.hybrid_attention import HybridAttention
from laminae.primitives.blocks.losses import cross_entropy, shift_labels
from laminae.primitives.blocks.norms import RMSNorm
from laminae.primitives.blocks.sliding_window import SlidingWindowAttention
from laminae.primitives.blocks.swiglu import SwiGLU

from ._config import config_from_seed
from ._keymap import KeyMap, load_state_dict, reference_tensors

__all__ = ["CONFIG", "ShramConfig", "build", "loss", "load_reference_state_dict", "reference_parameters"]


@dataclass
class ShramConfig:
    """Defaults: the seed's ``ShramConfig`` (smithblack-0/advanced-transformers-lib @ 95a0b97)."""

    vocab_size: int = 50277
    embedding_width: int = 512
    mlp_width: int = 1366
    num_decoder_layers: int = 12
    num_sliding_window_heads: int = 16
    num_mosrah_heads: int = 16
    num_selected_heads: int = 16
    head_dim: int = 16
    window_size: int = 128
    rope_mode: str = "main_sequence"
    rms_norm_eps: float = 1e-5
    local_rope_theta: float = 10000.0
    mosrah_rope_theta: float = 10000.0
    training_sequence_length: int = 1024
    inference_sequence_length: int | None = None   # None: = training_sequence_length (YaRN off)
    alpha: float = 1.0
    beta: float = 32.0
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    ce_weight: float = 1.0
    load_balance_weight: float = 0.01
    cache_horizon: str = "live_rank"               # "raw_slot": the public code's padded-decoding rule (E1)
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.attention_dropout:
            raise ConfigError(f"SHRAM: attention_dropout must be 0, got {self.attention_dropout}")

    @classmethod
    def from_seed_config(cls, seed: Mapping[str, Any]) -> "ShramConfig":
        """The seed's ``ShramConfig`` keys; the constructor aliases ``hidden_size``,
        ``intermediate_size`` and ``num_hidden_layers`` yield to the serialised names (E9)."""
        seed = dict(seed)
        for alias, name in (("hidden_size", "embedding_width"), ("intermediate_size", "mlp_width"),
                            ("num_hidden_layers", "num_decoder_layers")):
            if alias in seed:
                value = seed.pop(alias)
                seed.setdefault(name, value)
        no_effect = "no numerical effect"
        return config_from_seed(cls, seed, ignored={"use_cache": no_effect, "output_hidden_states": no_effect,
                                                    "model_type": no_effect, "architectures": no_effect,
                                                    "auto_map": no_effect, "torch_dtype": no_effect,
                                                    "transformers_version": no_effect},
                                allowed={"rope_mode": ("main_sequence", "semantic_sequence")})


def _layer(c: ShramConfig, backend: str) -> ResidualBlock:
    def norm():
        return RMSNorm(c.embedding_width, c.rms_norm_eps)

    local = SlidingWindowAttention(c.embedding_width, c.num_sliding_window_heads, c.head_dim, c.window_size,
                                   c.local_rope_theta, backend=backend)
    sparse = MoSRAH(c.embedding_width, c.num_mosrah_heads, c.num_selected_heads, c.head_dim, c.rope_mode,
                    c.mosrah_rope_theta, c.training_sequence_length, c.inference_sequence_length, c.alpha, c.beta,
                    cache_horizon=c.cache_horizon, init="whole_bank", backend=backend)
    mlp = SwiGLU(c.embedding_width, c.mlp_width, initializer_range=c.initializer_range)
    return ResidualBlock([[Branch("attention", HybridAttention(local, sparse), norm(), "attn_norm")],
                          [Branch("mlp", mlp, norm(), "mlp_norm")]])


def build(config: ShramConfig, backend: str = "auto") -> CausalLM:
    c = config
    embed = nn.Embedding(c.vocab_size, c.embedding_width)
    nn.init.normal_(embed.weight, std=c.initializer_range)
    model = DecoderModel(embed, [_layer(c, backend) for _ in range(c.num_decoder_layers)],
                         RMSNorm(c.embedding_width, c.rms_norm_eps),
                         max_positions=c.inference_sequence_length or c.training_sequence_length)   # the YaRN range
    lm = CausalLM(model, c.vocab_size, tie_word_embeddings=c.tie_word_embeddings,
                  initializer_range=c.initializer_range)
    lm.config = c
    return lm


def loss(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
         attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """``ce_weight·CE + load_balance_weight·Σ LB`` with ``labels`` unshifted (default
    ``input_ids``); the attention mask does not mask the CE (errata E4)."""
    c = model.config
    out = model(input_ids, attention_mask)
    labels = input_ids if labels is None else labels
    ce = cross_entropy(out.logits, shift_labels(labels))
    return c.ce_weight * ce + c.load_balance_weight * out.aux_loss, out


def _keymap(c: ShramConfig) -> KeyMap:
    return KeyMap(renames=[(r"^embed_tokens\.", "model.embed_tokens.")],
                  tied={"lm_head.weight": "model.embed_tokens.weight"} if c.tie_word_embeddings else {})


def load_reference_state_dict(model: CausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a ``ShramForCausalLM`` state dict (``embed_tokens``/``lm_head`` at the top
    level, ``model.layers.{i}.attention.{local,sparse}_attention…``). Strict."""
    load_state_dict(model, dict(state_dict), _keymap(model.config))


def reference_parameters(model: CausalLM, seed_keys) -> dict:
    return reference_tensors(model, seed_keys, _keymap(model.config))


CONFIG = ShramConfig
