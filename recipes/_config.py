"""Reading a seed's configuration dictionary into a recipe's config dataclass."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from laminae.primitives import ConfigError


def config_from_seed(cls, seed: Mapping[str, Any], *, renames: Mapping[str, str] | None = None,
                     ignored: Mapping[str, str] | None = None, allowed: Mapping[str, tuple] | None = None):
    """Build ``cls`` from the seed's keys. ``renames`` maps seed keys to field names;
    ``ignored`` lists seed keys without numerical effect (key → why); ``allowed`` pins
    the values a field may take. Unknown keys and unsupported values raise ConfigError
    naming them."""
    renames, ignored, allowed = renames or {}, ignored or {}, allowed or {}
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in seed if k not in ignored and renames.get(k, k) not in fields]
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown seed configuration keys {unknown}")
    kwargs = {}
    for key, value in seed.items():
        if key in ignored:
            continue
        name = renames.get(key, key)
        if name in allowed and value not in allowed[name]:
            raise ConfigError(f"{cls.__name__}: seed key {key!r} = {value!r} is not supported "
                              f"(supported: {list(allowed[name])})")
        kwargs[name] = value
    return cls(**kwargs)
