"""The command line at the door, as plain strings (no torch, no Hydra: the doctor reads it too).

    normalise(argv)                     # resume=X → resume.path=X, before Hydra composes it
    without(argv, ("resume", "hydra.run.dir"))   # the overrides a follow-up command replaces
"""
from __future__ import annotations


def normalise(argv: list[str]) -> list[str]:
    """`resume=X` is shorthand for `resume.path=X`: rewritten at the door, so the declared-change keys
    (`resume=latest resume.allow_data_change=true`) compose beside it in either order."""
    return [f"resume.path={a.split('=', 1)[1]}" if a.startswith("resume=") else a for a in argv]


def without(argv: list[str], keys) -> list[str]:
    """argv less the overrides of these keys and of any key under them (`+`/`~` prefixes included)."""
    def drop(a: str) -> bool:
        k = a.split("=", 1)[0].lstrip("+~")
        return any(k == key or k.startswith(key + ".") for key in keys)
    return [a for a in argv if not drop(a)]
