"""One default per key: the default run (`python train.py --cfg job`, conf/config.yaml composed with no
override) is the schema's own defaults, leaf for leaf, so a reader finds each key's value in one place;
conf/ options set only what they change."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from run.config import Config, register

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def leaves(node, prefix: str = "") -> dict:
    """Every leaf by its dotted key; a list is one leaf (an option replaces it whole), so is a null node."""
    if isinstance(node, dict) and node:
        return {k: v for key, child in node.items() for k, v in leaves(child, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def differing_keys(run: dict, schema: dict) -> list[str]:
    a, b = leaves(run), leaves(schema)
    # a node null on one side and set on the other differs once, at the node, not at each of its leaves
    keys = {k for k in a.keys() | b.keys() if a.get(k, KeyError) != b.get(k, KeyError)}
    return sorted(k for k in keys if not any(k.startswith(f"{j}.") for j in keys))


def test_the_default_run_is_the_schema_defaults():
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        run = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=True)
    diff = differing_keys(run, schema)
    assert not diff, "keys whose default run value is not the schema's default: " + ", ".join(
        f"{k}={OmegaConf.select(OmegaConf.create(run), k)} (schema {OmegaConf.select(OmegaConf.create(schema), k)})"
        for k in diff)


def test_a_differing_key_is_counted_once():
    assert differing_keys({"m": {"moe": {"a": 1, "b": 2}}, "lr": 2}, {"m": {"moe": None}, "lr": 3}) == ["lr", "m.moe"]
    assert differing_keys({"x": {"y": 1}}, {"x": {"y": 1}}) == []
