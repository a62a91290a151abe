"""The specification checks: one module per check in this package (spec/check.py says what a check declares).

`registry()` imports every module here and returns the checks in the order their failures are read within a step
(each check's `rank`: the state the step started from, its data, forward, gradient, update, the system). Nothing
else lists them: a new check is one module dropped here (docs/hacking.md).
"""
from __future__ import annotations

import importlib
import pkgutil

from spec.check import CHECKS, Check


def registry() -> dict[str, type[Check]]:
    """name -> check class, for every module of this package, in rank order."""
    for m in pkgutil.iter_modules(__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")  # defining the class registers it
    return dict(sorted(CHECKS.items(), key=lambda kv: (kv[1].rank, kv[0])))
