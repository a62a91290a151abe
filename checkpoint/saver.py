"""Sync or async save through the publish protocol, with one defined snapshot point.

The snapshot point is the call to `save`: async mode copies (stages) every tensor into private CPU
buffers before returning, so the optimizer step that follows cannot reach the checkpoint. The write,
the hashing and the publish run in one background thread; a new save first waits for the previous
one, and `close` waits for the last. The training stall is the staging copy, not the write.

Several ranks: every rank writes its own shard into the same temp directory (DCP plans the write
over a dedicated gloo group, so the background collectives never interleave with the training
step's), rank 0 marks and publishes, and an all-gather tells every rank whether it worked.

A save that fails is reported by `finished()` as a SaveError (checkpoint/failure.py: the cause in one line,
and whether the disk is full), whatever it raised: DCP's CheckpointException is a BaseException, so the
background thread catches BaseException, and its temp directory is removed. The caller decides what a
failure means (checkpoint/checkpointer.py: the run stops).
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
# WARN: private helpers, the ones DCP's own stagers use; if torch moves them, async save breaks loudly.
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from checkpoint import publish
from checkpoint.failure import SaveError, save_error

MODES = ("sync", "async")


class Saver:
    def __init__(self, root: Path, mode: str = "async", keep_last: int = 3, keep_every: int | None = None,
                 rank: int = 0, group=None):
        if mode not in MODES:
            raise ValueError(f"checkpoint.mode={mode}: expected one of {', '.join(MODES)}")
        self.root, self.mode, self.keep_last, self.keep_every = Path(root), mode, keep_last, keep_every
        self.rank, self.group = rank, group
        self._thread: threading.Thread | None = None
        self._done: list[tuple[str, float, SaveError | None]] = []  # (name, seconds, error or None)
        self._lock = threading.Lock()
        self._staged: dict | None = None  # CPU buffers reused by every async save

    def save(self, name: str, state_dict: dict, info: dict) -> float:
        """Snapshot `state_dict` now and write it as checkpoint `name`; return the stall in seconds."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight: its staged copy and its collectives are ours alone
        if self.mode == "sync":
            self._run(name, state_dict, info, t0)
            return time.perf_counter() - t0
        staged = self._stage(state_dict)  # the snapshot: a private CPU copy
        self._thread = threading.Thread(target=self._run, args=(name, staged, info, time.perf_counter()),
                                        name=f"ckpt-{name}", daemon=False)
        self._thread.start()
        return time.perf_counter() - t0

    @property
    def busy(self) -> bool:
        """True while a background write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finished(self) -> list[tuple[str, float, SaveError | None]]:
        """Saves that ended since the last call: (name, seconds, SaveError or None)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> list[tuple[str, float, SaveError | None]]:
        self.wait()
        return self.finished()

    def _stage(self, state_dict: dict) -> dict:
        """Copy every tensor (DTensor: this rank's shard) into CPU buffers kept between saves.

        NOTE: reusing the buffers is safe because `save` waited for the previous write, and it saves
        the page faults of fresh memory (the bulk of the stall on a first copy). Pinned on CUDA, so
        the device-to-host copy runs at full speed.
        """
        if self._staged is not None:
            try:
                return _copy_state_dict(state_dict, self._staged, type_check=False)
            except (KeyError, RuntimeError, ValueError, TypeError):  # the structure changed: new buffers
                pass
        self._staged = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._staged, type_check=False)

    def _write(self, tmp: Path, state_dict: dict) -> None:
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                 process_group=self.group)

    def _run(self, name: str, state_dict: dict, info: dict, t0: float) -> None:
        try:
            error = self._phases(name, state_dict, info)
        except BaseException as e:  # NOTE: whatever escaped the phases (a collective) still ends this save
            if _main_thread() and isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = save_error(e)
        with self._lock:
            self._done.append((name, time.perf_counter() - t0, error))

    def _phases(self, name: str, state_dict: dict, info: dict) -> SaveError | None:
        # WARN: every rank must make the same collective calls in the same order whatever fails, so
        # errors are caught per phase and agreed on, never raised past a collective.
        tmp = self.root / f".tmp-{name}"
        error = None
        if self.rank == 0:
            error = _attempt(lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True)))
        error = self._agree(error)
        need, free = _nbytes(state_dict), _free(self.root)  # free before this write: a larger one cannot fit
        if error is None:
            error = _attempt(lambda: self._write(tmp, state_dict), need, free)
            if error is None and self.rank == 0:
                error = _attempt(lambda: (publish.write_marker(tmp, info), publish.publish(tmp, self.root, name)),
                                 need, free)
            if error is None and self.rank == 0:
                prune_error = _attempt(lambda: publish.prune(self.root, self.keep_last, self.keep_every))
                if prune_error:  # the checkpoint is published; a failed clean-up only costs disk
                    print(f"checkpoint: retention failed after {name}: {prune_error.line}", flush=True)
        if error is not None and self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # NOTE: never the published directories
        return self._agree(error)

    def _agree(self, error: SaveError | None) -> SaveError | None:
        """Every rank learns whether rank 0 published (a rank-local error counts too)."""
        if self.group is None:
            return error
        errors = [None] * tdist.get_world_size(self.group)
        tdist.all_gather_object(errors, error, group=self.group)
        return next((SaveError(*e) for e in errors if e), None)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _nbytes(tree) -> int:
    """Bytes of the tensors and blobs of a state dict (a DTensor: this rank's shard): what the write needs."""
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    return len(tree) if isinstance(tree, (bytes, bytearray)) else 0


def _attempt(fn, need: int | None = None, free: int | None = None) -> SaveError | None:
    """Run fn; a SaveError if it raised anything (DCP raises BaseException subclasses), else None.
    In the main thread (checkpoint.mode=sync) an interrupt or an exit is not a failed save: it goes on up."""
    try:
        fn()
    except BaseException as e:  # NOTE: a failed save is reported, never raised here: the last good one stands
        if _main_thread() and isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return save_error(e, need, free)
    return None
