"""Training checkpoints as one safetensors file: the model's full state dict, AdamW's
state and the step (+ JSON metadata such as the loss history). Works the same for a
plain module, DDP and FSDP2 (the full state dict is gathered on rank 0).

Loading is strict: a checkpoint whose tensors do not match the model's names and
shapes one for one (another recipe or configuration wrote it) raises ConfigError
listing the missing, unexpected and shape-mismatched keys, before anything is loaded."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from laminae.primitives import ConfigError

_SHOWN = 12  # keys listed per kind in a mismatch message


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


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", … and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def check_same_model(path: Path, saved: dict[str, tuple], model: torch.nn.Module, meta: dict,
                     expected_meta: dict | None = None) -> None:
    """ConfigError unless ``saved`` (key → shape) matches ``model``'s state dict exactly.
    ``expected_meta`` (e.g. ``{"recipe": ..., "config": {...}}``) is compared with the
    checkpoint's own metadata to say which settings differ."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    # FSDP2 parameters are DTensors whose .shape is the full (unsharded) shape
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(set(want) - set(saved))
    unexpected = sorted(set(saved) - set(want))
    shapes = [f"{k} {list(saved[k])} in the checkpoint vs {list(want[k])} here"
              for k in sorted(set(want) & set(saved)) if tuple(saved[k]) != want[k]]
    if not (missing or unexpected or shapes):
        return
    parts = [f"checkpoint {path} was written by another model, so it cannot be resumed here:"]
    if missing:
        parts.append(f"  missing from the checkpoint ({len(missing)}): {_listed(missing)}")
    if unexpected:
        parts.append(f"  unexpected (not in this model) ({len(unexpected)}): {_listed(unexpected)}")
    if shapes:
        parts.append(f"  shape mismatch ({len(shapes)}): {_listed(shapes)}")
    expected_meta = expected_meta or {}
    then = {k: json.loads(meta[k]) for k in expected_meta if k in meta}
    # a different recipe or preset says it all; the field-by-field diff only within one
    labels = [f"  {k}: {then[k]!r} there, {v!r} here" for k, v in expected_meta.items()
              if k in then and not isinstance(v, dict) and then[k] != v]
    parts += labels
    for key, now in expected_meta.items():
        if not labels and isinstance(now, dict) and isinstance(then.get(key), dict):
            diff = [f"{k}={then[key].get(k)!r} there, {now.get(k)!r} here"
                    for k in sorted(set(now) | set(then[key])) if then[key].get(k) != now.get(k)]
            if diff:
                parts.append(f"  {key} differs: {_listed(diff)}")
    parts.append("Resume with the settings that wrote it, or train into another --out.")
    raise ConfigError("\n".join(parts))


def load_checkpoint(path: Path, model, optimizer, expected_meta: dict | None = None) -> tuple[int, list]:
    """Load ``path`` into ``model`` and ``optimizer`` (strict, see the module docstring);
    returns ``(step, history)``."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, state = {}, {}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        saved = {key[len("model/"):]: tuple(f.get_slice(key).get_shape()) for key in f.keys()
                 if key.startswith("model/")}
        check_same_model(path, saved, model, meta, expected_meta)
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
                   options=StateDictOptions(full_state_dict=True, strict=True))
    return int(meta["step"]), json.loads(meta.get("history", "[]"))
