"""What went wrong with a write, in one line: the cause under DCP's wrapping, and whether the disk is full.

    try: write()
    except BaseException as e: err = save_error(e, need_bytes, free_bytes)   # SaveError(line, disk_full)

DCP reports a rank's failure as a CheckpointException (a BaseException, not an Exception) whose message is
every rank's traceback; and a disk that fills under torch.save's zip writer surfaces as "unexpected pos 704 vs
598", the ENOSPC itself swallowed. So the cause is dug out of the wrapping, and a full disk is also recognised
by its arithmetic: a checkpoint larger than the free space before the write cannot have fitted, whatever the
message says.
"""
from __future__ import annotations

import errno
from typing import NamedTuple

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # disk full, and a quota that is


class SaveError(NamedTuple):
    line: str        # the cause, one line
    disk_full: bool  # ENOSPC / EDQUOT, or a write larger than the free space: a distinct exit status


def causes(exc: BaseException):
    """exc, then what it wraps: DCP's per-rank failures, then each __cause__ / __context__, outermost first."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
        todo += [e.__cause__, e.__context__]


def is_disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in NO_SPACE for e in causes(exc))


def one_line(exc: BaseException) -> str:
    """The innermost cause worth naming: an OSError if there is one (it names the errno and the file), else the
    first exception that is not DCP's wrapper; its message's first line."""
    chain = list(causes(exc))
    e = next((c for c in chain if isinstance(c, OSError)), None) or next(
        (c for c in chain if not hasattr(c, "failures")), exc)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].strip()}" if text else type(e).__name__


def mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def save_error(exc: BaseException, need_bytes: int | None = None, free_bytes: int | None = None) -> SaveError:
    """SaveError of a failed write; need/free (bytes this write needed, bytes free before it) recognise a full
    disk that the error itself does not name."""
    line = one_line(exc)
    full = is_disk_full(exc)
    short = need_bytes is not None and free_bytes is not None and need_bytes > free_bytes
    if full or short:
        room = f" ({mb(free_bytes)} free before the write, it needs {mb(need_bytes)})" if short else ""
        return SaveError(f"disk full{room}: {line}", True)
    return SaveError(line, False)
