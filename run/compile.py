"""train.compile: torch.compile the model only where it pays for itself, and say so while it compiles.

A compiled step is shorter than an eager one (inductor fuses the element-wise work between the matmuls: the
norms, RoPE, SwiGLU, the loss), but the run first waits for the compile: the first step traces the model and
generates its kernels, and the first telemetry step compiles a second graph (its hooks change what runs). A
compile therefore pays only when the run is long enough:

    steps × (t_eager − t_compiled)  >  t_cold            (per-step saving × run length  >  cold start)

`train.compile: null` (the default) decides before the first step from what is known then, the device and
the run's length: compile when steps ≥ MIN_STEPS[device type], the inequality solved for steps with a cold
start and a per-step saving of this repository's models on that device (on a CPU `bash bench/speed/speedrun.sh`
measures both beside each other: docs/results/speedrun.md). true or false decides outright.

NOTE: a rule of the config and the device alone, never of a timing taken on the fly: the same command gives
the same numerics on the same machine (eager and compiled steps round differently), and a resume decides as
the run it continues did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

# The break-even run length by device type, steps ≥ t_cold / (t_eager − t_compiled), with t_cold and the two step
# times from `bash bench/speed/speedrun.sh` (docs/results/speedrun.md, which also prints the quotient):
#   cpu: inductor compiles two graphs (the first step's, the first telemetry step's) and saves only the
#        element-wise share of a matmul-bound step: the quotient is thousands of steps, and
#        the threshold sits above it by the spread of a shared machine's cold start (more than twice the
#        quiet figure), past any experiment here on a laptop.
#   cuda: eager small models are bound by kernel launches, which the compiled graph mostly removes: the saving
#        is a large share of each step, and a run of a few thousand steps repays the cold start.
MIN_STEPS = {"cpu": 20_000, "cuda": 2_000}


@dataclass(frozen=True)
class CompileDecision:
    on: bool
    why: str  # one clause, printed in the run's header

    def line(self) -> str:
        return f"train.compile: {'on' if self.on else 'off'} ({self.why})"


def decide(setting: bool | None, device: torch.device | str, steps: int) -> CompileDecision:
    """train.compile's decision for a run of `steps` optimizer steps on `device`."""
    if setting is not None:
        return CompileDecision(bool(setting), f"train.compile={str(bool(setting)).lower()}")
    kind = torch.device(device).type
    need = MIN_STEPS.get(kind)
    if need is None:
        return CompileDecision(False, f"auto: no break-even known for device {kind}, eager")
    if steps >= need:
        return CompileDecision(True, f"auto: {steps} steps on {kind} ≥ {need}, where the saving per step repays "
                                     "the cold start")
    return CompileDecision(False, f"auto: {steps} steps on {kind} < {need}, too few to repay a cold compile; "
                                  "train.compile=true forces it")


def compile_model(module: nn.Module, announce: bool = True, backend: str = "inductor") -> nn.Module:
    """torch.compile(module); with announce, every compile it goes through (the first forward, its backward,
    a recompile for a new graph) prints one line on stdout while it runs and ends it with its seconds."""
    if announce:
        _announce_compiles()
    return torch.compile(module, backend=backend)


_announcing = False


def _announce_compiles() -> None:
    global _announcing
    if _announcing:  # the hooks are process-wide: one pair for every compiled model of the process
        return
    _announcing = True
    from torch._dynamo.callback import CallbackTrigger, on_compile_end, on_compile_start

    t0: list[float] = []
    what = {CallbackTrigger.DYNAMO: "forward", CallbackTrigger.LAZY_BACKWARD: "backward"}

    def start(args) -> None:
        t0[:] = [time.perf_counter()]
        part = what.get(args.callback_trigger, args.callback_trigger.name.lower())
        print(f"torch.compile: compiling the {part} (graph {args.compile_id}) ...", end="", flush=True)

    def end(args) -> None:
        print(f" {time.perf_counter() - t0[0]:.1f} s", flush=True)

    on_compile_start(start)
    on_compile_end(end)
