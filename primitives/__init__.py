"""laminae.primitives: each mechanism's nn.Module and its plain-PyTorch reference.

Importing this package never imports Triton; the kernels load lazily on first use
of ``backend="triton"`` (or "auto" on CUDA)."""
from ._backend import BACKENDS, resolve_backend
from ._errors import BackendUnavailableError, ConfigError, DeviceError, DTypeError, ShapeError
from .affine_scaled_attention import AffineScaledAttention, AffineScaledAttentionCache, affine_scaled_attention_reference
from .derf import DERFAttention, DERFCache, DERFContextGate, derf_attention_reference, derf_context_gate_reference
from .elo_attention import EloAttention, EloAttentionCache, elo_attention_reference
from .engram import (EngramLayerFusion, EngramModule, EngramState, MultiHeadHashLookup, TokenCompressor,
                     engram_fusion_gate_reference, engram_lookup_reference)
from .laurel import LAuReL, LAuReLBlock, laurel_reference
from .lucid_attention import LucidAttention, LucidCache, LucidCacheError, lucid_attention_reference
from .memory_caching import MemoryCacheBranch, MemoryCacheState, memory_caching_reference
from .mom_read import MoMRead, MoMReadState, mom_read_reference
from .mosrah import (BottleneckedEnsembleAttention, MoSRAH, MoSRAHCache, MoSRAHOutput, MoSRAHRouter,
                     mosrah_reference)
from .siamese_norm import SiameseNormFinal, SiameseNormLayer, siamese_boundary_reference, siamese_start
from .xsa import ExclusiveSelfAttention, xsa_reference

__all__ = [
    "BACKENDS", "resolve_backend",
    "BackendUnavailableError", "ConfigError", "DeviceError", "DTypeError", "ShapeError",
    "AffineScaledAttention", "AffineScaledAttentionCache", "affine_scaled_attention_reference",
    "DERFAttention", "DERFCache", "DERFContextGate", "derf_attention_reference", "derf_context_gate_reference",
    "EloAttention", "EloAttentionCache", "elo_attention_reference",
    "EngramLayerFusion", "EngramModule", "EngramState", "MultiHeadHashLookup", "TokenCompressor",
    "engram_fusion_gate_reference", "engram_lookup_reference",
    "LAuReL", "LAuReLBlock", "laurel_reference",
    "LucidAttention", "LucidCache", "LucidCacheError", "lucid_attention_reference",
    "MemoryCacheBranch", "MemoryCacheState", "memory_caching_reference",
    "MoMRead", "MoMReadState", "mom_read_reference",
    "BottleneckedEnsembleAttention", "MoSRAH", "MoSRAHCache", "MoSRAHOutput", "MoSRAHRouter", "mosrah_reference",
    "SiameseNormFinal", "SiameseNormLayer", "siamese_boundary_reference", "siamese_start",
    "ExclusiveSelfAttention", "xsa_reference",
]
