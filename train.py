"""ballast: train a small dense / MoE transformer — the story of one run, top to bottom.

    python train.py                                          # quickstart: dense + MoE, synthetic data
    python train.py +experiment=shakespeare_char data.path=input.txt
    torchrun --standalone --nproc_per_node=2 train.py +experiment=dense_tiny

One optimizer step (DESIGN §3): count the global valid tokens → forward/backward every micro-batch on
(loss_sum + z·z_sum)/N_valid (+ aux) → clip by the global norm → the guard may veto → step → schedule
→ telemetry → one StepRecord → the guard may roll back (stability/guard.py).
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from checkpoint import Checkpointer, TrainState, resume_options
from checkpoint.state import versions
from data import build_data
from data.loader import Loader, eval_batches
from model import ModelConfig, Transformer
from optim import build_optimizer, build_scheduler, format_table
from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
from parallel import all_reduce_sum, barrier, destroy, init_distributed, wrap_model
from precision import build_recipe, optimizer_step
from stability.anticipatory import AnticipatoryRouting
from stability.events import EventLog
from stability.faults import FaultInjector
from stability.guard import Guard, GuardAbort
from stability.inputs import InputBaseline, input_stats
from stability.plots import plot_losses
from stability.record import StepRecord, read_records
from stability.sinks import build_sinks
from stability.step_state import cpu_clock, rank_inputs, resume_marker, state_summary
from stability.telemetry import Telemetry, moe_summary, nonfinite_flags


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    dist = init_distributed(cfg.device)
    try:
        run = build(cfg, dist)
    except ValueError as e:  # every config problem surfaces here as one line naming the key
        print(f"ballast: config error: {e}", file=sys.stderr)
        destroy()
        sys.exit(2)
    try:
        train(cfg, dist, **run)
    except GuardAbort as e:  # the guard gave up: say why in one line; the last good checkpoint stands
        print(f"ballast: guard: {e}", file=sys.stderr)
        sys.exit(3)
    finally:
        run["ckpt"].close()  # the run is not over until its last async save is published
        run["events"].close()
        destroy()


def build(cfg: DictConfig, dist) -> dict:
    check_train_cfg(cfg, dist.world)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    if dist.is_main and (run_dir / "metrics.jsonl").exists() and not resume_options(config["resume"])[0]:
        raise ValueError(f"hydra.run.dir={run_dir} already holds a run; pick a new directory")
    torch.manual_seed(cfg.seed)  # same seed on every rank → identical initial weights
    recipe = build_recipe(config["precision"], dist.device)  # te_fp8 without CUDA/TE stops here, in one line

    dataset = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    model_cfg = ModelConfig.from_dict({**OmegaConf.to_container(cfg.model, resolve=True),
                                       "vocab_size": dataset.vocab_size, "seq_len": dataset.seq_len})
    model = Transformer(model_cfg).to(dist.device)
    recipe.convert(model)  # swaps eligible Linears (FP8): before sharding and before the optimizer
    wrapped = wrap_model(model, dist=dist, **{**config["parallel"], **recipe.fsdp_dtypes()})  # before the optimizer: FSDP2 swaps the params
    if cfg.train.compile:  # fuses the elementwise ops between matmuls (norms, RoPE, SwiGLU, loss)
        wrapped = torch.compile(wrapped)
    optimizer, group_table = build_optimizer(model, OmegaConf.to_container(cfg.optim, resolve=True))
    scheduler = build_scheduler(optimizer, OmegaConf.to_container(cfg.optim.schedule, resolve=True), cfg.train.steps)
    scaler = recipe.make_scaler()  # None unless fp16
    loader = Loader(dataset, cfg.train.batch_size, dist.rank, dist.world)
    evals = eval_batches(dataset, cfg.train.eval_samples, cfg.train.eval_batch_size, dist.rank, dist.world)
    floor = dataset.expected_floor() if hasattr(dataset, "expected_floor") else None
    # the stability pieces validate their config here too, before anything is written
    events = EventLog(run_dir, dist.is_main)
    faults = FaultInjector(config["fault"], model=model, optimizer=optimizer, loader=loader,
                           data_cfg=config["data"], dist=dist)
    faults.wrap(wrapped)  # a missing-reduction drill hooks DDP's gradient communication
    telemetry = Telemetry(model, cfg.telemetry.every)
    is_moe = bool(model.moe_layers())
    an = config["guard"]["anticipatory"]
    routing = AnticipatoryRouting(model, loader, cfg.train.micro_batches, an["delay"], dist.device,
                                  recipe.autocast) if is_moe and an["enabled"] else None
    state = TrainState(model, optimizer, scheduler, loader, config, dist.rank, dist.world,
                       extras={"loss_scaler": scaler, "faults": faults} if scaler else {"faults": faults})
    state.guard = guard = Guard(config["guard"], state=state, ckpt=None, events=events, routing=routing,
                                is_moe=is_moe)

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        env = {**versions(), "world": dist.world, "device": str(dist.device), "argv": sys.argv[1:]}
        (run_dir / "environment.json").write_text(json.dumps(env, indent=1) + "\n")  # for the doctor's report
        print(f"run dir {run_dir} | {dist.world} process(es) on {dist.device} | data {dataset.fingerprint[:12]}")
        print(dataset.describe())
        print(f"model: {model.num_params() / 1e6:.3f}M parameters, "
              f"{sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers))} MoE layer(s) of {model_cfg.n_layers}")
        print(format_table(group_table))
        table = recipe.table()
        print(table.to_markdown())
        table.save(run_dir)
    sinks = build_sinks(cfg.logging, run_dir, cfg.train.steps, floor, cfg.run_name, config) if dist.is_main else []
    ckpt = Checkpointer(config, dist, run_dir, state)
    guard.ckpt = ckpt
    ckpt.resume()  # last: restores every RNG stream just before the first step
    guard.start(state.step)
    barrier()
    return dict(model=model, wrapped=wrapped, optimizer=optimizer, scheduler=scheduler, loader=loader,
                evals=evals, dataset=dataset, sinks=sinks, run_dir=run_dir, ckpt=ckpt, recipe=recipe, scaler=scaler,
                events=events, faults=faults, telemetry=telemetry, routing=routing, guard=guard)


def train(cfg, dist, model, wrapped, optimizer, scheduler, loader, evals, dataset, sinks, run_dir, ckpt,
          recipe, scaler, events, faults, telemetry, routing, guard) -> None:
    # NOTE: a plain namespace: an OmegaConf attribute read costs ~17 µs (a dict read ~0.05 µs)
    tc, names = SimpleNamespace(**OmegaConf.to_container(cfg.train, resolve=True)), dataset.source_names
    step, tokens_seen = ckpt.state.step, ckpt.state.tokens  # 0 unless resumed
    in_base = InputBaseline(dataset)  # the running unigram histogram the inputs are judged by
    while step < ckpt.last_step:  # last_step < train.steps under checkpoint.stop_after
        step += 1  # NOTE: a while loop, because a guard rollback moves the step back
        t0, c0 = time.perf_counter(), cpu_clock()
        faults.before_batch(step)
        first_id = loader.samples_consumed  # the global batch is sample ids [first_id, first_id + batch_size)
        batch = faults.corrupt(step, first_id, loader.next())
        micro = [mb.to(dist.device) for mb in batch.micro_batches(tc.micro_batches)]
        routes = routing.routes_for(step, first_id) if routing is not None else None  # None unless on
        n_valid = count_valid_tokens(micro, dist.device)  # global, before any forward
        inputs = input_stats(micro, dist.device, dataset.vocab_size, getattr(dataset, "bos_ids", None), in_base)
        t1 = time.perf_counter()

        measure = telemetry.wants(step)
        if measure:
            telemetry.start(step)
        faults.before_forward(step)
        sums = forward_backward(wrapped, micro, n_valid, tc.z_loss, dist.world, len(names), routes=routes,
                                autocast=recipe.autocast, loss_scale=scaler.scale if scaler else None)
        # the global loss before the update: the guard judges the step before it is applied
        stats = reduce_step_sums(sums, n_valid.item())
        ranks = rank_inputs(batch, sums, dist.world, dist.rank, dist.device)
        t2 = time.perf_counter()

        factor, planned = faults.lr_factor(step), [g["lr"] for g in optimizer.param_groups]  # 1.0 unless an LR drill
        for g in optimizer.param_groups:
            g["lr"] *= factor
        lr = optimizer.param_groups[0]["lr"] / optimizer.param_groups[0].get("lr_scale", 1.0)
        if measure:
            telemetry.before_update()

        loss_by_source = {n: s / c for n, s, c in zip(names, stats["loss_sum_by_source"], stats["tokens_by_source"]) if c}

        flags = {}

        def veto(norm, overflow):  # the guard's pre-update checkpoint: loss (by source), grad norm, finite flags
            flags.update(nonfinite_flags(stats["loss"], stats["logit_max"], norm.item()))
            return guard.before_update(step, stats["loss"], norm.item(), flags, scaled=scaler is not None,
                                       fingerprint=loader.dataset.fingerprint, loss_by_source=loss_by_source)

        # unscale → global norm → finite check agreed by all ranks → clip → guard veto → step, or a counted skip
        res = optimizer_step(model.parameters(), optimizer, scaler, tc.max_grad_norm, veto=veto)
        norm, coef = res.norm, res.coef
        for g, lr_g in zip(optimizer.param_groups, planned):
            g["lr"] = lr_g
        post = telemetry.finish(coef, optimizer) if measure else {}
        faults.after_update(step)
        events_now = []
        if res.skipped and not res.vetoed:  # NOTE: a non-finite gradient would poison the weights and moments
            events_now.append(f"non-finite grad norm ({norm.item()}) at loss scale {res.loss_scale}: optimizer "
                              f"step skipped ({res.skipped_total if res.skipped_total is not None else 1} so far)")
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()

        for layer, moe in model.moe_layers():  # aux-loss-free balancing from the global loads
            moe.update_bias(stats["moe_load"][layer].to(dist.device))
        moe_stats = moe_summary(stats["moe_load"])
        opt_state = state_summary(optimizer, model)
        worst = max((m["max_violation"] for m in moe_stats.values()), default=None)
        for e in faults.pop_events():  # the injected fault, in the same story as the guard's actions
            info = {k: v for k, v in e.items() if k not in ("step", "kind")}
            events.emit(e["step"], "fault", ", ".join(f"{k}={v}" for k, v in info.items()), **info)
        verdict = guard.after_update(step, first_id, int(n_valid.item()), post, stats["loss"], worst)
        tokens_seen += int(n_valid.item())
        ev = evaluate(model, evals, names, dist.device) if step % tc.eval_every == 0 or step == ckpt.last_step else None
        t4 = time.perf_counter()
        # the snapshot point: after the update, before the next batch; never a state the guard fired on
        ckpt.maybe_save(step, tokens_seen, healthy=guard.healthy())
        guard.maybe_snapshot(step)
        t5, c5 = time.perf_counter(), cpu_clock()
        events_now += events.pop() + ckpt.pop_events()

        rec = StepRecord(
            step=step, tokens=tokens_seen, world=dist.world,
            batch={"first": first_id, "size": tc.batch_size},
            source_mix={n: int(c) for n, c in zip(names, stats["samples_by_source"])},
            valid_tokens=int(n_valid.item()),
            tokens_by_source={n: int(c) for n, c in zip(names, stats["tokens_by_source"])}, inputs=inputs,
            loss=stats["loss"], z_loss=stats["z_loss"], aux_loss=stats["aux_loss"], logit_max=stats["logit_max"],
            loss_by_source=loss_by_source,
            expert_load={str(l): (load / load.sum()).tolist() for l, load in stats["moe_load"].items()},
            lr=lr, grad_norm=norm.item(), clip_coef=coef.item(), skipped=res.skipped, loss_scale=res.loss_scale,
            layers=post.get("layers", {}), moe=moe_stats, update_ratio_max=post.get("update_ratio_max"),
            nonfinite={**flags, **post.get("nonfinite", {})},
            replica=post.get("replica", {}), guard=guard.record(),
            routing=routing.info(step) if routing is not None else {},
            time_s={"data": t1 - t0, "fwd_bwd": t2 - t1, "optim": t3 - t2, "log_eval": t4 - t3, "ckpt": t5 - t4,
                    "total": t5 - t0, "cpu": c5 - c0},
            tokens_per_s=tc.batch_size * dataset.seq_len / (t5 - t0), memory_mb=peak_memory_mb(dist.device),
            events=events_now, eval=ev, ckpt_id=ckpt.ckpt_id,
            resume=resume_marker(events_now), state=opt_state, ranks=ranks,
        )
        for sink in sinks:
            sink.write(rec)
        if verdict.rollback:  # restore a recent good TrainState; the loop continues from its step
            step = guard.rollback(step)
            tokens_seen = ckpt.state.tokens
        guard.end_step(step)
    ckpt.close()
    finish(cfg, sinks, run_dir, dataset)


@torch.no_grad()
def evaluate(model, batches, names, device) -> dict:
    """Loss per valid token on the fixed validation samples, by source, beside the exact floor."""
    S = len(names)
    acc = torch.zeros(3 + 2 * S, dtype=torch.float64)  # loss, tokens, floor, loss by source, tokens by source
    for b in batches:
        b = b.to(device)
        out = model(b.tokens, b.labels)
        acc[0] += out.loss_sum.item()
        acc[1] += out.n_valid.item()
        if b.floor is not None:
            acc[2] += b.floor.double().sum().item()
        acc[3:3 + S].index_add_(0, b.sources.cpu(), out.loss_sum_B.double().cpu())
        acc[3 + S:].index_add_(0, b.sources.cpu(), out.n_valid_B.double().cpu())
    acc = all_reduce_sum(acc.to(device)).cpu().tolist()
    result = {"loss": acc[0] / acc[1], "tokens": int(acc[1]),
              "floor": acc[2] / acc[1] if batches and batches[0].floor is not None else None}
    result["by_source"] = {n: acc[3 + i] / acc[3 + S + i] for i, n in enumerate(names) if acc[3 + S + i]}
    return result


def finish(cfg, sinks, run_dir: Path, dataset) -> None:
    for sink in sinks:
        sink.close()
    if not sinks:
        return
    records = read_records(run_dir / "metrics.jsonl")
    last = next(r["eval"] for r in reversed(records) if r.get("eval"))
    if cfg.logging.plot:
        plot_losses(records, run_dir / "loss.png", last["floor"])
    floor = f" | exact floor {last['floor']:.4f} | gap {last['loss'] - last['floor']:+.4f} nats" if last["floor"] is not None else ""
    by_src = "  ".join(f"{n} {v:.4f}" for n, v in last["by_source"].items())
    print(f"final eval loss {last['loss']:.4f}{floor}\n  by source: {by_src}\n  metrics: {run_dir / 'metrics.jsonl'}")


def check_train_cfg(cfg, world: int) -> None:
    tc = cfg.train
    for key in ("steps", "batch_size", "micro_batches", "eval_every", "eval_samples", "eval_batch_size"):
        if int(tc[key]) <= 0:
            raise ValueError(f"train.{key}={tc[key]}: must be a positive integer")
    if tc.batch_size % (world * tc.micro_batches):
        raise ValueError(f"train.batch_size={tc.batch_size} is not divisible by world size {world} × "
                         f"train.micro_batches={tc.micro_batches}")
    if tc.max_grad_norm is not None and tc.max_grad_norm < 0:
        raise ValueError(f"train.max_grad_norm={tc.max_grad_norm}: must be >= 0 or null")
    if tc.z_loss < 0:
        raise ValueError(f"train.z_loss={tc.z_loss}: must be >= 0")
    if tc.compile and cfg.model.get("moe"):
        raise ValueError("train.compile=true: MoE dispatch has data-dependent shapes (one recompile per "
                         "expert-load pattern); compile dense models only")
    if cfg.data.kind == "text" and OmegaConf.is_missing(cfg.data, "path"):
        raise ValueError("data.path is required for data=text (e.g. data.path=input.txt)")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


if __name__ == "__main__":
    main()
