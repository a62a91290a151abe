"""Config checks and their errors: the one-line `group.key=value: rule` ConfigError, the `check`/`choice`/
`fail` helpers the schemas call, building a config dataclass from a mapping, and turning OmegaConf's and
Hydra's own errors into that one line.

Every config group is a dataclass next to its component (model/config.py, optim/config.py, ...);
run/config.py composes them into the root registered with Hydra's ConfigStore. OmegaConf checks keys
and types against the dataclasses; the dataclasses' `__post_init__` checks ranges and cross-key
rules. This module only turns both into the project's one-line `group.key=value: rule` ValueError.

It imports no component, so every component may import it.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Mapping, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

T = TypeVar("T")
_CONVERT = re.compile(r"Value '(?P<value>.*)' of type '(?P<got>[^']*)' could not be converted to (?P<to>\w+)")
_BOOL = re.compile(r"Value '(?P<value>.*)' is not a valid bool \(type (?P<got>\w+)\)")
_TYPES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


class ConfigError(ValueError):
    """A config problem, one line naming `group.key=value` (train.py prints it and exits 2)."""


def fail(key: str, value: Any, rule: str, sep: str = ": ") -> None:
    raise ConfigError(f"{key}={_show(value)}{sep}{rule}")


def check(ok: bool, key: str, value: Any, rule: str, sep: str = ": ") -> None:
    """The one range/choice check of the schema: `key=value: rule` unless ok."""
    if not ok:
        fail(key, value, rule, sep)


def choice(key: str, value: Any, choices) -> None:
    check(value in choices, key, value, f"expected one of {', '.join(map(str, choices))}")


def from_mapping(cls: type[T], cfg: Any, where: str) -> T:
    """`cls` from a plain mapping, an OmegaConf node or a `cls` (returned as is), through OmegaConf's
    key and type checks and the dataclass's own checks; missing keys take the dataclass defaults."""
    if isinstance(cfg, cls):
        return cfg
    try:
        node = OmegaConf.merge(OmegaConf.structured(cls), cfg if cfg is not None else {})
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e, where)) from None


def typed(cfg: Any, cls: type[T], builder: str) -> T:
    """`cfg` if it is a `cls`: a builder takes its group's config dataclass only, so the typed schema
    (run/config.py `Config.from_dict`, or the dataclass itself) is the one way in and nothing re-parses a dict."""
    if not isinstance(cfg, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{builder} takes {article} {cls.__name__} ({cls.__module__}), got {type(cfg).__name__}: "
                        f"build it with {cls.__name__}(...), {cls.__name__}.from_dict(d) or Config.from_dict(d)")
    return cfg


def unused_keys(obj, used, where: str, what: str) -> None:
    """Refuse a key that `what` (e.g. `data.kind=text`) does not read but that was set away from its
    default: a silently ignored setting is a wrong belief about the run."""
    for f in dataclasses.fields(obj):
        if f.name in used:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(obj, f.name)
        if value != default:
            fail(f"{where}.{f.name}", value, f"not used by {what}")


def known_keys_only(node: DictConfig, prefix: str = "") -> None:
    """Refuse a key a structured node does not define. OmegaConf refuses it on merge, but Hydra's
    `+group.key=value` force-adds it, and OmegaConf.to_object then drops it without a word."""
    typ = OmegaConf.get_type(node)
    names = [f.name for f in dataclasses.fields(typ)] if dataclasses.is_dataclass(typ) else None
    for key in node.keys():
        path = f"{prefix}{key}"
        if names is not None and key not in names:
            raise ConfigError(f"{path}: unknown key{_hint(str(key), names, typ, prefix)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            known_keys_only(child, f"{path}.")
        elif isinstance(child, ListConfig) and not child._is_none() and not child._is_missing():
            for i in range(len(child)):
                item = child._get_node(i)
                if isinstance(item, DictConfig) and not item._is_none():
                    known_keys_only(item, f"{path}[{i}].")


def one_line(e: BaseException, where: str = "") -> str:
    """OmegaConf's (or Hydra's) multi-line message as `where.key: what (did you mean where.other?)`."""
    root = e
    while not isinstance(root, OmegaConfBaseException) and root.__cause__ is not None:
        root = root.__cause__  # Hydra wraps OmegaConf's error in a ConfigCompositionException
    if not isinstance(root, OmegaConfBaseException):
        return _hydra_line(root)
    full = str(getattr(root, "full_key", None) or getattr(root, "key", None) or "")
    key = f"{where}.{full}" if where and full else (where or full)
    first = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    if isinstance(root, (KeyError, AttributeError)) and " not in " in first:  # an unknown key
        parent = key.rpartition(".")[0]
        leaf, typ = full.rpartition(".")[2], getattr(root, "object_type", None)
        return f"{key}: unknown key{_hint(leaf, _known(root), typ, parent + '.' if parent else '')}"
    if isinstance(root, MissingMandatoryValue):
        return f"{key}: missing (set {key}=...)"
    value = getattr(root, "value", None) if hasattr(root, "value") else None
    m = _CONVERT.search(first)
    if m:  # "Value 'abc' of type 'str' could not be converted to Integer"
        return f"{key}={m['value']}: expected {_TYPES.get(m['to'], m['to'])} (got {m['got']})"
    m = _BOOL.search(first)
    if m:  # "Value 'maybe' is not a valid bool (type str)"
        return f"{key}={m['value']}: expected true or false (got {m['got']})"
    if "Invalid type" in first or "is not a subclass" in first or "Unsupported value type" in first:
        return f"{key}: wrong type ({first})"
    return f"{key}: {first}" if value is None else f"{key}={_show(value)}: {first}"


def _hint(key: str, known: list[str], typ: Any, prefix: str) -> str:
    """What an unknown `key` under `prefix` may have meant: a close name at this level, else the same name
    one level down (a drill's key is fault.<kind>.<key>: `fault.factor` means fault.lr_spike.factor or
    another drill's), else the names this level knows."""
    near = difflib.get_close_matches(key, known, n=1)
    if near:
        return f" (did you mean {prefix}{near[0]}?)"
    below = [f"{prefix}{f.name}.{key}" for f in dataclasses.fields(typ) if dataclasses.is_dataclass(f.type)
             and key in {g.name for g in dataclasses.fields(f.type)}] if dataclasses.is_dataclass(typ) else []
    if below:
        return f" (did you mean {' or '.join(below)}?)"
    return f" (known: {', '.join(sorted(known))})" if known else ""


def _hydra_line(e: BaseException) -> str:
    """Hydra's own errors: a group option that does not exist, an override it cannot parse."""
    text = str(e).strip()
    m = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if m:  # `fault=lr_spkie`: "Could not find 'fault/lr_spkie'" + "Available options in 'fault':" + tab lines
        group, name = m[1], m[2]
        options = [line.strip() for line in text.splitlines() if line.startswith("\t") and "=" not in line]
        near = difflib.get_close_matches(name, options, n=1)
        hint = f"did you mean {group}={near[0]}?" if near else f"options: {', '.join(options)}"
        return f"{group}={name}: no such option in conf/{group}/ ({hint})"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _known(err: OmegaConfBaseException) -> list[str]:
    typ = getattr(err, "object_type", None)
    if typ is not None and dataclasses.is_dataclass(typ):
        return [f.name for f in dataclasses.fields(typ)]
    parent = getattr(err, "parent_node", None)
    if isinstance(parent, DictConfig):
        return [str(k) for k in parent.keys()]
    return []


def _show(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value
