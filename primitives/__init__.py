"""laminae.primitives: each mechanism's nn.Module and its plain-PyTorch reference, and (in
blocks/) the generic building blocks models wire them with.

Importing this package never imports Triton; the kernels load lazily on first use
of ``backend="triton"`` (or "auto" on CUDA)."""
from ._backend import BACKENDS, resolve_backend, set_backend, use_backend
from ._cache import AppendBuffer, DecodingCache, KVCache
from ._outputs import BlockOutput
from ._errors import BackendUnavailableError, ConfigError, DeviceError, DTypeError, ShapeError, TokenIdError
from .affine_scaled_attention import AffineScaledAttention, AffineScaledAttentionCache, affine_scaled_attention_reference
from .derf import DERFAttention, DERFCache, DERFContextGate, derf_attention_reference, derf_context_gate_reference
from .elo_attention import EloAttention, EloAttentionCache, elo_attention_reference
from .engram import (EngramCache, EngramLayerFusion, EngramModule, MultiHeadHashLookup, TokenCompressor,
                     engram_fusion_gate_reference, engram_lookup_reference)
from .hrm_refinement import HRMRefinementBlock, HRMRefinementOutput, hrm_refinement_reference
from .laurel import LAuReL, LAuReLBlock, laurel_reference
from .leviathan import LeviathanGenerator, leviathan_reference
from .lucid_attention import LucidAttention, LucidCache, lucid_attention_reference
from .memory_caching import MemoryCacheBranch, MemoryCachingCache, memory_caching_reference
from .mom_read import MoMRead, MoMReadCache, mom_read_reference
from .mosrah import (BottleneckedEnsembleAttention, MoSRAH, MoSRAHCache, MoSRAHOutput, MoSRAHRouter,
                     mosrah_reference)
from .shared_matrix import ElasticTiers, Readout, SharedMatrix, extract_tier, save_subnetwork, shared_matrix_reference
from .siamese_norm import SiameseNormFinal, SiameseNormLayer, SiameseStreams, siamese_boundary_reference, siamese_start
from .spelling_bee import SpellingBeeEmbedding, byte_table_from_strings, spelling_bee_reference
from .stack_memory import (StackMemory, StackMemoryCache, StackMemoryOutput, StackMemoryState, stack_memory_reference,
                           stack_scan_reference, stack_step_reference)
from .xsa import ExclusiveSelfAttention, xsa_reference

from .blocks import (AttentionOutput, GroupedQueryAttention, GroupedSwiGLU, HCOutputMix, HyperConnection, RMSNorm,
                     RotaryEmbedding, SlidingWindowAttention, SlidingWindowCache, SparseMoE, SwiGLU, abstention_loss,
                     apply_rotary, cross_entropy, expand_streams, rms_norm, rope_inv_freq, rotary_embedding, sdpa_core,
                     shift_labels, yarn_rope, z_loss)
from .blocks.moe import MoEOutput

__all__ = [
    "BACKENDS", "resolve_backend", "set_backend", "use_backend",
    "AppendBuffer", "BlockOutput", "DecodingCache", "KVCache",
    "BackendUnavailableError", "ConfigError", "DeviceError", "DTypeError", "ShapeError", "TokenIdError",
    "AffineScaledAttention", "AffineScaledAttentionCache", "affine_scaled_attention_reference",
    "DERFAttention", "DERFCache", "DERFContextGate", "derf_attention_reference", "derf_context_gate_reference",
    "EloAttention", "EloAttentionCache", "elo_attention_reference",
    "EngramCache", "EngramLayerFusion", "EngramModule", "MultiHeadHashLookup", "TokenCompressor",
    "engram_fusion_gate_reference", "engram_lookup_reference",
    "HRMRefinementBlock", "HRMRefinementOutput", "hrm_refinement_reference",
    "LAuReL", "LAuReLBlock", "laurel_reference",
    "LeviathanGenerator", "leviathan_reference",
    "LucidAttention", "LucidCache", "lucid_attention_reference",
    "MemoryCacheBranch", "MemoryCachingCache", "memory_caching_reference",
    "MoMRead", "MoMReadCache", "mom_read_reference",
    "BottleneckedEnsembleAttention", "MoSRAH", "MoSRAHCache", "MoSRAHOutput", "MoSRAHRouter", "mosrah_reference",
    "ElasticTiers", "Readout", "SharedMatrix", "extract_tier", "save_subnetwork", "shared_matrix_reference",
    "SiameseNormFinal", "SiameseNormLayer", "SiameseStreams", "siamese_boundary_reference", "siamese_start",
    "SpellingBeeEmbedding", "byte_table_from_strings", "spelling_bee_reference",
    "StackMemory", "StackMemoryCache", "StackMemoryOutput", "StackMemoryState", "stack_memory_reference",
    "stack_scan_reference", "stack_step_reference",
    "ExclusiveSelfAttention", "xsa_reference",
    # generic building blocks (primitives/blocks/)
    "AttentionOutput", "GroupedQueryAttention", "sdpa_core",
    "HCOutputMix", "HyperConnection", "expand_streams",
    "abstention_loss", "cross_entropy", "shift_labels", "z_loss",
    "GroupedSwiGLU", "MoEOutput", "SparseMoE",
    "RMSNorm", "rms_norm",
    "RotaryEmbedding", "apply_rotary", "rope_inv_freq", "rotary_embedding", "yarn_rope",
    "SlidingWindowAttention", "SlidingWindowCache",
    "SwiGLU",
]
