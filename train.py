"""ballast: train a small dense / MoE transformer — the story of one run, top to bottom.

    python train.py                                          # quickstart: dense + MoE, synthetic data
    python train.py +experiment=shakespeare_char data.path=input.txt
    torchrun --standalone --nproc_per_node=2 train.py +experiment=dense_tiny

One optimizer step: count the global valid tokens → forward/backward every micro-batch on
(loss_sum + z·z_sum)/N_valid (+ aux) → unscale → global norm → finite check → clip → the guard may veto
→ step → schedule → one StepRecord → the guard may roll back (stability/guard.py). Drills, anticipatory
routing and per-layer telemetry act at the step's named points (stability/callbacks.py); run/build.py
assembles everything from the config.
"""
from __future__ import annotations

from run import omp_wait  # noqa: F401  (first: how OpenMP threads wait is fixed when torch loads)

import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from checkpoint import FinalCheckpointWithheld, RunComplete

from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
from parallel import Dist, all_reduce_sum, destroy, init_distributed, release
from precision import optimizer_step
from run.build import Run, build_run
from run.argv import normalise
from run.config import preflight, register
from run.lifecycle import CannotStart, Exit, Interrupted, Interrupts, RunDir, RunDirBusy, note_new_dirs, say
from run.config_errors import ConfigError
from stability.callbacks import StepState
from stability.guard import GuardAbort
from stability.inputs import InputBaseline, input_stats
from stability.plots import plot_losses
from stability.record import config_fingerprint, loss_by_source, read_records, step_record
from stability.resume_fields import cpu_clock, rank_inputs, state_nonfinite, state_summary
from stability.telemetry import moe_summary, nonfinite_flags

register()  # the typed schema conf/config.yaml's defaults list starts with (run/config.py)


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    dist = init_distributed(cfg.device)
    try:
        code = job(cfg, dist)
    finally:
        destroy()  # after job() returned: the run, which owns the group too, is gone (parallel.dist.destroy)
    if code:
        sys.exit(code)


def job(cfg: DictConfig, dist: Dist) -> int:
    """Build and train one run; the exit status (run/lifecycle.py Exit). Every reference to the run ends with
    this frame. The run directory has one owner from before the first write to the last save."""
    try:
        with RunDir(Path(HydraConfig.get().runtime.output_dir), dist) as owner, Interrupts(dist) as stop:
            try:
                run = build_run(cfg, dist)
            except RunComplete as e:  # resume=auto after the final save: the job is done, not refused
                return say(dist, f"ballast: {e}", Exit.OK)
            except ValueError as e:  # every config, data or resume problem: one line naming the key or file
                return say(dist, f"ballast: config error: {e}", Exit.START)
            except OSError as e:  # e.g. a run directory that cannot be written
                return say(dist, f"ballast: cannot start: {e}", Exit.START)
            owner.started()
            return train_and_close(run, stop)
    except (RunDirBusy, CannotStart) as e:
        return say(dist, f"ballast: {e}", Exit.BUSY if isinstance(e, RunDirBusy) else Exit.START)


def train_and_close(run: Run, stop: Interrupts) -> int:
    try:
        train(run, stop)
    except GuardAbort as e:  # the guard gave up: say why in one line; the last good checkpoint stands
        return say(run.dist, f"ballast: guard: {e}", Exit.GUARD)
    except FinalCheckpointWithheld as e:  # the last step was vetoed: the run ends without its final save
        return say(run.dist, f"ballast: {e}", Exit.GUARD)
    except Interrupted as e:
        return say(run.dist, f"ballast: {e}", Exit.INTERRUPTED)
    finally:
        run.close()
        release(run.wrapped)  # DDP's reducer first, in case a cycle outlives the run: parallel.dist.release
    return Exit.OK


def train(run: Run, stop: Interrupts) -> None:
    tc, names, dev = run.train, run.dataset.source_names, run.dist.device
    model, optimizer, loader, ckpt, guard, cb = run.model, run.optimizer, run.loader, run.ckpt, run.guard, run.callbacks
    step, tokens_seen = ckpt.state.step, ckpt.state.tokens  # 0 unless resumed
    in_base = InputBaseline(run.dataset)  # the running unigram histogram each batch's inputs are judged by
    cfg_fp = config_fingerprint(run.cfg)  # per group: a resume that changed the config shows in the records
    while step < ckpt.last_step:  # last_step < train.steps under checkpoint.stop_after
        if stop.agreed():  # the step boundary: an interrupt saves this state and ends the run here
            saved = ckpt.save_interrupted(step, tokens_seen, guard.healthy())
            stopped = Interrupted.at(stop, step, saved, run.run_dir)
            run.events.emit(step, "interrupted", str(stopped), signal=stop.name, checkpoint=saved and saved.name)
            for sink in run.sinks:
                sink.close()
            raise stopped
        step += 1  # NOTE: a while loop, because a guard rollback moves the step back
        s = StepState(step, max_grad_norm=tc.max_grad_norm)
        t0, c0 = time.perf_counter(), cpu_clock()
        cb.before_batch(s)
        s.first_id = loader.samples_consumed  # the global batch is sample ids [first_id, first_id + batch_size)
        s.batch = loader.next()
        cb.on_batch(s)  # a data drill may replace the batch; anticipatory routing sets s.routes
        s.micro = micro = [mb.to(dev) for mb in s.batch.micro_batches(tc.micro_batches)]
        n_valid = count_valid_tokens(micro, dev)  # global, before any forward
        s.n_valid = int(n_valid.item())
        s.inputs = input_stats(micro, dev, run.dataset.vocab_size, getattr(run.dataset, "bos_ids", None), in_base)
        t1 = time.perf_counter()

        cb.before_forward(s)
        sums = forward_backward(run.wrapped, micro, n_valid, tc.z_loss, run.dist.world, len(names), routes=s.routes,
                                autocast=run.recipe.autocast, loss_scale=run.scaler.scale if run.scaler else None)
        # the global loss before the update: the guard judges the step before it is applied
        s.stats = reduce_step_sums(sums, n_valid.item())
        s.ranks = rank_inputs(s.batch, sums, run.dist.world, run.dist.rank, dev)  # each rank's ids, hash, loss
        s.loss_by_source = loss_by_source(s.stats, names)
        t2 = time.perf_counter()

        cb.before_update(s)
        s.lr = optimizer.param_groups[0]["lr"] / optimizer.param_groups[0].get("lr_scale", 1.0)

        def veto(norm, overflow):  # the guard's pre-update checkpoint: loss (by source), grad norm, finite flags
            s.flags = nonfinite_flags(s.stats["loss"], s.stats["logit_max"], norm.item())
            by_src = dict(zip(names, s.stats["tokens_by_source"]))
            # the rest of what the step knows before its update, for signals the config adds to the guard's watch
            extra = {"inputs": s.inputs, "logit_max": s.stats["logit_max"], "z_loss": s.stats["z_loss"],
                     "nonfinite": s.flags, "tokens_by_source": by_src, "loss_by_source": s.loss_by_source,
                     "ranks": s.ranks} if guard.watches_more else None
            return guard.before_update(step, s.stats["loss"], norm.item(), s.flags, scaled=run.scaler is not None,
                                       fingerprint=loader.dataset.fingerprint, loss_by_source=s.loss_by_source,
                                       tokens_by_source=by_src, extra=extra)

        # unscale → global norm → finite check agreed by all ranks → clip → guard veto → step, or a counted skip
        s.result = res = optimizer_step(model.parameters(), optimizer, run.scaler, s.max_grad_norm, veto=veto,
                                        clip=run.clip)  # clip: None (fixed threshold) or the adaptive z-score policy
        cb.after_update(s)  # QK-clip; telemetry reads the gradients and Δθ into s.post
        if res.skipped and not res.vetoed:  # NOTE: a non-finite gradient would poison the weights and moments
            s.events.append(f"non-finite grad norm ({res.norm.item()}) at loss scale {res.loss_scale}: optimizer "
                            f"step skipped ({res.skipped_total if res.skipped_total is not None else 1} so far)")
        run.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()

        for layer, moe in model.moe_layers() if not res.skipped else ():  # a vetoed step moves no state
            moe.update_bias(s.stats["moe_load"][layer].to(dev))  # aux-loss-free balancing, global loads
        s.moe = moe_summary(s.stats["moe_load"], s.stats["moe_out_sq"])
        s.opt_state = state_summary(optimizer, model)  # ‖m‖, ‖v‖ per group, MoE bias norms (collective)
        # from those norms, every step: the optimizer state holds no inf/NaN (the guard's post-update check);
        # state beside the moments (Muon's momentum) on telemetry steps only (s.post is theirs)
        s.post = {**s.post, "nonfinite": {**s.post.get("nonfinite", {}),
                                          "optim_state": state_nonfinite(optimizer, s.opt_state, bool(s.post))}}
        worst = max((m["max_violation"] for m in s.moe.values()), default=None)
        after = {"moe": s.moe, "state": s.opt_state, "clip_coef": res.coef.item(), "grad_norm": res.norm.item(),
                 "skipped": res.skipped} if guard.watches_more else None
        verdict = guard.after_update(step, s.first_id, s.n_valid, s.post, s.stats["loss"], worst, extra=after)
        tokens_seen += s.n_valid
        if step % tc.eval_every == 0 or step == ckpt.last_step:
            s.eval = evaluate(model, run.evals, names, dev)
        t4 = time.perf_counter()
        # the snapshot point: after the update, before the next batch; never a state the guard fired on
        ckpt.maybe_save(step, tokens_seen, healthy=guard.healthy())
        guard.maybe_snapshot(step)
        t5, c5 = time.perf_counter(), cpu_clock()

        route = s.time_s.get("route", 0.0)  # NOTE: the anticipatory routing forward, booked on its own
        s.time_s = {"data": t1 - t0 - route, "route": route, "fwd_bwd": t2 - t1, "optim": t3 - t2,
                    "log_eval": t4 - t3, "ckpt": t5 - t4, "total": t5 - t0, "cpu": c5 - c0}
        s.events += run.events.pop() + ckpt.pop_events()
        rec = step_record(s, tokens=tokens_seen, world=run.dist.world, batch_size=tc.batch_size,
                          seq_len=run.dataset.seq_len, names=names, guard=guard.record(), ckpt_id=ckpt.ckpt_id,
                          device=dev, fingerprint={**cfg_fp, "data": loader.dataset.fingerprint[:12]})
        for sink in run.sinks:
            sink.write(rec)
        if verdict.rollback:  # restore a recent good TrainState; the loop continues from its step
            step = guard.rollback(step)
            tokens_seen = ckpt.state.tokens
        guard.end_step(step)
    ckpt.close()
    finish(run)


@torch.no_grad()
def evaluate(model, batches, names, device) -> dict:
    """Loss per valid token on the fixed validation samples, by source, beside the exact floor."""
    S = len(names)
    # loss, tokens, floor, loss by source, tokens by source, floor by source
    acc = torch.zeros(3 + 3 * S, dtype=torch.float64)
    for b in batches:
        b = b.to(device)
        out = model(b.tokens, b.labels)
        acc[0] += out.loss_sum.item()
        acc[1] += out.n_valid.item()
        if b.floor is not None:
            acc[2] += b.floor.double().sum().item()
            acc[3 + 2 * S:].index_add_(0, b.sources.cpu(), b.floor.double().sum(-1).cpu())
        acc[3:3 + S].index_add_(0, b.sources.cpu(), out.loss_sum_B.double().cpu())
        acc[3 + S:3 + 2 * S].index_add_(0, b.sources.cpu(), out.n_valid_B.double().cpu())
    acc = all_reduce_sum(acc.to(device)).cpu().tolist()
    has_floor = bool(batches) and batches[0].floor is not None
    result = {"loss": acc[0] / acc[1], "tokens": int(acc[1]), "floor": acc[2] / acc[1] if has_floor else None}
    result["by_source"] = {n: acc[3 + i] / acc[3 + S + i] for i, n in enumerate(names) if acc[3 + S + i]}
    result["tokens_by_source"] = {n: int(acc[3 + S + i]) for i, n in enumerate(names) if acc[3 + S + i]}
    result["floor_by_source"] = ({n: acc[3 + 2 * S + i] / acc[3 + S + i] for i, n in enumerate(names)
                                  if acc[3 + S + i]} if has_floor else {})
    return result


def finish(run: Run) -> None:
    for sink in run.sinks:
        sink.close()
    if not run.sinks:
        return
    records = read_records(run.run_dir / "metrics.jsonl")
    last = next(r["eval"] for r in reversed(records) if r.get("eval"))
    if run.cfg.logging.plot:
        plot_losses(records, run.run_dir / "loss.png", last["floor"])
    floor = (f" | exact floor {last['floor']:.4f} | gap {last['loss'] - last['floor']:+.4f} nats"
             if last["floor"] is not None else "")
    by_src = "  ".join(f"{n} {v:.4f}" for n, v in last["by_source"].items())
    print(f"final eval loss {last['loss']:.4f}{floor}\n  by source: {by_src}\n"
          f"  metrics: {run.run_dir / 'metrics.jsonl'}")


if __name__ == "__main__":
    sys.argv[1:] = normalise(sys.argv[1:])  # resume=X → resume.path=X, for Hydra too
    try:  # one line for a bad key or value, before Hydra's multi-line message or any file is written
        note_new_dirs(preflight(sys.argv[1:], str(Path(__file__).resolve().parent / "conf")))
    except ConfigError as e:
        print(f"ballast: config error: {e}", file=sys.stderr)
        sys.exit(Exit.START)
    main()
