"""The training script: loss falls, resuming continues exactly, and two gloo ranks
(DDP, and FSDP2) reproduce one process on the same global batch."""
from __future__ import annotations

import json
import math
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


ONE_STEP = ["--recipe", "naylis", "--steps", "1", *SMALL]


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    from laminae.primitives import ConfigError

    main([*ONE_STEP, "--out", str(tmp_path)])
    written = (tmp_path / "checkpoint.safetensors").read_bytes()
    resume = ["--steps", "2", *SMALL, "--out", str(tmp_path), "--resume"]
    with pytest.raises(ConfigError, match=r"(?s)missing from the checkpoint \(\d+\): model\.layers\.2\..*"
                                          r"shape mismatch \(\d+\): lm_head\.weight \[256, 64\] in the checkpoint "
                                          r"vs \[256, 32\] here.*hidden_size=64 there, 32 here"):
        main(["--recipe", "naylis", *resume, "--set", "hidden_size=32", "--set", "num_hidden_layers=3"])
    with pytest.raises(ConfigError, match=r"(?s)unexpected \(not in this model\) \(\d+\): model\.M_blocks.*"
                                          r"recipe: 'naylis' there, 'shram' here"):
        main(["--recipe", "shram", *resume])
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == written


def test_resume_at_or_past_steps_writes_nothing(tmp_path, capsys):
    main([*ONE_STEP, "--steps", "3", "--out", str(tmp_path)])
    written = (tmp_path / "checkpoint.safetensors").read_bytes()
    history = main([*ONE_STEP, "--steps", "2", "--out", str(tmp_path), "--resume"])
    assert [s for s, _ in history] == [1, 2, 3]
    assert "at step 3, at or past --steps 2: nothing to train, nothing written" in capsys.readouterr().out
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == written


def test_set_overrides_preset_fields_and_explains_its_json(tmp_path, capsys):
    from safetensors import safe_open

    main([*ONE_STEP, "--out", str(tmp_path), "--set", "hidden_size=32", "--set", "num_hidden_layers=1"])
    with safe_open(str(tmp_path / "checkpoint.safetensors"), "pt") as f:
        assert f.get_slice("model/lm_head.weight").get_shape() == [256, 32]
        assert not any(k.startswith("model/model.layers.1.") for k in f.keys())
    example = "e.g. --set hidden_size=128, --set use_xsa=true, --set 'moe_layers=[0, 1]', --set 'hidden_act=\"silu\"'"
    for bad, said in [("hidden_act=silu", "--set 'hidden_act=silu': the value must be JSON"),
                      ("hidden_size", f"--set 'hidden_size': expected FIELD=JSON, {example}"),
                      ("hidden_sise=32", "NaylisConfig has no field hidden_sise (hidden_sise: did you mean hidden_size")]:
        with pytest.raises(SystemExit):
            main([*ONE_STEP, "--out", str(tmp_path), "--set", bad])
        err = " ".join(capsys.readouterr().err.split())
        assert said in err, err
        assert example in err or "no field" in said, err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: naylis)", "(default: tiny)", "(default: 100)", "(default: 0.003)", "(default: auto)"):
        assert default in out


def test_tokens_per_second_is_the_mean_since_the_start():
    from laminae.recipes.train import Throughput

    ticks = iter([10.0, 11.0, 14.0, 15.0])   # steps of 1 s, 3 s, 1 s
    meter = Throughput(clock=lambda: next(ticks))
    assert [meter.add(100) for _ in range(3)] == [100.0, 200 / 4, 300 / 5]


def test_loss_curve_is_announced_only_when_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib raises ImportError
    main([*ONE_STEP, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "loss curve: not written (matplotlib is not installed" in out
    assert not (tmp_path / "loss.png").exists()


def test_spikewhale_tiny_full_trains_every_listed_mechanism(tmp_path):
    from laminae.recipes.assembly.decoder import layer_plan
    from laminae.recipes import spikewhale
    from laminae.recipes.train import PRESETS, make_config

    config = make_config(spikewhale, "spikewhale", "tiny-full", {})
    model = spikewhale.build(config)
    kinds = {type(m).__name__ for m in model.modules()}
    # the README's list: MLA-style GQA, DERF/Elo/XSA, Engram, hyper-connections, MoE, memory cache, HRM,
    # looped stack, MTP
    for name in ("GroupedQueryAttention", "EloAttention", "DERFContextGate", "EngramModule", "EngramLayerFusion",
                 "HyperConnection", "SparseMoE", "MemoryCacheBranch", "HRMRefinementBlock", "MTPHead"):
        assert name in kinds, name
    assert config.use_xsa and config.q_lora_rank and config.o_lora_rank
    assert len(layer_plan(config.num_hidden_layers, config.loop_count, config.loop_mode)) > config.num_hidden_layers
    assert not any(TINY["spikewhale"].get(k) for k in ("use_engram", "use_elo", "use_hrm_refine"))
    assert set(PRESETS["spikewhale"]) == {"tiny", "tiny-full"}
    history = main(["--recipe", "spikewhale", "--preset", "tiny-full", "--steps", "3", *SMALL, "--out", str(tmp_path)])
    assert len(history) == 3 and all(math.isfinite(v) for _, v in history)
