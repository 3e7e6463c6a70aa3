"""Engram: an n-gram hash memory read through a sign-bit LSH, and its gated mid-stack fusion.

Every position ``t`` of a sequence of token embeddings ``x`` is compressed by a frozen
random projection and L2-normalised (``c_t``, the hash space). For each n-gram order
``n = 1..N`` and each head ``h = 1..H`` the n-gram ending at ``t`` is hashed:

    a[t, n, h, b] = Σ_{k=0}^{n-1} ⟨c_{t-n+1+k}, W_{n,k}[h, b]⟩       b = 0..bits-1
    id[t, n, h]   = (Σ_b 1[a > 0]·2^b) mod table_size

one hyperplane set ``W_{n,k}`` per position ``k`` inside the n-gram, so "a b" and "b a"
land in different buckets, and the sign makes the hash invariant to the input scale.
The read is the mean of the addressed table rows over heads and the orders that fit:

    out[t] = Σ_{n ≤ min(N, t+1)} Σ_h  table_h[id[t, n, h]]  /  (H · min(N, t+1))

Padding (``attention_mask``, the ``(batch, seq)`` keep mask): a dropped position acts
as a sequence boundary. The orders read at ``t`` are those whose window holds only kept
positions, ``n ≤ fit[t] = min(N, run[t])`` with ``run[t]`` the number of consecutive kept
positions ending at ``t``, and the read divides by ``H · fit[t]``: the first tokens after
padding read exactly as the first tokens of an unpadded sequence, so a left-padded row
equals the unpadded row, and a hole restarts the n-grams. Dropped positions read zeros,
are never hashed into a kept position's n-gram and send no gradient to the tables.

``legacy_trunc`` reproduces the pre-sign-LSH hash (``|Σ_k ⟨c, w_{n,k}[h]⟩|`` truncated
to an integer, one hyperplane per head) so old checkpoints read bit-identically.

Only the tables receive gradients: the compressor is frozen and the hash is discrete.

:class:`EngramLayerFusion` re-injects the n-gram read higher in the stack, gated by the
agreement between the hidden state and an n-gram key (``F = fusion_dim``):

    ĥ = RMSNorm(hidden·W_down),  k̂ = RMSNorm(ngram·W_key),  a = ⟨ĥ, k̂⟩ / √F
    g = sigmoid(sign(a)·√max(|a|, 1e-6))
    y = hidden + (g · ngram·W_value)·W_out          (W_out zero-init: identity at init)
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._cache import DecodingCache, check_cache
from ._errors import ConfigError, DTypeError, ShapeError
from ._validation import (FLOAT_DTYPES, check_has_tokens, check_keep_mask, check_param_dtype, check_positive_int,
                          check_same_device, check_tensor, match_activation_dtypes, zero_padding)
from .blocks.norms import RMSNorm, rms_norm

__all__ = [
    "engram_hash_bits",
    "ngram_slots",
    "token_compressor_reference",
    "engram_bucket_ids",
    "engram_lookup_reference",
    "engram_fusion_gate_reference",
    "engram_fusion_reference",
    "engram_next_prefix",
    "engram_orders_that_fit",
    "EngramCache",
    "EngramOutput",
    "TokenCompressor",
    "MultiHeadHashLookup",
    "EngramModule",
    "EngramLayerFusion",
]

COMPRESS_EPS = 1e-6   # L2 normalisation of the compressed vector
PROJ_EPS = 1e-8       # normalisation of each random hyperplane at init
GATE_FLOOR = 1e-6     # |a| is clamped to this before the signed square root
MAX_HASH_BITS = 24    # bits are packed through fp32, exact up to 2^24


def engram_hash_bits(table_size: int) -> int:
    """Hash width: ⌈log2 table_size⌉ + 8 spare bits (so ``mod table_size`` is near
    uniform for any table size), at least 1 and at most 24."""
    return min(MAX_HASH_BITS, max(1, math.ceil(math.log2(max(table_size, 2))) + 8))


def ngram_slots(max_ngram: int) -> list[tuple[int, int]]:
    """The (order n, position k) pairs in the order the hash projections are stacked:
    (1,0), (2,0), (2,1), (3,0), (3,1), (3,2), ... — ``max_ngram·(max_ngram+1)/2`` slots."""
    return [(n, k) for n in range(1, max_ngram + 1) for k in range(n)]


def _max_ngram_from_slots(num_slots: int) -> int:
    m = int(round((math.sqrt(8 * num_slots + 1) - 1) / 2))
    if m < 1 or m * (m + 1) // 2 != num_slots:
        raise ShapeError(
            f"`hash_projs` must stack max_ngram·(max_ngram+1)/2 projections (1, 3, 6, 10, ...) on dim 0, "
            f"got {num_slots}")
    return m


def _as_table_list(tables) -> list[torch.Tensor]:
    if isinstance(tables, torch.Tensor):
        check_tensor("tables", tables, ndim=3, layout="[num_heads, table_size, out_dim]")
        return list(tables.unbind(0))
    if not isinstance(tables, (list, tuple)) or len(tables) == 0:
        raise TypeError(f"`tables` must be a [H, T, D] tensor or a non-empty list of [T, D] tensors, got {type(tables).__name__}")
    return list(tables)


def check_lookup_args(compressed, hash_projs, bit_weights, tables, prefix, legacy_trunc, attention_mask=None,
                      prefix_mask=None):
    """Validate the functional lookup's inputs; returns (max_ngram, tables as a list)."""
    check_tensor("compressed", compressed, ndim=3, layout="[batch, seq, compress_dim]")
    batch, seq, dim = compressed.shape
    if seq == 0:
        raise ShapeError("`compressed` has an empty sequence (dim 1 is 0); the lookup needs at least one token")
    if legacy_trunc:
        check_tensor("hash_projs", hash_projs, ndim=3, layout="[slots, num_heads, compress_dim] (legacy_trunc)")
    else:
        check_tensor("hash_projs", hash_projs, ndim=4, layout="[slots, num_heads, hash_bits, compress_dim]")
    max_ngram = _max_ngram_from_slots(hash_projs.shape[0])
    heads = hash_projs.shape[1]
    if hash_projs.shape[-1] != dim:
        raise ShapeError(f"`hash_projs` last dim must be compress_dim={dim}, got shape {tuple(hash_projs.shape)}")
    check_tensor("bit_weights", bit_weights, ndim=1)
    if not legacy_trunc and bit_weights.shape[0] != hash_projs.shape[2]:
        raise ShapeError(
            f"`bit_weights` must have hash_bits={hash_projs.shape[2]} entries, got {bit_weights.shape[0]}")
    table_list = _as_table_list(tables)
    if len(table_list) != heads:
        raise ShapeError(f"expected one table per head ({heads}), got {len(table_list)}")
    for i, t in enumerate(table_list):
        check_tensor(f"tables[{i}]", t, ndim=2, layout="[table_size, out_dim]")
        if t.shape != table_list[0].shape:
            raise ShapeError(f"all tables must share one shape, tables[0] {tuple(table_list[0].shape)} vs "
                             f"tables[{i}] {tuple(t.shape)}")
        if t.dtype != table_list[0].dtype:
            raise DTypeError(f"all tables must share one dtype, got {table_list[0].dtype} and {t.dtype}")
    if prefix is not None:
        check_tensor("prefix", prefix, ndim=3, layout="[batch, prefix_len, compress_dim]")
        if prefix.shape[0] != batch or prefix.shape[2] != dim:
            raise ShapeError(f"`prefix` must be [batch={batch}, *, compress_dim={dim}], got {tuple(prefix.shape)}")
    check_keep_mask("attention_mask", attention_mask, batch, seq)
    if prefix_mask is not None:
        if prefix is None:
            raise ShapeError("`prefix_mask` was given without a `prefix`")
        check_keep_mask("prefix_mask", prefix_mask, batch, prefix.shape[1])
    check_same_device(compressed=compressed, hash_projs=hash_projs, bit_weights=bit_weights,
                      prefix=prefix, attention_mask=attention_mask, prefix_mask=prefix_mask,
                      **{f"tables[{i}]": t for i, t in enumerate(table_list)})
    return max_ngram, table_list


# ----------------------------------------------------------------------------
# Reference math
# ----------------------------------------------------------------------------


def engram_orders_that_fit(keep: torch.Tensor, max_ngram: int) -> torch.Tensor:
    """``[B, L]`` int64: how many n-gram orders are read at each position of a
    ``(B, L)`` keep mask, ``min(max_ngram, run)`` with ``run`` the number of
    consecutive kept positions ending there (0 where dropped). Without padding it is
    ``min(max_ngram, t + 1)``. Static shapes, no host sync (a running max)."""
    keep = keep.bool()
    pos = torch.arange(keep.shape[1], device=keep.device).expand(keep.shape)
    last_dropped = torch.where(keep, -1, pos).cummax(dim=1).values
    return torch.where(keep, pos - last_dropped, 0).clamp(max=max_ngram)


def full_keep_mask(batch: int, prefix_len: int, seq: int, attention_mask: torch.Tensor | None,
                   prefix_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The ``(B, P + S)`` bool keep mask of prefix ++ positions, or None when nothing is dropped."""
    if attention_mask is None and prefix_mask is None:
        return None
    ones = lambda n: torch.ones(batch, n, dtype=torch.bool, device=device)  # noqa: E731
    parts = [ones(prefix_len) if prefix_mask is None else prefix_mask.bool(),
             ones(seq) if attention_mask is None else attention_mask.bool()]
    return torch.cat(parts, dim=1)


def token_compressor_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = COMPRESS_EPS) -> torch.Tensor:
    """``z / (‖z‖ + eps)`` with ``z = x·weightᵀ``: ``x`` [..., embed_dim], ``weight``
    [compress_dim, embed_dim] → [..., compress_dim] in the dtype of ``z``."""
    z = F.linear(x, weight)
    return z / (z.norm(dim=-1, keepdim=True) + eps)


def engram_bucket_ids(
    compressed: torch.Tensor,
    hash_projs: torch.Tensor,
    bit_weights: torch.Tensor,
    table_size: int,
    *,
    legacy_trunc: bool = False,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bucket index of every n-gram: ``[batch, seq, max_ngram, num_heads]`` int64.

    Entry ``[b, t, n-1, h]`` addresses head ``h``'s table for the n-gram ending at
    position ``t``; it is -1 where that n-gram would start before position 0
    (``t < n-1``) or reach a dropped position of ``attention_mask`` (``[B, S]`` keep
    mask; dropped positions have no n-gram). Hashing runs in fp32 whatever the input dtype.

    Args:
        compressed: ``[B, S, Dc]`` hash-space vectors (the whole sequence, prefix included).
        hash_projs: ``[slots, H, bits, Dc]`` hyperplanes stacked in :func:`ngram_slots`
            order (legacy: ``[slots, H, Dc]``).
        bit_weights: ``[bits]``, ``2^b``.
        table_size: rows per table.
    """
    max_ngram = _max_ngram_from_slots(hash_projs.shape[0])
    batch, seq, dim = compressed.shape
    heads = hash_projs.shape[1]
    projs = hash_projs.float()
    if legacy_trunc:
        projs = projs.unsqueeze(2)  # one "bit" per head
    bits = projs.shape[2]
    c = compressed.float()
    if attention_mask is not None:
        (c,) = zero_padding(attention_mask, c)  # padding (even NaN) never enters a product
    ids = torch.full((batch, seq, max_ngram, heads), -1, dtype=torch.int64, device=compressed.device)
    slot = 0
    for n in range(1, max_ngram + 1):
        if seq < n:
            break
        length = seq - n + 1
        # The projections of the n positions are summed BEFORE the sign, so every
        # bit depends on the whole n-gram (and on its order: one W per position).
        a = None
        for k in range(n):
            term = torch.matmul(c[:, k:k + length, :], projs[slot + k].reshape(heads * bits, dim).t())
            a = term if a is None else a + term
        a = a.view(batch, length, heads, bits)
        if legacy_trunc:
            idx = a[..., 0].abs().long()
        else:
            idx = ((a > 0).float() * bit_weights.float()).sum(dim=-1).long()
        ids[:, n - 1:, n - 1, :] = idx % table_size
        slot += n
    if attention_mask is not None:
        fit = engram_orders_that_fit(attention_mask, max_ngram)
        order = torch.arange(1, max_ngram + 1, device=ids.device).view(1, 1, -1, 1)
        ids = torch.where(order <= fit[:, :, None, None], ids, -1)
    return ids


def engram_lookup_reference(
    compressed: torch.Tensor,
    hash_projs: torch.Tensor,
    bit_weights: torch.Tensor,
    tables: torch.Tensor | Sequence[torch.Tensor],
    *,
    prefix: torch.Tensor | None = None,
    legacy_trunc: bool = False,
    upcast: bool = True,
    attention_mask: torch.Tensor | None = None,
    prefix_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference Engram read.

    Args:
        compressed: ``[B, S, Dc]`` compressed vectors of the positions to read (S ≥ 1).
        hash_projs: ``[slots, H, bits, Dc]`` (legacy ``[slots, H, Dc]``), stacked in
            :func:`ngram_slots` order; ``slots = N·(N+1)/2`` fixes ``max_ngram = N``.
        bit_weights: ``[bits]`` packing weights ``2^b``.
        tables: ``[H, T, D]`` or a list of H ``[T, D]`` tensors (the only inputs with a
            gradient).
        prefix: ``[B, P, Dc]`` compressed vectors of the tokens before ``compressed``
            (decoding: the last ``N-1``); n-grams that start in it are hashed exactly
            as in a forward over the concatenation, and only the ``S`` positions of
            ``compressed`` are returned.
        legacy_trunc: the pre-sign-LSH truncation hash.
        upcast: sum the table rows in fp32 (the ground truth); ``False`` sums in the
            output dtype as the seed did.
        attention_mask: ``[B, S]`` keep mask of ``compressed`` (bool or 0/1). A dropped
            position reads zeros and acts as a sequence start for the positions
            after it (see the module docstring).
        prefix_mask: ``[B, P]`` keep mask of ``prefix`` (decoding after padding).
    Returns:
        ``[B, S, D]`` in the dtype of ``compressed``.
    """
    max_ngram, table_list = check_lookup_args(compressed, hash_projs, bit_weights, tables, prefix, legacy_trunc,
                                              attention_mask, prefix_mask)
    prefix_len = 0
    full = compressed
    if prefix is not None and prefix.shape[1] > 0:
        prefix_len = prefix.shape[1]
        full = torch.cat([prefix.to(compressed.dtype), compressed], dim=1)
    heads = len(table_list)
    table_size, out_dim = table_list[0].shape
    batch, seq = full.shape[:2]
    keep = full_keep_mask(batch, prefix_len, compressed.shape[1], attention_mask, prefix_mask, compressed.device)
    ids = engram_bucket_ids(full, hash_projs, bit_weights, table_size, legacy_trunc=legacy_trunc,
                            attention_mask=keep)
    acc_dtype = torch.promote_types(compressed.dtype, torch.float32) if upcast else compressed.dtype
    acc = torch.zeros(batch, seq, out_dim, dtype=acc_dtype, device=compressed.device)
    for n in range(1, min(max_ngram, seq) + 1):
        for h, table in enumerate(table_list):
            idx = ids[:, :, n - 1, h]
            rows = F.embedding(idx.clamp_min(0), table).to(acc_dtype)
            acc = acc + torch.where((idx >= 0)[..., None], rows, 0)
    # H · (number of orders read at position t); 0 (and a zero read) where dropped
    if keep is None:
        keep = torch.ones(1, seq, dtype=torch.bool, device=compressed.device)
    count = heads * engram_orders_that_fit(keep, max_ngram).clamp_min(1)
    out = acc / count.to(acc_dtype)[..., None]
    return out[:, prefix_len:].to(compressed.dtype)


def engram_next_prefix(prefix: torch.Tensor | None, compressed: torch.Tensor, max_ngram: int) -> torch.Tensor | None:
    """The decode prefix after reading ``compressed``: the last ``max_ngram - 1``
    compressed vectors of (prefix ++ compressed), detached; ``None`` for unigrams."""
    keep = max(0, max_ngram - 1)
    if keep == 0:
        return None
    full = compressed if prefix is None or prefix.shape[1] == 0 else torch.cat(
        [prefix.to(compressed.dtype), compressed], dim=1)
    start = max(0, full.shape[1] - keep)
    return full[:, start:, :].detach()


def engram_fusion_gate_reference(
    hidden_low: torch.Tensor,
    key_low: torch.Tensor,
    value: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    ngram_norm_weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """The agreement gate of :class:`EngramLayerFusion` applied to the value.

    Args:
        hidden_low: ``[..., F]`` = ``hidden_down(hidden)``.
        key_low: ``[..., F]`` = ``key_proj(ngram)``.
        value: ``[..., F]`` = ``value_proj(ngram)``.
        hidden_norm_weight, ngram_norm_weight: ``[F]`` RMSNorm weights.
        eps: RMSNorm epsilon.
        upcast: compute in fp32 and cast back; ``False`` keeps the input dtype.
    Returns:
        ``g · value`` with ``g = sigmoid(sign(a)·√max(|a|, 1e-6))``,
        ``a = ⟨RMSNorm(hidden_low), RMSNorm(key_low)⟩ / √F``; ``[..., F]`` in value's dtype.
    """
    dtype = value.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    fusion_dim = value.shape[-1]
    h = rms_norm(hidden_low.to(compute), hidden_norm_weight.to(compute), eps, upcast=False)
    k = rms_norm(key_low.to(compute), ngram_norm_weight.to(compute), eps, upcast=False)
    a = (h * k).sum(-1, keepdim=True) / math.sqrt(fusion_dim)
    # Signed square root: compresses the agreement's range before the sigmoid.
    gate = torch.sigmoid(a.abs().clamp_min(GATE_FLOOR).sqrt() * torch.sign(a))
    return (gate * value.to(compute)).to(dtype)


def engram_fusion_reference(
    hidden: torch.Tensor,
    ngram: torch.Tensor,
    hidden_down_weight: torch.Tensor,
    key_proj_weight: torch.Tensor,
    value_proj_weight: torch.Tensor,
    out_proj_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    ngram_norm_weight: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``hidden + out_proj(gate · value_proj(ngram))`` (see :func:`engram_fusion_gate_reference`).

    ``hidden``, ``ngram``: ``[..., H]``; ``*_down/key/value`` weights ``[F, H]``,
    ``out_proj_weight`` ``[H, F]``, norm weights ``[F]``. Returns ``[..., H]``.
    """
    gated = engram_fusion_gate_reference(
        F.linear(hidden, hidden_down_weight), F.linear(ngram, key_proj_weight), F.linear(ngram, value_proj_weight),
        hidden_norm_weight, ngram_norm_weight, eps)
    return hidden + F.linear(gated, out_proj_weight)


# ----------------------------------------------------------------------------
# Decoding state
# ----------------------------------------------------------------------------


class EngramCache(DecodingCache):
    """What incremental decoding must carry for the n-gram read: ``prefix``
    ``[B, ≤N-1, Dc]``, the compressed vectors of the last ``max_ngram - 1`` tokens
    (empty before the first token, and always for ``max_ngram == 1``), ``keep`` their
    ``[B, ≤N-1]`` bool keep mask (None while no call was padded) and ``length`` the
    token count. They depend only on the token embeddings, so caching them is exact.
    Start one with :meth:`EngramModule.empty_cache`; a call never changes the cache it
    was given, and an append copies at most N-1 positions."""

    def __init__(self, prefix: torch.Tensor, length: int = 0, config: dict | None = None,
                 keep: torch.Tensor | None = None) -> None:
        self.prefix, self._length, self.config, self.keep = prefix, int(length), dict(config or {}), keep

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch(self) -> int:
        return self.prefix.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.prefix.dtype

    @property
    def device(self) -> torch.device:
        return self.prefix.device

    def reset(self) -> None:
        self.prefix, self.keep, self._length = self.prefix[:, :0], None, 0

    def clone(self) -> "EngramCache":
        keep = None if self.keep is None else self.keep.clone()
        return EngramCache(self.prefix.clone(), self._length, self.config, keep)

    def advance(self, compressed: torch.Tensor, max_ngram: int,
                attention_mask: torch.Tensor | None = None) -> "EngramCache":
        """A cache that also holds ``compressed`` ``[B, S, Dc]`` (keep mask ``[B, S]``)."""
        old = self.prefix if self.prefix.shape[1] else None
        prefix = engram_next_prefix(old, compressed.to(self.dtype), max_ngram)
        keep = None
        if prefix is not None and (attention_mask is not None or self.keep is not None):
            batch, seq = compressed.shape[:2]
            old_len = 0 if old is None else old.shape[1]
            full = full_keep_mask(batch, old_len, seq, attention_mask, self.keep, compressed.device)
            keep = full[:, full.shape[1] - prefix.shape[1]:]
        if prefix is None:
            prefix = self.prefix[:, :0]
        return EngramCache(prefix, self._length + compressed.shape[1], self.config, keep)


class EngramOutput(NamedTuple):
    output: torch.Tensor          # the gated read, added to the residual stream
    cache: EngramCache | None     # pass back on the next call (None for cache=None)
    retrieved: torch.Tensor       # the raw read (reused by EngramLayerFusion)


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


class TokenCompressor(nn.Module):
    """Frozen random projection into the hash space, L2-normalised.

    ``proj`` = ``nn.Linear(embed_dim, compress_dim, bias=False)`` with N(0, 1/embed_dim)
    weights and ``requires_grad=False``. ``x`` ``[..., embed_dim]`` → ``[..., compress_dim]``.
    Normalising makes the hash input independent of the embedding scale.
    """

    def __init__(self, embed_dim: int, compress_dim: int) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("compress_dim", compress_dim)
        self.embed_dim, self.compress_dim = embed_dim, compress_dim
        self.proj = nn.Linear(embed_dim, compress_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=embed_dim ** -0.5)
        self.proj.weight.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, compress_dim={self.compress_dim}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.embed_dim:
            raise ShapeError(f"last dim of `x` must be embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        check_same_device(x=x, weight=self.proj.weight)
        check_param_dtype("x", x, self.proj.weight)
        return token_compressor_reference(x, self.proj.weight)


class MultiHeadHashLookup(nn.Module):
    """Multi-head n-gram hash memory (sign-bit LSH).

    Args:
        num_heads: H tables, each ``nn.Embedding(table_size, out_dim)`` with N(0, 0.01²) rows.
        table_size: T rows per table.
        compress_dim: Dc, the hash-space width.
        out_dim: D, the width of a table row (the model's hidden size).
        max_ngram: N, orders 1..N are read.
        legacy_trunc: the pre-sign-LSH truncation hash, only to read old checkpoints
            bit-identically (it collapses onto a few buckets).
        backend: "auto" | "triton" | "reference".
        deterministic: kept for configuration compatibility; both backends' table
            gradients are deterministic (the Triton backward uses no atomics).

    Buffers (persistent, part of the checkpoint): ``hash_proj_n{n}_p{k}`` ``[H, bits,
    Dc]`` (legacy ``[H, Dc]``) unit-norm hyperplanes; ``bit_weights`` ``[bits]`` = 2^b
    (not persistent). ``bits = min(24, ⌈log2 T⌉ + 8)``.

    Shapes: ``compressed`` ``[B, S, Dc]`` → ``[B, S, D]`` in compressed's dtype.

    Example::

        lookup = MultiHeadHashLookup(4, 4096, 64, 512)
        read = lookup(compressed)                        # full sequence
        step = lookup(c_new, prefix=compressed[:, -2:])  # one decoding step
    """

    def __init__(self, num_heads: int, table_size: int, compress_dim: int, out_dim: int,
                 max_ngram: int = 3, legacy_trunc: bool = False, backend: Backend = "auto",
                 deterministic: bool = False) -> None:
        super().__init__()
        for name, value in (("num_heads", num_heads), ("table_size", table_size),
                            ("compress_dim", compress_dim), ("out_dim", out_dim), ("max_ngram", max_ngram)):
            check_positive_int(name, value)
        check_backend(backend)
        if not isinstance(legacy_trunc, bool):
            raise ConfigError(f"`legacy_trunc` must be a bool, got {legacy_trunc!r}")
        self.num_heads, self.table_size, self.max_ngram = num_heads, table_size, max_ngram
        self.compress_dim, self.out_dim = compress_dim, out_dim
        self.legacy_trunc, self.backend, self.deterministic = legacy_trunc, backend, bool(deterministic)
        self.hash_bits = engram_hash_bits(table_size)

        self.tables = nn.ModuleList([nn.Embedding(table_size, out_dim) for _ in range(num_heads)])
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.01)
        self.register_buffer("bit_weights", 2.0 ** torch.arange(self.hash_bits, dtype=torch.float32),
                             persistent=False)
        for n, k in ngram_slots(max_ngram):
            shape = (num_heads, compress_dim) if legacy_trunc else (num_heads, self.hash_bits, compress_dim)
            proj = torch.randn(*shape)
            proj = proj / (proj.norm(dim=-1, keepdim=True) + PROJ_EPS)
            self.register_buffer(f"hash_proj_n{n}_p{k}", proj)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, table_size={self.table_size}, compress_dim={self.compress_dim}, "
                f"out_dim={self.out_dim}, max_ngram={self.max_ngram}, hash_bits={self.hash_bits}, "
                f"legacy_trunc={self.legacy_trunc}, backend={self.backend!r}")

    def hash_projs(self) -> torch.Tensor:
        """All hyperplanes stacked in :func:`ngram_slots` order, fp32."""
        return torch.stack([getattr(self, f"hash_proj_n{n}_p{k}").float() for n, k in ngram_slots(self.max_ngram)])

    def _check_compressed(self, compressed: torch.Tensor) -> None:
        check_tensor("compressed", compressed, ndim=3, layout="[batch, seq, compress_dim]")
        if compressed.shape[-1] != self.compress_dim:
            raise ShapeError(f"last dim of `compressed` must be compress_dim={self.compress_dim}, "
                             f"got shape {tuple(compressed.shape)}")

    @torch.no_grad()
    def bucket_ids(self, compressed: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S, max_ngram, H]`` int64 bucket indices (-1 where the n-gram does not fit
        or reaches a dropped position of the ``[B, S]`` keep mask)."""
        self._check_compressed(compressed)
        check_keep_mask("attention_mask", attention_mask, *compressed.shape[:2])
        return engram_bucket_ids(compressed, self.hash_projs(), self.bit_weights, self.table_size,
                                 legacy_trunc=self.legacy_trunc, attention_mask=attention_mask)

    @torch.no_grad()
    def bucket_occupancy(self, compressed: torch.Tensor) -> dict:
        """Fraction of each table actually addressed, per n-gram order:
        ``{"n1": {"distinct_buckets", "table_size", "occupancy"}, ...}`` with
        ``occupancy = distinct / min(#lookups, table_size)``. A healthy hash is near 1;
        a collapsed one addresses a single bucket."""
        ids = self.bucket_ids(compressed)
        stats = {}
        for n in range(1, self.max_ngram + 1):
            if compressed.shape[1] < n:
                continue
            idx = ids[:, n - 1:, n - 1, :]
            distinct = int(idx.unique().numel())
            stats[f"n{n}"] = {"distinct_buckets": distinct, "table_size": self.table_size,
                              "occupancy": distinct / min(idx.numel(), self.table_size)}
        return stats

    def forward(self, compressed: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                prefix: torch.Tensor | None = None, prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Read the memory for ``compressed`` ``[B, S, Dc]``; ``prefix`` ``[B, P, Dc]`` is
        the compressed tail of the preceding tokens (decoding); ``attention_mask``
        ``[B, S]`` and ``prefix_mask`` ``[B, P]`` are their keep masks (padding reads
        zeros and cuts the n-grams). Returns ``[B, S, D]``."""
        self._check_compressed(compressed)
        tables = [t.weight for t in self.tables]
        projs = self.hash_projs()
        masks = dict(attention_mask=attention_mask, prefix_mask=prefix_mask)
        if resolve_backend(self.backend, compressed, tables[0]) == "triton":
            from laminae.triton_ops.engram import engram_lookup

            return engram_lookup(compressed, projs, self.bit_weights, tables, prefix=prefix,
                                 legacy_trunc=self.legacy_trunc, **masks)
        return engram_lookup_reference(compressed, projs, self.bit_weights, tables, prefix=prefix,
                                       legacy_trunc=self.legacy_trunc, **masks)


class EngramModule(nn.Module):
    """Engram: compress → n-gram hash read → DERF context gate.

    Args (the seed's config fields, explicit):
        hidden_size: model width (input and output of the read).
        compress_dim: hash-space width (``engram_compress_dim``).
        num_heads: tables (``engram_num_heads``).
        table_size: rows per table (``engram_table_size``).
        max_ngram: orders 1..max_ngram (``engram_max_ngram``).
        gate_init_bias: DERF gate bias (``engram_gate_init_bias``; −4 starts nearly closed).
        legacy_trunc: ``engram_legacy_hash``.
        backend: "auto" | "triton" | "reference" (lookup and gate).
        deterministic: see :class:`MultiHeadHashLookup`.

    Submodules ``compressor`` (:class:`TokenCompressor`), ``lookup``
    (:class:`MultiHeadHashLookup`), ``gate`` (:class:`~laminae.primitives.derf.DERFContextGate`)
    carry the seed's names, so its state dict loads strictly.

    Shapes: ``x`` ``[B, S, hidden_size]`` → ``[B, S, hidden_size]`` (the gated read;
    the model adds it to ``x``).

    Example::

        engram = EngramModule(512, 64, num_heads=4, table_size=4096)
        out, _, ngram = engram(x)                                                  # training
        out, cache, ngram = engram(x_prompt, cache=engram.empty_cache(batch))      # prefill
        out, cache, ngram = engram(x_next, cache=cache)                            # one token
    """

    def __init__(self, hidden_size: int, compress_dim: int, num_heads: int, table_size: int,
                 max_ngram: int = 3, gate_init_bias: float = -4.0, legacy_trunc: bool = False,
                 backend: Backend = "auto", deterministic: bool = False) -> None:
        super().__init__()
        from .derf import DERFContextGate

        check_backend(backend)
        self.hidden_size = hidden_size
        self.compressor = TokenCompressor(hidden_size, compress_dim)
        self.lookup = MultiHeadHashLookup(num_heads, table_size, compress_dim, hidden_size, max_ngram,
                                          legacy_trunc=legacy_trunc, backend=backend, deterministic=deterministic)
        self.gate = DERFContextGate(hidden_size, gate_init_bias, backend=backend)
        self.backend = backend

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        # the blocks inside follow the parent: setting it here never leaves them behind
        check_backend(value)
        self._backend = self.lookup.backend = self.gate.backend = value

    @property
    def max_ngram(self) -> int:
        return self.lookup.max_ngram

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """Hash-space vectors ``[B, S, Dc]``; depend only on the token embedding (x is
        detached, the projection frozen), which is what makes the decode prefix exact."""
        return self.compressor(x.detach())

    def retrieve(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 prefix: torch.Tensor | None = None, prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The raw (ungated) read ``[B, S, hidden_size]`` (zeros at dropped positions)."""
        check_tensor("x", x, ndim=3, layout="[batch, seq, hidden_size]")
        check_keep_mask("attention_mask", attention_mask, *x.shape[:2])
        (x,) = zero_padding(attention_mask, x)
        return self.lookup(self.compress(x), attention_mask, prefix=prefix, prefix_mask=prefix_mask)

    def _cache_config(self) -> dict:
        return {"max_ngram": self.max_ngram, "compress_dim": self.compressor.compress_dim}

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> EngramCache:
        """An empty decoding cache for ``batch`` sequences on ``device`` (default: the
        parameters'). ``dtype`` (default: the parameters') is the activations'; the
        compressed prefix is kept in fp32 (fp64 for float64), where hashing runs."""
        check_positive_int("batch", batch)
        weight = self.compressor.proj.weight
        dtype = weight.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of an EngramCache must be a float dtype, got {dtype}")
        device = weight.device if device is None else device
        prefix = torch.zeros(batch, 0, self.compressor.compress_dim, dtype=torch.promote_types(dtype, torch.float32),
                             device=device)
        return EngramCache(prefix, 0, self._cache_config())

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: EngramCache | None = None, *, retrieved: torch.Tensor | None = None) -> EngramOutput:
        """``EngramOutput(output, cache, retrieved)``: the gated read ``[B, S,
        hidden_size]``, the cache and the raw read. ``cache=None`` returns None; a cache
        from :meth:`empty_cache` or an earlier call comes back as a new cache holding
        these tokens too (the one passed in is unchanged). A prefill followed by
        one-token steps equals one forward over the sequence. ``retrieved`` skips the
        lookup (a read computed earlier for this ``x``). ``attention_mask`` ``[B, S]``
        (keep mask): dropped positions output zeros, get no gradient, and cut the
        n-grams of the kept tokens after them (a left-padded row equals the unpadded
        row; the cache remembers the padding)."""
        check_tensor("x", x, ndim=3, layout="[batch, seq, hidden_size]")
        check_has_tokens("x", x)
        if cache is not None:
            check_cache(cache, EngramCache, self._cache_config(), batch=x.shape[0],
                        dtype=torch.promote_types(x.dtype, torch.float32), device=x.device,
                        cache_dtype=getattr(cache, "dtype", None), cache_device=getattr(cache, "device", None))
        keep = check_keep_mask("attention_mask", attention_mask, *x.shape[:2])
        (x,) = zero_padding(keep, x)   # padding contents (even NaN) reach neither the hash nor the gate
        compressed = self.compress(x)
        if retrieved is None:
            prefix = None if cache is None or cache.prefix.shape[1] == 0 else cache.prefix
            retrieved = self.lookup(compressed, keep, prefix=prefix,
                                    prefix_mask=None if prefix is None else cache.keep)
        # under autocast the frozen projection runs in bf16: the read joins x in the wider dtype
        x, retrieved = match_activation_dtypes(x=x, retrieved=retrieved)
        out = self.gate(x, retrieved=retrieved)
        if keep is not None:
            (out,) = zero_padding(keep, out)
        return EngramOutput(out, None if cache is None else cache.advance(compressed, self.max_ngram, keep), retrieved)


class EngramLayerFusion(nn.Module):
    """Mid-stack re-injection of the Engram read, gated by hidden/n-gram agreement.

    Args:
        hidden_size: model width H.
        fusion_dim: bottleneck F (seed default 256).
        eps: RMSNorm epsilon.
        backend: "auto" | "triton" | "reference".

    Parameters (seed names): ``hidden_down``, ``key_proj``, ``value_proj``
    (``nn.Linear(H, F, bias=False)``, N(0, 0.02²)), ``out_proj`` (``nn.Linear(F, H,
    bias=False)``, zeros: an exact no-op at init), ``hidden_norm.weight``,
    ``ngram_norm.weight`` (ones).

    Shapes: ``x`` (the hidden state) and ``ngram`` ``[..., H]`` (same shape and dtype)
    → ``[..., H]``.

    Example::

        fusion = EngramLayerFusion(512, 256)
        x = fusion(x, ngram=ngram_read)
    """

    def __init__(self, hidden_size: int, fusion_dim: int = 256, eps: float = 1e-6,
                 backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("fusion_dim", fusion_dim)
        check_backend(backend)
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ConfigError(f"`eps` must be a positive number, got {eps!r}")
        self.hidden_size, self.fusion_dim, self.eps, self.backend = hidden_size, fusion_dim, float(eps), backend
        self.hidden_down = nn.Linear(hidden_size, fusion_dim, bias=False)
        self.key_proj = nn.Linear(hidden_size, fusion_dim, bias=False)
        self.value_proj = nn.Linear(hidden_size, fusion_dim, bias=False)
        self.out_proj = nn.Linear(fusion_dim, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(fusion_dim, eps, upcast=False)
        self.ngram_norm = RMSNorm(fusion_dim, eps, upcast=False)
        for m in (self.hidden_down, self.key_proj, self.value_proj):
            nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.out_proj.weight)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, fusion_dim={self.fusion_dim}, eps={self.eps}, backend={self.backend!r}"

    def forward(self, x: torch.Tensor, *, ngram: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        check_tensor("ngram", ngram)
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ShapeError(f"last dim of `x` must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        if ngram.shape != x.shape:
            raise ShapeError(f"`ngram` must have the shape of `x` {tuple(x.shape)}, got {tuple(ngram.shape)}")
        check_has_tokens("x", x, None)
        check_same_device(x=x, ngram=ngram, weight=self.out_proj.weight)
        x, ngram = match_activation_dtypes(x=x, ngram=ngram)
        check_param_dtype("x", x, self.out_proj.weight)
        args = (x, ngram, self.hidden_down.weight, self.key_proj.weight, self.value_proj.weight,
                self.out_proj.weight, self.hidden_norm.weight, self.ngram_norm.weight, self.eps)
        if resolve_backend(self.backend, x, ngram) == "triton":
            from laminae.triton_ops.engram import engram_fusion

            return engram_fusion(*args)
        return engram_fusion_reference(*args)
