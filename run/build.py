"""Build a run from the composed config: every component, in the order their dependencies allow.

    run = build_run(cfg, dist)   # validates, builds, writes the run directory's header files, resumes
    train(run)                   # train.py's loop reads everything from `run`

Order matters: the precision recipe converts modules before sharding; FSDP2 swaps the parameters, so
the optimizer comes after wrap_model; the checkpointer resumes last (it restores every RNG stream just
before the first step). Everything that can reject the config runs before the run directory is written.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from checkpoint import Checkpointer, TrainState, resume_options
from checkpoint.publish import write_atomic
from checkpoint.state import versions
from data import build_data
from data.loader import Loader, eval_batches
from model import Transformer
from model.checkpointing import set_activation_checkpointing
from optim import build_optimizer, build_scheduler, format_table
from optim.levers import build_levers
from optim.muon import ns_dtype_for
from parallel import Dist, barrier, wrap_model
from parallel.wrap import is_sharded
from precision import build_recipe
from run.compile import compile_model, decide
from run.config import TrainConfig, validate
from spec.monitor import Conformance, build_spec
from stability.anticipatory import AnticipatoryRouting
from stability.callbacks import Callbacks
from stability.events import EventLog
from stability.faults import FaultDrill, FaultInjector
from stability.guard import Guard
from stability.intervene import Intervene
from stability.plots import plot_losses
from stability.record import read_records
from stability.sinks import ConsoleSink, build_sinks
from stability.telemetry import StepTelemetry, Telemetry


@dataclass
class Run:
    """One run's components; train() takes this and nothing else."""
    cfg: DictConfig
    train: TrainConfig      # train.* as the schema built it (plain attributes, not OmegaConf nodes)
    dist: Dist
    run_dir: Path
    dataset: object
    model: Transformer      # the bare module (telemetry, MoE bias, checkpoints read it)
    wrapped: torch.nn.Module  # what the step calls: DDP / FSDP2 / compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: object          # optim.scaler.DynamicLossScaler or None
    recipe: object          # precision recipe: autocast, table
    loader: Loader
    evals: list
    events: EventLog
    guard: Guard
    ckpt: Checkpointer
    callbacks: Callbacks    # drills, anticipatory routing, telemetry, levers: attached at the step's named points
    spec: Conformance | None  # the step's specification checks (also one of the callbacks), or None: spec.enabled=false
    clip: object            # None (train.clip=fixed) or the adaptive z-score clip policy
    sinks: list

    def close(self) -> None:
        """After the loop, or after an error: the last async save waited for, the files closed. A save that
        failed under another error (the guard gave up) is said here, after that error's line."""
        failed = self.ckpt.failure()  # the run is not over until its last async save is published
        if failed is not None and self.dist.is_main:
            print(f"ballast: {failed}", file=sys.stderr, flush=True)
        for f in [*self.sinks, self.events]:
            try:
                f.close()
            except OSError:  # NOTE: a full disk fails the flush of a record the error was already about
                pass

    def finish(self) -> None:
        """After the last step: the sinks closed, loss.png, and the final evaluation beside the exact floor."""
        for sink in self.sinks:
            sink.close()
        if not self.sinks:
            return
        records = read_records(self.run_dir / "metrics.jsonl")
        last = next(r["eval"] for r in reversed(records) if r.get("eval"))
        if self.cfg.logging.plot:
            plot_losses(records, self.run_dir / "loss.png", last["floor"])
        floor = (f" | exact floor {last['floor']:.4f} | gap {last['loss'] - last['floor']:+.4f} nats"
                 if last["floor"] is not None else "")
        by_src = "  ".join(f"{n} {v:.4f}" for n, v in last["by_source"].items())
        print(f"final eval loss {last['loss']:.4f}{floor}\n  by source: {by_src}\n"
              f"  metrics: {self.run_dir / 'metrics.jsonl'}")


def build_run(cfg: DictConfig, dist: Dist) -> Run:
    """cfg: the composed config (saved as config.yaml, fingerprinted); each component gets its own group of
    the Config the schema builds from it, checked once."""
    typed = validate(cfg)  # every group's keys, types and rules, once: run/config.py
    typed.train.check_world(dist.world)
    if typed.threads:
        torch.set_num_threads(typed.threads)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    if dist.is_main and (run_dir / "metrics.jsonl").exists() and not resume_options(typed.resume)[0]:
        raise ValueError(f"hydra.run.dir={run_dir} already holds a run; pick a new directory")
    torch.manual_seed(typed.seed)  # same seed on every rank → identical initial weights
    recipe = build_recipe(typed.precision, dist.device)  # te_fp8 without CUDA/TE stops here, in one line

    dataset = build_data(typed.data)
    model_cfg = typed.model.for_data(dataset)
    model = Transformer(model_cfg).to(dist.device)
    recipe.convert(model)  # swaps eligible Linears (FP8): before sharding and before the optimizer
    set_activation_checkpointing(model, typed.train.activation_checkpointing)  # after convert, before wrap and compile
    # before the optimizer: FSDP2 swaps the parameters
    wrapped = wrap_model(model, dataclasses.replace(typed.parallel, **recipe.fsdp_dtypes()), dist)
    compile_ = decide(typed.train.compile, dist.device, typed.train.steps)
    if compile_.on:  # fuses the elementwise ops between matmuls (norms, RoPE, SwiGLU, loss)
        wrapped = compile_model(wrapped, announce=dist.is_main)
    optimizer, group_table = build_optimizer(model, typed.optim)
    scheduler = build_scheduler(optimizer, typed.optim.schedule, typed.train.steps)
    scaler = recipe.make_scaler()  # None unless fp16
    levers = build_levers(typed.train.clip, typed.train.zscore, typed.optim.qk_clip, model)
    tc = typed.train
    loader = Loader(dataset, tc.batch_size, dist.rank, dist.world, skip=tuple(tc.skip_batches))
    evals = eval_batches(dataset, tc.eval_samples, tc.eval_batch_size, dist.rank, dist.world)
    floor = dataset.expected_floor() if hasattr(dataset, "expected_floor") else None
    # the rules that need the model or the data (fault.layer, the mixture weights) fail here, before anything is written
    events = EventLog(run_dir, dist.is_main)
    faults = FaultInjector(typed.fault, model=model, optimizer=optimizer, loader=loader, data_cfg=typed.data,
                           train_cfg=typed.train, dist=dist)
    faults.wrap(wrapped)  # a missing-reduction drill hooks DDP's gradient communication
    telemetry = Telemetry(model, typed.telemetry)
    is_moe = bool(model.moe_layers())
    an = typed.guard.anticipatory
    routing = AnticipatoryRouting(model, loader, typed.train.micro_batches, an, dist.device, recipe.autocast,
                                  forward=wrapped) if is_moe and an.enabled else None
    spec = build_spec(typed, model=model, wrapped=wrapped, optimizer=optimizer, scheduler=scheduler, loader=loader,
                      dataset=dataset, dist=dist, recipe=recipe, scaler=scaler, evals=evals, clip_policy=levers.clip,
                      sharded=is_sharded(model))
    state = TrainState(model, optimizer, scheduler, loader, config, dist.rank, dist.world,
                       extras={**({"loss_scaler": scaler} if scaler else {}), "faults": faults, **levers.extras(),
                               **({"spec": spec} if spec is not None else {})})
    state.guard = guard = Guard(typed.guard, state=state, ckpt=None, events=events, routing=routing,
                                is_moe=is_moe)
    ckpt = Checkpointer(typed.checkpoint, typed.resume, typed.train.steps, dist, run_dir, state)
    ckpt.check_resume()  # which checkpoint, and is it this run: fails before anything is written
    callbacks = Callbacks([FaultDrill(faults, optimizer, events, guard) if faults.kind != "none" else None, routing,
                           StepTelemetry(telemetry) if telemetry.every else None, levers,
                           Intervene(typed.intervene, optimizer, scheduler, loader, events)
                           if typed.intervene.kind != "none" else None, spec])

    if dist.is_main:
        write_header(cfg, typed, dist, run_dir, dataset, model, model_cfg, group_table, recipe)
        print(compile_.line())
        if typed.optim.name == "muon":  # the optimizer and the optimizer check resolve it alike (optim/muon.py)
            dtype, why = ns_dtype_for(typed.optim.muon.ns_dtype, dist.device)
            print(f"optim.muon.ns_dtype: {dtype} ({why})")
    sinks = build_sinks(typed.logging, run_dir, typed.train.steps, floor, typed.run_name, config) if dist.is_main else []
    guard.ckpt = ckpt
    if spec is not None:  # a rollback's restored state and its data policy are the plan the checks go on from
        guard.restored.append(spec.rolled_back)
    ckpt.resume()  # last: restores every RNG stream just before the first step
    console = next((s for s in sinks if isinstance(s, ConsoleSink)), None)
    ckpt.begin(console.say if console else print)  # what the start did, said once (not again on step 1's line)
    guard.start(state.step)
    barrier()
    return Run(cfg=cfg, train=typed.train, dist=dist,
               run_dir=run_dir, dataset=dataset, model=model, wrapped=wrapped, optimizer=optimizer,
               scheduler=scheduler, scaler=scaler, recipe=recipe, loader=loader, evals=evals, events=events,
               guard=guard, ckpt=ckpt, callbacks=callbacks, spec=spec, clip=levers.clip, sinks=sinks)


def write_header(cfg, typed, dist: Dist, run_dir: Path, dataset, model, model_cfg, group_table, recipe) -> None:
    """Rank 0: the resolved config, the environment, and the tables a reader checks before the loss."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: atomic: a resume rewrites these, and a full disk must not leave the run a truncated config.yaml
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    # threads: the intra-op count in force (the config's, or torch's default from OMP_NUM_THREADS and the cores): a
    # CPU matmul's rounding can depend on it, so a rebuild that reproduces the run bit for bit runs with it
    env = {**versions(), "world": dist.world, "device": str(dist.device), "threads": torch.get_num_threads(),
           "argv": sys.argv[1:]}
    write_atomic(run_dir / "environment.json", json.dumps(env, indent=1) + "\n")  # for the doctor's report
    print(f"run dir {run_dir} | {dist.world} process(es) on {dist.device} | data {dataset.fingerprint[:12]}")
    print(dataset.describe())
    print(f"model: {model.num_params() / 1e6:.3f}M parameters, "
          f"{sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers))} MoE layer(s) of {model_cfg.n_layers}")
    print(format_table(group_table))
    if note := typed.optim.schedule.clamp_note(typed.train.steps):
        print(note)  # a run shorter than its schedule's warmup (or wsd decay) runs on the clamped schedule
    table = recipe.table(sharded=is_sharded(model))  # FSDP2's param_dtype reaches the fp32 modules too
    print(table.to_markdown())
    table.save(run_dir)
    if typed.train.compile:  # NOTE: the first step waits for it: a minute or more on a CPU, else a silent wait
        print("train.compile=true: the first step compiles the model first (torch.compile); "
              "train.compile=false runs it eagerly")

