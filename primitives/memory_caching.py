"""Memory Caching: a gated linear-attention memory over segments (arXiv 2602.24281).

The sequence is cut into segments of ``segment_len`` tokens. Every segment i keeps
a linear-attention memory of its tokens, with φ(x) = elu(x) + 1:

    M_i = Σ_{m∈i} φ(k_m) v_mᵀ   [D, D]        z_i = Σ_{m∈i} φ(k_m)   [D]

A token t in segment s reads every earlier segment's full memory and its own
segment causally (tokens m ≤ t only), un-normalised:

    num_i(t) = φ(q_t)ᵀ M_i,  den_i(t) = φ(q_t)·z_i             i < s
    num_s(t) = Σ_{m∈s, m≤t} (φ(q_t)·φ(k_m)) v_m,  den_s(t) = Σ_{m∈s, m≤t} φ(q_t)·φ(k_m)

The reads are mixed by per-token gates, a softmax over the segments i ≤ s of
⟨u_t, pool_i⟩, where pool_i is the mean of p over segment i's valid tokens and,
on the diagonal (i = s), the causal running mean over its tokens m ≤ t:

    γ_{t,i} = softmax_{i≤s} ⟨u_t, pool_i⟩
    y_t = Σ_i γ_{t,i} num_i(t) / (Σ_i γ_{t,i} den_i(t) + eps)      (one global normaliser)

Padding (keep mask 0) removes a token's key from every memory and its p from every
pool. Everything runs in fp32 (the denominator underflows in bf16).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._cache import AppendBuffer, DecodingCache, check_cache
from ._errors import DTypeError, ShapeError
from ._outputs import BlockOutput
from ._validation import (FLOAT_DTYPES, check_has_tokens, check_keep_mask, check_param_dtype, check_positive_float,
                          check_positive_int, check_same_device, check_same_dtype, check_tensor, without_autocast,
                          zero_padding)

_warned_tiles: set[tuple[int, int]] = set()

__all__ = [
    "memory_caching_reference", "check_memory_caching_inputs", "elu_feature_map",
    "MemoryCacheBranch", "MemoryCachingCache",
]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 (positive; the Katharopoulos linear-attention feature map)."""
    return F.elu(x) + 1.0


def check_memory_caching_inputs(q, k, v, u, p, segment_len, attention_mask, eps) -> None:
    """Validate the arguments of :func:`memory_caching_reference` (and its kernel)."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES, layout="[batch, seq, heads, head_dim]")
    B, S, H, D = q.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, shape=(B, S, H, D), dtypes=FLOAT_DTYPES, layout="[batch, seq, heads, head_dim]")
    check_tensor("u", u, ndim=3, dtypes=FLOAT_DTYPES, layout="[batch, seq, gate_dim]")
    G = u.shape[-1]
    check_tensor("p", p, shape=(B, S, G), dtypes=FLOAT_DTYPES, layout="[batch, seq, gate_dim]")
    check_tensor("u", u, shape=(B, S, G), dtypes=FLOAT_DTYPES, layout="[batch, seq, gate_dim]")
    if S == 0 or H == 0 or D == 0 or G == 0:
        raise ShapeError(f"memory caching needs at least one token, head, head dim and gate dim; "
                         f"got q {tuple(q.shape)}, u {tuple(u.shape)}")
    check_same_dtype(q=q, k=k, v=v, u=u, p=p)
    check_same_device(q=q, k=k, v=v, u=u, p=p, attention_mask=attention_mask)
    check_keep_mask("attention_mask", attention_mask, B, S)
    check_positive_int("segment_len", segment_len)
    check_positive_float("eps", eps)


def memory_caching_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    p: torch.Tensor,
    segment_len: int,
    attention_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference Memory Caching readout (before the output projection).

    Args:
        q, k, v: ``[B, S, H, D]`` raw projections (φ is applied to q and k here).
        u: ``[B, S, G]`` per-token gate queries.
        p: ``[B, S, G]`` per-token gate keys, mean-pooled per segment.
        segment_len: L, tokens per segment; S need not be a multiple of L.
        attention_mask: optional ``(B, S)`` keep mask (bool, or integer 0/1; padding).
        eps: added to the global denominator.
        upcast: compute in fp32 (fp64 stays fp64) and cast back — the ground truth;
            ``False`` computes in the input dtype.
    Returns:
        ``y`` ``[B, S, H, D]`` in the dtype of ``q``.

    Written for clarity: it builds every (query segment, key segment) readout,
    a [B, N, N, L, H, D] tensor for N = ⌈S/L⌉ segments.
    """
    check_memory_caching_inputs(q, k, v, u, p, segment_len, attention_mask, eps)
    dtype = q.dtype
    cdt = torch.promote_types(dtype, torch.float32) if upcast else dtype
    B, S, H, D = q.shape
    L = segment_len
    N = -(-S // L)
    pad = N * L - S
    keep = (torch.ones(B, S, dtype=cdt, device=q.device) if attention_mask is None
            else (attention_mask != 0).to(cdt))

    def segments(t: torch.Tensor) -> torch.Tensor:  # [B, S, ...] -> [B, N, L, ...]
        t = t.to(cdt)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(B, N, L, *t.shape[2:])

    keep = segments(keep)                                     # [B, N, L]
    phi_q = elu_feature_map(segments(q))                      # [B, N, L, H, D]
    kept = keep[..., None, None] > 0
    zero = torch.zeros((), dtype=cdt, device=q.device)
    # where, not products: padding (even NaN) must not reach kept tokens through 0·x
    phi_k = torch.where(kept, elu_feature_map(segments(k)), zero)
    v_s = torch.where(kept, segments(v), zero)

    # Full memories of every segment and every query's read of each of them.
    mem = torch.einsum("bnlhd,bnlhe->bnhde", phi_k, v_s)     # [B, N, H, D, D]
    mem_z = phi_k.sum(2)                                      # [B, N, H, D]
    num = torch.einsum("bqlhd,bihde->bqilhe", phi_q, mem)     # [B, Nq, Ni, L, H, D]
    den = torch.einsum("bqlhd,bihd->bqilh", phi_q, mem_z)     # [B, Nq, Ni, L, H]

    # Own segment: causal within the segment.
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(causal, torch.einsum("bnlhd,bnmhd->bnhlm", phi_q, phi_k), zero)
    num_own = torch.einsum("bnhlm,bnmhe->bnlhe", scores, v_s)  # [B, N, L, H, D]
    den_own = scores.sum(-1).permute(0, 1, 3, 2)               # [B, N, L, H]
    diagonal = torch.eye(N, dtype=torch.bool, device=q.device)[None, :, :, None, None]
    num = torch.where(diagonal[..., None], num_own[:, :, None], num)
    den = torch.where(diagonal, den_own[:, :, None], den)

    # Gates: softmax over segments i <= s of <u_t, pool_i>; causal running mean on i = s.
    p_s = torch.where(kept[..., 0], segments(p), zero)         # [B, N, L, G]
    u_s = segments(u)
    pool = p_s.sum(2) / keep.sum(2).clamp_min(1)[..., None]    # [B, N, G]
    running = p_s.cumsum(2) / keep.cumsum(2).clamp_min(1)[..., None]
    score = torch.einsum("bqlg,big->bqil", u_s, pool)          # [B, Nq, Ni, L]
    score_own = (u_s * running).sum(-1)                        # [B, N, L]
    score = torch.where(diagonal[..., 0], score_own[:, :, None], score)
    later = torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1)
    score = score.masked_fill(later[None, :, :, None], float("-inf"))
    gamma = torch.softmax(score, dim=2)                        # [B, Nq, Ni, L]

    y_num = (gamma[..., None, None] * num).sum(2)              # [B, N, L, H, D]
    y_den = (gamma[..., None] * den).sum(2)                    # [B, N, L, H]
    y = y_num / (y_den[..., None] + eps)
    return y.reshape(B, N * L, H, D)[:, :S].to(dtype)


# ----------------------------------------------------------------------------
# Decoding state
# ----------------------------------------------------------------------------


class MemoryCachingCache(DecodingCache):
    """Exact running state of a :class:`MemoryCacheBranch` (start one with
    :meth:`MemoryCacheBranch.empty_cache`). Detached, in fp32 (the branch computes in
    fp32 whatever the activations' dtype).

    Closed segments (one append per segment that filled up, in an
    :class:`~laminae.primitives._cache.AppendBuffer`): ``segment_memories``
    ``[B, n, H, D, D]``, ``segment_normalisers`` ``[B, n, H, D]``, ``segment_pools``
    ``[B, n, G]``. The open segment: ``open_memory`` ``[B, H, D, D]``,
    ``open_normaliser`` ``[B, H, D]``, ``open_pool_sum`` ``[B, G]`` (sum of the kept
    tokens' p), ``open_kept`` ``[B]`` (kept tokens), ``open_length`` (its tokens, < L).
    ``length``: every token seen.

    A call never changes the cache it was given. A weight-shared (looped) stack that
    calls one module several times per token keeps one cache per call site.
    """

    def __init__(self, config: dict, closed: AppendBuffer, open_state: tuple[torch.Tensor, ...],
                 open_length: int = 0, length: int = 0) -> None:
        self.config = dict(config)
        self._closed, self._open = closed, tuple(open_state)
        self.open_length, self._length = int(open_length), int(length)

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch(self) -> int:
        return self._open[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._open[0].dtype

    @property
    def device(self) -> torch.device:
        return self._open[0].device

    @property
    def segment_memories(self) -> torch.Tensor | None:
        return self._closed.get("memories")

    @property
    def segment_normalisers(self) -> torch.Tensor | None:
        return self._closed.get("normalisers")

    @property
    def segment_pools(self) -> torch.Tensor | None:
        return self._closed.get("pools")

    @property
    def open_memory(self) -> torch.Tensor:
        return self._open[0]

    @property
    def open_normaliser(self) -> torch.Tensor:
        return self._open[1]

    @property
    def open_pool_sum(self) -> torch.Tensor:
        return self._open[2]

    @property
    def open_kept(self) -> torch.Tensor:
        return self._open[3]

    def reset(self) -> None:
        # the next append branches off the shared storage: caches sharing it keep their segments
        self._closed = AppendBuffer(self._closed._storage, 0)
        self._open = tuple(torch.zeros_like(t) for t in self._open)
        self.open_length, self._length = 0, 0

    def clone(self) -> "MemoryCachingCache":
        return MemoryCachingCache(self.config, self._closed.clone(), tuple(t.clone() for t in self._open),
                                  self.open_length, self._length)


MIN_SEGMENTS = 4   # closed segments an empty cache has room for before its storage grows


def _empty_state(batch: int, num_heads: int, head_dim: int, gate_dim: int, config: dict,
                 device: torch.device | str | None) -> MemoryCachingCache:
    H, D, G = num_heads, head_dim, gate_dim
    f32 = torch.float32
    closed = AppendBuffer.preallocate(
        MIN_SEGMENTS, {"memories": ((H, D, D), f32), "normalisers": ((H, D), f32), "pools": ((G,), f32)},
        batch, device)
    zeros = lambda *shape: torch.zeros(batch, *shape, dtype=f32, device=device)  # noqa: E731
    return MemoryCachingCache(config, closed, (zeros(H, D, D), zeros(H, D), zeros(G), zeros()))


def _prefill(cache: MemoryCachingCache, phi_k, v, p, keep, segment_len: int) -> MemoryCachingCache:
    """``cache`` (empty) after a prefill of S tokens: phi_k, v ``[B, S, H, D]`` (phi_k
    already masked), p ``[B, S, G]`` (masked), keep ``[B, S]``; all fp32."""
    B, S, H, D = phi_k.shape
    G = p.shape[-1]
    L = segment_len
    closed = S // L
    n = closed * L
    segments = cache._closed
    if closed:
        ks = phi_k[:, :n].reshape(B, closed, L, H, D)
        vs = v[:, :n].reshape(B, closed, L, H, D)
        counts = keep[:, :n].reshape(B, closed, L).sum(2).clamp_min(1)
        segments = segments.append(memories=torch.einsum("bnlhd,bnlhe->bnhde", ks, vs), normalisers=ks.sum(2),
                                   pools=p[:, :n].reshape(B, closed, L, G).sum(2) / counts[..., None])
    open_state = (torch.einsum("blhd,blhe->bhde", phi_k[:, n:], v[:, n:]), phi_k[:, n:].sum(1), p[:, n:].sum(1),
                  keep[:, n:].sum(1))
    return MemoryCachingCache(cache.config, segments, open_state, S - n, S)


def _step(cache: MemoryCachingCache, phi_q, phi_k, v, u, p, keep, segment_len: int,
          eps: float) -> tuple[torch.Tensor, MemoryCachingCache]:
    """One token: phi_q, phi_k (masked), v ``[B, H, D]``; u, p (masked) ``[B, G]``;
    keep ``[B]``. Returns y ``[B, H, D]`` and the advanced cache (``cache`` unchanged)."""
    run_mem = cache.open_memory + torch.einsum("bhd,bhe->bhde", phi_k, v)
    run_z, run_p, run_count = cache.open_normaliser + phi_k, cache.open_pool_sum + p, cache.open_kept + keep
    fill, length = cache.open_length + 1, cache.length + 1

    mems, mem_zs, pools = cache.segment_memories, cache.segment_normalisers, cache.segment_pools
    running_pool = run_p / run_count.clamp_min(1)[:, None]
    num = torch.einsum("bhd,bhde->bhe", phi_q, run_mem)[:, None]                          # [B, 1, H, D]
    den = torch.einsum("bhd,bhd->bh", phi_q, run_z)[:, None]                              # [B, 1, H]
    score = (u * running_pool).sum(-1, keepdim=True)                                      # [B, 1]
    if mems is not None and mems.shape[1]:
        num = torch.cat([torch.einsum("bhd,bnhde->bnhe", phi_q, mems), num], dim=1)      # [B, n+1, H, D]
        den = torch.cat([torch.einsum("bhd,bnhd->bnh", phi_q, mem_zs), den], dim=1)
        score = torch.cat([torch.einsum("bg,bng->bn", u, pools), score], 1)
    gamma = torch.softmax(score, dim=1)                                                   # [B, n+1]
    y = (gamma[:, :, None, None] * num).sum(1) / ((gamma[:, :, None] * den).sum(1)[..., None] + eps)

    closed = cache._closed
    if fill == segment_len:   # the open segment is complete: close it
        closed = closed.append(memories=run_mem[:, None], normalisers=run_z[:, None], pools=running_pool[:, None])
        run_mem, run_z, run_p, run_count = (torch.zeros_like(t) for t in (run_mem, run_z, run_p, run_count))
        fill = 0
    return y, MemoryCachingCache(cache.config, closed, (run_mem, run_z, run_p, run_count), fill, length)


# ----------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------


class MemoryCacheBranch(nn.Module):
    """Memory Caching branch: projections, the gated segment-memory readout, output
    projection. Meant to sit parallel to attention (the caller adds
    ``tanh(gate)·branch(norm(h))``; the zero-init gate and norm are not part of it).

    Args:
        hidden_size: width of ``x``.
        num_heads: memory heads (the seed's ``mc_num_heads``).
        head_dim: per-head width D (``mc_head_dim``).
        segment_len: tokens per segment L (``mc_segment_len``).
        gate_dim: width G of the gate query/key (``mc_gate_dim``).
        eps: added to the global denominator (the seed's 1e-6).
        backend: "auto" | "triton" | "reference".

    Parameters (the seed's names, ``nn.Linear`` default init, no biases):
    ``q_proj``, ``k_proj``, ``v_proj`` [H·D, hidden], ``o_proj`` [hidden, H·D],
    ``u_proj``, ``p_proj`` [G, hidden]. No buffers.

    ``forward(x, attention_mask=None, cache=None) -> BlockOutput(output, cache)``:
    ``x`` ``[B, S, hidden]`` (the parameters' dtype, or any float dtype under
    autocast; the branch runs in fp32 and returns ``x.dtype``), ``attention_mask`` an
    optional ``(B, S)`` keep mask for the S tokens of ``x``. ``cache=None`` is the full
    forward and returns no cache. To decode, start from :meth:`empty_cache`: the first
    call (the prefill) is the full forward and records the segment memories; later
    calls continue them one token at a time (exact: prefill + steps == full forward;
    steps run without autograd). The returned cache holds these tokens too; the one
    passed in is unchanged.

    Example::

        branch = MemoryCacheBranch(256, num_heads=4, head_dim=32, segment_len=64, gate_dim=64)
        y, _ = branch(x)                                                   # training
        y, cache = branch(x_prompt, prompt_mask, cache=branch.empty_cache(batch))   # prefill
        y1, cache = branch(x_next, cache=cache)                            # one token
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        head_dim: int = 32,
        segment_len: int = 64,
        gate_dim: int = 64,
        eps: float = 1e-6,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                            ("segment_len", segment_len), ("gate_dim", gate_dim)):
            check_positive_int(name, value)
        check_positive_float("eps", eps)
        check_backend(backend)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.segment_len, self.gate_dim, self.eps = segment_len, gate_dim, float(eps)
        self.backend = backend
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        self.u_proj = nn.Linear(hidden_size, gate_dim, bias=False)   # per-token gate query
        self.p_proj = nn.Linear(hidden_size, gate_dim, bias=False)   # per-segment gate key (mean-pooled)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"segment_len={self.segment_len}, gate_dim={self.gate_dim}, eps={self.eps}, backend={self.backend!r}")

    def _project(self, xf: torch.Tensor):
        B, S, _ = xf.shape
        H, D = self.num_heads, self.head_dim

        def lin(layer):
            return F.linear(xf, layer.weight.float())

        return (lin(self.q_proj).view(B, S, H, D), lin(self.k_proj).view(B, S, H, D),
                lin(self.v_proj).view(B, S, H, D), lin(self.u_proj), lin(self.p_proj))

    def _check(self, x, attention_mask, cache) -> None:
        check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES, layout="[batch, seq, hidden]")
        if x.shape[-1] != self.hidden_size:
            raise ShapeError(f"last dim of `x` must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        check_has_tokens("x", x)
        check_same_device(x=x, attention_mask=attention_mask, weight=self.q_proj.weight)
        check_param_dtype("x", x, self.q_proj.weight)
        check_keep_mask("attention_mask", attention_mask, x.shape[0], x.shape[1])
        if cache is not None:
            check_cache(cache, MemoryCachingCache, self._cache_config(), batch=x.shape[0], dtype=torch.float32,
                        device=x.device, cache_dtype=getattr(cache, "dtype", None),
                        cache_device=getattr(cache, "device", None))

    def _cache_config(self) -> dict:
        return {"num_heads": self.num_heads, "head_dim": self.head_dim, "segment_len": self.segment_len,
                "gate_dim": self.gate_dim}

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> MemoryCachingCache:
        """An empty decoding cache for ``batch`` sequences on ``device`` (default: the
        parameters'). ``dtype`` (default: the parameters') is the activations'; the
        state is fp32 whatever it is, as the branch computes in fp32."""
        check_positive_int("batch", batch)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of a MemoryCachingCache must be a float dtype, got {dtype}")
        device = self.q_proj.weight.device if device is None else device
        return _empty_state(batch, self.num_heads, self.head_dim, self.gate_dim, self._cache_config(), device)

    def _readout(self, q, k, v, u, p, attention_mask) -> torch.Tensor:
        if resolve_backend(self.backend, q) == "triton":
            from laminae.triton_ops.memory_caching import memory_caching, supports_tile

            if self.backend == "triton" or supports_tile(self.segment_len, self.head_dim):
                return memory_caching(q, k, v, u, p, self.segment_len, attention_mask, self.eps)
            key = (self.segment_len, self.head_dim)
            if key not in _warned_tiles:
                _warned_tiles.add(key)
                warnings.warn(f"laminae: MemoryCacheBranch(segment_len={self.segment_len}, "
                              f"head_dim={self.head_dim}) has no Triton tile; backend='auto' runs the reference",
                              stacklevel=3)
        return memory_caching_reference(q, k, v, u, p, self.segment_len, attention_mask, self.eps)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: MemoryCachingCache | None = None,
    ) -> BlockOutput:
        self._check(x, attention_mask, cache)
        B, S, _ = x.shape
        keep = check_keep_mask("attention_mask", attention_mask, B, S)
        (x,) = zero_padding(keep, x)   # padded tokens (even NaN) reach nothing
        with without_autocast(x.device.type):
            q, k, v, u, p = self._project(x.float())   # the branch computes in fp32 (its denominator)
            kf = torch.ones(B, S, device=x.device) if keep is None else keep.float()
            if cache is None or cache.length == 0:
                y = self._readout(q, k, v, u, p, keep)
                if cache is not None:
                    with torch.no_grad():
                        kept = kf[..., None, None] > 0
                        cache = _prefill(cache, torch.where(kept, elu_feature_map(k), 0.0), v,
                                         torch.where(kept[..., 0], p, 0.0), kf, self.segment_len)
            else:
                with torch.no_grad():
                    phi_q, phi_k = elu_feature_map(q), torch.where(kf[..., None, None] > 0, elu_feature_map(k), 0.0)
                    pm = torch.where(kf[..., None] > 0, p, 0.0)
                    ys = []
                    for t in range(S):
                        yt, cache = _step(cache, phi_q[:, t], phi_k[:, t], v[:, t], u[:, t], pm[:, t], kf[:, t],
                                          self.segment_len, self.eps)
                        ys.append(yt)
                y = torch.stack(ys, dim=1)
            out = F.linear(y.reshape(B, S, -1), self.o_proj.weight.float())
        return BlockOutput(out.to(x.dtype), cache)
