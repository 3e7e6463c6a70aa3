"""One harness for every recipe: which seed-parity fixture belongs to which recipe.

A new recipe plugs in by adding its fixture folders to ``SEED_FIXTURES``
(tests/_fixtures.py). Every recipe module
provides ``CONFIG.from_seed_config``, ``build``, ``loss``,
``load_reference_state_dict`` and ``reference_parameters``.
"""
from __future__ import annotations

import importlib

import torch

from .._decoding import prefill_then_decode
from .._fixtures import SEED_FIXTURES, load_fixture

# the fixtures every recipe runs through this harness; ShellElastic's tiers have their own
# tests (test_shell_elastic.py)
FIXTURES = {name: module for name, module in SEED_FIXTURES.items() if module != "shell_elastic"}

LOGIT_ATOL = 1e-4
GRAD_ATOL, GRAD_RTOL = 1e-4, 1e-3


def recipe(fixture: str):
    return importlib.import_module(f"laminae.recipes.{FIXTURES[fixture]}")


def load(fixture: str):
    """``(recipe module, config, weights, inputs, expected)``; tensors are fresh copies."""
    seed_config, weights, inputs, expected = load_fixture(fixture)
    mod = recipe(fixture)
    return mod, mod.CONFIG.from_seed_config(seed_config), weights, inputs, expected


def build_loaded(fixture: str, backend: str = "reference"):
    mod, config, weights, inputs, expected = load(fixture)
    model = mod.build(config, backend=backend)
    mod.load_reference_state_dict(model, weights)
    model.eval()
    return mod, model, inputs, expected


def gradient_errors(mod, model, expected) -> dict[str, float]:
    """Per seed parameter: max(|g − g_seed| − rtol·|g_seed|) (≤ atol passes)."""
    names = [k[len("grad."):] for k in expected if k.startswith("grad.")]
    errors = {}
    for name, (param, row) in mod.reference_parameters(model, names).items():
        want = expected["grad." + name]
        got = param.grad if row is None else param.grad[row]
        if got is None:
            errors[name] = float("inf")
            continue
        errors[name] = ((got - want).abs() - GRAD_RTOL * want.abs()).max().item()
    return errors


def tier_gradient_errors(mod, model, expected, tier: str) -> dict[str, float]:
    """:func:`gradient_errors` for a tiered fixture (``grad.<tier>.<name>``)."""
    prefix = f"grad.{tier}."
    tiered = {"grad." + k[len(prefix):]: v for k, v in expected.items() if k.startswith(prefix)}
    return gradient_errors(mod, model, tiered)


def decode_in_steps(model, ids: torch.Tensor, prefill: int, attention_mask: torch.Tensor | None = None,
                    **kwargs) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens followed by one-token cached steps."""
    with torch.no_grad():
        return prefill_then_decode(model, ids, cache=model.empty_cache(ids.shape[0]), prefill=prefill,
                                   attention_mask=attention_mask, field="logits", **kwargs)[0]


def relative_gradient_errors(mod, model, expected, prefix: str = "grad.") -> dict[str, float]:
    """Per seed parameter ‖g − g_seed‖ / ‖g_seed‖: catches a gradient that is off by a
    small factor even where the gradients are too small for the absolute tolerance."""
    names = [k[len(prefix):] for k in expected if k.startswith(prefix)]
    out = {}
    for name, (param, row) in mod.reference_parameters(model, names).items():
        got = param.grad if row is None else param.grad[row]
        want = expected[prefix + name]
        out[name] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return out
