"""Train a recipe at a tiny size on byte-level text.

    python -m laminae.recipes.train --recipe naylis --steps 200
    python -m laminae.recipes.train --recipe spikewhale --preset tiny-full  # every mechanism on
    python -m laminae.recipes.train --recipe shell_elastic --tiers low,max   # multi-tier steps
    torchrun --nproc_per_node 2 -m laminae.recipes.train --recipe spikewhale    # DDP, gloo on CPU
    torchrun --nproc_per_node 2 -m laminae.recipes.train --recipe naylis --fsdp  # FSDP2

Config: the recipe's defaults, then ``--preset`` (``PRESETS``; ``tiny`` for every
recipe, ``tiny-full`` for spikewhale), then every ``--set FIELD=JSON``.

Text: every ``*.md`` under ``--data`` (default: this project's docs, shipped with the
package), read as bytes (vocabulary 256). Each step draws ``--batch-size`` windows (the *global* batch, the
same on every rank for a given seed and step); rank r trains on rows r, r+W, … and
the reported loss is the mean over ranks, so W ranks reproduce one process.

Prints ``step``, ``loss`` and the mean tokens/s since the start; writes
``<out>/checkpoint.safetensors`` (model, AdamW state, step, the settings that wrote it)
every ``--save-every`` steps and at the end, and ``<out>/loss.png`` (with matplotlib).
``--resume`` continues from the checkpoint in ``<out>``: strictly (a checkpoint of
another recipe or configuration raises, listing the keys that differ), and not at all
when the checkpoint already reached ``--steps`` (nothing is written then).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from laminae.primitives import ConfigError
from laminae.primitives._backend import interpret_without_cuda

from ._checkpoint import load_checkpoint, save_checkpoint
from ._presets import PRESETS, TINY, make_config
from ._training import (DEFAULT_DATA, SET_EXAMPLES, Throughput, _Forward, byte_corpus,  # noqa: F401 (Throughput: re-exported)
                        global_batch, parse_overrides, plot)

__all__ = ["PRESETS", "TINY", "make_config", "main", "Throughput", "byte_corpus", "global_batch",
           "parse_overrides", "plot"]

# The project's docs as byte-level text: packaged with the wheel (laminae/recipes/corpus),
# read from the source tree in a checkout.
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m laminae.recipes.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipe", default="naylis", choices=sorted(PRESETS), help="which recipe to train")
    p.add_argument("--preset", default="tiny", choices=sorted({k for v in PRESETS.values() for k in v}),
                   help="config fields on top of the recipe's defaults: tiny (small sizes, the recipe's "
                        "default mechanisms) or, for spikewhale, tiny-full (every optional mechanism on)")
    p.add_argument("--steps", type=int, default=100, help="train up to this step (counted from 0, resumes too)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (windows per step, over all ranks)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per window")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the batches")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="a text file, or a folder whose *.md files are read (default: laminae's docs)")
    p.add_argument("--out", type=Path, default=Path("runs/train"), help="folder for the checkpoint and loss.png")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from <out>/checkpoint.safetensors (same recipe, preset and --set)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP under torchrun")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"],
                   help="kernels: auto = Triton on CUDA, the reference on CPU; triton on CPU runs the interpreter")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help=f"override a config field (any, preset fields included); the value is JSON: {SET_EXAMPLES}")
    p.add_argument("--log-every", type=int, default=10, help="print every N steps")
    p.add_argument("--tiers", default=None, metavar="T1,T2",
                   help="elastic recipes: train these tiers each step (losses summed; default the widest)")
    p.add_argument("--noise-cutoff", type=float, default=0.15, help="fraction of steps with router noise")
    return p


def main(argv: list[str] | None = None) -> list[tuple[int, float]]:
    p = _parser()
    args = p.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        p.error(str(e))
    # before anything imports triton: on CPU, --backend triton runs in the interpreter
    interpret_without_cuda()

    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % world:
        p.error(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
    recipe = importlib.import_module(f"laminae.recipes.{args.recipe}")
    try:
        config = make_config(recipe, args.recipe, args.preset, overrides)
    except ValueError as e:
        p.error(str(e))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        history = _train(args, recipe, config, world, rank)
        if world > 1:
            dist.barrier()
        return history
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(args, recipe, config, world: int, rank: int) -> list[tuple[int, float]]:
    torch.manual_seed(args.seed)
    model = recipe.build(config, backend=args.backend)
    model.train()
    lm = model
    if world > 1:
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr, weight_decay=0.0)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "checkpoint.safetensors"
    # what wrote a checkpoint, so a mismatched resume can say which settings differ
    meta = {"recipe": args.recipe, "preset": args.preset, "config": json.loads(json.dumps(
        dataclasses.asdict(config), default=str))}
    start, history = 0, []
    if args.resume and ckpt.exists():
        start, history = load_checkpoint(ckpt, model, optimizer, expected_meta=meta)
        if start >= args.steps:
            # saving now would record step --steps over weights and optimizer state from step `start`
            if rank == 0:
                print(f"{ckpt} is at step {start}, at or past --steps {args.steps}: nothing to train, "
                      f"nothing written (raise --steps above {start} to continue)")
            return history
        if rank == 0:
            print(f"resumed from {ckpt} at step {start}")
    elif args.resume and rank == 0:
        print(f"--resume: no checkpoint at {ckpt} yet, starting at step 0")
    corpus = byte_corpus(args.data)

    meter = Throughput()
    for step in range(start, args.steps):
        if step >= args.noise_cutoff * args.steps:
            # Naylis' trainer: the MoM router's Gumbel exploration stops at 15 % of the run
            for module in lm.modules():
                if hasattr(module, "noise_scale"):
                    module.noise_scale = 0.0
        rows = global_batch(corpus, step, args.batch_size, args.seq_len, args.seed)[rank::world]
        extra = {"tiers": args.tiers.split(",")} if args.tiers else {}
        value, _ = recipe.loss(model if world == 1 else _Forward(model, lm), rows, **extra)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        reported = value.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        history.append((step + 1, reported.item()))
        rate = meter.add(args.batch_size * args.seq_len)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step == start):
            print(f"step {step + 1:5d}  loss {history[-1][1]:.4f}  mean tokens/s {rate:,.0f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(ckpt, model, optimizer, step + 1, {**meta, "history": history})
    save_checkpoint(ckpt, model, optimizer, history[-1][0], {**meta, "history": history})
    if rank == 0:
        print(f"checkpoint: {ckpt}")
        png = args.out / "loss.png"
        title = f"{args.recipe} ({args.preset}), {world} rank(s)"
        print(f"loss curve: {png}" if plot(history, png, title) else
              "loss curve: not written (matplotlib is not installed: pip install 'laminae[bench]')")
    return history


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:    # a mismatched --resume: the message is the whole story
        raise SystemExit(f"error: {e}") from None
