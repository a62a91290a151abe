"""The parameter-group contract: which tensors decay, and at what learning rate.

Every trainable parameter gets a set of *kinds*, decided by the module that owns it, and the config's
rules (first match wins) send it to a named group. Parameters no rule matches go to group "default"
(weight_decay = optim.weight_decay, lr_scale = 1). Config (conf/optim/adamw.yaml):

    groups:
      - {name: no_decay, kinds: [bias, norm, embedding, router, expert_bias], weight_decay: 0.0}
      - {name: attn, names: ["*.attn.*"], lr_scale: 0.5}

A rule matches a parameter when any of its `kinds` is among the parameter's kinds OR its qualified
name matches any of its `names` patterns (fnmatch, case-sensitive).

NOTE: a rule that matches nothing is an error, not an empty group. Renaming `RMSNorm` to `RmsNorm`
or moving the router must not silently start decaying gains and routing logits — that is exactly
the bug this contract exists to catch.
"""

from fnmatch import fnmatchcase

import torch.nn as nn

from optim.config import DEFAULT_GROUP, OptimConfig
from run.config_errors import typed


def _module_kinds(module: nn.Module, module_name: str, param_name: str) -> set[str]:
    """Kinds of one parameter as seen from one owning module."""
    qual = f"{module_name}.{param_name}" if module_name else param_name
    cls = type(module).__name__
    kinds = set()
    if param_name == "bias":
        kinds.add("bias")
    # NOTE: class names ending in "Norm" too, so a hand-written model.RMSNorm is caught like nn.RMSNorm.
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or cls.endswith("Norm"):
        kinds.add("norm")
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        kinds.add("embedding")
    if ".router." in f".{qual}" or qual.endswith("router.weight"):
        kinds.add("router")
    if "expert_bias" in qual:
        kinds.add("expert_bias")
    return kinds


def param_kinds(model: nn.Module) -> dict[str, set[str]]:
    """Qualified name -> kinds, for every trainable parameter, each tensor once.

    A tied tensor (head weight = embedding weight) is one parameter with several owners; its kinds are
    the union over owners, so the tied head counts under `embedding` whichever module registered first.
    """
    kinds_by_id: dict[int, set[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, p in module.named_parameters(recurse=False):
            kinds_by_id.setdefault(id(p), set()).update(_module_kinds(module, module_name, param_name))
        if "Router" in type(module).__name__:  # the whole subtree: a Router's inner Linear routes too
            for p in module.parameters():
                kinds_by_id.setdefault(id(p), set()).add("router")
    # named_parameters() deduplicates tied tensors and keeps the first name: one entry per tensor.
    return {n: kinds_by_id[id(p)] for n, p in model.named_parameters() if p.requires_grad}


def _matches(rule: dict, pname: str, kinds: set[str]) -> bool:
    return bool(rule["kinds"] & kinds) or any(fnmatchcase(pname, pat) for pat in rule["names"])


def _rules(cfg: OptimConfig) -> list[dict]:
    base_wd = float(cfg.weight_decay)
    return [dict(name=rule.name or f"group{i}", kinds=set(rule.kinds), names=tuple(rule.names),
                 weight_decay=base_wd if rule.weight_decay is None else float(rule.weight_decay),
                 lr_scale=float(rule.lr_scale)) for i, rule in enumerate(cfg.groups)]


def group_of(model: nn.Module, cfg: OptimConfig) -> dict[str, str]:
    """Qualified name -> the group the config's rules send it to (the first that matches, else "default"), for every
    trainable parameter: the contract itself, which the optimizer's groups are built from and the specification
    check of the update reads (spec/checks/optimizer.py), not the groups an optimizer ended up holding."""
    rules = _rules(cfg)
    return {pname: next((r["name"] for r in rules if _matches(r, pname, kinds)), DEFAULT_GROUP)
            for pname, kinds in param_kinds(model).items()}


def build_param_groups(model: nn.Module, cfg: OptimConfig) -> tuple[list[dict], list[dict]]:
    """Torch param-group dicts and a summary table (one row per group) for `model` under `cfg`.

    Group dicts carry params, name, weight_decay, lr_scale and lr = cfg.lr · lr_scale. Parameters keep
    model.named_parameters() order inside each group, so optimizer state maps back deterministically.
    """
    cfg = typed(cfg, OptimConfig, "build_param_groups")  # keys, types, ranges, kinds, names: the schema checked them
    base_lr, base_wd = float(cfg.lr), float(cfg.weight_decay)
    rules = _rules(cfg)
    default = dict(name=DEFAULT_GROUP, weight_decay=base_wd, lr_scale=1.0)

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    members: dict[str, list[str]] = {r["name"]: [] for r in rules + [default]}
    for pname, group in group_of(model, cfg).items():
        members[group].append(pname)

    for i, r in enumerate(rules):
        if not members[r["name"]]:
            raise ValueError(f"optim.groups[{i}] ({r['name']}) matches no parameter")
    placed = [n for names in members.values() for n in names]
    assert len(placed) == len(set(placed)) == len(params), "every trainable parameter in exactly one group"

    groups, table = [], []
    for r in rules + [default]:
        names = members[r["name"]]
        if not names:  # only the default group may end up empty
            continue
        tensors = [params[n] for n in names]
        groups.append(dict(params=tensors, name=r["name"], weight_decay=r["weight_decay"],
                           lr_scale=r["lr_scale"], lr=base_lr * r["lr_scale"]))
        table.append(dict(group=r["name"], tensors=len(tensors), parameters=sum(p.numel() for p in tensors),
                          weight_decay=r["weight_decay"], lr_scale=r["lr_scale"]))
    return groups, table


def format_table(table: list[dict]) -> str:
    """Fixed-width text of the group table, with a total line, for printing at start."""
    head = f"{'group':<16} {'optimizer':<10} {'tensors':>8} {'parameters':>12} {'weight_decay':>13} {'lr_scale':>9}"
    lines = [head, "-" * len(head)]
    for row in table:
        lines.append(f"{row['group']:<16} {row.get('optimizer', 'adamw'):<10} {row['tensors']:>8d} "
                     f"{row['parameters']:>12,d} {row['weight_decay']:>13g} {row['lr_scale']:>9g}")
    lines.append(f"{'total':<16} {'':<10} {sum(r['tensors'] for r in table):>8d} "
                 f"{sum(r['parameters'] for r in table):>12,d}")
    return "\n".join(lines)
