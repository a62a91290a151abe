"""The run's life around the loop: one writer per run directory, an interrupt that saves, a start that fails
leaving nothing behind, a write that fails (a full disk) said in one line, and the exit statuses that say which.

    with RunDir(run_dir, dist) as owner, Interrupts(dist) as stop:   # train.py job()
        run = build_run(cfg, dist)
        owner.started()           # from here the directory is the run's, whatever happens
        ... at each step boundary: if stop.agreed(): save, say so, exit Exit.INTERRUPTED

A run directory has one owner, as a database's data directory does (PostgreSQL's postmaster.pid): rank 0
takes an advisory lock (flock) on <run dir>/run.lock before anything is written and holds it for the run's
whole life; the other ranks of the launch wait for its answer. The kernel drops the lock when its holder
dies, so a stale file from a killed run never blocks the next start. Readers (the doctor, sample, export,
checkpoint.verify) take no lock: they work on a live run.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
from enum import IntEnum
from pathlib import Path

import torch

from checkpoint.checkpointer import CheckpointFailed
from checkpoint.failure import is_disk_full, one_line
from checkpoint.publish import step_name
from parallel.dist import Dist, all_gather_object, all_reduce_max, broadcast_object
from run.argv import without

LOCK_NAME = "run.lock"


class Exit(IntEnum):
    """train.py's exit statuses: a scheduler or a script tells the outcomes apart by these alone."""
    OK = 0
    START = 2         # the run cannot start: a config, data or resume problem, an unwritable directory
    GUARD = 3         # the guard gave up, or the last step was vetoed (the last good checkpoint stands)
    BUSY = 4          # another live process owns the run directory
    NO_SPACE = 5      # the disk filled (ENOSPC, EDQUOT): at the start, in a save, writing the records; free space, resume
    IO = 74           # EX_IOERR: a checkpoint or a record could not be written for another reason (permission, I/O)
    INTERRUPTED = 75  # EX_TEMPFAIL: stopped by SIGINT/SIGTERM at a step boundary and saved; resume=auto goes on
    ABORTED = 130     # a second interrupt, or one before the run began (run/startup.py): out at once (128 + SIGINT)


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory's lock."""


class CannotStart(RuntimeError):
    """The run directory cannot be taken (e.g. not writable, or the disk is full)."""

    def __init__(self, line: str, disk_full: bool = False):
        super().__init__(line)
        self.exit = Exit.NO_SPACE if disk_full else Exit.START


class RunDir:
    """Rank 0 holds <run_dir>/run.lock for the run's life; a start that fails removes what it created.

    A second writer is refused in one line naming the holder and touches nothing: the holder created the
    lock file, the refused process only opens and reads it.
    """

    def __init__(self, run_dir: Path, dist: Dist):
        self.dir, self.dist = Path(run_dir), dist
        self.path = self.dir / LOCK_NAME
        self.fd: int | None = None
        self.running = False
        self.previous: dict | None = None  # the stale holder a dead process left, if any
        self.new: Path | bool | None = None  # the topmost directory this launch made (note_new_dirs)

    def __enter__(self) -> "RunDir":
        answer = None
        if self.dist.is_main:
            try:
                self._acquire()
            except RunDirBusy as e:
                answer = (type(e).__name__, str(e), False)
            except OSError as e:
                full = is_disk_full(e)
                answer = (type(e).__name__, f"disk full: {e}; free space on that filesystem, then rerun" if full
                          else str(e), full)
        answer = broadcast_object(answer)  # every rank of the launch goes on or stops together
        # the first rank to make the directory saw it missing: the union of what the ranks saw is what to remove
        self.new = topmost(all_gather_object(_NEW[0]))
        if answer is not None:
            kind, line, full = answer
            if kind == RunDirBusy.__name__:
                raise RunDirBusy(line)
            remove_if_empty(self.dir, self.new)
            raise CannotStart(f"cannot start: {line}", full)
        if self.previous and self.dist.is_main:
            print(f"run dir {self.dir}: the lock of {_holder(self.previous)} was released when it exited; "
                  f"taking it over", flush=True)
        return self

    def _acquire(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)  # Hydra made it; a Python caller may not have
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise RunDirBusy(f"{self.dir} is in use by {_holder(holder)}; wait for it to end, or pick another "
                                 f"hydra.run.dir") from None
            # NOTE: the holder unlinks the file as it releases it; a lock won on that unlinked inode is no lock
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.previous = _read(fd) or None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "launch": os.environ.get("TORCHELASTIC_RUN_ID"),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:]}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError as e:  # a full disk: a start that cannot run leaves no lock (the file is ours: we hold it)
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self.fd = fd

    def started(self) -> None:
        """The run is built: from here its directory stays, whatever happens next."""
        self.running = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before the release: the next owner creates its own (_acquire)
            os.close(self.fd)
            self.fd = None
        if not self.running:  # the start failed (or found the run complete): leave what was there, only that
            remove_if_empty(self.dir, self.new)


_NEW: list[Path | bool | None] = [None]  # the topmost directory this start will create (note_new_dirs)
_RUN_DIR: list[Path | None] = [None]      # ... and the run directory itself


def note_new_dirs(run_dir: Path | None) -> None:
    """Before Hydra makes the run directory (mkdir -p): the topmost part of it that does not exist yet, which
    a failed start removes again; False when it all exists (a failed start removes nothing: an empty directory
    the user made stays). Unknown (None) → only the run directory itself, when empty."""
    _RUN_DIR[0] = run_dir
    if run_dir is None:
        _NEW[0] = None
        return
    missing = [p for p in [run_dir, *run_dir.parents] if not p.exists()]
    _NEW[0] = missing[-1] if missing else False


def topmost(seen: list) -> Path | bool | None:
    """What a launch made, from what each rank noted: the first rank to make the directory saw it missing."""
    made = [p for p in seen if isinstance(p, Path)]
    if made:
        return min(made, key=lambda p: len(p.parts))
    return False if any(p is False for p in seen) else None


def remove_new_dirs() -> None:
    """An interrupt before the run began: what this start made, while still empty (run/startup.py)."""
    if isinstance(_NEW[0], Path) and _RUN_DIR[0] is not None:
        remove_if_empty(_RUN_DIR[0], _NEW[0])


def before_hydra(argv: list[str], config_dir: str) -> None:
    """The command line checked before @hydra.main runs (run/config.py preflight): a bad key or value, a run
    directory that cannot be made, a device this machine lacks: one line (rank 0's, under torchrun: every rank
    fails the same way) and exit 2, or 5 for a full disk, before anything is written."""
    from run.config import preflight
    from run.config_errors import ConfigError

    try:
        note_new_dirs(preflight(argv, config_dir))
        return
    except ConfigError as e:
        line, code = f"ballast: config error: {e}", Exit.START
    except OSError as e:
        line, code = start_failed(e)
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def remove_if_empty(path: Path, top: Path | bool | None) -> None:
    """A start that failed leaves no directory: the run dir and the parents this start made for it, each
    only while empty. top=False: the start made none of them."""
    if top is False:
        return
    path = path.absolute()
    stop = top.absolute() if top is not None and (top == path or top in path.parents) else path
    for p in [path, *path.parents]:
        try:
            p.rmdir()
        except FileNotFoundError:  # another rank of the launch removed it first
            pass
        except OSError:  # not empty: someone's files
            return
        if p == stop:
            return


def _holder(h: dict) -> str:
    launch = f"launch {h['launch']}, " if h.get("launch") else ""
    return f"pid {h.get('pid')} on {h.get('host')} ({launch}since {h.get('started')})"


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except ValueError:
        return {}


class Interrupts:
    """SIGINT and SIGTERM ask the loop to stop at the next step boundary, where it saves; a second signal exits
    at once.

    NOTE: under torchrun a Ctrl-C reaches every process of the terminal's group, and torchrun then sends its
    workers SIGTERM (and SIGKILL 30 s later): a SIGTERM after a SIGINT is that forwarding, not a second ask.
    """

    def __init__(self, dist: Dist):
        self.dist = dist
        self.signum = 0
        self._heard: int | None = None  # the signal the last step agreed on (a launch)
        self._old: dict = {}

    def __enter__(self) -> "Interrupts":
        if _main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGTERM:
            return  # torchrun forwarding the Ctrl-C its workers already received
        if self.signum:
            _say(self.dist, f"ballast: {signal.Signals(signum).name} again: exiting now; the checkpoints on disk "
                            f"are whole (an unfinished save is never published)")
            os._exit(Exit.ABORTED)
        self.signum = signum
        again = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        # NOTE: os.write, not print: a handler that prints while the loop is printing raises "reentrant call"
        _say(self.dist, f"ballast: {signal.Signals(signum).name}: stopping at the end of this step, then saving "
                        f"({again} again to exit at once)")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def agreed(self) -> bool:
        """Has any rank been asked to stop? Every rank answers the same at the same boundary: the save is a
        collective. One process: the flag alone; a launch: the flag as the step before agreed it (tensors(),
        heard()), or one max-reduce of it where no step did (the first boundary)."""
        if self.dist.world == 1:
            return bool(self.signum)
        agreed = self._heard
        if agreed is None:
            flag = torch.tensor([float(self.signum)], device=self.dist.device)
            agreed = int(all_reduce_max(flag).item())
        self._heard = None
        # NOTE: a signal that came after the step's reduction is this rank's alone so far: kept, it rides the
        # next step's reduction and stops the run at the boundary after that step
        self.signum = agreed or self.signum
        return bool(agreed)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The step's share of the interrupt check (a launch only): this rank's signal, MAX-reduced over the
        ranks on the device; the step reads it with its other numbers and passes them to heard()."""
        if self.dist.world == 1:
            return {}
        return {"signal": all_reduce_max(torch.full((), float(self.signum), device=self.dist.device))}

    def heard(self, host) -> None:
        """The agreed signal from the host's copy of tensors() (a mapping name -> numbers)."""
        if "signal" in host:
            self._heard = int(host["signal"])


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _say(dist: Dist, line: str) -> None:
    if dist.is_main:
        os.write(2, (line + "\n").encode())


def resume_command(run_dir: Path, argv: list[str]) -> str:
    """The command that continues this run where it stopped: the same overrides, its directory pinned (a
    relaunch under torchrun gets a new launch id, hence a new default directory), resume=auto."""
    keep = without(argv, ("resume", "hydra.run.dir"))
    launcher = "torchrun <the same options> train.py" if os.environ.get("TORCHELASTIC_RUN_ID") else "python train.py"
    return " ".join([launcher, *keep, f"hydra.run.dir={run_dir}", "resume=auto"])


class Interrupted(RuntimeError):
    """The loop stopped at a step boundary on a signal; the message says where it saved and how to go on."""

    @classmethod
    def at(cls, stop: Interrupts, step: int, saved: Path | None, run_dir: Path) -> "Interrupted":
        where = (f"saved {saved}" if saved is not None and saved.name == step_name(step) else
                 f"the newest complete checkpoint is {saved} (this step's state was not saved: the guard acted on "
                 f"it)" if saved is not None else "no checkpoint to continue from (nothing was saved)")
        go_on = f"; continue with: {resume_command(run_dir, sys.argv[1:])}" if saved is not None else ""
        return cls(f"{stop.name} after step {step}: {where}{go_on}")


def start_failed(error: OSError) -> tuple[str, Exit]:
    """One line and the exit status of a start that could not write (an unwritable directory, a full disk)."""
    full = is_disk_full(error)
    if full:
        return f"ballast: cannot start: disk full: {error}; free space on that filesystem, then rerun", Exit.NO_SPACE
    return f"ballast: cannot start: {error}", Exit.START


def write_failed(error: BaseException, ckpt) -> tuple[str, Exit]:
    """One line and the exit status of a run stopped by a write that failed: a save that did not publish
    (CheckpointFailed), or an OSError while training or writing the records, events or plot (then the save in
    flight is waited for, and the last good checkpoint checked against its marker). A full disk has its own
    status: free space, then the same resume=auto command continues from the last good checkpoint."""
    if isinstance(error, CheckpointFailed):
        line, full = str(error), error.disk_full
    else:
        full = is_disk_full(error)
        saved = ckpt.failure()
        line = (f"{'disk full' if full else 'cannot write'} after step {ckpt.state.step}: {one_line(error)}; "
                + (str(saved) if saved else ckpt.last_good()))
        full = full or bool(saved and saved.disk_full)
    fix = "free space on that filesystem" if full else "fix that"
    return (f"ballast: {line}; {fix}, then continue with: {resume_command(ckpt.run_dir, sys.argv[1:])}",
            Exit.NO_SPACE if full else Exit.IO)


def say(dist: Dist, line: str, code: Exit) -> Exit:
    """One line on rank 0 (every rank of a launch fails the same way: torchrun names the ranks that exited)."""
    if dist.is_main:
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
    return code
