"""The decoding blocks, built small, behind one calling shape for the protocol tests:
``block.call(module, x, mask, cache)`` is the block's own forward (``x`` a
``[B, T, HIDDEN]`` activation from which each block takes the inputs it needs), and
``block.run(...) -> (out, cache)`` reads its ``[0]`` and ``[1]``: every protocol test
relies on that order.

``BLOCKS`` holds one block per declared decoding mechanism (``primitives/_mechanisms.py``;
a declared one without an entry here fails every test over ``BLOCKS``), then the
decoding attention layers of ``primitives/blocks`` and ``recipes/assembly``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from laminae.primitives import (AffineScaledAttention, DERFAttention, EloAttention, EngramModule, LucidAttention,
                                MemoryCacheBranch, MoMRead, MoSRAH, StackMemory)
from laminae.recipes.assembly.hybrid_attention import HybridAttention
from laminae.primitives.blocks.sliding_window import SlidingWindowAttention
from laminae.primitives._mechanisms import DECODING

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 2, 1, 8


def _qkv(x: torch.Tensor):
    """Fixed slices of x as q [B, T, H, D], k and v [B, T, Hkv, D] (no parameters needed)."""
    B, T, _ = x.shape
    q = x.flip(-1).reshape(B, T, HEADS, HEAD_DIM)
    return q, x[..., :HEAD_DIM].reshape(B, T, KV_HEADS, HEAD_DIM), x[..., HEAD_DIM:].reshape(B, T, KV_HEADS, HEAD_DIM)


@dataclass
class Block:
    name: str
    build: Callable[[str], torch.nn.Module]
    call: Callable  # (module, x, mask, cache) -> the block's forward result, as it returns it
    masked: bool = True   # takes an attention_mask
    # the documented empty cache of a block whose cache=None call returns no cache
    # (docs/protocol.md: its cache is storage only decoding needs); None: a cache=None
    # call returns a cache built from the call
    start: Callable | None = None   # (module, x) -> empty cache

    def run(self, module, x, mask, cache):
        """``(out, cache)`` read by position, ``[0]`` and ``[1]``, as the protocol promises.
        Without a cache: the uncached forward's output and the cache to continue from
        (a block without a cheap cache prefills its empty cache for it)."""
        res = self.call(module, x, mask, cache)
        if cache is None and self.start is not None:
            return res[0], self.call(module, x, mask, self.start(module, x))[1]
        return res[0], res[1]


def _attention_call(module, x, mask, cache):
    q, k, v = _qkv(x)
    return module(q, k, v, mask, cache)


def _affine_call(module, x, mask, cache):
    q, k, v = _qkv(x)
    return module(q, k, v, mask, cache, x=x)


BANK = MoMRead.init_bank(4, 2, HIDDEN, generator=torch.Generator().manual_seed(0))


def _mom_call(module, x, mask, cache):
    return module(x, mask, cache, M_blocks=BANK.to(x.dtype))


def _memory_call(module, x, mask, cache):
    # MemoryCacheBranch, EngramModule, StackMemory (temporal): no side input
    return module(x, mask, cache)


def _empty_cache(module, x):
    return module.empty_cache(x.shape[0], dtype=x.dtype, device=x.device)


def _routed_call(module, x, mask, cache):
    # MoSRAH, SHRAM's sliding window and its hybrid of both: a decoding cache starts empty
    return module(x, mask, cache=cache)


def _hybrid(backend):
    torch.manual_seed(0)
    local = SlidingWindowAttention(HIDDEN, 2, HEAD_DIM, window_size=3, backend=backend)
    sparse = MoSRAH(HIDDEN, num_mosrah_heads=4, num_selected_heads=2, head_dim=HEAD_DIM, training_sequence_length=32,
                    backend=backend)
    return HybridAttention(local, sparse).eval()


def _sliding_window(backend):
    torch.manual_seed(0)
    return SlidingWindowAttention(HIDDEN, 2, HEAD_DIM, window_size=3, backend=backend).eval()


def _scaled(module):
    # non-trivial parameters, so every term of the mechanism is exercised
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return module.eval()


WRITTEN = [
    Block("derf", lambda be: _scaled(DERFAttention(HEADS, KV_HEADS, HEAD_DIM, backend=be)), _attention_call,
          start=_empty_cache),
    Block("affine_scaled_attention",
          lambda be: _scaled(AffineScaledAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, alpha_ma_init=0.4,
                                                   initializer_range=0.3, backend=be)), _affine_call,
          start=_empty_cache),
    Block("elo_attention", lambda be: _scaled(EloAttention(HEADS, KV_HEADS, HEAD_DIM, backend=be)), _attention_call,
          start=_empty_cache),
    Block("lucid_attention", lambda be: LucidAttention(HEADS, KV_HEADS, HEAD_DIM, backend=be), _attention_call,
          start=_empty_cache),
    Block("memory_caching", lambda be: MemoryCacheBranch(HIDDEN, 2, 4, segment_len=3, gate_dim=4, backend=be).eval(),
          _memory_call, start=_empty_cache),
    Block("mom_read", lambda be: _mom(be), _mom_call, start=_empty_cache),
    Block("engram", lambda be: EngramModule(HIDDEN, 8, num_heads=2, table_size=31, gate_init_bias=0.5,
                                            backend=be).eval(), _memory_call, start=_empty_cache),
    Block("stack_memory", lambda be: _scaled(StackMemory(HIDDEN, stack_d_model=8, num_mem_heads=2, stack_slots=4,
                                                         mode="temporal", backend=be)), _memory_call,
          start=_empty_cache),
    Block("mosrah", lambda be: MoSRAH(HIDDEN, num_mosrah_heads=4, num_selected_heads=2, head_dim=HEAD_DIM,
                                      training_sequence_length=32, backend=be).eval(), _routed_call,
          start=_empty_cache),
]
LAYERS = [
    Block("sliding_window_attention", _sliding_window, _routed_call, start=_empty_cache),
    Block("hybrid_attention", _hybrid, _routed_call, start=_empty_cache),
]


def _missing(stem: str) -> Block:
    def build(backend):
        raise AssertionError(f"declared decoding mechanism {stem!r} has no block: add it to tests/_blocks.py")

    return Block(stem, build, lambda *a: None)


_BY_STEM = {b.name: b for b in WRITTEN}
BLOCKS = [_BY_STEM.get(stem) or _missing(stem) for stem in DECODING] + LAYERS
BY_NAME = {b.name: b for b in WRITTEN + LAYERS}


def _mom(backend):
    m = MoMRead(HIDDEN, 2, mem_size=8, block_size=2, top_blocks=2, router_rank=4, initializer_range=0.3,
                backend=backend).eval()
    with torch.no_grad():
        m.mom_scale.fill_(1.0)
    return m
