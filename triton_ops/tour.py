"""The main job: every implemented mechanism's Triton op against its reference.

    python -m laminae.triton_ops.tour            (or the ``laminae-tour`` script)
    laminae-tour --device cuda --dtype bfloat16  (every kernel on a GPU, in bf16)
    python -m laminae.triton_ops.tour --recipes  every recipe against its seed's fixtures
    laminae-tour --recipes naylis                one fixture

For each mechanism it runs the kernel and the reference on small random inputs,
forward and backward with a shared random upstream gradient, and prints the
backend actually used (compiled Triton on CUDA, the interpreter on CPU), the max
abs error of the outputs and of all gradients, the eager reference time, and on
CUDA the Triton time and speed-up. Exits 1 if any error exceeds tolerance.

``MECHANISMS`` are the declared stems (``primitives/_mechanisms.py``); each one's
``triton_ops/<stem>.py`` provides ``tour_case(device) -> TourCase`` (or a list).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from laminae.primitives._mechanisms import STEMS

MECHANISMS = list(STEMS)


@dataclass
class TourCase:
    name: str
    op: Callable
    reference: Callable
    inputs: Mapping[str, object]
    grad_names: Sequence[str]


def attention_inputs(device, gen, batch: int = 2, seq: int = 64, heads: int = 4, kv_heads: int = 2,
                     head_dim: int = 32) -> dict:
    """q, k, v of a GQA attention case and its ragged keep mask (left padding on the second
    row, a hole in the first): the inputs every attention core's tour case starts from."""
    import torch

    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[1, :9] = False
    keep[0, 50:53] = False
    return {"q": torch.randn(batch, seq, heads, head_dim, generator=gen).to(device),
            "k": torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device),
            "v": torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device),
            "attention_mask": keep.to(device)}


def _prepare_environment() -> None:
    from laminae.primitives._backend import interpret_without_cuda

    interpret_without_cuda()
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def _time_fwd_bwd(fn: Callable, inputs: Mapping[str, object], grad_names: Sequence[str], device, reps: int) -> float:
    import torch

    from ._parity import _run

    _run(fn, inputs, grad_names, None, 0, None)  # warm-up (compilation, autotune, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        _run(fn, inputs, grad_names, None, 0, None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _cast(inputs: Mapping[str, object], dtype) -> dict:
    """fp32 tensors of a tour case in ``dtype`` (integer inputs such as indices stay)."""
    import torch

    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v
            for k, v in inputs.items()}


def run(mechanisms: Sequence[str], reps: int, device=None, dtype=None) -> int:
    import torch

    from laminae.primitives._backend import backend_label

    from ._parity import parity, tolerance

    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or torch.float32
    rows = []
    failed = False
    for stem in mechanisms:
        module = importlib.import_module(f"laminae.triton_ops.{stem}")
        cases = module.tour_case(device)
        for case in cases if isinstance(cases, (list, tuple)) else [cases]:
            if dtype != torch.float32:
                case.inputs = _cast(case.inputs, dtype)
            result = parity(case.op, case.reference, case.inputs, case.grad_names, dtype=dtype, seed=0)
            ref_ms = _time_fwd_bwd(case.reference, case.inputs, case.grad_names, device, reps)
            if device.type == "cuda":
                tri_ms = _time_fwd_bwd(case.op, case.inputs, case.grad_names, device, reps)
                tri, speed = f"{tri_ms:.3f}", f"{ref_ms / tri_ms:.2f}x"
            else:
                tri = speed = "-"
            status = "ok" if result.ok else "FAIL"
            failed |= not result.ok
            rows.append((case.name, backend_label(device), f"{result.max_out_err:.2e}",
                         f"{result.max_grad_err:.2e}", f"{ref_ms:.3f}", tri, speed, status))
            if not result.ok:
                print(f"[{case.name}] mismatches:\n{result.report()}", file=sys.stderr)
    header = ("mechanism", "backend", "max|dy|", "max|dgrad|", "ref ms (fwd+bwd)", "triton ms", "speed-up", "status")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(fmt.format(*r))
    atol_f, rtol_f = tolerance(dtype, "fwd")
    atol_b, rtol_b = tolerance(dtype, "bwd")
    name = str(dtype).replace("torch.", "")
    extra = "" if dtype == torch.float32 else " (plus twice the same-dtype reference's error vs fp32)"
    print(f"\n{name} tolerances: forward atol={atol_f} rtol={rtol_f}; backward atol={atol_b} rtol={rtol_b}{extra}")
    print("FAILED" if failed else f"all {len(rows)} checks within tolerance")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="laminae-tour", description=__doc__.split("\n\n")[0])
    parser.add_argument("mechanisms", nargs="*", help="subset of mechanism stems (with --recipes: of fixtures; "
                        "default: all)")
    parser.add_argument("--reps", type=int, default=3, help="timing repetitions")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where to run (default: cuda when available, else cpu with the interpreter)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="input dtype; bfloat16/float16 are checked against the fp32 reference (GPU only)")
    parser.add_argument("--recipes", action="store_true",
                        help="instead: every recipe's seed-parity line on its fixtures (both backends)")
    args = parser.parse_args(argv)
    if args.recipes:
        _prepare_environment()
        from laminae.recipes.parity import FIXTURES, report

        unknown = sorted(set(args.mechanisms) - set(FIXTURES))
        if unknown:
            parser.error(f"unknown fixtures {unknown}; choose from {list(FIXTURES)}")
        return report(fixtures=args.mechanisms or None)
    args.mechanisms = args.mechanisms or MECHANISMS
    unknown = sorted(set(args.mechanisms) - set(MECHANISMS))
    if unknown:
        parser.error(f"unknown mechanisms {unknown}; choose from {MECHANISMS}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, DTYPES[args.dtype])
    if device == "cpu" and dtype != torch.float32:
        parser.error(f"--dtype {args.dtype} needs --device cuda: the CPU interpreter runs bf16 arithmetic "
                     "outside tl.dot on raw bits, so only float32 is checked there")
    _prepare_environment()
    return run(args.mechanisms, args.reps, device, dtype)


if __name__ == "__main__":
    sys.exit(main())
