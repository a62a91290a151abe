"""Single-batch replay: one logged step, rebuilt from its batch ID and the checkpoint before it, run
forward in FP32 (or FP64) on one process and compared with what the run logged (docs/course.md §1: only
a saved batch ID lets you replay the same fault, shrunk, on one device).

    python -m doctor.replay runs/<run> --step S [--dtype float32|float64] [--checkpoint PATH]

The logged loss of step S was computed with the parameters after step S−1. A checkpoint at exactly
S−1 replays exactly; from an older one at k the steps k+1..S−1 are re-run first with the real
optimizer and schedule (the checkpoint holds their state), which is exact when the run was
deterministic (same thread count, one process). Prints the replayed vs logged loss, per-source loss,
and the first layer whose output is non-finite; writes replay_step_<S>.json into the run directory.

NOTE: the batch is rebuilt from its ids (dataset.samples(range(first, first + size)); a multi-rank
batch is the ranks' shards in rank order). A batch corrupted in flight is therefore rebuilt CLEAN, and
a NaN injected by a forward hook does not come back: a finite replay of a non-finite step is evidence
that the fault is not in the state or the batch (transient), and the run's own per-layer telemetry
names the layer. A drill the config names (fault.kind, one process) is part of the run and acts in the
replay too, at its points and with its state from the checkpoint: a rerun contains the planted fault.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from stability.record import read_records

DTYPES = ("float32", "float64")


@dataclass
class ReplayResult:
    step: int
    checkpoint: str
    dtype: str
    retrained: list[int]            # steps re-run from the checkpoint before the replayed forward
    loss: float
    logged_loss: float
    loss_by_source: dict[str, float]
    logged_loss_by_source: dict[str, float]
    first_nonfinite: str | None     # the replay's first non-finite layer output (model order)
    logged_first_nonfinite: str | None  # the run's telemetry's
    act_rms: dict[str, float]       # replayed per-layer activation RMS (telemetry's layer names)
    inputs: dict[str, float]
    logged_inputs: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def delta(self) -> float:
        return abs(self.loss - self.logged_loss)


def replay(run_dir, step: int, dtype: str = "float32", checkpoint=None, train_to: bool = True,
           say=None) -> ReplayResult:
    """say: a line per phase (the command line prints them: re-running steps from an older checkpoint takes
    minutes on a CPU), with a bar over the re-run steps on a terminal; None: silent."""
    # NOTE: torch and the model stack are imported here, not at module level: a bad command line fails
    # in a fraction of a second instead of after the torch import.
    import torch

    from checkpoint import TrainState, publish, read_blobs
    from data import Loader, build_data
    from model import Transformer
    from optim import build_optimizer, build_scheduler
    from run.config import Config
    from stability.faults import FaultInjector

    run_dir = Path(run_dir)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype}: expected one of {', '.join(DTYPES)}")
    if not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "config.yaml").is_file():
        raise ValueError(f"run_dir={run_dir}: needs metrics.jsonl and config.yaml (not a run directory)")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    path_of = trajectory(read_records(run_dir / "metrics.jsonl"), step)
    ckpt = Path(checkpoint) if checkpoint else newest_before(run_dir, config, step)
    quiet, say = say is None, say or (lambda line: None)
    say(f"replay: checking {ckpt} against its marker (sha256 of every file)")
    reason = publish.check(ckpt, verify_hashes=True)
    if reason:
        raise ValueError(f"--checkpoint={ckpt}: not a complete checkpoint: {reason}")
    blobs = read_blobs(ckpt, ("meta", "progress", "loader"))
    k = blobs["progress"]["step"]
    if k >= step:
        raise ValueError(f"--checkpoint={ckpt}: saved at step {k}, not before step {step}")
    if config.get("threads"):  # NOTE: the thread count changes CPU reduction order: keep the run's
        torch.set_num_threads(int(config["threads"]))

    cfg = Config.from_dict(config)
    ds = build_data(cfg.data)
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model.for_data(ds))
    optimizer, _ = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim.schedule, cfg.train.steps)
    loader = Loader(ds, cfg.train.batch_size)
    faults = FaultInjector(cfg.fault, model=model, optimizer=optimizer, loader=loader, data_cfg=cfg.data,
                           train_cfg=cfg.train)
    state = TrainState(model, optimizer, scheduler, loader, config, extras={"faults": faults})
    state.load(ckpt, blobs["meta"]["world"], allow_data_change=True)
    notes = [] if blobs["loader"]["fingerprint"] == ds.fingerprint else [
        f"the checkpoint's data manifest {blobs['loader']['fingerprint'][:12]} differs from config.yaml's "
        f"{ds.fingerprint[:12]} (the data changed during the run): batches are rebuilt from config.yaml's data"]
    missing = [t for t in range(k + 1, step) if t not in path_of]
    if missing:
        raise ValueError(f"--step={step}: no record of step(s) {missing[:3]} between the checkpoint (step {k}) and it")
    retrained = list(range(k + 1, step)) if train_to else []
    if retrained:
        say(f"replay: re-running steps {retrained[0]}..{retrained[-1]} from {ckpt.name} "
            f"({len(retrained)} optimizer step(s))")
    from tqdm.auto import tqdm  # NOTE: a bar on a terminal only, as train.py's; off one, the line above
    for t in tqdm(retrained, desc="replay", unit="step", file=sys.stderr,
                  disable=quiet or not sys.stderr.isatty()):
        notes += train_step(model, optimizer, scheduler, ds, config, path_of[t], faults)
    if not train_to and k < step - 1:
        notes.append(f"--no-train-to: the parameters are those of step {k}, not {step - 1}: an approximate replay")
    rec = path_of[step]
    say(f"replay: step {step}'s forward in {dtype}")
    if rec.get("routing", {}).get("on"):
        notes.append("the run used anticipatory routes at this step; the replay routes with the current parameters")
    out = forward(model.to(getattr(torch, dtype)), micro_batches(ds, config, rec, faults), len(ds.source_names), ds)
    logged_first = next((n for n, q in rec.get("layers", {}).items()
                         if "act_rms" in q and not math.isfinite(q["act_rms"])), None)
    res = ReplayResult(step, str(ckpt), dtype, retrained, out["loss"], rec["loss"],
                       {n: v for n, v in zip(ds.source_names, out["by_source"]) if v is not None},
                       rec.get("loss_by_source", {}), out["first_nonfinite"], logged_first, out["act_rms"],
                       out["inputs"], rec.get("inputs", {}), notes)
    res.notes += verdict(res)
    return res


def trajectory(records: list[dict], step: int) -> dict[int, dict]:
    """step -> record on the path that first reached `step` (execution order; after a rollback the
    replayed steps overwrite the abandoned ones, so the path leading to `step` is what remains)."""
    path: dict[int, dict] = {}
    for r in records:
        path = {t: x for t, x in path.items() if t < r["step"]}  # a rollback abandons the steps after it
        path[r["step"]] = r
        if r["step"] == step:
            return path
    raise ValueError(f"--step={step}: no record of that step in metrics.jsonl")


def newest_before(run_dir: Path, config: dict, step: int) -> Path:
    from doctor import checkpoints
    found = checkpoints.before(run_dir, config, step)
    if found is None:
        raise ValueError(f"--step={step}: no complete checkpoint before it under {checkpoints.root(run_dir, config)} "
                         f"(rerun with checkpoint.every=K, K < {step}, or pass --checkpoint)")
    return found[1]


def micro_batches(ds, config: dict, rec: dict, faults=None) -> list:
    """The step's micro-batches in the run's order: each rank's contiguous shard, split per rank; on one
    process, the config's drill acts on the batch and arms its forward hooks as in the run."""
    from stability.callbacks import StepState
    first, size, world = rec["batch"]["first"], rec["batch"]["size"], rec.get("world", 1)
    batch = ds.samples(range(first, first + size), "train")
    if faults is not None and world == 1:
        s = StepState(rec["step"], first_id=first, batch=batch)
        faults.at("on_batch", s)
        faults.at("before_forward", s)
        batch = s.batch
    n = int(config["train"]["micro_batches"])
    return [mb for shard in batch.micro_batches(world) for mb in shard.micro_batches(n)]


def train_step(model, optimizer, scheduler, ds, config: dict, rec: dict, faults=None) -> list[str]:
    """One logged optimizer step, as train.py runs it (token-normalised forward/backward, clip, step or
    the logged skip, schedule, MoE bias; the config's drill at its points). Returns notes where the replay
    departs from the record."""
    import torch

    from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
    from precision import optimizer_step
    from stability.callbacks import StepState
    tc, notes, t = config["train"], [], rec["step"]
    micro = micro_batches(ds, config, rec, faults)
    n_valid = count_valid_tokens(micro, torch.device("cpu"))
    sums = forward_backward(model, micro, n_valid, float(tc["z_loss"]), 1, len(ds.source_names))
    stats = reduce_step_sums(sums, n_valid.item())
    if faults is not None:
        faults.at("before_update", StepState(t))
    lr = optimizer.param_groups[0]["lr"] / optimizer.param_groups[0].get("lr_scale", 1.0)
    if not math.isclose(lr, rec["lr"], rel_tol=1e-9):  # both float64 from one formula: a few roundings at most
        notes.append(f"step {t}: logged lr {rec['lr']:.6g} but the schedule gives {lr:.6g}: "
                     f"the replay follows the schedule")
    if not rec.get("skipped"):
        optimizer_step(model.parameters(), optimizer, None, tc.get("max_grad_norm"))
    if faults is not None:
        faults.at("after_update", StepState(t))
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    for layer, moe in model.moe_layers():
        moe.update_bias(stats["moe_load"][layer])
    # NOTE: 1e-5: an FP32 loss over ~1e4 tokens summed in another order differs by √K·u ≈ 1e-5 at most
    if not (math.isfinite(stats["loss"]) and math.isclose(stats["loss"], rec["loss"], rel_tol=1e-5)):
        notes.append(f"step {t} (re-run): loss {stats['loss']:.6g} vs logged {rec['loss']:.6g}")
    return notes


def forward(model, micro: list, n_sources: int, ds) -> dict:
    """Forward only, with a hook on every block and sublayer: loss as the run sums it (loss sums over
    micro-batches, one division by the valid-token count), per-source loss, per-layer activation RMS
    and the first layer (model order) whose output holds an inf/NaN."""
    import torch

    from stability.inputs import input_stats
    watch = [("emb", model.tok_emb)]
    for i, block in enumerate(model.blocks):
        watch += [(f"block{i}.attn", block.attn), (f"block{i}.mlp", block.mlp), (f"block{i}", block)]
    watch.append(("norm", model.norm))
    if model.head.weight is not model.tok_emb.weight:
        watch.append(("head", model.head))
    sq = {name: [0.0, 0] for name, _ in watch}

    def hook(name):
        def f(module, args, out):
            y = out[0] if isinstance(out, tuple) else getattr(out, "y", out)  # a Block returns (x, moe)
            sq[name][0] += float(y.double().square().sum())
            sq[name][1] += y.numel()
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in watch]
    dtype = next(model.parameters()).dtype
    loss_sum = torch.zeros((), dtype=dtype)
    by_src, n_src = torch.zeros(n_sources, dtype=dtype), torch.zeros(n_sources, dtype=dtype)
    n_valid = 0
    try:
        with torch.no_grad():
            for mb in micro:
                out = model(mb.tokens, mb.labels)
                loss_sum += out.loss_sum.to(dtype)  # NOTE: summed in micro-batch order, as the run does
                by_src.index_add_(0, mb.sources, out.loss_sum_B.to(dtype))
                n_src.index_add_(0, mb.sources, out.n_valid_B.to(dtype))
                n_valid += int(out.n_valid)
    finally:
        for h in handles:
            h.remove()
    act = {n: math.sqrt(s / c) if c else math.nan for n, (s, c) in sq.items()}
    return {"loss": float(loss_sum) / n_valid,
            "by_source": [float(s / c) if c else None for s, c in zip(by_src, n_src)],
            "act_rms": act, "first_nonfinite": next((n for n, v in act.items() if not math.isfinite(v)), None),
            "inputs": input_stats(micro, torch.device("cpu"), ds.vocab_size, getattr(ds, "bos_ids", None))}


def verdict(r: ReplayResult) -> list[str]:
    """What the comparison says, in words (docs/course.md §5: reproducible or not is itself evidence)."""
    logged_bad = not math.isfinite(r.logged_loss) or r.logged_first_nonfinite is not None
    if logged_bad and r.first_nonfinite is None and math.isfinite(r.loss):
        where = f"; the run's telemetry names the first non-finite layer: {r.logged_first_nonfinite}" \
            if r.logged_first_nonfinite else ""
        return [f"the fault did not reproduce from the state and the batch: the replay is finite (transient: "
                f"a kernel, device or injected event){where}"]
    if r.first_nonfinite is not None:
        return [f"reproduced: the first non-finite layer output is {r.first_nonfinite}"]
    # NOTE: the input statistics are exact counts (equal to the last bits: 1e-9), and a corrupted batch moves the
    # loss by far more than FP32's rounding (a thousandth, against ~1e-5)
    differ = [k for k in r.logged_inputs if k in r.inputs and abs(r.inputs[k] - r.logged_inputs[k]) > 1e-9]
    if differ and r.delta > 1e-3 * max(1.0, abs(r.logged_loss)):
        return [f"the logged batch is not what the ids produce: the batch was corrupted in flight "
                f"(input stats differ: {', '.join(differ)})"]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m doctor.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--step", type=int, required=True, help="the logged optimizer step to replay")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the newest before --step)")
    ap.add_argument("--train-to", action=argparse.BooleanOptionalAction, default=True,
                    help="re-run the steps between the checkpoint and --step (default: on)")
    args = ap.parse_args(argv)
    try:
        r = replay(args.run_dir, args.step, args.dtype, args.checkpoint, args.train_to,
                   say=lambda line: print(line, flush=True))
    except ValueError as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    print(f"replay of step {r.step} from {Path(r.checkpoint).name} in {r.dtype}"
          + (f" (re-ran steps {r.retrained[0]}..{r.retrained[-1]})" if r.retrained else ""))
    print(f"  loss {r.loss:.8g} vs logged {r.logged_loss:.8g}: |Δ| = {r.delta:.3g}")
    for s, v in r.loss_by_source.items():
        print(f"  {s}: {v:.6g} vs logged {r.logged_loss_by_source.get(s, math.nan):.6g}")
    print(f"  first non-finite layer: replay {r.first_nonfinite or 'none'}, "
          f"run telemetry {r.logged_first_nonfinite or 'none'}")
    for n in r.notes:
        print(f"  note: {n}")
    out = Path(args.run_dir) / f"replay_step_{r.step}.json"
    out.write_text(json.dumps({**asdict(r), "delta": r.delta}, indent=1, allow_nan=True))
    print(f"  written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
