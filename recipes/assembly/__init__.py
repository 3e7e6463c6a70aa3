"""laminae.recipes.assembly: how the recipes stack primitives into models (residual
blocks and decoder stacks, the causal LM head, SHRAM's hybrid attention, multi-token
prediction). Models exist only as recipes, so their assembly lives here."""
from .decoder import (BRANCH_CALLS, BlockContext, Branch, CausalLM, DecoderCache, DecoderModel, DecoderOutput,
                      LMOutput, ResidualBlock, layer_plan)
from .elastic_decoder import ElasticCausalLM
from .hybrid_attention import HybridAttention, HybridAttentionCache, HybridAttentionOutput
from .mtp import MTPHead, mtp_loss
from .stream_decoder import AttentionSublayer, PreNormLayer, ScaledSublayer, StreamDecoderModel

__all__ = [
    "BRANCH_CALLS", "BlockContext", "Branch", "CausalLM", "DecoderCache", "DecoderModel", "DecoderOutput", "LMOutput",
    "ResidualBlock", "layer_plan",
    "ElasticCausalLM",
    "HybridAttention", "HybridAttentionCache", "HybridAttentionOutput",
    "MTPHead", "mtp_loss",
    "AttentionSublayer", "PreNormLayer", "ScaledSublayer", "StreamDecoderModel",
]
