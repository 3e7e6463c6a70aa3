"""NeoLLM configuration: the seed's ``NeoLLMConfig`` signature (names and defaults),
and which of its flags this toolkit implements."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from laminae.primitives import ConfigError

from ._config import config_from_seed

# Flags whose mechanism no source specifies (spec/recipes.md §1): a model built with one
# of them on would silently lack it, so building raises until the caller turns it off.
UNSPECIFIED = {
    "use_momentum_attention": "momentum shear of Q/K: no modelling code",
    "use_learnable_multipliers": "multiplier placement and init: no modelling code",
    "use_jtok": "JTok B-spline surface and its norm: no modelling code",
    "use_jtokm": "JTok-M mixture: no modelling code",
    "use_hadamard_o_proj": "Hadamard output projection α/β init: no modelling code",
    "use_repo": "REPO position module f_φ: no modelling code",
    "use_repo_grape": "REPO-GRAPE angular spectrum: no modelling code",
    "use_repo_goat_prior": "REPO-GOAT prior: no modelling code",
    "use_tweo": "which stream of a SiameseNorm block TWEO penalises: no modelling code",
    "use_nitp": "NITP projector and target wiring: no modelling code",
    "use_nitp_temporal": "NITP temporal transition: no modelling code",
    "use_nextlat": "NextLat dynamics model: no modelling code",
    "use_meap": "MEAP masking: no modelling code",
    "use_hola_memory": "HOLA episodic memory: no modelling code",
    "use_mea_attention": "MEA head mixing: no modelling code",
    "use_directional_routing": "directional routing: no modelling code",
    "use_attn_res": "attention residuals: no modelling code",
    "use_fan_residual": "FAN residual: no modelling code",
    "use_gpas": "GPAS: no modelling code",
    "use_iha": "interleaved head attention: no modelling code",
    "polynorm_exclusive": "where PolyNorm is used: no modelling code",
}
# Values other than these are not implemented (key -> supported values).
SUPPORTED_VALUES = {
    "hidden_act": ("silu",),                    # xIELU's form is unverified
    "rope_scaling": (None,),
    "ntp_loss_backend": ("cce", "liger"),       # both compute the same CE
    "generator_spline_degree": (2,),
}
# Keys without numerical effect here (key -> why).
NO_EFFECT = {k: "kernel/backend choice of the same loss" for k in
             ("use_liger_kernel", "cce_loss_impl", "liger_loss_accum_dtype", "jtok_kernel_backend",
              "meap_implementation")}
NO_EFFECT.update({k: "no numerical effect" for k in
                  ("model_type", "torch_dtype", "transformers_version", "architectures", "auto_map",
                   "bos_token_id", "eos_token_id", "pad_token_id", "use_cache")})


@dataclass
class NeoLLMConfig:
    """``NeoLLMConfig``'s constructor signature, defaults included (the signature wins
    over the docstring where they disagree, spec/recipes.md §1). Defaults switch on
    mechanisms this toolkit does not have (:data:`UNSPECIFIED`); :func:`unsupported`
    lists them and ``build`` refuses such a config."""

    vocab_size: int = 64402
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    hidden_act: str = "xielu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    ntp_loss_backend: str = "cce"
    use_liger_kernel: bool = False
    cce_loss_impl: str = "cce_kahan_full_c"
    use_mile_loss: bool = True
    mile_loss_gamma: float = 1.0
    use_mu_loss: bool = True
    mu_loss_lambda: float = 1e-4
    use_meap: bool = False
    meap_mask_ratio: float = 0.15
    meap_mask_token_id: Any = None
    meap_seed: int = 0
    meap_implementation: str = "triton"
    meap_exclude_last: bool = True
    liger_loss_accum_dtype: str = "float32"
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    attention_dropout: float = 0.1
    use_hola_memory: bool = False
    hola_memory_size: int = 64
    hola_chunk_size: int = 256
    hola_logit_bias_init: float = -2.0
    hola_rms_gamma_init: float = 1.0
    hola_score_eps: float = 1e-6
    head_dim: int = 64
    use_momentum_attention: bool = True
    momentum_gamma: float = 0.10
    use_mea_attention: bool = False
    mea_component_key_value_heads: Any = None
    mea_groupnorm_eps: float = 1e-6
    use_lucid_attention: bool = False
    lucid_attention_eps: float = 1e-6
    use_affine_scaled_attention: bool = False
    affine_momentum: float = 0.9
    use_xsa: bool = True
    xsa_eps: float = 1e-6
    use_directional_routing: bool = False
    directional_routing_k: int = 4
    directional_routing_temp: float = 3.0
    use_attn_res: bool = False
    attn_res_num_blocks: int = 4
    use_stack_memory: bool = False
    stack_d_model: int = 24
    num_mem_heads: int = 4
    stack_slots: int = 16
    stack_memory_cache_size: int = 2048
    stack_entropy_loss_weight: float = 1e-3
    use_fan_residual: bool = False
    fan_ratio: float = 0.125
    fan_ratio_ffn: float = 0.0625
    dropout_rate: float = 0.1
    use_learnable_multipliers: bool = True
    use_embedding_multipliers: bool = False
    use_lns: bool = True
    use_gpas: bool = False
    use_siamesenorm: bool = True
    siamese_normalized_input: bool = True
    siamese_depth_scaling: bool = True
    siamese_attn_x_scale_init: float = 1.0
    use_embedding_input_norm: bool = True
    use_token_generator: bool = True
    generator_d_seed: int = 128
    generator_num_modes: int = 8
    generator_num_knots: int = 16
    generator_spline_degree: int = 2
    generator_k: int = 3
    generator_krank: int = 64
    use_jtok: bool = True
    use_jtokm: bool = False
    jtok_num_modes: int = 4
    jtok_num_experts: int = 5
    jtok_top_k: int = 2
    jtok_norm_eps: float = 1e-6
    jtok_aux_loss_weight: float = 1e-4
    jtok_kernel_backend: str = "torch"
    use_hadamard_o_proj: bool = True
    polynorm_exclusive: bool = False
    use_spelling_bee_embeddings: bool = False
    use_repo: bool = True
    repo_start_layer: Any = None
    repo_d_p: Any = None
    use_repo_grape: bool = True
    use_repo_goat_prior: bool = False
    repo_goat_num_frequencies: int = 3
    repo_goat_sink_decay: float = 4.0
    use_laurel: bool = False
    use_laurel_rw: bool = False
    use_laurel_lr: bool = False
    laurel_lr_rank: int = 32
    use_tweo: bool = True
    tweo_loss_weight: float = 0.01
    tweo_tau: float = 3.0
    tweo_power: float = 4.0
    tweo_eps: float = 1e-6
    use_nitp: bool = True
    nitp_target_layer: Any = None
    nitp_loss_weight: float = 1.0
    nitp_projector_intermediate_size: Any = None
    use_nitp_temporal: bool = False
    nitp_temporal_apply_loss: bool = False
    nitp_temporal_horizon: int = 4
    nitp_temporal_dynamics_weight: float = 1.0
    nitp_temporal_identification_weight: float = 0.1
    nitp_temporal_intermediate_size: Any = None
    nitp_temporal_similarity_temperature: float = 0.1
    nitp_temporal_target_temperature: float = 0.5
    use_nextlat: bool = False
    nextlat_horizon: int = 1
    nextlat_mse_weight: float = 1.0
    nextlat_kl_weight: float = 1.0
    nextlat_dynamics_proj_factor: float = 1.0
    use_iha: bool = False
    iha_num_pseudo_heads: int = 2
    iha_local_global_pattern: str = "LLLLG"
    iha_sliding_window: Any = None
    iha_global_layers_use_iha: bool = False

    @classmethod
    def from_seed_config(cls, seed: Mapping[str, Any]) -> "NeoLLMConfig":
        """The seed's keys; unknown keys and unsupported values raise ConfigError naming them.
        ``tie_word_embeddings`` is forced off with the token generator, as the seed does."""
        config = config_from_seed(cls, seed, ignored=NO_EFFECT, allowed=SUPPORTED_VALUES)
        if config.use_token_generator:
            config.tie_word_embeddings = False
        return config

    @classmethod
    def buildable(cls, **changes: Any) -> "NeoLLMConfig":
        """The seed's defaults with every setting this toolkit lacks changed (the
        :data:`UNSPECIFIED` flags off, unsupported values such as ``hidden_act="xielu"``
        replaced by the supported one, see :func:`required_changes`), then ``changes``:
        the closest configuration to the seed's that ``build`` accepts.

        Example: ``build(NeoLLMConfig.buildable(hidden_size=256, num_hidden_layers=4))``."""
        return dataclasses.replace(cls(), **{**required_changes(cls()), **changes})


def unsupported(c: NeoLLMConfig) -> list[str]:
    """The flags of ``c`` that are on but not implemented here."""
    return [k for k in UNSPECIFIED if getattr(c, k)]


def required_changes(c: NeoLLMConfig) -> dict[str, Any]:
    """Setting → value for everything ``c`` sets that this toolkit lacks: the
    :data:`UNSPECIFIED` flags that are on (→ False) and values outside
    :data:`SUPPORTED_VALUES` (→ the supported one)."""
    changes: dict[str, Any] = {k: False for k in unsupported(c)}
    changes.update({k: values[0] for k, values in SUPPORTED_VALUES.items() if getattr(c, k) not in values})
    return changes


def _rule_violations(c: NeoLLMConfig) -> list[str]:
    """The seed's combination rules (and this toolkit's) that ``c`` breaks."""
    out = []
    flows = [k for k in ("use_laurel", "use_attn_res", "use_stack_memory", "use_siamesenorm") if getattr(c, k)]
    if len(flows) > 1 and set(flows) != {"use_stack_memory", "use_siamesenorm"}:
        out.append(f"at most one residual-flow mechanism may be on, except the pair use_stack_memory + "
                   f"use_siamesenorm; active: {flows}")
    if c.use_laurel and not (c.use_laurel_rw or c.use_laurel_lr):
        out.append("use_laurel=True needs use_laurel_rw and/or use_laurel_lr")
    cores = [k for k in ("use_lucid_attention", "use_affine_scaled_attention") if getattr(c, k)]
    if len(cores) > 1:
        out.append(f"one attention core at a time here, got {cores}")
    if c.use_token_generator and c.tie_word_embeddings:
        out.append("use_token_generator=True needs tie_word_embeddings=False (the head is untied)")
    rot = c.head_dim * c.partial_rotary_factor
    if rot != int(rot) or int(rot) % 2 or rot <= 0:
        out.append(f"head_dim·partial_rotary_factor = {rot} must be a positive even integer "
                   f"(head_dim={c.head_dim}, partial_rotary_factor={c.partial_rotary_factor})")
    return out


def check_config(c: NeoLLMConfig) -> None:
    """The seed's own rules plus :data:`UNSPECIFIED`/:data:`SUPPORTED_VALUES`: one
    ConfigError listing every setting to change and every rule broken."""
    lines = []
    for key, value in required_changes(c).items():
        why = UNSPECIFIED.get(key) or f"{getattr(c, key)!r} is not supported, only {list(SUPPORTED_VALUES[key])}"
        lines.append(f"  {key}={value!r}   ({why})")
    lines += [f"  {rule}" for rule in _rule_violations(c)]
    if lines:
        raise ConfigError(f"NeoLLM: this configuration does not build ({len(lines)} to fix):\n"
                          + "\n".join(lines) + "\nNeoLLMConfig.buildable(**fields) is the seed's defaults with "
                          "the unimplemented settings already changed.")
    if c.use_embedding_multipliers:
        # the seed's own warnings: the flag acts only with learnable multipliers on (never
        # here: they are refused above), a standard embedding matrix and an untied head
        reason = ("use_learnable_multipliers=False: no embedding multiplier parameters are created"
                  if not c.use_learnable_multipliers else
                  "use_token_generator=True replaces the embedding matrix with the Leviathan generator"
                  if c.use_token_generator else
                  "tie_word_embeddings=True: multipliers would break the input/output sharing")
        warnings.warn(f"NeoLLM: use_embedding_multipliers=True is inactive because {reason}", stacklevel=3)
