"""SpikeWhaleLM v2 configuration: the seed's ``SpikeWhaleConfig`` attribute names."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ._config import config_from_seed


@dataclass
class SpikeWhaleConfig:
    """The seed's ``SpikeWhaleConfig`` attributes. The seed's config.py is not public:
    defaults are the model code's fallbacks where it has them, small sizes otherwise."""

    vocab_size: int = 50304
    hidden_size: int = 512
    num_hidden_layers: int = 8
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    q_lora_rank: int = 256
    o_lora_rank: int = 256
    head_dim: int = 64
    nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    rope_theta: float = 10000.0
    use_qk_norm: bool = True
    use_derf: bool = False
    use_xsa: bool = False
    use_elo: bool = False
    elo_k_init: float = 1.0
    use_fractal_rope: bool = False
    fractal_rope_gamma: float = 0.0
    use_depth_attention: bool = False
    depth_attention_stride: int = 4
    use_engram: bool = False
    engram_compress_dim: int = 64
    engram_num_heads: int = 4
    engram_table_size: int = 4096
    engram_max_ngram: int = 3
    engram_gate_init_bias: float = -4.0
    engram_legacy_hash: bool = False
    engram_fusion_layers: list = dataclasses.field(default_factory=list)
    engram_fusion_dim: int = 256
    use_hyper_connections: bool = False
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    use_moe: bool = False
    moe_layers: list = dataclasses.field(default_factory=list)
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 1024
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    num_hash_layers: int = 0
    moe_aux_loss_coef: float = 0.01
    use_memory_cache: bool = False
    mc_num_heads: int = 4
    mc_head_dim: int = 32
    mc_segment_len: int = 64
    mc_gate_dim: int = 64
    use_value_embed: bool = False
    use_hrm_refine: bool = False
    hrm_refine_dim: int = 256
    hrm_refine_steps: int = 2
    hrm_gate_init: float = 1.0
    hrm_deep_supervision: bool = False
    loop_count: int = 1
    loop_mode: str = "full"
    loop_middle_layers: int | None = None
    loop_pass_embed: bool = True
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.3
    zloss_coef: float = 1e-4
    use_abstain_head: bool = False
    abstain_loss_weight: float = 0.1
    abstain_pos_weight: float = 8.0
    abstain_threshold: float = 0.6

    @classmethod
    def from_seed_config(cls, seed: Mapping[str, Any]) -> "SpikeWhaleConfig":
        return config_from_seed(cls, seed, ignored={"model_type": "no numerical effect",
                                                    "torch_dtype": "no numerical effect"},
                                allowed={"scoring_func": ("softmax", "sqrtsoftplus"),
                                         "loop_mode": ("full", "middle_split")})
