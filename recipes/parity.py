"""Seed parity of every recipe on its fixtures (``tests/data/seed_parity``, shipped in
the wheel as ``laminae/recipes/seed_parity``): one line per fixture and backend with the
largest differences from what the seed computed.

    python -m laminae.triton_ops.tour --recipes          # every fixture, both backends
    laminae-tour --recipes naylis spikewhale_off         # some fixtures

Figures: logits and loss (every tier for tiered fixtures), gradients (max abs
difference, and the tolerance margin max(|g − g_seed| − 1e-3·|g_seed|) that must stay
≤ 1e-4), and cached decoding (prefill 3 + one-token steps) against the full forward.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

_PACKAGED = Path(__file__).resolve().parent / "seed_parity"   # an installed wheel
DATA = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[1] / "tests" / "data" / "seed_parity"
FIXTURES = {"naylis": "naylis", "spikewhale_off": "spikewhale", "spikewhale_on": "spikewhale",
            "elastic_fully": "shell_elastic", "elastic_matformer": "shell_elastic",
            "shram_tiny": "shram", "shram_tiny_yarn": "shram"}
LOGIT_ATOL, GRAD_ATOL, GRAD_RTOL = 1e-4, 1e-4, 1e-3


def _load(fixture: str, backend: str):
    from safetensors.torch import load_file

    folder = DATA / fixture
    mod = importlib.import_module(f"laminae.recipes.{FIXTURES[fixture]}")
    config = mod.CONFIG.from_seed_config(json.loads((folder / "config.json").read_text()))
    weights, inputs, expected = (load_file(str(folder / f"{n}.safetensors")) for n in ("weights", "inputs", "expected"))
    model = mod.build(config, backend=backend)
    mod.load_reference_state_dict(model, weights)
    return mod, model.eval(), inputs, expected


def _grad_errors(mod, model, grads: dict) -> tuple[float, float]:
    worst_abs = worst_margin = 0.0
    for name, (param, row) in mod.reference_parameters(model, list(grads)).items():
        got = param.grad if row is None else param.grad[row]
        want = grads[name]
        if got is None:
            return float("inf"), float("inf")
        worst_abs = max(worst_abs, (got - want).abs().max().item())
        worst_margin = max(worst_margin, ((got - want).abs() - GRAD_RTOL * want.abs()).max().item())
    return worst_abs, worst_margin


def check(fixture: str, backend: str = "reference") -> dict:
    """``{logits, loss, grad, grad_margin, decode, ok}`` for one fixture and backend."""
    mod, model, inputs, expected = _load(fixture, backend)
    ids, labels = inputs["input_ids"], inputs["labels"]
    tiers = [k[len("logits."):] for k in expected if k.startswith("logits.")] or [None]
    res = dict(logits=0.0, loss=0.0, grad=0.0, grad_margin=-1.0)
    for tier in tiers:
        model.zero_grad(set_to_none=True)
        kw, suffix = ({"tier": tier}, f".{tier}") if tier else ({}, "")
        value, out = mod.loss(model, ids, labels, **kw)
        res["logits"] = max(res["logits"], (out.logits - expected["logits" + suffix]).abs().max().item())
        res["loss"] = max(res["loss"], abs(value.item() - expected["loss" + suffix].item()))
        prefix = f"grad{suffix}."
        grads = {k[len(prefix):]: v for k, v in expected.items() if k.startswith(prefix)}
        if tier is not None and not any(k.startswith(prefix) for k in expected):
            continue
        value.backward()
        g_abs, g_margin = _grad_errors(mod, model, grads)
        res["grad"], res["grad_margin"] = max(res["grad"], g_abs), max(res["grad_margin"], g_margin)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :3], cache=model.empty_cache(ids.shape[0]))
        steps, cache = [out.logits], out.cache
        for t in range(3, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache)
            steps.append(out.logits)
            cache = out.cache
    res["decode"] = (torch.cat(steps, 1) - full).abs().max().item()
    res["ok"] = (res["logits"] <= LOGIT_ATOL and res["loss"] <= LOGIT_ATOL and res["grad_margin"] <= GRAD_ATOL
                 and res["decode"] <= 1e-5)
    return res


def report(backends=("reference", "triton"), fixtures=None) -> int:
    """Print one parity line per fixture and backend; 1 if any is out of tolerance."""
    header = ("fixture", "recipe", "backend", "logits", "loss", "grad", "grad margin", "decode", "status")
    rows, failed = [], False
    for fixture in fixtures or FIXTURES:
        for backend in backends:
            r = check(fixture, backend)
            failed |= not r["ok"]
            rows.append((fixture, FIXTURES[fixture], backend, f"{r['logits']:.1e}", f"{r['loss']:.1e}",
                         f"{r['grad']:.1e}", f"{r['grad_margin']:.1e}", f"{r['decode']:.1e}",
                         "ok" if r["ok"] else "FAIL"))
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(fmt.format(*row))
    print(f"\nlogits/loss atol {LOGIT_ATOL}; gradients {GRAD_ATOL} + {GRAD_RTOL}·|g_seed| (margin ≤ {GRAD_ATOL}); "
          "decode: cached steps vs full forward ≤ 1e-5")
    return 1 if failed else 0
