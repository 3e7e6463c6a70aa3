"""The training script: loss falls, resuming continues exactly, and two gloo ranks
(DDP, and FSDP2) reproduce one process on the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laminae.recipes.train import TINY, main

SMALL = ["--batch-size", "4", "--seq-len", "32", "--log-every", "1000"]
# no Gumbel noise and no aux loss, so the objective is a per-token mean that sharding preserves
DETERMINISTIC = {"naylis": ["--set", "mom_noise_scale=0", "--set", "mom_aux_weight=0"],
                 "spikewhale": ["--set", "moe_aux_loss_coef=0"],
                 "shell_elastic": ["--tiers", "low,max"],   # multi-tier steps
                 "shram": ["--set", "load_balance_weight=0"],   # LB is a statistic of the whole batch
                 # MiLe normalises its weights by the mean over a rank's tokens
                 "neollm": ["--set", "use_mile_loss=false"]}


@pytest.mark.parametrize("recipe", sorted(TINY))
def test_loss_falls(recipe, tmp_path):
    history = main(["--recipe", recipe, "--steps", "24", "--out", str(tmp_path), *SMALL])
    first, last = sum(h[1] for h in history[:5]) / 5, sum(h[1] for h in history[-5:]) / 5
    assert last < first - 0.5, f"{recipe}: loss went from {first:.3f} to {last:.3f}"
    assert (tmp_path / "checkpoint.safetensors").exists() and (tmp_path / "loss.png").exists()


def test_resume_continues_exactly(tmp_path):
    args = ["--recipe", "naylis", *SMALL, *DETERMINISTIC["naylis"]]
    straight = main([*args, "--steps", "4", "--out", str(tmp_path / "a")])
    main([*args, "--steps", "2", "--out", str(tmp_path / "b")])
    resumed = main([*args, "--steps", "4", "--out", str(tmp_path / "b"), "--resume"])
    assert [round(v, 5) for _, v in resumed] == [round(v, 5) for _, v in straight]


@pytest.mark.parametrize("recipe,wrapper", [(name, "ddp") for name in sorted(TINY)] + [("naylis", "fsdp")])
def test_two_ranks_match_one_process(recipe, wrapper, tmp_path):
    args = ["--recipe", recipe, "--steps", "3", *SMALL, *DETERMINISTIC[recipe]]
    single = main([*args, "--out", str(tmp_path / "one")])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "laminae.recipes.train",
           *args, "--out", str(tmp_path / "two"), *(["--fsdp"] if wrapper == "fsdp" else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "two" / "checkpoint.safetensors"), "pt") as f:
        two = json.loads(f.metadata()["history"])
    assert len(two) == len(single)
    for (_, a), (_, b) in zip(single, two):
        assert abs(a - b) < 1e-4, f"one process {a}, two ranks {b}"
