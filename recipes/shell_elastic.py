"""ShellElastic: one supernet, every tier from one set of weights (MatFormer or Fully elastic).

    x = embed_tokens[ids][..., :n]                     tier τ: width n, FFN width h
    └─ × num_hidden_layers
       ├─ x += attn(attn_norm(x))     q/k/v/gate blocks, per-head QK RMSNorm, RoPE
       │                              (bf16-rounded tables by default), causal SDPA,
       │                              ⊙ σ(gate), o_proj block
       └─ x += mlp(mlp_norm(x))       down(SiLU(gate x) ⊙ up x) / e
    norm → Readout (α_τ · W_τ) → fp32 logits

Fully elastic: n = s·g, h = s·F₀, fan-in ratio r = s on every matrix, one α per tier.
MatFormer: n = D, h = s·F₀, r = s on ``mlp.down_proj`` only, one shared α.
Loss: mean CE over already-shifted labels (−100 ignored); summed over ``tiers`` for
multi-tier training. ``model.extract(tier)`` is a dense model with the tier's logits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from laminae.primitives import ConfigError
from laminae.recipes.assembly.elastic_decoder import ElasticCausalLM
from laminae.primitives.blocks.losses import cross_entropy, shift_labels
from laminae.primitives.shared_matrix import MATRICES, ElasticTiers

from ._config import config_from_seed
from ._keymap import KeyMap, load_state_dict, reference_tensors

__all__ = ["CONFIG", "ShellElasticConfig", "build", "loss", "load_reference_state_dict", "reference_parameters"]


@dataclass
class ShellElasticConfig:
    """Defaults: the seed's ``ElasticConfig`` (Fully elastic, 32 layers, D 640, g 64, head_dim
    64, widths 6..10, FFN base 256, e 4, V 50432, context 2048)."""

    variant: str = "fully_elastic"
    vocab_size: int = 50432
    num_hidden_layers: int = 32
    hidden_size: int = 640
    head_dim: int = 64
    base_width: int | None = 64
    mlp_base_width: int = 256
    widths: tuple[int, ...] = (6, 7, 8, 9, 10)
    tiers: tuple[str, ...] = ("low", "medium", "high", "extra", "max")
    mlp_output_divisor: float = 4.0
    split_matrices: tuple[str, ...] = MATRICES
    rope_theta: float = 10000.0
    rope_precision: str = "bfloat16"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    init_trainable: bool = True          # the seed trains ``init`` with ``delta``

    def __post_init__(self) -> None:
        for name in ("widths", "tiers", "split_matrices"):
            setattr(self, name, tuple(getattr(self, name)))
        if self.tie_word_embeddings:
            raise ConfigError("ShellElastic: tie_word_embeddings=True is not supported (the Readout is its own matrix)")

    @property
    def elastic_tiers(self) -> ElasticTiers:
        names = {f.name for f in dataclasses.fields(ElasticTiers)}
        return ElasticTiers(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    @classmethod
    def from_seed_config(cls, seed: Mapping[str, Any]) -> "ShellElasticConfig":
        """The seed's ``ElasticConfig`` fields (``config.json`` of a checkpoint)."""
        return config_from_seed(cls, seed, ignored={"tokenizer": "no numerical effect",
                                                    "architectures": "no numerical effect",
                                                    "torch_dtype": "no numerical effect"},
                                allowed={"rope_precision": ("bfloat16", "float32"), "tie_word_embeddings": (False,)})


def build(config: ShellElasticConfig, backend: str = "auto", *, base_init: bool = True) -> ElasticCausalLM:
    """The supernet; ``base_init`` draws every matrix at 1/sqrt(base fan-in) (from scratch)."""
    c = config
    lm = ElasticCausalLM(c.elastic_tiers, c.vocab_size, c.num_hidden_layers, eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, rope_precision=c.rope_precision,
                         max_positions=c.max_position_embeddings, init_trainable=c.init_trainable,
                         base_init=base_init, backend=backend)
    lm.config = c
    return lm


def loss(model: ElasticCausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
         attention_mask: torch.Tensor | None = None, tier: str | None = None,
         tiers: Sequence[str] | None = None) -> tuple[torch.Tensor, Any]:
    """Mean CE of ``tier`` (default the widest) on the seed's already-shifted ``labels``
    (default: ``input_ids`` shifted here). ``tiers``: the sum of those tiers' losses
    (multi-tier step; the output returned is the last tier's)."""
    targets = shift_labels(input_ids) if labels is None else labels
    if attention_mask is not None:
        targets = torch.where(attention_mask.bool(), targets, torch.full_like(targets, -100))
    value, out = None, None
    for t in (tiers or [tier]):
        out = model(input_ids, attention_mask, tier=t)
        ce = cross_entropy(out.logits, targets)
        value = ce if value is None else value + ce
    return value, out


KEYMAP = KeyMap()   # the module names are the seed's


def load_reference_state_dict(model: ElasticCausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load an ``ElasticForCausalLM`` state dict (``init``/``delta`` or ``weight`` per matrix). Strict."""
    load_state_dict(model, dict(state_dict), KEYMAP)


def reference_parameters(model: ElasticCausalLM, seed_keys) -> dict:
    return reference_tensors(model, seed_keys, KEYMAP)


CONFIG = ShellElasticConfig
