"""Training checkpoints as one safetensors file: the model's full state dict, AdamW's
state and the step (+ JSON metadata such as the loss history). Works the same for a
plain module, DDP and FSDP2 (the full state dict is gathered on rank 0)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def save_checkpoint(path: Path, model, optimizer, step: int, meta: dict) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tensors = {f"model/{k}": v.detach().clone().contiguous() for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for k, v in state.items():
            tensors[f"optim/{name}/{k}"] = torch.as_tensor(v).detach().clone().contiguous().reshape(-1) \
                if k == "step" else v.detach().clone().contiguous()
    save_file(tensors, str(path), metadata={"step": str(step), **{k: json.dumps(v) for k, v in meta.items()}})


def load_checkpoint(path: Path, model, optimizer) -> tuple[int, list]:
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, state = {}, {}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        for key in f.keys():
            kind, _, rest = key.partition("/")
            if kind == "model":
                model_sd[rest] = f.get_tensor(key)
            else:
                name, _, k = rest.rpartition("/")
                t = f.get_tensor(key)
                state.setdefault(name, {})[k] = t.reshape(()) if k == "step" else t
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(state)}
              for g in optimizer.state_dict()["param_groups"]][:1]
    set_state_dict(model, optimizer, model_state_dict=model_sd,
                   optim_state_dict={"state": state, "param_groups": groups},
                   options=StateDictOptions(full_state_dict=True, strict=False))
    return int(meta["step"]), json.loads(meta.get("history", "[]"))
