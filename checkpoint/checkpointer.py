"""The checkpoint side of train.py: resume once at start, save at the snapshot point, wait at exit.

    ckpt = Checkpointer(cfg.checkpoint, cfg.resume, cfg.train.steps, dist, run_dir, state)
    ckpt.resume()                                      # no-op unless resume=... is set
    ckpt.begin(console.say)                            # what the start did, said once
    for step in range(ckpt.state.step + 1, ckpt.last_step + 1):
        ...optimizer step...
        stall_s = ckpt.maybe_save(step, tokens)       # the snapshot point: after the update
        rec.ckpt_id, rec.events = ckpt.ckpt_id, events + ckpt.pop_events()
    ckpt.close()                                       # waits for the last async write

A save that does not publish stops the run (CheckpointFailed: the checkpoint, the cause, and the last good
checkpoint checked against its marker): a job whose state is not on disk is not done, and a scheduler must be
able to trust exit 0. One process stops at the first step boundary after the background write failed; a
launch at its next save or at the end, where every rank has waited for the write and knows (every rank must
stop at the same step: the saves are collectives).
"""
from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path

import torch.distributed as tdist
from torch.distributed.checkpoint import FileSystemReader

from checkpoint import publish
from checkpoint.config import CheckpointConfig, ResumeConfig
from checkpoint.failure import SaveError
from checkpoint.resume import check_config, check_data, check_model, check_progress, check_versions
from checkpoint.saver import Saver
from checkpoint.state import TrainState, read_blobs, versions
from optim.schedule import follow, resumed, schedule_of
from parallel.dist import broadcast_object
from stability.record import read_records_partial

AUTO = "auto"  # resume=auto: resume when a complete checkpoint exists, else start fresh


class FinalCheckpointWithheld(RuntimeError):
    """The last step of train.steps was vetoed by the guard: there is no healthy step left to save."""


class CheckpointFailed(RuntimeError):
    """A save did not publish. The message names the checkpoint, the cause and the last good checkpoint."""

    def __init__(self, line: str, disk_full: bool):
        super().__init__(line)
        self.disk_full = disk_full


class RunComplete(Exception):
    """resume=auto found this run's final checkpoint (step = train.steps): the job is done. A scheduler that
    restarts a job killed after its final save gets exit 0 and this line, not a refusal."""


def schema_defaults() -> dict:
    """Every key's default, as the typed schema declares it (run/config.py)."""
    from omegaconf import OmegaConf

    from run.config import Config
    return OmegaConf.to_container(OmegaConf.structured(Config), resolve=True)


def resume_options(resume: str | ResumeConfig | None) -> tuple[str | None, bool, list[str]]:
    """(what to resume from, allow_data_change, allow_config_change) from `resume=latest` or the full form
    (a ResumeConfig, checked by the schema)."""
    if resume is None or isinstance(resume, str):  # `resume=latest` replaces the node with a string
        return resume, False, []
    return resume.path, bool(resume.allow_data_change), list(resume.allow_config_change)


class Checkpointer:
    def __init__(self, ck: CheckpointConfig, resume: str | ResumeConfig | None, steps: int, dist, run_dir: Path,
                 state: TrainState):
        """ck: checkpoint.*, resume: resume, steps: train.steps (all checked by the schema, with the rule
        between them)."""
        self.every, self.stop_after = ck.every, ck.stop_after
        self.last_step = self.stop_after or steps  # the schedule still spans train.steps
        self.verify_hashes = bool(ck.verify_hashes)
        self.steps, self.deferred = steps, None  # deferred: the step a withheld last save moved to
        self.spec, self.allow_data_change, self.allow_config = resume_options(resume)
        self.root = Path(ck.dir) if ck.dir else run_dir / "checkpoints"
        self.dist, self.run_dir, self.state = dist, run_dir, state
        self.ckpt_id: str | None = None  # the checkpoint this run last published or resumed from
        self.ckpt_path: Path | None = None  # ... and where it is
        self._failed: tuple[str, SaveError] | None = None  # the first save that did not publish
        self._schedule: tuple | None = None  # (Schedule, base LRs) a declared change at the resume moved to
        self._raised = False
        self._stall: dict[str, float] = {}  # checkpoint name -> the training stall of its snapshot
        self._events: list[str] = []
        self._plan: tuple | None = None  # check_resume(): (path, skipped notes, notes, meta), () = nothing
        self._fresh = False  # resume=auto found no checkpoint
        saving = self.every > 0 or self.stop_after is not None
        # NOTE: even when checkpoint.every=0: an interrupt saves too (save_interrupted)
        group = tdist.new_group(backend="gloo") if dist.world > 1 else None
        self.saver = Saver(self.root, ck.mode, ck.keep_last, ck.keep_every, dist.rank, group)
        if saving and not self.spec and publish.list_steps(self.root):  # every rank sees it and stops
            raise ValueError(f"checkpoint.dir={self.root} already holds checkpoints of another run; "
                             f"pass resume=latest to continue it, or choose another checkpoint.dir")
        self._unsaid: list[str] = []  # notes from before the first step, printed by begin()
        self._live = False
        self.say = print

    def _note(self, line: str) -> None:
        """A line for the step's record (its events). Before the first step it is printed at once by begin();
        after, the console prints it on the step's line: one line each, never twice."""
        self._events.append(line)
        if not self._live:
            self._unsaid.append(line)

    def begin(self, say=print) -> None:
        """The loop starts: the notes of the start (a resume, a clean-up) printed now on rank 0 through `say`
        (train.py's console sink, which then leaves them off the first step's line)."""
        self.say = say
        if self.dist.is_main:
            for line in self._unsaid:
                say(line)
        self._unsaid, self._live = [], True

    def check_resume(self) -> None:
        """Everything resume() checks, before anything is written: which checkpoint, and that it is this
        run (config, model, data, progress). A start that fails here leaves the run directory as it was.
        Idempotent; resume() calls it when the caller did not."""
        if self._plan is not None:
            return
        if self.spec == AUTO:
            self.spec, self._fresh = self._auto(), True
        if not self.spec:
            self._plan = ()
            return
        found = None
        if self.dist.is_main:
            try:
                if self.spec == publish.LATEST and not self.root.is_dir():
                    raise ValueError(f"resume=latest: no {self.root}; continue a run with hydra.run.dir=<its run dir> "
                                     f"resume=latest, or pass resume=<checkpoint path>")
                path, notes = publish.resolve(str(self.spec), self.root, self.verify_hashes)
                found = (str(path), notes)
            except ValueError as e:
                found = str(e)
        found = broadcast_object(found)  # rank 0 decides, so every rank loads the same checkpoint
        if isinstance(found, str):
            raise ValueError(found)
        path, skipped = Path(found[0]), found[1]
        name = path.name
        blobs = read_blobs(path, ("meta", "loader", "progress"))
        meta = blobs["meta"]
        saved_shapes = {k[len("model."):]: tuple(md.size) for k, md in
                        FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
                        if k.startswith("model.") and hasattr(md, "size")}
        notes = check_config(meta["config"], self.state.config, self.allow_config, name, schema_defaults())
        check_model(saved_shapes, self.state.tensors()[0], name)
        notes += check_data(blobs["loader"]["fingerprint"], self.state.loader.dataset.fingerprint,
                            self.allow_data_change, name, meta["config"].get("data"), self.state.config.get("data"))
        step = blobs["progress"]["step"]
        if self._fresh and step >= self.last_step:
            raise RunComplete(self._complete_line(name, step))
        check_progress(step, self.last_step, name)
        notes += check_versions(meta["versions"], versions())
        if meta["world"] != self.dist.world:
            fresh = f"; ranks >= {meta['world']} have no saved RNG streams" if self.dist.world > meta["world"] else ""
            notes.append(f"resume: world size {meta['world']} -> {self.dist.world}; the data cursor continues at "
                         f"{blobs['loader']['samples_consumed']} samples consumed{fresh}")
        self._plan = (path, skipped, notes, meta)

    def resume(self) -> None:
        """Load the checkpoint `resume` names into the state, after checking it is the same run. First, what
        a killed save left behind is swept (one line each)."""
        if self.dist.is_main:
            for name in publish.clean_stale(self.root):
                self._note(f"checkpoint: removed {name}, left by an interrupted save")
        self.check_resume()
        if not self._plan:
            if self._fresh:
                self._start_fresh()
            return
        path, skipped, notes, meta = self._plan
        name = path.name
        for line in skipped:
            self._note(f"checkpoint: {line}")
        sched = self.state.scheduler
        configured, base = copy.copy(schedule_of(sched)), list(sched.base_lrs)  # the load overwrites both
        self.state.load(path, meta["world"], self.allow_data_change)
        # the checkpoint's LR schedule, unless a declared change moves it (check_config refused any other)
        lines, self._schedule = resumed(sched, configured, base, self.state.step,
                                        declared=any(": optim.schedule." in n for n in notes))
        notes += lines
        if self.dist.is_main:
            moved = supersede_records(self.run_dir / "metrics.jsonl", self.state.step)
            if moved:
                notes.append(f"resume: moved {moved} record(s) after step {self.state.step} "
                             f"to metrics.superseded.jsonl")
        self.ckpt_id, self.ckpt_path = name, path
        self._note(f"resumed from {path} (step {self.state.step}, {self.state.tokens} tokens)")
        for line in notes:
            self._note(line)

    def _auto(self) -> str | None:
        """resume=auto (a scheduler restarts a preempted job with the same command): the newest complete
        checkpoint under checkpoint.dir if there is one, else a fresh start. Says which, either way."""
        found = None
        if self.dist.is_main:
            try:
                found = str(publish.resolve(publish.LATEST, self.root, self.verify_hashes)[0])
            except ValueError:
                found = None
        found = broadcast_object(found)
        if found is not None:
            self._note(f"resume=auto: resuming from {found}")
            return publish.LATEST
        return None

    def _complete_line(self, name: str, step: int) -> str:
        """What resume=auto says when the newest checkpoint is the last one; the records may end one step
        short when the process died between the final save and its final record (the save comes first)."""
        metrics = self.run_dir / "metrics.jsonl"
        recorded = [r["step"] for r in read_records_partial(metrics)[0]] if metrics.exists() else []
        short = (f"; metrics.jsonl ends at step {max(recorded)} (the process stopped after the final save, "
                 f"before its last record)" if recorded and max(recorded) < step else "")
        return f"resume=auto: the run is complete: {name} is at step {step} = train.steps{short}; nothing to run"

    def _start_fresh(self) -> None:
        """resume=auto found nothing: what an earlier, killed attempt logged is not this run's story."""
        moved = supersede_records(self.run_dir / "metrics.jsonl", 0) if self.dist.is_main else 0
        self._note(f"resume=auto: no complete checkpoint under {self.root}; starting fresh"
                   + (f" (moved {moved} record(s) of an earlier attempt to metrics.superseded.jsonl)" if moved else ""))
        if self.dist.is_main and (self.run_dir / "events.jsonl").exists():
            ev = self.run_dir / "events.jsonl"
            ev.replace(ev.with_name("events.superseded.jsonl"))

    def load_before(self, max_step: int, skip_extras: tuple[str, ...] = ()) -> str | None:
        """Guard rollback from disk: load the newest complete checkpoint saved at step <= max_step.

        Waits for an in-flight async save first (it may be the very one we want). Returns its name, or
        None when there is none; the checks of resume() are not repeated: it is this run's own.
        """
        self.saver.wait()
        self._collect()
        self._raise_failed()
        found = None
        if self.dist.is_main:
            for step, path in sorted(publish.list_steps(self.root), reverse=True):
                if step <= max_step and publish.check(path, self.verify_hashes) is None:
                    found = str(path)
                    break
        found = broadcast_object(found)
        if found is None:
            return None
        path = Path(found)
        self.state.load(path, read_blobs(path, ("meta",))["meta"]["world"], allow_data_change=True,
                        skip_extras=skip_extras)
        if self._schedule is not None:  # a checkpoint from before this process's resume changed the schedule
            follow(self.state.scheduler, *self._schedule)
        return path.name

    def has_before(self, max_step: int) -> bool:
        """Is there a checkpoint directory at step <= max_step (complete or not: load_before checks)?"""
        return any(step <= max_step for step, _ in publish.list_steps(self.root))

    def due(self, step: int) -> bool:
        return step in (self.stop_after, self.deferred) or (
            self.every > 0 and (step % self.every == 0 or step == self.last_step))

    def maybe_save(self, step: int, tokens: int, healthy: bool = True) -> float:
        """The snapshot point. Returns the training stall in seconds (0 when no save is due).

        healthy=False (the guard fired on this step's state): a due save is withheld, so the last good
        checkpoint is never replaced by a suspect one.
        """
        self.state.step, self.state.tokens = step, tokens
        if not self.due(step):
            return 0.0
        if not healthy:
            self._note(f"checkpoint at step {step} withheld: the guard fired on this step; "
                       f"last complete: {self.ckpt_id}")
            if step == self.last_step:
                # NOTE: the run's last save must not vanish (resume=latest would find nothing, or an older
                # step): train one more step and save that, or say the run ends without one.
                if step >= self.steps:
                    self.saver.wait()  # name the newest complete one, async writes included
                    self._collect()
                    self._raise_failed()
                    raise FinalCheckpointWithheld(
                        f"checkpoint: the last step {step} (train.steps) was vetoed by the guard, so no final "
                        f"checkpoint was written; last complete: {self.ckpt_id or 'none'}")
                self.last_step = self.deferred = step + 1
                self._note(f"checkpoint: the last save moves to step {step + 1}, the next step (train.steps="
                           f"{self.steps} still bounds the run)")
            return 0.0
        return self._save(step, tokens)

    def _save(self, step: int, tokens: int) -> float:
        name = publish.step_name(step)
        info = {"name": name, "step": step, "tokens": tokens, "world": self.dist.world,
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.saver.wait()  # the previous write first: a failed one stops the run before another starts
        self._collect()
        self._raise_failed()
        stall = self._stall[name] = self.saver.save(name, self.state.state_dict(), info)
        self._collect()
        return stall

    def save_interrupted(self, step: int, tokens: int, healthy: bool) -> Path | None:
        """An interrupt at the boundary after `step`: that state saved and published (waited for), unless the
        guard fired on it (the last good checkpoint stands) or the snapshot point already saved it. Returns
        the newest complete checkpoint, or None when there is none."""
        on_disk = step in {s for s, _ in publish.list_steps(self.root)} if self.dist.is_main else None
        # NOTE: every rank takes the same decision (the save is a collective); rank 0 reads the directory
        if healthy and step > 0 and not self.due(step) and not broadcast_object(on_disk):
            self.state.step, self.state.tokens = step, tokens
            self._save(step, tokens)
        self.saver.wait()
        self._collect()
        self._raise_failed()
        return self.ckpt_path

    def _collect(self) -> None:
        for name, seconds, error in self.saver.finished():
            if error is None:
                self.ckpt_id, self.ckpt_path = name, self.root / name
                stall = self._stall.pop(name, seconds)
                self._note(f"checkpoint {name} published to {self.root} ({seconds:.2f} s" +
                           (f", training stalled {stall:.3f} s)" if stall < seconds else ")"))
            elif self._failed is None:
                self._failed = (name, error)
                if self.dist.world > 1:  # every rank stops at the same step: the next save (module docstring)
                    self._note(f"checkpoint {name} was not saved: {error.line}; the run stops at its next save")

    def _raise_failed(self) -> None:
        """A save that did not publish ends the run, once: CheckpointFailed naming it, its cause, and the last
        good checkpoint as checked now."""
        if self._failed is None or self._raised:
            return
        self._raised = True
        name, error = self._failed
        raise CheckpointFailed(f"checkpoint {name} was not saved: {error.line}; {self.last_good()}",
                               error.disk_full)

    def failure(self) -> CheckpointFailed | None:
        """After the run stopped on another error: wait for the write in flight; the failed save not yet
        reported (raised), if any."""
        self.saver.wait()
        self._collect()
        try:
            self._raise_failed()
        except CheckpointFailed as e:
            return e
        return None

    def last_good(self) -> str:
        """The newest checkpoint this run published or resumed from, checked now against its marker (the
        size and sha256 of every file): what a resume will load. Rank 0 reads; the others say nothing."""
        if self.ckpt_path is None:
            return "no earlier checkpoint of this run to resume from"
        if not self.dist.is_main:
            return f"the last good checkpoint is {self.ckpt_id}"
        reason = publish.check(self.ckpt_path, verify_hashes=True)
        if reason is None:
            return f"the last good checkpoint {self.ckpt_path} is intact (every file matches its marker)"
        return f"the last good checkpoint {self.ckpt_path} is damaged too: {reason}"

    def pop_events(self) -> list[str]:
        self._collect()
        if self.dist.world == 1:  # one process stops at once; a launch at its next wait (the module docstring)
            self._raise_failed()
        events, self._events = self._events, []
        return events

    def close(self) -> list[str]:
        """Wait for the last write (the run is not over until it is published); say and return what no step
        record took (the final save's line). Raises CheckpointFailed when a save did not publish."""
        self.saver.wait()
        self._collect()
        self._raise_failed()
        events = self.pop_events()
        if self.dist.is_main:
            for line in events:
                self.say(line)
        return events


def supersede_records(path: Path, step: int) -> int:
    """Keep metrics.jsonl the story of this run: records after the resumed step (replayed now) move
    to metrics.superseded.jsonl. Truncates in place, so an open append handle stays valid."""
    if not path.exists():
        return 0
    with open(path, "r+b") as f:
        keep_bytes, tail = 0, []
        for line in iter(f.readline, b""):
            if not tail and line.strip() and _step_of(line) <= step:
                keep_bytes = f.tell()
            elif line.strip():
                tail.append(line)  # NOTE: a torn last line (killed mid-write) goes too
        if tail:
            with open(path.with_name("metrics.superseded.jsonl"), "ab") as out:
                out.writelines(tail)
            f.truncate(keep_bytes)
    return len(tail)


def _step_of(line: bytes) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
