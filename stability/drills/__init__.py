"""The fault drills: one module per drill in this package, each one class (stability/drills/base.py).

The registry is this package's modules: `registry()` imports every one and returns kind -> class.
Nothing else lists the kinds; `fault=<kind>` is the Hydra option conf/fault/<kind>.yaml (a test keeps
the two in step), stability/config.py builds the `fault` group's schema from the drills' Configs, and
stability/faults.py runs whichever drill the config names.
"""
from __future__ import annotations

import importlib
import pkgutil

from stability.drills.base import LIFETIMES, POINTS, REGISTRY, Context, Drill  # noqa: F401

NONE = "none"  # fault.kind=none: no drill; every other fault key is ignored (a drill's clean twin)


def registry() -> dict[str, type[Drill]]:
    """kind -> drill class, for every module of this package (sorted by kind)."""
    for m in pkgutil.iter_modules(__path__):
        if m.name != "base" and not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")  # defining the class registers it
    return dict(sorted(REGISTRY.items()))
