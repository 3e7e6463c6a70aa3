"""SpikeWhaleLM v2: an MLA-style decoder where every optional feature sits behind a flag.

    embed_tokens ──(value embedding: token_embed)
    [Engram: n-gram hash read, DERF-gated, added to x; the raw read feeds fusion layers]
    [hyper-connections: x → hc_mult streams]
    for (layer, pass) in layer_plan(...)              looped stack, + loop_pass_embed[pass]
       h = hc_attn.pre(x) | x   (+ tanh(ve_gate)·token_embed)
       a = attn(attn_norm(h))     q_b(q_a_norm(q_a(x))), GQA k/v, QK-norm, nope|rope RoPE,
                                  depth attention, core SDPA | DERF | Elo, XSA, o_b(o_a(y))
         + tanh(mc_gate)·mc(mc_norm(h))               memory-cache branch
       x = hc_attn.post(x, a) | h + a
       f = ffn(ffn_norm(hc_ffn.pre(x) | x))           MoE (hash / routed, shared) or SwiGLU
       x = hc_ffn.post(x, f) | x + f
       [x = engram_fusion(x, ngram=ngram)]
    [hc_out_mix] → [hrm_refine] → norm → lm_head   (+ MTP heads, abstain head)

Loss: CE (mean of the refinement steps' CEs with deep supervision in training)
+ abstain_loss_weight·BCE + zloss_coef·z-loss + mtp_loss_weight·MTP CE + MoE aux.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from laminae.primitives import ConfigError, DERFAttention, EloAttention
from laminae.recipes.assembly.decoder import Branch, CausalLM, DecoderModel, ResidualBlock, layer_plan
from laminae.primitives.engram import EngramLayerFusion, EngramModule
from laminae.primitives.blocks.gqa import GroupedQueryAttention
from laminae.primitives.hrm_refinement import HRMRefinementBlock
from laminae.primitives.blocks.losses import abstention_loss, cross_entropy, shift_labels, z_loss
from laminae.primitives.memory_caching import MemoryCacheBranch
from laminae.primitives.blocks.moe import SparseMoE
from laminae.recipes.assembly.mtp import MTPHead, mtp_loss
from laminae.primitives.blocks.norms import RMSNorm
from laminae.primitives.blocks.rotary import RotaryEmbedding
from laminae.primitives.blocks.swiglu import SwiGLU

from ._keymap import KeyMap, load_state_dict, reference_tensors
from ._spikewhale_config import SpikeWhaleConfig

__all__ = ["CONFIG", "SpikeWhaleConfig", "build", "loss", "load_reference_state_dict", "reference_parameters"]


def _check(c: SpikeWhaleConfig) -> None:
    if c.nope_head_dim + c.qk_rope_head_dim != c.head_dim:
        raise ConfigError(f"nope_head_dim + qk_rope_head_dim must equal head_dim={c.head_dim}, "
                          f"got {c.nope_head_dim} + {c.qk_rope_head_dim}")
    if c.attention_dropout and (c.use_elo or c.use_derf):
        raise ConfigError("attention_dropout > 0 is supported on the SDPA core only (use_elo/use_derf are on)")
    if c.use_fractal_rope and c.fractal_rope_gamma != 0.0:
        warnings.warn("use_fractal_rope with gamma != 0: the fractal spectrum (the seed's fractal.py) is not "
                      "public; standard frequencies are built, load a checkpoint for its tables", stacklevel=3)


def _attention(c: SpikeWhaleConfig, i: int, backend: str) -> GroupedQueryAttention:
    core: Any = "sdpa"
    if c.use_elo:
        core = EloAttention(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.elo_k_init, backend=backend)
    elif c.use_derf:
        core = DERFAttention(c.num_attention_heads, c.num_key_value_heads, c.head_dim, backend=backend)
    rope = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.max_position_embeddings, persistent=True)
    depth = c.use_depth_attention
    attn = GroupedQueryAttention(
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, core=core, rope=rope,
        q_lora_rank=c.q_lora_rank, o_lora_rank=c.o_lora_rank, qk_norm=c.use_qk_norm, norm_eps=c.rms_norm_eps,
        norm_upcast=False, xsa=c.use_xsa, depth_gate=depth and i > 0,
        depth_source=depth and i % max(1, c.depth_attention_stride) == 0, dropout=c.attention_dropout,
        initializer_range=c.initializer_range, backend=backend)
    if c.use_elo and c.use_derf:
        # the seed takes the Elo branch and never reads DERF's parameters: kept so checkpoints load
        attn.add_module("derf_unused", DERFAttention(c.num_attention_heads, c.num_key_value_heads, c.head_dim))
    return attn


def _ffn(c: SpikeWhaleConfig, i: int) -> nn.Module:
    if c.use_moe and i in c.moe_layers:
        return SparseMoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                         num_shared_experts=c.n_shared_experts, scoring=c.scoring_func,
                         normalize_top_k=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
                         hash_routing=i < c.num_hash_layers, aux_loss_coef=c.moe_aux_loss_coef,
                         initializer_range=c.initializer_range)
    return SwiGLU(c.hidden_size, c.moe_intermediate_size, initializer_range=c.initializer_range)


def _layer(c: SpikeWhaleConfig, i: int, backend: str) -> ResidualBlock:
    def norm():
        return RMSNorm(c.hidden_size, c.rms_norm_eps, upcast=False)

    attention = [Branch("attn", _attention(c, i, backend), norm())]
    if c.use_memory_cache:
        mc = MemoryCacheBranch(c.hidden_size, c.mc_num_heads, c.mc_head_dim, c.mc_segment_len, c.mc_gate_dim,
                               backend=backend)
        attention.append(Branch("mc", mc, norm(), gate=True))
    fusion = None
    if c.use_engram and i in (c.engram_fusion_layers or ()):
        fusion = ("engram_fusion", EngramLayerFusion(c.hidden_size, c.engram_fusion_dim, c.rms_norm_eps,
                                                     backend=backend))
    return ResidualBlock([attention, [Branch("ffn", _ffn(c, i), norm())]],
                         hyper_connections=["hc_attn", "hc_ffn"] if c.use_hyper_connections else None,
                         hc_mult=c.hc_mult, injection=("ve_gate", "token_embed") if c.use_value_embed else None,
                         post=fusion, dropout=c.hidden_dropout)


def build(config: SpikeWhaleConfig, backend: str = "auto") -> CausalLM:
    c = config
    _check(c)
    embed = nn.Embedding(c.vocab_size, c.hidden_size)
    nn.init.normal_(embed.weight, std=c.initializer_range)
    plan = layer_plan(c.num_hidden_layers, max(1, c.loop_count), c.loop_mode, c.loop_middle_layers)
    engram = (EngramModule(c.hidden_size, c.engram_compress_dim, c.engram_num_heads, c.engram_table_size,
                           c.engram_max_ngram, c.engram_gate_init_bias, c.engram_legacy_hash, backend=backend)
              if c.use_engram else None)
    hrm = (HRMRefinementBlock(c.hidden_size, c.hrm_refine_dim, c.hrm_refine_steps, c.rms_norm_eps,
                              c.hrm_gate_init, backend=backend) if c.use_hrm_refine else None)
    model = DecoderModel(
        embed, [_layer(c, i, backend) for i in range(c.num_hidden_layers)],
        RMSNorm(c.hidden_size, c.rms_norm_eps, upcast=False), plan=plan,
        loop_pass_embed=c.loop_count > 1 and c.loop_pass_embed,
        hc_mult=c.hc_mult if c.use_hyper_connections else 1,
        input_stage=("engram", engram) if engram is not None else None, value_embedding=c.use_value_embed,
        refiner=("hrm_refine", hrm) if hrm is not None else None, deep_supervision=c.hrm_deep_supervision,
        max_positions=c.max_position_embeddings)   # the rotary tables' length
    if c.use_hyper_connections and plan[0][0] == 0 and sum(layer == 0 for layer, _ in plan) == 1:
        # identical streams make the first pre-mix weight-invariant: no gradient, frozen as in the seed
        model.layers[0].hc_attn.pre_weight.requires_grad_(False)
    lm = CausalLM(model, c.vocab_size, tie_word_embeddings=c.tie_word_embeddings,
                  initializer_range=c.initializer_range)
    if c.num_nextn_predict_layers > 0:
        lm.mtp_heads = nn.ModuleList(MTPHead(c.hidden_size) for _ in range(c.num_nextn_predict_layers))
    if c.use_abstain_head:
        lm.abstain_head = nn.Linear(c.hidden_size, 1)
        nn.init.zeros_(lm.abstain_head.weight)
        nn.init.zeros_(lm.abstain_head.bias)
    lm.config = c
    return lm


def loss(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
         attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """The seed's objective; ``labels`` unshifted (default ``input_ids``). Returns ``(loss, LMOutput)``."""
    c = model.config
    out = model(input_ids, attention_mask)
    labels = input_ids if labels is None else labels
    targets = shift_labels(labels)
    value = cross_entropy(out.logits, targets)
    if out.refine_states:      # deep supervision: the last state is the output itself
        steps = [value] + [cross_entropy(model.logits_fn(s), targets) for s in out.refine_states[:-1]]
        value = torch.stack(steps).mean()
    if c.use_abstain_head and c.abstain_loss_weight > 0:
        logit = model.abstain_head(out.hidden).squeeze(-1)
        value = value + c.abstain_loss_weight * abstention_loss(logit, out.logits, targets, c.abstain_pos_weight)
    if c.zloss_coef > 0:
        value = value + c.zloss_coef * z_loss(out.logits, targets)
    if c.num_nextn_predict_layers > 0 and c.mtp_loss_weight > 0:
        value = value + c.mtp_loss_weight * mtp_loss(model.mtp_heads, out.hidden, labels, model.logits_fn)
    return value + out.aux_loss, out


def _keymap(c: SpikeWhaleConfig) -> KeyMap:
    derf_home = "derf_unused" if c.use_elo else "core"
    return KeyMap(renames=[(r"\.attn\.(elo_\w+)$", r".attn.core.\1"), (r"\.attn\.(derf_\w+)$", rf".attn.{derf_home}.\1")],
                  stacks=[(r"^(?P<pre>.*\.ffn\.experts)\.(?P<idx>\d+)\.(?P<name>\w+)\.weight$", "{pre}.{name}")],
                  tied={"lm_head.weight": "model.embed_tokens.weight"} if c.tie_word_embeddings else {})


def load_reference_state_dict(model: CausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a ``SpikeWhaleLM`` state dict (rotary tables and Engram hyperplanes included). Strict."""
    load_state_dict(model, dict(state_dict), _keymap(model.config))


def reference_parameters(model: CausalLM, seed_keys) -> dict:
    return reference_tensors(model, seed_keys, _keymap(model.config))


CONFIG = SpikeWhaleConfig
