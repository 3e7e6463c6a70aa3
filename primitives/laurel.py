"""LAuReL: Learned Augmented Residual Layer (Menghani, Kumar & Kumar, ICML 2025).

Generalises the residual connection around one sublayer with output ``f`` (the
``sublayer_output`` keyword of every entry point):

    RW     y = α_s·f + β_s·x                  (α_s, β_s) = softmax(α̃, β̃)
    LR     y = f + x + (x·A)·B                A: [D, r], B: [r, D]
    RW+LR  y = α_s·f + β_s·(x + (x·A)·B)

``x`` is the sublayer's input residual (before its pre-norm), ``f`` the whole branch
output including the pre-norm. Activations are row vectors, so the seed's "B A x" is
written ``(x·A)·B``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, ShapeError
from ._validation import (check_choice, check_has_tokens, check_positive_int, check_same_device, check_tensor,
                          match_activation_dtypes, without_autocast)

__all__ = ["laurel_reference", "laurel_weights", "LAuReL", "LAuReLBlock", "laurel_lr_init"]


def laurel_weights(alpha_logit: torch.Tensor, beta_logit: torch.Tensor) -> torch.Tensor:
    """(α_s, β_s) = softmax(α̃, β̃) in fp32 (fp64 for fp64 logits), as a tensor of shape [2]."""
    dtype = torch.promote_types(alpha_logit.dtype, torch.float32)
    logits = torch.stack([alpha_logit.reshape(()), beta_logit.reshape(())]).to(dtype)
    return torch.softmax(logits, dim=0)


def laurel_reference(
    x: torch.Tensor,
    alpha_logit: torch.Tensor | None = None,
    beta_logit: torch.Tensor | None = None,
    lr_A: torch.Tensor | None = None,
    lr_B: torch.Tensor | None = None,
    *,
    sublayer_output: torch.Tensor,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference LAuReL combination.

    Args:
        x: the sublayer's input residual ``[..., D]`` (the stream LAuReL updates).
        alpha_logit, beta_logit: scalar logits; both given → RW weighting.
        lr_A ``[D, r]``, lr_B ``[r, D]``: both given → low-rank augmentation.
        sublayer_output: the branch output f ``[..., D]`` (same shape and dtype as ``x``).
        upcast: compute in fp32 and cast back (the ground truth); ``False`` keeps
            the input dtype (the same-dtype eager baseline).
    Returns:
        ``y`` with the shape and dtype of ``sublayer_output``.
    """
    f = sublayer_output
    dtype = f.dtype
    # fp32 for fp32/bf16/fp16, fp64 stays fp64 (gradcheck and fp64 users get fp64 math)
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    cf, cx = f.to(compute), x.to(compute)
    u = cx
    if lr_A is not None:
        # matmuls in model dtype with fp32 accumulation, as the spec prescribes
        low_rank = (x @ lr_A.to(x.dtype)) @ lr_B.to(x.dtype)
        u = cx + low_rank.to(cx.dtype)
    if alpha_logit is None:
        y = cf + u
    else:
        w = laurel_weights(alpha_logit, beta_logit).to(cf.dtype)
        y = w[0] * cf + w[1] * u
    return y.to(dtype)


def laurel_lr_init(hidden_size: int, rank: int) -> torch.Tensor:
    """Column-orthogonal A: A[i, j] = 1/sqrt(r·D) where i mod r == j, else 0."""
    a = torch.zeros(hidden_size, rank)
    rows = torch.arange(hidden_size)
    a[rows, rows % rank] = 1.0 / math.sqrt(rank * hidden_size)
    return a


class LAuReL(nn.Module):
    """LAuReL residual combination for one sublayer: ``y = module(x, sublayer_output=f)``.

    Args:
        hidden_size: D.
        use_rw: learned residual weights (2 parameters: ``alpha_logit``, ``beta_logit``).
        use_lr: low-rank augmentation (2·r·D parameters: ``lr_A`` [D, r], ``lr_B`` [r, D]).
        lr_rank: r, 1 ≤ r ≤ D (seed default 32; the paper recommends 32–64).
        rw_init: initial (α̃, β̃). Default (0, 0) → α_s = β_s = 0.5; (0, 2) gives a
            near-identity start (β_s ≈ 0.88).
        backend: "auto" | "triton" | "reference".
        check_finite: raise if the RW logits are not finite. ``None`` (default) checks
            on CPU only, since on a GPU the check synchronises the device every call.

    Shapes: ``x`` (the residual stream) and ``sublayer_output`` are ``[..., D]``
    (typically ``[batch, seq, D]``), fp32/bf16/fp16; returns ``y`` of that shape.

    Example::

        laurel = LAuReL(512, use_rw=True, use_lr=True, lr_rank=32)
        x = laurel(x, sublayer_output=attn(norm(x)))
    """

    def __init__(
        self,
        hidden_size: int,
        use_rw: bool = True,
        use_lr: bool = False,
        lr_rank: int = 32,
        rw_init: tuple[float, float] = (0.0, 0.0),
        backend: Backend = "auto",
        check_finite: bool | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_backend(backend)
        if not (use_rw or use_lr):
            raise ConfigError("LAuReL needs at least one variant: set use_rw=True and/or use_lr=True")
        if use_lr:
            check_positive_int("lr_rank", lr_rank)
            if lr_rank > hidden_size:
                raise ConfigError(
                    f"`lr_rank` must be <= hidden_size ({hidden_size}) for a column-orthogonal A, got {lr_rank}"
                )
        if len(rw_init) != 2 or not all(math.isfinite(float(v)) for v in rw_init):
            raise ConfigError(f"`rw_init` must be two finite floats (alpha, beta), got {rw_init!r}")
        self.hidden_size, self.use_rw, self.use_lr = hidden_size, use_rw, use_lr
        self.lr_rank = lr_rank if use_lr else 0
        self.backend = backend
        self.check_finite = check_finite
        if use_rw:
            self.alpha_logit = nn.Parameter(torch.tensor(float(rw_init[0])))
            self.beta_logit = nn.Parameter(torch.tensor(float(rw_init[1])))
        if use_lr:
            self.lr_A = nn.Parameter(laurel_lr_init(hidden_size, lr_rank))
            self.lr_B = nn.Parameter(torch.zeros(lr_rank, hidden_size))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, use_rw={self.use_rw}, use_lr={self.use_lr}, lr_rank={self.lr_rank}, backend={self.backend!r}"

    def _params(self):
        a = self.alpha_logit if self.use_rw else None
        b = self.beta_logit if self.use_rw else None
        la = self.lr_A if self.use_lr else None
        lb = self.lr_B if self.use_lr else None
        return a, b, la, lb

    def forward(self, x: torch.Tensor, *, sublayer_output: torch.Tensor) -> torch.Tensor:
        f = sublayer_output
        check_tensor("x", x)
        check_tensor("sublayer_output", f)
        if f.shape != x.shape:
            raise ShapeError(f"`sublayer_output` must have the shape of `x` {tuple(x.shape)}, got {tuple(f.shape)}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ShapeError(f"last dim of `x` must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        check_has_tokens("x", x, None)
        check_same_device(x=x, sublayer_output=f, weight=next(self.parameters()))
        x, f = match_activation_dtypes(x=x, sublayer_output=f)
        params = self._params()
        # Reading the logits' finiteness on a GPU is a device sync per call; there it
        # runs only when asked for (check_finite=True), on CPU always.
        check = self.check_finite if self.check_finite is not None else params[0] is not None and params[0].device.type == "cpu"
        if self.use_rw and check and not torch.compiler.is_compiling():
            logits = torch.stack([params[0], params[1]]).detach()
            if not bool(torch.isfinite(logits).all()):
                raise ConfigError(f"LAuReL `alpha_logit`/`beta_logit` must be finite, got {logits.tolist()} "
                                  "(a diverged step; check_finite=False skips this check)")
        with without_autocast(f.device.type):
            if resolve_backend(self.backend, x, f) == "triton":
                from laminae.triton_ops.laurel import laurel

                return laurel(x, *params, sublayer_output=f)
            return laurel_reference(x, *params, sublayer_output=f)


class LAuReLBlock(nn.Module):
    """A pre-norm sublayer wrapped with LAuReL: ``y = LAuReL(sublayer(norm(x)), base)``.

    ``augment_input`` picks what the residual path g acts on (spec open point 2):
    "residual" (default, recommended) uses the un-normalised stream ``x``; "normed"
    uses the normalised input ``norm(x)``.
    """

    def __init__(self, sublayer: nn.Module, norm: nn.Module | None, hidden_size: int,
                 augment_input: str = "residual", **laurel_kwargs) -> None:
        super().__init__()
        check_choice("augment_input", augment_input, ("residual", "normed"))
        self.sublayer, self.norm = sublayer, norm if norm is not None else nn.Identity()
        self.augment_input = augment_input
        self.laurel = LAuReL(hidden_size, **laurel_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.laurel(x if self.augment_input == "residual" else h, sublayer_output=self.sublayer(h))
