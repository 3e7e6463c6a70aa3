"""NeoLLM, built from the mechanisms its configuration documents (no modelling code is
public; spec/recipes.md §1):

    token_generator (Leviathan; untied head)  or  embed_tokens
    [spelling_bee]                                       e = ½(e + byte spelling)
    └─ × num_hidden_layers, residual flow by configuration:
       SiameseNorm (default): X = Y = e; each layer fuses s⊙X + RMSNorm(Y) → RMSNorm → h
       pre-norm:  x ← x + f(norm(x))  or  LAuReL: x ← α·f + β·(x + BAx)  (RW / LR / RW+LR)
       attention on h·lns → [StackMemory] → GQA, partial RoPE (last ⌊D·factor⌋ dims),
                 core SDPA | LUCID | affine-scaled, optional XSA (‖v‖² + eps form)
       mlp on h·lns → SwiGLU
    SiameseNormFinal(X, Y)  or  RMSNorm → lm_head

lns = 1/√(ℓ+1) with LayerNorm Scaling (``use_lns``), 1 otherwise.
Loss: CE over shifted labels, MiLe-reweighted (``use_mile_loss``) + μ-loss
(``use_mu_loss``) + the StackMemory entropy term in training.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from laminae.primitives import ConfigError
from laminae.primitives.affine_scaled_attention import AffineScaledAttention
from laminae.recipes.assembly.decoder import CausalLM
from laminae.primitives.blocks.gqa import GroupedQueryAttention
from laminae.primitives.laurel import LAuReL
from laminae.primitives.leviathan import LeviathanGenerator
from laminae.primitives.blocks.losses import IGNORE_INDEX, shift_labels
from laminae.primitives.lucid_attention import LucidAttention
from laminae.primitives.blocks.norms import RMSNorm
from laminae.primitives.blocks.rotary import RotaryEmbedding
from laminae.primitives.siamese_norm import SiameseNormFinal, SiameseNormLayer
from laminae.primitives.spelling_bee import SpellingBeeEmbedding
from laminae.primitives.stack_memory import StackMemory
from laminae.recipes.assembly.stream_decoder import AttentionSublayer, PreNormLayer, ScaledSublayer, StreamDecoderModel
from laminae.primitives.blocks.swiglu import SwiGLU
from laminae.primitives.xsa import ExclusiveSelfAttention

from ._keymap import KeyMap, load_state_dict
from ._neollm_config import UNSPECIFIED, NeoLLMConfig, check_config, required_changes, unsupported

__all__ = ["CONFIG", "NeoLLMConfig", "UNSPECIFIED", "unsupported", "required_changes", "build", "loss",
           "mile_weights", "load_reference_state_dict", "GENERATOR_KEYS"]


def _attention(c: NeoLLMConfig, layer_idx: int, backend: str) -> AttentionSublayer:
    H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    core: str | nn.Module = "sdpa"
    if c.use_lucid_attention:
        core = LucidAttention(H, Hkv, D, lucid_attention_eps=c.lucid_attention_eps, backend=backend)
    elif c.use_affine_scaled_attention:
        core = AffineScaledAttention(c.hidden_size, H, Hkv, D, affine_momentum=c.affine_momentum,
                                     initializer_range=c.initializer_range, backend=backend)
    attn = GroupedQueryAttention(c.hidden_size, H, Hkv, D, core=core,
                                 rope=RotaryEmbedding(int(D * c.partial_rotary_factor), c.rope_theta),
                                 xsa=c.use_xsa, dropout=c.attention_dropout, bias=c.attention_bias,
                                 initializer_range=c.initializer_range, backend=backend)
    if c.use_xsa:   # the seed's form: y − (y·v)/(‖v‖² + eps)·v
        attn.xsa = ExclusiveSelfAttention(H, Hkv, D, mode="squared_norm", eps=c.xsa_eps, backend=backend)
    stack = None
    if c.use_stack_memory:
        stack = StackMemory(c.hidden_size, c.stack_d_model, c.num_mem_heads, c.stack_slots,
                            c.stack_memory_cache_size, c.stack_entropy_loss_weight, backend=backend)
    return AttentionSublayer(attn, layer_idx, stack, _lns(c, layer_idx))


def _lns(c: NeoLLMConfig, layer_idx: int) -> float:
    return 1.0 / math.sqrt(layer_idx + 1) if c.use_lns else 1.0


def _layer(c: NeoLLMConfig, i: int, backend: str) -> nn.Module:
    attn = _attention(c, i, backend)
    mlp = ScaledSublayer(SwiGLU(c.hidden_size, c.intermediate_size, initializer_range=c.initializer_range),
                         _lns(c, i))
    if c.use_siamesenorm:
        return SiameseNormLayer(c.hidden_size, i, attn, mlp, normalized_input=c.siamese_normalized_input,
                                depth_scaling=c.siamese_depth_scaling, attn_x_scale_init=c.siamese_attn_x_scale_init,
                                use_attn_y_norm=i > 0 or c.use_embedding_input_norm, eps=c.rms_norm_eps,
                                dropout=c.dropout_rate, backend=backend)

    def norm():
        return RMSNorm(c.hidden_size, c.rms_norm_eps, upcast=True)

    def laurel():
        return LAuReL(c.hidden_size, c.use_laurel_rw, c.use_laurel_lr, c.laurel_lr_rank, backend=backend) \
            if c.use_laurel else None

    first = norm() if i > 0 or c.use_embedding_input_norm else nn.Identity()
    return PreNormLayer(attn, mlp, first, norm(), laurel(), laurel(), dropout=c.dropout_rate)


def build(config: NeoLLMConfig, backend: str = "auto") -> CausalLM:
    """The model for ``config``; one ConfigError listing every flag this toolkit lacks
    (:data:`UNSPECIFIED`), unsupported value and combination the seed forbids
    (``NeoLLMConfig.buildable()`` is the seed's defaults made buildable). With Spelling Bee, set its byte table
    (``model.model.spelling_bee.set_byte_table_from_strings``) before the first forward."""
    c = config
    check_config(c)
    if c.use_token_generator:
        embed = ("token_generator", LeviathanGenerator(
            c.vocab_size, c.hidden_size, c.generator_d_seed, c.generator_num_modes, c.generator_num_knots,
            c.generator_spline_degree, c.generator_k, c.generator_krank, c.initializer_range, backend=backend))
    else:
        table = nn.Embedding(c.vocab_size, c.hidden_size)
        nn.init.normal_(table.weight, std=c.initializer_range)
        embed = ("embed_tokens", table)
    bee = SpellingBeeEmbedding(c.vocab_size, c.hidden_size, c.rope_theta, initializer_range=c.initializer_range,
                               backend=backend) if c.use_spelling_bee_embeddings else None
    final = SiameseNormFinal(c.hidden_size, c.rms_norm_eps, backend=backend) if c.use_siamesenorm \
        else RMSNorm(c.hidden_size, c.rms_norm_eps, upcast=True)
    model = StreamDecoderModel(embed, [_layer(c, i, backend) for i in range(c.num_hidden_layers)], final,
                               c.hidden_size, spelling_bee=bee, max_positions=c.max_position_embeddings)
    lm = CausalLM(model, c.vocab_size, tie_word_embeddings=c.tie_word_embeddings,
                  initializer_range=c.initializer_range)
    lm.config = c
    return lm


def mile_weights(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """MiLe token weights (1 + H(p))^γ, H = LSE − E_p[logit] (fp32), detached and divided
    by their mean over valid labels; 0 where ``labels`` is ignored."""
    z = logits.detach().float()
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    valid = labels != IGNORE_INDEX
    w = torch.where(valid, (1.0 + entropy) ** gamma, torch.zeros_like(entropy))
    return w / (w.sum() / valid.sum().clamp_min(1)).clamp_min(1e-12)


def loss(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
         attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """NeoLLM's objective for ``labels`` in the seed's convention (``labels = input_ids``,
    shifted here): mean over valid labels of w·NLL (w = MiLe weights, 1 without MiLe)
    + λ_μ·‖mean of the lm_head rows‖² + (training) λ_St·mean stack-action entropy.
    Returns ``(loss, LMOutput)``."""
    c = model.config
    out = model(input_ids, attention_mask)
    labels = shift_labels(input_ids if labels is None else labels)
    if attention_mask is not None:
        labels = torch.where(shift_labels(attention_mask.long(), ignore_index=0).bool(), labels,
                             torch.full_like(labels, IGNORE_INDEX))
    nll = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none").view_as(labels)
    valid = (labels != IGNORE_INDEX).float()
    weights = mile_weights(out.logits, labels, c.mile_loss_gamma) if c.use_mile_loss else valid
    value = (weights * nll).sum() / valid.sum().clamp_min(1)
    if c.use_mu_loss:
        value = value + c.mu_loss_lambda * model.lm_head.weight.float().mean(0).pow(2).sum()
    if model.training and c.use_stack_memory:
        value = value + out.aux_loss
    return value, out


GENERATOR_KEYS = ("codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias", "head_spline_delta",
                  "head_out_weight")


def load_reference_state_dict(model: CausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load the pinned part of a ``NeoLLMForCausalLM`` state dict: the Leviathan generator
    (``model.token_generator.*``, spec/leviathan.md). Nothing else can be pinned without
    the modelling code, so any other key raises ConfigError naming it; the rest of
    the model keeps its initialisation."""
    if not model.config.use_token_generator:
        raise ConfigError("NeoLLM: only the token generator's names are pinned; this model has none")
    prefix = "model.token_generator."
    other = [k for k in state_dict if not k.startswith(prefix)]
    if other:
        raise ConfigError(f"NeoLLM: keys {other} have no pinned name (only {prefix}{{{', '.join(GENERATOR_KEYS)}}} "
                          "are known); the modelling code is not public")
    load_state_dict(model.model.token_generator, {k[len(prefix):]: v for k, v in state_dict.items()}, KeyMap())


CONFIG = NeoLLMConfig
