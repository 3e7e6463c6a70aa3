"""Decoding caches: one convention for every sequence mechanism.

``out, cache = block(..., cache=cache)``: the block reads the cache passed in and
returns a NEW cache that also holds this call's tokens. The object passed in is never
changed, so two different next steps from one cache (beam search, speculative
decoding) are both right, and ``cache=None`` means "no history".

Per-position tensors live in :class:`AppendBuffer`: named buffers ``[batch, capacity,
...]`` (positions on dim 1) shared by the caches of one generation. Each buffer object
records its own ``length`` and the write version it continues; the shared storage
records the version of its newest write. A buffer at that version writes in place
(amortised O(1) per token, capacity doubles when full); a buffer behind it (another
branch wrote since) copies its positions into fresh storage first (copy-on-branch), so
branches never see each other's tokens. Appends write the next positions; scattered
writes (:meth:`AppendBuffer.scatter`) put rows at data-dependent positions, as
MoSRAH's per-head rows.

Caches hold detached tensors: decoding is inference. To differentiate through carried
state, call the functional ``*_reference`` / ``laminae.triton_ops`` ops with explicit
state tensors.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

from ._errors import ConfigError, DeviceError, DTypeError, ShapeError

__all__ = ["AppendBuffer", "DecodingCache", "check_cache"]

MIN_CAPACITY = 16


class _Storage:
    """Buffers shared by every AppendBuffer of one lineage, and the version of the
    newest write into them (the only buffer that may write in place carries it)."""

    __slots__ = ("tensors", "version")

    def __init__(self, tensors: dict[str, torch.Tensor], version: int = 0) -> None:
        self.tensors, self.version = tensors, version

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[1]


class AppendBuffer:
    """Append-only named tensors ``[batch, length, ...]`` with copy-on-branch storage.

    Example::

        buf = AppendBuffer()                                   # empty
        buf = buf.append(key=k_prompt, value=v_prompt)         # [B, T, H, D] each
        a = buf.append(key=k1, value=v1)                       # in place, O(1)
        b = buf.append(key=k2, value=v2)                       # copies: `a` stays intact
        b.get("key").shape                                     # [B, T + 1, H, D]

    A buffer made by hand from another's storage (``AppendBuffer(storage, n)``)
    carries no write version, so its first write copies: always correct.
    """

    __slots__ = ("_storage", "length", "_version")

    def __init__(self, storage: _Storage | None = None, length: int = 0, version: int | None = None) -> None:
        self._storage, self.length, self._version = storage, length, version

    @classmethod
    def preallocate(cls, capacity: int, like: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                    batch: int, device: torch.device | str | None = None) -> "AppendBuffer":
        """Empty, with room for ``capacity`` positions: ``like`` maps each name to
        (trailing shape, dtype)."""
        tensors = {name: torch.zeros((batch, capacity, *tail), dtype=dtype, device=device)
                   for name, (tail, dtype) in like.items()}
        return cls(_Storage(tensors), 0, 0)

    @classmethod
    def wrap(cls, **tensors: torch.Tensor) -> "AppendBuffer":
        """A full buffer around existing tensors, without copying (the first append
        after it grows into fresh storage, so the tensors are never written)."""
        tensors = {k: t.detach() for k, t in tensors.items()}
        return cls(_Storage(tensors), _positions(tensors), 0)

    @property
    def names(self) -> tuple[str, ...]:
        return () if self._storage is None else tuple(self._storage.tensors)

    @property
    def capacity(self) -> int:
        return 0 if self._storage is None else self._storage.capacity

    def get(self, name: str) -> torch.Tensor | None:
        """The first ``length`` positions of buffer ``name`` (a view), or None when empty."""
        if self._storage is None:
            return None
        return self._storage.tensors[name][:, :self.length]

    def append(self, **new: torch.Tensor) -> "AppendBuffer":
        """A buffer holding these positions plus ``new`` (each ``[batch, T, ...]``, one
        T). This buffer object is unchanged."""
        start = self.length
        end = start + _positions(new)
        with torch.no_grad():
            st = self._writable(end, new)
            for name, t in new.items():
                st.tensors[name][:, start:end].copy_(t)
        return self._written(st, end)

    def scatter(self, count: int, index: torch.Tensor, **new: torch.Tensor) -> "AppendBuffer":
        """A buffer ``count`` positions longer whose storage also holds the rows of
        ``new`` (each ``[batch, T, ...]``) at the positions ``index`` ``[batch, T, ...]``
        along dim 1 (the leading dims of every ``new`` tensor, broadcast over the rest;
        distinct, each below ``length + count``). This buffer object is unchanged.

        For rows at data-dependent positions (MoSRAH's per-head rows, written at each
        head's own count): a position below ``length`` may be written, so the caller
        writes only positions that it does not read as holding data. The earlier
        buffers of the lineage read no more than it does, so they stay intact too; a
        branch copies first, as for appends."""
        end = self.length + count
        with torch.no_grad():
            st = self._writable(end, new)
            for name, t in new.items():
                dest = st.tensors[name]
                at = index.reshape(index.shape + (1,) * (t.dim() - index.dim())).expand(t.shape)
                dest.scatter_(1, at, t.to(dest.dtype))
        return self._written(st, end)

    def _writable(self, end: int, new: Mapping[str, torch.Tensor]) -> _Storage:
        """The storage the next write goes to: this buffer's own when it holds the newest
        write and ``end`` positions fit, else fresh storage (capacity doubled when
        growing) holding a copy of this buffer's positions. The storage keeps its dtypes."""
        st = self._storage
        if st is not None and set(new) != set(st.tensors):
            raise ConfigError(f"appending {sorted(new)} to a cache holding {sorted(st.tensors)}")
        newest = st is not None and st.version == self._version
        if newest and end <= st.capacity:
            return st
        # grow (doubling), or branch off: either way the positions move to new storage
        old = 0 if st is None else st.capacity
        capacity = old if st is not None and not newest and end <= old else max(end, 2 * old, MIN_CAPACITY)
        tensors = {}
        for name, t in new.items():
            like = t if st is None else st.tensors[name]
            buf = like.new_empty((t.shape[0], capacity, *like.shape[2:]))
            if self.length:
                buf[:, :self.length].copy_(st.tensors[name][:, :self.length])
            tensors[name] = buf
        return _Storage(tensors)

    @staticmethod
    def _written(st: _Storage, length: int) -> "AppendBuffer":
        st.version += 1
        return AppendBuffer(st, length, st.version)

    def clone(self) -> "AppendBuffer":
        """An independent copy of the first ``length`` positions."""
        if self._storage is None:
            return AppendBuffer()
        return AppendBuffer.wrap(**{n: self.get(n).clone() for n in self.names})

    def __repr__(self) -> str:
        return f"AppendBuffer(names={list(self.names)}, length={self.length}, capacity={self.capacity})"


def _positions(tensors: Mapping[str, torch.Tensor]) -> int:
    counts = {t.shape[1] for t in tensors.values()}
    if len(counts) != 1:
        raise ShapeError(f"all appended tensors must hold one number of positions (dim 1), got "
                         f"{ {k: tuple(t.shape) for k, t in tensors.items()} }")
    return counts.pop()


class DecodingCache:
    """Base of every decoding cache.

    ``config`` records the configuration of the module that built the cache (e.g.
    ``{"num_kv_heads": 2, "head_dim": 64}``); a module refuses a cache of another
    configuration (:func:`check_cache`). Subclasses are immutable from the outside:
    a module returns a new cache, and only the explicit ``reset()`` changes one.
    """

    config: dict[str, Any]

    @property
    def length(self) -> int:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every token (explicit, in place); the cache then starts a new sequence."""
        raise NotImplementedError

    def clone(self) -> "DecodingCache":
        """A deep, independent copy (rarely needed: appends never touch this cache)."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length}, config={self.config})"


def check_cache(cache: object, cls: type, config: Mapping[str, Any], *,
                batch: int | None = None, dtype: torch.dtype | None = None,
                device: torch.device | None = None, cache_dtype: torch.dtype | None = None,
                cache_device: torch.device | None = None, cache_batch: int | None = None) -> None:
    """Raise a named error unless ``cache`` is a ``cls`` built for ``config`` and (when
    it holds tokens) matches the batch, dtype and device of this call."""
    if not isinstance(cache, cls):
        raise TypeError(f"`cache` must be a {cls.__name__} (from this kind of module) or None, "
                        f"got {type(cache).__name__}")
    theirs = getattr(cache, "config", None) or {}
    diff = {k: (theirs.get(k), v) for k, v in config.items() if k in theirs and theirs[k] != v}
    if diff:
        listing = ", ".join(f"{k}={got!r} (module: {want!r})" for k, (got, want) in diff.items())
        raise ConfigError(f"`cache` was built for another configuration: {listing}")
    cache_batch = cache_batch if cache_batch is not None else getattr(cache, "batch", None)
    if cache_batch is not None and batch is not None and cache_batch != batch:
        raise ShapeError(f"`cache` holds batch size {cache_batch}, this call has batch size {batch}")
    if cache_dtype is not None and dtype is not None and cache_dtype != dtype:
        raise DTypeError(f"`cache` holds {str(cache_dtype).replace('torch.', '')} tensors, this call "
                         f"passes {str(dtype).replace('torch.', '')}")
    if cache_device is not None and device is not None and cache_device != device:
        raise DeviceError(f"`cache` is on {cache_device}, this call's tensors are on {device}")


class KVCache(DecodingCache):
    """Keys, values and the key keep mask of every token so far (attention cores).

    ``keys``/``values``: ``[B, length, H_kv, D]`` views; ``keep``: ``[B, length]`` bool,
    or None while no appended chunk came with a padding mask (the kernels then skip
    the mask); ``length``: tokens held; ``batch``, ``dtype``, ``device``: of its
    storage, fixed when the cache is made. Start one with ``module.empty_cache(batch)``;
    every call returns a new cache that holds its tokens too.
    """

    def __init__(self, buffers: AppendBuffer | None = None, has_mask: bool = False,
                 config: Mapping[str, Any] | None = None) -> None:
        self.buffers = buffers if buffers is not None else AppendBuffer()
        self.has_mask = bool(has_mask)
        self.config = dict(config or {})

    @classmethod
    def _empty(cls, batch: int, config: Mapping[str, Any], *, dtype: torch.dtype,
               device: torch.device | str | None, layout: Mapping[str, tuple] | None = None):
        """An empty cache with storage for a few positions (it doubles when full).
        ``config`` holds ``num_kv_heads`` and ``head_dim``; ``layout`` adds or overrides
        per-position buffers, name -> (trailing shape, dtype)."""
        from ._validation import FLOAT_DTYPES, check_positive_int

        check_positive_int("batch", batch)
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of a {cls.__name__} must be a float dtype, got {dtype}")
        tail = (config["num_kv_heads"], config["head_dim"])
        buffers = {"key": (tail, dtype), "value": (tail, dtype), **(layout or {}), "keep": ((), torch.bool)}
        return cls(AppendBuffer.preallocate(MIN_CAPACITY, buffers, batch, device), False, config)

    @property
    def length(self) -> int:
        return self.buffers.length

    @property
    def keys(self) -> torch.Tensor | None:
        return self.buffers.get("key")

    @property
    def values(self) -> torch.Tensor | None:
        return self.buffers.get("value")

    @property
    def keep(self) -> torch.Tensor | None:
        return self.buffers.get("keep") if self.has_mask else None

    @property
    def batch(self) -> int | None:
        st = self.buffers._storage
        return None if st is None else st.tensors["key"].shape[0]

    @property
    def dtype(self) -> torch.dtype | None:
        st = self.buffers._storage
        return None if st is None else st.tensors["key"].dtype

    @property
    def device(self) -> torch.device | None:
        st = self.buffers._storage
        return None if st is None else st.tensors["key"].device

    def reset(self) -> None:
        self.buffers = AppendBuffer(self.buffers._storage, 0)  # the next append branches off
        self.has_mask = False

    def append(self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
               extra: Mapping[str, torch.Tensor] | None = None, **changes: Any):
        """A new cache of this class holding these tokens plus ``k``/``v``
        ``[B, T, H_kv, D]`` and their ``(B, T)`` keep mask (``extra``: a subclass's other
        per-position tensors); ``changes`` sets other attributes of the new cache. This
        cache is unchanged."""
        keep_bool = (torch.ones(k.shape[:2], dtype=torch.bool, device=k.device) if keep is None
                     else keep.to(device=k.device, dtype=torch.bool))
        new = copy.copy(self)
        new.buffers = self.buffers.append(key=k, value=v, keep=keep_bool, **(extra or {}))
        new.has_mask = self.has_mask or keep is not None
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def clone(self):
        new = copy.copy(self)
        new.buffers = self.buffers.clone()
        new.config = dict(self.config)
        return new

    def check(self, module_name: str, config: Mapping[str, Any], k: torch.Tensor) -> None:
        """Named errors unless this cache fits ``config`` and continues ``k``'s batch/dtype/device."""
        check_cache(self, type(self), config, batch=k.shape[0], dtype=k.dtype, device=k.device,
                    cache_batch=self.batch, cache_dtype=self.dtype, cache_device=self.device)
        st = self.buffers._storage
        if st is not None and tuple(st.tensors["key"].shape[2:]) != tuple(k.shape[2:]):
            raise ShapeError(f"`cache` holds keys [batch, len, {', '.join(map(str, st.tensors['key'].shape[2:]))}]"
                             f" for {module_name}, this call's k is {tuple(k.shape)}")


def cache_placement(module: torch.nn.Module, dtype: torch.dtype | None,
                    device: torch.device | str | None) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of an attention cache ``module.empty_cache(batch, dtype=None,
    device=None)``: those given, else the device of the module's first parameter (the
    CPU for a module without parameters) and its dtype (float32 without parameters),
    or, when the cache is made under ``torch.autocast`` for that device, autocast's
    dtype: the dtype projections give keys and values there."""
    param = next(module.parameters(), None)
    device = torch.device(device if device is not None else "cpu" if param is None else param.device)
    if dtype is None:
        if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        else:
            dtype = torch.float32 if param is None else param.dtype
    return dtype, device
