"""Mapping a seed implementation's state-dict keys onto a recipe's parameters.

A :class:`KeyMap` is data: regex renames (seed → ours, applied in order to each seed
key), legacy renames applied first, and *stack* rules for per-expert tensors that
a recipe holds stacked (``…experts.3.gate_proj.weight`` → row 3 of ``…experts.gate_proj``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from laminae.primitives import ConfigError, ShapeError


@dataclass
class KeyMap:
    renames: list[tuple[str, str]] = field(default_factory=list)
    legacy: list[tuple[str, str]] = field(default_factory=list)
    stacks: list[tuple[str, str]] = field(default_factory=list)   # (regex with (?P<idx>), template)
    tied: dict[str, str] = field(default_factory=dict)            # our alias → our source key

    def target(self, seed_key: str) -> tuple[str, int | None]:
        """``(our key, row or None)`` for one seed key."""
        key = seed_key
        for pattern, repl in self.legacy:
            key = re.sub(pattern, repl, key)
        for pattern, template in self.stacks:
            m = re.match(pattern, key)
            if m:
                return template.format(**m.groupdict()), int(m.group("idx"))
        for pattern, repl in self.renames:
            key = re.sub(pattern, repl, key)
        return key, None


def load_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], keymap: KeyMap) -> None:
    """Copy every seed tensor into the model (strict: a seed key without a home, or a
    model tensor no seed key fills, raises ConfigError naming them)."""
    own = model.state_dict(keep_vars=True)
    filled: dict[str, set] = {}
    unknown = []
    for seed_key, tensor in state_dict.items():
        key, row = keymap.target(seed_key)
        if key in keymap.tied:
            continue   # a tied alias: its source carries the tensor
        if key not in own:
            unknown.append(seed_key)
            continue
        dest = own[key] if row is None else own[key][row]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ShapeError(f"seed tensor {seed_key!r} has shape {tuple(tensor.shape)}, "
                             f"model tensor {key!r} expects {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor.to(dest.dtype))
        filled.setdefault(key, set()).add(row)
    missing = []
    for key, t in own.items():
        if key in keymap.tied:
            continue
        rows = filled.get(key)
        if rows is None or (None not in rows and len(rows) != t.shape[0]):
            missing.append(key)
    if unknown or missing:
        raise ConfigError(f"state dict does not match the model: unexpected seed keys {unknown}, "
                          f"model tensors left unfilled {missing}")


def reference_tensors(model: nn.Module, seed_keys, keymap: KeyMap) -> dict[str, tuple[torch.Tensor, int | None]]:
    """``seed key → (our parameter or buffer, row or None)``: read gradients or values
    under the seed's names."""
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    out = {}
    for seed_key in seed_keys:
        key, row = keymap.target(seed_key)
        key = keymap.tied.get(key, key)
        if key not in own:
            raise ConfigError(f"seed key {seed_key!r} maps to {key!r}, which the model does not have")
        out[seed_key] = (own[key], row)
    return out
