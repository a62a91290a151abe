"""ballast: train a small dense / MoE transformer — the story of one run, top to bottom.

    python train.py                                          # quickstart: dense + MoE, synthetic data
    python train.py +experiment=shakespeare_char data.path=input.txt
    torchrun --standalone --nproc_per_node=2 train.py +experiment=dense_tiny

One optimizer step: count the global valid tokens → forward/backward every micro-batch on
(loss_sum + z·z_sum)/N_valid (+ aux) → unscale → global norm → finite check → clip → the guard may veto
→ step → schedule → one StepRecord → the guard may roll back (stability/guard.py). Drills, anticipatory
routing and per-layer telemetry act at the step's named points (stability/callbacks.py); run/build.py
assembles everything from the config. The numbers a step needs on the host stay on the device until one
transfer (parallel/host_scalars.py; two when the guard can veto: docs/host_reads.md).
"""
from __future__ import annotations

from run import startup  # noqa: F401  (first: a Ctrl-C while the imports run is one line, not a traceback)
from run import omp_wait  # noqa: F401  (before torch: how OpenMP threads wait is fixed when torch loads)

import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from checkpoint import CheckpointFailed, FinalCheckpointWithheld, RunComplete

from optim.accumulate import count_valid_tokens, forward_backward, reduce_sums
from optim.schedule import record as lr_record
from parallel import Dist, HostScalars, all_reduce_sum, destroy, init_distributed, release
from precision.step import apply_update, prepare_update
from run.build import Run, build_run
from run.argv import normalise
from run.config import register
from run.lifecycle import (CannotStart, Exit, Interrupted, Interrupts, RunDir, RunDirBusy, before_hydra, say,
                           start_failed, write_failed)
from stability.callbacks import StepState
from stability.guard import GuardAbort
from stability.inputs import InputBaseline, input_tensors
from stability.record import config_fingerprint, step_record
from stability.resume_fields import cpu_clock, rank_tensors, state_nonfinite, state_tensors, state_values
from stability.step_numbers import ask_guard, step_numbers
from stability.telemetry import moe_summary

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
            except OSError as e:  # e.g. a run directory that cannot be written, a full disk
                return say(dist, *start_failed(e))
            owner.started()
            return train_and_close(run, stop)
    except (RunDirBusy, CannotStart) as e:
        return say(dist, f"ballast: {e}", Exit.BUSY if isinstance(e, RunDirBusy) else e.exit)


def train_and_close(run: Run, stop: Interrupts) -> int:
    try:
        train(run, stop)
    except GuardAbort as e:  # the guard gave up: say why in one line; the last good checkpoint stands
        return say(run.dist, f"ballast: guard: {e}", Exit.GUARD)
    except FinalCheckpointWithheld as e:  # the last step was vetoed: the run ends without its final save
        return say(run.dist, f"ballast: {e}", Exit.GUARD)
    except Interrupted as e:
        return say(run.dist, f"ballast: {e}", Exit.INTERRUPTED)
    except (CheckpointFailed, OSError) as e:  # a save that did not publish, a full disk: the job is not done
        return say(run.dist, *write_failed(e, run.ckpt))
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
    # the guard judges a step before its update when it may veto it (or a drill reads its verdict after the
    # update): the step's numbers are read then; under guard=log, once, after the update (docs/host_reads.md)
    first = guard.vetoes or cb.reads_verdict
    while step < ckpt.last_step:  # last_step < train.steps under checkpoint.stop_after
        if stop.agreed():  # the step boundary: an interrupt saves this state and ends the run here
            saved = ckpt.save_interrupted(step, tokens_seen, guard.healthy())
            stopped = Interrupted.at(stop, step, saved, run.run_dir)
            run.events.emit(step, "interrupted", str(stopped), signal=stop.name, checkpoint=saved and saved.name)
            for sink in run.sinks:
                sink.close()
            raise stopped
        step += 1  # NOTE: a while loop, because a guard rollback moves the step back
        host = HostScalars()  # every number the step needs on the host, as device tensors until read
        s = StepState(step, max_grad_norm=tc.max_grad_norm, host=host)
        t0, c0 = time.perf_counter(), cpu_clock()
        cb.before_batch(s)
        s.first_id = loader.samples_consumed  # the global batch is sample ids [first_id, first_id + batch_size)
        s.batch = loader.next()
        cb.on_batch(s)  # a data drill may replace the batch; anticipatory routing sets s.routes
        s.micro = micro = [mb.to(dev, non_blocking=True) for mb in s.batch.micro_batches(tc.micro_batches)]
        s.n_valid_t = n_valid = count_valid_tokens(micro, dev)  # global, before any forward
        inputs = input_tensors(micro, dev, run.dataset.vocab_size, getattr(run.dataset, "bos_ids", None), in_base)
        host.put(n_valid=n_valid, **inputs)
        t1 = time.perf_counter()

        cb.before_forward(s)
        sums = forward_backward(run.wrapped, micro, n_valid, tc.z_loss, run.dist.world, len(names), routes=s.routes,
                                autocast=run.recipe.autocast, loss_scale=run.scaler.scale if run.scaler else None)
        reduced = reduce_sums(sums)  # the global loss (by source) and MoE sums, all-reduced, still on the device
        host.put(**reduced.tensors(), **rank_tensors(micro, sums, run.dist.world, run.dist.rank, dev))
        t2 = time.perf_counter()

        cb.before_update(s)
        s.lr = optimizer.param_groups[0]["lr"] / optimizer.param_groups[0].get("lr_scale", 1.0)
        # unscale → global norm → finite check agreed by all ranks → clip (the adaptive z-score policy, or None)
        params, fingerprint = list(model.parameters()), loader.dataset.fingerprint
        s.update = upd = prepare_update(params, run.scaler, s.max_grad_norm, clip=run.clip)
        host.put(grad_norm=upd.norm, clip_coef=upd.coef, overflow=upd.overflow)
        cb.after_clip(s)  # the specification checks that can refuse the update measure here (spec/)
        nums, vetoed = None, False
        if first:  # the guard judges before the update: the step's numbers are read now, and it may veto
            host.read()
            s.numbers = nums = step_numbers(host, reduced, names)
            failed = run.spec.read(s, host, "before") if run.spec is not None else []
            s.vetoed = vetoed = ask_guard(guard, step, nums, spec=failed, scaled=run.scaler is not None,
                                          fingerprint=fingerprint)
        # → step, or a counted skip (decided on the device when nothing is read yet)
        s.result = res = apply_update(params, optimizer, run.scaler, upd, nums.overflow if first else None,
                                      vetoed)
        cb.after_update(s)  # QK-clip; telemetry reads the gradients and Δθ into s.post
        run.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()

        s.loads = loads = reduced.loads_E()
        for layer, moe in model.moe_layers():  # aux-loss-free balancing, global loads; a skipped step moves no state
            moe.update_bias(loads[layer], skipped=res.skipped)
        cb.end_step(s)  # the state the step leaves: the specification checks of the update measure it (spec/)
        host.put(**state_tensors(optimizer, model), **stop.tensors())  # ‖m‖, ‖v‖ per group, MoE bias norms
        host.read()  # from here the step reads only the host's copy
        if nums is None:  # the guard judges after the update (guard=log): from the same numbers, no veto
            s.numbers = nums = step_numbers(host, reduced, names)
            failed = run.spec.read(s, host, "before") if run.spec is not None else []
            ask_guard(guard, step, nums, spec=failed, scaled=run.scaler is not None, fingerprint=fingerprint)
        s.skipped = skipped = nums.overflow or vetoed  # the update was not applied
        failed = run.spec.read(s, host, "after") if run.spec is not None else []  # the checks read after it
        if nums.overflow:  # NOTE: a non-finite gradient would poison the weights and moments
            s.events.append(f"non-finite grad norm ({nums.grad_norm}) at loss scale {res.loss_scale}: optimizer "
                            f"step skipped ({res.skipped_total if res.skipped_total is not None else 1} so far)")
        s.moe = moe_summary(nums.stats["moe_load"], nums.stats["moe_out_sq"])
        s.opt_state = state_values(host, optimizer, model)
        stop.heard(host)
        # from those norms, every step: the optimizer state holds no inf/NaN (the guard's post-update check);
        # state beside the moments (Muon's momentum) on telemetry steps only (s.post is theirs)
        s.post = {**s.post, "nonfinite": {**s.post.get("nonfinite", {}),
                                          "optim_state": state_nonfinite(optimizer, s.opt_state, bool(s.post))}}
        worst = max((m["max_violation"] for m in s.moe.values()), default=None)
        after = {"moe": s.moe, "state": s.opt_state, "clip_coef": nums.clip_coef, "grad_norm": nums.grad_norm,
                 "skipped": skipped} if guard.watches_more else None
        verdict = guard.after_update(step, s.first_id, nums.n_valid, s.post, nums.stats["loss"], worst, extra=after,
                                     spec=failed)
        if run.spec is not None and (verdict.triggers or s.spec.get("fail")):  # the reference checks look at it too
            run.spec.on_demand(s, host)
        tokens_seen += nums.n_valid
        evaluated = {}
        if step % tc.eval_every == 0 or step == ckpt.last_step:
            te, ce = time.perf_counter(), cpu_clock()
            s.eval = evaluate(model, run.evals, names, dev)
            evaluated = {"eval": time.perf_counter() - te, "eval_cpu": cpu_clock() - ce}  # inside log_eval and cpu
        t4 = time.perf_counter()
        # the snapshot point: after the update, before the next batch; never a state the guard fired on
        ckpt.maybe_save(step, tokens_seen, healthy=guard.healthy())
        guard.maybe_snapshot(step)
        t5, c5 = time.perf_counter(), cpu_clock()

        route = s.time_s.get("route", 0.0)  # NOTE: the anticipatory routing forward, booked on its own
        s.time_s = {"data": t1 - t0 - route, "route": route, "fwd_bwd": t2 - t1, "optim": t3 - t2,
                    "log_eval": t4 - t3, "ckpt": t5 - t4, "total": t5 - t0, "cpu": c5 - c0, **evaluated}
        if run.spec is not None:  # the specification checks' share of the times above
            total, by_check = run.spec.took()
            s.time_s.update({"spec": total, **{f"spec.{k}": v for k, v in by_check.items()}})
        s.events += run.events.pop() + ckpt.pop_events()
        rec = step_record(s, tokens=tokens_seen, world=run.dist.world, batch_size=tc.batch_size,
                          seq_len=run.dataset.seq_len, names=names, guard=guard.record(), ckpt_id=ckpt.ckpt_id,
                          device=dev, fingerprint={**cfg_fp, "data": loader.dataset.fingerprint[:12]},
                          schedule=lr_record(run.scheduler))
        for sink in run.sinks:
            sink.write(rec)
        if verdict.rollback:  # restore a recent good TrainState; the loop continues from its step
            step = guard.rollback(step)
            tokens_seen = ckpt.state.tokens
        guard.end_step(step)
    ckpt.close()
    run.finish()


@torch.no_grad()
def evaluate(model, batches, names, device) -> dict:
    """Loss per valid token on the fixed validation samples, by source, beside the exact floor."""
    S = len(names)
    # loss, tokens, floor, loss by source, tokens by source, floor by source: summed on the device, read once
    acc = torch.zeros(3 + 3 * S, dtype=torch.float64, device=device)
    for b in batches:
        b = b.to(device)
        out = model(b.tokens, b.labels)
        acc[0] += out.loss_sum
        acc[1] += out.n_valid
        if b.floor is not None:
            acc[2] += b.floor.double().sum()
            acc[3 + 2 * S:].index_add_(0, b.sources, b.floor.double().sum(-1))
        acc[3:3 + S].index_add_(0, b.sources, out.loss_sum_B.double())
        acc[3 + S:3 + 2 * S].index_add_(0, b.sources, out.n_valid_B.double())
    acc = all_reduce_sum(acc).tolist()
    has_floor = bool(batches) and batches[0].floor is not None
    result = {"loss": acc[0] / acc[1], "tokens": int(acc[1]), "floor": acc[2] / acc[1] if has_floor else None}
    result["by_source"] = {n: acc[3 + i] / acc[3 + S + i] for i, n in enumerate(names) if acc[3 + S + i]}
    result["tokens_by_source"] = {n: int(acc[3 + S + i]) for i, n in enumerate(names) if acc[3 + S + i]}
    result["floor_by_source"] = ({n: acc[3 + 2 * S + i] / acc[3 + S + i] for i, n in enumerate(names)
                                  if acc[3 + S + i]} if has_floor else {})
    return result


if __name__ == "__main__":
    sys.argv[1:] = normalise(sys.argv[1:])  # resume=X → resume.path=X, for Hydra too
    # one line for a bad key or value, before Hydra's multi-line message or any file is written
    before_hydra(sys.argv[1:], str(Path(__file__).resolve().parent / "conf"))
    main()
