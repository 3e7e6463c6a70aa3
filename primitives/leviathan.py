"""Leviathan continuous token generator (Batley & Saha, 2026; NeoLLM's LEV layer with
a KHRONOS separable spline kernel). It replaces an embedding table of V·D entries with
a generator of O(k·⌈V^(1/k)⌉·d + h·d·κ·r) parameters.

For one token id (b = ⌈V^(1/k)⌉, most significant digit first):

    c_0..c_{k-1}     base-b digits of id
    z                = Σ_i codebooks[i, c_i]                            [d]
    per mode l < h:
      ŷ              = LayerNorm(z·W_lᵀ; γ_l, β_l, eps 1e-5)             [d]
      z̃              = clamp(sigmoid(ŷ/2), 0, 1)                         [d] ∈ [0,1]^d
      B[j, g]        = w(|z̃_j − g/(κ−1)|·(κ−1)) / Σ_g' w(...)           [d, κ] quadratic B-spline
      φ[j, q]        = Σ_g B[j, g]·(1 + wd_l[j, g, q])                   [d, r]
      M_l[q]         = (−1)^#{j: φ[j,q] < 0} · exp Σ_j log(|φ[j, q]| + 1e-9)   [r]
    E                = Σ_l M_l · head_out[l]                             [D]

with w(δ) = 0.75 − δ² (δ < 0.5), 0.5·(1.5 − δ)² (δ < 1.5), 0 otherwise. Tokens do not
interact, so there is no mask or decoding state: a token is embedded the same way
alone or in any batch.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, DTypeError, ShapeError
from ._token_ids import check_token_ids, ids_in_range, nan_rows, safe_ids
from ._validation import (check_choice, check_has_tokens, check_keep_mask, check_positive_int, check_same_device,
                          check_tensor, without_autocast, zero_padding)

__all__ = [
    "LeviathanGenerator", "leviathan_reference", "leviathan_base", "leviathan_digits",
    "leviathan_basis", "leviathan_knot_grid", "leviathan_kwargs_from_config",
]

LN_EPS = 1e-5
LOG_EPS = 1e-9
BASIS_EPS = 1e-12
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def leviathan_base(vocab_size: int, num_coords: int) -> int:
    """b = ceil(V^(1/k)) in IEEE double, the formula NeoLLM checkpoints are shaped by."""
    base = math.ceil(vocab_size ** (1.0 / num_coords))
    if base**num_coords < vocab_size:  # cannot happen for the ceil formula; kept as a guard
        raise ConfigError(f"base {base}^{num_coords} = {base**num_coords} < vocab_size {vocab_size}")
    return base


def leviathan_id_bound(vocab_size: int | None, base: int, num_coords: int) -> int:
    """The ids a generator embeds are ``[0, bound)``: ``vocab_size``, or b^k when it is None."""
    if vocab_size is None:
        return base**num_coords
    if not (isinstance(vocab_size, int) and 1 <= vocab_size <= base**num_coords):
        raise ConfigError(f"`vocab_size` must be an int in [1, b^k = {base**num_coords}] for codebooks of base "
                          f"{base} and {num_coords} digits, got {vocab_size!r}")
    return vocab_size


def leviathan_digits(ids: torch.Tensor, base: int, num_coords: int) -> torch.Tensor:
    """Base-``base`` digits of ``ids``, most significant first: ``[*ids.shape, num_coords]`` int64."""
    rest = ids.long()
    digits = []
    for _ in range(num_coords):
        digits.append(torch.remainder(rest, base))
        rest = torch.div(rest, base, rounding_mode="floor")
    return torch.stack(digits[::-1], dim=-1)


def leviathan_knot_grid(num_knots: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The fixed knots g/(κ−1), g < κ, in fp32 (fp64 for an fp64 module)."""
    return torch.linspace(0.0, 1.0, num_knots, dtype=dtype, device=device)


def leviathan_basis(z_tilde: torch.Tensor, knot_grid: torch.Tensor) -> torch.Tensor:
    """Normalised quadratic B-spline basis ``[..., κ]`` of points ``z_tilde`` ∈ [0, 1]."""
    num_knots = knot_grid.shape[0]
    delta = (z_tilde.unsqueeze(-1) - knot_grid).abs() * (num_knots - 1)
    w = torch.where(delta < 0.5, 0.75 - delta * delta,
                    torch.where(delta < 1.5, 0.5 * (1.5 - delta) ** 2, torch.zeros_like(delta)))
    return w / w.sum(-1, keepdim=True).clamp_min(BASIS_EPS)


def _working_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # The spline chain runs in fp32, or fp64 when the parameters are fp64 (errata 2).
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def leviathan_reference(
    input_ids: torch.Tensor,
    codebooks: torch.Tensor,
    head_proj_weight: torch.Tensor,
    head_norm_weight: torch.Tensor,
    head_norm_bias: torch.Tensor,
    head_spline_delta: torch.Tensor,
    head_out_weight: torch.Tensor,
    knot_grid: torch.Tensor | None = None,
    *,
    vocab_size: int | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference Leviathan generator.

    Args:
        input_ids: integer ids of any shape ``[*]``; an id outside ``[0, vocab_size)``
            gives a NaN row (no gradient flows through it).
        codebooks: ``[k, b, d]``; head_proj_weight ``[h, d, d]`` (applied as ``z·W_lᵀ``);
            head_norm_weight, head_norm_bias ``[h, d]``; head_spline_delta ``[h, d, κ, r]``;
            head_out_weight ``[h, r, D]``; all in the model dtype.
        knot_grid: ``[κ]`` knots (default: ``linspace(0, 1, κ)`` in the working dtype).
        vocab_size: V (default b^k, every id the digits can represent).
        upcast: ``True`` (the ground truth) sums the seed and the output in the working
            dtype (fp32, or fp64 for fp64 parameters) and casts once at the end.
            ``False`` follows NeoLLM's dtype flow: the seed summed and projected in the
            model dtype, each mode's output cast to the model dtype and accumulated there.
    Returns:
        ``[*input_ids.shape, D]`` in the model dtype. The spline chain (LayerNorm to M)
        always runs in the working dtype.
    """
    num_coords, base, _ = codebooks.shape
    num_modes, _, num_knots, rank = head_spline_delta.shape
    dtype = codebooks.dtype
    work = _working_dtype(codebooks, head_proj_weight, head_norm_weight, head_spline_delta, head_out_weight)
    valid = ids_in_range(input_ids.reshape(-1), leviathan_id_bound(vocab_size, base, num_coords))
    coords = leviathan_digits(safe_ids(input_ids.reshape(-1), valid), base, num_coords)  # [N, k]
    seed_dtype = work if upcast else dtype
    z = torch.zeros(coords.shape[0], codebooks.shape[-1], dtype=seed_dtype, device=codebooks.device)
    for i in range(num_coords):
        z = z + codebooks[i].to(seed_dtype)[coords[:, i]]
    y0 = torch.einsum("ne,hde->nhd", z, head_proj_weight.to(seed_dtype)).to(work)  # [N, h, d]
    mean = y0.mean(-1, keepdim=True)
    var = (y0 - mean).pow(2).mean(-1, keepdim=True)
    y = (y0 - mean) * torch.rsqrt(var + LN_EPS) * head_norm_weight.to(work) + head_norm_bias.to(work)
    z_tilde = torch.sigmoid(y * 0.5).clamp(0.0, 1.0)
    grid = leviathan_knot_grid(num_knots, work, codebooks.device) if knot_grid is None else knot_grid.to(work)
    basis = leviathan_basis(z_tilde, grid)                                            # [N, h, d, κ]
    phi = torch.einsum("nhjg,hjgq->nhjq", basis, 1.0 + head_spline_delta.to(work))   # [N, h, d, r]
    log_mag = torch.log(phi.abs() + LOG_EPS).sum(2)                                   # [N, h, r]
    negatives = (phi < 0).sum(2)
    m = torch.where(negatives % 2 == 1, -1.0, 1.0).to(work) * torch.exp(log_mag)
    if upcast:
        out = torch.einsum("nhq,hqo->no", m, head_out_weight.to(work)).to(dtype)
    else:
        out = torch.zeros(m.shape[0], head_out_weight.shape[-1], dtype=dtype, device=m.device)
        for mode in range(num_modes):
            out = out + m[:, mode].to(dtype) @ head_out_weight[mode]
    return nan_rows(out, valid).reshape(*input_ids.shape, head_out_weight.shape[-1])


def leviathan_kwargs_from_config(config: dict) -> dict:
    """Constructor arguments from NeoLLM configuration keys (``generator_*``)."""
    keys = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "generator_d_seed": "seed_dim",
            "generator_num_modes": "num_modes", "generator_num_knots": "num_knots",
            "generator_spline_degree": "spline_degree", "generator_k": "num_coords", "generator_krank": "rank",
            "initializer_range": "initializer_range"}
    return {ours: config[theirs] for theirs, ours in keys.items() if theirs in config}


# Limits of the Triton kernels (the reference has none): κ and r must fit one register tile.
TRITON_MAX_KNOTS = 32
TRITON_MAX_RANK = 128
_warned: set[str] = set()


class LeviathanGenerator(nn.Module):
    """Leviathan generator: ``embeddings = module(input_ids)``, a drop-in for ``nn.Embedding``.

    Args (NeoLLM configuration key in brackets; defaults are NeoLLM's):
        vocab_size: V [vocab_size] = 64402.
        hidden_size: D [hidden_size] = 512.
        seed_dim: d [generator_d_seed] = 128.
        num_modes: h [generator_num_modes] = 8.
        num_knots: κ ≥ 2 [generator_num_knots] = 16.
        spline_degree: must be 2 [generator_spline_degree]; the closed form is quadratic.
        num_coords: k [generator_k] = 3; base b = ⌈V^(1/k)⌉.
        rank: r [generator_krank] = 64.
        initializer_range: std of the codebooks and projections (0.02).
        unique_ids: evaluate the generator once per distinct id of a call (sync-free;
            see the docs page) rather than once per token. Same result either way.
        backend: "auto" | "triton" | "reference".
        validate_ids: read the ids and raise :class:`TokenIdError` for any outside
            ``[0, V)`` (on a GPU a device sync per call). ``False`` (default, every
            device): no check, such ids give NaN rows on every backend.

    Shapes: ``input_ids`` integer ``[*]`` (typically ``[batch, seq]``) → ``[*, D]`` in
    the parameter dtype. Autocast does not change it (as for ``nn.Embedding``).
    ``attention_mask`` (optional, ``[batch, seq]`` keep mask, needs 2-D ids): padded
    positions may hold any id, are never evaluated and give zero rows.

    Example::

        gen = LeviathanGenerator(vocab_size=64402, hidden_size=512)
        x = gen(torch.randint(0, 64402, (2, 16)))       # [2, 16, 512]
    """

    def __init__(
        self,
        vocab_size: int = 64402,
        hidden_size: int = 512,
        seed_dim: int = 128,
        num_modes: int = 8,
        num_knots: int = 16,
        spline_degree: int = 2,
        num_coords: int = 3,
        rank: int = 64,
        initializer_range: float = 0.02,
        unique_ids: bool = True,
        backend: Backend = "auto",
        validate_ids: bool = False,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("seed_dim", seed_dim),
                            ("num_modes", num_modes), ("num_knots", num_knots), ("num_coords", num_coords),
                            ("rank", rank)):
            check_positive_int(name, value)
        if num_knots < 2:
            raise ConfigError(f"`num_knots` must be >= 2 (knot spacing 1/(κ-1)), got {num_knots}")
        if spline_degree != 2:
            raise ConfigError(f"`spline_degree` must be 2 (the closed-form basis is quadratic), got {spline_degree!r}")
        if not (isinstance(initializer_range, (int, float)) and initializer_range >= 0):
            raise ConfigError(f"`initializer_range` must be a number >= 0, got {initializer_range!r}")
        check_backend(backend)
        check_choice("unique_ids", unique_ids, (True, False))
        check_choice("validate_ids", validate_ids, (True, False))
        if dtype is not None and dtype not in PARAM_DTYPES:
            raise DTypeError(f"`dtype` must be one of fp32/bf16/fp16/fp64, got {dtype}")
        self.vocab_size, self.hidden_size, self.seed_dim = vocab_size, hidden_size, seed_dim
        self.num_modes, self.num_knots, self.num_coords, self.rank = num_modes, num_knots, num_coords, rank
        self.base = leviathan_base(vocab_size, num_coords)
        self.initializer_range = float(initializer_range)
        self.unique_ids, self.backend, self.validate_ids = unique_ids, backend, validate_ids
        kw = dict(device=device, dtype=dtype)
        self.codebooks = nn.Parameter(torch.empty(num_coords, self.base, seed_dim, **kw))
        self.head_proj_weight = nn.Parameter(torch.empty(num_modes, seed_dim, seed_dim, **kw))
        self.head_norm_weight = nn.Parameter(torch.empty(num_modes, seed_dim, **kw))
        self.head_norm_bias = nn.Parameter(torch.empty(num_modes, seed_dim, **kw))
        self.head_spline_delta = nn.Parameter(torch.empty(num_modes, seed_dim, num_knots, rank, **kw))
        self.head_out_weight = nn.Parameter(torch.empty(num_modes, rank, hidden_size, **kw))
        self.register_buffer("knot_grid", self._canonical_grid(), persistent=False)
        self.reset_parameters()

    def _canonical_grid(self) -> torch.Tensor:
        dtype = torch.float64 if self.codebooks.dtype == torch.float64 else torch.float32
        return leviathan_knot_grid(self.num_knots, dtype, self.codebooks.device)

    def reset_parameters(self) -> None:
        std = self.initializer_range
        with torch.no_grad():
            nn.init.normal_(self.codebooks, 0.0, std)
            nn.init.normal_(self.head_proj_weight, 0.0, std)
            nn.init.ones_(self.head_norm_weight)
            nn.init.zeros_(self.head_norm_bias)
            nn.init.normal_(self.head_spline_delta, 0.0, 0.1)
            nn.init.normal_(self.head_out_weight, 0.0, std / math.sqrt(self.num_modes))

    def _apply(self, fn, recurse=True):
        # The knots must stay the fp32 values g/(κ−1) through `.to(bf16)`/`.half()`: bf16
        # knots move the basis by up to 0.027 knot units (errata 1).
        super()._apply(fn, recurse)
        if self.codebooks.device.type != "meta":
            self.knot_grid = self._canonical_grid()
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, param in self._parameters.items():
            key = prefix + name
            if key in state_dict and tuple(state_dict[key].shape) != tuple(param.shape):
                raise ShapeError(f"checkpoint `{key}` has shape {tuple(state_dict[key].shape)}, this "
                                 f"LeviathanGenerator expects {tuple(param.shape)} (check num_knots/rank/seed_dim)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, seed_dim={self.seed_dim}, "
                f"num_modes={self.num_modes}, num_knots={self.num_knots}, num_coords={self.num_coords}, "
                f"base={self.base}, rank={self.rank}, unique_ids={self.unique_ids}, backend={self.backend!r}")

    def _params(self) -> tuple[torch.Tensor, ...]:
        return (self.codebooks, self.head_proj_weight, self.head_norm_weight, self.head_norm_bias,
                self.head_spline_delta, self.head_out_weight)

    def _resolve(self, input_ids: torch.Tensor) -> str:
        backend = resolve_backend(self.backend, input_ids, self.codebooks)
        if backend != "triton":
            return backend
        reasons = []
        if self.codebooks.dtype == torch.float64:
            reasons.append("fp64 parameters")
        if self.num_knots > TRITON_MAX_KNOTS:
            reasons.append(f"num_knots={self.num_knots} > {TRITON_MAX_KNOTS}")
        if self.rank > TRITON_MAX_RANK:
            reasons.append(f"rank={self.rank} > {TRITON_MAX_RANK}")
        if not reasons:
            return "triton"
        why = ", ".join(reasons)
        if self.backend == "triton":
            raise ConfigError(f"the Leviathan Triton kernels do not support {why}; use backend='reference'")
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"laminae: Leviathan runs the PyTorch reference ({why} is outside the kernels' range)",
                          stacklevel=3)
        return "reference"

    @torch.no_grad()
    def embedding_table(self, chunk_size: int = 8192) -> torch.Tensor:
        """The frozen ``[V, D]`` table of every id's embedding, for inference by gather
        (``F.embedding(ids, table)``). It is a snapshot: recompute it after any change
        to the parameters. Built ``chunk_size`` ids at a time to bound the reference's memory."""
        check_positive_int("chunk_size", chunk_size)
        ids = torch.arange(self.vocab_size, device=self.codebooks.device)
        return torch.cat([self(chunk) for chunk in ids.split(chunk_size)])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor("input_ids", input_ids, dtypes=ID_DTYPES)
        check_has_tokens("input_ids", input_ids, input_ids.dim())
        check_same_device(input_ids=input_ids, codebooks=self.codebooks)
        keep = None
        if attention_mask is not None:
            if input_ids.dim() != 2:
                raise ShapeError(f"`input_ids` must be 2-D (batch, seq) with an attention_mask, got shape "
                                 f"{tuple(input_ids.shape)}")
            keep = check_keep_mask("attention_mask", attention_mask, *input_ids.shape)
            check_same_device(input_ids=input_ids, attention_mask=keep)
        if self.validate_ids:
            check_token_ids("input_ids", input_ids, self.vocab_size, keep)
        if self.knot_grid.shape != (self.num_knots,):
            raise ShapeError(f"`knot_grid` must have shape ({self.num_knots},), got {tuple(self.knot_grid.shape)}")
        ids = input_ids if keep is None else torch.where(keep, input_ids, torch.zeros_like(input_ids))
        # An embedding's output dtype is its parameters' dtype; autocast must not recast the
        # spline chain (it runs in fp32 by design).
        with without_autocast(ids.device.type):
            if self._resolve(ids) == "triton":
                from laminae.triton_ops.leviathan import leviathan

                out = leviathan(ids, *self._params(), self.knot_grid, vocab_size=self.vocab_size,
                                unique_ids=self.unique_ids)
            else:
                out = leviathan_reference(ids, *self._params(), self.knot_grid, vocab_size=self.vocab_size)
        (out,) = zero_padding(keep, out)
        return out
