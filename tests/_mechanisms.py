"""Every mechanism module of ``laminae.primitives``, built tiny, behind one calling
shape for the cross-cutting tests (torch.compile, empty inputs): ``case.build(backend)``
makes the module, ``case.inputs(batch, seq)`` its inputs with ``seq`` tokens per
row, and ``case.call(module, *inputs)`` runs its forward and returns the float
outputs a loss can sum.
``CASES`` follows the declared stems (``primitives/_mechanisms.py``): a declared stem
without a case here fails every test that runs over ``CASES``, and a case of an
undeclared stem fails ``tests/test_mechanisms.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from laminae.primitives._mechanisms import STEMS
from laminae.primitives import (AffineScaledAttention, DERFAttention, DERFContextGate, EloAttention, EngramLayerFusion,
                                EngramModule, ExclusiveSelfAttention, HRMRefinementBlock, LAuReL, LeviathanGenerator,
                                LucidAttention, MemoryCacheBranch, MoMRead, MoSRAH, SharedMatrix, SiameseNormFinal,
                                SiameseNormLayer, SpellingBeeEmbedding, StackMemory, siamese_start)

D, H, HKV, HD, VOCAB = 16, 2, 1, 8, 8


def _x(batch, seq, width=D, seed=0):
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(seed))


def _left_padded(batch, seq):
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[:1, :max(0, min(2, seq - 1))] = False     # row 0 left-padded, one token kept at least
    return keep


def _ids(batch, seq):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _qkv(batch, seq):
    x = _x(batch, seq, 2 * D)
    return (x[..., :D].reshape(batch, seq, H, HD), x[..., D:D + HD].reshape(batch, seq, HKV, HD),
            x[..., D + HD:D + 2 * HD].reshape(batch, seq, HKV, HD))


@dataclass
class Case:
    stem: str
    build: Callable[[str], torch.nn.Module]
    inputs: Callable[[int, int], tuple]   # (batch, seq) -> the forward's tensors
    call: Callable                        # (module, *inputs) -> the float outputs a loss sums


class _Siamese(torch.nn.Module):
    """One SiameseNorm layer and its final boundary around two token-wise sublayers."""

    def __init__(self, backend):
        super().__init__()
        self.attn, self.mlp = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.layer = SiameseNormLayer(D, 0, self.attn, self.mlp, backend=backend)
        self.final = SiameseNormFinal(D, backend=backend)

    def forward(self, x):
        return self.final(*self.layer(*siamese_start(x)))


class _Engram(torch.nn.Module):
    """The Engram input stage and its layer fusion, as a decoder wires them."""

    def __init__(self, backend):
        super().__init__()
        self.module = EngramModule(D, 8, num_heads=2, table_size=31, gate_init_bias=0.5, backend=backend)
        self.fusion = EngramLayerFusion(D, 8, backend=backend)

    def forward(self, x):
        out, _, retrieved = self.module(x)
        return out, self.fusion(x, ngram=retrieved)


class _Derf(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.attention = DERFAttention(H, HKV, HD, backend=backend)
        self.gate = DERFContextGate(D, backend=backend)

    def forward(self, q, k, v, x):
        return self.attention(q, k, v)[0], self.gate(x.flip(-1), retrieved=x)


def _bee(backend):
    bee = SpellingBeeEmbedding(VOCAB, D, backend=backend)
    bee.set_byte_table_from_strings(["a", "bc", "def", "", "gh", "i", "jkl", "m"])
    return bee


def _mom(backend):
    m = MoMRead(D, 2, mem_size=8, block_size=2, top_blocks=2, router_rank=4, initializer_range=0.3, backend=backend)
    m.bank = torch.nn.Parameter(MoMRead.init_bank(4, 2, D, generator=torch.Generator().manual_seed(0)))
    return m


WRITTEN = [
    Case("laurel", lambda be: LAuReL(D, use_rw=True, use_lr=True, lr_rank=4, backend=be),
         lambda b, s: (_x(b, s), _x(b, s, seed=1)), lambda m, x, f: (m(x, sublayer_output=f),)),
    Case("siamese_norm", _Siamese, lambda b, s: (_x(b, s),), lambda m, x: (m(x),)),
    Case("derf", _Derf, lambda b, s: (*_qkv(b, s), _x(b, s)), lambda m, *a: m(*a)),
    Case("xsa", lambda be: ExclusiveSelfAttention(H, HKV, HD, backend=be), lambda b, s: _qkv(b, s)[::2],
         lambda m, y, v: (m(y, v=v),)),
    Case("affine_scaled_attention", lambda be: AffineScaledAttention(D, H, HKV, HD, initializer_range=0.3, backend=be),
         lambda b, s: (_x(b, s), *_qkv(b, s)), lambda m, x, q, k, v: (m(q, k, v, x=x)[0],)),
    Case("elo_attention", lambda be: EloAttention(H, HKV, HD, backend=be), _qkv, lambda m, *a: (m(*a)[0],)),
    Case("lucid_attention", lambda be: LucidAttention(H, HKV, HD, backend=be), _qkv, lambda m, *a: (m(*a)[0],)),
    Case("engram", _Engram, lambda b, s: (_x(b, s),), lambda m, x: m(x)),
    Case("memory_caching", lambda be: MemoryCacheBranch(D, 2, 4, segment_len=3, gate_dim=4, backend=be),
         lambda b, s: (_x(b, s),), lambda m, x: (m(x)[0],)),
    Case("mom_read", _mom, lambda b, s: (_x(b, s),), lambda m, x: (m(x, M_blocks=m.bank)[0],)),
    Case("hrm_refinement", lambda be: HRMRefinementBlock(D, 8, 2, backend=be), lambda b, s: (_x(b, s),),
         lambda m, x: (m(x).output,)),
    Case("spelling_bee", _bee, lambda b, s: (_ids(b, s), _x(b, s)),
         lambda m, ids, e: (m(ids, token_embeddings=e),)),
    Case("leviathan", lambda be: LeviathanGenerator(vocab_size=VOCAB, hidden_size=D, seed_dim=8, num_modes=2,
                                                    num_knots=4, rank=4, backend=be),
         lambda b, s: (_ids(b, s),), lambda m, ids: (m(ids),)),
    Case("shared_matrix", lambda be: SharedMatrix(D, D, backend=be), lambda b, s: (_x(b, s),),
         lambda m, x: (m(x, ratio=0.5),)),
    Case("mosrah", lambda be: MoSRAH(D, num_mosrah_heads=4, num_selected_heads=2, head_dim=HD,
                                     training_sequence_length=32, backend=be),
         lambda b, s: (_x(b, s), _left_padded(b, s)), lambda m, x, keep: tuple(m(x, attention_mask=keep))[::2]),
    Case("stack_memory", lambda be: StackMemory(D, stack_d_model=8, num_mem_heads=2, stack_slots=4, mode="temporal",
                                                backend=be),
         lambda b, s: (_x(b, s),), lambda m, x: (m(x)[0],)),
]
BY_STEM = {case.stem: case for case in WRITTEN}


def _missing(stem: str) -> Case:
    def build(backend):
        raise AssertionError(f"declared mechanism {stem!r} has no case: add it to tests/_mechanisms.py")

    return Case(stem, build, lambda b, s: (), lambda m, *a: ())


CASES = [BY_STEM.get(stem) or _missing(stem) for stem in STEMS]
