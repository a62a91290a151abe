"""Resume checks: refuse to continue a run that would not be the same run, and say what differs.

Each check raises ValueError with one line naming the difference, or returns log lines for a
difference the user declared (resume.allow_data_change, resume.allow_config_change).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

# Config keys that define the trajectory. Anything else (logging, eval cadence, threads, device,
# parallel layout, micro-batching, checkpoint cadence) may change on resume.
# NOTE: train.micro_batches is absent on purpose: the loss is normalised by the global token count,
# so splitting the same global batch differently is the same step (and world-size changes need it).
MUST_MATCH = ("seed", "model", "optim", "precision", "train.steps", "train.batch_size", "train.z_loss",
              "train.max_grad_norm")
_ABSENT = "<absent>"


def flatten(cfg, prefix: str = "") -> dict:
    """{"a.b.0.c": leaf} for nested mappings and lists."""
    if isinstance(cfg, Mapping):
        items = cfg.items()
    elif isinstance(cfg, (list, tuple)):
        items = enumerate(cfg)
    else:
        return {prefix: cfg}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out or {prefix: cfg}  # keep empty containers visible


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def check_config(saved: Mapping, current: Mapping, allowed: Sequence[str], name: str,
                 defaults: Mapping | None = None) -> list[str]:
    """defaults: the schema's (run/config.py Config): a key the checkpoint's code did not have yet ran as its
    default describes (a schema default is the default run's value), so a new key at its default is no change."""
    a, b, d = flatten(saved), flatten(current), flatten(defaults or {})
    notes = []
    for key in sorted(set(a) | set(b)):
        if not _under(key, MUST_MATCH):
            continue
        was, now = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if was == now or (was == _ABSENT and key in d and now == d[key]):
            continue
        diff = f"{key}={now} but checkpoint {name} has {key}={was}"
        if not _under(key, allowed):
            raise ValueError(f"resume: config mismatch: {diff} (list it in resume.allow_config_change to accept)")
        notes.append(f"resume: config changed (resume.allow_config_change): {diff}")
    return notes


def check_model(saved_shapes: Mapping[str, tuple], model_sd: Mapping, name: str) -> None:
    """Every model tensor present on both sides with the same global shape (DTensors: global)."""
    for key, t in model_sd.items():
        if key not in saved_shapes:
            raise ValueError(f"resume: model tensor {key} is not in checkpoint {name} (model code or config changed)")
        if tuple(saved_shapes[key]) != tuple(t.shape):
            raise ValueError(f"resume: model tensor {key} has shape {tuple(t.shape)} but checkpoint {name} "
                             f"has {tuple(saved_shapes[key])}")
    extra = sorted(set(saved_shapes) - set(model_sd))
    if extra:
        raise ValueError(f"resume: checkpoint {name} has model tensor {extra[0]}, which this model lacks")


def check_data(saved_fp: str, current_fp: str, allow: bool, name: str, saved_data: Mapping | None = None,
               current_data: Mapping | None = None) -> list[str]:
    """The fingerprint covers the data's content; the data.* keys of both configs say what changed in it."""
    if saved_fp == current_fp:
        return []
    a, b = flatten(saved_data or {}, "data"), flatten(current_data or {}, "data")
    changed = [f"{k} {a.get(k, _ABSENT)} -> {b.get(k, _ABSENT)}" for k in sorted(set(a) | set(b))
               if a.get(k, _ABSENT) != b.get(k, _ABSENT)]
    what = ", ".join(changed) if changed else "the same data.* keys: the files' content changed"
    diff = f"data fingerprint {current_fp[:12]} but checkpoint {name} was trained on {saved_fp[:12]} ({what})"
    if not allow:
        raise ValueError(f"resume: {diff}; set resume.allow_data_change=true to continue on the new data")
    return [f"resume: data changed (resume.allow_data_change=true): {diff}; the cursor continues at the same "
            f"sample count"]


def check_versions(saved: Mapping, current: Mapping) -> list[str]:
    return [f"resume: {lib} {saved.get(lib)} in checkpoint, {v} now" for lib, v in current.items()
            if saved.get(lib) != v]


def check_progress(step: int, last_step: int, name: str) -> None:
    if step >= last_step:
        raise ValueError(f"resume: checkpoint {name} is at step {step}, nothing left to run up to step {last_step} "
                         f"(raise train.steps and list it in resume.allow_config_change)")
