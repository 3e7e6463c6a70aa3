"""The seed-parity fixtures (``tests/data/seed_parity``, copied from
shared/fixtures/seed_parity): which recipe each folder belongs to, and the one loader."""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "seed_parity"

# fixture folder → recipe module (laminae.recipes.<name>); every folder under DATA, once
SEED_FIXTURES = {
    "naylis": "naylis",
    "spikewhale_off": "spikewhale",
    "spikewhale_on": "spikewhale",
    "shram_tiny": "shram",
    "shram_tiny_yarn": "shram",
    "elastic_fully": "shell_elastic",
    "elastic_matformer": "shell_elastic",
}


@lru_cache(maxsize=None)
def _read(name: str):
    from safetensors.torch import load_file

    folder = DATA / name
    return (json.loads((folder / "config.json").read_text()),
            *(load_file(str(folder / f"{part}.safetensors")) for part in ("weights", "inputs", "expected")))


def load_fixture(name: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(seed config, weights, inputs, expected)`` of one fixture folder, read once per
    session; every call returns fresh copies, so a test may change what it gets."""
    config, *tensors = _read(name)
    return (copy.deepcopy(config), *({k: v.clone() for k, v in d.items()} for d in tensors))
