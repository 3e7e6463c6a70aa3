"""What the training command uses besides the loop: the byte corpus and its batches,
``--set`` overrides, the loss plot, the throughput meter, and the call router for
wrapped (DDP/FSDP) models. Kept apart so ``recipes/train.py`` is the loop and its CLI."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

_PACKAGED_DATA = Path(__file__).resolve().parent / "corpus"
DEFAULT_DATA = _PACKAGED_DATA if _PACKAGED_DATA.is_dir() else Path(__file__).resolve().parents[1] / "docs"
SET_EXAMPLES = "--set hidden_size=128, --set use_xsa=true, --set 'moe_layers=[0, 1]', --set 'hidden_act=\"silu\"'"


def byte_corpus(root: Path) -> torch.Tensor:
    if not root.exists():
        raise FileNotFoundError(f"--data {root}: no such file or folder")
    files = sorted(root.rglob("*.md")) if root.is_dir() else [root]
    data = b"\n".join(f.read_bytes() for f in files)
    if len(data) < 2:
        raise ValueError(f"no text found under {root}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def global_batch(corpus: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(corpus) - seq, (batch,), generator=gen)
    return torch.stack([corpus[s:s + seq] for s in starts.tolist()])


def parse_overrides(items: list[str]) -> dict:
    """``FIELD=JSON`` items as a dict; ValueError naming the item and showing examples."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=JSON, e.g. {SET_EXAMPLES}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--set {item!r}: the value must be JSON ({e.msg}); strings need double "
                             f"quotes, e.g. {SET_EXAMPLES}") from None
    return out


def plot(history: list, path: Path, title: str) -> bool:
    """Write the loss curve to ``path``; False (and nothing written) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h[0] for h in history], [h[1] for h in history])
    ax.set(xlabel="step", ylabel="loss", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


class Throughput:
    """Tokens per second since the run (or the resumed run) started: a running mean
    over every step so far, not the rate of the last step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock, self._tokens, self._start = clock, 0, clock()

    def add(self, tokens: int) -> float:
        self._tokens += tokens
        return self._tokens / max(self._clock() - self._start, 1e-9)


class _Forward:
    """The recipe's loss calls ``model(...)`` and reads ``model.config``/``.training``/
    ``.modules()``: route the call through the DDP/FSDP wrapper, the rest to the LM."""

    def __init__(self, wrapped, lm) -> None:
        self._wrapped, self._lm = wrapped, lm

    def __call__(self, *args, **kwargs):
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._lm, name)
