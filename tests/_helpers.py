"""Shared test helpers: kernel-vs-reference assertions and hypothesis strategies."""
from __future__ import annotations

import torch

import laminae.triton_ops.testing as public
from laminae.triton_ops.testing import assert_parity  # noqa: F401  (the public routine, re-exported here)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, dtype=torch.float32, scale: float = 1.0, generator=None) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=DEVICE)


# Value scales, not only shapes: tiny, unit and large magnitudes (the public strategies).
scales = public.scales()
seeds = public.seeds()


def keep_mask(batch: int, length: int, gen: torch.Generator, p_drop: float = 0.3) -> torch.Tensor:
    """Ragged padding: random holes (the public strategy, on the test device)."""
    return public.keep_mask(batch, length, gen, p_drop, DEVICE)


def host_reads(fn) -> int:
    """How many times ``fn`` read a tensor value back to the host (``.item()``, ``bool(t)``,
    ``int(t)``): on a GPU each is a device sync."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


# Relative RMSE of an op against its reference run in float64, per input dtype: fp32 is the
# op's own rounding (the bound ``parity_float64`` uses); bf16/fp16 allow one rounding of each
# result to the dtype (RMS 2⁻⁸/√3 and 2⁻¹¹/√3 of a value), with margin.
FLOAT64_REL_RMSE = {torch.float32: public.FLOAT64_REL_RMSE, torch.float16: 5e-4, torch.bfloat16: 4e-3}


def assert_matches_float64(op, reference, inputs, grad_names, *, dtype=None, exact_names=(), conditioning=None,
                           slack=None, magnitude: float = 1.0, seed: int = 0):
    """Judge ``op`` against ``reference`` run in float64 (the truth), not against an fp32 run:
    every output and gradient by relative RMSE over the tensor (``FLOAT64_REL_RMSE`` of the
    inputs' dtype, with ``parity_float64``'s absolute floor), and the outputs of an fp32 op
    element-wise as well (fp32 forward tolerance). Gradients are not checked element-wise:
    a gradient that sums many tokens gives a small element the absolute rounding error of
    its large neighbours, in an fp32 reference as much as in the op. ``dtype`` (default:
    the first floating input's) picks the bound; ``exact_names`` ("out0", "dx", ...) are
    results returned in fp32 whatever that dtype, held to the fp32 bound.

    ``conditioning=K`` (for property tests that draw ill-conditioned cases) also runs the
    reference on the inputs as given and lets a gradient be up to K times as far from the
    truth as that run is: where a gradient is tiny next to the terms it cancels (a
    LayerNorm over two seed dims), no fp32 computation holds the fixed bound.

    ``slack={name: e}`` adds ``e`` to the bound on ``‖a − b‖`` of that compared tensor:
    an error the test derives from its inputs' conditioning (what any fp32 order of
    summation may cost on an ill-conditioned row), so only those rows' share is relaxed.

    ``magnitude`` multiplies both absolute terms (the float64 floor and the fp32
    element-wise atol): the size of the terms the results sum and cancel next to
    unit-scale inputs. Attention on inputs of scale s has scores of s² and values of s:
    a gradient that is exactly 0 (a query alone with its one key) comes out of the
    ``Σ O·dO`` form of the backward at a rounding of those terms, not of 1."""
    from laminae.triton_ops._parity import _run, compare

    dtype = dtype or next(v.dtype for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    out_a, grad_a, up = _run(op, inputs, grad_names, None, seed, None)
    out_b, grad_b, _ = _run(reference, inputs, grad_names, up, seed, torch.float64)
    grad_c = _run(reference, inputs, grad_names, up, seed, None)[1] if conditioning else {}
    pairs = [(f"out{i}", a, b, None) for i, (a, b) in enumerate(zip(out_a, out_b))
             if isinstance(a, torch.Tensor) and a.is_floating_point()]
    pairs += [(f"d{k}", grad_a.get(k), grad_b.get(k), grad_c.get(k)) for k in grad_names]
    unknown = sorted(set(slack or {}) - {p[0] for p in pairs})
    assert not unknown, f"slack names {unknown}, which are not compared here"
    failures = []
    for name, a, b, c in pairs:
        if a is None or b is None:
            if a is not b:
                failures.append(f"{name}: one side has no gradient")
            continue
        a64, b64 = a.detach().double(), b.detach().double()
        bound_rel = FLOAT64_REL_RMSE[torch.float32 if name in exact_names else dtype]
        err, ref = float(torch.linalg.vector_norm(a64 - b64)), float(torch.linalg.vector_norm(b64))
        bound = bound_rel * ref + magnitude * public.FLOAT64_ABS_RMS * max(1, b64.numel()) ** 0.5
        if c is not None:
            bound = max(bound, conditioning * float(torch.linalg.vector_norm(c.detach().double() - b64)))
        bound += (slack or {}).get(name, 0.0)
        if not err <= bound:
            failures.append(f"{name}: ‖a−b‖ = {err:.3e} > {bound:.3e} (relative RMSE {err / max(ref, 1e-30):.3e}, "
                            f"bound {bound_rel})")
        if name.startswith("out") and dtype == torch.float32:
            atol, rtol = public.tolerance(torch.float32, "fwd")
            cmp = compare(name, a, b, magnitude * atol, rtol)
            if not cmp.ok:
                failures.append(f"{name} element-wise: {cmp.detail}")
    assert not failures, "op differs from the float64 truth:\n" + "\n".join(failures)
