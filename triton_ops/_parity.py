"""Kernel-vs-reference parity: one routine used by the test suite and the tour.

``parity`` runs an op and its reference on identical inputs, backpropagates the
same random upstream gradient through every floating output, and returns the
errors of the outputs and of every requested gradient. Tolerances live here,
once, per dtype and direction (backward looser than forward). ``where`` restricts
any compared tensor to the elements a caller can vouch for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from laminae.primitives._errors import ConfigError, DTypeError, ShapeError

# (atol, rtol) per (dtype, direction). An element passes when
# |a - b| <= atol + rtol * |b|, the torch.allclose rule.
TOLERANCES: dict[tuple[torch.dtype, str], tuple[float, float]] = {
    (torch.float64, "fwd"): (1e-10, 1e-8),
    (torch.float64, "bwd"): (1e-9, 1e-7),
    (torch.float32, "fwd"): (2e-5, 2e-4),
    (torch.float32, "bwd"): (1e-4, 1e-3),
    (torch.float16, "fwd"): (2e-3, 2e-3),
    (torch.float16, "bwd"): (1e-2, 1e-2),
    (torch.bfloat16, "fwd"): (1.6e-2, 1.6e-2),
    (torch.bfloat16, "bwd"): (6e-2, 6e-2),
}


def tolerance(dtype: torch.dtype, direction: str) -> tuple[float, float]:
    return TOLERANCES[(dtype, direction)]


@dataclass
class Comparison:
    name: str
    max_abs: float
    rel_rmse: float
    ok: bool
    detail: str = ""


@dataclass
class ParityResult:
    outputs: list[Comparison] = field(default_factory=list)
    grads: list[Comparison] = field(default_factory=list)

    @property
    def max_out_err(self) -> float:
        return max((c.max_abs for c in self.outputs), default=0.0)

    @property
    def max_grad_err(self) -> float:
        return max((c.max_abs for c in self.grads), default=0.0)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.outputs + self.grads)

    def failures(self) -> list[Comparison]:
        return [c for c in self.outputs + self.grads if not c.ok]

    def report(self) -> str:
        lines = [f"{'FAIL' if not c.ok else 'ok  '} {c.name}: max_abs={c.max_abs:.3e} rel_rmse={c.rel_rmse:.3e} {c.detail}"
                 for c in self.outputs + self.grads]
        return "\n".join(lines)


def compare(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None,
            atol: float, rtol: float) -> Comparison:
    if actual is None or expected is None:
        both = actual is None and expected is None
        return Comparison(name, 0.0 if both else float("inf"), 0.0, both,
                          "" if both else f"one side has no gradient (actual={actual is None}, expected={expected is None})")
    if actual.shape != expected.shape:
        return Comparison(name, float("inf"), float("inf"), False,
                          f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, b = actual.detach().double(), expected.detach().double()
    if a.numel() == 0:
        return Comparison(name, 0.0, 0.0, True)
    nonfinite = ~torch.isfinite(a)
    if bool((nonfinite != ~torch.isfinite(b)).any()) or bool((a[nonfinite] != b[nonfinite]).any()):
        idx = torch.nonzero(nonfinite != ~torch.isfinite(b))
        first = tuple(idx[0].tolist()) if len(idx) else "?"
        return Comparison(name, float("inf"), float("inf"), False,
                          f"non-finite mismatch at {first}: actual={a[first] if len(idx) else '?'}")
    a = torch.where(nonfinite, 0.0, a)
    b = torch.where(nonfinite, 0.0, b)
    diff = (a - b).abs()
    max_abs = float(diff.max())
    rel_rmse = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
    bad = diff > atol + rtol * b.abs()
    ok = not bool(bad.any())
    detail = ""
    if not ok:
        first = tuple(torch.nonzero(bad)[0].tolist())
        detail = (f"{int(bad.sum())}/{bad.numel()} elements off; first at {first}: "
                  f"actual={a[first].item():.6g} expected={b[first].item():.6g} (atol={atol}, rtol={rtol})")
    return Comparison(name, max_abs, rel_rmse, ok, detail)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _run(fn: Callable, inputs: Mapping[str, object], grad_names: Sequence[str],
         upstream: list[torch.Tensor] | None, seed: int, upcast: torch.dtype | None):
    leaves = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            t = v.detach().clone()
            if upcast is not None and t.is_floating_point():
                t = t.to(upcast)
            if k in grad_names:
                t.requires_grad_(True)
            leaves[k] = t
        else:
            leaves[k] = v
    outs = _as_tuple(fn(**leaves))
    diff_outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if upstream is None:
        # in the op's output dtype, so that a reference run in a wider one backpropagates
        # exactly the values the op did
        gen = torch.Generator(device="cpu").manual_seed(seed)
        upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype) for o in diff_outs]
    grads: dict[str, torch.Tensor | None] = {}
    wanted = [k for k in grad_names if k in leaves]
    if diff_outs and wanted:
        got = torch.autograd.grad(diff_outs, [leaves[k] for k in wanted],
                                  [u.to(o.dtype) for u, o in zip(upstream, diff_outs)], allow_unused=True)
        grads = dict(zip(wanted, got))
    return outs, grads, upstream


Where = Mapping[str, torch.Tensor]


def _restrict(where: Where | None, pairs: list) -> list:
    """``pairs`` of (direction, name, *tensors) with each named tensor cut down to the
    elements ``where[name]`` keeps (a bool mask broadcastable to it)."""
    if not where:
        return pairs
    names = [p[1] for p in pairs]
    unknown = sorted(set(where) - set(names))
    if unknown:
        raise ConfigError(f"`where` names {unknown}, which are not compared here; the compared tensors are "
                          f"{names} (outputs by output name, gradients as 'd' + input name)")
    cut = []
    for direction, name, *tensors in pairs:
        keep = where.get(name)
        shape = next((t.shape for t in tensors if t is not None), None)
        if keep is not None and shape is not None:
            if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
                raise DTypeError(f"`where[{name!r}]` must be a bool tensor (True = compare), got "
                                 f"{getattr(keep, 'dtype', type(keep).__name__)}")
            try:
                full = torch.broadcast_shapes(keep.shape, shape) == shape
            except RuntimeError:
                full = False
            if not full:
                raise ShapeError(f"`where[{name!r}]` of shape {tuple(keep.shape)} does not broadcast to the shape "
                                 f"of {name}, {tuple(shape)}")
            tensors = [None if t is None else t.detach()[keep.to(t.device).expand(shape)] for t in tensors]
        cut.append((direction, name, *tensors))
    return cut


def parity(op: Callable, reference: Callable, inputs: Mapping[str, object], grad_names: Sequence[str],
           *, dtype: torch.dtype | None = None, seed: int = 0,
           output_names: Sequence[str] | None = None, where: Where | None = None) -> ParityResult:
    """Compare ``op(**inputs)`` with ``reference(**inputs)``, outputs and gradients.

    For fp32/fp64 the reference runs on the same inputs and tolerances come from
    :data:`TOLERANCES`. For bf16/fp16 the truth is the reference in fp32, and the
    kernel may be at most twice as far from it as the same-dtype reference
    (plus the dtype's atol): precision-appropriate rather than a magic number.

    ``where`` maps a compared tensor's name — an output (``output_names``, else
    ``"out0"``, ``"out1"``, ...) or a gradient (``"d"`` + the input's name, as in the
    report) — to a bool mask broadcastable to it: only its True elements are
    compared (a name not compared here is an error, so a typo cannot pass silently).
    It selects elements of that one tensor; a gradient summed over rows (a
    per-head parameter's) still holds every row's contribution.
    """
    dtype = dtype or next(v.dtype for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    out_a, grad_a, up = _run(op, inputs, grad_names, None, seed, None)
    low = dtype in (torch.float16, torch.bfloat16)
    out_b, grad_b, _ = _run(reference, inputs, grad_names, up, seed, torch.float32 if low else None)
    if low:
        out_c, grad_c, _ = _run(reference, inputs, grad_names, up, seed, None)
    result = ParityResult()
    names = list(output_names) if output_names else [f"out{i}" for i in range(len(out_a))]
    pairs = [("fwd", n, a, b, (out_c[i] if low else None)) for i, (n, a, b) in enumerate(zip(names, out_a, out_b))
             if isinstance(a, torch.Tensor) and a.is_floating_point()]
    pairs += [("bwd", f"d{k}", grad_a.get(k), grad_b.get(k), grad_c.get(k) if low else None) for k in grad_names]
    for direction, name, a, b, c in _restrict(where, pairs):
        atol, rtol = tolerance(dtype, direction)
        if low and a is not None and b is not None and c is not None:
            base = float((c.detach().double() - b.detach().double()).abs().max()) if c.numel() else 0.0
            cmp = compare(name, a, b, atol + 2.0 * base, rtol)
        else:
            cmp = compare(name, a, b, atol, rtol)
        (result.outputs if direction == "fwd" else result.grads).append(cmp)
    return result


# fp32 op vs the float64 reference: a relative-RMSE bound tight enough that a uniform
# ×1.001 error in any output or gradient fails (its relative RMSE is 1e-3), loose enough
# for fp32 rounding (≤ 1e-6 measured on every tour case). The absolute floor is per
# element of the largest compared tensor: a gradient whose truth cancels to (almost)
# nothing is fp32 rounding of the whole computation behind it, and one summed over
# every row (a per-head parameter) has as many rounded terms as the output has
# elements, not its own one. DERF at one query and one key, where the truth is ~0,
# needs 1.4e-6 (60 draws of α, b ~ N(0, 4)); every tour gradient but DERF's ∂γ
# (~1e-8) is large enough, over that count, that a ×1.001 error still fails.
FLOAT64_REL_RMSE = 2e-5
FLOAT64_ABS_RMS = 4e-6
# bf16/fp16 ops against the same float64 truth: two ulps of the dtype, RMS (a kernel
# with 16-bit operands and fp32 accumulation lands within 1.5 on every tour case; one
# whose δ = dO·O is rounded to 16 bits before the subtraction, 3 to 8 on DERF rows
# that nearly see one key)
FLOAT64_REL_RMSE_ULPS = 2.0


def parity_float64(op: Callable, reference: Callable, inputs: Mapping[str, object], grad_names: Sequence[str],
                   *, seed: int = 0, output_names: Sequence[str] | None = None,
                   rel_rmse: float | None = None, abs_rms: float = FLOAT64_ABS_RMS,
                   where: Where | None = None) -> ParityResult:
    """Compare ``op`` with ``reference`` run in float64 on the same values.

    Element-wise tolerances (:func:`parity`) admit a uniform scale error of 1e-3 in a
    gradient; this check bounds the relative RMSE of each output and gradient against
    the float64 truth instead: ``‖a − b‖ ≤ rel_rmse·‖b‖ + abs_rms·√N``, N the element
    count of the largest compared tensor. ``rel_rmse`` defaults to
    :data:`FLOAT64_REL_RMSE` for fp32 inputs and to :data:`FLOAT64_REL_RMSE_ULPS` ulps
    (``torch.finfo(dtype).eps``) for bf16/fp16 ones. ``where`` as in :func:`parity`."""
    if rel_rmse is None:
        dtype = next((v.dtype for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()),
                     torch.float32)
        low = dtype in (torch.float16, torch.bfloat16)
        rel_rmse = FLOAT64_REL_RMSE_ULPS * torch.finfo(dtype).eps if low else FLOAT64_REL_RMSE
    out_a, grad_a, up = _run(op, inputs, grad_names, None, seed, None)
    out_b, grad_b, _ = _run(reference, inputs, grad_names, up, seed, torch.float64)
    names = list(output_names) if output_names else [f"out{i}" for i in range(len(out_a))]
    pairs = [("fwd", n, a, b) for n, a, b in zip(names, out_a, out_b)
             if isinstance(a, torch.Tensor) and a.is_floating_point()]
    pairs += [("bwd", f"d{k}", grad_a.get(k), grad_b.get(k)) for k in grad_names]
    pairs = _restrict(where, pairs)
    largest = max((t.numel() for _, _, a, b in pairs for t in (a, b) if t is not None), default=1)
    result = ParityResult()
    for direction, name, a, b in pairs:
        if a is None or b is None:
            cmp = compare(name, a, b, 0.0, 0.0)
        else:
            a64, b64 = a.detach().double(), b.detach().double()
            err, ref = float(torch.linalg.vector_norm(a64 - b64)), float(torch.linalg.vector_norm(b64))
            bound = rel_rmse * ref + abs_rms * max(1, largest) ** 0.5
            ok = err <= bound
            cmp = Comparison(name, float((a64 - b64).abs().max()) if a64.numel() else 0.0, err / max(ref, 1e-30), ok,
                             "" if ok else f"‖a−b‖={err:.3e} > bound {bound:.3e} (rel_rmse={rel_rmse}, vs float64)")
        (result.outputs if direction == "fwd" else result.grads).append(cmp)
    return result
