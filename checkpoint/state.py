"""TrainState: everything that decides what the next step computes, as one DCP state dict.

    model      parameters and persistent buffers (the MoE balancing bias is training state)
    optim      AdamW moments and step counts, param groups — keyed by parameter name, not position
    scheduler  LambdaLR counter (the factor itself is recomputed from the config)
    loader     samples consumed + data fingerprint (the whole data cursor)
    progress   step, cumulative valid tokens
    rng        rank<r>: that rank's Python / NumPy / torch / CUDA streams
    guard      the stability guard's state: detector histories, counters, anticipatory routing
    extras     any other stateful piece the step owns (the fp16 loss scaler), by name
    meta       resolved config, library versions, world size

Model and optimizer tensors go through torch.distributed.checkpoint.state_dict, so the same code
saves a plain, DDP or FSDP2 model: FSDP2 hands over DTensor shards, DCP writes each rank's shard
and reshards on load to whatever world size the reader has.
"""
from __future__ import annotations

import copy
import pickle
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpoint import rng

BLOBS = ("progress", "scheduler", "loader", "guard", "extras", "meta")


def versions() -> dict:
    return {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "git": git_commit()}


def git_commit() -> str:
    """This checkout's commit (12 hex digits, "-dirty" with uncommitted changes to tracked files)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def _blob(obj) -> bytes:
    # NOTE: small Python state travels as one pickled blob per key: DCP would otherwise flatten
    # every list and dict into its own entry. Checkpoints are trusted files, as with torch.load.
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x)


def _schedule_from_config(scheduler, config: dict) -> None:
    """A checkpoint whose scheduler state holds no Schedule trained under the one its own config describes."""
    from optim.schedule import Schedule
    cfg, steps = (config.get("optim") or {}).get("schedule"), (config.get("train") or {}).get("steps")
    if cfg is not None and steps and hasattr(scheduler, "lr_lambdas"):
        scheduler.lr_lambdas = [Schedule(cfg, int(steps))] * len(scheduler.lr_lambdas)


def read_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, full (unsharded) and keyed by its flat DCP name
    ("model.tok_emb.weight", "optim.state.tok_emb.weight.exp_avg"), for offline comparison."""
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in entries.items()
          if isinstance(md, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=str(path))
    return sd


def read_blobs(path, keys=("meta",)) -> dict:
    """Unpickled Python state of a checkpoint, without touching the model tensors."""
    sd = {k: b"" for k in keys}
    dcp.load(sd, checkpoint_id=str(path))
    return {k: pickle.loads(v) for k, v in sd.items()}


@dataclass
class TrainState:
    model: torch.nn.Module  # the unwrapped module (fully_shard converts it in place)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: object  # data.Loader
    config: dict  # resolved run config
    rank: int = 0
    world: int = 1
    step: int = 0
    tokens: int = 0
    guard: object | None = None  # stability.guard.Guard (state_dict / load_state_dict), or None
    extras: dict = field(default_factory=dict)  # name -> object with state_dict() / load_state_dict()

    def tensors(self) -> tuple[dict, dict]:
        """(model, optimizer) state dicts keyed by parameter name; DTensor shards under FSDP2.

        WARN: on an optimizer that never stepped, torch initialises the moments with a zero-lr step
        (step count 1); a run saved before its first optimizer step would not resume bit-identically.
        """
        return get_state_dict(self.model, self.optimizer)

    def state_dict(self) -> dict:
        model_sd, optim_sd = self.tensors()
        return {
            "model": model_sd,
            "optim": optim_sd,
            "progress": _blob({"step": self.step, "tokens": self.tokens}),
            "scheduler": _blob(self.scheduler.state_dict()),
            "loader": _blob(self.loader.state_dict()),
            "guard": _blob(self.guard.state_dict() if self.guard is not None else {}),
            "extras": _blob({k: v.state_dict() for k, v in self.extras.items()}),
            "meta": _blob({"config": self.config, "versions": versions(), "world": self.world}),
            "rng": {f"rank{self.rank}": _blob(rng.capture())},
            # NOTE: per rank, like the RNG: each rank's anticipatory route cache is for its own shard
            "local": {f"rank{self.rank}": _blob(self.guard.local_state_dict() if self.guard is not None else {})},
        }

    def load(self, path, saved_world: int, allow_data_change: bool = False, skip_extras: tuple[str, ...] = ()) -> None:
        """Load checkpoint `path` (already checked) into this state.

        A rank the saving run did not have (world grew) keeps its freshly seeded RNG streams.
        `skip_extras`: extras left as they are (a guard rollback must not re-arm a fired fault).
        """
        model_sd, optim_sd = self.tensors()
        has_rng = self.rank < saved_world
        sd = {"model": model_sd, "optim": optim_sd, **{k: b"" for k in BLOBS}}
        if has_rng:
            sd["rng"] = {f"rank{self.rank}": b""}
        # the same world only: another one splits the batch differently, so the cached routes do not fit
        local = saved_world == self.world and f"local.rank{self.rank}" in \
            dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if local:
            sd["local"] = {f"rank{self.rank}": b""}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        blobs = {k: pickle.loads(sd[k]) for k in BLOBS}
        self.scheduler.load_state_dict(blobs["scheduler"])
        if not any(blobs["scheduler"].get("lr_lambdas") or [None]):  # saved before the Schedule travelled with it
            _schedule_from_config(self.scheduler, blobs["meta"]["config"])
        self.loader.load_state_dict(blobs["loader"], allow_data_change=allow_data_change)
        self.step, self.tokens = blobs["progress"]["step"], blobs["progress"]["tokens"]
        if self.guard is not None and blobs["guard"]:
            self.guard.load_state_dict(blobs["guard"])
            if local:
                self.guard.load_local_state_dict(pickle.loads(sd["local"][f"rank{self.rank}"]))
        for name, obj in self.extras.items():
            if name in skip_extras:
                continue
            if name not in blobs["extras"] and getattr(obj, "optional", False):
                continue  # saved before this piece existed: it starts from the state as loaded
            if name not in blobs["extras"]:
                raise ValueError(f"resume: checkpoint {Path(path).name} holds no {name} state (saved: "
                                 f"{sorted(blobs['extras']) or 'none'})")
            obj.load_state_dict(blobs["extras"][name])
        if has_rng:
            # NOTE: last, so nothing between here and the first step draws from the restored streams.
            rng.restore(pickle.loads(sd["rng"][f"rank{self.rank}"]))

    def snapshot(self, skip_extras: tuple[str, ...] = ()) -> dict:
        """An in-memory copy of this rank's whole state (the guard's rollback ring).

        Tensors are cloned (a state dict shares storage with the live parameters and moments); the
        guard's own state is left out: the guard decides what of itself a rollback restores.
        """
        model_sd, optim_sd = self.tensors()
        return {
            "model": {k: _clone(v) for k, v in model_sd.items()},
            "optim": torch.utils._pytree.tree_map(_clone, optim_sd),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "loader": copy.deepcopy(self.loader.state_dict()),
            "extras": {k: copy.deepcopy(v.state_dict()) for k, v in self.extras.items() if k not in skip_extras},
            "rng": rng.capture(), "step": self.step, "tokens": self.tokens,
        }

    def restore(self, snap: dict) -> None:
        """Put a snapshot() back: parameters, moments, schedule, data cursor, extras, RNG, progress."""
        # WARN: Optimizer.load_state_dict may keep the given tensors (no copy when dtype and device
        # match): hand it clones, or the next steps would write into the snapshot itself.
        set_state_dict(self.model, self.optimizer, model_state_dict=snap["model"],
                       optim_state_dict=torch.utils._pytree.tree_map(_clone, snap["optim"]))
        self.scheduler.load_state_dict(snap["scheduler"])
        # NOTE: the run's own snapshot: a data switch since (a mixture drill) is the run's, not an accident
        self.loader.load_state_dict(snap["loader"], allow_data_change=True)
        for name, sd in snap["extras"].items():
            self.extras[name].load_state_dict(sd)
        self.step, self.tokens = snap["step"], snap["tokens"]
        rng.restore(snap["rng"])
