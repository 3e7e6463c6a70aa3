"""laminae.primitives.blocks: generic building blocks (norms, rotary embeddings, SwiGLU,
grouped-query attention, MoE, hyper-connections, losses, sliding-window attention),
written with PyTorch's own ops; the mechanisms beside this folder are what they wire in."""
from types import ModuleType as _ModuleType

from .gqa import AttentionOutput, GroupedQueryAttention, sdpa_core
from .hyper_connections import HCOutputMix, HyperConnection, expand_streams
from .losses import abstention_loss, cross_entropy, shift_labels, z_loss
from .moe import GroupedSwiGLU, MoEOutput, SparseMoE
from .norms import RMSNorm, rms_norm
from .rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotary_embedding, yarn_rope
from .sliding_window import SlidingWindowAttention, SlidingWindowCache
from .swiglu import SwiGLU

# every name imported above, once: the imports are the list
__all__ = [name for name, value in globals().items() if not name.startswith("_") and not isinstance(value, _ModuleType)]
