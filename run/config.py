"""The root config: every group's schema, composed once, registered with Hydra's ConfigStore.

    conf/config.yaml          defaults: [ballast_schema, model: mixed_tiny, ..., _self_]
    ballast_schema (here)     Config: the types and defaults of every key (components' dataclasses)
    conf/<group>/<option>     only the values that option changes

Where a key is defined: run_name, seed, device, threads, resume, train.* here; telemetry.*, logging.*,
guard.*, fault.* in stability/config.py; spec.* in spec/config.py; model.* in model/config.py; optim.* (and the fp16 loss scale)
in optim/config.py; data.* in data/config.py; parallel.* in parallel/config.py; precision.* in
precision/config.py; checkpoint.* and resume.* in checkpoint/config.py.

To add a key: add a typed field with its default (and a `why` comment) to its group's dataclass, its
range or cross-key rule to that dataclass's `__post_init__` (a rule across groups: `Config.__post_init__`
below), and read it in the component. A YAML option sets it only where its value differs from the
default. OmegaConf then refuses an unknown or mistyped key; `python train.py --cfg job` shows it.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from checkpoint.config import CheckpointConfig, ResumeConfig
from checkpoint.failure import NO_SPACE
from data.config import DataConfig, read_keys
from model.config import ModelConfig, default_model
from optim.config import CLIP_MODES, OptimConfig, ZScoreConfig
from parallel.config import ParallelConfig
from precision.config import PrecisionConfig
from run.argv import normalise
from run.config_errors import ConfigError, check, choice, fail, from_mapping, known_keys_only, one_line
from spec.config import SpecConfig
from stability.config import FaultConfig, GuardConfig, LoggingConfig, TelemetryConfig, read_saved
from stability.intervene import InterveneConfig

SCHEMA = "ballast_schema"  # the name conf/config.yaml's defaults list starts with
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    steps: int = 400
    batch_size: int = 16         # GLOBAL samples per optimizer step (split over ranks)
    micro_batches: int = 2       # gradient-accumulation micro-batches per rank
    z_loss: float = 1e-4         # coefficient on Σ logsumexp² / N_valid
    max_grad_norm: float | None = 1.0  # global-norm clip threshold; null = measure only
    eval_every: int = 100
    eval_samples: int = 512
    eval_batch_size: int = 64
    # torch.compile the model: a cold start, then faster steps (MoE: one graph, grouped GEMM); null: only where the
    # run is long enough for the saving to repay the cold start (run/compile.py decides from the device and steps)
    compile: bool | None = None
    activation_checkpointing: str = "none"  # none | full | selective: recompute block activations in the backward
    clip: str = "fixed"          # fixed (max_grad_norm) | zscore (adaptive, optim/zclip.py)
    zscore: ZScoreConfig = field(default_factory=ZScoreConfig)  # train.clip=zscore only
    # batch IDs (first global sample ids) the loader never serves: quarantined data, keyed by the batch and not
    # by the step, so a resume or a rollback cannot move the quarantine onto other data (the doctor's data fix)
    skip_batches: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "micro_batches", "eval_every", "eval_samples", "eval_batch_size"):
            check(getattr(self, key) > 0, f"train.{key}", getattr(self, key), "must be a positive integer")
        if self.batch_size % self.micro_batches:
            fail("train.batch_size", self.batch_size,
                 f"is not divisible by train.micro_batches={self.micro_batches}", sep=" ")
        check(self.max_grad_norm is None or self.max_grad_norm >= 0, "train.max_grad_norm", self.max_grad_norm,
              "must be >= 0 or null")
        check(self.z_loss >= 0, "train.z_loss", self.z_loss, "must be >= 0")
        choice("train.clip", self.clip, CLIP_MODES)
        choice("train.activation_checkpointing", self.activation_checkpointing, ("none", "full", "selective"))
        bad = [i for i in self.skip_batches if i < 0 or i % self.batch_size]
        check(not bad, "train.skip_batches", bad[:1], f"batch IDs are multiples of train.batch_size={self.batch_size}")

    def check_world(self, world: int) -> None:
        """The rule that needs the launch: every rank gets whole micro-batches."""
        if self.batch_size % (world * self.micro_batches):
            fail("train.batch_size", self.batch_size, f"is not divisible by world size {world} × "
                 f"train.micro_batches={self.micro_batches}", sep=" ")


def _resume_default() -> dict:
    return {"path": None, "allow_data_change": False, "allow_config_change": []}


@dataclass
class Config:
    run_name: str = "quickstart"
    seed: int = 0                # model init and torch RNG; the data has its own seed (data.seed)
    device: str = "auto"         # auto | cpu | cuda
    threads: int | None = None   # torch intra-op threads per process; null = torch's default
    # Continue a run from a checkpoint: `resume=latest` (this run dir's checkpoints/latest) or a checkpoint
    # path; the full form, for declared changes: resume.path=latest resume.allow_data_change=true.
    # NOTE: Any, because the shorthand replaces the node with a string; the mapping is checked below.
    resume: Any = field(default_factory=_resume_default)
    train: TrainConfig = field(default_factory=TrainConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)  # the step's specification checks (spec/)
    model: ModelConfig = field(default_factory=default_model)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    intervene: InterveneConfig = field(default_factory=InterveneConfig)  # one changed step (doctor --verify)

    @classmethod
    def from_dict(cls, saved: Mapping) -> "Config":
        """A run's saved config.yaml read back (the doctor's replay, checkpoint loading), through the same
        schema; data keys its kind does not read are dropped (a run saved when one had another default), and
        a run saved with flat fault keys reads back with them under its drill's namespace."""
        saved = {**saved, "data": read_keys(saved.get("data") or {}), "fault": read_saved(saved.get("fault") or {})}
        try:
            return validate(OmegaConf.merge(OmegaConf.structured(cls), saved))
        except OmegaConfBaseException as e:
            raise ConfigError(one_line(e)) from None

    def __post_init__(self) -> None:
        """Rules across groups (each group checked its own keys when it was built)."""
        choice("device", self.device, DEVICES)
        check(self.threads is None or self.threads >= 1, "threads", self.threads, "must be >= 1 or null")
        if isinstance(self.resume, (dict, DictConfig)):  # the full form, checked and kept as a ResumeConfig
            self.resume = from_mapping(ResumeConfig, self.resume, "resume")
        elif self.resume is not None and not isinstance(self.resume, str):
            fail("resume", self.resume, "expected latest, a checkpoint path, or resume.path=...")
        for key in ("vocab_size", "seq_len"):
            value = getattr(self.model, key)
            check(value is None, f"model.{key}", value, f"set by the data (data.kind={self.data.kind}); drop it")
        self.checkpoint.check_steps(self.train.steps)
        if self.guard.action == "rollback" and self.guard.rollback.source == "disk" and not self.checkpoint.every:
            raise ConfigError("guard.rollback.source=disk needs checkpoint.every > 0 (there would be nothing on "
                              "disk to roll back to); set checkpoint.every or use guard.rollback.source=memory")
        # NOTE: fault rules that need the model or the data (fault.layer, fault.param, the mixture_switch
        # weights) are checked by FaultInjector, built before anything is written.


def register() -> None:
    """The schema under SCHEMA, for conf/config.yaml's defaults list (Hydra's typed-config pattern)."""
    ConfigStore.instance().store(name=SCHEMA, node=Config)


def validate(cfg: DictConfig) -> Config:
    """The composed config as a checked Config (every group's __post_init__ and the root's), or one
    ConfigError line."""
    try:
        known_keys_only(cfg)
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from None


def compose_check(overrides: list[str], config_dir: str | None = None, config_name: str = "config") -> Config:
    """Compose conf/ with these command-line overrides, as @hydra.main will, and validate: the pre-flight
    that turns Hydra's and OmegaConf's multi-line messages into one ConfigError line. config_dir=None:
    inside a caller's `hydra.initialize_config_dir` (tests compose many configs under one)."""
    return _compose(overrides, config_dir, config_name)[0]


def _compose(overrides: list[str], config_dir: str | None, config_name: str = "config") -> tuple[Config, str]:
    """The validated Config and the run directory Hydra will make for it (hydra.run.dir, resolved now)."""
    from contextlib import nullcontext

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register()
    init = nullcontext() if config_dir is None else initialize_config_dir(config_dir=config_dir, version_base=None)
    try:
        with init:
            cfg = compose(config_name=config_name, overrides=normalise(overrides), return_hydra_config=True)
        with open_dict(cfg):
            run_dir = str(cfg.hydra.run.dir)
            del cfg["hydra"]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(one_line(e)) from None
    return validate(cfg), run_dir


def preflight(argv: list[str], config_dir: str) -> Path | None:
    """Compose and validate the command line before @hydra.main runs: a bad key or value, or a run
    directory that cannot be made, stops the run in one line (train.py prints it, exit 2) before anything
    is written. Returns the run directory Hydra will make (None when skipped). Skipped when an argument
    is a flag (--cfg, -m/--multirun, --help, --info, -c, ...): those
    are Hydra's own business."""
    if any(a.startswith("-") for a in argv):
        return None
    cfg, run_dir = _compose(list(argv), config_dir)
    run_dir = Path(run_dir).absolute()
    parent = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise ConfigError(f"hydra.run.dir={run_dir}: cannot create it: {parent} is not a writable directory")
    if parent != run_dir:  # NOTE: root passes os.access on /proc and /sys, where mkdir fails: try one
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".ballast-", dir=parent))
        except OSError as e:
            if e.errno in NO_SPACE:
                raise OSError(e.errno, e.strerror, str(parent)) from None  # a full disk: its own exit status
            raise ConfigError(f"hydra.run.dir={run_dir}: cannot create it under {parent}: {e.strerror}") from None
    if cfg.device == "cuda":
        import torch  # NOTE: here, not at the top: the schema is read without torch (the doctor)
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda: CUDA is not available on this machine (use device=cpu or auto)")
    return run_dir
