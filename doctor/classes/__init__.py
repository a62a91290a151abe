"""The doctor's fault classes, each declared once with its meaning, its one single-variable fix (docs/course.md
§5: never "lower the LR until it stops") and its row of the course's symptom table where it has one
(docs/course.md §10: symptom, what to check first, what it is easily mistaken for).

    declare_class("numerics.probe_growth", "my probe grew", fix=my_fix)   # a class and its fix, in one place
    fix_for(diag, run, ckpt) -> {"variable", "change", "override", "expect"}

A Signal (stability/signals.py) names the class it implies when it moves first; a specification check (spec/)
names the class its way of failing implies; a drill (stability/drills/) names the class it must produce; the
doctor's declared rules (doctor/classify.py RULES) name the classes its context decides. tests/test_signals.py checks that
every one of those names is declared. The classes of this package are declared by area, one module each.

A fix's `override` is the config overrides (space-separated) that make the change on a rerun, or None when the
fix is not a config change; `python -m doctor RUN --verify` runs it from the state before the incident
(doctor/verify.py), and the regression command repeats the run's own command line with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from doctor.diagnosis import Diagnosis
    from doctor.timeline import Run

Fix = Callable[..., dict]  # fix(diag, run, ckpt, t, batch, guard_action, ckpt_text) -> the four keys


@dataclass(frozen=True)
class FaultClass:
    name: str
    means: str
    fix: Fix
    symptom: tuple[str, str, str] | None = None  # (symptom, check first, easily mistaken for)
    dynamics: bool = False  # the run's own dynamics can produce it: judged by what the run did after it
    #                         (doctor/judge.py); every other class names a broken invariant, a changed setting or
    #                         data, a fault whatever happens after it


CLASSES: dict[str, FaultClass] = {}


def declare_class(name: str, means: str, fix: Fix, symptom: tuple[str, str, str] | None = None,
                  dynamics: bool = False) -> FaultClass:
    if name in CLASSES:
        raise ValueError(f"fault class {name!r} declared twice")
    if not callable(fix):
        raise TypeError(f"fault class {name!r}: its fix must be a function (diag, run, ckpt, t, batch, action, ck)")
    c = CLASSES[name] = FaultClass(name, means, fix, symptom, dynamics)
    return c


def symptom(name: str) -> tuple[str, str, str] | None:
    c = CLASSES.get(name)
    return c.symptom if c else None


def fix_for(diag: "Diagnosis", run: "Run", ckpt) -> dict:
    """The one single-variable change that tests the diagnosis (its class's declared fix)."""
    t, b, action = diag.step, diag.batch, (run.config.get("guard") or {}).get("action")
    ck = str(ckpt[1]) if ckpt else "<a checkpoint before the incident>"
    return CLASSES[diag.fault_class].fix(diag, run, ckpt, t, b, action, ck)


def batch_ids(b: dict) -> str:
    return f"samples [{b['first']}, {b['first'] + b['size']})"


def hint(diag: "Diagnosis", run: "Run", ckpt, t, b, action, ck) -> dict:
    """The fix its first quantity's Signal hints at (stability/signals.py `fix`): a class with nothing more to
    say than where to look."""
    from stability.signals import family
    sig = family(diag.anomaly.quantity) if diag.anomaly else None
    return {"variable": sig.fix if sig else "the quantity that deviated first",
            "change": f"change only that and rerun from {ck}", "override": None,
            "expect": "the earliest anomaly gone, nothing else moved"}


def no_fix(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "nothing", "change": "nothing to change", "override": None, "expect": "—"}


def spec_fix(diag, run, ckpt, t, b, action, ck) -> dict:
    """A failed specification check: the code that broke it is the fix, not a setting (its check names where)."""
    ev = (diag.judgement.evidence if diag.judgement else {}) or {}
    check, where = ev.get("check", "the check"), diag.model_layer or "the named place"
    return {"variable": f"the code behind {where} (check {check} failed at step {t})",
            "change": f"{diag.summary.split('. ', 1)[-1] if '. ' in diag.summary else diag.summary} Find what computes "
                      f"{where} other than its specification (a hook, a patched function, a kernel, a cast) and "
                      f"remove it; rerun from {ck}",
            "override": None, "expect": f"check {check} within its tolerance at step {t} and after"}


# the declarations, by area (each module calls declare_class beside its fixes)
from doctor.classes import data, numerics, optim, state, system, recipe  # noqa: E402,F401
