"""Pieces shared by the attention references."""
from __future__ import annotations

import torch


def visible_keys(S: int, N: int, key_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[B or 1, 1, S, N]`` bool: query i (absolute position N − S + i) sees key j when
    j ≤ N − S + i (causal, with S ≤ N cached-or-current keys) and ``key_mask[b, j]``."""
    rows = torch.arange(S, device=device)[:, None] + (N - S)
    visible = (torch.arange(N, device=device)[None, :] <= rows)[None, None]
    if key_mask is not None:
        visible = visible & key_mask.to(device).bool()[:, None, None, :]
    return visible
