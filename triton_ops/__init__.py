"""laminae.triton_ops: Triton forward/backward kernels, one file per mechanism.

Each public function has the signature of its ``*_reference`` twin in
``laminae.primitives`` and is differentiable (registered with
``torch.library.triton_op`` + ``register_autograd``).

Exports load lazily: importing this package does not import triton, so
``TRITON_INTERPRET`` can still be set (the tour and the tests do) before the
first kernel is defined.
"""
from importlib import import_module

_EXPORTS = {
    "affine_scaled_attention": "affine_scaled_attention",
    "derf_attention": "derf",
    "derf_context_gate": "derf",
    "elo_attention": "elo_attention",
    "engram_fusion": "engram",
    "engram_fusion_gate": "engram",
    "engram_lookup": "engram",
    "flash_attention": "_flash",
    "hrm_refinement": "hrm_refinement",
    "laurel": "laurel",
    "leviathan": "leviathan",
    "leviathan_spline": "leviathan",
    "lucid_attention": "lucid_attention",
    "memory_caching": "memory_caching",
    "mom_read": "mom_read",
    "siamese_boundary": "siamese_norm",
    "spelling_bee": "spelling_bee",
    "stack_memory": "stack_memory",
    "stack_scan": "stack_memory",
    "stack_step": "stack_memory",
    "xsa": "xsa",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
