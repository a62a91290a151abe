"""One-line ValueErrors that name the config key and the bad value (e.g. `data.seq_len=0`)."""
from __future__ import annotations

import math
from typing import Any, Mapping

_MISSING = object()


def get_int(cfg: Mapping, key: str, where: str, default: Any = _MISSING, lo: int | None = None,
            hi: int | None = None) -> int:
    v = _get(cfg, key, where, default)
    integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    if isinstance(v, bool) or not integral:
        raise ValueError(f"{where}.{key}={v!r}: expected an integer")
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(f"{where}.{key}={v}: must be >= {lo}")
    if hi is not None and v > hi:
        raise ValueError(f"{where}.{key}={v}: must be <= {hi}")
    return v


def get_float(cfg: Mapping, key: str, where: str, default: Any = _MISSING, lo: float | None = None,
              positive: bool = False) -> float:
    v = _get(cfg, key, where, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}.{key}={v!r}: expected a finite number")
    if positive and v <= 0:
        raise ValueError(f"{where}.{key}={v}: must be > 0")
    if lo is not None and v < lo:
        raise ValueError(f"{where}.{key}={v}: must be >= {lo}")
    return float(v)


def get_choice(cfg: Mapping, key: str, where: str, choices, default: Any = _MISSING):
    v = _get(cfg, key, where, default)
    if v not in choices:
        raise ValueError(f"{where}.{key}={v}: expected one of {', '.join(map(str, choices))}")
    return v


def check_keys(cfg: Mapping, allowed, where: str) -> None:
    for key in cfg:
        if key not in allowed:
            raise ValueError(f"{where}.{key}: unknown key (expected some of {', '.join(sorted(allowed))})")


def _get(cfg: Mapping, key: str, where: str, default: Any):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is _MISSING:
        raise ValueError(f"{where}.{key}: missing")
    return default
