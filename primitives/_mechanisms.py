"""One declaration per mechanism: the single list a new mechanism joins.

From :data:`MECHANISMS` are derived ``laminae.primitives.__all__`` (the mechanism
part), the functional ops of ``laminae.triton_ops``, the tour's list
(``triton_ops/tour.py``), the stems the cross-cutting tests parametrise over and the
mechanism tables of README.md and docs/index.md (checked by
``tests/test_mechanisms.py``, which also fails a stem that lacks any of its files).
The tour case and the static sm_90 cases are found by convention in
``triton_ops/<stem>.py`` (``tour_case`` and ``static_cases``).

Pure data: the file imports no mechanism, no torch and no triton of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# What a module's forward looks like (docs/protocol.md, "The contract"); the kind
# decides whether it decodes.
CORE = "attention core"            # forward(q, k, v, attention_mask=None, cache=None, *, ...); empty_cache
SEQUENCE = "sequence block"        # forward(x, attention_mask=None, cache=None, *, ...); empty_cache
TOKEN = "token block"              # forward(input_ids[, attention_mask=None], *, ...)
POSITION_WISE = "position-wise block"   # forward(activation[, attention_mask=None], *, ...)
STREAMS = "two-stream container"   # forward(x, y, *, ...)
KINDS = (CORE, SEQUENCE, TOKEN, POSITION_WISE, STREAMS)
DECODING_KINDS = (CORE, SEQUENCE)


@dataclass(frozen=True)
class Mechanism:
    """``stem`` names every file of the mechanism (``primitives/<stem>.py``,
    ``triton_ops/<stem>.py``, ``tests/*/test_<stem>.py``, ``bench/test_<stem>.py``,
    ``docs/mechanisms/<stem>.md``); ``title`` is its row in the docs tables;
    ``modules`` maps each public ``nn.Module`` class to its kind; ``references`` are
    the ``*_reference`` functions and ``ops`` the functional ops in
    ``triton_ops/<stem>.py``; ``exports`` the other public names of
    ``primitives/<stem>.py`` that ``laminae.primitives`` re-exports (caches, outputs,
    helpers)."""

    stem: str
    title: str
    modules: dict[str, str]
    references: tuple[str, ...]
    ops: tuple[str, ...]
    exports: tuple[str, ...] = field(default=())

    @property
    def decoding(self) -> bool:
        return any(kind in DECODING_KINDS for kind in self.modules.values())

    @property
    def decoding_modules(self) -> tuple[str, ...]:
        return tuple(name for name, kind in self.modules.items() if kind in DECODING_KINDS)

    @property
    def names(self) -> tuple[str, ...]:
        """What ``laminae.primitives`` exports from ``primitives/<stem>.py``."""
        return (*self.modules, *self.references, *self.exports)


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism("laurel", "LAuReL learned augmented residual (RW, LR, RW+LR)",
              {"LAuReL": POSITION_WISE, "LAuReLBlock": POSITION_WISE}, ("laurel_reference",), ("laurel",)),
    Mechanism("siamese_norm", "SiameseNorm two-stream residual (RMSNorm only)",
              {"SiameseNormLayer": STREAMS, "SiameseNormFinal": STREAMS}, ("siamese_boundary_reference",),
              ("siamese_boundary",), ("SiameseStreams", "siamese_start")),
    Mechanism("derf", "DERF erf attention + DERF context gate",
              {"DERFAttention": CORE, "DERFContextGate": POSITION_WISE},
              ("derf_attention_reference", "derf_context_gate_reference"), ("derf_attention", "derf_context_gate"),
              ("DERFCache",)),
    Mechanism("xsa", "exclusive self-attention (removes each head's own value direction)",
              {"ExclusiveSelfAttention": POSITION_WISE}, ("xsa_reference",), ("xsa",)),
    Mechanism("affine_scaled_attention", "affine-scaled attention [α·softmax + β]·V, on a shared flash core",
              {"AffineScaledAttention": CORE}, ("affine_scaled_attention_reference",), ("affine_scaled_attention",),
              ("AffineScaledAttentionCache",)),
    Mechanism("elo_attention", "Elo tournament attention with carried ratings",
              {"EloAttention": CORE}, ("elo_attention_reference",), ("elo_attention",), ("EloAttentionCache",)),
    Mechanism("lucid_attention", "LUCID preconditioned attention (V′ = L⁻¹V)",
              {"LucidAttention": CORE}, ("lucid_attention_reference",), ("lucid_attention",), ("LucidCache",)),
    Mechanism("engram", "Engram n-gram sign-LSH hash memory + gated layer fusion",
              {"EngramModule": SEQUENCE, "EngramLayerFusion": POSITION_WISE, "MultiHeadHashLookup": POSITION_WISE,
               "TokenCompressor": POSITION_WISE},
              ("engram_lookup_reference", "engram_fusion_gate_reference"),
              ("engram_lookup", "engram_fusion_gate", "engram_fusion"), ("EngramCache", "EngramOutput")),
    Mechanism("memory_caching", "Memory Caching gated segment memory",
              {"MemoryCacheBranch": SEQUENCE}, ("memory_caching_reference",), ("memory_caching",),
              ("MemoryCachingCache",)),
    Mechanism("mom_read", "Mixture-of-Memory read over a shared bank",
              {"MoMRead": SEQUENCE}, ("mom_read_reference",), ("mom_read",), ("MoMReadCache",)),
    Mechanism("hrm_refinement", "HRM iterative refinement of the final hidden state (deep-supervision states)",
              {"HRMRefinementBlock": POSITION_WISE}, ("hrm_refinement_reference",), ("hrm_refinement",),
              ("HRMRefinementOutput",)),
    Mechanism("spelling_bee", "Spelling Bee byte-level embeddings (rotated byte-spelling average, baked inference)",
              {"SpellingBeeEmbedding": TOKEN}, ("spelling_bee_reference",), ("spelling_bee",),
              ("byte_table_from_strings",)),
    Mechanism("leviathan", "Leviathan continuous token generator (replaces the embedding table)",
              {"LeviathanGenerator": TOKEN}, ("leviathan_reference",), ("leviathan", "leviathan_spline")),
    Mechanism("shared_matrix",
              "Elastic SharedMatrix + Readout: nested tiers fused into one matmul (ShellElastic)",
              {"SharedMatrix": POSITION_WISE, "Readout": POSITION_WISE}, ("shared_matrix_reference",),
              ("shared_matrix",), ("ElasticTiers", "extract_tier", "save_subnetwork")),
    Mechanism("mosrah", "MoSRAH sparse routed attention heads (top-K router, varlen flash over expert-packed tokens, "
              "YaRN)",
              {"MoSRAH": SEQUENCE, "MoSRAHRouter": POSITION_WISE, "BottleneckedEnsembleAttention": POSITION_WISE},
              ("mosrah_reference",), ("mosrah", "mosrah_attention"), ("MoSRAHCache", "MoSRAHOutput")),
    Mechanism("stack_memory", "StackMemory differentiable hidden-state stack (depth and temporal modes)",
              {"StackMemory": SEQUENCE}, ("stack_memory_reference", "stack_scan_reference", "stack_step_reference"),
              ("stack_memory", "stack_scan", "stack_step"), ("StackMemoryCache", "StackMemoryOutput",
                                                             "StackMemoryState")),
)

BY_STEM: dict[str, Mechanism] = {m.stem: m for m in MECHANISMS}
STEMS: list[str] = [m.stem for m in MECHANISMS]
DECODING: list[str] = [m.stem for m in MECHANISMS if m.decoding]


def ops() -> dict[str, str]:
    """Every functional op, mapped to the stem of the file that defines it."""
    return {op: m.stem for m in MECHANISMS for op in m.ops}
