"""train.py with its writes failing from one call on, as a disk that fills or a broken store fails them
(tests/test_write_failures.py): the fault is injected where the write happens, everything else is train.py.

    python tests/inject_train.py PHASE AT [train.py overrides...]
    torchrun --nproc_per_node=2 tests/inject_train.py PHASE AT ...   # INJECT_RANKS=1: rank 1's writes only

PHASE   the write that fails, from its AT-th call on (1-based; a full disk stays full):
  lock       the run.lock record (os.pwrite), at the start
  header     config.yaml (its fsync in checkpoint.publish.write_atomic), at the start
  save       a checkpoint's tensor files, inside DCP's writer (half a tensor, then ENOSPC; DCP re-raises it on
             every rank as its CheckpointException, a BaseException)
  save_io    the same with EIO (an I/O error, not a full disk)
  save_base  a save that raises a BaseException of its own before DCP (Saver._write), its cause an I/O error
  marker     a checkpoint's marker.json (publish.write_marker), after its files were written
  records    a line of metrics.jsonl
"""
from __future__ import annotations

import errno
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)
PHASE, AT = sys.argv[1], int(sys.argv[2])
sys.argv = ["train.py", *sys.argv[3:]]
calls = [0]


RANKS = os.environ.get("INJECT_RANKS")  # e.g. "1": only rank 1's writes fail (under torchrun); unset: every rank


def failing() -> bool:
    calls[0] += 1
    return calls[0] >= AT and (RANKS is None or os.environ.get("RANK", "0") in RANKS.split(","))


def full(path="") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(path)] if path else []))


class CheckpointException(BaseException):
    """torch.distributed.checkpoint's wrapper of a rank's failure: not an Exception; the cause in `failures`."""

    def __init__(self, cause: BaseException):
        super().__init__("CheckpointException ranks:dict_keys([0])\nTraceback (most recent call last): (RANK 0)")
        self.failures = {0: (cause, None)}


if PHASE == "lock":
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if failing():
            raise full()
        return real_pwrite(fd, data, offset)

    os.pwrite = pwrite
elif PHASE == "header":
    real_fsync = os.fsync

    def fsync(fd):  # NOTE: where a filesystem with delayed allocation reports ENOSPC: the data is written
        path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if path.endswith("/.config.yaml.tmp") and failing():
            raise full(path)
        return real_fsync(fd)

    os.fsync = fsync
elif PHASE in ("save", "save_io"):
    import torch.distributed.checkpoint.filesystem as dcp_files

    real_item, saves, failed = dcp_files._write_item, set(), set()

    def _write_item(transforms, stream, *args, **kwargs):  # NOTE: inside DCP, which wraps what it raises
        save = Path(getattr(stream, "name", "")).parent.name  # .tmp-step_000004: one save, several items
        if save not in saves:
            saves.add(save)
            if failing():  # counts saves, not items
                failed.add(save)
        if save in failed:
            stream.write(b"half a tensor")
            raise full(stream.name) if PHASE == "save" else OSError(errno.EIO, os.strerror(errno.EIO), stream.name)
        return real_item(transforms, stream, *args, **kwargs)

    dcp_files._write_item = _write_item
elif PHASE == "save_base":
    from checkpoint.saver import Saver

    real_write = Saver._write

    def _write(self, tmp, state_dict):
        if not failing():
            return real_write(self, tmp, state_dict)
        (Path(tmp) / "__0_0.distcp").write_bytes(b"half a shard")
        raise CheckpointException(OSError(errno.EIO, os.strerror(errno.EIO)))

    Saver._write = _write
elif PHASE == "marker":
    from checkpoint import publish

    real_marker = publish.write_marker

    def write_marker(tmp, info):
        if failing():
            raise full(Path(tmp) / publish.MARKER)
        return real_marker(tmp, info)

    publish.write_marker = write_marker
elif PHASE == "records":
    from stability import sinks

    class FullFile:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            if failing():
                self.f.write(text[: len(text) // 2])  # a torn line, as a full disk leaves it
                raise full()
            return self.f.write(text)

        def close(self):
            self.f.close()

    real_init = sinks.JsonlSink.__init__

    def __init__(self, path):
        real_init(self, path)
        self.f = FullFile(self.f)

    sinks.JsonlSink.__init__ = __init__
else:
    sys.exit(f"inject_train: unknown phase {PHASE}")

runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
