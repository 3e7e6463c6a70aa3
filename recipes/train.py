"""Train a recipe at a tiny size on byte-level text.

    python -m laminae.recipes.train --recipe naylis --steps 200
    python -m laminae.recipes.train --recipe shell_elastic --tiers low,max   # multi-tier steps
    torchrun --nproc_per_node 2 -m laminae.recipes.train --recipe spikewhale    # DDP, gloo on CPU
    torchrun --nproc_per_node 2 -m laminae.recipes.train --recipe naylis --fsdp  # FSDP2

Text: every ``*.md`` under ``--data`` (default: this project's docs), read as bytes
(vocabulary 256). Each step draws ``--batch-size`` windows (the *global* batch, the
same on every rank for a given seed and step); rank r trains on rows r, r+W, … and
the reported loss is the mean over ranks, so W ranks reproduce one process.

Prints ``step``, ``loss`` and ``tokens/s``; writes ``<out>/checkpoint.safetensors``
(model, AdamW state, step) every ``--save-every`` steps and at the end, and
``<out>/loss.png``. ``--resume`` continues from the checkpoint in ``<out>``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ._checkpoint import load_checkpoint, save_checkpoint

# Tiny sizes (config fields) per recipe: a few seconds per dozen steps on 2 CPU cores.
TINY = {
    "naylis": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=256, mem_size=32, mom_block_size=4,
                   mom_top_blocks=2, mom_router_rank=16),
    "spikewhale": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, nope_head_dim=8, qk_rope_head_dim=8,
                       q_lora_rank=32, o_lora_rank=32, max_position_embeddings=256, moe_intermediate_size=64,
                       use_moe=True, moe_layers=[1], n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1, num_nextn_predict_layers=1, zloss_coef=1e-4),
    "shell_elastic": dict(vocab_size=256, num_hidden_layers=2, hidden_size=64, head_dim=16, base_width=16,
                          mlp_base_width=32, widths=(1, 2, 4), tiers=("low", "medium", "max"),
                          mlp_output_divisor=2.0, max_position_embeddings=256),
    "shram": dict(vocab_size=256, embedding_width=64, mlp_width=128, num_decoder_layers=2,
                  num_sliding_window_heads=2, num_mosrah_heads=4, num_selected_heads=2, head_dim=16,
                  window_size=16, training_sequence_length=256),
    "neollm": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, hidden_act="silu", generator_d_seed=16, generator_num_modes=2,
                   generator_num_knots=8, generator_krank=8, attention_dropout=0.0, dropout_rate=0.0,
                   use_stack_memory=True, use_lucid_attention=True, use_momentum_attention=False,
                   use_learnable_multipliers=False, use_jtok=False, use_hadamard_o_proj=False, use_repo=False,
                   use_repo_grape=False, use_tweo=False, use_nitp=False),
}
DEFAULT_DATA = Path(__file__).resolve().parents[1] / "docs"


def byte_corpus(root: Path) -> torch.Tensor:
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
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = json.loads(value)
    return out


def plot(history: list, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve written")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h[0] for h in history], [h[1] for h in history])
    ax.set(xlabel="step", ylabel="loss", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[tuple[int, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="naylis", choices=sorted(TINY))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (windows per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=Path("runs/train"))
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP under torchrun")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="override a config field")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tiers", default=None, metavar="T1,T2",
                   help="elastic recipes: train these tiers each step (losses summed; default the widest)")
    p.add_argument("--noise-cutoff", type=float, default=0.15, help="fraction of steps with router noise")
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")

    recipe = importlib.import_module(f"laminae.recipes.{args.recipe}")
    config = dataclasses.replace(recipe.CONFIG(), **TINY[args.recipe], **parse_overrides(args.set))
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
    start, history = 0, []
    if args.resume and ckpt.exists():
        start, history = load_checkpoint(ckpt, model, optimizer)
        if rank == 0:
            print(f"resumed from {ckpt} at step {start}")
    corpus = byte_corpus(args.data)

    for step in range(start, args.steps):
        t0 = time.perf_counter()
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
        if rank == 0 and ((step + 1) % args.log_every == 0 or step == start):
            rate = args.batch_size * args.seq_len / (time.perf_counter() - t0)
            print(f"step {step + 1:5d}  loss {history[-1][1]:.4f}  tokens/s {rate:,.0f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(ckpt, model, optimizer, step + 1, {"history": history})
    save_checkpoint(ckpt, model, optimizer, args.steps, {"history": history})
    if rank == 0:
        plot(history, args.out / "loss.png", f"{args.recipe} (tiny), {world} rank(s)")
        print(f"checkpoint: {ckpt}\nloss curve: {args.out / 'loss.png'}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return history


class _Forward:
    """The recipe's loss calls ``model(...)`` and reads ``model.config``/``.training``/
    ``.modules()``: route the call through the DDP/FSDP wrapper, the rest to the LM."""

    def __init__(self, wrapped, lm) -> None:
        self._wrapped, self._lm = wrapped, lm

    def __call__(self, *args, **kwargs):
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._lm, name)


if __name__ == "__main__":
    main()
